"""Compiled paths of a token-tree round on the CPU (decode.tree.round, decode.tree.head), beside heads.kernels' chain ones.

A tree level at batch 1 is a handful of nodes, and each tensor op on them costs its dispatch, which after a forward
runs on cold caches: topk, softmax, the draws without replacement and recursive rejection's tests made a pass of
several ops per sibling rank (3.8 ms of host work a round of the head tree at batch 1 on a 2-core CPU, 1.5 ms of it
the sibling head's array path). These do each in one call:
    top_children(logits, counts)              (N, V), (N,) -> a greedy level's children, best first, and their probabilities
    head_children(logits, tokens, hidden, runs, codes, params)   a sibling head over a level's children
    draws_without_replacement(q, counts, u)   a sampled level's children, token for token as decode.tree.round draws them
    sibling_tests(p, q, x)                    recursive rejection's tests at a tree's nodes (decode.labels.sibling_tests)
    best_width(existing, guess, spent, ...)   how many frontier nodes a head tree's level expands
Callers keep the tensor paths for a GPU, many nodes and machines without numba (heads.kernels.HAVE_NUMBA False);
tests hold each kernel to its twin.
"""

from __future__ import annotations

import math

import numpy as np

from heads.kernels import HAVE_NUMBA, _exp_sums, _extras_into, _jit, _mlp_prob, _work, check_width

if HAVE_NUMBA:
    import numba


def _top_children(logits, counts, tokens, probs, work):
    """Row n's counts[n] tokens of highest logit (ties: the lower id), best first, and their softmax probabilities
    (where fewer tokens have mass, some of no mass, as topk gives them); tokens[n, j] = -1 and probs[n, j] = 0 past
    counts[n]. One pass over V a row, where topk and softmax are two."""
    for n in range(logits.shape[0]):
        x, k = logits[n], min(counts[n], logits.shape[1])  # no more children than tokens
        for j in range(tokens.shape[1]):
            tokens[n, j], probs[n, j] = -1, 0.0
        m = x[0]
        for i in range(x.shape[0]):
            m = max(m, x[i])
            v, j = x[i], k
            while j > 0 and (tokens[n, j - 1] < 0 or x[tokens[n, j - 1]] < v):
                j -= 1
            if j < k:
                for t in range(k - 1, j, -1):
                    tokens[n, t] = tokens[n, t - 1]
                tokens[n, j] = i
        total, _ = _exp_sums(x, m, work)
        for j in range(k):
            probs[n, j] = math.exp(x[tokens[n, j]] - m) / total


def _head_children(logits, tokens, hidden, runs, codes, work, out, inv, shift, w, b, w_out, b_out):
    """A sibling head over each expanded node's children: out[n, j] = a_j * prod_{i<j} (1 - a_i), a_j the head's
    chance that child j (rank j, tokens[n, j]; -1: none) is accepted once the children before it were rejected,
    from the softmax scalars of row n's raw logits (computed once a node) and run runs[n]."""
    extras = np.empty(codes.shape[0], dtype=np.float32)
    for n in range(logits.shape[0]):
        x = logits[n]
        m = x[0]
        for i in range(x.shape[0]):
            m = max(m, x[i])
        total, dot = _exp_sums(x, m, work)
        ent, top1, survive = math.log(total) - dot / total, 1.0 / total, 1.0
        for j in range(tokens.shape[1]):
            out[n, j] = 0.0
            if tokens[n, j] < 0:
                continue
            _extras_into(extras, codes, ent, top1, math.exp(x[tokens[n, j]] - m) / total, runs[n], j)
            a = _mlp_prob(hidden[n], extras, inv, shift, w, b, w_out, b_out)
            out[n, j] = a * survive
            survive *= 1.0 - a


def _draws_without_replacement(q, counts, u, out):
    """decode.tree.round.without_replacement, one law at a time: law n's counts[n] draws, each by sample()'s inverse CDF
    (the first token whose float64 running mass, summed in order, exceeds u times the total; past the end, the
    last token with mass) on the law with the earlier draws removed. A law left with no mass draws no more (-1)."""
    k = 0
    for n in range(q.shape[0]):
        law = q[n].astype(np.float64)
        for j in range(out.shape[1]):
            out[n, j] = -1
        for j in range(counts[n]):
            total, last, best = 0.0, 0, 0.0
            for i in range(law.shape[0]):
                total += law[i]
            if total > 0:
                target, acc, tok = u[k + j] * total, 0.0, -1
                for i in range(law.shape[0]):
                    acc += law[i]
                    if acc > best:  # the first maximum of the running sums: the last token with mass
                        best, last = acc, i
                    if tok < 0 and acc > target:
                        tok = i
                out[n, j] = last if tok < 0 else tok
                law[out[n, j]] = 0.0
        k += counts[n]


