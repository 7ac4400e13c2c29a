"""Batched speculative decoding (decode.batch): every row equals the target alone decoding the same batch, token for
token, for every family in float32 and bfloat16 with ragged prompts; a row's output does not depend on its
neighbours; sampled rows keep the target's law."""

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch

from decode.batch import BatchAutoregressive, BatchDecoder
from decode.control import BatchCostAware, BatchSizeK, acceptance, expected_max, level_progress
from decode.costs.batch import BatchCosts
from decode.engine import SpeculativeDecoder
from decode.hf import hf_generate_batch
from decode.policies import DraftConfidence, FixedK, SpecDecPP
from decode.rules.chain import GreedyMatch, SpeculativeSampling
from tests.test_archs import MATRIX, TEXTS, arch_pairs, no_eos  # noqa: F401, F811  (arch_pairs is a fixture)
from tests.test_decode import ALPHA, export_head, two_token_pvalue

EXTRAS = ("draft_entropy", "draft_top1", "cand_logq", "accepted_run")
# Tables that make drafting pay whenever a candidate is ever accepted (drafting and realigning cost nothing), and
# tables under which it never pays (a draft step costs ten verifications): the controller's two regimes.
CHEAP = BatchCosts([1, 32], [0.0, 0.0], [[10.0] * 9, [20.0] * 9], [0.0, 0.0])
DEAR = BatchCosts([1, 32], [100.0, 200.0], [[10.0] * 9, [20.0] * 9], [1.0, 1.0])


def controller(head, costs):
    ctl = BatchCostAware(head)
    ctl.set_batch_costs(costs)
    return ctl


def ragged(pair, b: int) -> list[list[int]]:
    """b prompts of different lengths (the texts, cut at different points, repeated)."""
    ids = [pair.encode(TEXTS[i % len(TEXTS)]) for i in range(b)]
    return [x[: max(2, len(x) - (i % 5))] for i, x in enumerate(ids)]


def top2_margin(pair, prompt, tokens, at: int) -> float:
    """The target's top-2 logit gap where a row first differs: a near-tie that padding's rounding may flip."""
    with torch.no_grad():
        logits = pair.target(torch.tensor([prompt + tokens[:at]], device=pair.input_device("target"))).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_rows_equal(pair, prompts, got, want, tag):
    for i, (g, w) in enumerate(zip(got, want)):
        if g.tokens != w.tokens:
            at = next(j for j, (a, b) in enumerate(zip(g.tokens, w.tokens)) if a != b)
            margin = top2_margin(pair, prompts[i], w.tokens, at)
            assert pair.target.dtype != torch.float32 and margin < 0.02 * abs(margin) + 0.1, \
                (tag, i, at, margin, g.tokens, w.tokens)


@pytest.mark.parametrize("family,dtype", MATRIX)
def test_batched_greedy_rows_equal_the_target_alone_on_the_same_batch(arch_pairs, family, dtype, tmp_path):
    """At B = 1, 3, 8 and 32: fixed K, draft confidence, a head per row (one head forward over the rows per step) and
    the batch controller in both regimes."""
    pair = no_eos(arch_pairs(family, dtype)[1])
    head = export_head(tmp_path, pair, position="prev", extras=EXTRAS, depth=2)
    for b, policy, rule in ((1, FixedK(3), SpeculativeSampling()), (1, controller(head, CHEAP), GreedyMatch()),
                            (3, DraftConfidence(0.3), GreedyMatch()), (3, SpecDecPP(head, h=0.5), GreedyMatch()),
                            (8, FixedK(3), SpeculativeSampling()), (8, controller(head, DEAR), SpeculativeSampling()),
                            (32, FixedK(2), GreedyMatch()), (32, controller(head, CHEAP), SpeculativeSampling())):
        prompts = ragged(pair, b)
        want = BatchAutoregressive(pair).generate(prompts, 12)
        dec = BatchDecoder(pair, policy, rule)
        got = dec.generate(prompts, 12)
        assert_rows_equal(pair, prompts, got, want, (family, dtype, b, type(policy).__name__))
        if policy.__class__ is BatchCostAware and policy.costs is DEAR:  # drafts once, to learn, then plain steps
            assert 0 < dec.stats.drafted <= policy.max_len * b and dec.stats.target_calls == 12


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here: the cuda-marked tests run where one is present")
@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("mistral", "bfloat16"), ("gpt2", "float32")])
def test_batched_greedy_rows_on_the_gpu(arch_pairs, family, dtype, tmp_path):
    """On the GPU (caches, masks, the draft's scalars in torch, the head's inputs read back per step): rows equal the
    target alone decoding the same batch, under fixed K, draft confidence and the batch controller."""
    pair = no_eos(arch_pairs(family, dtype, "cuda")[1])
    head = export_head(tmp_path, pair, position="prev", extras=EXTRAS, depth=2)
    for b, policy, rule in ((1, FixedK(3), GreedyMatch()), (8, DraftConfidence(0.3), SpeculativeSampling()),
                            (8, controller(head, CHEAP), GreedyMatch()), (32, FixedK(2), SpeculativeSampling())):
        prompts = ragged(pair, b)
        want = BatchAutoregressive(pair).generate(prompts, 12)
        assert_rows_equal(pair, prompts, BatchDecoder(pair, policy, rule).generate(prompts, 12), want, (family, dtype, b))


