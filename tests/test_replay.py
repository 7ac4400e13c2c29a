"""Replay of greedy decoding on recorded trajectories writes the engine's own call log, round for round."""

import pytest

from decode.engine import SpeculativeDecoder
from decode.evaluation.ceilings import Oracle
from decode.evaluation.replay import CostLine, record, replay, speedup, target_alone_calls
from decode.policies import AdaEDL, CostAwareStop, DraftConfidence, FixedK, HeadPolicy, SpecDecPP
from decode.rules.chain import SpeculativeSampling
from tests.test_decode import PROMPTS, export_head


@pytest.fixture(scope="module")
def greedy(tiny_pair):
    return tiny_pair.with_sampling(temperature=0.0)


def policies(heads):
    yield FixedK(3)
    yield FixedK(7)
    yield DraftConfidence(0.3)
    yield AdaEDL(0.5)
    yield Oracle()
    for head in heads:
        yield SpecDecPP(head, h=0.5)
        yield CostAwareStop(head, draft_ms=1.0, target_ms=5.0, per_token_ms=0.2)


def test_replay_writes_the_engines_call_log_for_every_policy(greedy, tmp_path):
    heads = [export_head(tmp_path, greedy, depth=3, position=pos, name=pos) for pos in ("own", "prev")]
    checked = 0
    for prompt in PROMPTS[:8]:
        traj = record(greedy, prompt, 24)
        assert traj.response == SpeculativeDecoder(greedy, FixedK(1), SpeculativeSampling()).generate(prompt, 24).tokens
        for live, replayed in zip(policies(heads), policies(heads)):
            out = SpeculativeDecoder(greedy, live, SpeculativeSampling()).generate(prompt, 24)
            calls, n = replay(traj, replayed, greedy.config.max_context)
            assert calls == out.stats.calls and n == len(out.tokens), (type(live).__name__, prompt)
            decisions = sum(1 for m, _ in calls if m == "head")  # one per candidate a head decided on
            assert (decisions > 0) == isinstance(live, HeadPolicy), type(live).__name__
            checked += 1
    assert checked == 8 * 9


def test_cost_line_prices_calls_and_the_oracle_accepts_most_per_target_call(greedy):
    cost = CostLine.parse("1.0,5.0,0.25")
    assert cost.predict_s([("draft", 1), ("target", 3), ("draft", 1)]) == pytest.approx(1e-3 * (1 + 5.5 + 1))
    assert cost.call_ms("draft", 5) == pytest.approx(1.0 * 6.0 / 5.0)  # a prefill grows as the target's
    with pytest.raises(ValueError, match="draft_ms,target_ms,per_token_ms"):
        CostLine.parse("1,2")
    trajs = [record(greedy, p, 24) for p in PROMPTS[:6]]
    assert all(target_alone_calls(t)[0] == ("target", len(t.prompt)) for t in trajs)
    _, oracle = speedup(trajs, Oracle(), cost, greedy.config.max_context)
    assert all(oracle >= speedup(trajs, FixedK(k), cost, greedy.config.max_context)[1] for k in (1, 2, 4))


def test_cost_aware_stop_drafts_while_one_more_candidate_pays_for_itself(greedy, tmp_path):
    """A head that says 0.8 for every candidate: with a 1.2 ms draft step, a 4.99 ms target call and 0.21 ms per
    extra verified token, candidate k + 1 adds 0.8^(k+1) tokens for 1.41 ms, worth it while that beats the
    round's rate: k = 1 (0.45 > 0.28 tokens/ms), k = 2 (0.36 > 0.31), not k = 3 (0.29 < 0.32)."""
    import json
    import math
    from pathlib import Path

    head = export_head(tmp_path, greedy, bias=math.log(0.8 / 0.2), position="prev", name="sure")
    policy = CostAwareStop(head, draft_ms=1.2, target_ms=4.99, per_token_ms=0.21)
    policy.reset()
    steps = [replay_step(i) for i in range(6)]
    assert [policy.stop(s) for s in steps[:3]] == [False, False, True]
    cfg = json.loads((Path(head) / "config.json").read_text())
    cfg["calibration"] = {"a": 1.0, "b": -math.log(4.0)}  # calibrated: 0.8 -> 0.5
    (Path(head) / "config.json").write_text(json.dumps(cfg))
    assert abs(CostAwareStop(head, 1.2, 4.99, 0.21).prob(steps[0]) - 0.5) < 1e-6
    with pytest.raises(ValueError, match="step costs"):
        CostAwareStop(head, -1.0, 4.99, 0.21)


