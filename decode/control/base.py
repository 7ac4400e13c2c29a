"""The batch decoder's control interface and the controllers that need no cost tables; callers import them from
decode.control.

RowsStep is what a controller reads of the rows deciding at one index of a round (DraftStep over R rows, with one
head forward and one softmax pass for all of them), BatchControl the interface decode.batch asks (decode.control
describes it), PerRow a decode.policies policy copied per row, BatchSizeK vLLM's K-by-batch-size table, and control_of
what the decoder makes of whichever it is given. BatchCostAware, priced by cost tables, is decode.control.cost_aware.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import numpy as np
import torch

from decode.policies import DraftStep, HeadPolicy, Policy, draft_scalars
from decode.sampling import as_numpy
from heads import kernels


@dataclass
class RowsStep:
    """The candidates of the rows deciding now, all at the same index of the round: DraftStep over R rows."""

    index: int
    rows: list[int]  # their positions in the batch
    tokens: list[int]
    q: torch.Tensor | None  # (R, V) the distributions the candidates were drawn from (None: greedy, unread)
    logits: torch.Tensor  # (R, V) the draft's raw logits behind q
    hidden_prev: torch.Tensor | None  # (R, H)
    hidden_own: torch.Tensor | None  # (R, H)

    @functools.cached_property
    def scalars(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(R,) confidence, entropy and top-1 probability of each row's raw softmax (decode.policies.draft_scalars)."""
        return draft_scalars(self.logits, self.tokens)

    def row(self, j: int) -> DraftStep:
        """Row j's DraftStep; its scalars, if a policy reads them, from the batch's one pass over every row."""
        step = _RowStep(self.index, self.tokens[j], None if self.q is None else self.q[j], self.logits[j],
                        None if self.hidden_prev is None else self.hidden_prev[j],
                        None if self.hidden_own is None else self.hidden_own[j])
        step.batch, step.j = self, j
        return step

    def head_probs(self, head: HeadPolicy, runs: list[int] | np.ndarray) -> np.ndarray:
        """(R,) the head's probabilities, one forward over the rows; runs: each row's accepted run before the round.
        On the CPU, up to kernels.ROWS_MAX rows, the draft's scalars and the head are one compiled call."""
        hidden = self.hidden_own if head.features.position == "own" else self.hidden_prev
        params = getattr(head.fast_prob, "params", None)
        if (params is not None and head.features.extras and len(self.rows) <= kernels.ROWS_MAX
                and self.logits.device.type == "cpu" and hidden.device.type == "cpu" and "scalars" not in vars(self)):
            out = kernels.head_rows(as_numpy(self.logits) if head._reads else None, np.asarray(self.tokens),
                                    as_numpy(hidden), np.asarray(runs) + self.index, head._codes, params)
            if head._reads:
                vars(self)["scalars"] = (out[1], out[2], out[3])  # a per-row policy reading them does not pay again
            return out[0]
        confidence, entropy, top1 = self.scalars if head.features.extras else (None,) * 3
        return head.probs(hidden, entropy, top1, confidence, np.asarray(runs) + self.index)


class _RowStep(DraftStep):
    """A DraftStep of one row of a RowsStep (batch, j): its scalars are read from the batch's, on first use."""

    @functools.cached_property
    def _scalars(self) -> tuple[float, float, float]:
        return tuple(float(x[self.j]) for x in self.batch.scalars)


class BatchControl:
    """The batch decoder's drafting control (see the module docstring)."""

    needs_hidden = False  # the draft's cache keeps its hidden states (a head reads them)
    reads_own_state = False  # a decision reads the state after the candidate (one more draft pass first)
    needs_batch_costs = False  # the decoder hands it cost tables by batch size (set_batch_costs) before decoding
    needs_tree_costs = False  # a tree shape priced by width and node count (set_tree_costs, decode.costs.model.tree_costs)

    def head_policy(self):
        """The exported head it reads beside its own (a decode.policies.HeadPolicy, which the decoder checks was
        trained for the pair's draft and setting), or None."""
        return None

    def start(self, n: int) -> None:
        """A request of n rows begins."""

    def begin(self, b: int, remaining: list[int] | None = None) -> int:
        """b rows decode this round, row i able to emit remaining[i] more tokens -> the most candidates any row drafts
        (0: no drafting, a plain target step)."""
        raise NotImplementedError

    def decide(self, step: RowsStep) -> list[bool]:
        """Each deciding row's candidate at step.index -> draft on (True) or stop, per row of step.rows."""
        return [True] * len(step.rows)

    def verified(self, accepted: list[int], drafted: list[int]) -> None:
        """Each row's accepted and drafted counts of the round just verified."""

    def select(self, stay: list[int]) -> None:
        """Only these rows (positions in the batch) go on, in this order."""

    def timed(self, ms: float) -> None:
        """The wall time of the round just finished (verification, realignment and leaving rows included)."""


class PerRow(BatchControl):
    """A decode.policies policy per row: the policy is copied for each row, so each copy keeps its row's state."""

    def __init__(self, policy: Policy):
        if policy.sees_target:
            raise ValueError(f"{type(policy).__name__} is a ceiling that reads the target off the books, one "
                             "sequence at a time: use decode.engine.SpeculativeDecoder")
        self.policy, self.rows = policy, []
        self.needs_hidden, self.reads_own_state = policy.needs_hidden, policy.reads_own_state

    def head_policy(self):
        return self.policy if isinstance(self.policy, HeadPolicy) else None

    def start(self, n):
        self.rows = [copy.copy(self.policy) for _ in range(n)]
        for p in self.rows:
            p.start()

    def begin(self, b, remaining=None):
        for p in self.rows:
            p.reset()
        return self.policy.max_len

    def decide(self, step):
        if isinstance(self.policy, HeadPolicy):
            probs = step.head_probs(self.policy, [self.rows[i].run for i in step.rows])
            return [not self.rows[i].given(float(p)) for i, p in zip(step.rows, probs)]
        return [not self.rows[i].stop(step.row(j)) for j, i in enumerate(step.rows)]

    def verified(self, accepted, drafted):
        for p, a, d in zip(self.rows, accepted, drafted):
            p.verified(a, d)

    def select(self, stay):
        self.rows = [self.rows[i] for i in stay]


class BatchSizeK(BatchControl):
    """K by the rows still decoding: table maps a batch size to the K used from it up (the largest size at or
    below the batch's; below every size, the smallest's). K = 0 turns speculation off at that size."""

    def __init__(self, table: dict[int, int]):
        if not table or any(b < 1 or not 0 <= k <= 64 for b, k in table.items()):
            raise ValueError(f"BatchSizeK needs {{batch size >= 1: K in 0..64}}, got {table}")
        self.table = dict(sorted((int(b), int(k)) for b, k in table.items()))

    def begin(self, b, remaining=None):
        sizes = [s for s in self.table if s <= b] or [min(self.table)]
        return self.table[sizes[-1]]


def control_of(policy: Policy | BatchControl) -> BatchControl:
    """A BatchControl as it is, a decode.policies policy one copy per row."""
    return policy if isinstance(policy, BatchControl) else PerRow(policy)