def test_batch_of_32_with_eos_and_a_budget_per_row(arch_pairs):
    """Rows end on their own EOS or budget and leave the batch; the rest go on unchanged."""
    pair = arch_pairs("mistral", "float32")[1]
    prompts = ragged(pair, 32)
    want = BatchAutoregressive(pair).generate(prompts, 24)
    got = BatchDecoder(pair, FixedK(4), SpeculativeSampling()).generate(prompts, 24)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    ends = [g.tokens[-1] in pair.eos_ids for g in got]
    assert any(ends) or all(len(g.tokens) == 24 for g in got)


def test_rows_decode_through_their_eos_when_told_and_hf_batches_agree(arch_pairs):
    """stop_at_eos=False (a throughput bench's fixed lengths): every row emits the whole budget, its text up to its EOS
    is the text that stops there, and Hugging Face generate() on the left-padded batch agrees either way."""
    pair = arch_pairs("llama", "float32")[1]
    prompts = ragged(pair, 8)
    pair = dataclasses.replace(pair, eos_ids=(Counter(t for p in prompts for t in p).most_common(1)[0][0],))
    stopped = BatchAutoregressive(pair).generate(prompts, 16)
    assert any(len(g.tokens) < 16 for g in stopped), "no row met the EOS: the test would check nothing"
    through = BatchAutoregressive(pair).generate(prompts, 16, stop_at_eos=False)
    got = BatchDecoder(pair, FixedK(3), GreedyMatch()).generate(prompts, 16, stop_at_eos=False)
    assert [g.tokens for g in got] == [t.tokens for t in through]
    for s, t in zip(stopped, through):
        assert len(t.tokens) == 16 and t.tokens[:len(s.tokens)] == s.tokens
    for stop, want in ((True, stopped), (False, through)):
        hf, _ = hf_generate_batch(pair, prompts, 16, 0, stop)
        assert hf == [w.tokens for w in want], stop


def test_a_row_alone_and_inside_a_batch_of_32_gives_the_same_tokens(arch_pairs):
    pair = no_eos(arch_pairs("llama", "float32")[1])
    prompts = ragged(pair, 32)
    batch = BatchDecoder(pair, FixedK(3), SpeculativeSampling()).generate(prompts, 16)
    for i in (0, 7, 31):
        alone = BatchDecoder(pair, FixedK(3), SpeculativeSampling()).generate([prompts[i]], 16)[0]
        assert alone.tokens == batch[i].tokens
        assert SpeculativeDecoder(pair, FixedK(3), SpeculativeSampling()).generate(prompts[i], 16).tokens == alone.tokens


class Rows:
    """decoder.generate(prompt, n) for two_token_pvalue, served from batches of 8 ragged rows in which the first four
    rows decode `prompt`: each batch a new seed (rows draw from streams seed + row)."""

    def __init__(self, pair, others):
        self.pair, self.others, self.buffer, self.seed = pair, others, [], 0

    def generate(self, prompt, n):
        if not self.buffer:
            self.seed += 8
            dec = BatchDecoder(self.pair, FixedK(2), SpeculativeSampling(), seed=self.seed)
            self.buffer = dec.generate([prompt] * 4 + self.others, n)[:4]
        return self.buffer.pop()


