"""Sampled trees that size themselves (decode.tree.ConfidenceTree, decode.tree.HeadTree) keep the target's
law even when they prune hard (eight children drawable, three nodes verified): the second token given the first,
stratified by the first, matches the target's conditional law, at T = 1 and under top-p / top-k. The same test fails
the pruning that shipped before (the best nodes by value kept after drawing), and a shape whose keep() drops a drawn
node under sampling is refused in one line."""

import dataclasses

import numpy as np
import pytest
import torch

from decode.batch import BatchDecoder
from decode.rules.chain import SpeculativeSampling
from decode.sampling import transform
from decode.tree import round as tree_mod
from decode.tree.head import HeadTree
from decode.tree.shapes import ConfidenceTree, SequoiaTree, StaticTree, best_first, counted, planned
from tests.test_decode import ALPHA
from tests.test_head_tree import priced, sibling_head

PROMPT = [14]  # the tiny pair's prompt where pruning by drawn value showed the most bias (of 8 tried at 4,000 draws)


def conditional_pvalue(pair, shape, n: int, rows: int = 250, prompt=PROMPT) -> float:
    """n two-token draws after `prompt` (batches of `rows` rows, row i of a batch seeded seed + i) -> the chi-square
    p-value of the first token against the target's law plus, for every first token drawn at least 50 times, the
    second token against the target's law after it (cells of expected count >= 5, the rest pooled into one): the
    statistics and degrees of freedom summed over the strata."""
    from scipy.stats import chi2

    s = pair.config.sampling
    with torch.no_grad():
        first = transform(pair.logits(pair.target(torch.tensor([prompt])).logits[0, -1]), s).double().numpy()
        after = transform(pair.logits(pair.target(torch.tensor([prompt + [a] for a in range(pair.vocab)])).logits[:, -1]),
                          s).double().numpy()
    counts = np.zeros((pair.vocab, pair.vocab))
    dec = BatchDecoder(pair, shape, SpeculativeSampling())
    for seed in range(0, n, rows):
        dec.seed = seed
        for g in dec.generate([prompt] * rows, 2):
            counts[g.tokens[0], g.tokens[1]] += 1
    stat, dof = 0.0, 0
    strata = [(counts.sum(1), first * n)] + [(counts[a], after[a] * counts[a].sum())
                                              for a in range(pair.vocab) if counts[a].sum() >= 50]
    for obs, exp in strata:
        if obs[exp == 0].sum() > 0:  # a token the target's (truncated) law never emits
            return 0.0
        big = exp >= 5
        o, e = obs[big], exp[big]
        if exp[~big].sum() > 0:
            o, e = np.append(o, obs[~big].sum()), np.append(e, exp[~big].sum())
        stat, dof = stat + ((o - e) ** 2 / e).sum(), dof + len(o) - 1
    return float(chi2.sf(stat, dof))


@pytest.fixture
def t1_pair(tiny_pair):
    return dataclasses.replace(tiny_pair.with_sampling(temperature=1.0), eos_ids=(-1,))


def test_hard_pruned_confidence_trees_keep_the_conditional_law(t1_pair):
    """16,000 draws a shape: the pruning that shipped gives p = 8e-12 and 5e-7 on the two shapes here."""
    assert conditional_pvalue(t1_pair, ConfidenceTree(top_k=8, depth=2, nodes=3), n=16000) > ALPHA
    assert conditional_pvalue(t1_pair, ConfidenceTree(top_k=4, depth=2, nodes=9), n=16000) > ALPHA
    topk = dataclasses.replace(t1_pair.with_sampling(temperature=0.8, top_p=0.9, top_k=12), eos_ids=(-1,))
    assert conditional_pvalue(topk, ConfidenceTree(top_k=8, depth=2, nodes=3), n=8000, prompt=[3, 7]) > ALPHA


def test_hard_pruned_head_trees_keep_the_conditional_law(t1_pair, tmp_path):
    head = sibling_head(tmp_path, t1_pair)
    assert conditional_pvalue(t1_pair, priced(head, per_node=0.0, top_k=8, depth=2, nodes=3), n=16000) > ALPHA
    # no cost tables: sized by the ranks' running means alone
    assert conditional_pvalue(t1_pair, HeadTree(head, top_k=8, depth=2, nodes=3), n=8000) > ALPHA


