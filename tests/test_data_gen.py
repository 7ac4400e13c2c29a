import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from data_gen.generate import (
    Mixing,
    Phases,
    RowNoise,
    exponential_,
    label_batch,
    left_pad,
    positions,
    prompt_generator,
    race_argmax,
    sample_responses,
)
from data_gen.store import done_ids, load_features, load_split
from decode.labels import accept_prob

ROOT = Path(__file__).resolve().parents[1]


def prompts(n):
    return [[1 + (i * 7 + j) % 20 for j in range(3 + i % 5)] for i in range(n)]


def test_records_are_consistent_and_kinds_behave(tiny_pair):
    kinds = ["prompt", "draft", "target", "mixed"] * 2
    ids = [f"p{i}" for i in range(8)]
    recs, feats = label_batch(tiny_pair, prompts(8), ids, kinds, Mixing(r=0.5), seed=0, max_new=10)
    for rec, f, kind in zip(recs, feats, kinds):
        n = len(rec["z"])
        assert f.shape == (n + 1, tiny_pair.draft.config.hidden_size)
        a = accept_prob(torch.tensor(rec["p_cand"]), torch.tensor(rec["q_cand"]))
        assert torch.allclose(a, torch.tensor(rec["alpha"]))
        if kind == "prompt":
            assert n == 1
        if kind == "target":
            assert all(rec["from_target"]) and rec["z"] == rec["y"]
        if kind == "draft":
            assert not any(rec["from_target"]) and rec["z"] == rec["candidate"]
        for zi, yi, ci, ft in zip(rec["z"], rec["y"], rec["candidate"], rec["from_target"]):
            assert zi == (yi if ft else ci)


def test_record_does_not_depend_on_batch_composition(tiny_pair):
    ps, ids = prompts(6), [f"p{i}" for i in range(6)]
    alone, _ = label_batch(tiny_pair, ps[3:4], ids[3:4], ["mixed"], Mixing(), seed=1, max_new=8)
    batched, _ = label_batch(tiny_pair, ps, ids, ["mixed"] * 6, Mixing(), seed=1, max_new=8)
    assert alone[0]["z"] == batched[3]["z"] and alone[0]["y"] == batched[3]["y"]
    assert torch.allclose(torch.tensor(alone[0]["alpha"]), torch.tensor(batched[3]["alpha"]), atol=1e-4)


def test_phases_time_every_stage_without_changing_the_records(tiny_pair):
    ps, ids = prompts(4), [f"p{i}" for i in range(4)]
    phases = Phases()
    timed, _ = label_batch(tiny_pair, ps, ids, ["mixed"] * 4, Mixing(), seed=2, max_new=6, phases=phases)
    plain, _ = label_batch(tiny_pair, ps, ids, ["mixed"] * 4, Mixing(), seed=2, max_new=6)
    assert timed == plain
    assert list(phases.seconds) == ["noise", "target sampling", "draft walk", "target pass over z", "statistics",
                                    "records"]
    assert all(t >= 0 for t in phases.seconds.values())


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_scores_in_stretches_from_the_sampling_cache_equal_a_fresh_pass(tiny_pair, chunk):
    """The target reads z a stretch at a time from the cache it sampled with: the labels are those of one fresh
    pass over prompt + z, whatever the stretch."""
    from data_gen.scores import PositionScores
    from decode.labels import position_stats
    from decode.sampling import transform

    ps, ids = prompts(5), [f"p{i}" for i in range(5)]
    x, mask = left_pad(ps, tiny_pair.tokenizer.eos_token_id)
    resp = sample_responses(tiny_pair, x, mask, RowNoise([prompt_generator(0, i) for i in ids], 9, tiny_pair.vocab), 9)
    g = torch.Generator().manual_seed(0)
    N = resp.tokens.shape[1]
    z = torch.randint(1, tiny_pair.vocab, (5, N), generator=g)
    q = torch.softmax(torch.randn(5, N, tiny_pair.vocab, generator=g), -1)
    scores = PositionScores(tiny_pair, resp, mask, chunk)
    for t in range(N):
        scores.add(q[:, t], None, z[:, t], z[:, t])
    full = torch.cat([mask, torch.ones_like(z)], 1)
    fresh = tiny_pair.target(torch.cat([x, z], 1), attention_mask=full, position_ids=positions(full)).logits
    p = transform(tiny_pair.logits(fresh[:, x.shape[1] - 1 : -1]), tiny_pair.config.sampling)
    want, got = position_stats(p, q, z), scores.result()
    assert set(got) == set(want) and got["alpha"].shape == (5, N)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-4), k


