"""Tree shapes: which nodes a round's token tree grows and which it sends to the target (docs/design.md, Token trees).

    BatchDecoder(pair.with_sampling(temperature=0.0), SequoiaTree([0.72, 0.15, 0.04], nodes=15, depth=6), GreedyMatch())
    BatchDecoder(pair, ConfidenceTree(top_k=4, depth=6, nodes=16), SpeculativeSampling())

A shape is a decode.control.BatchControl, so decode.batch.BatchDecoder (and SpeculativeDecoder, through a
batch of one row) decode with it as with any control. Each row's tree grows level by level: the shape says how many
children each frontier node gets (the draft's top choices under greedy, draws without replacement under sampling),
then which of the drafted nodes the target verifies. A kept node's parent and earlier siblings are always kept:
recursive rejection tests siblings in the order they were drawn.

Under sampling a shape prunes before it draws, never after (docs/trees.md, "Pruning under sampling"): recursive
rejection emits the target's law only if how many of a node's children the target tests does not depend on what those
children turned out to be. So a sampled round verifies every child it drew, and a shape sizes each level in
children() from what is already drawn (the frontier, its ancestors), never from the children's own draws; keeping
the best nodes by value after drawing (best_first) is for greedy rounds alone.
"""

from __future__ import annotations

import functools
import heapq
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from decode.checks import is_whole
from decode.control import BatchControl


class TreeShape(BatchControl):
    """A control that proposes token trees. depth: the most levels (candidates on one path) a round drafts."""

    depth = 1

    def begin(self, b, remaining=None):
        """A round at batch size b, each row's remaining budget -> how many levels it may draft (0: none, a plain
        target step; the draft reads the text it skipped when a later round drafts)."""
        return self.depth

    def children(self, level: int, tree, frontier: list[int]) -> list[int]:
        """One row's tree (decode.tree.round.RowTree) and its frontier at `level` (0: the root alone) -> how many children
        the draft proposes for each frontier node (0: not expanded). Under sampling (tree.sampled) these counts are
        final: the target verifies every child drawn, up to the round's node budget (tree.room nodes still free)."""
        raise NotImplementedError

    def weigh(self, level: int, nodes: NodeBatch) -> list[list[float]]:
        """The expanded nodes of this level, their children drawn -> each child's chance to be on the accepted path
        given its parent is (a node's value is the product along its path). By default the draft's probability of
        the child (EAGLE-2's confidence); decode.tree.HeadTree asks a trained head."""
        return nodes.probs

    def keep(self, tree, most: int) -> list[int]:
        """One row's drafted tree -> the nodes the target verifies, in drafting order. Greedy: the best `most` by
        value, each with its parent and earlier siblings (best_first). Sampling: every drafted node (see the module;
        decode.tree.round refuses a shape whose keep drops a drawn node there)."""
        if tree.sampled:
            return list(range(1, len(tree.value)))
        return best_first(tree.value, tree.parent, tree.rank, most)

    def tree_verified(self, accepted: list[int], whole: list[bool]) -> None:
        """Each row's accepted path length, and whether the path ended at a leaf (no rejection ended it)."""

    def tree_timed(self, grow_ms: float, rest_ms: float, draft_ms: float | None = None,
                   verify_ms: float | None = None) -> None:
        """The ms the round spent outside the models' forwards: growing the tree (drawing, weighing, the levels'
        masks) and the rest (the target's masks, the walk, the caches' bookkeeping); and in its draft forwards and
        its verify (None in a round that read a prompt too)."""


@dataclass
class NodeBatch:
    """The nodes one level expands, over every row: row b of the batch, the node's depth, the draft's (V,) raw logits
    and (H,) last hidden state after it (None unless the shape needs_hidden), and its children's tokens and draft
    probabilities (greedy: the raw softmax's, sampling: the sampling law q's), in rank order."""

    rows: list[int]
    depth: list[int]
    logits: torch.Tensor  # (N, V)
    hidden: torch.Tensor | None  # (N, H)
    tokens: list[list[int]]
    probs: list[list[float]]

    @functools.cached_property
    def softmax(self) -> torch.Tensor:
        """(N, V) float32 the raw logits' softmax (the drafting pass sets it where it computed one)."""
        return self.logits.float().softmax(-1)


def best_first(value: Sequence[float], parent: Sequence[int], rank: Sequence[int], most: int) -> list[int]:
    """The `most` highest-value nodes (node 0, the root, excluded) such that every kept node's parent and earlier
    siblings are kept too, in increasing node order (best_order's first `most`, sorted)."""
    return sorted(best_order(value, parent, rank, most))


