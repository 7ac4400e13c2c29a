"""The head tree (decode.tree.HeadTree): greedy output equals the target alone for every full-attention family in
float32 and bfloat16 at batch 1 and 8; sampled head trees keep the target's law; a chain head is refused in one line;
the measured costs size the tree (a flat verify grows it, a steep one keeps it small); the head's values are the
chances a child is the accepted one; the rounds' forwards and accepted paths correct the tables and the values."""

import dataclasses

import numpy as np
import pytest

from decode.batch import BatchAutoregressive, BatchDecoder
from decode.cache.rows import windowed
from decode.costs.model import CostModel
from decode.engine import SpeculativeDecoder
from decode.rules.chain import GreedyMatch, SpeculativeSampling
from decode.tree.head import HeadTree
from decode.tree.shapes import NodeBatch
from tests.test_archs import MATRIX, arch_pairs, no_eos  # noqa: F401, F811  (arch_pairs is a fixture)
from tests.test_batch import assert_rows_equal, ragged
from tests.test_decode import ALPHA, export_head
from tests.test_tree import tree_pvalue

SIBLING = {"position": "prev", "extras": ["draft_entropy", "draft_top1", "cand_logq", "accepted_run", "cand_rank"]}
WIDE = {"draft": ([1, 512], [1.0, 1.0]), "target": ([1, 512], [10.0, 10.0])}  # past the step tables


def sibling_head(tmp_path, pair, name="tree-head", bias=None, **kw) -> str:
    """A random (or, with bias, constant) depth-2 sibling head exported for this pair's draft and setting."""
    return export_head(tmp_path, pair, position="prev", extras=SIBLING["extras"], depth=2, name=name, bias=bias, **kw)


def costs(per_node: float) -> CostModel:
    """A draft level costs 1 ms whatever its width; verifying n tokens 10 + per_node * n ms."""
    verify = [10.0 + per_node * n for n in range(512)]
    return CostModel(step={"draft": [1.0] * 16, "target": verify}, switched={"target": verify},
                     prefill={"draft": WIDE["draft"], "target": ([1, 512], [verify[0], verify[-1]])})


def priced(head_dir, per_node=0.5, **kw) -> HeadTree:
    shape = HeadTree(head_dir, **kw)
    shape.set_tree_costs(costs(per_node))
    return shape


@pytest.mark.parametrize("family,dtype", MATRIX)
def test_greedy_head_trees_equal_the_target_alone_at_batch_1_and_8(arch_pairs, family, dtype, tmp_path):
    pair = no_eos(arch_pairs(family, dtype)[1])
    head = sibling_head(tmp_path, pair)
    if windowed(pair.target.config) or windowed(pair.draft.config):
        with pytest.raises(ValueError, match="token trees need full attention"):
            BatchDecoder(pair, priced(head), GreedyMatch())
        return
    for b in (1, 8):
        prompts = ragged(pair, b)
        want = BatchAutoregressive(pair).generate(prompts, 16)
        got = BatchDecoder(pair, priced(head, top_k=3, depth=4, nodes=12), GreedyMatch()).generate(prompts, 16)
        assert_rows_equal(pair, prompts, got, want, (family, dtype, b))
    one = SpeculativeDecoder(pair, priced(head, per_node=0.0), GreedyMatch()).generate(prompts[2], 16)
    assert_rows_equal(pair, prompts[2:3], [one], want[2:3], (family, dtype, "engine"))


def test_sampled_head_trees_keep_the_targets_law(tiny_pair, tmp_path):
    pair = dataclasses.replace(tiny_pair.with_sampling(temperature=1.0), eos_ids=(-1,))
    head = sibling_head(tmp_path, pair)
    assert tree_pvalue(pair, priced(head, per_node=0.0, top_k=4, depth=2, nodes=9), n=800, rows=8) > ALPHA


def test_a_chain_head_or_one_for_another_setting_is_refused_in_one_line(tiny_pair, tmp_path):
    pair = tiny_pair.with_sampling(temperature=0.0)
    chain = export_head(tmp_path, pair, position="prev", extras=["cand_logq"], depth=2, name="chain")
    with pytest.raises(ValueError, match="trained on chain candidates .* heads/pycode/specdecpp-tree.yaml") as info:
        HeadTree(chain)
    assert "\n" not in str(info.value)
    t1 = sibling_head(tmp_path, pair.with_sampling(temperature=1.0), name="t1")
    with pytest.raises(ValueError, match="trained for sampling t1 but the decoder samples greedy") as info:
        BatchDecoder(pair, HeadTree(t1), GreedyMatch())
    assert str(tmp_path / "chain") not in str(info.value)  # the greedy head beside it is a chain head: no use here
    with pytest.raises(ValueError, match="HeadTree needs nodes to be a whole number >= 1"):
        HeadTree(t1, nodes=0)


