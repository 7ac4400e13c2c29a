"""Tiny random-weight draft/target pairs of every model family the project serves, built from configs.

    write_arch_pair(tmp_path, "mistral", dtype="bfloat16") -> path of a pair YAML

Each pair shares a character-level tokenizer the way real instruct checkpoints ship one: a chat
template, a BOS the tokenizer prepends, and two EOS ids in the generation config (end of text and
end of turn, as Llama-3.1-Instruct and Qwen-Instruct have). Sliding windows are 8 tokens, so any
prompt of the tests is longer than the window. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

BOS, EOS, EOT = "<bos>", "<eos>", "<eot>"
CHARS = list("abcdefghu ():=\n0123456789")
# The turn markers are plain characters, the end of a turn is the second EOS.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<eot>{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")
WINDOW = 8

# family -> (config class name, model class name, extra config fields); draft and target differ in depth.
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_positions": 128}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2, "sliding_window": WINDOW}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"num_key_value_heads": 2, "sliding_window": WINDOW}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"num_key_value_heads": 2, "sliding_window": WINDOW, "head_dim": 8,
                                                     "query_pre_attn_scalar": 8, "initializer_range": 0.05}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"num_key_value_heads": 2, "sliding_window": WINDOW,
                                                         "head_dim": 8, "query_pre_attn_scalar": 8, "initializer_range": 0.05}),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "gpt-neo": ("GPTNeoConfig", "GPTNeoForCausalLM", {"window_size": WINDOW}),
}
# Embedding rows beyond the tokenizer (draft, target): Qwen pads its lm_head, and differently per size.
PAD_ROWS = {"qwen2": (8, 24)}


def chat_tokenizer():
    """PreTrainedTokenizerFast: one token per character, <bos> prepended, <eos> and <eot>, a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {BOS: 0, EOS: 1, EOT: 2} | {c: i + 3 for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=EOS, pad_token=EOS,
                                  additional_special_tokens=[EOT])
    out.chat_template = CHAT_TEMPLATE
    return out


def _layers(family: str, layers: int) -> dict:
    """Depth fields, and for hybrid families a layer pattern that holds both kinds of attention."""
    if family == "gpt2":
        return {"n_layer": layers}
    if family == "gpt-neo":
        kinds = (["local", "global"] * layers)[:layers]  # local attention is GPT-Neo's sliding window
        return {"num_layers": layers, "attention_types": [[kinds, 1]]}
    fields = {"num_hidden_layers": layers}
    if family in ("gemma2", "gemma3"):
        fields["layer_types"] = (["sliding_attention", "full_attention"] * layers)[:layers]
    return fields


def tiny_arch(family: str, vocab: int, layers: int, seed: int, dtype: str = "float32"):
    """A random model of `family` with `vocab` embedding rows, peaked logits (large init), eval mode."""
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    width = {"n_embd": 32, "n_head": 4} if family == "gpt2" else \
        {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64}
    if family == "gpt-neo":
        width = {"hidden_size": 32, "num_heads": 4, "intermediate_size": 64}
    special = {"bos_token_id": 0, "eos_token_id": [1, 2], "pad_token_id": 1}
    # Gemma scales its tied embeddings by sqrt(width) and soft-caps the logits: a large init saturates the cap
    extra = {"initializer_range": 0.4} | extra
    cfg = getattr(transformers, cfg_name)(vocab_size=vocab, max_position_embeddings=128, **width,
                                          **_layers(family, layers), **extra, **special)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).to(getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = [1, 2]
    model.generation_config.bos_token_id = 0
    model.generation_config.pad_token_id = 1
    return model


def write_arch_pair(root: Path, family: str, dtype: str = "float32", seed: int = 0, **sampling) -> Path:
    """Save a tiny pair of `family` (draft 1 layer, target 2) as HF folders and return its pair YAML."""
    tok = chat_tokenizer()
    pads = PAD_ROWS.get(family, (0, 0))
    draft = tiny_arch(family, len(tok) + pads[0], layers=1, seed=seed + 1, dtype=dtype)
    target = tiny_arch(family, len(tok) + pads[1], layers=2, seed=seed + 2, dtype=dtype)
    # The draft shares the target's embeddings, first layer and head, so that it agrees with the target often
    # enough for rounds that accept everything (and the caches' paths behind them) to happen.
    shared = {k: v for k, v in target.state_dict().items() if k in draft.state_dict()
              and draft.state_dict()[k].shape == v.shape}
    draft.load_state_dict(shared, strict=False)
    with torch.no_grad():  # ... and not always: its layers are the target's with noise
        g = torch.Generator().manual_seed(seed)
        for name, w in draft.named_parameters():
            if w.dim() == 2 and "embed" not in name and "wte" not in name and "lm_head" not in name:
                w.add_(0.3 * w.float().std() * torch.randn(w.shape, generator=g).to(w.dtype))
    with torch.no_grad():  # padding rows of a real checkpoint were never trained: near zero, never the argmax
        for model in (draft, target):
            model.get_output_embeddings().weight[len(tok):] = 0.0
    root = Path(root)
    for name, model in (("draft", draft), ("target", target)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    cfg = {"name": f"tiny-{family}", "draft": {"path": str(root / "draft"), "dtype": dtype},
           "target": {"path": str(root / "target"), "dtype": dtype}, "chat_template": True,
           "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, **sampling}, "max_context": 128}
    path = root / "pair.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