def test_pruning_the_drawn_children_by_value_is_caught(t1_pair, monkeypatch):
    """The rule that shipped: each node sized as under greedy, then the best `nodes` kept by their drawn values."""
    monkeypatch.setattr(tree_mod, "_within", lambda tree, counts: counts)
    monkeypatch.setattr(tree_mod, "_kept", lambda shape, t, fit: best_first(t.value, t.parent, t.rank, min(fit, 3)))
    greedy_children = ConfidenceTree.children
    monkeypatch.setattr(ConfidenceTree, "children",
                        lambda self, level, t, f: greedy_children(self, level, dataclasses.replace(t, sampled=False), f))
    assert conditional_pvalue(t1_pair, ConfidenceTree(top_k=8, depth=2, nodes=3), n=16000) < ALPHA


def test_a_shape_that_drops_drawn_nodes_under_sampling_is_refused_in_one_line(t1_pair):
    class Pruning(StaticTree):
        def keep(self, tree, most):
            return [1]

    with pytest.raises(ValueError, match="Pruning.keep dropped drawn nodes under sampling") as info:
        BatchDecoder(t1_pair, Pruning([(0,), (1,)]), SpeculativeSampling()).generate([[3, 7]], 4)
    assert "\n" not in str(info.value)

    class EveryNode(StaticTree):  # every drawn node, as a range: kept
        def keep(self, tree, most):
            return range(1, len(tree.value))

    assert len(BatchDecoder(t1_pair, EveryNode([(0,), (1,)]), SpeculativeSampling()).generate([[3, 7]], 4)[0].tokens) == 4


def test_a_sampled_level_is_sized_before_its_children_are_drawn():
    """planned grows the positional tree below the frontier: with shares (0.5, 0.2) and 3 nodes, the root's first child
    (0.5), its first grandchild (0.25) and its second child (0.2); the frontier node of value 0 gets none."""
    got = planned([1.0], [0.5, 0.2], room=3, levels=2)
    assert [(round(v, 6), f, d) for v, f, d in got] == [(0.5, 0, 1), (0.25, 0, 2), (0.2, 0, 1)]
    assert counted(got, 1) == [2]
    assert counted(planned([0.9, 0.1, 0.0], [0.5, 0.2], room=4, levels=1), 3) == [2, 2, 0]
    assert planned([1.0], [0.5], room=5, levels=0) == []
    # the budget caps a level in drafting order, whatever was drawn
    t = tree_mod.RowTree([5], sampled=True, budget=4)
    assert tree_mod._within(t, [3, 3]) == [3, 1]
    assert tree_mod._within(dataclasses.replace(t, sampled=False), [3, 3]) == [3, 3]


@pytest.mark.parametrize("make,says", [
    (lambda: StaticTree(None), "StaticTree's paths are a list of rank paths"),
    (lambda: StaticTree(5), "StaticTree's paths are a list of rank paths"),
    (lambda: StaticTree([None]), "StaticTree's paths are a list of rank paths"),
    (lambda: StaticTree([[0, -1]]), "StaticTree's paths are a list of rank paths"),
    (lambda: SequoiaTree(["0.7", "0.2"], 8, 4), "SequoiaTree's accept is the positional acceptance vector"),
    (lambda: StaticTree.sequoia([0.7, 0.0], 8, 4), r"StaticTree.sequoia's accept .* in \(0, 1\]"),
    (lambda: StaticTree.sequoia([1.5], 4, 4), r"StaticTree.sequoia's accept .* in \(0, 1\]"),
    (lambda: StaticTree.sequoia([0.5], 0, 4), "StaticTree.sequoia needs nodes to be a whole number >= 1"),
    (lambda: ConfidenceTree(shares=[0.5, "x"]), "ConfidenceTree's shares are a list of probabilities"),
    (lambda: HeadTree("no/such/folder"), "HeadTree's head_dir: no/such/folder is not a head checkpoint"),
    (lambda: HeadTree(None), "HeadTree's head_dir is the folder of an exported sibling head, got None"),
])
def test_tree_shapes_refuse_bad_input_in_one_line(make, says, tmp_path):
    with pytest.raises(ValueError, match=says) as info:
        make()
    assert "\n" not in str(info.value)


def test_tree_shapes_take_numpy_arrays_and_numbers():
    assert StaticTree(np.array([[0], [1]])).paths == StaticTree([[np.int64(0)], [1]]).paths == [(0,), (1,)]
    want = StaticTree.sequoia([0.7, 0.2], 4, 2).paths
    assert SequoiaTree(np.array([0.7, 0.2]), np.int64(4), 2).paths == want
    assert StaticTree.sequoia(np.array([0.7, 0.2]), 4, 2).paths == SequoiaTree([np.float32(0.7), 0.2], 4, 2).paths
    assert list(ConfidenceTree(shares=np.array([0.5, 0.25]), top_k=2).shares) == [0.5, 0.25]