def test_an_own_state_head_prices_its_extra_draft_pass_into_the_round(greedy, tmp_path):
    """The same 0.8 head reading the "own" state: every round also runs the draft over its last candidate
    (1.2 ms more), so the rate to beat is lower and the stop comes one candidate later: at k = 3 the next
    candidate's 0.29 tokens/ms beats the round's 2.95 tokens / 10.42 ms = 0.283."""
    import math

    head = export_head(tmp_path, greedy, bias=math.log(0.8 / 0.2), position="own", name="sure-own")
    policy = CostAwareStop(head, draft_ms=1.2, target_ms=4.99, per_token_ms=0.21)
    policy.reset()
    steps = [replay_step(i) for i in range(6)]
    assert [policy.stop(s) for s in steps[:4]] == [False, False, False, True]


def test_a_measured_verify_table_draws_the_stop_to_a_size_that_runs_faster(greedy, tmp_path):
    """The same 0.8 head and costs as a table: as a line it stops at k = 3 (above). When verifying 5 tokens costs
    less than 4 (CPU kernels do that), the fourth candidate costs only its draft step minus the saving, and the
    rule, which looks past the next candidate, drafts it; verifying 6 costs the line again, so it stops there."""
    import math

    head = export_head(tmp_path, greedy, bias=math.log(0.8 / 0.2), position="prev", name="sure-table")
    line = [4.99 + 0.21 * n for n in range(21)]  # verifying n + 1 tokens
    steps = [replay_step(i) for i in range(6)]
    for table, want in [(line, [False, False, True]), (line[:4] + [line[1]] + line[5:], [False, False, False, True])]:
        policy = CostAwareStop(head)
        policy.set_costs(1.2, table)
        policy.reset()
        assert [policy.stop(s) for s in steps[: len(want)]] == want
    short = CostAwareStop(head, max_len=8)
    short.set_costs(1.2, line[:3])  # a table shorter than max_len + 1 goes on along its last step
    assert short.costs[1] == pytest.approx(line[:9])


def test_the_cost_aware_stop_prices_its_own_head_decisions(greedy, tmp_path):
    """Each candidate costs a draft step and a head decision: at 0.6 ms a decision the third candidate's 0.512 tokens
    for 2.01 ms no longer beat the round's 2.44 tokens / 9.01 ms, so the 0.8 head stops at k = 2, not 3; a call log
    prices a ("head", 1) entry at that cost, and a decision between two draft steps leaves the draft warm."""
    import math

    from decode.costs.model import CostModel

    head = export_head(tmp_path, greedy, bias=math.log(0.8 / 0.2), position="prev", name="sure-priced")
    policy = CostAwareStop(head)
    policy.set_costs(1.2, [4.99 + 0.21 * n for n in range(21)], head_ms=0.6)
    policy.reset()
    assert [policy.stop(replay_step(i)) for i in range(2)] == [False, True]
    line = CostLine.parse("1.0,5.0,0.25,0.05")
    assert line.predict_s([("draft", 1), ("head", 1), ("target", 3)]) == pytest.approx(1e-3 * (1 + 0.05 + 5.5))
    model = CostModel(step={"draft": [1.0], "target": [6.0]}, switched={"draft": [3.0], "target": [8.0]}, head=0.04)
    # the second draft step is priced warm (1.0), not switched (3.0): the decision between them runs no model
    assert model.predict_s([("target", 1), ("draft", 1), ("head", 1), ("draft", 1)]) == pytest.approx(1e-3 * 10.04)


