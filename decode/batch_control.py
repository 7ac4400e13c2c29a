"""Drafting control over a batch (decode.batch): how many candidates each round drafts, for every row at once.

A BatchControl answers three questions a round asks: how many candidates at most (begin: 0 means a plain target
step), whether to draft on after each candidate (decide, per deciding row), and what verification kept (verified).

    PerRow(policy)        any decode.policies policy, one copy per row (its state is the row's); a head policy's
                          probabilities come from one head forward over the rows per step
    BatchSizeK(table)     vLLM's dynamic rule: K by the number of rows still decoding, from a table chosen on dev
    BatchCostAware(head)  the batch-aware cost-aware controller: drafts on while the rows' expected extra tokens pay
                          for the extra draft step and the wider verify at this batch size, else stops; falls back to
                          K = 0 when no K pays (decode.batch_costs measures the tables)

A batch verifies every row at the width of its longest draft, so a row that stops before the others saves nothing:
the batch-level controllers draft every live row to the batch's K.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import numpy as np
import torch

from decode.batch_costs import BatchCosts
from decode.policies import DraftStep, HeadPolicy, Policy, check_max_len, draft_scalars


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

    def head_probs(self, head: HeadPolicy, runs: list[int]) -> np.ndarray:
        """(R,) the head's probabilities, one forward over the rows; runs: each row's accepted run before the round."""
        hidden = self.hidden_own if head.features.position == "own" else self.hidden_prev
        confidence, entropy, top1 = self.scalars if head.features.extras else (None,) * 3
        return head.probs(hidden, entropy, top1, confidence, np.asarray(runs) + self.index)


class _RowStep(DraftStep):
    """A DraftStep of one row of a RowsStep (batch, j): its scalars are read from the batch's, on first use."""

    @functools.cached_property
    def _scalars(self) -> tuple[float, float, float]:
        return tuple(float(x[self.j]) for x in self.batch.scalars)


class BatchControl:
    """The batch decoder's drafting control (see the module docstring)."""

    needs_hidden = False
    reads_own_state = False
    needs_batch_costs = False

    def start(self, n: int) -> None:
        """A request of n rows begins."""

    def begin(self, b: int) -> int:
        """b rows decode this round -> the most candidates any row drafts (0: no drafting, a plain target step)."""
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
        if policy.needs_target_peek:
            raise ValueError(f"{type(policy).__name__} peeks at the target off the books and decodes one sequence "
                             "at a time: use decode.engine.SpeculativeDecoder")
        self.policy, self.rows = policy, []
        self.needs_hidden, self.reads_own_state = policy.needs_hidden, policy.reads_own_state

    def start(self, n):
        self.rows = [copy.copy(self.policy) for _ in range(n)]
        for p in self.rows:
            p.start()

    def begin(self, b):
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

    def begin(self, b):
        sizes = [s for s in self.table if s <= b] or [min(self.table)]
        return self.table[sizes[-1]]


PRIOR_ROUNDS = 8.0  # the prior weighs as much as 8 rows' rounds: one row's first round cannot turn drafting off