@pytest.mark.slow
def test_sampled_rows_of_a_batch_of_8_keep_the_targets_law(tiny_pair):
    pair = dataclasses.replace(tiny_pair.with_sampling(temperature=1.0), eos_ids=(-1,))
    prompt = [3, 7]
    with torch.no_grad():
        p1 = pair.logits(pair.target(torch.tensor([prompt])).logits[0, -1]).softmax(-1)
        nxt = pair.logits(pair.target(torch.tensor([prompt + [a] for a in range(pair.vocab)])).logits[:, -1]).softmax(-1)
    law = p1[:, None] * nxt
    others = [[5, 1, 2, 9, 4], [8], [2, 2, 2], [11, 3, 6, 1, 1, 7]]
    # 750 draws: a broken resample (test_decode's BrokenResample) decoded the same way fails at p = 5e-18
    assert two_token_pvalue(Rows(pair, others), law, prompt, n=750) > ALPHA


def test_a_sampled_row_draws_from_its_own_stream_whatever_its_neighbours(arch_pairs):
    """Row i of a request draws from seed + i: alone with that seed it gives the same tokens (float32), so what a row
    emits never depends on the rows beside it."""
    pair = no_eos(arch_pairs("llama", "float32")[1]).with_sampling(temperature=1.0)
    prompts = ragged(pair, 8)
    batch = BatchDecoder(pair, FixedK(3), SpeculativeSampling(), seed=5).generate(prompts, 16)
    for i in (0, 3, 7):
        alone = BatchDecoder(pair, FixedK(3), SpeculativeSampling(), seed=5 + i).generate([prompts[i]], 16)[0]
        assert alone.tokens == batch[i].tokens
    assert SpeculativeDecoder(pair, FixedK(3), SpeculativeSampling(), seed=5).generate(prompts[0], 16).tokens == \
        batch[0].tokens  # and row 0 is the one-sequence engine's draw for draw


def test_the_batch_controller_drafts_while_drafting_pays_and_stops_when_it_does_not(arch_pairs, tmp_path):
    """A draft that is its own target accepts every candidate. Under CHEAP tables a draft step is free, so every
    round drafts; under DEAR it never pays, so after the first round (nothing known yet) every round is a plain
    target step, which is the target alone's work."""
    pair = no_eos(arch_pairs("llama", "float32")[1])
    pair = dataclasses.replace(pair, target=pair.draft)
    head = export_head(tmp_path, pair, position="prev", extras=EXTRAS)
    prompts = ragged(pair, 8)
    cheap = BatchDecoder(pair, controller(head, CHEAP), GreedyMatch())
    cheap.generate(prompts, 12)
    assert cheap.stats.discarded == 0 and cheap.stats.target_calls < 12 and cheap.stats.drafted >= cheap.stats.rounds
    dear = BatchDecoder(pair, controller(head, DEAR), GreedyMatch())
    dear.generate(prompts, 12)
    assert dear.stats.draft_calls == 1 and dear.stats.drafted == 8  # one candidate per row, then no more drafting
    assert dear.stats.target_calls == 11  # its candidate accepted, the first round gave two tokens, then one a step
    dear.generate(prompts, 12)  # the next request: what the first taught stands, so it never drafts
    assert dear.stats.draft_calls == 0 and dear.stats.target_calls == 11
    dear.control.forget()
    dear.generate(prompts, 12)
    assert dear.stats.draft_calls == 1


def test_a_size_that_drafted_few_rounds_drafts_on_until_they_show_it_does_not_pay(arch_pairs, tmp_path):
    """Drafted rounds at one size that made 10% less progress per ms than a plain step: over 10 rounds (one request's,
    noise) the controller drafts on; over 1000 it stops."""
    pair = arch_pairs("llama", "float32")[1]
    ctl = controller(export_head(tmp_path, pair, position="prev", extras=EXTRAS),
                     BatchCosts([1, 32], [1.0, 2.0], [[4.0 + k for k in range(9)], [8.0 + 2 * k for k in range(9)]],
                                [0.0, 0.0]))
    ctl.prior = None  # the head's prior would stand in beside the rounds: this test weighs the rounds alone
    c0, c2 = ctl.round_costs(1)[0], ctl.round_costs(1)[2]
    for rounds, drafts in ((10, True), (1000, False)):
        ctl.forget()
        ctl.start(1)
        ctl.stretches[1] = np.array([rounds, rounds * 0.9 * c2 / c0, 2.0 * rounds, rounds * c2, rounds * c2])
        assert (ctl.begin(1, [20]) > 0) == drafts, rounds


