"""One round of token-tree speculation over a batch of rows: grow each row's tree with the draft (one draft forward
per level), score every node with one target forward, walk the accepted path, keep it in both caches.

decode.batch.BatchDecoder calls round() when its control is a decode.tree.TreeShape; a chain is the tree
with one child per node, batch 1 a batch of one row. The caches are decode.cache.rows.RowCache: a node reads the
committed text and its own ancestors (RowCache.feed_tree), and after verification the path's columns become kept
text while the rest are holes (RowCache.commit_columns). docs/design.md, "Token trees", gives the rules:
- greedy: follow the child equal to the target's argmax; its argmax after the last followed node is the bonus.
- sampling: a node's children were drawn from the draft's q without replacement; they are tested in turn against
  what earlier rejections leave (recursive rejection), and after m rejections the token comes from that residual.
  Each round draws one uniform per drafted child (drafting) and n + 1 per row (verifying n nodes), whatever the
  outcome, so a row's draws depend on its own tree alone; with one child per node this is speculative sampling,
  the same uniforms in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from decode.cache.rows import RowCache
from decode.rounds import Round
from decode.rules.tree import walk
from decode.sampling import as_numpy, sample, transform
from decode.tree.shapes import NodeBatch, TreeShape
from heads import kernels, tree_kernels


@dataclass
class RowTree:
    """One row's tree this round: node 0 is the root (the row's pending token), nodes in drafting (level) order."""

    tokens: list[int]
    parent: list[int] = field(default_factory=lambda: [-1])
    depth: list[int] = field(default_factory=lambda: [0])
    rank: list[int] = field(default_factory=lambda: [0])
    value: list[float] = field(default_factory=lambda: [1.0])
    path: list[tuple[int, ...]] = field(default_factory=lambda: [()])
    col: list[int] = field(default_factory=lambda: [-1])  # the draft cache column a node was read into (-1: unread)
    q: dict = field(default_factory=dict)  # node -> (V,) the draft's law after it (sampling only)
    sampled: bool = False  # drawn from q (sampling): every drawn node is verified (decode.tree.shapes)
    budget: int = 64  # the most nodes the target may verify this round

    @property
    def room(self) -> int:
        """Nodes the budget still leaves."""
        return self.budget - len(self.tokens) + 1

    def add(self, parent: int, token: int, rank: int, prob: float) -> int:
        self.tokens.append(token)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.rank.append(rank)
        self.value.append(self.value[parent] * prob)
        self.path.append(self.path[parent] + (rank,))
        self.col.append(-1)
        return len(self.tokens) - 1

    def ancestors(self, i: int) -> list[int]:
        """Node i's ancestors below the root, nearest last."""
        out = []
        while self.parent[i] > 0:
            i = self.parent[i]
            out.append(i)
        return out[::-1]

    def children(self) -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for i in range(1, len(self.tokens)):
            kids.setdefault(self.parent[i], []).append(i)
        return kids

    def subtree(self, keep: list[int]) -> RowTree:
        """The tree of the root and the nodes `keep` (increasing, each with its parent), renumbered in order."""
        new = {0: 0} | {old: j + 1 for j, old in enumerate(keep)}
        out = RowTree([self.tokens[0]], q={new[k]: v for k, v in self.q.items() if k in new}, sampled=self.sampled,
                      budget=self.budget)
        for old in keep:
            out.add(new[self.parent[old]], self.tokens[old], self.rank[old], 1.0)
            out.value[-1], out.col[-1] = self.value[old], self.col[old]
        return out


def without_replacement(q: torch.Tensor, counts: list[int], u: list[float]) -> list[list[int]]:
    """(N, V) laws, a count and that many uniforms per law -> each law's draws without replacement (each from the
    law with the earlier draws removed; sample() scales by the remaining mass, so removing renormalises). A law
    with fewer tokens than its count gives them all; its unused uniforms are spent all the same. One batched draw
    per child rank, and one host read for them all."""
    if kernels.HAVE_NUMBA and q.device.type == "cpu" and q.dtype == torch.float32:  # one compiled pass a draw
        got = tree_kernels.draws_without_replacement(as_numpy(q), np.asarray(counts, dtype=np.int64),
                                                     np.asarray(u, dtype=np.float64))
        return [[t for t in row if t >= 0] for row in got.tolist()]
    law, out = q.clone(), [[] for _ in counts]
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    drawn = []
    for j in range(max(counts, default=0)):
        rows = [i for i, c in enumerate(counts) if c > j]
        idx = torch.tensor(rows, device=q.device)
        us = torch.tensor([[u[starts[i] + j]] for i in rows], dtype=torch.float64, device=q.device)
        left = law[idx].sum(-1) > 0  # top-k / top-p may leave fewer tokens than children
        tok = sample(law[idx], u=us)
        law[idx, tok] = torch.where(left, 0.0, law[idx, tok])
        drawn.append((rows, tok, left))
    for rows, tok, left in [(r, t.tolist(), k.tolist()) for r, t, k in drawn]:
        for i, t, ok in zip(rows, tok, left):
            if ok:
                out[i].append(t)
    return out


