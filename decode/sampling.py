"""The sampling transform (temperature, top-k, top-p) shared by data_gen and decode.

p and q are always compared after the same transform, so the labels a head learns from and
the decisions decode makes describe one and the same pair of distributions.
"""

from __future__ import annotations

import numpy as np
import torch

from decode.pair import Sampling
from decode.streams import Streams


def transform(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """(..., V) logits -> (..., V) probabilities under temperature, top-k and top-p.

    Temperature 0 gives the one-hot argmax (greedy decoding as a distribution).
    """
    logits = logits.float()
    if s.temperature == 0:
        return one_hot_at(argmax(logits), logits)
    if s.temperature != 1.0:  # x / 1 == x: skip a pass over (..., V) (6.3M values per labelled batch)
        logits = logits / s.temperature
    if 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        logits = logits.masked_fill(~nucleus(logits.softmax(-1), s.top_p), float("-inf"))
    return logits.softmax(-1)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) int64 index of the first maximum of each row, as torch.argmax(-1) gives.

    On the CPU numpy's argmax over the last dimension is several times faster than torch's on decoding's small
    tensors (docs/engine.md, "Measured fast paths"), and a greedy round takes it once per candidate and once over
    the k + 1 verified rows.
    """
    if x.device.type != "cpu":  # the numpy path is for CPU tensors only: a GPU's argmax stays on the GPU
        return x.argmax(-1)
    return torch.from_numpy(np.asarray(as_numpy(x).argmax(-1)))


def as_numpy(x: torch.Tensor) -> np.ndarray:
    """A float tensor's values as a numpy array: a view for float32/64 on the CPU, else a float32 copy.

    Decoding calls it per draft token right after a forward, where detach() and cpu() are measurable (docs/engine.md):
    a CPU tensor that needs no gradient is read as it is."""
    if x.device.type != "cpu" or x.requires_grad:
        x = x.detach().cpu()
    return x.numpy() if x.dtype in (torch.float32, torch.float64) else x.float().numpy()


def one_hot_at(best: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(...) token ids and (..., V) logits -> (..., V) float32 one-hot rows on the logits' device: scattered into
    zeros, with no (..., V) int64 one_hot and no copy to float."""
    return torch.zeros_like(like, dtype=torch.float32).scatter_(-1, best.unsqueeze(-1).to(like.device), 1.0)


def one_hots(tokens: list[int], vocab: int) -> torch.Tensor:
    """k tokens -> (k, V) float32 rows, each the one-hot of its token: greedy decoding's distributions."""
    q = np.zeros((len(tokens), vocab), dtype=np.float32)
    q[np.arange(len(tokens)), tokens] = 1.0
    return torch.from_numpy(q)


def pick(logits: torch.Tensor, s: Sampling, generator: Streams | torch.Generator | None = None,
         want_q: bool = True) -> tuple[int, torch.Tensor | None]:
    """(V,) logits -> the next token and (V,) its distribution under s, as decoding reads them.

    Greedy: the argmax and its one-hot (None unless want_q), found in one pass with nothing drawn, all in numpy
    on the CPU (the first calls after a forward run on cold caches, and numpy's paths are shorter: docs/engine.md);
    else a draw from transform.
    """
    if s.temperature == 0 and logits.device.type == "cpu":
        tok = int(as_numpy(logits).argmax())
        return tok, one_hots([tok], logits.shape[-1])[0] if want_q else None
    if s.temperature == 0 and not want_q:
        return int(argmax(logits)), None
    q = transform(logits, s)
    if s.temperature == 0:  # on a GPU: the one-hot stays there, one host read for the token id
        return int(q.argmax()), q
    return int(sample(q, generator)), q


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(..., V) probabilities -> (..., V) bool: the top tokens kept by top-p.

    A token stays while the mass of the tokens before it (in descending order) is below top_p, so
    the top token always stays. Only the kept count is needed, so the values are sorted without
    their indices, in numpy, which sorts a row faster than torch does (docs/engine.md). Tokens tied with the last kept one are kept as well.
    """
    if probs.device.type != "cpu":  # the same rule in torch, on the tensor's device
        desc = probs.sort(-1, descending=True).values
        kept = ((desc.cumsum(-1) - desc) < top_p).sum(-1, keepdim=True)
        return probs >= desc.gather(-1, kept - 1)
    p = probs.detach().numpy()
    desc = np.sort(p, axis=-1)[..., ::-1]
    before = np.cumsum(desc, axis=-1) - desc
    kept = (before < top_p).sum(-1, keepdims=True)  # >= 1: nothing comes before the top token
    return torch.from_numpy(p >= np.take_along_axis(desc, kept - 1, axis=-1))


def sample(probs: torch.Tensor, generator: Streams | torch.Generator | None = None,
           u: torch.Tensor | None = None) -> torch.Tensor:
    """(..., V) probabilities -> (...) token ids, one uniform per row from `generator` (decode.streams' Streams: one
    stream per row) or the (rows, 1) float64 uniforms u, drawn by the caller.

    Inverse CDF: the first token whose running mass exceeds u times the total, cheaper than
    torch.multinomial, which also slowed the forward after it (docs/engine.md). The sums are in float64, so a token's share of [0, total) is its
    probability to about 1e-16. Tokens of zero mass add an empty interval and are never drawn.
    """
    flat = probs.detach().reshape(-1, probs.shape[-1]).double()
    cum = flat.cumsum(-1)
    if isinstance(generator, Streams):
        u = generator.draw(1)[:, None]
    elif u is None:
        u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=flat.device)
    idx = torch.searchsorted(cum, u * cum[:, -1:], right=True)
    # u * total can round up to the total: take the last token with mass (the first maximum of the sums)
    idx = torch.where(idx < flat.shape[-1], idx, cum.argmax(-1, keepdim=True))
    return idx.reshape(probs.shape[:-1])


def pick_rows(logits: torch.Tensor, s: Sampling, streams: Streams,
              want_q: bool = True) -> tuple[list[int], torch.Tensor | None]:
    """(R, V) logits -> R next tokens and (R, V) their distributions: pick() over rows, row r drawing from
    streams' row r exactly what pick() draws from that row alone (one uniform), so a row's tokens do not depend on
    its batch. One host read for the R tokens. Greedy: the argmax, and its one-hot rows only if want_q (None else)."""
    if s.temperature == 0:
        best = argmax(logits)
        return best.tolist(), one_hot_at(best, logits) if want_q else None
    q = transform(logits, s)
    return sample(q, streams).tolist(), q
