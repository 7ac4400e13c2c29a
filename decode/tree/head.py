"""HeadTree: a token tree shaped each round by a trained sibling head and the machine's measured step costs.

    BatchDecoder(pair.with_sampling(temperature=0.0), HeadTree("checkpoints/specdecpp-tree-greedy"), GreedyMatch())
    SpeculativeDecoder(pair, HeadTree("checkpoints/specdecpp-tree"), SpeculativeSampling())  # T = 1, the pair's own

The head (trained by `python -m train fit --config heads/pycode/specdecpp-tree.yaml`, on data_gen's sibling labels) reads
the draft's state after a node, the draft's entropy and top-1 there, a child's probability under the draft's raw
softmax (as the labels' sib_q and a chain head's cand_logq) and its rank among its siblings, and says the chance
that child is accepted once the siblings before it were rejected, a_j. The chance child j is the accepted one is then
a_j * prod_{i<j} (1 - a_i), and a node's value, its chance to be on the accepted path, the product of those along its
path (Sequoia's positional model with the head's numbers in place of one vector for every node).

Like decode.control.BatchCostAware, a HeadTree is a batch-level control that learns as it decodes: a round's
tree depends on the batch size (a verify prices every row's nodes) and on what earlier rounds taught it (each rank's
share, the host work a level and a round cost, learnt from the wall clock; the forwards' measured ms over the tables',
which are measured once on a machine whose speed drifts; at each depth, the tokens that arrived over those the values
promised, since a head is optimistic deep in a tree or on text it was not trained on), and, as the controller does,
whether to draft at all at each batch size (where a plain target step brings the batch on faster, it takes plain
steps; decode.batch runs them as a chain of no candidates). Greedy output is the target's whatever the tree; under
sampling the law is the target's, but a row's draws depend on the trees it got, so they differ between a row alone
and in a batch, between a fresh HeadTree and one that has decoded before, and (as the trees follow the wall clock)
from run to run; with learn=False and given tables (set_tree_costs) a seed's tokens repeat.

The cost-aware stop, generalised to trees: a round's rate is the expected tokens over the round's ms when the target
verifies the best-first prefix of the nodes with the most expected tokens per ms, a draft level priced by its width
and the verification by its node count from cost tables measured on this machine (decode.costs.model.tree_costs, once per
decoder). Each level expands the w best frontier nodes (w <= top_k) that raise that rate, their children valued
before drafting by the running mean of each rank's share; after drafting, the target verifies the best prefix.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from decode.control.cost_aware import RECHECK_ROUNDS, optimistic
from decode.costs.model import CostModel
from decode.policies.heads import HeadPolicy
from decode.sampling import as_numpy
from decode.tree.shapes import NodeBatch, TreeShape, _check_sizes, best_order, counted, planned
from heads import kernels, tree_kernels

DECAY = 0.95  # per round, of what the rounds taught (about the last 20 rounds count)
PRIOR = 2.0  # tokens of evidence that a depth's calibration is 1, which never decay


class HeadTree(TreeShape):
    """A dynamic tree valued by a sibling head (see the module). top_k: the most children a node gets and the most
    nodes a level expands; depth: the most levels; nodes: the most nodes verified. allow_sampling_mismatch: use a head
    trained for another sampling setting (warns). learn: let the rounds correct the tables and the head (the forwards'
    measured ms scale the cost tables, each depth's accepted tokens calibrate the values); False: price as given."""

    needs_hidden = True
    needs_tree_costs = True

    def __init__(self, head_dir: str, top_k: int = 4, depth: int = 8, nodes: int = 32,
                 allow_sampling_mismatch: bool = False, learn: bool = True):
        _check_sizes("HeadTree", top_k=top_k, depth=depth, nodes=nodes)
        if not isinstance(head_dir, (str, os.PathLike)):
            raise ValueError(f"HeadTree's head_dir is the folder of an exported sibling head, got {head_dir!r}")
        try:
            self.head = HeadPolicy(head_dir, allow_sampling_mismatch)
        except FileNotFoundError as e:
            raise ValueError(f"HeadTree's head_dir: {e}; export a sibling head with python -m train fit --config "
                             "heads/pycode/specdecpp-tree.yaml") from e
        spec = self.head.features
        if spec.position != "prev" or "cand_rank" not in spec.extras:
            raise ValueError(f"head {head_dir} was trained on chain candidates (features {spec.to_dict()}); a tree needs "
                             "a sibling head reading the state before its candidates and their rank (position prev, "
                             "extra cand_rank): train one with python -m train fit --config heads/pycode/specdecpp-tree.yaml")
        self.top_k, self.depth, self.nodes, self.learn = top_k, depth, nodes, learn
        self.costs: CostModel | None = None
        self.runs = np.zeros(0, dtype=np.int64)  # each row's accepted run before this round (the extra accepted_run)
        self.b = 1
        # running means of the chance a node's j-th child is the accepted one (what a level not yet drafted will add)
        self.rank_mean = 0.8 * 0.2 ** np.arange(top_k)
        self._tables: dict[tuple[str, int], np.ndarray] = {}  # the cost tables at a batch size
        # by batch size, [ms a draft level costs beyond its forward (the level's host work: drawing, the head, masks),
        # a round's fixed host work (the walk, bookkeeping)], learnt from the rounds' host time (tree_timed): both grow
        # with the rows
        self.host: dict[int, np.ndarray] = {}
        self._levels = 0
        # what the rounds teach beyond the tables, which are measured once on a machine whose speed drifts: the
        # measured over the tabled ms of the draft's and the target's forwards (decayed sums, [measured, tabled]),
        # and at each depth the tokens that arrived over those the kept nodes' values promised
        self.forwards: dict[tuple[str, int], np.ndarray] = {}  # (model, batch size) -> [measured, tabled]
        self.promised, self.arrived = np.zeros(depth + 2), np.zeros(depth + 2)
        self._tabled = {"draft": 0.0, "verify": 0.0}  # this round's tabled forwards (the widest row's)
        self._mass: list[np.ndarray] = []  # each row's kept value by depth this round, in row order
        self._priced: dict | None = None  # this round's scaled tables and calibration, computed once a round
        # whether to draft at all, by batch size (as decode.control.BatchCostAware chooses): each size's
        # drafted rounds [rounds, progress, ms] and plain steps [rounds, ms], kept from one request to the next
        self.sizes: dict[int, np.ndarray] = {}
        self.declined: set[int] = set()  # sizes whose last choice was a plain step
        self.mode: tuple[int, bool] | None = None  # (size, drafting) of this request's stretch
        self.reach: np.ndarray | None = None  # each row's remaining budget this round
        self._progress = 1.0  # the last round's progress (tree_verified)
        self._fresh = True  # the request's first round is still to come

    def head_policy(self) -> HeadPolicy:
        return self.head

    def set_tree_costs(self, costs: CostModel) -> None:
        """The machine's cost tables: a draft forward by width, a target forward by tokens (decode.costs.model.tree_costs)."""
        self.costs, self._tables, self._priced = costs, {}, None

    def start(self, n):
        self.runs = np.zeros(n, dtype=np.int64)
        self.mode, self._fresh = None, True

    def verified(self, accepted, drafted):
        if self.mode is not None and not self.mode[1]:  # a plain step (tree rounds: tree_verified)
            self.runs += 1
            self._progress = 1.0

    def timed(self, ms):
        """A round's whole ms (not a request's first, whose draft reads the prompts) and its progress count for its
        batch size's choice to draft; a drafted round after plain steps counts its draft's read of what they skipped,
        which is what drafting again costs."""
        if self.mode is not None and not self._fresh:
            got = self.sizes.get(self.b)
            if got is None:
                got = self.sizes[self.b] = np.zeros(5)
            if self.mode[1]:
                got[:3] += (1.0, self._progress, ms)
            else:
                got[3:] += (1.0, ms)
        self._fresh = False

    def begin(self, b, remaining=None):
        self.b, self._priced = b, None
        self.reach = None if remaining is None else np.asarray(remaining, dtype=np.float64)
        if self.learn and self.costs is not None:
            self.mode = (b, self._drafts(b))
            (self.declined.discard if self.mode[1] else self.declined.add)(b)
        return self.depth if self.mode is None or self.mode[1] else 0

    def _drafts(self, b: int) -> bool:
        """Whether this round at batch size b drafts: a stretch (a request's rounds at one size) drafts while the
        progress per ms its size's drafted rounds realized (raised by optimistic, as the batch controller's) beats a
        plain step's 1 over its ms (measured; before any, the tables' target forward over b tokens and a round's
        host work); it is chosen when the size changes and stopped at a loss once the size has RECHECK_ROUNDS drafted
        rounds (over every request). A plain stretch lasts until the size changes. A size with no drafted rounds
        drafts, unless a smaller size chose not to (a tree costs more per row the more rows verify)."""
        got = self.sizes.get(b, np.zeros(5))
        if self.mode == (b, False):
            return False
        if not got[0]:
            return not any(s < b for s in self.declined)
        price = self.priced()
        plain = got[4] / got[3] if got[3] else price["verify"][0] + price["round"]
        pays = optimistic(got[1] / got[2], got[0]) > 1.0 / plain
        return pays if self.mode is None or self.mode[0] != b or got[0] >= RECHECK_ROUNDS else True

    def select(self, stay):
        self.runs = self.runs[stay]

    def tree_verified(self, accepted, whole):
        """A rejection ends a row's run; a path accepted to a leaf extends it by its nodes and the bonus token. Each
        depth's calibration learns whether the paths reached it as often as the kept values promised."""
        accepted = np.asarray(accepted)
        self.runs = np.where(whole, self.runs + accepted + 1, 0)
        # the round's progress: how far it brought down the most tokens a row may still emit (the batch ends with
        # its last row); without budgets, the rows' mean tokens
        reach = self.reach if self.reach is not None and len(self.reach) == len(accepted) else None
        self._progress = float(np.mean(accepted + 1) if reach is None else reach.max() - (reach - accepted - 1).max())
        if self.learn and self._mass and len(self._mass) == len(accepted):
            # rows whose path reached each depth: the count of paths at least that long
            reached = np.bincount(np.minimum(accepted, len(self.arrived) - 1), minlength=len(self.arrived))
            reached = reached[::-1].cumsum()[::-1]
            reached[0] = 0
            self.promised = DECAY * self.promised + sum(self._mass)
            self.arrived = DECAY * self.arrived + reached
        self._mass = []

    def weigh(self, level: int, nodes: NodeBatch) -> list[list[float]]:
        """Each child's chance to be the accepted one given its parent is, a_j * prod_{i<j} (1 - a_i), from one head
        forward over every child of the level (on the CPU, up to ROWS_MAX nodes, one compiled call)."""
        sizes = [len(t) for t in nodes.tokens]
        runs = self.runs[np.asarray(nodes.rows)] + np.asarray(nodes.depth)
        params = getattr(self.head.fast_prob, "params", None)
        if params is not None and nodes.logits.device.type == "cpu" and len(sizes) <= kernels.ROWS_MAX:
            kids = np.full((len(sizes), max(sizes)), -1, dtype=np.int64)
            for n, t in enumerate(nodes.tokens):
                kids[n, :len(t)] = t
            value = tree_kernels.head_children(as_numpy(nodes.logits), kids, as_numpy(nodes.hidden), runs,
                                               self.head._codes, params)
            out = [v[:m] for v, m in zip(value.tolist(), sizes)]
        else:
            out = self._weigh_rows(nodes, sizes, runs)
        # each rank's running mean over the nodes that drew a child of that rank (a sampled level sized by
        # _sampled_children gives many nodes fewer than top_k)
        grid = np.full((len(out), self.top_k), np.nan)
        for n, o in enumerate(out):
            grid[n, :len(o)] = o[: self.top_k]
        seen = ~np.isnan(grid).all(0)
        if seen.any():
            self.rank_mean[seen] = 0.9 * self.rank_mean[seen] + 0.1 * np.nanmean(grid[:, seen], axis=0)
        return out

    def _weigh_rows(self, nodes: NodeBatch, sizes: list[int], runs: np.ndarray) -> list[list[float]]:
        """weigh() in array ops over the level's children: a batch's many nodes, a GPU's, or without numba."""
        each = np.repeat(np.arange(len(sizes)), sizes)
        p = nodes.softmax
        kids = torch.tensor([t for ts in nodes.tokens for t in ts], device=p.device)
        # the draft's entropy and top-1 after each node, and each child's raw-softmax probability (the law the labels'
        # sib_q and a chain head's cand_logq use, whatever law drew the child), in one host read
        scalars = as_numpy(torch.cat([torch.special.entr(p).sum(-1), p.max(-1).values,
                                      p[torch.as_tensor(each, device=p.device), kids]]))
        n = len(sizes)
        entropy, top1, probs = scalars[:n], scalars[n:2 * n], scalars[2 * n:]
        hidden = as_numpy(nodes.hidden)[each]
        ranks = np.concatenate([np.arange(m) for m in sizes]).astype(np.float32)
        x = self.head.features.rows(hidden, entropy[each], top1[each], probs, runs[each], ranks)
        a = np.atleast_1d(self.head.fast_prob(x[0] if len(x) == 1 else x)).astype(np.float64)
        out, k = [], 0
        for m in sizes:
            survive = np.concatenate([[1.0], np.cumprod(1.0 - a[k:k + m])[:-1]])
            out.append((a[k:k + m] * survive).tolist())
            k += m
        return out

    def children(self, level, tree, frontier):
        if tree.sampled:
            return self._sampled_children(level, tree, frontier)
        if level == 0:  # the root's children cost no extra forward (the draft read the root anyway)
            return [self.top_k]
        best = sorted(frontier, key=lambda i: -tree.value[i])[: self.top_k]
        if self.costs is None:  # unpriced: EAGLE-2's rule on the head's values
            return [self.top_k if i in best else 0 for i in frontier]
        # row w: the tree's values and those of the w best frontier nodes' children, valued by the ranks' running
        # means, best first; each row's best rate at once
        price = self.priced()
        c = price["calibration"]
        guess = np.outer([tree.value[i] * c[tree.depth[i] + 1] for i in best], self.rank_mean)
        value = np.asarray(tree.value[1:]) * c[np.asarray(tree.depth[1:])]
        width = tree_kernels.best_width if kernels.HAVE_NUMBA else best_width
        expand = set(best[: width(value, guess, self._draft_ms(tree), price["level"], price["verify"], self.nodes)])
        return [self.top_k if i in expand else 0 for i in frontier]

    def _sampled_children(self, level, tree, frontier) -> list[int]:
        """Under sampling a level is sized before its children are drawn, as every drawn child is verified
        (decode.tree.shapes): the best top_k frontier nodes' children, and the deeper levels they would grow, are
        valued by the ranks' running means (planned); priced, the target verifies the prefix of those with the best
        rate beside the nodes already drawn, and this level draws that prefix's children."""
        best = sorted(frontier, key=lambda i: -tree.value[i])[: self.top_k]
        room = min(tree.room, self.nodes - len(tree.value) + 1)
        share = np.minimum.accumulate(np.maximum(self.rank_mean, 1e-6))  # planned wants them > 0, non-increasing
        if self.costs is None:
            picked = planned([tree.value[i] for i in best], share, room, self.depth - level)
        else:
            price = self.priced()
            c = price["calibration"]
            picked = planned([tree.value[i] * c[tree.depth[i] + 1] for i in best], share, room, self.depth - level)
            drawn = float(np.dot(tree.value[1:], c[np.asarray(tree.depth[1:], dtype=np.int64)]))
            tokens = 1.0 + drawn + np.concatenate([[0.0], np.cumsum([v for v, _, _ in picked])])
            seen, width = set(), np.zeros(len(picked) + 1, dtype=np.int64)  # the draft forward this level needs
            for n, (_, f, _) in enumerate(picked):
                seen.add(f)
                width[n + 1] = len(seen)
            level_ms = price["level"][width] if level else np.zeros(len(width))
            ms = self._draft_ms(tree) + level_ms + price["verify"][len(tree.value) - 1 + np.arange(len(picked) + 1)]
            picked = picked[: int(np.argmax(tokens / ms))]
        got = dict(zip(best, counted(picked, len(best))))
        return [got.get(i, 0) for i in frontier]

    def keep(self, tree, most):
        if self.costs is None:
            return super().keep(tree, min(most, self.nodes))
        if tree.sampled:  # sized before drawing (_sampled_children): every drawn node
            kept = list(range(1, len(tree.value)))
            n = len(kept)
        else:
            value = (np.asarray(tree.value) * self.priced()["calibration"][np.asarray(tree.depth)]).tolist()
            order = best_order(value, tree.parent, tree.rank, min(most, self.nodes))
            n = self._best_rate(np.asarray([value[i] for i in order]), self._draft_ms(tree))[1]
            kept = order[:n]
        self._levels = max(self._levels, max(tree.depth))
        self._mass.append(np.bincount([tree.depth[i] for i in kept], [tree.value[i] for i in kept],
                                      minlength=len(self.promised)))
        self._tabled["draft"] = max(self._tabled["draft"], self._draft_forwards(tree))
        self._tabled["verify"] = max(self._tabled["verify"], self._verify_table()[n])
        return sorted(kept)

    def tree_timed(self, grow_ms, rest_ms, draft_ms=None, verify_ms=None):
        """The host work of growing the tree, spread over its draft levels (the root's included), is what a level
        costs beyond the draft's forward; the rest is a round's fixed cost. The forwards' ms, set beside what the
        tables said of this round's, scale the tables."""
        if self.learn:  # learn=False prices from the tables alone: the wall clock never reaches its trees
            self.host[self.b] = 0.9 * self._host() + 0.1 * np.array([grow_ms / (self._levels + 1), rest_ms])
        for model, ms in (("draft", draft_ms), ("verify", verify_ms)):
            if self.learn and ms is not None and self._tabled[model] > 0:
                key = (model, self.b)  # by batch size: a table's error at 8 rows is not its error at 1
                self.forwards[key] = DECAY * self.forwards.get(key, np.ones(2)) + np.array([ms, self._tabled[model]])
        self._levels, self._tabled, self._priced = 0, {"draft": 0.0, "verify": 0.0}, None

    def priced(self) -> dict:
        """This round's prices, computed once a round: "calibration" (depth + 2,) what a node's value is multiplied by
        at each depth (the tokens that arrived there over those promised, in [0.25, 1.5]: a head trained on other
        text, or optimistic deep in a tree, is corrected by this run's rounds), "draft" the scale of the draft's
        tabled forwards (measured over tabled, in [0.25, 4]), "verify" (nodes + 1,) and "level" (top_k + 1,) the
        scaled ms of a verify by node count and of a draft level by width, its host work included ([0]: that work
        alone, which the root's level pays too), "round" a round's fixed host work."""
        if self._priced is None:
            (dm, dt), (vm, vt) = (self.forwards.get((m, self.b), np.ones(2)) for m in ("draft", "verify"))
            draft = float(np.clip(dm / dt, 0.25, 4.0))
            # a depth the trees stopped reaching decays to no evidence, so back to 1: it is tried again
            calibration = (self.arrived + PRIOR) / (self.promised + PRIOR)
            level, fixed = self._host()
            self._priced = {"calibration": np.clip(calibration, 0.25, 1.5), "draft": draft,
                            "verify": self._verify_table() * float(np.clip(vm / vt, 0.25, 4.0)),
                            "level": self._draft_table() * draft + level, "round": fixed}
        return self._priced

    def _host(self) -> np.ndarray:
        """[level, round] host ms at this batch size: its own, else the nearest size's (by ratio), else none yet."""
        if self.b in self.host or not self.host:
            return self.host.get(self.b, np.zeros(2))
        return self.host[min(self.host, key=lambda s: abs(np.log(s / self.b)))]

    def _best_rate(self, values: np.ndarray, spent: float) -> tuple[float, int]:
        """Node values, best first, and the draft's ms -> the most expected tokens per ms of verifying a prefix of
        them (up to `nodes`), and that prefix's length (0: the root alone)."""
        tokens = 1.0 + np.concatenate([[0.0], np.cumsum(values[: self.nodes])])
        rates = tokens / (spent + self.priced()["verify"][: len(tokens)])
        n = int(np.argmax(rates))
        return float(rates[n]), n

    def _verify_table(self) -> np.ndarray:
        """(nodes + 1,) tabled ms of the target scoring the root and n nodes in every row of the batch (rows priced
        alike)."""
        key = ("verify", self.b)
        if key not in self._tables:
            self._tables[key] = monotone([self.costs.call_ms("target", self.b * (n + 1), switched=True)
                                          for n in range(self.nodes + 1)])
        return self._tables[key]

    def _draft_table(self) -> np.ndarray:
        """(top_k + 1,) tabled ms of a draft forward over w expanded nodes in every row ([0]: none)."""
        key = ("draft", self.b)
        if key not in self._tables:
            width = max(self.top_k, 5)  # widths past top_k too, so the median filter sees both sides of top_k
            self._tables[key] = np.concatenate([[0.0], monotone([self.costs.call_ms("draft", self.b * w)
                                                                 for w in range(1, width + 1)])[: self.top_k]])
        return self._tables[key]

    def _draft_forwards(self, tree, widths: dict[int, int] | None = None) -> float:
        """Tabled ms of the draft's forwards this round so far: the root's, then one a level over the nodes that were
        expanded (widths: _widths(tree), when the caller has it)."""
        table = self._draft_table()
        widths = _widths(tree) if widths is None else widths
        return self.costs.call_ms("draft", self.b * 2) + sum(table[w] for w in widths.values())

    def _draft_ms(self, tree) -> float:
        """The round's ms before the verify, as priced: its fixed host work, each level's, and the draft's forwards."""
        widths = _widths(tree)
        price = self.priced()
        forwards = price["draft"] * self._draft_forwards(tree, widths)
        return price["round"] + price["level"][0] * (1 + len(widths)) + forwards


def _widths(tree) -> dict[int, int]:
    """A tree's draft levels after the root's: depth -> how many of its nodes were expanded (read by the draft)."""
    widths: dict[int, int] = {}
    for i in set(tree.parent[1:]) - {0}:
        widths[tree.depth[i]] = widths.get(tree.depth[i], 0) + 1
    return widths


def best_width(existing: np.ndarray, guess: np.ndarray, spent: float, level: np.ndarray, verify: np.ndarray,
               nodes: int) -> int:
    """(n,) the tree's node values, (W, k) the guessed values of the children of its W best frontier nodes, the
    round's ms so far, (k + 1,) a level's ms by width and (nodes + 1,) a verify's by node count -> the w in 0..W whose
    tree (the nodes and the first w frontier nodes' children) has the best rate over its best-first prefixes (ties:
    the fewer). heads.tree_kernels.best_width is its compiled twin."""
    w = np.arange(len(guess) + 1)
    flat = guess.ravel()
    values = np.concatenate([np.broadcast_to(existing, (len(w), len(existing))),
                             np.where(np.arange(len(flat)) < w[:, None] * guess.shape[1], flat, 0.0)], 1)
    values = -np.sort(-values, 1)[:, :nodes]
    tokens = 1.0 + np.concatenate([np.zeros((len(w), 1)), np.cumsum(values, 1)], 1)
    cost = spent + np.where(w > 0, level[w], 0.0)
    return int(np.argmax((tokens / (cost[:, None] + verify[None, : tokens.shape[1]])).max(1)))


def monotone(ms: list[float], window: int = 5) -> np.ndarray:
    """A cost table by size, measured once, as the tree prices it: a running median over `window` sizes, then
    non-decreasing. A forward of more tokens never costs less, so a measured dip is noise; so is a lone spike, which
    the running maximum alone would carry to every larger size, making them look free (a tree then grows past what
    pays: one spike at 6 tokens of a busy 2-core machine's table priced 6 to 33 alike)."""
    x = np.asarray(ms, dtype=np.float64)
    reach = [min(window // 2, i, len(x) - 1 - i) for i in range(len(x))]  # centred: the ends keep their own sizes
    smooth = np.array([np.median(x[i - r: i + r + 1]) for i, r in enumerate(reach)])
    # the first sizes see few neighbours on their left: capped by the median of the window on their right, a spike
    # there (the one-token verify) no longer carries to every size, and a rising table keeps its own values
    for i in range(min(window // 2, len(x))):
        smooth[i] = min(smooth[i], np.median(x[i: i + window]))
    return np.maximum.accumulate(smooth)