def test_noise_drawn_per_position_is_the_whole_stream_drawn_up_front():
    """Responses, then candidates, then the mixing coins, per row, whatever is drawn when (and rows whose
    responses end early skip the rest)."""
    n, V = 7, 50
    streams = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        streams.append([torch.rand(n, V, generator=g), torch.rand(n, V, generator=g), torch.rand(n, generator=g)])
    noise = RowNoise([torch.Generator().manual_seed(s) for s in (1, 2)], n, V)
    for t in range(3):
        assert torch.equal(noise.response(t), exponential_(torch.stack([s[0][t] for s in streams])))
    assert torch.equal(noise.mix, torch.stack([s[2] for s in streams]))
    for t in range(n):  # the responses ended after 3 positions: candidates still start after N of them
        assert torch.equal(noise.candidate(t), exponential_(torch.stack([s[1][t] for s in streams])))


def test_race_argmax_is_the_gumbel_max_draw_and_samples_p():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(4000, 50, generator=g), -1)
    probs[:, :10] = 0  # tokens a top-k/top-p transform removed
    probs = probs / probs.sum(-1, keepdim=True)
    e = -torch.rand(4000, 50, generator=g).log()
    gumbel = (probs.log() - e.log()).argmax(-1)
    assert torch.equal(race_argmax(probs, e), gumbel)
    one = probs[:1].expand(20000, 50)
    draws = race_argmax(one, -torch.rand(20000, 50, generator=g).log())
    freq = torch.bincount(draws, minlength=50) / 20000.0
    assert freq[:10].sum() == 0 and (freq - probs[0]).abs().max() < 0.015


def test_mean_alpha_estimates_expected_acceptance(tiny_pair):
    n = 64
    recs, _ = label_batch(tiny_pair, prompts(n), [f"s{i}" for i in range(n)], ["mixed"] * n, Mixing(), 0, 24)
    alpha = torch.tensor([a for r in recs for a in r["alpha"]])
    expect = torch.tensor([a for r in recs for a in r["expected_accept"]])
    # alpha is an unbiased sample of sum min(p, q); its standard error here is < 0.02
    assert abs(alpha.mean() - expect.mean()) < 4 * alpha.std() / len(alpha) ** 0.5


def write_config(tmp_path, pair_yaml, n_prompts, **data):
    rows = [{"id": i, "prompt": "abc(" * (1 + i % 4)} for i in range(n_prompts)]
    rows += [{"id": "empty", "prompt": "   "}, {"id": "long", "prompt": "a=1\n" * 200}]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = {"data": {"pair": str(pair_yaml), "output": str(tmp_path / "labels"), "batch_size": 2,
                    "max_new_tokens": 8, "prompts": [{"name": "jsonl", "split": "train",
                                                     "path": str(tmp_path / "prompts.jsonl")}]},
           "model": {"threads": 1}}
    cfg["data"].update(data)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_cli(cfg, *extra, wait=True):
    """`python -m data_gen --config cfg EXTRA` in its own process (for what needs one: a signal, DDP ranks)."""
    cmd = [sys.executable, "-m", "data_gen", "--config", str(cfg), *extra]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)