def test_a_smaller_sizes_rounds_stand_in_for_the_rows_as_they_are(arch_pairs, tmp_path):
    """One row's 2.1 tokens a round at 2 candidates: the acceptance rate that explains them, carried to 8 level rows,
    is a round that rarely moves the slowest row on; carried to rows spread apart, it is the leading row's round."""
    pair = arch_pairs("llama", "float32")[1]
    ctl = controller(export_head(tmp_path, pair, position="prev", extras=EXTRAS), CHEAP)
    a = acceptance(2.1, 2, 1)
    assert 1 + a + a * a == pytest.approx(2.1, abs=1e-6)
    ctl.start(8)
    ctl.begin(8, [20] * 8)
    assert ctl.stand_in(a, 2) == pytest.approx(level_progress(a, 2, 8)) == pytest.approx(1 + a ** 8 + a ** 16)
    ctl.begin(8, [20, 9, 8, 7, 5, 4, 3, 2])
    assert ctl.stand_in(a, 2) == pytest.approx(2.1, abs=1e-6)


def test_a_batch_that_never_drafts_does_the_target_alones_forwards(arch_pairs):
    """The first token of every row comes from the prefill (as in HF generate()): the target alone spends one forward
    per token of its longest row, and a speculative decoder at K = 0 spends exactly those forwards."""
    pair = no_eos(arch_pairs("qwen2", "float32")[1])
    prompts = ragged(pair, 8)
    alone = BatchAutoregressive(pair)
    want = alone.generate(prompts, 10)
    assert len(alone.stats.calls) == alone.stats.target_calls == 10
    plain = BatchDecoder(pair, BatchSizeK({1: 0}), GreedyMatch())
    assert [g.tokens for g in plain.generate(prompts, 10)] == [w.tokens for w in want]
    assert [c for c in plain.stats.calls if c[0] == "target"] == alone.stats.calls and plain.stats.draft_calls == 0


def test_a_rounds_progress_is_the_expected_drop_of_the_most_any_row_has_left():
    """expected_max, which the controller's progress is built on, against draws: rows of different remaining budgets
    and survival curves, level rows (the slowest sets the progress) and one row (its expected tokens)."""
    rng = np.random.default_rng(0)
    for reach, probs in (([9, 9, 9], [[0.9, 0.8], [0.9, 0.8], [0.5, 0.5]]), ([12, 10, 7, 11], [[0.7, 0.6, 0.9]] * 4),
                         ([5], [[0.8, 0.8, 0.8]])):
        reach, probs = np.array(reach, dtype=float), np.array(probs)
        surv = np.c_[np.ones(len(reach)), np.cumprod(probs, 1)]
        accepted = np.cumprod(rng.random((200_000, *probs.shape)) < probs, 2).sum(2)
        drawn = (reach - 1 - accepted).max(1).mean()
        assert expected_max(reach, surv) == pytest.approx(drawn, abs=0.01)
        assert np.allclose(expected_max(reach, np.stack([surv, surv])), expected_max(reach, surv))
    level = np.array([9.0] * 3)  # level rows: the batch moves on by 1 + P(every row takes the candidate)
    assert 9 - expected_max(level, np.array([[1, 0.9]] * 2 + [[1, 0.5]])) == pytest.approx(1 + 0.9 * 0.9 * 0.5)
    assert 5 - expected_max(np.array([5.0]), np.array([[1, 0.8, 0.4]])) == pytest.approx(2.2)


def test_batch_size_table_and_cost_interpolation():
    table = BatchSizeK({1: 4, 8: 2, 64: 0})
    assert [table.begin(b) for b in (1, 7, 8, 63, 64, 256)] == [4, 4, 2, 2, 0, 0]
    with pytest.raises(ValueError, match="BatchSizeK"):
        BatchSizeK({0: 3})
    d, verify, move = DEAR.at(16)
    assert d == pytest.approx(100 + 100 * 15 / 31) and verify[0] == pytest.approx(10 + 10 * 15 / 31)
    assert DEAR.at(1000)[0] == 200.0  # past the largest size measured: its costs


def test_batch_costs_are_measured_on_the_decoders_own_caches(tiny_pair):
    costs = BatchCosts.measure(tiny_pair, [1, 4], prefix=12, max_len=3, repeats=2)
    assert costs.sizes == [1, 4] and len(costs.verify_ms) == 2 and len(costs.verify_ms[0]) == 4
    assert all(x > 0 for x in costs.draft_ms + costs.move_ms + [v for row in costs.verify_ms for v in row])
    assert "batch" in costs.describe()


