"""One GPU command: the cuda-marked tests, train.check and a short batch bench, each time-boxed, in one table.

    python -m train.gpucheck [--out docs/bench/gpu] [--steps tests check bench] [--pair configs/pairs/pycode.yaml]
    python -m train.gpucheck --cpu          (a tiny version of every step on the CPU: about a minute)

On one GPU (H100/H200) it runs three steps, each in its own process group under a time limit (200 + 60 + 190 s,
so the whole command ends within 8 minutes):
1. tests: `python -m pytest -q -m cuda`, the architecture matrix and the batch decoder on the GPU;
2. check: `python -m train.check` on the embedded pycode pair (its defaults: 8 prompts, 24 new tokens);
3. bench: the batch bench of configs/bench/batch_gpucheck.yaml (batch 1, 8 and 64, greedy and T = 1). The bench saves
   each (setting, batch size) as it finishes, under <out>/check/bench/batch_cache, so a rerun after a timeout
   resumes there (`--steps bench` reruns that step alone; the row says how many sizes came from the cache, which
   is deleted to measure afresh).
A step that fails or runs out of time is a row of the table, and the next step runs. The table is printed and written
to <out>/check.md; each step's whole output is in <out>/check/logs/<step>.log. Without a GPU the command says in one
line what it skips and exits 0. --cpu hides any GPU from the steps and shrinks each (the cuda tests of
tests/test_batch.py, which skip; train.check on 2 prompts of 4 tokens; the bench at batch 1 and 2, one batch each,
4 tokens), writing to runs/gpucheck-cpu unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from importlib.metadata import version
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "configs" / "bench" / "batch_gpucheck.yaml"
STEPS = ("tests", "check", "bench")
# Seconds per step on one GPU: the cuda tests took 91 s on an H200 (docs/batch.md), train.check well under a minute,
# and the bench is sized for about 2 minutes; the three sum to 450 s, which leaves the 8 minutes' rest for stopping
# a step that overruns (up to 5 s each) and for this process.
LIMITS = {"tests": 200, "check": 60, "bench": 190}  # the cuda tests took 179 s on an H200 (45 of them), check 21
CPU_LIMITS = {"tests": 120, "check": 120, "bench": 120}  # a shared 2-core box, loaded by the test that runs them
# The bench's tiny version: its config with every size and length cut down, so the same code path runs in seconds.
CPU_BENCH = {"batch_sizes": [1, 2], "repeats": {1: 1, 2: 1}, "fixed_k": [1], "max_new_tokens": 4, "prompt_tokens": 16,
             "threads": 1}
NO_GPU = ("gpucheck: no GPU here (torch.cuda.is_available() is False), so it skips all three steps (the cuda-marked "
          "tests, train.check, the batch bench); `python -m train.gpucheck --cpu` runs a tiny version of each on the CPU")


@dataclass
class Step:
    """One time-boxed command; numbers(log) reads its key numbers from what it printed."""

    name: str
    argv: list[str]
    limit_s: float
    numbers: Callable[[str], str]


@dataclass
class Row:
    step: str
    command: str
    result: str  # PASS, FAIL or TIMEOUT
    numbers: str
    seconds: float


def shown(argv: list[str]) -> str:
    """The command as a user would type it from the repository root."""
    return shlex.join("python" if a == sys.executable else a.replace(f"{ROOT}/", "") for a in argv)


def stop(proc: subprocess.Popen) -> None:
    """End the step's whole process group: pytest and Lightning may leave children that would hold the GPU."""
    for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 2)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def last_line(log: str) -> str:
    """The last line a step printed: where it failed, when it says nothing else."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "(no output)"


def run_step(step: Step, logs: Path, env: dict[str, str]) -> Row:
    """Run one step to its end or its limit; its output goes to logs/<name>.log, unbuffered, so a step stopped
    at its limit leaves what it had printed by then."""
    log = logs / f"{step.name}.log"
    print(f"gpucheck: {step.name}: {shown(step.argv)} (up to {step.limit_s:.0f} s; output in {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(step.argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=step.limit_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            rc = None
        except BaseException:  # Ctrl-C or SIGTERM: the step sits in a session of its own, out of the terminal's reach
            stop(proc)
            raise
    seconds, text = time.perf_counter() - t0, log.read_text(errors="replace")
    try:
        numbers = step.numbers(text)
    except Exception as e:  # a log cut short has no numbers; the row still reports the step
        numbers = f"no numbers ({type(e).__name__}: {e})"
    result = "TIMEOUT" if rc is None else "FAIL" if rc else "PASS"
    if rc is None:
        numbers = f"stopped at its {step.limit_s:.0f} s limit; " + (numbers or last_line(text))
    elif rc:
        numbers = f"exit {rc}; " + (numbers or last_line(text))
    return Row(step.name, shown(step.argv), result, numbers, seconds)


def run_all(steps: list[Step], logs: Path, env: dict[str, str]) -> list[Row]:
    """Every step in turn, whatever the ones before it did: they need nothing from one another."""
    logs.mkdir(parents=True, exist_ok=True)
    return [run_step(step, logs, env) for step in steps]


def tests_numbers(log: str) -> str:
    """pytest's closing counts ('2 failed, 41 passed in 91.02s') and the first failures' ids."""
    counts = [ln.strip(" =") for ln in log.splitlines()
              if re.search(r"\b(passed|failed|skipped|deselected|errors?|no tests ran)\b.* in [\d.]+s", ln)]
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M)
    parts = counts[-1:] + ([f"failed: {', '.join(failed[:3])}" + (f" and {len(failed) - 3} more" if failed[3:] else "")]
                           if failed else [])
    return "; ".join(parts)


def check_numbers(log: str) -> str:
    """train.check's 'n of m steps passed' and what each failed step said."""
    got = re.search(r"\d+ of \d+ steps passed", log)
    failed = [f"{name.strip()} ({detail.strip()[:100]})" for name, detail in
              re.findall(r"^\| ([^|\n]+) \| FAIL \| ([^\n]*)\|$", log, re.M)]
    return "; ".join(([got.group(0)] if got else []) + ([f"failed: {', '.join(failed)}"] if failed else []))


