"""HeadTree: a token tree shaped each round by a trained sibling head and the machine's measured step costs.

    BatchDecoder(pair, HeadTree("checkpoints/specdecpp-tree-greedy"), GreedyMatch())
    SpeculativeDecoder(pair, HeadTree("checkpoints/specdecpp-tree"), SpeculativeSampling())  # T = 1, the pair's own

The head (trained by `python -m train fit --config heads/specdecpp-tree.yaml`, on data_gen's sibling labels) reads
the draft's state after a node, the draft's entropy and top-1 there, a child's probability under the draft's raw
softmax (as the labels' sib_q and a chain head's cand_logq) and its rank among its siblings, and says the chance
that child is accepted once the siblings before it were rejected, a_j. The chance child j is the accepted one is then
a_j * prod_{i<j} (1 - a_i), and a node's value, its chance to be on the accepted path, the product of those along its
path (Sequoia's positional model with the head's numbers in place of one vector for every node).

The cost-aware stop, generalised to trees: each level the tree expands the frontier nodes (best first, up to top_k)
only while the expected tokens per millisecond rise, a draft level priced by its width and the verification by its
node count from cost tables measured on this machine (decode.costs.tree_costs, once per decoder); after drafting,
the target verifies the prefix of the best-first order that maximises expected tokens per millisecond.
"""

from __future__ import annotations

import numpy as np
import torch

from decode.costs import CostModel
from decode.head_policies import HeadPolicy
from decode.policy_base import draft_scalars
from decode.sampling import as_numpy
from decode.tree_shapes import NodeBatch, TreeShape, _check_sizes, best_order


class HeadTree(TreeShape):
    """A dynamic tree valued by a sibling head (see the module). top_k: the most children a node gets and the most
    nodes a level expands; depth: the most levels; nodes: the most nodes verified. allow_sampling_mismatch: use a head
    trained for another sampling setting (warns)."""

    needs_hidden = True
    needs_tree_costs = True

    def __init__(self, head_dir: str, top_k: int = 4, depth: int = 8, nodes: int = 32,
                 allow_sampling_mismatch: bool = False):
        _check_sizes("HeadTree", top_k=top_k, depth=depth, nodes=nodes)
        self.head = HeadPolicy(head_dir, allow_sampling_mismatch)
        spec = self.head.features
        if spec.position != "prev" or "cand_rank" not in spec.extras:
            raise ValueError(f"head {head_dir} was trained on chain candidates (features {spec.to_dict()}); a tree needs "
                             "a sibling head reading the state before its candidates and their rank (position prev, "
                             "extra cand_rank): train one with python -m train fit --config heads/specdecpp-tree.yaml")
        self.top_k, self.depth, self.nodes = top_k, depth, nodes
        self.costs: CostModel | None = None
        self.runs = np.zeros(0, dtype=np.int64)  # each row's accepted run before this round (the extra accepted_run)
        self.b = 1
        self.hit = 0.8  # running mean of the chance some child of an expanded node is accepted, given the node is

    def set_tree_costs(self, costs: CostModel) -> None:
        """The machine's cost tables: a draft forward by width, a target forward by tokens (decode.costs.tree_costs)."""
        self.costs = costs

    def start(self, n):
        self.runs = np.zeros(n, dtype=np.int64)

    def begin(self, b, remaining=None):
        self.b = b
        return self.depth

    def select(self, stay):
        self.runs = self.runs[stay]

    def tree_verified(self, accepted, whole):
        """A rejection ends a row's run; a path accepted to a leaf extends it by its nodes and the bonus token."""
        self.runs = np.where(whole, self.runs + np.asarray(accepted) + 1, 0)

    def weigh(self, level: int, nodes: NodeBatch) -> list[list[float]]:
        """Each child's chance to be the accepted one given its parent is, a_j * prod_{i<j} (1 - a_i), from one head
        forward over every child of the level."""
        sizes = [len(t) for t in nodes.tokens]
        each = np.repeat(np.arange(len(sizes)), sizes)
        _, entropy, top1 = draft_scalars(nodes.logits, [t[0] if t else 0 for t in nodes.tokens])
        hidden = as_numpy(nodes.hidden)[each]
        runs = (self.runs[np.asarray(nodes.rows)] + np.asarray(nodes.depth))[each]
        ranks = np.concatenate([np.arange(m) for m in sizes]).astype(np.float32)
        # the raw softmax's probability of each child, whatever law drew it (greedy: what nodes.probs holds already)
        dev = nodes.logits.device
        kids = torch.tensor([t for ts in nodes.tokens for t in ts], device=dev)
        probs = as_numpy(nodes.logits.float().log_softmax(-1)[torch.as_tensor(each, device=dev), kids].exp())
        x = self.head.features.rows(hidden, entropy[each], top1[each], probs, runs, ranks)
        a = np.atleast_1d(self.head.fast_prob(x[0] if len(x) == 1 else x)).astype(np.float64)
        out, k = [], 0
        for m in sizes:
            survive = np.concatenate([[1.0], np.cumprod(1.0 - a[k:k + m])[:-1]])
            out.append((a[k:k + m] * survive).tolist())
            k += m
        if out:
            self.hit = 0.9 * self.hit + 0.1 * float(np.mean([sum(o) for o in out]))
        return out

    def children(self, level, tree, frontier):
        if level == 0:
            return [self.top_k]
        best = sorted(frontier, key=lambda i: -tree.value[i])[: self.top_k]
        if self.costs is None:  # unpriced: EAGLE-2's rule on the head's values
            return [self.top_k if i in best else 0 for i in frontier]
        order = best_order(tree.value, tree.parent, tree.rank, self.nodes)
        tokens, spent = 1.0 + sum(tree.value[i] for i in order), self._draft_ms(tree)
        rate, wide = tokens / (spent + self._verify_ms(len(order))), 0
        gain = 0.0
        for w, i in enumerate(best, 1):  # expand the w best frontier nodes, if that raises tokens per ms
            gain += tree.value[i] * self.hit
            n = min(self.nodes, len(order) + w * self.top_k)
            r = (tokens + gain) / (spent + self.costs.call_ms("draft", self.b * w) + self._verify_ms(n))
            if r > rate:
                rate, wide = r, w
        expand = set(best[:wide])
        return [self.top_k if i in expand else 0 for i in frontier]

    def keep(self, tree, most):
        order = best_order(tree.value, tree.parent, tree.rank, min(most, self.nodes))
        if self.costs is None:
            return sorted(order)
        spent, tokens, best, n_best = self._draft_ms(tree), 1.0, 0.0, 0
        for n in range(len(order) + 1):  # the best-first prefix with the most expected tokens per ms
            if n:
                tokens += tree.value[order[n - 1]]
            rate = tokens / (spent + self._verify_ms(n))
            if rate > best:
                best, n_best = rate, n
        return sorted(order[:n_best])

    def _verify_ms(self, n: int) -> float:
        """The target scoring the root and n nodes in every row of the batch (rows priced alike)."""
        return self.costs.call_ms("target", self.b * (n + 1), switched=True)

    def _draft_ms(self, tree) -> float:
        """The draft's forwards this round so far: the root's, then one a level over the nodes that were expanded."""
        widths: dict[int, int] = {}
        for i in set(tree.parent[1:]) - {0}:
            widths[tree.depth[i]] = widths.get(tree.depth[i], 0) + 1
        return self.costs.call_ms("draft", self.b * 2) + sum(self.costs.call_ms("draft", self.b * w)
                                                              for w in widths.values())
