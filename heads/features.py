"""What a head reads: the draft's hidden state at a chosen position, plus optional scalar extras.

position "own": the state after the draft read candidate c_i. Decoding must run the draft on
  c_i before it can decide to stop after c_i (that pass is the one that drafts c_{i+1}, so
  with adaptive stopping it is spent even when drafting stops: one extra draft step per round).
position "prev": the state that produced q_i (before c_i is read). The decision on c_i is free
  at the moment c_i is sampled; the head cannot see which token was drawn unless the extra
  `cand_logq` is used.

The extra "accepted_run" is the number of positions right before the candidate whose candidates were accepted
(capped at RUN_CAP, read as log1p): accepted text runs in stretches, and a stop rule multiplies the head's
probabilities given that every earlier candidate of the round was accepted, which this extra states. Decoding
knows it (decode.policies.HeadPolicy.verified); a label set knows it only along accepted text, so it needs
target-prefix label sets (every sequence of kind "target", e.g. configs/data_gen/pycode-target.yaml).

The extra "cand_rank" is the candidate's rank among the siblings a token tree drafts after the same node (0: the
draft's first choice or first draw, 1: its second, ...; a chain's candidates are all rank 0), read as a number. A head
reading it is trained on sibling labels (data_gen's `siblings`) and predicts the chance the candidate is accepted once
its earlier siblings were rejected (decode.tree.HeadTree).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

EXTRAS = ("draft_entropy", "draft_top1", "cand_logq", "accepted_run", "cand_rank")
CHAIN_EXTRAS = EXTRAS[:4]  # what a chain candidate's compiled decision (heads.kernels) computes; its rank is 0
RUN_CAP = 16


@dataclass
class FeatureSpec:
    """Which hidden state (position) and which scalar extras, concatenated in EXTRAS order."""

    position: str = "own"
    extras: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.position not in ("own", "prev"):
            raise ValueError(f"feature position must be 'own' or 'prev', got {self.position!r}")
        bad = [e for e in self.extras if e not in EXTRAS]
        if bad:
            raise ValueError(f"unknown extra features {bad}; choose from {EXTRAS}")
        self.extras = [e for e in EXTRAS if e in self.extras]  # canonical order

    def dim(self, hidden_size: int) -> int:
        return hidden_size + len(self.extras)

    def build(self, hidden: torch.Tensor, draft_entropy: torch.Tensor, draft_top1: torch.Tensor,
              q_cand: torch.Tensor, dtype: torch.dtype = torch.float32,
              accepted_run: torch.Tensor | None = None, cand_rank: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H) hidden and (...) scalars -> (..., H + len(extras)) features in `dtype` (cand_rank None: 0)."""
        scalars = {"draft_entropy": draft_entropy, "draft_top1": draft_top1,
                   "cand_logq": q_cand.float().clamp_min(1e-20).log(),
                   "cand_rank": torch.zeros_like(q_cand, dtype=torch.float32) if cand_rank is None else cand_rank.float()}
        if "accepted_run" in self.extras:
            if accepted_run is None:
                raise ValueError("this head reads the extra accepted_run: pass the accepted run before each candidate")
            scalars["accepted_run"] = accepted_run.float().clamp(0, RUN_CAP).log1p()
        cols = [hidden.to(dtype)] + [scalars[e].to(dtype).unsqueeze(-1) for e in self.extras]
        return torch.cat(cols, dim=-1)

    def row(self, hidden, draft_entropy: float, draft_top1: float, q_cand: float, accepted_run: int = 0):
        """build() of one row as a float32 numpy array, the scalars as Python floats (decode and replay build one
        row per candidate: a few hundred floats, where torch would pay per op)."""
        h = len(hidden)
        out = np.empty(h + len(self.extras), dtype=np.float32)
        out[:h] = hidden
        self.extras_into(out[h:], draft_entropy, draft_top1, q_cand, accepted_run)
        return out

    def extras_into(self, out: np.ndarray, draft_entropy: float, draft_top1: float, q_cand: float,
                    accepted_run: int = 0) -> np.ndarray:
        """The extras of one row written into out, (len(extras),) float32 (decode.policies.HeadPolicy.prob reuses
        one array: at batch 1 an allocation per candidate is a measurable share of the head's time)."""
        for i, e in enumerate(self.extras):
            out[i] = (draft_entropy if e == "draft_entropy" else draft_top1 if e == "draft_top1" else
                      math.log(max(float(q_cand), 1e-20)) if e == "cand_logq" else
                      0.0 if e == "cand_rank" else math.log1p(min(max(accepted_run, 0), RUN_CAP)))
        return out

    def rows(self, hidden: np.ndarray, draft_entropy: np.ndarray, draft_top1: np.ndarray, q_cand: np.ndarray,
             accepted_run: np.ndarray, cand_rank: np.ndarray | None = None) -> np.ndarray:
        """row() over R rows in numpy, (R, H) and (R,) arrays -> (R, H + len(extras)) float32 (decode.batch: a few
        array ops per draft step for the whole batch, where torch pays per op at small batches; cand_rank None: 0)."""
        scalars = {"draft_entropy": draft_entropy, "draft_top1": draft_top1,
                   "cand_logq": np.log(np.maximum(q_cand, 1e-20)),
                   "accepted_run": np.log1p(np.minimum(np.maximum(accepted_run, 0), RUN_CAP)),
                   "cand_rank": np.zeros(len(hidden)) if cand_rank is None else cand_rank}  # not np.clip: 10x slower on a few rows
        cols = [np.asarray(hidden, dtype=np.float32)] + [np.asarray(scalars[e], dtype=np.float32)[:, None]
                                                          for e in self.extras]
        return np.concatenate(cols, axis=1)

    def to_dict(self) -> dict:
        return asdict(self)