def bench_numbers(folder: Path, config: Path, log: str) -> str:
    """Per setting: the target alone's tok/s, the batch controller's and the best fixed K's speedup at each size,
    from the batch.csv that this run wrote; a run cut short says how much of the bench its cache holds."""
    if "batch bench took" not in log:  # the bench prints it after writing batch.csv: an older csv is not this run's
        cfg = yaml.safe_load(config.read_text())
        done = len(list((folder / "batch_cache").glob("*_b*.json")))
        return f"{done} of {len(cfg['settings']) * len(cfg['batch_sizes'])} (setting, batch size) cached: rerun to resume"
    with open(folder / "batch.csv") as f:
        rows = list(csv.DictReader(f))
    parts = [setting_numbers([r for r in rows if r["setting"] == s]) for s in dict.fromkeys(r["setting"] for r in rows)]
    # a cached size is an earlier run's reading, maybe of other code: say so, and how to measure afresh
    measured = set(re.findall(r"^batch-bench (\S+) B=(\d+): batch", log, re.M))
    cached = len({(r["setting"], r["batch_size"]) for r in rows} - measured)
    return "; ".join(parts + ([f"{cached} (setting, batch size) read from an earlier run's cache (delete "
                               f"{shown([str(folder / 'batch_cache')])} to measure afresh)"] if cached else [])) \
        + f" (tables: {shown([str(folder / 'batch.md')])})"


def setting_numbers(sub: list[dict]) -> str:
    """'greedy B = 1/8/64: target 150/772/3256 tok/s, controller 0.98/1.02/1.20x, best fixed K 0.95x (K=3)/...,
    head tree 1.05x (B = 1)' (the head tree where the bench decoded one)."""
    sizes = sorted({int(r["batch_size"]) for r in sub})
    at = {(r["method"], int(r["batch_size"])): r for r in sub}
    best = [max((r for r in sub if int(r["batch_size"]) == b and r["method"].startswith("SD K=")),
                key=lambda r: float(r["speedup"])) for b in sizes]
    return (f"{sub[0]['setting']} B = {'/'.join(map(str, sizes))}: target "
            + "/".join(f"{float(at[('target', b)]['tokens_per_s']):.0f}" for b in sizes) + " tok/s, controller "
            + "/".join(f"{float(at[('batch controller', b)]['speedup']):.2f}" for b in sizes) + "x, best fixed K "
            + "/".join(f"{float(r['speedup']):.2f}x ({r['method'].removeprefix('SD ')})" for r in best)
            + "".join(f", head tree {float(at[('tree head', b)]['speedup']):.2f}x (B = {b})" for b in sizes
                      if ("tree head", b) in at))