def best_order(value: Sequence[float], parent: Sequence[int], rank: Sequence[int], most: int) -> list[int]:
    """best_first's nodes in the order it keeps them: a node becomes eligible once its parent and its previous sibling
    are kept; the best eligible one is kept next (ties go to the earlier node)."""
    kids: dict[int, list[int]] = {}
    for i in range(1, len(value)):
        kids.setdefault(parent[i], []).append(i)
    for v in kids.values():
        v.sort(key=lambda i: rank[i])
    heap = [(-value[kids[0][0]], kids[0][0])] if kids.get(0) else []
    kept: list[int] = []
    while heap and len(kept) < most:
        _, i = heapq.heappop(heap)
        kept.append(i)
        sibs = kids[parent[i]]
        at = sibs.index(i)
        for j in ([sibs[at + 1]] if at + 1 < len(sibs) else []) + kids.get(i, [])[:1]:
            heapq.heappush(heap, (-value[j], j))
    return kept


class StaticTree(TreeShape):
    """One fixed tree every round, given as the rank paths of its nodes (vLLM's speculative_token_tree form): (0,)
    is the draft's top choice after the root, (1,) its second, (0, 0) the top choice after (0,), and so on. A chain
    of k candidates is [(0,), (0, 0), ...]. Under sampling a rank is a draw's order (without replacement)."""

    def __init__(self, paths: Sequence[Sequence[int]]):
        paths = _rank_paths(paths)
        self.paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        if not self.paths or any(not p for p in self.paths):
            raise ValueError("a static tree needs at least one non-empty rank path, e.g. [[0], [1], [0, 0]]")
        have = set(self.paths)
        for p in self.paths:
            if p[:-1] and p[:-1] not in have or p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in have:
                raise ValueError(f"rank path {list(p)} needs its parent and earlier siblings in the tree too")
        self.depth = max(map(len, self.paths))
        self.wide: dict[tuple[int, ...], int] = {}
        for p in self.paths:
            self.wide[p[:-1]] = max(self.wide.get(p[:-1], 0), p[-1] + 1)
        self.nodes = len(self.paths)

    def children(self, level, tree, frontier):
        return [self.wide.get(tree.path[i], 0) for i in frontier]

    def keep(self, tree, most):
        return list(range(1, min(len(tree.value), most + 1)))  # every drafted node, in drafting order

    @classmethod
    def sequoia(cls, accept: Sequence[float], nodes: int, depth: int) -> StaticTree:
        """Sequoia's tree under the positional model: the j-th child of any node is accepted with probability
        accept[j] given its parent was, so a node's value is the product along its rank path and the best tree of
        `nodes` nodes with at most `depth` levels is the best `nodes` of that infinite tree (best_first)."""
        accept = _check_accept("StaticTree.sequoia", accept)
        _check_sizes("StaticTree.sequoia", nodes=nodes, depth=depth)
        return cls(sequoia_paths(accept, nodes, depth))


def _rank_paths(paths) -> list[tuple[int, ...]]:
    """A static tree's rank paths as tuples of ints (numpy arrays and integers welcome), or a one-line ValueError."""
    if hasattr(paths, "tolist"):  # a numpy array of paths
        paths = paths.tolist()
    bad = ValueError(f"StaticTree's paths are a list of rank paths, each a list of ranks >= 0 (e.g. [[0], [1], "
                     f"[0, 0]]), got {' '.join(repr(paths).split())[:200]}")
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence):
        raise bad
    out = []
    for p in paths:
        if hasattr(p, "tolist"):
            p = p.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or not all(
                is_whole(j) and j >= 0 for j in p):
            raise bad
        out.append(tuple(int(j) for j in p))
    return out


def _check_accept(name: str, accept) -> list[float]:
    """The positional acceptance vector: a non-empty list (or array) of numbers in (0, 1] -> as floats, or a one-line
    ValueError."""
    got = _probabilities(accept)
    if got is None:
        raise ValueError(f"{name}'s accept is the positional acceptance vector, a list of numbers each in (0, 1] "
                         f"(python -m decode.evaluation.tree_plan prints it), got {' '.join(repr(accept).split())[:200]}")
    return got


def _probabilities(values) -> list[float] | None:
    """A non-empty list or array of numbers each in (0, 1] -> as floats; None for anything else."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values or not all(
            isinstance(a, numbers.Real) and not isinstance(a, bool) and 0 < a <= 1 for a in values):
        return None
    return [float(a) for a in values]


class SequoiaTree(StaticTree):
    """StaticTree.sequoia as a class a YAML names: accept is the positional acceptance vector (python -m
    decode.evaluation.tree_plan prints it and the nodes and depth that pay on this machine)."""

    def __init__(self, accept: Sequence[float], nodes: int = 16, depth: int = 6):
        accept = _check_accept("SequoiaTree", accept)
        _check_sizes("SequoiaTree", nodes=nodes, depth=depth)
        super().__init__(sequoia_paths(accept, nodes, depth))
        self.accept = list(accept)


def sequoia_paths(accept: Sequence[float], nodes: int, depth: int) -> list[tuple[int, ...]]:
    """The rank paths of the best `nodes`-node tree of at most `depth` levels under positional acceptance `accept`."""
    heap, out = [(-accept[0], (0,))] if accept and nodes > 0 else [], []
    while heap and len(out) < nodes:
        neg, p = heapq.heappop(heap)
        out.append(p)
        if p[-1] + 1 < len(accept):
            heapq.heappush(heap, (neg / accept[p[-1]] * accept[p[-1] + 1] if accept[p[-1]] else 0.0, p[:-1] + (p[-1] + 1,)))
        if len(p) < depth:
            heapq.heappush(heap, (neg * accept[0], p + (0,)))
    return out


def expected_tokens(accept: Sequence[float], paths: Sequence[Sequence[int]]) -> float:
    """Tokens a round emits on average under the positional model: 1 + the sum of the nodes' path values."""
    return 1.0 + sum(math.prod(accept[j] for j in p) for p in paths)


