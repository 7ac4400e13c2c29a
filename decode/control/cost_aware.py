"""The batch-aware cost-aware controller (BatchCostAware) and the progress math it prices rounds with; callers import
them from decode.control.

A batch waits for its row furthest behind, so a round's worth is its progress: how much it brings down the most tokens
any row may still emit. level_progress and acceptance relate a candidate's acceptance rate to that progress for level
rows, expected_max gives it for rows spread apart, optimistic leans a rate measured over few rounds to drafting; the
module constants weigh priors and measurements against each other. The step costs come from decode.costs.batch.
"""

from __future__ import annotations

import numpy as np

from decode.control.base import BatchControl
from decode.costs.batch import BatchCosts
from decode.policies import HeadPolicy, check_max_len
from heads import kernels

PRIOR_ROUNDS = 2.0  # a prior weighs as much as 2 drafted rounds at a batch size: one request's rounds outweigh it
FACTOR_ROUNDS = 8.0  # a cost factor starts at 1 with the weight of 8 rounds' predicted cost
LOOKAHEAD = 3  # a decision weighs up to 3 more candidates: each further one's survival only falls
RECHECK_ROUNDS = 32  # a drafting stretch is stopped on its size's realized progress once it has this many rounds


def level_progress(a: float, k: float, b: int) -> float:
    """A round's progress at b level rows drafting k candidates each, every candidate taken with probability a
    independently: 1 + sum_j a^(j b), the batch moving on by j more only where every row took its first j."""
    whole = max(1, round(k))
    return 1.0 + sum(a ** (j * b) for j in range(1, whole + 1))


def acceptance(progress: float, k: float, b: int) -> float:
    """The a whose level_progress(a, k, b) is progress (bisection): what a smaller size's rounds say of a candidate,
    so that a larger size's stand-in waits on its slowest row. At T = 1 one row's 2.1 tokens a round at 2.2
    candidates had stood in for 8 level rows as they were, and drafting there ran 0.90x the target alone (a dev-prompts
    bench)."""
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if level_progress(mid, k, b) < progress else (lo, mid)
    return lo


def optimistic(rate: float, rounds: float) -> float:
    """A size's drafting progress per ms measured over `rounds` drafted rounds, raised by 1 / sqrt(rounds): about two
    standard errors of one round's progress at batch 1 under sampling. One request's rate is noise (12 requests of
    one T = 1 row ran 0.23 to 0.49 per ms against a plain step's 0.24), and a size that stops drafting measures no
    more of it, so a choice made on few rounds must lean to drafting to be corrected; the lean shrinks as rounds
    accumulate."""
    return rate * (1.0 + 1.0 / np.sqrt(rounds)) if rounds else rate


def expected_max(reach: np.ndarray, surv: np.ndarray) -> np.ndarray:
    """E[max over rows of reach_i - y_i]: row i's tokens this round y_i = 1 + its accepted candidates, with
    P(y_i > m) = surv[..., i, m] (surv[..., 0] = 1, non-increasing), the rows independent.
    (R,) reach, (..., R, M) surv -> (...) expectations, one per leading index (e.g. per hypothesis)."""
    if len(reach) == 1:
        return reach[0] - surv[..., 0, :].sum(-1)
    m = surv.shape[-1]
    z = np.arange(int(reach.min()) - m, int(reach.max()))  # every value reach_i - y_i can take
    need = np.clip(reach[:, None] - z[None, :], 1, m + 1).astype(np.int64) - 1  # Z_i <= z <=> y_i >= need
    padded = np.concatenate([surv, np.zeros(surv.shape[:-1] + (1,))], -1)  # P(y_i > m) = 0
    cdf = np.take_along_axis(padded, np.broadcast_to(need, surv.shape[:-2] + need.shape), -1)
    below = cdf.prod(-2)  # (..., Z) P(max <= z)
    return z[-1] - below[..., :-1].sum(-1)


