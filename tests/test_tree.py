"""Token trees (decode.tree.round, decode.tree.shapes): greedy trees emit the target's greedy text for every family at batch
1 and 8, plain target steps between trees included; sampled trees keep the target's law (and a tree without the residual update, or with children drawn with
replacement, is caught); a chain-shaped tree is speculative sampling token for token; shapes are prefix-closed."""

import dataclasses
import json

import pytest
import torch

from decode import labels as labels_mod
from decode.batch import BatchAutoregressive, BatchDecoder
from decode.cache.rows import windowed
from decode.engine import SpeculativeDecoder
from decode.policies import FixedK
from decode.rules.chain import FSD, GreedyMatch, SpeculativeSampling, draw
from decode.tree import round as tree_mod
from decode.tree.shapes import ConfidenceTree, StaticTree, best_first, expected_tokens, sequoia_paths
from heads import kernels
from tests.test_archs import MATRIX, TEXTS, arch_pairs, no_eos  # noqa: F401, F811  (arch_pairs is a fixture)
from tests.test_batch import assert_rows_equal, ragged
from tests.test_decode import ALPHA


class PlainEveryOther:
    """A tree shape (the class it is mixed into) that drafts every `period`-th round only, taking plain target steps
    in the others, the first included: the draft reads what it skipped (the prompt, the plain steps' tokens) when it
    next drafts."""

    period = 2

    def start(self, n):
        super().start(n)
        self.round = 0

    def begin(self, b, remaining=None):
        self.round += 1
        return 0 if self.round % self.period else self.depth


class EveryOther(PlainEveryOther, ConfidenceTree):
    pass


SHAPES = {"sequoia": lambda: StaticTree.sequoia([0.7, 0.15, 0.05], nodes=10, depth=4),
          "confidence": lambda: ConfidenceTree(top_k=3, depth=4, nodes=10),
          "plain steps between trees": lambda: EveryOther(top_k=3, depth=4, nodes=10)}


@pytest.mark.parametrize("family,dtype", MATRIX)
def test_greedy_trees_equal_the_target_alone_at_batch_1_and_8(arch_pairs, family, dtype):
    pair = no_eos(arch_pairs(family, dtype)[1])
    if windowed(pair.target.config) or windowed(pair.draft.config):
        with pytest.raises(ValueError, match="token trees need full attention: the draft .* sliding window") as info:
            BatchDecoder(pair, SHAPES["sequoia"](), GreedyMatch())
        assert "\n" not in str(info.value)
        return
    for b in (1, 8):
        prompts = ragged(pair, b)
        want = BatchAutoregressive(pair).generate(prompts, 16)
        for name, shape in SHAPES.items():
            got = BatchDecoder(pair, shape(), GreedyMatch()).generate(prompts, 16)
            assert_rows_equal(pair, prompts, got, want, (family, dtype, b, name))
    one = SpeculativeDecoder(pair, SHAPES["confidence"](), GreedyMatch()).generate(prompts[3], 16)
    assert_rows_equal(pair, prompts[3:4], [one], BatchAutoregressive(pair).generate(prompts[3:4], 16), (family, dtype))
    assert one.stats.target_calls == one.stats.rounds == len(one.stats.accepted)  # the batch's counters, one row


def test_after_plain_steps_the_draft_reads_what_it_skipped(arch_pairs):
    """A draft that is its own target accepts a whole chain whenever its cache holds the text: with plain target steps
    between chain-shaped trees (the first round plain, so the draft first reads the prompt with a committed token
    after it), every drafted round of 8 ragged rows accepts all 3 candidates and the target's calls are the rounds."""
    pair = no_eos(arch_pairs("llama", "float32")[1])
    pair = dataclasses.replace(pair, target=pair.draft)

    class ChainEveryOther(PlainEveryOther, StaticTree):
        pass

    dec = BatchDecoder(pair, ChainEveryOther([(0,), (0, 0), (0, 0, 0)]), GreedyMatch())
    got = dec.generate(ragged(pair, 8), 20)
    assert sorted(set(dec.stats.accepted)) == [0, 3] and dec.stats.discarded == 0
    assert all(len(g.tokens) == 20 for g in got) and dec.stats.draft_calls == 3 * dec.stats.accepted.count(3) // 8