def grow(r: Round, most: int = 64) -> list[RowTree]:
    """Each row's tree, grown level by level (up to r.depth) from its pending token: the draft reads the row's unread
    text and the root in one forward, then each level's expanded nodes in one forward each. Under sampling a row
    draws at most `most` nodes, in drafting order: the tree it draws is the tree the target verifies."""
    shape, levels, draft, rows, text, limits, stats, now = (r.control, r.depth, r.draft, r.rows, r.text, r.limits,
                                                            r.stats, r.now)
    greedy = r.sampling.temperature == 0
    unread = [text.committed[r][int(x):] + [text.pending[r]] for r, x in zip(rows, draft.length)]
    t0 = now()
    logits, hidden = draft.feed(unread)
    stats.t_draft, stats.draft_calls = stats.t_draft + now() - t0, stats.draft_calls + 1
    last = torch.tensor([len(u) - 1 for u in unread], device=logits.device)
    at = torch.arange(len(rows), device=logits.device)
    raw = logits[at, last][:, None]  # (B, 1, V)
    state = None if hidden is None else hidden[at, last.to(hidden.device)][:, None]  # (B, 1, H)
    trees = [RowTree([text.pending[r]], sampled=not greedy, budget=most) for r in rows]
    frontier = [[0] for _ in rows]  # the nodes whose children this level draws, with raw[b, j] their logits
    counts = [_within(t, shape.children(0, t, [0])) for t in trees]  # how many children each frontier node gets
    for level in range(levels):
        t0 = now()
        new = _draw(r, level, trees, frontier, counts, raw, state)
        stats.t_sample += now() - t0
        if level + 1 >= levels:
            break
        # the next level expands the new nodes the shape gives children (a row within its limit), each read by the
        # draft first
        wide = [_within(t, shape.children(level + 1, t, n)) if level + 1 < lim else [0] * len(n)
                for t, n, lim in zip(trees, new, limits)]
        frontier = [[i for i, c in zip(n, w) if c] for n, w in zip(new, wide)]
        counts = [[c for c in w if c] for w in wide]
        if not any(frontier):
            break
        t0 = now()
        raw, state = _read(draft, trees, frontier, [len(text.committed[r]) for r in rows])
        stats.t_draft, stats.draft_calls = stats.t_draft + now() - t0, stats.draft_calls + 1
    return trees


def _within(tree: RowTree, counts: list[int]) -> list[int]:
    """A sampled level's child counts cut, in drafting order, to the nodes the row's budget leaves (a cut that
    depends on the tree above, never on the children's draws); a greedy level's as the shape gave them (its keep()
    prunes after drafting)."""
    if not tree.sampled:
        return counts
    room, out = tree.room, []
    for c in counts:
        out.append(max(0, min(c, room)))
        room -= out[-1]
    return out