class BatchCostAware(HeadPolicy, BatchControl):
    """The batch-aware cost-aware controller: CostAwareStop's renewal-reward rule with the batch as the unit.

    A static batch ends when its last row does, so what a round buys is progress: how much it brings down the most
    tokens any row may still emit (its remaining budget). A plain target step brings every row one token on: its
    progress is 1. Drafting brings rows on by different amounts, and the batch waits for the row furthest behind:
    at batch 8 on the embedded pair, fixed K = 1 to 3 gave 1.8 to 2.7 tokens per row and round but cut the batch's
    rounds only 1.6x to 2.1x. With one row, progress is that row's tokens.

    Whether to draft is chosen per stretch: at a request's first round and whenever rows leaving move the batch to
    another measured size (decode.costs.batch). It drafts if the progress per ms that its drafting stretches at this
    size realized (the tables' cost of their rounds times what those rounds measured against them, the draft's
    catch-up reads included) beats a plain step's 1 over its cost.
    Stretches, not single rounds: a round from rows level with each other makes little progress (the slowest of
    them sets it), and the rounds after it gain what it spread; the draft's first round reads all the text since it
    last drafted. A size's measured rate is raised by 1 / sqrt(its drafted rounds) (optimistic): a plain stretch
    measures no more drafting, so a choice made on few rounds must lean to drafting to be corrected. Where this size
    has no drafting stretch yet, the nearest smaller size's rounds stand in (stand_in): the acceptance rate that
    explains their progress, carried to the rows as they are, at their candidates per round, priced by the tables
    here times the measured-over-predicted cost of its rounds; where a smaller size chose not to draft, this one does
    not either; before any, the head's dev acceptance rate with the K that pays best. A plain step's cost is the
    table's times what plain rounds measured against it. A drafting stretch stops early where, by the tables, even
    every candidate accepted could not have paid for its rounds, or once its size has RECHECK_ROUNDS drafted rounds
    and their raised progress per ms is below a plain step's.

    Within a drafting round, after each candidate the batch drafts on while some j more candidates would raise
    E[progress] - r * C: C_K = K * draft(b) + verify(b, K + 1) + realign(b) from the tables, the rows' tokens from the
    head's probabilities (a row's survival the product of its probabilities, further candidates at its last one), r
    the expected progress per ms of this request's rounds. What it learns carries over from one request to the next
    (forget() drops it), as a server calibrates once.
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
        """Drop what earlier requests taught: the drafting stretches per batch size and the plain steps' cost
        factors. A controller that serves one request after another keeps them (start() does not), as a server
        calibrates once: otherwise every request pays again to learn that drafting does not pay."""
        self.stretches: dict[int, np.ndarray] = {}  # measured size -> [rounds, progress, candidates, ms, predicted ms]
        self.plain_ms: dict[int, list[float]] = {}  # measured size -> [ms, predicted ms] of plain steps
        self.declined: set[int] = set()  # sizes whose last stretch decision was not to draft

    def start(self, n):
        self.run_rows = np.zeros(n, dtype=np.int64)
        self.plain_steps = 0  # plain steps not yet added to run_rows (each adds 1 to every row's run)
        self.progress = self.spent = 0.0  # this request's expected progress and predicted cost so far (decide's r)
        self.mode = None  # (size, drafting) of the stretch

    def round_costs(self, b: int) -> list[float]:
        """C_0 .. C_max_len at batch size b: C_0 a plain target step, C_k a round of k candidates per row."""
        d, verify, move = self.costs.at(b)
        own = d if self.reads_own_state else 0.0
        return [verify[0]] + [k * d + verify[k] + move + own for k in range(1, self.max_len + 1)]

    def priced(self, b: int) -> tuple[list[float], tuple[float, float] | None, int]:
        """At batch size b, once per size: C_0 .. C_max_len, the head prior's (K, tokens per
        round) for the K that pays best at its rate, and the measured size nearest b (whose stretches price it)."""
        if b not in self._priced:
            c, prior = self.round_costs(b), None
            if self.prior is not None:
                yields = [level_progress(self.prior, k, b) for k in range(1, self.max_len + 1)]
                k0 = 1 + int(np.argmax([y / c[k] for k, y in enumerate(yields, 1)]))
                prior = (k0, yields[k0 - 1])
            nearest = min(self.costs.sizes, key=lambda s: abs(np.log(s / b)))
            self._priced[b] = (c, prior, nearest)
        return self._priced[b]

    def cost_at(self, mean_k: float) -> float:
        """This size's table cost of a round of mean_k candidates per row (linear between whole K)."""
        lo = min(int(mean_k), self.max_len)
        return self.c[lo] + (mean_k - lo) * (self.c[min(lo + 1, self.max_len)] - self.c[lo])

    def drafting_rate(self, prior) -> tuple[float | None, float, float]:
        """Progress per ms of drafting at this size: its stretches, with PRIOR_ROUNDS of the nearest smaller size's
        (or of the head's prior), None where nothing is known; the rounds this size measured; and the most progress
        per ms those rounds could have made (each row taking every candidate)."""
        got = self.stretches.get(self.bucket, np.zeros(5))
        below = [s for s, r in self.stretches.items() if s < self.bucket and r[0]]
        if not got[0] and any(s < self.bucket for s in self.declined):
            return 0.0, 0.0, np.inf  # drafting did not pay at a smaller size: it will not pay here either
        guess = None
        if below:
            s = max(below)
            r = self.stretches[s]
            k = r[2] / r[0]
            guess = (self.stand_in(acceptance(r[1] / r[0], k, s), k), self.cost_at(k) * self.factor(r))
        elif prior is not None:
            guess = (self.stand_in(self.prior, prior[0]), self.c[prior[0]])
        rounds, progress, ms = got[0], got[1], got[4] * self.factor(got)
        bound = (rounds + got[2]) / got[4] if got[4] else np.inf  # by the tables: a first round also reads prompts
        if guess is not None:
            rounds, progress, ms = rounds + PRIOR_ROUNDS, progress + PRIOR_ROUNDS * guess[0], ms + PRIOR_ROUNDS * guess[1]
        return (progress / ms if rounds else None), got[0], bound

    def stand_in(self, a: float, k: float) -> float:
        """The expected progress of a round of k candidates for the rows as they are (their remaining budgets), each
        row taking each candidate with probability a: level rows wait on their slowest (level_progress), rows spread
        apart (a batch's tail, as rows leave) on the one furthest behind alone."""
        column = a ** np.arange(max(1, round(k)) + 1)  # P(a row's tokens > m), m = 0 .. k, every row alike
        surv = np.broadcast_to(column, (len(self.reach), len(column)))
        return float(self.reach.max() - expected_max(self.reach, surv))

    def factor(self, stats) -> float:
        """Measured over predicted time of rounds (stats[-2:]: their ms and the tables' ms), starting at 1 with the
        weight of FACTOR_ROUNDS rounds of C_1: what the tables do not price (the rows' Python work, filler, rows
        leaving, the draft's catch-up reads), which grows with the rows, so one size's is not another's."""
        c = FACTOR_ROUNDS * self.c[1]
        return (stats[-2] + c) / (stats[-1] + c)

    def begin(self, b, remaining=None):
        if self.costs is None:
            raise ValueError("BatchCostAware has no cost tables: decode with decode.batch.BatchDecoder, which "
                             "measures them, or call set_batch_costs")
        self.b, self.k = b, 0
        self.c, prior, self.bucket = self.priced(b)
        if self.mode == (self.bucket, False):  # a plain stretch goes on until the size changes: as lean as a plain step
            self.expected = 1.0
            return 0
        self.run_rows += self.plain_steps
        self.plain_steps = 0
        self.reach = np.zeros(b) if remaining is None else np.asarray(remaining, dtype=np.float64)
        self.reach_int = self.reach.astype(np.int64)
        rate, measured, bound = self.drafting_rate(prior)
        rate = None if rate is None else optimistic(rate, measured)
        plain = 1.0 / (self.c[0] * self.factor(self.plain_ms.get(self.bucket, (0.0, 0.0))))  # progress 1 per ms
        if self.mode is None or self.mode[0] != self.bucket:  # a new stretch: draft or not
            self.mode = (self.bucket, rate is None or rate > plain)
        elif self.mode[1] and (bound < 1.0 / self.c[0] or measured >= RECHECK_ROUNDS and rate < plain):
            self.mode = (self.bucket, False)  # drafting here cannot pay, or has not over enough rounds
        (self.declined.discard if self.mode[1] else self.declined.add)(self.bucket)
        self.surv = np.zeros((b, self.max_len + 1))
        self.surv[:, 0] = 1.0
        self.every = np.ones(b, dtype=bool)
        self.expected = 1.0  # the round's expected progress as decided so far (a plain step's: 1)
        return self.max_len if self.mode[1] else 0

    def _stretch(self) -> np.ndarray:
        """This size's drafting-stretch counters (stretches' row), made on first use: setdefault would build a
        fresh array on every drafted round's two updates."""
        got = self.stretches.get(self.bucket)
        if got is None:
            got = self.stretches[self.bucket] = np.zeros(5)
        return got

    def timed(self, ms):
        if self.k:
            self._stretch()[3:] += (ms, self.c[self.k])
        else:
            got = self.plain_ms.get(self.bucket) or self.plain_ms.setdefault(self.bucket, [0.0, 0.0])
            got[0] += ms  # Python floats: a plain step's bookkeeping is as lean as the target alone's
            got[1] += self.c[0]

    def decide(self, step):
        rows = step.rows
        whole = len(rows) == self.b  # every row decides (always at batch 1): slices, not fancy indexing
        a = step.head_probs(self, self.run_rows if whole else self.run_rows[rows])
        self.k = k = step.index + 1
        if whole:
            self.surv[:, k] = self.surv[:, k - 1] * a
        else:
            self.surv[rows, k] = self.surv[rows, k - 1] * a
        later = min(self.max_len - k, LOOKAHEAD)
        if kernels.HAVE_NUMBA and self.b <= kernels.ROWS_MAX:
            if whole:
                deciding, last = self.every, a
            else:
                deciding, last = np.zeros(self.b, dtype=bool), np.zeros(self.b)
                deciding[rows], last[rows] = True, a
            progress = kernels.round_progress(self.reach_int, self.surv, deciding, last, k, later).tolist()
        else:
            progress = self._progress(rows, a, k, later).tolist()
        self.expected = p0 = progress[0]
        rate = self.progress / self.spent if self.spent else p0 / self.c[k]
        c = self.c  # Python floats: at a handful of candidates, numpy's per-call cost is most of the decision
        go = any(progress[j] - p0 > rate * (c[k + j] - c[k]) for j in range(1, later + 1))
        return [go] * len(rows)

    def _progress(self, rows, a, k: int, later: int) -> np.ndarray:
        """kernels.round_progress in numpy (many rows, or no numba): the round's expected progress if it stops after
        j = 0 .. later more candidates, each further candidate of a deciding row surviving at its last probability.
        Rows too far behind the most remaining to set it this round (even taking every candidate) are left out."""
        most = float(self.reach.max())
        near = self.reach > most - k - later - 2
        reach, rows_at = self.reach[near], np.asarray(rows)
        hyp = np.repeat(self.surv[near][None, :, :k + later + 1], later + 1, 0)
        sub = np.flatnonzero(near[rows_at])  # the deciding rows among the near ones
        at = np.cumsum(near)[rows_at[sub]] - 1
        grow = np.power.outer(a[sub], np.arange(1, later + 1)) * self.surv[rows_at[sub], k][:, None]
        for j in range(1, later + 1):
            hyp[j][at, k + 1:k + j + 1] = grow[:, :j]
        return most - expected_max(reach, hyp)

    def verified(self, accepted, drafted):
        self.progress += self.expected
        self.spent += self.c[self.k]
        if self.k:  # the round's progress: the rows' most remaining before it less the most after what each emitted
            done = float(self.reach.max() - (self.reach - 1 - np.asarray(accepted)).max())
            self._stretch()[:3] += (1.0, done, self.k)
        if not any(drafted):  # a plain step: every row's run grows by its one token (added at the next drafting begin)
            self.plain_steps += 1
            return
        a, d = np.asarray(accepted), np.asarray(drafted)  # HeadPolicy.verified's run, per row
        self.run_rows = np.where(a < d, 0, self.run_rows + d + 1)

    def select(self, stay):
        self.run_rows = self.run_rows[stay]