def test_a_rounds_forwards_are_priced_only_where_the_draft_read_what_a_round_leaves(arch_pairs):
    """A shape learns its forwards' cost from rounds whose draft read the bonus token (and perhaps one more): not the
    first round (the prompt) nor a round after three plain steps (what they skipped)."""
    pair = no_eos(arch_pairs("llama", "float32")[1])

    def timed_rounds(base):
        class Recording(base):
            def tree_timed(self, grow_ms, rest_ms, draft_ms=None, verify_ms=None):
                self.log.append(draft_ms is not None and verify_ms is not None)

        shape = Recording(top_k=2, depth=3, nodes=6)
        shape.log = []
        BatchDecoder(pair, shape, GreedyMatch()).generate(ragged(pair, 3), 12)
        return shape.log

    class EveryFourth(EveryOther):
        period = 4

    assert timed_rounds(EveryFourth) and not any(timed_rounds(EveryFourth))
    steady = timed_rounds(ConfidenceTree)
    assert steady[0] is False and all(steady[1:]) and len(steady) > 2


def test_a_chain_shaped_tree_is_speculative_sampling_token_for_token(arch_pairs):
    pair = no_eos(arch_pairs("llama", "float32")[1]).with_sampling(temperature=1.0)
    prompts = ragged(pair, 6)
    for seed in (0, 1):
        chain = BatchDecoder(pair, FixedK(3), SpeculativeSampling(), seed=seed).generate(prompts, 20)
        tree = BatchDecoder(pair, StaticTree([(0,), (0, 0), (0, 0, 0)]), SpeculativeSampling(), seed=seed)
        assert [g.tokens for g in tree.generate(prompts, 20)] == [g.tokens for g in chain]


def test_a_sampled_tree_row_draws_the_same_alone_and_in_a_batch(arch_pairs):
    pair = no_eos(arch_pairs("gpt2", "float32")[1]).with_sampling(temperature=0.8, top_p=0.9)
    prompts = ragged(pair, 5)
    batch = BatchDecoder(pair, SHAPES["confidence"](), SpeculativeSampling(), seed=3).generate(prompts, 20)
    for i in (0, 4):
        alone = BatchDecoder(pair, SHAPES["confidence"](), SpeculativeSampling(), seed=3 + i).generate([prompts[i]], 20)
        assert alone[0].tokens == batch[i].tokens
    assert SpeculativeDecoder(pair, SHAPES["confidence"](), SpeculativeSampling(), seed=3).generate(
        prompts[0], 20).tokens == batch[0].tokens


def two_token_law(pair, prompt):
    """(V, V) the target's law of the next two tokens after prompt, under the pair's sampling transform."""
    from decode.sampling import transform

    s = pair.config.sampling
    with torch.no_grad():
        p1 = transform(pair.logits(pair.target(torch.tensor([prompt])).logits[0, -1]), s)
        nxt = transform(pair.logits(pair.target(torch.tensor([prompt + [a] for a in range(pair.vocab)])).logits[:, -1]), s)
    return p1[:, None] * nxt


def tree_pvalue(pair, shape, n: int = 2400, rows: int = 8) -> float:
    """Chi-square p-value of n two-token draws after one prompt against the target's law, decoded in batches of
    `rows` rows of that prompt (each row its own stream: seed + its index)."""
    from scipy.stats import chisquare

    prompt = [3, 7]
    law = two_token_law(pair, prompt)
    counts = torch.zeros_like(law)
    dec = BatchDecoder(pair, shape, SpeculativeSampling())
    for seed in range(0, n, rows):
        dec.seed = seed
        for g in dec.generate([prompt] * rows, 2):
            counts[g.tokens[0], g.tokens[1]] += 1
    expected, counts = law.flatten() * n, counts.flatten()
    if counts[expected == 0].sum() > 0:  # a pair the target's (truncated) law never emits
        return 0.0
    big = expected >= 5  # pool the rare cells into one so the chi-square approximation holds
    obs, exp = counts[big], expected[big]
    if expected[~big].sum() > 0:
        obs, exp = torch.cat([obs, counts[~big].sum()[None]]), torch.cat([exp, expected[~big].sum()[None]])
    return chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


