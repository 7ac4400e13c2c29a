"""Verifying a token tree: greedy matching along the target's argmax, or recursive rejection over siblings drawn
without replacement (docs/design.md, "Token trees"), beside the chain rules of decode.rules.chain. decode.tree.round
calls walk() once a round, after the target's forward over every row's tree.
"""

from __future__ import annotations

import numpy as np
import torch

from decode.labels import sibling_tests
from decode.sampling import argmax, as_numpy, sample, transform
from decode.streams import Streams
from heads import kernels, tree_kernels


def walk(trees: list, logits: torch.Tensor, sampling, streams: Streams) -> list[tuple[list[int], int]]:
    """Each row's tree (decode.tree.RowTree) and the target's (B, 1 + n, V) logits after its root and nodes -> each
    row's accepted path (its nodes, root excluded) and next token."""
    if sampling.temperature == 0:
        best = argmax(logits).tolist()
        out = []
        for t, bst in zip(trees, best):
            kids, v, path = t.children(), 0, []
            while True:
                nxt = next((c for c in kids.get(v, []) if t.tokens[c] == bst[v]), None)
                if nxt is None:
                    out.append((path, bst[v]))
                    break
                v = nxt
                path.append(v)
        return out
    u = streams.draw([len(t.tokens) for t in trees]).tolist()  # n + 1 per row: one a node, one for the last draw
    starts = [0]
    for t in trees:
        starts.append(starts[-1] + len(t.tokens))
    kids = [t.children() for t in trees]
    items = [(b, v, cs) for b, k in enumerate(kids) for v, cs in sorted(k.items())]  # every node with children
    alpha, left, at = [], None, {}
    if items:  # every node's sibling tests at once: one transform, one pass per sibling rank, one host read
        dev = logits.device
        p = transform(logits[torch.tensor([b for b, _, _ in items], device=dev),
                             torch.tensor([v for _, v, _ in items], device=dev)], sampling)
        q = torch.stack([trees[b].q[v] for b, v, _ in items])
        m = max(len(cs) for _, _, cs in items)
        x = [[trees[b].tokens[c] for c in cs] + [-1] * (m - len(cs)) for b, _, cs in items]
        if kernels.HAVE_NUMBA and dev.type == "cpu" and p.dtype == q.dtype == torch.float32:  # no pass per rank
            a, left = tree_kernels.sibling_tests(as_numpy(p), as_numpy(q), np.asarray(x, dtype=np.int64))
            left = torch.from_numpy(left)
        else:
            a, left = sibling_tests(p, q, torch.tensor(x, device=dev))
        alpha, at = a.tolist(), {(b, v): i for i, (b, v, _) in enumerate(items)}
    paths, laws = [], []  # a row's law: ("left", i), item i's residual after all its children, or ("p", b, v)
    for b in range(len(trees)):
        v, path, ub = 0, [], u[starts[b]: starts[b + 1]]
        while True:
            i = at.get((b, v))
            if i is None:
                laws.append(("p", b, v))
                break
            cs = items[i][2]
            j = next((j for j, c in enumerate(cs) if ub[c - 1] < alpha[i][j]), None)
            if j is None:
                laws.append(("left", i))
                break
            v = cs[j]
            path.append(v)
        paths.append(path)
    leaf = [(w[1], w[2]) for w in laws if w[0] == "p"]
    leaf_p = iter(transform(logits[torch.tensor([b for b, _ in leaf], device=logits.device),
                                   torch.tensor([v for _, v in leaf], device=logits.device)], sampling)
                  if leaf else [])
    law = torch.stack([left[w[1]] if w[0] == "left" else next(leaf_p) for w in laws])
    last = torch.tensor([[u[starts[b + 1] - 1]] for b in range(len(trees))], dtype=torch.float64, device=law.device)
    return list(zip(paths, sample(law, u=last).tolist()))


def first_accepted(p: torch.Tensor, q: torch.Tensor, tokens: list[int], u: list[float]) -> int | None:
    """Recursive rejection at one node (sibling_tests): (V,) p and q, the children drawn and one uniform each -> the
    index of the accepted child, or None if all are rejected."""
    if not tokens:
        return None
    alpha = sibling_tests(p[None], q[None], torch.tensor([tokens], device=p.device))[0][0].tolist()
    return next((j for j, a in enumerate(alpha) if u[j] < a), None)

def check_tree(pair, rule) -> None:
    """Refuse, before decoding, what a tree round cannot serve: a sliding-window model (its window is measured in
    cache columns, which a tree's siblings interleave) and a rule other than the lossless two."""
    from decode.cache.rows import windowed
    from decode.rules.chain import GreedyMatch, SpeculativeSampling

    for role in ("draft", "target"):
        if windowed(getattr(pair, role).config):
            raise ValueError(f"token trees need full attention: the {role} ({type(getattr(pair, role)).__name__}) "
                             "attends over a sliding window, which a tree's interleaved siblings would misplace; "
                             "decode it with a chain policy (e.g. FixedK)")
    if type(rule) not in (GreedyMatch, SpeculativeSampling) or \
            (pair.config.sampling.temperature > 0 and type(rule) is not SpeculativeSampling):
        raise ValueError(f"token trees verify by greedy matching (temperature 0) or recursive rejection sampling: use "
                         f"GreedyMatch or SpeculativeSampling, not {type(rule).__name__} at temperature "
                         f"{pair.config.sampling.temperature:g}")
