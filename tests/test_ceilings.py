"""The ceilings of replay: the hindsight oracle is the cheapest call log there is, the perfect head needs alpha."""

import itertools

import numpy as np
import pytest
import torch

from decode.evaluation.ceilings import Oracle, PerfectHead, hindsight, round_calls
from decode.evaluation.intervals import paired_ratio_ci
from decode.evaluation.replay import CostLine, FreeRun, Trajectory, record, replay, speedup, target_alone_calls
from decode.policies import AdaEDL, DraftConfidence, FixedK
from tests.test_decode import PROMPTS

COSTS = [CostLine.parse("1.0,5.0,0.25"), CostLine.parse("1.4,5.0,1.5"), CostLine.parse("0.1,5.0,0.0")]


def synthetic(agree: list[int], kmax: int = 4) -> Trajectory:
    """A greedy trajectory whose draft agrees with the response for agree[i] candidates after prefix i."""
    y = list(range(100, 100 + len(agree)))
    runs = [FreeRun([y[i + j] if j < a and i + j < len(y) else 1 for j in range(kmax)], [0.5] * kmax, [1.0] * kmax,
                    [0.5] * kmax, None) for i, a in enumerate(agree)]
    return Trajectory([1, 2, 3], y, runs, len(y))


def brute_force(traj: Trajectory, cost) -> float:
    """The cheapest call log over every sequence of round lengths (tiny trajectories only)."""
    best = float("inf")
    kmax = len(traj.runs[0].tokens)
    for ks in itertools.product(range(1, kmax + 1), repeat=len(traj.response)):
        calls, out, feed = [("draft", 2), ("target", 2)], 0, 1
        for k in ks:
            if out >= len(traj.response):
                break
            run = traj.runs[out]
            k = min(k, traj.max_new - out)
            n = next((j for j in range(k) if out + j >= len(traj.response) or
                      not run.accepted(j, traj.response[out + j])), k)
            calls += round_calls(feed, k)
            out, feed = out + n + 1, 2 if n == k else 1
        if out >= len(traj.response):
            best = min(best, cost.predict_s(calls))
    return best


@pytest.mark.parametrize("cost", COSTS)
def test_the_hindsight_oracle_is_the_cheapest_call_log_of_all(cost):
    """Against every sequence of round lengths on small trajectories, under cost lines where drafting the first
    rejected candidate pays (a free verify width) and where it does not."""
    rng = np.random.default_rng(0)
    for _ in range(6):
        traj = synthetic(rng.integers(0, 5, size=7).tolist())
        calls, n = hindsight(traj, cost, 512)
        assert n == len(traj.response)
        assert cost.predict_s(calls) == pytest.approx(brute_force(traj, cost))


def test_the_hindsight_oracle_beats_every_replayed_policy(tiny_pair):
    """Greedy, a real pair: at or above every policy replayed on the same trajectories and cost model, the
    first-disagreement oracle included, which drafts each rejected candidate too."""
    greedy = tiny_pair.with_sampling(temperature=0.0)
    trajs = [record(greedy, p, 24, kmax=8, hidden=False) for p in PROMPTS[:6]]
    for cost in COSTS[:2]:
        ours = np.mean([cost.predict_s(target_alone_calls(t)) / cost.predict_s(hindsight(t, cost, 512)[0])
                        for t in trajs])
        others = [speedup(trajs, p, cost, 512)[0] for p in
                  (*(FixedK(k) for k in range(1, 9)), DraftConfidence(0.3), AdaEDL(0.5), Oracle())]
        assert ours >= max(others) - 1e-12
        assert ours > speedup(trajs, Oracle(), cost, 512)[0]  # the first-disagreement oracle is not a limit


def test_the_perfect_head_reads_the_true_acceptance_and_only_under_sampling(tiny_pair):
    pair = tiny_pair.with_sampling(temperature=1.0)
    traj = record(pair, PROMPTS[0], 16, kmax=6, hidden=False)
    head = PerfectHead(1.0, 5.0, 0.25)
    calls, n = replay(traj, head, 512)
    assert n == len(traj.response) and head.spent > 0
    for run in traj.runs:  # candidates sure to be accepted: always worth drafting on, to the recording's end
        run.accept = [1.0] * len(run.tokens)
    assert all(k == 6 or k >= traj.max_new - out for k, out in rounds(replay(traj, PerfectHead(1.0, 5.0, 0.25), 512)[0]))
    with pytest.raises(ValueError, match="replay supplies only under sampling"):
        replay(record(tiny_pair.with_sampling(temperature=0.0), PROMPTS[0], 8, kmax=4, hidden=False), PerfectHead(1.0, 5.0, 0.25), 512)