def _draw(r: Round, level: int, trees: list[RowTree], frontier: list[list[int]], counts: list[list[int]], raw, state
          ) -> list[list[int]]:
    """Add each frontier node's children (counts) to its tree -> each row's new nodes. Greedy: the draft's top
    choices; sampling: draws without replacement from q (row r's uniforms from its own stream, one per child). The
    shape weighs them (TreeShape.weigh: the draft's probabilities unless it asks a head)."""
    shape, sampling, streams, greedy = r.control, r.sampling, r.streams, r.sampling.temperature == 0
    new: list[list[int]] = [[] for _ in trees]
    counts = [[min(m, raw.shape[-1]) for m in c] for c in counts]  # no node has more children than tokens exist
    at = [(b, j) for b, c in enumerate(counts) for j, m in enumerate(c) if m]
    if not at:
        return new
    if raw.device.type == "cpu":  # one numpy gather: a tensor op on a few rows costs its dispatch, several here
        rows, cols = np.asarray(at).T
        logits = torch.from_numpy(as_numpy(raw)[rows, cols])  # (N, V) the expanded nodes' logits
        hidden = None if state is None else torch.from_numpy(as_numpy(state)[rows, cols]).to(state.dtype)
    else:
        idx = torch.tensor(at, device=raw.device)
        logits = raw[idx[:, 0], idx[:, 1]]
        hidden = None if state is None else state[idx[:, 0].to(state.device), idx[:, 1].to(state.device)]
    m_of = [counts[b][j] for b, j in at]
    raw = None
    if greedy and kernels.HAVE_NUMBA and logits.device.type == "cpu":  # one compiled pass over each node's logits
        tk, pr = tree_kernels.top_children(as_numpy(logits), np.asarray(m_of, dtype=np.int64))
        toks = [t[:m] for t, m in zip(tk.tolist(), m_of)]
        probs = [v[:m] for v, m in zip(pr.tolist(), m_of)]
    elif greedy:
        raw = logits.float().softmax(-1)
        top = raw.topk(max(m_of), -1)
        toks = [tk[:m] for tk, m in zip(top.indices.tolist(), m_of)]
        probs = [vl[:m] for vl, m in zip(top.values.tolist(), m_of)]
    else:
        q = transform(logits, sampling)
        # row by row, each row's nodes in order: the order `at` lists them in, so the draws line up with the laws
        u = streams.draw([sum(c) for c in counts]).tolist()
        toks = without_replacement(q, m_of, u)
        law = q.cpu().numpy()  # one host read: each child's probability under q
        probs = [[float(law[n, t]) for t in got] for n, got in enumerate(toks)]
        for n, (b, j) in enumerate(at):
            trees[b].q[frontier[b][j]] = q[n]
    nodes = NodeBatch([b for b, _ in at], [trees[b].depth[frontier[b][j]] for b, j in at], logits, hidden, toks, probs)
    if raw is not None:
        nodes.softmax = raw  # computed once
    weights = shape.weigh(level, nodes)
    for (b, j), tk, w in zip(at, toks, weights):
        parent = frontier[b][j]
        for rank, (tok, pr) in enumerate(zip(tk, w)):
            new[b].append(trees[b].add(parent, tok, rank, pr))
    return new


def _read(cache: RowCache, trees: list[RowTree], nodes: list[list[int]], roots: list[int]):
    """The draft reads each row's `nodes` (one level), each attending to the kept text and its own ancestors ->
    (B, m, V) their logits and (B, m, H) hidden states (None unless the cache keeps them)."""
    m, width = max(map(len, nodes)), cache.width
    extra = np.zeros((len(trees), m, width), dtype=bool)  # numpy: element writes cost a tensor op each in torch
    pos = np.zeros((len(trees), m), dtype=np.int64)
    for b, (t, ns) in enumerate(zip(trees, nodes)):
        for j, i in enumerate(ns):
            pos[b, j] = roots[b] + t.depth[i]
            cols = [t.col[a] for a in t.ancestors(i)]
            if cols:
                extra[b, j, cols] = True
            t.col[i] = width + j
    among = torch.eye(m, dtype=torch.bool).expand(len(trees), m, m)
    return cache.feed_tree([[t.tokens[i] for i in ns] for t, ns in zip(trees, nodes)], torch.from_numpy(pos),
                           torch.from_numpy(extra), among, torch.zeros(len(trees), m, dtype=torch.bool))