class ConfidenceTree(TreeShape):
    """EAGLE-2's dynamic tree: a node's value is the product of the draft's probabilities along its path. Each level
    expands the top_k frontier nodes by value. Greedy: top_k children each, and the target verifies the best `nodes`
    of all (EAGLE-2's rerank). Sampling, where a rerank of drawn children would bias the law (see the module): the
    expanded nodes share what is left of the `nodes` budget before their children are drawn, as the best nodes of
    the positional tree grown from them (planned), the j-th child of a node valued by shares[j], the draft's typical
    probability of its j-th draw; the target verifies every child drawn."""

    def __init__(self, top_k: int = 4, depth: int = 6, nodes: int = 16, shares: Sequence[float] | None = None):
        _check_sizes("ConfidenceTree", top_k=top_k, depth=depth, nodes=nodes)
        self.top_k, self.depth, self.nodes = top_k, depth, nodes
        self.shares = check_shares("ConfidenceTree", SHARES if shares is None else shares, top_k)

    def children(self, level, tree, frontier):
        best = sorted(frontier, key=lambda i: -tree.value[i])[: self.top_k]
        if not tree.sampled:
            return [self.top_k if i in best else 0 for i in frontier]
        picked = planned([tree.value[i] for i in best], self.shares, tree.room, self.depth - level)
        got = dict(zip(best, counted(picked, len(best))))
        return [got.get(i, 0) for i in frontier]


SHARES = (0.6, 0.2, 0.08, 0.04)  # a peaked draft's typical probability of its 1st, 2nd, ... draw (then halving)


def check_shares(name: str, shares: Sequence[float], top_k: int) -> np.ndarray:
    """(top_k,) the shares as a non-increasing vector in (0, 1] (extended by halving), or a one-line ValueError."""
    got = _probabilities(shares)
    if got is None:
        raise ValueError(f"{name}'s shares are a list of probabilities in (0, 1], one per child rank (e.g. [0.6, 0.2, "
                         f"0.08]), got {shares!r}")
    out = got[:top_k]
    while len(out) < top_k:
        out.append(out[-1] / 2)
    return np.minimum.accumulate(np.asarray(out))


def planned(values: Sequence[float], shares: Sequence[float], room: int, levels: int) -> list[tuple[float, int, int]]:
    """Sizing a sampled level before its children are drawn: the values of the frontier nodes that may be expanded,
    (k,) the non-increasing share of a node's j-th child, the nodes the tree may still add and the levels it may
    still draft -> the best `room` nodes of the positional tree grown from those nodes (each node's j-th child worth
    its value times shares[j], Sequoia's model below the draws), best first, as (value, frontier index, depth below
    it). Its nodes at depth 1 are the children to draw now; the deeper ones hold budget for the levels after."""
    heap = [(-v * shares[0], f, (0,)) for f, v in enumerate(values) if v > 0 and levels > 0]
    heapq.heapify(heap)
    out: list[tuple[float, int, int]] = []
    while heap and len(out) < room:
        neg, f, path = heapq.heappop(heap)
        out.append((-neg, f, len(path)))
        j = path[-1]
        if j + 1 < len(shares):
            heapq.heappush(heap, (neg / shares[j] * shares[j + 1], f, path[:-1] + (j + 1,)))
        if len(path) < levels:
            heapq.heappush(heap, (neg * shares[0], f, path + (0,)))
    return out


def counted(picked: Sequence[tuple[float, int, int]], n: int) -> list[int]:
    """planned's nodes (or a prefix of them) -> how many children each of the n frontier nodes gets now."""
    counts = [0] * n
    for _, f, d in picked:
        counts[f] += d == 1
    return counts


def _check_sizes(name: str, **sizes) -> None:
    """Each size a whole number >= 1 (numpy's integers too), or a one-line ValueError naming it."""
    for key, v in sizes.items():
        if not is_whole(v) or v < 1:
            raise ValueError(f"{name} needs {key} to be a whole number >= 1, got {v!r}")