def test_the_measured_costs_size_the_tree(tiny_pair, tmp_path):
    """A head that says every child is accepted with chance 0.73 (constant): with a verify that costs nothing per
    node the tree grows to its node budget; with one that costs a target step per node it stays a short chain."""
    pair = dataclasses.replace(tiny_pair.with_sampling(temperature=0.0), eos_ids=(-1,))
    head = sibling_head(tmp_path, pair, bias=1.0)
    nodes = {}
    for per_node in (0.0, 10.0):
        shape = priced(head, per_node=per_node, top_k=3, depth=6, nodes=20, learn=False)  # the tables as given
        dec = BatchDecoder(pair, shape, GreedyMatch())
        dec.generate(ragged(pair, 4), 24)
        nodes[per_node] = dec.stats.drafted / dec.stats.rounds
        assert ("verify", 4) in shape._tables  # the first rounds priced four rows' forwards, not one's
    assert nodes[0.0] > 15 and nodes[10.0] < 3, nodes


def test_a_childs_value_is_its_chance_to_be_the_accepted_one(tiny_pair, tmp_path):
    """weigh: a_j * prod_{i<j} (1 - a_i) with a constant head a = sigmoid(bias); the accepted run resets on a
    rejection and grows by the path and the bonus on a path accepted to a leaf."""
    import torch

    pair = tiny_pair.with_sampling(temperature=0.0)
    shape = HeadTree(sibling_head(tmp_path, pair, bias=0.0))  # a = 0.5
    shape.start(2)
    h = pair.draft.config.hidden_size
    nodes = NodeBatch([0, 1], [0, 1], torch.zeros(2, pair.vocab), torch.zeros(2, h), [[5, 6, 7], [8]],
                      [[0.5, 0.2, 0.1], [0.9]])
    got = shape.weigh(1, nodes)
    assert np.allclose(got[0], [0.5, 0.25, 0.125]) and np.allclose(got[1], [0.5])
    shape.tree_verified([3, 1], [True, False])
    assert shape.runs.tolist() == [4, 0]


def test_a_lone_spike_in_a_cost_table_does_not_price_the_larger_sizes():
    """monotone: a running median, then non-decreasing; a measured dip and a lone spike are both noise."""
    from decode.tree.head import monotone

    line = [10.0 + 0.5 * n for n in range(12)]
    spiked = line.copy()
    spiked[3], spiked[7] = 40.0, 5.0
    got = monotone(spiked)
    assert np.all(np.diff(got) >= 0) and got[0] == 10.0
    assert np.abs(got - np.array(line)).max() <= 1.0  # the spike at 3 no longer prices 3 to 11 at 40
    assert np.allclose(monotone(line), line)
    first = [44.0] + line[1:]  # a spike at the one-token verify
    assert monotone(first)[-1] == line[-1] and monotone(first)[0] == np.median(first[:5])  # 11.5, not 44


def test_the_rounds_correct_the_tables_and_the_heads_values(tiny_pair, tmp_path):
    """Verifies that run twice the tabled ms scale the verify table by 2; paths that never reach depth 1 though the
    values promised them shrink that depth's calibration and the kept tree; with learn=False nothing moves."""
    from decode.tree.round import RowTree

    head = sibling_head(tmp_path, tiny_pair.with_sampling(temperature=0.0), bias=1.0)
    chain = RowTree([1])
    for d in range(4):
        chain.add(d, 2 + d, 0, 0.9)
    shapes = {learn: priced(head, per_node=4.0, learn=learn) for learn in (True, False)}
    for learn, shape in shapes.items():
        shape.start(1)
        first = shape.keep(chain, 32)
        table, smallest = shape.priced()["verify"].copy(), len(first)
        for _ in range(40):
            kept = shape.keep(chain, 32)
            smallest = min(smallest, len(kept))
            shape.tree_verified([0], [False])
            shape.tree_timed(0.0, 0.0, draft_ms=shape._draft_forwards(chain), verify_ms=2 * shape._verify_table()[len(kept)])
        assert np.allclose(shape.priced()["verify"], 2 * table if learn else table, rtol=0.02)
        assert np.isclose(shape.priced()["draft"], 1.0)
        c = shape.priced()["calibration"]
        assert (c[1] < 0.5 and smallest < len(first)) if learn else (np.all(c == 1) and smallest == len(first)), c


