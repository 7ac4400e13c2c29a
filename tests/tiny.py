"""A tiny random draft/target pair built in-process in about a second, for unit tests.

Character-level tokenizer over a small alphabet (V = 24), GPT-2 models with a large
initialisation scale so that p and q are peaked and clearly different from each other.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

ALPHABET = list("abcdefgh ():=\n0123456789")[:23]
EOS = "<eos>"


def tiny_tokenizer(alphabet: list[str] = ALPHABET):
    """PreTrainedTokenizerFast with one token per character plus <eos> (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0} | {c: i + 1 for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=EOS)


def tiny_model(vocab: int, layers: int, width: int, seed: int, init: float = 0.4, pad_rows: int = 0):
    """Random GPT-2 with `vocab + pad_rows` embedding rows (padding rows mimic real checkpoints)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab + pad_rows, n_positions=128, n_embd=width, n_layer=layers, n_head=2,
                     initializer_range=init, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def write_tiny_pair(root: Path, seed: int = 0, draft_alphabet: list[str] = ALPHABET, **sampling) -> Path:
    """Save a tiny pair as HF folders under root and return the path of its pair YAML."""
    tok_d, tok_t = tiny_tokenizer(draft_alphabet), tiny_tokenizer()
    draft = tiny_model(len(tok_d), layers=1, width=32, seed=seed + 1)
    target = tiny_model(len(tok_t), layers=2, width=32, seed=seed + 2, pad_rows=8)
    for name, model, tok in (("draft", draft, tok_d), ("target", target, tok_t)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    cfg = {"name": "tiny", "draft": {"path": str(root / "draft")}, "target": {"path": str(root / "target")},
           "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **sampling}, "max_context": 128}
    path = root / "pair.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
