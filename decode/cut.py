"""A draft whose output layer scores only the tokens its target uses most (frequency-ranked drafting, FR-Spec).

A small draft sharing a large vocabulary spends most of its step in its output layer: SmolLM2's 49,152 x 576
matrix is 28M weights against 3.5M in one of its layers, and at one token on a CPU that product is most of a
two-layer draft's step (docs/smollm2.md, "A cut vocabulary"). The target's own answers use a few thousand tokens
for nearly all positions, so the draft scores those alone and gives every other token probability 0.

Lossless decoding keeps the target's law with any draft distribution, this one too: a token the draft cannot
propose comes from the residual max(0, p - q) when the target rejects, or from the bonus token. Greedy output is
the target's whatever the draft proposes. What a cut costs is acceptance, where the target's token falls outside.

A pair names the file in its draft's spec (`head_tokens:`, decode.pair.ModelSpec); `python -m train.distill
--config RECIPE --head-tokens N` writes one from the target's stored answers.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F


class CutHead(torch.nn.Module):
    """An output layer scoring `ids` only: (B, T, H) hidden -> (B, T, V) logits, -inf at every other token.

    `weight` stays the full (V, H) matrix (tied to the input embeddings where the model ties them), so what reads a
    model's output width, dtype or device reads the same; `rows` is its copy at `ids`, the product's only operand.
    """

    def __init__(self, full: torch.nn.Module, ids: torch.Tensor):
        super().__init__()
        self.weight = full.weight
        self.bias = None
        self.register_buffer("ids", ids.to(self.weight.device))
        # A parameter, not a buffer, so the weights digest (decode.pair.weights_digest) tells a cut draft apart
        self.rows = torch.nn.Parameter(self.weight.detach()[self.ids].clone(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        got = F.linear(hidden, self.rows)  # (under autocast, in its dtype: the full logits take the same)
        return got.new_full((*got.shape[:-1], self.weight.shape[0]), float("-inf")).index_copy_(-1, self.ids, got)


def cut_head(model, ids: torch.Tensor):
    """Replace a causal LM's output layer by a CutHead over `ids`, in place; returns the model."""
    model.set_output_embeddings(CutHead(model.get_output_embeddings(), ids))
    return model


def read_tokens(path: Path, vocab: int) -> torch.Tensor:
    """The token ids a head_tokens file lists -> (N,) int64, or a one-line ValueError naming the file."""
    fix = "write it again with python -m train.distill --config RECIPE --head-tokens N"
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"head_tokens file {path} is not there: {fix}, or drop head_tokens from the draft's spec") \
            from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"head_tokens file {path} cannot be read ({' '.join(str(e).split())[:120]}): {fix}") from None
    ids = raw.get("tokens") if isinstance(raw, dict) else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"head_tokens file {path} holds no list of token ids under 'tokens': {fix}")
    if len(set(ids)) != len(ids) or not all(0 <= i < vocab for i in ids):
        raise ValueError(f"head_tokens file {path} lists repeated ids or ids outside this model's {vocab} tokens: it "
                         f"was written for another vocabulary; {fix}")
    return torch.tensor(ids, dtype=torch.long)


def rank_tokens(answers: list[list[int]], top: int, keep: tuple[int, ...] = ()) -> dict:
    """The `keep` tokens (e.g. EOS), then the most frequent in `answers`, `top` in all, with the share of answer
    positions they cover: what a head_tokens file holds."""
    counts = Counter(t for a in answers for t in a)
    ranked = list(dict.fromkeys([*keep, *(t for t, _ in counts.most_common())]))[:top]
    total = sum(counts.values())
    covered = sum(counts[t] for t in ranked) / max(total, 1)
    return {"tokens": ranked, "positions": total, "distinct": len(counts), "covered": round(covered, 6)}
