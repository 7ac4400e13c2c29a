"""python -m train.gpucheck: a row per step, a failing or hanging step reported while the next one runs, the one-line
skip without a GPU, and its tiny CPU version of every step end to end (the bench resuming from its cache)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train import gpucheck


def rows(out: Path) -> list[list[str]]:
    """check.md's table as cells per step row."""
    lines = [ln for ln in (out / "check.md").read_text().splitlines() if ln.startswith("| ")][1:]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]] for ln in lines]


def test_without_a_gpu_it_says_in_one_line_what_it_skips_and_runs_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started a step without a GPU"))
    assert gpucheck.main(["--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "no GPU" in lines[0] and "--cpu" in lines[0]
    assert all(s in lines[0] for s in ("cuda-marked tests", "train.check", "batch bench"))
    assert not list(tmp_path.iterdir())


def test_a_step_that_fails_or_times_out_is_a_row_and_the_next_step_runs(tmp_path, monkeypatch):
    """Real steps: train.check on a pair that does not exist fails, the bench stopped at a 1 s limit times out, and
    the cuda tests after them still run and pass; the command exits 1."""
    monkeypatch.setattr(gpucheck, "CPU_LIMITS", {"tests": 120, "check": 120, "bench": 1})
    assert gpucheck.main(["--cpu", "--out", str(tmp_path), "--steps", "check", "bench", "tests",
                          "--pair", str(tmp_path / "missing.yaml")]) == 1
    got = {r[0]: r for r in rows(tmp_path)}
    assert list(got) == ["check", "bench", "tests"]
    assert got["check"][2] == "FAIL" and "exit 1; 0 of 1 steps passed; failed: load the pair" in got["check"][3]
    assert got["bench"][2] == "TIMEOUT" and got["bench"][3].startswith("stopped at its 1 s limit; 0 of 4 ")
    assert float(got["bench"][4]) < 10  # stopped, not waited for
    assert got["tests"][2] == "PASS" and "skipped" in got["tests"][3]


def test_a_step_stopped_at_its_limit_takes_its_children_with_it(tmp_path):
    """A timed-out step's process group ends: a child it started (as pytest and Lightning do) would hold the GPU."""
    pid_file = tmp_path / "child.pid"
    spawn = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
             f" open({str(pid_file)!r}, 'w').write(str(p.pid)); print('spawned', flush=True); time.sleep(60)")
    steps = [gpucheck.Step("hangs", [sys.executable, "-c", spawn], 3, lambda log: ""),
             gpucheck.Step("next", [sys.executable, "-c", "print('ran')"], 30, lambda log: log.strip())]
    got = gpucheck.run_all(steps, tmp_path / "logs", dict(gpucheck.os.environ))
    assert [(r.result, r.numbers) for r in got] == [("TIMEOUT", "stopped at its 3 s limit; spawned"), ("PASS", "ran")]
    status = Path(f"/proc/{pid_file.read_text()}/status")
    assert not status.exists() or "State:\tZ" in status.read_text()  # gone, or a zombie nobody reaped yet
    assert gpucheck.table(got).count("\n") == 3  # header, rule, a row per step


def test_the_numbers_of_a_gpu_run_are_read_from_what_the_steps_print(tmp_path):
    """Output formats the CPU never produces: failures among the cuda tests, a failed train.check step, and a bench
    cut short with part of its cache written."""
    log = ("FAILED tests/test_archs.py::test_pipeline[gemma2-float32-cuda] - AssertionError: x\n"
           "FAILED tests/test_archs.py::test_pipeline[gemma2-bfloat16-cuda] - AssertionError: x\n"
           "2 failed, 41 passed, 120 deselected in 91.02s\n")
    assert gpucheck.tests_numbers(log) == ("2 failed, 41 passed, 120 deselected in 91.02s; failed: "
                                           "tests/test_archs.py::test_pipeline[gemma2-float32-cuda], "
                                           "tests/test_archs.py::test_pipeline[gemma2-bfloat16-cuda]")
    log = "| load the pair | PASS | ok |\n| decode: fixed K = 4 | FAIL | differs at token 3 |\n\n5 of 6 steps passed\n"
    assert gpucheck.check_numbers(log) == "5 of 6 steps passed; failed: decode: fixed K = 4 (differs at token 3)"
    (tmp_path / "batch_cache").mkdir()
    for name in ("dev_greedy", "greedy_b1", "greedy_b8"):
        (tmp_path / "batch_cache" / f"{name}.json").write_text("[]")
    assert gpucheck.bench_numbers(tmp_path, gpucheck.BENCH, "batch-bench greedy B=64: batch 1/4") == \
        "2 of 6 (setting, batch size) cached: rerun to resume"


@pytest.mark.slow
def test_the_cpu_version_runs_every_step_and_the_bench_resumes(tmp_path, tiny_pair_yaml):
    assert gpucheck.main(["--cpu", "--out", str(tmp_path), "--pair", str(tiny_pair_yaml)]) == 0
    first = {r[0]: r for r in rows(tmp_path)}
    assert list(first) == ["tests", "check", "bench"] and all(r[2] == "PASS" for r in first.values())
    assert re.search(r"\d+ skipped.* in [\d.]+s", first["tests"][3]) and first["check"][3] == "6 of 6 steps passed"
    assert "greedy B = 1/2: target" in first["bench"][3] and "t1 B = 1/2: target" in first["bench"][3]
    assert "3 of 3 steps passed" in (tmp_path / "check.md").read_text()
    assert "cache" not in first["bench"][3]  # all measured by this run
    # Again, the bench alone: every (setting, batch size) comes from its cache, so nothing decodes, the numbers hold
    # and the row says where they came from
    assert gpucheck.main(["--cpu", "--out", str(tmp_path), "--steps", "bench"]) == 0
    again = rows(tmp_path)[0][3]
    assert again.startswith(first["bench"][3].split(" (tables")[0] + "; 4 (setting, batch size) read from an earlier "
                            "run's cache (delete ")
    assert not re.search(r"batch-bench .*: batch \d+/", (tmp_path / "check" / "logs" / "bench.log").read_text())