def rounds(calls):
    """The round lengths of a call log (the target's verify sizes minus one) and the tokens out before each."""
    out, found = 0, []
    for m, n in calls[2:]:
        if m == "target":
            found.append((n - 1, out))
            out += n
    return found


def test_paired_ratio_intervals_cancel_what_prompts_share():
    """Two methods that differ by 2% on prompts whose difficulty varies 10x: the paired interval is tight around
    1.02 although each method's own mean varies far more."""
    rng = np.random.default_rng(0)
    base = rng.uniform(0.2, 2.0, size=300)
    r, lo, hi = paired_ratio_ci(base * 1.02 * rng.normal(1, 0.01, 300), base)
    assert lo < r < hi and 1.01 < lo and hi < 1.03
    assert paired_ratio_ci(base, base)[1:] == (1.0, 1.0)


def test_the_engine_decodes_the_hindsight_plan_and_replay_meets_it(tiny_pair):
    """Greedy: the engine under HindsightOracle emits the target's tokens in exactly the planned rounds (replay's
    call log of the same plan), spending fewer predicted seconds than fixed K or the first-disagreement oracle."""
    from decode.engine import Autoregressive, SpeculativeDecoder
    from decode.evaluation.ceilings import HindsightOracle, StepCosts
    from decode.rules.chain import GreedyMatch, SpeculativeSampling

    greedy = tiny_pair.with_sampling(temperature=0.0)
    for prompt in PROMPTS[:4]:
        oracle = HindsightOracle()
        out = SpeculativeDecoder(greedy, oracle, GreedyMatch()).generate(prompt, 24)
        assert out.tokens == Autoregressive(greedy).generate(prompt, 24).tokens
        replayed = HindsightOracle()
        replayed.set_costs(oracle.cost.draft_ms, oracle.cost.verify_ms)
        traj = record(greedy, prompt, 24, kmax=20, hidden=False)
        assert replay(traj, replayed, greedy.config.max_context)[0] == out.stats.calls
        cost = StepCosts(oracle.cost.draft_ms, oracle.cost.verify_ms)
        others = [replay(traj, p, greedy.config.max_context)[0] for p in (Oracle(), *(FixedK(k) for k in (1, 3, 6)))]
        assert cost.predict_s(out.stats.calls) <= min(cost.predict_s(c) for c in others) + 1e-12
    # one ceiling object through a decoder, replay and the decoder again: each reads its own source, never a stale one
    for ceiling in (HindsightOracle(), Oracle()):
        dec = SpeculativeDecoder(greedy, ceiling, GreedyMatch())
        first = dec.generate(PROMPTS[1], 24)
        replay(record(greedy, PROMPTS[2], 24, kmax=20, hidden=False), ceiling, greedy.config.max_context)
        again = dec.generate(PROMPTS[1], 24)
        assert again.tokens == first.tokens and again.stats.calls == first.stats.calls and again.stats.t_oracle > 0
    with pytest.raises(ValueError, match="greedy decoding only"):
        SpeculativeDecoder(tiny_pair.with_sampling(temperature=1.0), HindsightOracle(),
                           SpeculativeSampling()).generate(PROMPTS[0], 8)


def test_the_hindsight_oracle_plans_again_where_the_text_leaves_its_recording(tiny_pair, monkeypatch):
    """In bfloat16 a verify can round a near-tie the other way than the recording did, so the decoded text leaves
    the recording (here: its response is corrupted at token 5, or cut short): the oracle records and plans the rest
    from the round's prefix, off the books, and the output is still the target's greedy text."""
    from decode.engine import Autoregressive, SpeculativeDecoder
    from decode.evaluation import ceilings
    from decode.rules.chain import GreedyMatch

    greedy = tiny_pair.with_sampling(temperature=0.0)
    target = Autoregressive(greedy).generate(PROMPTS[0], 24).tokens
    for corrupt in ("flip", "short"):
        plans = []

        def wrong_first(pair, prompt, max_new, kmax, hidden, stop_at_eos=True, corrupt=corrupt, plans=plans):
            traj = record(pair, prompt, max_new if plans or corrupt == "flip" else 6, kmax, hidden=hidden)
            if not plans and corrupt == "flip":
                traj.response[5] = (traj.response[5] + 1) % 16  # the tiny vocabulary has more
            plans.append(len(prompt))
            return traj

        monkeypatch.setattr(ceilings, "record", wrong_first)
        out = SpeculativeDecoder(greedy, ceilings.HindsightOracle(), GreedyMatch()).generate(PROMPTS[0], 24)
        assert out.tokens == target, corrupt
        assert len(plans) >= 2 and plans[1] > plans[0], corrupt  # planned again, from a longer prefix


