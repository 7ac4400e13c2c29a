"""Compiled one-row paths of what a head reads and computes, for decoding one sequence on the CPU.

At batch 1 a head policy decides after every draft token, right after a draft forward. There each numpy call runs
on caches the forward left cold: the numpy head path (about 20 array ops: the draft's softmax scalars, the feature
row, the residual blocks) took 16 us in isolation and 100-120 us in the loop, 11-12% of a 0.9 ms draft step. Numba
functions do the same work with no temporaries:
    head_step(logits, token, hidden, run, codes, params)   a head policy's whole decision input in one call:
                                                           -> (probability, confidence, entropy, top-1)
    softmax_scalars(logits, token)       (V,) raw logits -> (confidence, entropy, top-1) of their softmax
    softmax_scalars_rows(logits, tokens) (R, V) and (R,) -> (3, R), the same per row
    mlp_prob(hidden, extras, params)     (H,) state and (E,) extras -> the head's calibrated probability
    head_rows(logits, tokens, hidden, runs, codes, params)   head_step over R rows -> (4, R)
    round_progress(reach, surv, deciding, a, k, later)       decode.control's expected progress of a round
                                                           stopping after j = 0 .. later more candidates
A batch controller decides after every draft step too, and its numpy path (about 60 array ops) took 340 us a
decision in the loop at batch 8, 3-5% of a round; small batches (up to ROWS_MAX rows) take the compiled rows paths.
Larger ones keep the numpy head (AcceptanceHead.inference_fn on (R, D)), whose BLAS matmul wins once there are rows
to amortise a call over, and decode.policies.draft_scalars runs softmax_scalars_rows (as fast as its numpy twin at
64 rows); tests hold every compiled path equal to its numpy twin. Without numba installed (HAVE_NUMBA False) callers
use the numpy paths. heads.tree_kernels holds a token tree's (a level's children, the sibling head, the draws and
the walk's tests).
"""

from __future__ import annotations

import math

import numpy as np

from heads.features import RUN_CAP

try:
    import numba
except ImportError:  # the numpy paths serve (slower at batch 1)
    numba = None

HAVE_NUMBA = numba is not None
LOG2E = 1.4426950408889634
# 2^r on [0, 1): the Taylor coefficients of exp(r ln 2) to r^7, largest relative error 7.2e-7 (on a grid of
# 10^5 points, tests/test_kernels.py), below float32's rounding of the sums it feeds
POLY = (0.6931471805599453, 0.2402265069591007, 0.055504108664821576, 0.009618129107628477,
        0.0013333558146428441, 0.00015403530393381606, 1.5252733804059838e-05)


# fast-math without "no infs, no nans": -inf logits (tokens a processor masked) stay well defined
FAST = {"reassoc", "contract", "nsz", "arcp", "afn"}


def _jit(fn):
    return numba.njit(cache=True, fastmath=FAST, nogil=True)(fn) if HAVE_NUMBA else None


def _exp_sums(x, m, work):
    """sum(exp(s)) and sum(exp(s) * s) over s = x - m, (V,) float32 x of maximum m.

    exp by 2^n * 2^r with n an integer built in the exponent bits (work's second half, viewed as int32) and 2^r a
    polynomial: every loop vectorises, where a call to exp per element does not (8.7 against 5.6 us at V = 4096).
    s is floored at -87 (2^-126): below it a term adds under 1e-36 to a sum >= 1, and -inf logits add no nan."""
    v = x.shape[0]
    frac, bits = work[:v], work[v:].view(np.int32)
    c1, c2, c3, c4 = np.float32(POLY[0]), np.float32(POLY[1]), np.float32(POLY[2]), np.float32(POLY[3])
    c5, c6, c7 = np.float32(POLY[4]), np.float32(POLY[5]), np.float32(POLY[6])
    floor = np.float32(-126.0 / LOG2E)
    for i in range(v):
        y = max(x[i] - m, floor) * np.float32(LOG2E)
        n = np.floor(y)
        r = y - n
        frac[i] = np.float32(1.0) + r * (c1 + r * (c2 + r * (c3 + r * (c4 + r * (c5 + r * (c6 + r * c7))))))
        bits[i] = (np.int32(n) + np.int32(127)) << 23
    scale = work[v:]
    total = np.float32(0.0)
    dot = np.float32(0.0)
    for i in range(v):
        e = frac[i] * scale[i]
        total += e
        dot += e * max(x[i] - m, floor)
    return total, dot


def _softmax_scalars(x, token, work):
    m = x[0]
    for i in range(x.shape[0]):
        m = max(m, x[i])
    total, dot = _exp_sums(x, m, work)
    return math.exp(x[token] - m) / total, math.log(total) - dot / total, 1.0 / total


def _softmax_scalars_rows(x, tokens, work, out):
    for r in range(x.shape[0]):
        c, e, t = _softmax_scalars(x[r], tokens[r], work)
        out[0, r], out[1, r], out[2, r] = c, e, t