def test_a_tree_that_does_not_learn_draws_the_same_tokens_for_a_seed(tiny_pair, tmp_path):
    """learn=False prices from the tables alone, host work included: the wall clock (a first run's compiles, a busy
    machine) never reaches its trees, so under sampling a seed's tokens repeat from one fresh tree to the next."""
    pair = dataclasses.replace(tiny_pair.with_sampling(temperature=1.0), eos_ids=(-1,))
    head = sibling_head(tmp_path, pair)
    runs = []
    for slow in (0.0, 500.0):
        shape = priced(head, per_node=0.5, learn=False)
        shape.tree_timed(slow, slow)  # a round whose host work took `slow` ms
        runs.append(SpeculativeDecoder(pair, shape, SpeculativeSampling(), seed=7).generate([3, 7, 5], 40).tokens)
        assert shape.host == {} and shape.priced()["round"] == 0.0
    assert runs[0] == runs[1]


def test_a_batchs_tree_is_priced_past_the_measured_sizes():
    """Eight rows' tree of 32 nodes is a 264-token verify, past every measured size: priced in proportion to the
    longest measured forward, not at its ms (which made eight rows' trees look free and grow to their budget)."""
    prefill = {"draft": ([8, 64], [2.0, 4.0]), "target": ([8, 64], [12.0, 40.0])}
    model = CostModel(step={"draft": [1.0] * 16, "target": [10.0] * 33}, prefill=prefill)
    assert model.call_ms("target", 33) == 10.0 and model.call_ms("target", 64) == 40.0
    assert np.isclose(model.call_ms("target", 264), 40.0 * 264 / 64)
    assert np.isclose(model.call_ms("draft", 128), 8.0)


def test_a_head_tree_takes_plain_steps_where_its_trees_do_not_pay(tiny_pair, tmp_path):
    """At 8 rows, drafted rounds that bring the batch 1 token on in 40 ms lose to a plain step (14 ms by the tables):
    after RECHECK_ROUNDS of them the stretch turns plain until the size changes, and the next request at 8 rows
    starts plain. One row, whose trees bring 4 tokens in 20 ms, drafts on; learn=False always drafts."""
    from decode.control.cost_aware import RECHECK_ROUNDS

    head = sibling_head(tmp_path, tiny_pair.with_sampling(temperature=0.0), bias=1.0)

    def round_(shape, b, accepted, ms):
        levels = shape.begin(b, [20] * b)
        if levels:  # as tree_round reports a round, then decode.batch a plain step's or any round's wall time
            shape.tree_verified([accepted] * b, [False] * b)
            shape.tree_timed(0.0, 0.0, draft_ms=ms / 2, verify_ms=ms / 2)
        else:
            shape.verified([0] * b, [0] * b)
        shape.timed(ms if levels else 14.0)
        return levels

    shape, fixed = priced(head), priced(head, learn=False)
    for s in (shape, fixed):
        s.start(8)
        s.timed(100.0)  # a request's first round (its draft reads the prompts) counts for nothing
        assert [round_(s, 8, 0, 40.0) > 0 for _ in range(RECHECK_ROUNDS)] == [True] * RECHECK_ROUNDS
    assert round_(shape, 8, 0, 40.0) == 0 and round_(shape, 8, 0, 40.0) == 0  # plain until the size changes
    assert round_(fixed, 8, 0, 40.0) > 0
    assert all(round_(shape, 1, 3, 20.0) > 0 for _ in range(2 * RECHECK_ROUNDS))  # one row's trees pay
    shape.start(8)
    assert round_(shape, 8, 0, 40.0) == 0  # the next request at 8 rows starts plain
    assert np.isclose(shape.sizes[8][4] / shape.sizes[8][3], 14.0)  # and its plain steps are measured
    shape.start(4)
    assert round_(shape, 4, 0, 40.0) > 0  # a size with no rounds drafts: a larger one declining says nothing of it


def test_a_rounds_host_work_is_learnt_per_batch_size(tiny_pair, tmp_path):
    """Host work grows with the rows: 8 rows' rounds at 50 ms of it leave one row's 2 ms as they were (one value for
    every size carried 8 rows' host work into one row's rounds); a size not yet seen starts from the nearest size's."""
    shape = priced(sibling_head(tmp_path, tiny_pair.with_sampling(temperature=0.0), bias=1.0))
    for b, rest in ((1, 2.0), (8, 50.0)):
        for _ in range(60):
            shape.begin(b, [20] * b)
            shape.tree_timed(0.0, rest)
    for b, want in ((1, 2.0), (8, 50.0), (5, 50.0), (2, 2.0)):
        shape.begin(b, [20] * b)
        assert abs(shape.priced()["round"] - want) < 0.1, (b, shape.priced()["round"])
