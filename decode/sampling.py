"""The sampling transform (temperature, top-k, top-p) shared by data_gen and decode.

p and q are always compared after the same transform, so the labels a head learns from and
the decisions decode makes describe one and the same pair of distributions.
"""

from __future__ import annotations

import torch

from decode.pair import Sampling


def transform(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """(..., V) logits -> (..., V) probabilities under temperature, top-k and top-p.

    Temperature 0 gives the one-hot argmax (greedy decoding as a distribution).
    """
    logits = logits.float()
    if s.temperature == 0:  # scatter into zeros: no (..., V) int64 one_hot and no copy to float
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / s.temperature
    if 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= s.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """(..., V) probabilities -> (...) token ids, one draw per row from `generator`."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
