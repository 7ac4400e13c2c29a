"""Do two bench runs agree? python -m decode compare docs/bench/bench.csv runs/bench2/bench.csv [--plots DIR]

Rows are matched by (prompt split, method); for each pair of rows the 95% speedup intervals must overlap.
A threshold chosen on dev can differ between runs: such rows are listed as present in one run only.
`--split test` keeps the test rows only (for a second run that reused the first run's dev sweep from
its section cache, whose dev rows are the same numbers and would agree trivially). `--plots DIR` draws
both runs' intervals side by side, one PNG per prompt split.

Speedups depend on the machine (on the ratio of the target's step to the draft's), so the comparison also prints
each split's ms per token of the target alone and of the draft alone in both runs, and warns where they differ by
more than 20%: such runs ran on different machines or under different load, and need not agree.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

from decode.evaluation.goals import interval_order
from decode.evaluation.report import pyplot, slug


def read_rows(path: Path, split: str | None = None) -> dict[tuple[str, str], dict]:
    """bench.csv -> {(prompts, method): row} for rows with a speedup interval, of one split or all."""
    if not path.is_file():
        raise SystemExit(f"{path}: no such file; a bench run writes <output>/bench.csv")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and "speedup_lo" not in rows[0]:
        raise SystemExit(f"{path} has no speedup_lo column: it was written by an older bench, run it again")
    return {(r["prompts"], r["method"]): r for r in rows if r.get("speedup_lo") not in (None, "")
            and (split is None or f"/{split} " in r["prompts"])}


def compare_runs(a: dict[tuple[str, str], dict], b: dict[tuple[str, str], dict]) -> tuple[list[str], int, int]:
    """Markdown lines of the comparison, the number of shared rows, and how many of them overlap."""
    def fmt(r):
        return f"{float(r['speedup']):.3f} [{float(r['speedup_lo']):.3f}, {float(r['speedup_hi']):.3f}]"

    lines = ["| prompts | method | run A | run B | intervals overlap |", "|---|---|---|---|---|"]
    shared = [k for k in a if k in b]
    agree = 0
    for key in shared:
        ok = interval_order(a[key], b[key]) == 0
        agree += ok
        lines.append(f"| {key[0]} | {key[1]} | {fmt(a[key])} | {fmt(b[key])} | {'yes' if ok else '**no**'} |")
    for key in [k for k in a if k not in b] + [k for k in b if k not in a]:
        lines.append(f"| {key[0]} | {key[1]} | {fmt(a[key]) if key in a else '-'} | {fmt(b[key]) if key in b else '-'} "
                     f"| one run only (chosen on dev) |")
    return lines, len(shared), agree


def step_ms(rows: dict[tuple[str, str], dict], split: str) -> tuple[float, float] | None:
    """ms per token of the target alone and of the draft alone in one split (None: rows without timers)."""
    def of(kind, model):
        r = next((r for (p, _), r in rows.items() if p == split and r.get("kind") == kind), None)
        return 1e3 * float(r[f"t_{model}_s"]) / float(r[f"{model}_calls"]) if r and r.get(f"t_{model}_s") else None

    t, d = of("target", "target"), of("draft", "draft")
    return (t, d) if t and d else None


def machine_lines(a: dict, b: dict, tolerance: float = 0.2) -> tuple[list[str], list[str]]:
    """Markdown lines of both runs' ms per token by split, and the splits whose steps differ beyond tolerance."""
    lines, apart = ["| prompts | target ms/token A | B | draft ms/token A | B |", "|---|---|---|---|---|"], []
    for split in dict.fromkeys(k[0] for k in a if k in b):
        sa, sb = step_ms(a, split), step_ms(b, split)
        if sa and sb:
            lines.append(f"| {split} | {sa[0]:.2f} | {sb[0]:.2f} | {sa[1]:.2f} | {sb[1]:.2f} |")
            if any(abs(y / x - 1) > tolerance for x, y in zip(sa, sb)):
                apart.append(split)
    return (lines if len(lines) > 2 else []), apart


def compare_plots(a: dict[tuple[str, str], dict], b: dict[tuple[str, str], dict], out_dir: Path) -> list[Path]:
    """One PNG per prompt split: each shared row's speedup and 95% interval in run A and run B, red where apart."""
    plt, paths = pyplot(), []
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in dict.fromkeys(k[0] for k in a if k in b):
        keys = [k for k in a if k in b and k[0] == split]
        fig, ax = plt.subplots(figsize=(7, 1.4 + 0.3 * len(keys)))
        for offset, run, name in ((-0.17, a, "run A"), (0.17, b, "run B")):
            s, lo, hi = (np.array([float(run[k][c]) for k in keys]) for c in ("speedup", "speedup_lo", "speedup_hi"))
            ax.errorbar(s, np.arange(len(keys)) + offset, xerr=[s - lo, hi - s], fmt="o", ms=3, capsize=2, label=name)
        ax.set_yticks(range(len(keys)), [k[1] for k in keys], fontsize=8)
        for tick, k in zip(ax.get_yticklabels(), keys):
            tick.set_color("black" if interval_order(a[k], b[k]) == 0 else "red")
        ax.axvline(1.0, color="grey", linestyle=":")
        ax.invert_yaxis()
        ax.set(xlabel="speedup over the target alone (95% interval)", title=f"{split}: two runs")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / f"compare_{slug(split)}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m decode compare", description=__doc__.splitlines()[0])
    ap.add_argument("run_a", type=Path, help="bench.csv of the first run")
    ap.add_argument("run_b", type=Path, help="bench.csv of the second run")
    ap.add_argument("--split", choices=["dev", "test"], help="compare only the rows of this prompt split")
    ap.add_argument("--plots", type=Path, help="folder for one PNG per prompt split with both runs' intervals")
    args = ap.parse_args(argv)
    a, b = read_rows(args.run_a, args.split), read_rows(args.run_b, args.split)
    lines, shared, agree = compare_runs(a, b)
    print("\n".join(lines))
    print(f"\n{agree} of {shared} shared rows have overlapping 95% intervals "
          f"(goal: all) — {'met' if agree == shared and shared else 'NOT met'}")
    steps, apart = machine_lines(a, b)
    if steps:
        print("\nmodel steps (the target alone's and the draft alone's timers):\n\n" + "\n".join(steps))
    if apart:
        print(f"\nwarning: in {len(apart)} of {len(steps) - 2} splits a model's step differs by more than 20% between "
              f"the runs ({', '.join(apart)}): they ran on different machines or under different load, so their "
              f"speedups need not agree; compare runs made back to back on one machine")
    if args.plots:
        print(f"plots: {', '.join(str(p) for p in compare_plots(a, b, args.plots))}")


if __name__ == "__main__":
    main()