SETTINGS = {"t1": dict(temperature=1.0), "t0.8-p0.9-k12": dict(temperature=0.8, top_p=0.9, top_k=12)}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("width", [2, 4])
def test_sampled_trees_keep_the_targets_law(tiny_pair, setting, width):
    """Width 2 and 4 at the root and below, in batches of 8 rows and of one row. Sized to the power they need: each
    draw count here still fails both broken trees of the next test (no residual update, children drawn with
    replacement) in both settings, at p about 1e-6 for the 150 one-row draws at T = 1 and far below that elsewhere."""
    pair = dataclasses.replace(tiny_pair.with_sampling(**SETTINGS[setting]), eos_ids=(-1,))
    paths = [(j,) for j in range(width)] + [(0, j) for j in range(width)] + [(1, j) for j in range(width - 1)]
    assert tree_pvalue(pair, StaticTree(paths), n=1200, rows=240) > ALPHA
    if width == 4:  # batches of 8, and of one row through the one-sequence decoder's entry
        assert tree_pvalue(pair, ConfidenceTree(top_k=4, depth=2, nodes=9), n=400, rows=8) > ALPHA
        assert tree_pvalue(pair, ConfidenceTree(top_k=4, depth=2, nodes=9), n=150, rows=1) > ALPHA
        assert tree_pvalue(pair, EveryOther(top_k=4, depth=2, nodes=9), n=400, rows=8) > ALPHA


def test_a_tree_without_the_residual_update_or_drawn_with_replacement_is_caught(tiny_pair, monkeypatch):
    """1200 draws a variant: each gives p = 0 to double precision (so do 600)."""
    pair = dataclasses.replace(tiny_pair.with_sampling(temperature=1.0), eos_ids=(-1,))
    shape = StaticTree([(0,), (1,), (2,), (0, 0), (0, 1)])
    with monkeypatch.context() as m:  # after a rejected sibling, the next is tested against p itself
        m.setattr(labels_mod, "residual", lambda r, q: r)  # sibling_tests lives in decode.labels
        m.setattr(kernels, "HAVE_NUMBA", False)  # its compiled twin is held equal to it (tests/test_kernels.py)
        assert tree_pvalue(pair, shape, n=1200, rows=256) < ALPHA
    with monkeypatch.context() as m:  # siblings may repeat a token, yet are tested as if drawn without replacement
        def with_replacement(q, counts, u):
            out, at = [], 0
            for law, c in zip(q, counts):
                out.append([draw(law, torch.tensor(u[at + j], dtype=torch.float64)) for j in range(c)])
                at += c
            return out
        m.setattr(tree_mod, "without_replacement", with_replacement)
        assert tree_pvalue(pair, shape, n=1200, rows=256) < ALPHA


def test_shapes_are_prefix_closed_and_sequoia_takes_the_best_nodes():
    paths = sequoia_paths([0.8, 0.1], nodes=5, depth=3)
    assert paths == [(0,), (0, 0), (0, 0, 0), (1,), (0, 1)]
    assert expected_tokens([0.8, 0.1], paths) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.1 + 0.08)
    assert sequoia_paths([0.8, 0.1], nodes=9, depth=1) == [(0,), (1,)]
    # node 3 (value .5) is the second child of the root: it waits for node 2 (value .1), its earlier sibling
    assert best_first([1.0, 0.9, 0.1, 0.5, 0.8], [-1, 0, 0, 0, 1], [0, 0, 1, 2, 0], 3) == [1, 2, 4]
    with pytest.raises(ValueError, match=r"rank path \[1\] needs its parent and earlier siblings"):
        StaticTree([(1,)])


def test_trees_refuse_lossy_rules_in_one_line(arch_pairs):
    pair = arch_pairs("llama", "float32")[1]
    with pytest.raises(ValueError, match="token trees verify by greedy matching .* not FSD"):
        BatchDecoder(pair, SHAPES["sequoia"](), FSD())
    with pytest.raises(ValueError, match="GreedyMatch accepts only the target's argmax, so at temperature 1"):
        BatchDecoder(pair.with_sampling(temperature=1.0), SHAPES["sequoia"](), GreedyMatch())