def bench_config(cpu: bool, folder: Path) -> Path:
    """The shipped config, or under --cpu its tiny version written beside the bench's outputs."""
    if not cpu:
        return BENCH
    cfg = yaml.safe_load(BENCH.read_text()) | CPU_BENCH | {"output": str(folder)}
    path = folder / "batch_cpu.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def steps(args: argparse.Namespace, out: Path) -> list[Step]:
    """The three steps at full size on a GPU, or tiny under --cpu."""
    py, limits = sys.executable, CPU_LIMITS if args.cpu else LIMITS
    # A folder of its own under --cpu: each run prunes the batch cache to its own config's pieces
    folder = out / "check" / ("bench-cpu" if args.cpu else "bench")
    folder.mkdir(parents=True, exist_ok=True)
    config = bench_config(args.cpu, folder)
    tests = [py, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"] + (["tests/test_batch.py"] if args.cpu else [])
    check = [py, "-m", "train.check", "--pair", args.pair] + (["--prompts", "2", "--max_new_tokens", "4"] if args.cpu else [])
    bench = [py, "-m", "decode", "batch-bench", "--config", str(config), "--output", str(folder)]
    every = {"tests": Step("tests", tests, limits["tests"], tests_numbers),
             "check": Step("check", check, limits["check"], check_numbers),
             "bench": Step("bench", bench, limits["bench"], lambda log: bench_numbers(folder, config, log))}
    return [every[name] for name in args.steps]


def table(rows: list[Row]) -> str:
    """The summary as a markdown table; a '|' inside a cell is escaped so the row keeps its columns."""
    def cell(x: str) -> str:
        return x.replace("|", "\\|")

    lines = ["| step | ran | result | key numbers | seconds |", "|---|---|---|---|---|"]
    lines += [f"| {r.step} | `{cell(r.command)}` | {r.result} | {cell(r.numbers)} | {r.seconds:.0f} |" for r in rows]
    return "\n".join(lines)


def machine(cpu: bool) -> str:
    """Where the steps ran and on what, for the page's first line."""
    device = "the CPU (--cpu: tiny steps)" if cpu else f"one {torch.cuda.get_device_name(0)}"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or "an unknown commit"
    except (OSError, subprocess.SubprocessError):  # a copy of the tree without git
        commit = "an unknown commit"
    return f"{device}, torch {torch.__version__}, transformers {version('transformers')}, at {commit}"


def report(rows: list[Row], out: Path, where: str, seconds: float) -> str:
    """Print the table and write it to out/check.md with what produced it."""
    passed = sum(r.result == "PASS" for r in rows)
    text = (f"Generated by `python -m train.gpucheck` on {date.today()} on {where}: {passed} of {len(rows)} steps passed "
            f"in {seconds:.0f} s. Each step's output: `check/logs/<step>.log` beside this page.\n\n{table(rows)}\n")
    (out / "check.md").write_text(f"# GPU check\n\n{text}")
    print(f"\n{text}", flush=True)
    return text


def child_env(cpu: bool) -> dict[str, str]:
    """The steps' environment: offline (the embedded pair is on disk, and GPU hosts may have no network), unbuffered
    output for the logs, and under --cpu no visible GPU, so the tiny version is the CPU's even on a GPU host."""
    env = os.environ | {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "PYTHONUNBUFFERED": "1"}
    return env | ({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m train.gpucheck", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder of check.md and check/ (default: docs/bench/gpu; "
                                                "runs/gpucheck-cpu under --cpu)")
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="which steps, in this order")
    ap.add_argument("--pair", default="configs/pairs/pycode.yaml", help="the pair train.check runs on (the bench's "
                                                                        "heads are the embedded pair's)")
    ap.add_argument("--cpu", action="store_true", help="a tiny version of every step on the CPU")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """-> 0 when every step passed (or, without a GPU, when it skipped them), else 1."""
    args = parse(argv)
    if not args.cpu and not torch.cuda.is_available():
        print(NO_GPU, flush=True)
        return 0
    out = Path(args.out or ROOT / ("runs/gpucheck-cpu" if args.cpu else "docs/bench/gpu")).resolve()
    args.pair = str(Path(args.pair).resolve()) if Path(args.pair).exists() else args.pair  # the steps run in ROOT
    t0 = time.perf_counter()
    rows = run_all(steps(args, out), out / "check" / "logs", child_env(args.cpu))
    report(rows, out, machine(args.cpu), time.perf_counter() - t0)
    return 0 if all(r.result == "PASS" for r in rows) else 1


if __name__ == "__main__":
    # a SIGTERM (a scheduler's time limit) unwinds as Ctrl-C does, so the running step's process group ends with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise SystemExit(main())