def label_here(cfg, *extra):
    """`python -m data_gen --config cfg EXTRA` in this process (a process spent seconds importing torch, transformers
    and Lightning): its exit code, stdout and stderr, as run_cli gives them. The torch threads and the SIGTERM/SIGINT
    handlers the run sets are put back."""
    from data_gen.__main__ import main

    threads, handlers = torch.get_num_threads(), {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("ignore")  # as PYTHONWARNINGS=ignore does for run_cli
            main(["--config", str(cfg), *extra])
    except SystemExit as e:
        code = e.code
    finally:
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess(["data_gen", "--config", str(cfg), *extra], code, out.getvalue(), err.getvalue())


@pytest.mark.slow
def test_cli_counts_bad_prompts_and_refuses_other_settings(tmp_path, tiny_pair_yaml):
    cfg = write_config(tmp_path, tiny_pair_yaml, 6)
    res = label_here(cfg)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 empty skipped, 1 truncated" in res.stdout
    assert len(load_split(tmp_path / "labels" / "t1", "jsonl_train")) == 7
    assert len(load_features(tmp_path / "labels" / "t1", "jsonl_train")) == 7
    res = label_here(cfg, "--model.seed", "5")
    assert res.returncode == 2 and "labels made under other settings" in res.stderr and "seed" in res.stderr


@pytest.mark.slow
def test_two_ddp_processes_label_every_prompt_once(tmp_path, tiny_pair_yaml):
    cfg = write_config(tmp_path, tiny_pair_yaml, 9)
    res = run_cli(cfg, "--trainer.devices", "2", "--trainer.strategy", "ddp")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ids = load_split(tmp_path / "labels" / "t1", "jsonl_train")["id"]
    assert len(ids) == len(set(ids)) == 10  # 9 + the truncated one; the empty one is skipped
    shards = list((tmp_path / "labels" / "t1" / "jsonl_train").iterdir())
    assert {s.name[:2] for s in shards} == {"r0", "r1"}  # both ranks wrote


def start_long_run(tmp_path, pair_yaml):
    """A 60-prompt run in its own process, returned once 3 prompts are labelled: (config, process, folder)."""
    cfg = write_config(tmp_path, pair_yaml, 60, batch_size=1, max_new_tokens=24)
    proc = run_cli(cfg, wait=False)
    out = tmp_path / "labels" / "t1"
    deadline = time.time() + 240
    while time.time() < deadline and len(done_ids(out)) < 3:
        time.sleep(0.2)
    return cfg, proc, out


@pytest.mark.slow
def test_killed_run_resumes_without_loss_or_duplicates(tmp_path, tiny_pair_yaml):
    cfg, proc, out = start_long_run(tmp_path, tiny_pair_yaml)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = len(done_ids(out))
    assert 3 <= first < 61, "the run must be killed part-way"
    res = label_here(cfg)  # the resume needs no process of its own
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"{first} already labelled" in res.stdout or first >= 3
    ids = load_split(out, "jsonl_train")["id"]
    assert len(ids) == len(set(ids)) == 61


def test_ranks_claiming_a_folder_at_once_all_succeed(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from data_gen.store import claim_output, metadata

    meta = {"pair": "tiny", "seed": 0}
    for trial in range(20):  # DDP ranks call claim_output together on a fresh folder
        out = tmp_path / f"run{trial}"
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda folder: claim_output(folder, meta), [out] * 4))
        assert metadata(out)["pair"] == "tiny"
        assert [p.name for p in out.iterdir()] == ["metadata.json"]  # no temporary file left behind