def test_the_hindsight_oracle_records_through_the_eos_where_the_generation_decodes_through_it(tiny_pair, monkeypatch):
    """A fixed-length generation (stop_at_eos=False) decodes past its EOS: the oracle's recording must go there too,
    or every round past it leaves the recording and plans again from a cut-short response."""
    import dataclasses

    from decode.engine import Autoregressive, SpeculativeDecoder
    from decode.evaluation import ceilings
    from decode.rules.chain import GreedyMatch

    greedy = tiny_pair.with_sampling(temperature=0.0)
    first = Autoregressive(greedy).generate(PROMPTS[0], 4).tokens[0]
    pair = dataclasses.replace(greedy, eos_ids=(first,))  # the EOS is the first token the target emits
    target = Autoregressive(pair).generate(PROMPTS[0], 24, stop_at_eos=False).tokens
    plans = []

    def counted(*args, **kw):
        plans.append(kw.get("stop_at_eos", True))
        return record(*args, **kw)

    monkeypatch.setattr(ceilings, "record", counted)
    oracle = ceilings.HindsightOracle()
    out = SpeculativeDecoder(pair, oracle, GreedyMatch()).generate(PROMPTS[0], 24, stop_at_eos=False)
    assert out.tokens == target and len(target) == 24
    assert plans == [False] and len(oracle.recording[1]) == 24  # one plan, over the whole fixed length


def test_the_replay_report_chooses_on_dev_and_prints_ceilings_and_what_heads_know(tiny_pair, tmp_path, capsys):
    """Under sampling: every family's value chosen on dev, each row against the best fixed K chosen on dev with
    an interval, the perfect head and the hindsight oracle as ceilings, and each head's R^2 against alpha."""
    import re

    from decode.evaluation.tuning import report
    from tests.test_decode import export_head

    pair = tiny_pair.with_sampling(temperature=1.0)
    head = export_head(tmp_path, pair, position="prev", depth=1, extras=("draft_top1", "cand_logq"))
    trajs = {s: [record(pair, p, 16, kmax=6, seed=i) for p in PROMPTS[:4]] for i, s in enumerate(("dev", "test"))}
    report("tiny", pair.config.sampling, trajs, COSTS[2], [head], 512)  # drafting is nearly free: ceilings apart
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in out.splitlines() if line.startswith("| ")}
    for family in ("fixed-K", "fixed-K in hindsight (test)", "draft-confidence", "cost-aware head", "perfect head",
                   "hindsight oracle", "draft confidence", "head"):
        assert family in rows, family
    assert float(rows["fixed-K"][4].split()[0]) == 1.0 and "K=" in rows["fixed-K"][1]
    assert re.fullmatch(r"[\d.]+ \[[\d.]+, [\d.]+\]", rows["cost-aware head"][4])
    assert rows["perfect head"][5] == "100%"
    policies = out.split("| predictor |")[0]
    speedups = [float(line.split(" | ")[3]) for line in policies.splitlines() if line.startswith("| ")
                and not line.startswith("| policy")]
    assert float(rows["hindsight oracle"][3]) == max(speedups)
    # R^2 and AUROC against alpha, on dev and on test (the last row of each predictor)
    assert rows["head"][1] == "test" and float(rows["head"][2]) < 1 and 0 < float(rows["head"][5]) < 1
    assert sum(line.startswith("| head | dev |") for line in out.splitlines()) == 1


def test_the_engine_hands_the_perfect_head_each_candidates_true_alpha(tiny_pair):
    """Under sampling the perfect head computes min(1, p/q) of every candidate through the engine's view of the
    target, off the books (a full target forward over its prefix), stops on it, and the wall time leaves that work
    out."""
    from decode.engine import SpeculativeDecoder
    from decode.labels import accept_prob
    from decode.rules.chain import SpeculativeSampling
    from decode.sampling import transform

    pair = tiny_pair.with_sampling(temperature=1.0)
    seen = []

    class Spy(PerfectHead):
        def alpha(self, step):
            seen.append((step.index, step.token, step.q, a := super().alpha(step)))
            return a

    dec = SpeculativeDecoder(pair, Spy(1.0, 5.0, 0.25), SpeculativeSampling(), seed=0)
    prompt = PROMPTS[0]
    out = dec.generate(prompt, 12)
    assert seen and out.stats.t_oracle > 0 and out.stats.wall > 0
    text = list(prompt) + out.tokens  # the first round's first candidate follows the prompt itself
    _, tok, q, alpha = seen[0]
    with torch.no_grad():
        p = transform(pair.logits(pair.target(torch.tensor([text[:len(prompt)]])).logits[0, -1:]), pair.config.sampling)[0]
    assert alpha == pytest.approx(float(accept_prob(p[tok], q[tok])), rel=1e-5)
    assert all(0.0 <= a <= 1.0 for *_, a in seen)