def test_the_batch_bench_reports_its_noise_floor_from_the_target_alone_run_twice():
    """The target alone decodes every batch twice: markdown() prints the second run's per-batch ratios to the first
    as the run's A/A check, and says so when a run has none."""
    from decode.evaluation.batch import AGAIN, markdown

    def row(method, b, per_batch, note=""):
        return {"prompts": "p/test", "setting": "greedy", "batch_size": b, "method": method, "speedup": 1.0, "lo": 1.0,
                "hi": 1.0, "tokens_per_s": 100.0, "row_latency_s": 0.1, "peak_kv_mib": 1.0, "note": note,
                "per_batch": per_batch}

    rows = [row("target", 8, [100.0, 200.0]), row(AGAIN, 8, [95.0, 220.0]),
            row("SD K=1", 8, [90.0, 210.0], "the single K best over all sizes on dev"),
            row("draft confidence 0.4", 8, [80.0, 150.0]), row("batch-size table (dev)", 8, [95.0, 220.0], "K = 0 at this size"),
            row("batch controller", 8, [100.0, 200.0])]
    assert "B = 8 1.02x (0.95-1.10)." in markdown(rows)
    assert "no A/A check" in markdown(rows[:1] + rows[2:])
    assert markdown(rows).startswith("Batch bench decoded at an unrecorded commit")  # these rows carry no provenance()


def test_the_batch_bench_runs_every_method_once_per_batch_in_seeded_shuffled_orders():
    """measure(): each batch runs every method once, in an order drawn from the seed and the batch's index, so no
    method always follows the same neighbour, and a rerun with the seed runs the same orders."""
    from decode.evaluation.batch import measure

    calls = []

    def method(name):
        def run(batch, seed):
            calls.append(name)
            return [[1] * 4 for _ in batch], 2.0, 0.5, None, None
        return run

    methods = {n: method(n) for n in "abcdef"}
    res = measure(None, methods, [[[1]]] * 8, 3, "t")
    orders = [calls[i * 6:(i + 1) * 6] for i in range(8)]
    assert all(sorted(o) == list("abcdef") for o in orders) and res["a"] == [(2.0, 0.5, None, None)] * 8
    assert len({o[o.index("a") + 1] if o[-1] != "a" else None for o in orders}) > 1  # a's follower changes
    calls.clear()
    measure(None, methods, [[[1]]] * 8, 3, "t")
    assert [calls[i * 6:(i + 1) * 6] for i in range(8)] == orders


def test_the_batch_bench_keys_what_it_saves_by_the_config_that_made_it(tiny_pair, tmp_path):
    """A saved piece stands in for measuring again only under what made it: more batches at one size give that size
    another file and leave the others', a field the dev pass does not read leaves its choice standing, a "8" key is
    B = 8, a half-written head folder is hashed as it is, and a run prunes the cache to its own pieces."""
    from decode.evaluation.batch import BatchBenchConfig, cached, prune

    def cfg(**kw):
        return BatchBenchConfig(pair="x.yaml", head=str(tmp_path / "head"), tree_head="", **kw)

    a = cached(tmp_path, tiny_pair, cfg(), 32)
    assert a == cached(tmp_path, tiny_pair, cfg(), 32) and a.name.startswith("t1_b32-")
    assert a != cached(tmp_path, tiny_pair, cfg(repeats={32: 6}), 32)
    assert cached(tmp_path, tiny_pair, cfg(), 8) == cached(tmp_path, tiny_pair, cfg(repeats={32: 6}), 8)
    assert cached(tmp_path, tiny_pair, cfg(repeats={"8": 4}), 8) == cached(tmp_path, tiny_pair, cfg(repeats={8: 4}), 8)
    assert cfg(repeats={"8": 4}).repeats == {8: 4}
    assert cached(tmp_path, tiny_pair, cfg()) == cached(tmp_path, tiny_pair, cfg(repeats={32: 6}, confidence=0.2))
    assert cached(tmp_path, tiny_pair, cfg()) != cached(tmp_path, tiny_pair, cfg(fixed_k=[1]))
    assert cached(tmp_path, tiny_pair, cfg(fixed_k=[1]), 8) != cached(tmp_path, tiny_pair, cfg(), 8)  # its dev table
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "model.safetensors").write_text("w")  # an export cut short: no config.json yet
    retrained = cached(tmp_path, tiny_pair, cfg(), 32)
    assert retrained != a and cached(tmp_path, tiny_pair, cfg()) == cached(tmp_path, tiny_pair, cfg(), None)
    for name in ("greedy_b32.json", a.name, retrained.name, "dev_t1-0123456789abcdef.json"):
        (tmp_path / name).write_text("[]")
    prune(tmp_path, [retrained])
    assert [p.name for p in tmp_path.glob("*.json")] == [retrained.name]
