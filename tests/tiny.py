"""A tiny random draft/target pair built in-process in about a second, for unit tests.

Character-level tokenizer over a small alphabet (V = 24), GPT-2 models with a large
initialisation scale so that p and q are peaked and clearly different from each other.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from lightning.pytorch.callbacks import Callback

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


def write_tiny_pair(root: Path, seed: int = 0, draft_alphabet: list[str] = ALPHABET, pad_rows: int = 8,
                    **sampling) -> Path:
    """Save a tiny pair as HF folders under root and return the path of its pair YAML."""
    tok_d, tok_t = tiny_tokenizer(draft_alphabet), tiny_tokenizer()
    draft = tiny_model(len(tok_d), layers=1, width=32, seed=seed + 1)
    target = tiny_model(len(tok_t), layers=2, width=32, seed=seed + 2, pad_rows=pad_rows)
    for name, model, tok in (("draft", draft, tok_d), ("target", target, tok_t)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    cfg = {"name": "tiny", "draft": {"path": str(root / "draft")}, "target": {"path": str(root / "target")},
           "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **sampling}, "max_context": 128}
    path = root / "pair.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def write_tiny_labels(root: Path, pair_yaml: Path, n_train: int = 48, n_dev: int = 24, max_new: int = 16,
                      kinds: tuple[str, ...] = ("mixed", "draft", "target", "prompt"), siblings: int = 0) -> Path:
    """A label set of the tiny pair (splits train and dev, sequences of `kinds` in turn, `siblings` labelled per
    position) and the data_gen config that names it."""
    from data_gen.generate import Mixing, label_batch
    from data_gen.store import claim_output, write_shard
    from decode.pair import load_pair

    pair = load_pair(pair_yaml)
    out = root / "labels" / pair.config.sampling.name
    claim_output(out, {"pair": "tiny", "pair_hash": pair.config.hash(), "draft": pair.identity("draft"),
                       "target": pair.identity("target"), "sampling": vars(pair.config.sampling), "seed": 0,
                       "mixing": {"r": 0.15}, "max_new_tokens": max_new} | ({"siblings": siblings} if siblings else {}))
    for split, n in (("train", n_train), ("dev", n_dev)):
        prompts = [[1 + (i * 5 + j) % 22 for j in range(2 + i % 6)] for i in range(n)]
        kinds_ = [kinds[i % len(kinds)] for i in range(n)]
        recs, feats = label_batch(pair, prompts, [f"{split}{i}" for i in range(n)], kinds_, Mixing(), 0, max_new,
                                  siblings=siblings)
        write_shard(out, split, recs, feats, rank=0)
    cfg = root / "data_gen.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"pair": str(pair_yaml), "output": str(out.parent), "max_new_tokens": max_new}}))
    return cfg



class SlowEpochs(Callback):
    """Pauses after each training epoch, so that a test can signal a run in the middle of fit."""

    def __init__(self, seconds: float = 1.5):
        self.seconds = seconds

    def on_train_epoch_end(self, trainer, pl_module):
        import time

        time.sleep(self.seconds)