def _mlp_prob(hidden, extras, inv, shift, w, b, w_out, b_out):
    """The residual blocks of AcceptanceHead.inference_fn, folded alike (the first block's weights read the raw
    features, its skip the normalised ones), over the features hidden (H,) then extras (E,), never concatenated.
    w: (L, D, D) weights as (out, in), b: (L, D), D = H + E; L = 0 is a linear head."""
    nh, d = hidden.shape[0], inv.shape[0]
    x = np.empty(d, dtype=np.float32)
    h = np.empty(d, dtype=np.float32)
    z = np.empty(d, dtype=np.float32)
    for j in range(nh):
        x[j] = hidden[j]
    for j in range(nh, d):
        x[j] = extras[j - nh]
    for j in range(d):
        h[j] = x[j] * inv[j] + shift[j]
    for layer in range(w.shape[0]):
        src = x if layer == 0 else h
        for j in range(d):
            acc = np.float32(0.0)
            for i in range(d):
                acc += w[layer, j, i] * src[i]
            z[j] = acc + b[layer, j]
        for j in range(d):
            h[j] += z[j] / (np.float32(1.0) + np.float32(math.exp(-z[j])))
    acc = np.float32(0.0)
    for j in range(d):
        acc += h[j] * w_out[j]
    return 1.0 / (1.0 + math.exp(-(acc + b_out)))


def _head_step(logits, token, hidden, run, codes, work, inv, shift, w, b, w_out, b_out):
    """softmax_scalars of the candidate's logits, the extras they and the accepted run make (codes: each extra's
    index in heads.features.EXTRAS, in order), then the head: one call for a head policy's whole decision input."""
    conf, ent, top1 = np.float32(0.0), np.float32(0.0), np.float32(0.0)
    if logits.shape[0]:
        conf, ent, top1 = _softmax_scalars(logits, token, work)
    extras = np.empty(codes.shape[0], dtype=np.float32)
    _extras_into(extras, codes, ent, top1, conf, run, 0)  # cand_rank 0: a chain's candidate is its node's first child
    return _mlp_prob(hidden, extras, inv, shift, w, b, w_out, b_out), conf, ent, top1


def _extras_into(extras, codes, ent, top1, conf, run, rank):
    """Write the extras that codes name (each extra's index in heads.features.EXTRAS, in order), as FeatureSpec.rows."""
    for i in range(codes.shape[0]):
        c = codes[i]
        if c == 0:
            extras[i] = ent
        elif c == 1:
            extras[i] = top1
        elif c == 2:
            extras[i] = math.log(max(conf, 1e-20))
        elif c == 3:
            extras[i] = math.log1p(min(max(run, 0), RUN_CAP))
        else:
            extras[i] = rank


def _head_rows(logits, tokens, hidden, runs, codes, work, out, inv, shift, w, b, w_out, b_out):
    for r in range(hidden.shape[0]):
        out[0, r], out[1, r], out[2, r], out[3, r] = _head_step(logits[r], tokens[r], hidden[r], runs[r], codes, work,
                                                                inv, shift, w, b, w_out, b_out)


def _round_progress(reach, surv, deciding, a, k, later, out):
    """out[j] = max(reach) - E[max_i reach_i - y_i] if the deciding rows draft j more candidates, each surviving at
    a[i]; y_i = 1 + row i's accepted candidates, P(y_i > m) = surv[i, m] up to m = k, then surv[i, k] * a[i]^(m - k)
    for deciding rows (up to k + j) and 0 past that. E[max] = z_top - sum over z < z_top of P(max <= z)."""
    n = reach.shape[0]
    most, least = reach[0], reach[0]
    for i in range(n):
        most, least = max(most, reach[i]), min(least, reach[i])
    for j in range(later + 1):
        e = float(most - 1)
        for z in range(least - k - later - 1, most - 1):
            below = 1.0
            for i in range(n):
                need = reach[i] - z  # max <= z needs y_i >= need, that is y_i > need - 1
                if need <= 1:
                    continue
                m = need - 1
                if m <= k:
                    below *= surv[i, m]
                elif deciding[i] and m <= k + j:
                    below *= surv[i, k] * a[i] ** (m - k)
                else:
                    below = 0.0
                if below == 0.0:
                    break
            e -= below
        out[j] = most - e


_exp_sums = _jit(_exp_sums) or _exp_sums
_softmax_scalars = _jit(_softmax_scalars) or _softmax_scalars
_mlp_prob = _jit(_mlp_prob) or _mlp_prob
_extras_into = _jit(_extras_into) or _extras_into
_head_step = _jit(_head_step) or _head_step
_head_step_k = _head_step if HAVE_NUMBA else None
_head_rows_k = _jit(_head_rows)
_round_progress_k = _jit(_round_progress)
ROWS_MAX = 32  # up to this many rows, a batch's head and controller use the compiled rows paths
_softmax_scalars_k = _softmax_scalars
_softmax_scalars_rows_k = _jit(_softmax_scalars_rows)
_NONE = np.zeros(0, dtype=np.float32)
_WORK: dict[int, np.ndarray] = {}  # softmax_scalars' (2V,) work array by V: a fresh 32 KB array faults pages in


