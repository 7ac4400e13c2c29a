"""Speculative sampling's verification of a batch of rows in one compiled call, for decoding on the CPU.

    verdicts = speculative_rows(p, q, tokens, us)  # each row's (accepted, next token)

The tensor path (decode.rules.SpeculativeSampling.verify_rows) runs about 20 tensor ops a round, each on caches the
target's forward left cold, a few percent of the wall on the embedded pair (docs/batch.md). This does the same work with no temporaries: each row's alphas and accept tests, then one inverse-CDF pass
over its law (its bonus p, or norm(max(0, p - q)) at its rejection, p where that has no mass). It reads the same
uniforms the tensor path reads, so the two give the same verdicts (tests/test_kernels.py); without numba the
tensor path serves.
"""

from __future__ import annotations

import numpy as np

from heads.kernels import HAVE_NUMBA, numba


def _speculative_rows(p, q, tokens, ks, us, out):
    """p (R, M + 1, V) and q (M, R, V) float32, tokens (R, M) int64 (row r's first ks[r]), us: each row's k + 1
    uniforms in turn (one per candidate, then the final draw's) -> out (2, R): accepted, next token."""
    u0 = 0
    v_size = p.shape[2]
    for r in range(ks.shape[0]):
        k = ks[r]
        n = k
        for i in range(k):
            x = tokens[r, i]
            qx = q[i, r, x]
            alpha = min(np.float32(1.0), p[r, i, x] / qx) if qx > 0 else np.float32(1.0)  # as labels.accept_prob
            if us[u0 + i] >= alpha:
                n = i
                break
        resid = n < k
        total = 0.0
        if resid:
            for v in range(v_size):
                total += max(0.0, np.float64(p[r, n, v]) - np.float64(q[n, r, v]))
            resid = total > 0.0
        if not resid:
            total = 0.0
            for v in range(v_size):
                total += np.float64(p[r, n, v])
        target = us[u0 + k] * total
        cum, token, last = 0.0, -1, 0
        for v in range(v_size):
            m = max(0.0, np.float64(p[r, n, v]) - np.float64(q[n, r, v])) if resid else np.float64(p[r, n, v])
            if m > 0.0:
                last = v
            cum += m
            if cum > target:  # the first token whose running mass exceeds u times the total (decode.sampling.sample)
                token = v
                break
        out[0, r] = n
        out[1, r] = token if token >= 0 else last  # rounding left u * total at the very top: the last token of mass
        u0 += k + 1


# no fast-math: the running sums must add in order, as the tensor path's cumsum does
_speculative_rows_k = numba.njit(cache=True, nogil=True)(_speculative_rows) if HAVE_NUMBA else None


def speculative_rows(p: np.ndarray, q: np.ndarray, tokens: list[list[int]], us: np.ndarray) -> list[tuple[int, int]]:
    """(R, M + 1, V) and (M, R, V) float32 probabilities, each row's candidates and (sum(k + 1),) float64 uniforms
    -> each row's (accepted, next token)."""
    ks = np.array([len(t) for t in tokens], dtype=np.int64)
    padded = np.zeros((len(tokens), max(1, int(ks.max(initial=0)))), dtype=np.int64)
    for r, t in enumerate(tokens):
        padded[r, : len(t)] = t
    out = np.empty((2, len(tokens)), dtype=np.int64)
    _speculative_rows_k(p, q, padded, ks, us, out)
    return list(zip(*out.tolist()))


def warm(vocab_size: int) -> None:
    """Compile (or load from numba's cache) before any timed round."""
    if HAVE_NUMBA:
        p = np.full((1, 2, vocab_size), 1.0 / vocab_size, dtype=np.float32)
        speculative_rows(p, p[:, :1].transpose(1, 0, 2).copy(), [[0]], np.zeros(2))
