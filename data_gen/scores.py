"""Per-position labels of a batch, scored a stretch of positions at a time as the draft walk makes them.

    scores = PositionScores(pair, responses, prompt_mask, chunk=PositionScores.chunk_for(B, V))
    scores.add(q_t, q_raw_t, candidate_t, z_t[, siblings_t])   # for t = 0 .. N - 1, in order
    stats = scores.result()                      # dict of (B, N) per-position quantities

The target reads z in stretches (its cache continues from the prompt, which it read while sampling), p is
formed for that stretch only, and only per-position scalars are kept: at V = 151,665, B = 16, N = 96 every
(B, N, V) float32 tensor of p or q would be 0.93 GB. With a stretch as long as the response (small
vocabularies) this is one target pass over z, as a whole-batch computation would do.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from decode.cache.kv import crop_cache, forward
from decode.labels import position_stats
from decode.pair import Pair
from decode.sampling import transform

BUDGET = 64 << 20  # bytes of one stretch's (B, n, V) float32 distributions


class PositionScores:
    """Collects the draft's distributions per position and turns every `chunk` of them into labels."""

    def __init__(self, pair: Pair, resp, mask: torch.Tensor, chunk: int, phase=None):
        self.pair, self.resp, self.chunk = pair, resp, chunk
        self.phase = phase or (lambda name: nullcontext())
        self.into = pair.input_device("target")
        self.T, self.mask = mask.shape[1], mask.to(self.into)
        crop_cache(resp.cache, self.T)  # the target's cache holds the responses: back to the prompts
        self.zs, self.pending, self.parts = [], [], []
        self.fed = self.scored = 0  # z tokens the target has read; positions scored

    @staticmethod
    def chunk_for(batch: int, vocab: int, budget: int = BUDGET) -> int:
        """Positions per stretch so that one (B, n, V) float32 tensor stays within `budget` bytes."""
        return max(1, budget // (4 * batch * vocab))

    def add(self, q: torch.Tensor, q_raw: torch.Tensor | None, cand: torch.Tensor, z: torch.Tensor,
            sib: torch.Tensor | None = None) -> None:
        """(B, V) q and q_raw (or None), (B,) candidate and the token the draft read next [, (B, m) siblings], of the
        next position."""
        self.pending.append((q, q_raw, cand, sib))
        self.zs.append(z)
        if len(self.pending) == self.chunk:
            self.flush()

    @torch.no_grad()
    def flush(self) -> None:
        """Score the pending positions s .. e - 1: the target reads z up to z_{e-2}, giving p_s .. p_{e-1}."""
        if not self.pending:
            return
        e = len(self.zs)
        with self.phase("target pass over z"):
            logits = [self.resp.first_logits[:, None]] if self.scored == 0 else []
            if e - 1 > self.fed:
                z = torch.stack(self.zs[self.fed : e - 1], 1).to(self.into)
                m = torch.cat([self.mask, torch.ones(z.shape[0], e - 1, dtype=self.mask.dtype, device=self.into)], 1)
                start = self.T + self.fed
                out = forward(self.pair.target, z, self.resp.cache, attention_mask=m,
                              position_ids=(m.cumsum(-1) - 1).clamp_min(0)[:, start:])
                logits.append(self.pair.logits(out.logits))
                self.fed = e - 1
            p = transform(torch.cat(logits, 1), self.pair.config.sampling)
        with self.phase("statistics"):
            q, q_raw, cand, sib = (None if x[0] is None else torch.stack(x, 1) for x in zip(*self.pending))
            greedy = self.pair.config.sampling.temperature == 0
            self.parts.append(position_stats(p, q, cand, q_raw, None if sib is None else sib.to(p.device), greedy))
        self.scored, self.pending = e, []

    def result(self) -> dict[str, torch.Tensor]:
        """dict of (B, N) per-position quantities (decode.labels.position_stats) over every position added; (B, N, m)
        for the siblings' columns."""
        self.flush()
        return {k: torch.cat([part[k] for part in self.parts], 1) for k in self.parts[0]}