def _work(v: int) -> np.ndarray:
    if v not in _WORK:
        _WORK[v] = np.empty(2 * v, dtype=np.float32)
    return _WORK[v]


def softmax_scalars(logits: np.ndarray, token: int) -> tuple[float, float, float]:
    """(V,) float32 raw logits and a token -> the softmax's probability of the token, entropy in nats, top-1."""
    return _softmax_scalars_k(logits, token, _work(logits.shape[-1]))


def softmax_scalars_rows(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """(R, V) float32 raw logits and (R,) tokens -> (3, R) float64: softmax_scalars of each row."""
    out = np.empty((3, logits.shape[0]))
    _softmax_scalars_rows_k(logits, tokens, _work(logits.shape[-1]), out)
    return out


def check_width(features: int, extras: int, params: tuple) -> None:
    """Raise ValueError unless H state features and E extras are the D a head's folded parameters read: the compiled
    kernels index without bounds checks, so a state of another width would write past their buffers."""
    if features + extras != params[0].shape[0]:
        raise ValueError(f"the head reads {params[0].shape[0]} features, got a state of {features} and {extras} "
                         "extras: it was trained on another draft (its config.json names the draft it reads)")


def mlp_prob(hidden: np.ndarray, extras: np.ndarray, params: tuple) -> float:
    """(H,) and (E,) float32 features and AcceptanceHead.inference_fn's folded parameters -> the probability."""
    check_width(hidden.shape[-1], extras.shape[0], params)
    return _mlp_prob(hidden, extras, *params)


def head_step(logits: np.ndarray | None, token: int, hidden: np.ndarray, run: int, codes: np.ndarray,
              params: tuple) -> tuple[float, float, float, float]:
    """A head policy's decision input in one call: (V,) raw logits (None: the extras read no softmax), the
    candidate, (H,) state, the accepted run before it and the extras' codes -> (probability, confidence,
    entropy, top-1)."""
    v = 0 if logits is None else logits.shape[0]
    check_width(hidden.shape[-1], codes.shape[0], params)
    if v and not 0 <= token < v:
        raise ValueError(f"candidate token {token} is outside the draft's {v} logits")
    return _head_step_k(_NONE if logits is None else logits, token, hidden, run, codes, _work(v), *params)


def head_rows(logits: np.ndarray | None, tokens: np.ndarray, hidden: np.ndarray, runs: np.ndarray, codes: np.ndarray,
              params: tuple) -> np.ndarray:
    """head_step over R rows: (R, V) raw logits (None: no softmax read), (R,) tokens, (R, H) states, (R,) runs ->
    (4, R) float64 rows of probability, confidence, entropy and top-1."""
    out = np.empty((4, hidden.shape[0]))
    v = 0 if logits is None else logits.shape[-1]
    check_width(hidden.shape[-1], codes.shape[0], params)
    rows, logit_rows = hidden.shape[0], None if logits is None else logits.shape[0]
    if not len(tokens) == len(runs) == rows or logit_rows not in (None, rows):
        raise ValueError(f"head_rows needs one token, run and logits row per state row, got {len(tokens)} tokens, "
                         f"{len(runs)} runs, {rows} states and {logit_rows or 'no'} logits rows")
    if v and len(tokens) and not (0 <= tokens.min() and tokens.max() < v):
        raise ValueError(f"candidate tokens must lie in the draft's {v} logits, got {tokens.min()}..{tokens.max()}")
    if logits is None:  # rows of no logits: _head_step reads no softmax
        logits = np.zeros((hidden.shape[0], 0), dtype=np.float32)
    _head_rows_k(logits, tokens, hidden, runs, codes, _work(v), out, *params)
    return out


def round_progress(reach: np.ndarray, surv: np.ndarray, deciding: np.ndarray, a: np.ndarray, k: int,
                   later: int) -> np.ndarray:
    """(R,) int64 remaining budgets, (R, M) float64 survivals (columns 0..k filled), (R,) bool deciding rows and
    (R,) float64 their last probabilities -> (later + 1,) expected progress of stopping after j more candidates."""
    out = np.empty(later + 1)
    _round_progress_k(reach, surv, deciding, a, k, later, out)
    return out


def warm(vocab_size: int) -> None:
    """Compile (or load from numba's cache) the kernels for the arrays decoding passes, so that the first draft
    step of a timed generation does not pay for it."""
    if HAVE_NUMBA:
        round_progress(np.ones(2, dtype=np.int64), np.ones((2, 2)), np.ones(2, dtype=bool), np.ones(2), 1, 1)
        softmax_scalars(np.zeros(vocab_size, dtype=np.float32), 0)
        softmax_scalars_rows(np.zeros((1, vocab_size), dtype=np.float32), np.zeros(1, dtype=np.int64))
