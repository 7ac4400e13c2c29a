"""One table of what the controllers gain, generated from a bench run's CSV: the README's results.

    python -m decode summary docs/bench/bench.csv                 # print it
    python -m decode summary docs/bench/bench.csv --readme true   # and write it into README.md
    python -m decode summary docs/bench/smollm2/bench.csv --head checkpoints/smollm2/specdecpp \
        --prev_head checkpoints/smollm2/specdecpp-prev --readme true   # the smollm2 run, with its heads' AUROC
    python -m decode summary a/bench.csv b/bench.csv                  # runs of separate prompt sets, joined

One row per prompt set and sampling setting (test split): the target alone's tokens/s, then the speedup over
it, with its 95% interval, of fixed-K speculative decoding (the K best on test in hindsight and the K chosen on
dev), each learned controller, the training-free
rules and the hindsight oracle (methods whose thresholds the bench chose on dev prompts appear with the chosen
one), and the dev AUROC of the SpecDec++ heads (the main recipe's, and the prev head's that the stopping rules
read) beside the draft confidence's for the same event: one figure per head, on the first prompt set's row.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from decode.evaluation.goals import member
from decode.evaluation.report import ROOT, from_root, made_by, write_readme

# (column, bench family): a family with several rows on test shows its fastest; fixed K shows both the K best in
# hindsight on test and the K chosen on dev (decode.evaluation.goals.member)
COLUMNS = [("best fixed K (hindsight)", "fixed-K"), ("fixed K chosen on dev", "fixed-K@dev"),
           ("SpecDec++ head", "specdec++"), ("SpecDec++ prev head", "specdec++-prev"),
           ("cost-aware stop", "cost-aware"), ("SPRINTER", "sprinter"),
           ("FSD + head", "fsd+head"), ("FSD + head, cost-aware", "fsd+cost-aware"),
           ("rFSD + head, cost-aware", "rfsd+cost-aware"),
           ("draft confidence", "draft-confidence"), ("AdaEDL", "adaedl"),
           ("FLy", "fly"), ("HF assisted (its threshold)", "hf-confidence"), ("HF + head", "hf-specdec++"),
           ("oracle", "oracle"),
           ("perfect head", "perfect-head")]
# the embedded pair's heads, whose dev AUROC the table reads unless told others (the setting's suffix left off)
HEAD, PREV_HEAD = "checkpoints/specdecpp", "checkpoints/specdecpp-prev"
SETTINGS = {"greedy": "greedy", "t0.7-p0.95": "T = 0.7, top-p 0.95", "t1": "T = 1"}


def cell(row: dict) -> str:
    s, lo, hi = (float(row[k]) for k in ("speedup", "speedup_lo", "speedup_hi"))
    return f"{s:.2f} [{lo:.2f}, {hi:.2f}]"


def head_config(setting: str, head: str = HEAD) -> dict | None:
    """The config of the head trained for `setting`: `head`-<setting>, or `head` itself at the pair's own setting (no
    suffix), each config saying its setting; None where neither is."""
    from decode.pair import Sampling

    for path in (ROOT / f"{head}-{setting}" / "config.json", ROOT / head / "config.json"):
        if path.exists() and Sampling.of((cfg := json.loads(path.read_text()))["sampling"]).name == setting:
            return cfg
    return None


def head_auroc(setting: str, head: str = HEAD) -> str:
    """'0.806 / 0.733': the head trained for `setting`'s dev AUROC and the draft confidence's, same event."""
    if (cfg := head_config(setting, head)) is None:
        return "-"
    m = cfg["metrics"]
    return f"{m['auroc']:.3f} / {m['draft_confidence_auroc']:.3f}"


def summary(rows: list[dict], head: str = HEAD, prev_head: str = PREV_HEAD) -> str:
    """bench.csv rows -> the markdown table (test splits only); head and prev_head: the folders (setting suffix
    left off) whose dev AUROC the last two columns read."""
    sets = list(dict.fromkeys(r["prompts"].split("/")[0] for r in rows))  # in the order the CSVs name them
    splits = sorted({r["prompts"] for r in rows if "/test " in r["prompts"]},
                    key=lambda s: (s.split("/")[0] != "pycode", sets.index(s.split("/")[0]),
                                   list(SETTINGS).index(s.split()[-1]) if s.split()[-1] in SETTINGS else 9, s))
    columns = [(c, f) for c, f in COLUMNS if any(member(r, f) for r in rows)]  # none decoded: no column
    header = ["prompts", "setting", "target alone tok/s"] + [c for c, _ in columns] + \
        ["SpecDec++ head dev AUROC / draft confidence", "prev head dev AUROC / draft confidence"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    shown: dict[str, str] = {}  # setting -> the prompt set whose row shows its heads' AUROC
    for split in splits:
        mine = [r for r in rows if r["prompts"] == split]
        target = next((r for r in mine if r["family"] == "target"), None)
        if target is None:  # every speedup is over it: a table without it would read nothing
            raise ValueError(f"split {split!r} has no target row: decode it again (python -m decode bench resumes it)")
        setting = split.split()[-1]
        cells = [split.split("/")[0], SETTINGS.get(setting, setting), f"{float(target['tokens_per_s']):.0f}"]
        for _, family in columns:
            fam = [r for r in mine if member(r, family)]
            best = max(fam, key=lambda r: float(r["speedup"]), default=None)
            cells.append("-" if best is None else cell(best) + (f" ({best['method'].split()[-1]})"
                                                                 if family.startswith("fixed-K") else ""))
        # one dev figure per head, not a reading on these prompts: shown once, its later rows point back to it
        first = shown.setdefault(setting, cells[0])
        aurocs = [head_auroc(setting, head), head_auroc(setting, prev_head)]
        cells += aurocs if first == cells[0] else [a if a == "-" else f"as for {first}" for a in aurocs]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m decode summary", description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path, nargs="+", help="a bench run's bench.csv (several: runs of other sections)")
    ap.add_argument("--head", default=HEAD, help="the SpecDec++ head's folder, suffix left off")
    ap.add_argument("--prev_head", default=PREV_HEAD, help="the prev head's, suffix left off")
    ap.add_argument("--readme", type=lambda v: v.lower() in ("1", "true", "yes"), default=False,
                    help="also write the table into README.md's generated block")
    args = ap.parse_args(argv)
    if missing := [str(p) for p in args.csv if not p.exists()]:
        ap.error(f"{' '.join(missing)} not found: give the bench.csv of a run folder (docs/bench/bench.csv)")
    if missing := [h for h in (args.head, args.prev_head) if not any(head_config(s, h) for s in SETTINGS)]:
        ap.error(f"no head folder {' or '.join(missing)}[-<setting>] with a config.json under {ROOT}: give the heads' "
                 "folder relative to the project root, setting suffix left off")
    rows, origin = [], {}
    for path in args.csv:
        for r in csv.DictReader(path.open()):
            if origin.setdefault(r["prompts"], path) != path:  # one split, two runs: their ratios are over other targets
                ap.error(f"{r['prompts']} is in both {origin[r['prompts']]} and {path}: give each split's run once")
            rows.append(r)
    try:
        table = summary(rows, args.head, args.prev_head)
    except ValueError as e:
        ap.error(str(e))
    print(table)
    if args.readme:
        where = ", ".join(f"`{from_root(p.resolve().parent, ROOT)}/`" for p in args.csv)
        command = " ".join(["python -m decode summary", *map(str, args.csv)] +
                           [f"--{k} {v}" for k, v in (("head", args.head), ("prev_head", args.prev_head))
                            if v != ap.get_default(k)])
        write_readme(f"Generated by `{command}` from the runs in {where}, {made_by(rows)} (speedup "
                     f"over the target alone, 95% "
                     f"interval over prompts; every row in each folder's bench.md):\n\n{table}")


if __name__ == "__main__":
    main()
