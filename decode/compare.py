"""Do two bench runs agree? python -m decode compare docs/bench/bench.csv runs/bench2/bench.csv

Rows are matched by (prompt split, method); for each pair of rows the 95% speedup intervals must overlap.
A threshold chosen on dev can differ between runs: such rows are listed as present in one run only.
`--split test` keeps the test rows only (for a second run that reused the first run's dev sweep from
its section cache, whose dev rows are the same numbers and would agree trivially).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from decode.goals import interval_order


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m decode compare", description=__doc__.splitlines()[0])
    ap.add_argument("run_a", type=Path, help="bench.csv of the first run")
    ap.add_argument("run_b", type=Path, help="bench.csv of the second run")
    ap.add_argument("--split", choices=["dev", "test"], help="compare only the rows of this prompt split")
    args = ap.parse_args(argv)
    lines, shared, agree = compare_runs(read_rows(args.run_a, args.split), read_rows(args.run_b, args.split))
    print("\n".join(lines))
    print(f"\n{agree} of {shared} shared rows have overlapping 95% intervals "
          f"(goal: all) — {'met' if agree == shared and shared else 'NOT met'}")


if __name__ == "__main__":
    main()