def test_engine_and_replay_report_every_rounds_acceptance_to_the_policy(greedy):
    """What a head reading accepted_run learns of verification: the same (accepted, drafted) per round, after a
    start() per generation, from the engine and from replay."""

    class Spy(FixedK):
        def start(self):
            self.seen.append("start")

        def verified(self, accepted, drafted):
            self.seen.append((accepted, drafted))

    for prompt in PROMPTS[:6]:
        live, replayed = Spy(4), Spy(4)
        live.seen, replayed.seen = [], []
        out = SpeculativeDecoder(greedy, live, SpeculativeSampling()).generate(prompt, 24)
        replay(record(greedy, prompt, 24), replayed, greedy.config.max_context)
        assert live.seen == replayed.seen and live.seen[0] == "start" and len(live.seen) == out.stats.rounds + 1
        assert [a for a, _ in live.seen[1:]] == out.stats.accepted


def test_a_head_reads_the_accepted_run_before_each_candidate(greedy, tmp_path):
    """A rejection ends the run; a round accepted whole extends it by its candidates and the bonus token; within a
    round candidate i reads the run as if candidates 0..i-1 were accepted, capped and read as log1p."""
    import math

    import torch

    from heads.features import RUN_CAP

    head = export_head(tmp_path, greedy, position="prev", name="runs", extras=["accepted_run"])
    policy = SpecDecPP(head, h=0.5)
    seen = []
    policy.fast_prob = lambda x, extras: seen.append(float(extras[-1])) or 0.9
    policy.start()
    policy.verified(3, 3)  # all accepted: 3 candidates and the bonus token
    assert policy.run == 4
    policy.reset()
    policy.stop(replay_step(0)), policy.stop(replay_step(2))
    assert seen == pytest.approx([math.log1p(4), math.log1p(6)])
    policy.verified(1, 3)
    assert policy.run == 0
    policy.run = 40
    policy.stop(replay_step(0))
    assert seen[-1] == pytest.approx(math.log1p(RUN_CAP))
    policy.start()
    assert policy.run == 0
    with pytest.raises(ValueError, match="accepted_run"):
        policy.features.build(torch.zeros(32), *torch.zeros(3))


def replay_step(i: int):
    import torch

    from decode.evaluation.replay import FreeRun, RecordedStep

    run = FreeRun([1] * 8, [0.9] * 8, [0.1] * 8, [0.9] * 8, torch.zeros(9, 32))
    return RecordedStep(run, i)


def test_sampled_replay_estimates_the_engines_acceptance(tiny_pair):
    """Under sampling, replay draws candidates from q and accepts each with min(1, p/q) as the engine does, but
    continues along a response of the target's law rather than the text the round produced: an estimate. Over
    prompts and seeds its accepted candidates per round meet the engine's within sampling noise."""
    import statistics

    pair = tiny_pair.with_sampling(temperature=1.0)
    for k in (2, 5):
        engine, replayed = [], []
        for seed in range(6):
            for prompt in PROMPTS[:6]:
                out = SpeculativeDecoder(pair, FixedK(k), SpeculativeSampling(), seed=seed).generate(prompt, 24)
                engine += out.stats.accepted
                spy = FixedK(k)
                spy.verified = lambda a, d, log=replayed: log.append(a)
                traj = record(pair, prompt, 24, kmax=k, hidden=False, seed=seed)
                assert all(0 <= a <= 1 for r in traj.runs for a in r.accept)
                replay(traj, spy, pair.config.max_context)
        e, r = statistics.fmean(engine), statistics.fmean(replayed)
        se = (statistics.pvariance(engine) / len(engine) + statistics.pvariance(replayed) / len(replayed)) ** 0.5
        assert abs(e - r) < 4 * se + 0.05, (k, e, r, se)
        assert 0.1 < e < k - 0.2  # acceptance neither nil nor certain: the comparison means something


def test_replay_command_refuses_a_head_for_another_draft_before_recording(tiny_pair, tmp_path, capsys):
    """`python -m decode replay` runs no decoder, so nothing bound its heads: a head of another draft reached the
    compiled kernels with a state of another width."""
    from decode.evaluation.tuning import main

    head = export_head(tmp_path, tiny_pair)  # the tiny test pair's, not the pycode pair's that the config names
    with pytest.raises(SystemExit) as e:
        main(["--config", "configs/replay/pycode.yaml", "--setting", "greedy", "--heads", head])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--heads {head}: head {head} was trained on draft" in err and "Retrain it for this draft" in err
