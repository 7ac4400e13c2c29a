"""A tiny random Llama written as a GGUF file by the gguf package, with a byte-level BPE tokenizer and a chat template
in its metadata: what transformers' GGUF loader reads, built in a test in milliseconds (no download)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0 (pad), 1 (BOS), 2 (EOS)


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: byte b as the printable character the BPE tokenizer writes it with."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b], extra = chr(256 + extra), extra + 1
    return [out[b] for b in range(256)]


def write_gguf(path: Path, layers: int = 2, width: int = 32, heads: int = 2, kv: int = 1, ff: int = 64,
               seed: int = 0, arch: str = "llama", init: float = 0.3) -> Path:
    """A random `layers` x `width` Llama (grouped-query attention, tied embeddings, float32 tensors) at path; arch
    names the architecture its metadata claims."""
    import gguf

    rng = np.random.default_rng(seed)
    merges = ["d e", "Ġ r"]
    tokens = SPECIAL + byte_alphabet() + [m.replace(" ", "") for m in merges]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(width)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(width // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHAT)

    def t(*shape):
        return (rng.standard_normal(shape) * init).astype(np.float32)

    hd = width // heads
    w.add_tensor("token_embd.weight", t(len(tokens), width))
    for i in range(layers):
        for name, shape in (("attn_q", (width, width)), ("attn_k", (kv * hd, width)), ("attn_v", (kv * hd, width)),
                            ("attn_output", (width, width)), ("ffn_gate", (ff, width)), ("ffn_up", (ff, width)),
                            ("ffn_down", (width, ff))):
            w.add_tensor(f"blk.{i}.{name}.weight", t(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(width, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(width, np.float32))
    w.add_tensor("output_norm.weight", np.ones(width, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