class BatchCostAware(HeadPolicy, BatchControl):
    """The batch-aware cost-aware controller: CostAwareStop's renewal-reward rule with the batch as the unit.

    A round with K candidates per row costs C_K = K * draft(b) + verify(b, K + 1) + realign(b) at batch size b
    (decode.batch_costs; a plain target step costs verify(b, 1)) and yields the rows' expected tokens E_K = sum over
    rows of 1 + S_1 + ... + S_K, S_j the row's survival (the product of the head's probabilities). After each
    candidate the batch drafts on while some j more candidates would raise E - r * C, each row's further acceptances
    estimated by its last probability, r the long-run rate of the rounds so far. Before a round it drafts only if
    drafting has paid: the tokens per row its drafted rounds yielded, over their cost at today's batch size (mean
    candidates per row), beat a plain target step. Realized yield, not the head's probabilities: these are of single
    candidates, agreement comes in runs, and rounds end where the head expects a rejection. Before any round the
    acceptance rate of the head's dev labels stands in, as geometric rounds of the best K. Both sides of that test are
    priced by the tables times what the rounds of that kind measured against them (factor): the tables time forwards
    and realignment, not the rows' bookkeeping, filler or rows leaving the batch. The yield and the factors carry over
    from one request to the next (forget() drops them), as a server calibrates once.
    """

    needs_batch_costs = True

    def __init__(self, head_dir: str, max_len: int = 8, allow_sampling_mismatch: bool = False):
        super().__init__(head_dir, allow_sampling_mismatch)
        self.max_len = check_max_len(max_len)
        self.costs: BatchCosts | None = None
        # The prior of the acceptance rate: the head's dev labels' rate (export writes it); see PRIOR_ROUNDS.
        self.prior = (self.config.get("metrics") or {}).get("positive_rate")
        self.forget()

    def set_batch_costs(self, costs: BatchCosts) -> None:
        self.costs, self._priced = costs, {}

    def forget(self) -> None:
        """Drop what earlier requests taught: the realized yield of drafted rounds and the measured-over-predicted
        factors. A controller that serves one request after another keeps them (start() does not reset them), as
        a server calibrates once: otherwise every request pays again for learning that drafting does not pay."""
        self.row_rounds = self.gained = self.drafted = 0.0
        self.measured: dict[tuple[int, bool], float] = {}  # by (the table's nearest batch size, drafted)
        self.predicted: dict[tuple[int, bool], float] = {}

    def start(self, n):
        self.run_rows = np.zeros(n, dtype=np.int64)
        self.tokens = self.spent = 0.0  # the long-run rate of this request's rounds (decide's r)

    def round_costs(self, b: int) -> list[float]:
        """C_0 .. C_max_len at batch size b: C_0 a plain target step, C_k a round of k candidates per row."""
        d, verify, move = self.costs.at(b)
        own = d if self.reads_own_state else 0.0
        return [verify[0]] + [k * d + verify[k] + move + own for k in range(1, self.max_len + 1)]

    def priced(self, b: int) -> tuple[list[float], np.ndarray, tuple[float, float] | None, int]:
        """At batch size b, once per size (a round's work at batch 1 is a few hundred microseconds): C_0 .. C_max_len
        as a list and an array, the prior's (K, tokens per row-round) for the K that pays best at its rate, and the
        measured size nearest b (whose factor() prices it)."""
        if b not in self._priced:
            c, prior = self.round_costs(b), None
            if self.prior is not None:
                yields = [sum(self.prior ** j for j in range(k + 1)) for k in range(1, self.max_len + 1)]
                k0 = 1 + int(np.argmax([y / c[k] for k, y in enumerate(yields, 1)]))
                prior = (k0, yields[k0 - 1])
            nearest = min(self.costs.sizes, key=lambda s: abs(np.log(s / b)))
            self._priced[b] = (c, np.array(c), prior, nearest)
        return self._priced[b]

    def begin(self, b):
        if self.costs is None:
            raise ValueError("BatchCostAware has no cost tables: decode with decode.batch.BatchDecoder, which "
                             "measures them, or call set_batch_costs")
        self.b, self.k = b, 0
        c, self.c_array, prior, self.bucket = self.priced(b)
        self.c = c
        self.survive, self.expected = np.ones(b), float(b)
        n, gain, cands = self.row_rounds, self.gained, self.drafted
        if prior is not None:  # the prior as PRIOR_ROUNDS row-rounds of the best fixed K at its rate
            n, gain, cands = n + PRIOR_ROUNDS, gain + PRIOR_ROUNDS * prior[1], cands + PRIOR_ROUNDS * prior[0]
        if not n:  # nothing known of the acceptance: draft, to learn it
            return self.max_len
        mean_k = cands / n
        lo = int(mean_k)
        cost = c[lo] + (mean_k - lo) * (c[min(lo + 1, self.max_len)] - c[lo])
        return self.max_len if b * gain / n / (cost * self.factor(True)) > b / (c[0] * self.factor(False)) else 0

    def factor(self, drafted: bool) -> float:
        """Measured over predicted time of the rounds of this kind so far (drafted or plain) at batch sizes nearest
        the same measured one, starting at 1 with the weight of PRIOR_ROUNDS rounds: what the tables do not price (the
        rows' Python work, filler, rows leaving), which grows with the rows, so one size's factor is not another's."""
        c, key = PRIOR_ROUNDS * self.c[1], (self.bucket, drafted)
        return (self.measured.get(key, 0.0) + c) / (self.predicted.get(key, 0.0) + c)

    def timed(self, ms):
        # Every drafted round joins its factor, the first too: it reads the prompts into the draft, as a drafted
        # round after plain steps reads the text they added, and a request that drafts pays for those reads
        drafted = self.k > 0
        key = (self.bucket, drafted)
        self.measured[key] = self.measured.get(key, 0.0) + ms
        self.predicted[key] = self.predicted.get(key, 0.0) + self.c[self.k]

    def decide(self, step):
        a = step.head_probs(self, self.run_rows[step.rows].tolist())
        self.k = k = step.index + 1
        self.survive[step.rows] *= a
        self.expected += float(self.survive[step.rows].sum())
        rate = self.tokens / self.spent if self.spent else self.expected / self.c[k]
        # gain[j] over the rows: the expected tokens of j more candidates, S_k * (a + a^2 + ... + a^j)
        more = np.power.outer(a, np.arange(1, self.max_len - k + 1))
        gain = np.cumsum(self.survive[step.rows] @ more)
        go = bool((gain > rate * (self.c_array[k + 1:] - self.c[k])).any())
        return [go] * len(step.rows)

    def verified(self, accepted, drafted):
        self.tokens += self.expected
        self.spent += self.c[self.k]
        if self.k:  # a drafted round: its tokens per row and candidates per row join the rate of drafting
            self.row_rounds += len(accepted)
            self.gained += sum(accepted) + len(accepted)
            self.drafted += sum(drafted)
        for i, (a, d) in enumerate(zip(accepted, drafted)):  # HeadPolicy.verified's run, per row
            self.run_rows[i] = 0 if a < d else self.run_rows[i] + d + 1

    def select(self, stay):
        self.run_rows = self.run_rows[stay]


def control_of(policy: Policy | BatchControl) -> BatchControl:
    """A BatchControl as it is, a decode.policies policy one copy per row."""
    return policy if isinstance(policy, BatchControl) else PerRow(policy)