def score(target: RowCache, trees: list[RowTree], roots: list[int], first: torch.Tensor | None) -> torch.Tensor:
    """One target forward over every row's root (unless the prefill read it: first, (B, 1, V)) and nodes ->
    (B, 1 + n, V) the target's logits after the root and after each node; the root's column becomes kept text."""
    fed_root = first is None
    chunks = [([t.tokens[0]] if fed_root else []) + t.tokens[1:] for t in trees]
    m, off = max(map(len, chunks)), int(fed_root)
    if m == 0:
        return first
    pos = np.zeros((len(trees), m), dtype=np.int64)  # numpy: element writes cost a tensor op each in torch
    among = np.zeros((len(trees), m, m), dtype=bool)
    kept = np.zeros((len(trees), m), dtype=bool)
    for b, t in enumerate(trees):
        n = len(t.tokens)
        for i in range(1 - off, n):
            c = i - 1 + off
            pos[b, c] = roots[b] + t.depth[i]
            among[b, c, c] = True
            for a in t.ancestors(i) + ([0] if fed_root and i else []):
                among[b, c, a - 1 + off] = True
        if fed_root:
            kept[b, 0] = True
        for c in range(len(chunks[b]), m):
            among[b, c, c] = True  # filler reads itself alone
    logits, _ = target.feed_tree(chunks, torch.from_numpy(pos), torch.zeros(len(trees), m, target.width, dtype=torch.bool),
                                 torch.from_numpy(among), torch.from_numpy(kept))
    return logits if fed_root else torch.cat([first, logits], 1)


def _kept(shape: TreeShape, tree: RowTree, fit: int) -> list[int]:
    """The nodes the shape keeps for the target; under sampling every drawn node, or a one-line ValueError."""
    kept = [int(i) for i in shape.keep(tree, fit)]  # a range, a tuple or an array of node ids alike
    if tree.sampled and kept != list(range(1, len(tree.tokens))):
        raise ValueError(f"{type(shape).__name__}.keep dropped drawn nodes under sampling, which biases the target's "
                         "law: size each level before drawing it in children() and keep every drawn node")
    return kept


def tree_round(r: Round) -> list[int]:
    """One tree round for every row (decode.batch.BatchDecoder, once the shape's begin chose to draft r.depth > 0
    levels): grow, score, walk, keep -> the batch positions of rows done. Where a model bounds the cache's width, its
    rows pack first and a row verifies at most what fits."""
    shape, s, now, draft, target, rows, text, streams, first, stats = (
        r.control, r.sampling, r.now, r.draft, r.target, r.rows, r.text, r.streams, r.first, r.stats)
    t_round, t_models = now(), stats.t_draft + stats.t_target
    most = getattr(shape, "nodes", 64)
    fit = max(1, min(most, target.room(most + 1) - 1))
    unread = max(len(text.committed[r]) + 1 - int(x) for r, x in zip(rows, draft.length))  # the draft's first read
    draft.room(unread + most)
    t_grow, t_drafting = now(), stats.t_draft
    trees = grow(r, fit)
    t_grown = stats.t_draft
    grow_host = now() - t_grow - (t_grown - t_drafting)
    trees = [t.subtree(_kept(shape, t, fit)) for t in trees]
    roots = [len(text.committed[r]) for r in rows]
    t0, width = now(), target.width
    logits = score(target, trees, roots, first)
    t_verify = now() - t0
    stats.t_target, stats.target_calls = stats.t_target + t_verify, stats.target_calls + 1
    t0, off = now(), int(first is None)
    verdicts = walk(trees, logits, s, streams)
    done, t_cols, d_cols = [], [], []
    for i, (r, t, (path, nxt)) in enumerate(zip(rows, trees, verdicts)):
        n = len(t.tokens) - 1
        stats.rounds, stats.drafted, stats.discarded = stats.rounds + 1, stats.drafted + n, stats.discarded + n - len(path)
        stats.accepted.append(len(path))
        if text.commit(r, [t.tokens[v] for v in path], nxt):
            done.append(i)
        t_cols.append([width + v - 1 + off for v in path])
        d_cols.append([t.col[v] for v in path if t.col[v] >= 0])
    target.commit_columns(t_cols)
    draft.commit_columns(d_cols)
    shape.verified([len(v[0]) for v in verdicts], [len(t.tokens) - 1 for t in trees])
    shape.tree_verified([len(v[0]) for v in verdicts],
                        [not t.children().get(v[0][-1] if v[0] else 0) for t, v in zip(trees, verdicts)])
    stats.t_rule += now() - t0
    # the round's forwards, beside what the shape's tables said of them, where the draft read what a round leaves it
    # (the bonus token, perhaps one more): not a request's first round (the prompt) nor one after plain steps
    steady = first is None and unread <= 2
    shape.tree_timed(1e3 * grow_host, 1e3 * (now() - t_round - (stats.t_draft + stats.t_target - t_models) - grow_host),
                     1e3 * (t_grown - t_drafting) if steady else None, 1e3 * t_verify if steady else None)
    return done