def test_second_writer_is_refused(tmp_path):
    import subprocess as sp

    from data_gen.store import OutputBusy, lock_output

    holder = sp.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                       "from data_gen.store import lock_output; f = lock_output(Path(sys.argv[1])); "
                       "print('locked', flush=True); time.sleep(60)", str(tmp_path)], cwd=ROOT, stdout=sp.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputBusy, match=f"pid {holder.pid}"):
            lock_output(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    lock_output(tmp_path)  # free again once the holder is gone


@pytest.mark.slow
def test_each_sampling_setting_gets_its_own_labels_and_greedy_labels_are_argmax_agreement(tmp_path, tiny_pair_yaml):
    from data_gen.store import metadata
    from decode.pair import load_pair

    cfg = write_config(tmp_path, tiny_pair_yaml, 6)
    res = label_here(cfg, "--settings", "[{temperature: 0}, {temperature: 0.7, top_p: 0.95}]")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    greedy, warm = tmp_path / "labels" / "greedy", tmp_path / "labels" / "t0.7-p0.95"
    assert metadata(greedy)["sampling"]["temperature"] == 0
    assert metadata(warm)["sampling"] == {"temperature": 0.7, "top_k": 0, "top_p": 0.95}
    pair = load_pair(tiny_pair_yaml)
    n_labels = 0
    for row in load_split(greedy, "jsonl_train"):
        alpha = torch.tensor(row["alpha"])
        assert set(alpha.tolist()) <= {0.0, 1.0}  # under greedy, p and q are one-hot
        with torch.no_grad():  # the target's argmax after the mixed prefix z_<i the head reads
            logits = pair.target(torch.tensor([row["prompt_ids"] + row["z"]])).logits[0]
        n = len(row["prompt_ids"])
        best = pair.logits(logits[n - 1 : n - 1 + len(row["z"])]).argmax(-1)
        assert torch.equal(alpha.bool(), torch.tensor(row["candidate"]) == best)
        # the draft's confidence is its raw softmax, as the decoder reads it, not the one-hot greedy q
        top1, conf = torch.tensor(row["draft_top1"]), torch.tensor(row["q_cand"])
        assert (top1 < 1).all() and torch.allclose(conf, top1) and (torch.tensor(row["draft_entropy"]) > 0).all()
        n_labels += len(alpha)
    assert n_labels > 20
    warm_alpha = torch.tensor([a for r in load_split(warm, "jsonl_train")["alpha"] for a in r])
    assert ((warm_alpha > 0) & (warm_alpha < 1)).any()  # soft labels away from greedy


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_the_resume_loses_and_repeats_nothing(tmp_path, tiny_pair_yaml):
    from data_gen.store import lock_output

    cfg, proc, out = start_long_run(tmp_path, tiny_pair_yaml)
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    text, _ = proc.communicate(timeout=60)
    assert time.time() - t0 < 30 and proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    kept = len(done_ids(out))
    assert 3 <= kept < 61, "the run must be stopped part-way"
    assert f"interrupted by SIGTERM: {kept} prompts are labelled" in text and "Resume with:" in text
    lock_output(out).close()  # the lock was released
    res = label_here(cfg)  # the resume needs no process of its own
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"{kept} already labelled" in res.stdout
    ids = load_split(out, "jsonl_train")["id"]
    assert len(ids) == len(set(ids)) == 61


def test_bench_runs_every_stage_on_every_chunk_in_rotated_order_and_pairs_ratios():
    from data_gen.bench import interleaved, paired_ratio, verdict

    calls = []
    stages = [lambda chunk, s=s: calls.append((s, tuple(chunk))) or len(chunk) for s in range(3)]
    chunks = [[1, 2], [3], [4, 5]]
    seconds, tokens = interleaved(stages, chunks, repeats=2)
    assert seconds.shape == (3, 2, 3) and (seconds > 0).all()
    assert tokens.tolist() == [5, 5, 5]  # tokens of one repeat, not of all
    assert len(calls) == 18 and all(calls.count((s, tuple(c))) == 2 for s in range(3) for c in chunks)
    firsts = [calls[i][0] for i in range(0, 18, 3)]
    assert sorted(set(firsts)) == [0, 1, 2]  # no stage always runs first
    den = np.array([[1.0, 2.0], [3.0, 4.0], [0.5, 1.5]])
    g, lo, hi = paired_ratio(1.2 * den, den)
    assert g == pytest.approx(1.2) and lo == pytest.approx(1.2) and hi == pytest.approx(1.2)
    g, lo, hi = paired_ratio(den * np.array([[1.1, 1.3], [1.2, 1.0], [1.25, 1.15]]), den)
    assert lo < g < hi and 1.0 <= lo and hi <= 1.3
    assert verdict(1.1, 1.2, 1.25, at_most=True) == "met"
    assert verdict(1.3, 1.4, 1.25, at_most=True) == "NOT met"
    assert verdict(1.2, 1.3, 1.25, at_most=True).startswith("not separated")
    assert verdict(3.1, 3.5, 3.0, at_most=False) == "met" and verdict(2.0, 2.9, 3.0, at_most=False) == "NOT met"


def test_bench_command_prints_its_table_on_the_tiny_pair(tiny_pair_yaml, capsys):
    from data_gen.bench import main

    main(["--pair", str(tiny_pair_yaml), "--prompts", "4", "--batch-size", "2", "--max-new-tokens", "4",
          "--repeats", "2", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| whole labelling stage | 2 |" in out and "goal <= 1.25x:" in out
    assert "target sampling" in out and "4 pycode dev prompts in 2 chunks of 2" in out