def test_the_tree_plan_sizes_sequoia_by_the_cost_tables(tiny_pair):
    """A verify that costs nothing more per node grows the tree; one that costs a draft step's worth per node keeps
    it small. The greedy vector is a share of positions: each entry in [0, 1], together at most 1."""
    from decode.costs.model import CostModel
    from decode.evaluation.tree_plan import best_tree, positional_vector

    v = positional_vector(tiny_pair.with_sampling(temperature=0.0), [[3, 7], [5, 1, 2]], new=12)
    assert len(v) == 4 and all(0 <= x <= 1 for x in v) and sum(v) <= 1 + 1e-9
    sampled = positional_vector(tiny_pair.with_sampling(temperature=1.0), [[3, 7]], new=6, draws=2)
    assert all(0 <= x <= 1 for x in sampled) and sum(sampled) <= 1 + 1e-9
    accept = [0.7, 0.15, 0.05, 0.02]
    wide = {"draft": ([1, 64], [1.0, 1.0])}  # a draft level wider than its step table: the prefill curve
    flat = CostModel(step={"draft": [1.0] * 16, "target": [10.0] * 65}, switched={"target": [10.0] * 65}, prefill=wide)
    steep = CostModel(step={"draft": [1.0] * 16, "target": [10.0 + 5 * n for n in range(65)]},
                      switched={"target": [10.0 + 5 * n for n in range(65)]}, prefill=wide)
    big, small = best_tree(accept, flat), best_tree(accept, steep)
    assert len(big[0]) > 3 * len(small[0]) and big[1] > small[1]


def test_the_plan_and_the_tree_bench_run_end_to_end(tiny_pair_yaml, tiny_pair, tmp_path):
    """python -m decode.evaluation.tree_plan writes each setting's vector and tree, and the tree bench decodes them against
    chains, printing a row per method with its interval against the dev-chosen chain; the head rows run where the
    setting's heads exist and are left out, in one line, where they do not."""
    from decode.evaluation import tree_bench, tree_plan
    from decode.evaluation.report import made_by, provenance
    from tests.test_head_tree import sibling_head

    plan, out = tmp_path / "trees.json", tmp_path / "trees.md"
    def planned(*settings):
        tree_plan.main(["--pair", str(tiny_pair_yaml), "--prompts", "2", "--new", "6", "--settings", *settings, "--nodes",
                        "6", "--repeats", "1", "--out", str(plan)])
        return json.loads(plan.read_text())

    got = planned("greedy", "t1")
    assert set(got) == {"pair", "greedy", "t1"} and all(len(got[s]["v"]) == 4 and got[s]["costs"] for s in ("greedy", "t1"))
    older = {"pair": got["pair"], "costs": got["greedy"]["costs"], "greedy": {k: v for k, v in got["greedy"].items()
                                                                           if k != "costs"}}
    plan.write_text(json.dumps(older))  # a plan written before each tree kept its tables
    again = planned("t1")  # planning one setting again keeps the other's tree, with the tables it was sized by
    assert again["greedy"] == got["greedy"] and set(again) == {"pair", "greedy", "t1"}
    sibling_head(tmp_path, tiny_pair.with_sampling(temperature=1.0), name="tree")  # T = 1: no suffix
    tree_bench.main(["--pair", str(tiny_pair_yaml), "--plan", str(plan), "--settings", "t1", "--dev", "1", "--test", "2",
                     "--new", "6", "--out", str(out), "--tree_head", str(tmp_path / "tree{suffix}"),
                     "--chain_head", str(tmp_path / "none{suffix}")])
    text = out.read_text()
    assert "chain chosen on dev: K = " in text
    assert f"{made_by([provenance()])}." in text
    for name in ("target", "chain K=1", "chain K=6", "tree sequoia", "tree confidence", "tree head"):
        assert f"| {name} |" in text
    assert "| chain cost-aware |" not in text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here: the cuda-marked tests run where one is present")
@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("gpt2", "bfloat16")])
def test_trees_on_the_gpu(arch_pairs, family, dtype):
    """Greedy trees equal the target alone on the GPU at batch 8; a sampled row draws alone what it draws in a batch."""
    pair = no_eos(arch_pairs(family, dtype, "cuda")[1])
    prompts = ragged(pair, 8)
    want = BatchAutoregressive(pair).generate(prompts, 16)
    for shape in SHAPES.values():
        assert_rows_equal(pair, prompts, BatchDecoder(pair, shape(), GreedyMatch()).generate(prompts, 16), want, family)
    sampled = pair.with_sampling(temperature=1.0)
    batch = BatchDecoder(sampled, SHAPES["confidence"](), SpeculativeSampling(), seed=2).generate(prompts, 16)
    alone = BatchDecoder(sampled, SHAPES["confidence"](), SpeculativeSampling(), seed=2 + 5).generate(prompts[5:6], 16)
    assert len(batch[5].tokens) == 16 and (dtype != "float32" or alone[0].tokens == batch[5].tokens)