def _sibling_tests(p, q, x, alpha, left):
    """decode.labels.sibling_tests node by node, in float64: (N, V) p and q, (N, m) children (-1: none) -> alpha
    (N, m) each child's chance to be accepted once the earlier ones were rejected, left (N, V) the residual after
    them all. r_1 = p; q_j is q with the earlier children removed, renormalised; r_{j+1} = norm(max(r_j - q_j, 0)),
    or r_j where that has no mass."""
    v = p.shape[1]
    r, qq, nxt = np.empty(v), np.empty(v), np.empty(v)
    for n in range(p.shape[0]):
        for i in range(v):
            r[i], qq[i] = p[n, i], q[n, i]
        for j in range(x.shape[1]):
            t = x[n, j]
            alpha[n, j] = 0.0
            if t < 0:
                continue
            if j > 0:
                mass = 0.0
                for i in range(v):
                    mass += qq[i]
                mass = max(mass, 1.1754943508222875e-38)
                for i in range(v):
                    qq[i] /= mass
            alpha[n, j] = 1.0 if qq[t] <= 0 else min(1.0, r[t] / qq[t])
            mass = 0.0
            for i in range(v):
                nxt[i] = max(r[i] - qq[i], 0.0)
                mass += nxt[i]
            if mass > 0:
                for i in range(v):
                    r[i] = nxt[i] / mass
            qq[t] = 0.0
        for i in range(v):
            left[n, i] = r[i]


def _best_width(existing, guess, spent, level, verify, nodes):
    """decode.tree.head.best_width's loop: each width's values sorted, their prefix sums and rates, in one call."""
    best_rate, best_w = -1.0, 0
    for w in range(guess.shape[0] + 1):
        vals = -np.sort(-np.concatenate((existing, guess[:w].ravel())))
        cost = spent + (level[w] if w > 0 else 0.0)
        total, rate = 0.0, 1.0 / (cost + verify[0])
        for j in range(min(len(vals), nodes)):
            total += vals[j]  # 1 + the running sum, as the twin's 1 + cumsum: the same floats, the same ties
            rate = max(rate, (1.0 + total) / (cost + verify[j + 1]))
        if rate > best_rate:  # ties: the fewer nodes
            best_rate, best_w = rate, w
    return best_w


_top_children_k = _jit(_top_children)
_head_children_k = _jit(_head_children)
_sibling_tests_k = _jit(_sibling_tests)
# no fast-math: the running sums must add in order, as torch's cumsum does, for the same token on the same uniform
_draws_k = numba.njit(cache=True, nogil=True)(_draws_without_replacement) if HAVE_NUMBA else None
_best_width_k = numba.njit(cache=True, nogil=True)(_best_width) if HAVE_NUMBA else None  # no fast-math: exact ties


def top_children(logits: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, V) float32 raw logits and (N,) int64 counts -> (N, max count) int64 each row's top tokens, best first (-1
    past its count), and (N, max count) float64 their softmax probabilities: a greedy tree level's children."""
    most = int(counts.max()) if len(counts) else 0
    tokens, probs = np.empty((len(counts), most), dtype=np.int64), np.empty((len(counts), most))
    _top_children_k(logits, counts, tokens, probs, _work(logits.shape[-1]))
    return tokens, probs


def head_children(logits: np.ndarray, tokens: np.ndarray, hidden: np.ndarray, runs: np.ndarray, codes: np.ndarray,
                  params: tuple) -> np.ndarray:
    """A sibling head over a tree level: (N, V) float32 raw logits after each expanded node, (N, m) int64 its
    children (-1: none), (N, H) states, (N,) runs -> (N, m) float64 each child's chance to be the accepted one given
    its parent is (decode.tree.HeadTree.weigh)."""
    check_width(hidden.shape[-1], codes.shape[0], params)
    if not logits.shape[0] == tokens.shape[0] == hidden.shape[0] == len(runs) or tokens.max(initial=-1) >= logits.shape[-1]:
        raise ValueError(f"head_children needs a logits row, children row, state and run per node and children in the "
                         f"vocabulary, got {logits.shape}, {tokens.shape}, {hidden.shape[0]} states, {len(runs)} runs")
    out = np.empty(tokens.shape)
    _head_children_k(logits, tokens, hidden, runs, codes, _work(logits.shape[-1]), out, *params)
    return out


def draws_without_replacement(q: np.ndarray, counts: np.ndarray, u: np.ndarray) -> np.ndarray:
    """(N, V) float32 laws, (N,) int64 counts and their float64 uniforms, law by law -> (N, max count) int64 draws
    without replacement, -1 where a law ran out of mass: decode.tree.round.without_replacement's draws, token for token."""
    out = np.empty((len(counts), int(counts.max()) if len(counts) else 0), dtype=np.int64)
    _draws_k(q, counts, u, out)
    return out


def sibling_tests(p: np.ndarray, q: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """decode.labels.sibling_tests on the CPU for a tree's few nodes: (N, V) float32 p and q, (N, m) int64 children
    -> (N, m) float64 alpha and (N, V) float32 the residual after every child."""
    alpha, left = np.empty(x.shape), np.empty(p.shape, dtype=np.float32)
    _sibling_tests_k(p, q, x, alpha, left)
    return alpha, left


def best_width(existing: np.ndarray, guess: np.ndarray, spent: float, level: np.ndarray, verify: np.ndarray,
               nodes: int) -> int:
    """decode.tree.head.best_width compiled: how many of a level's best frontier nodes to expand."""
    return int(_best_width_k(existing, guess, float(spent), level, verify, nodes))
