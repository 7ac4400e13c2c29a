"""Every method on the same prompts, interleaved, with paired speedups, intervals and a measured cost model.

    python -m decode bench --config configs/bench/pycode.yaml [--quick true] [--repeats 2] [--readme true] [--prompt_sets pycode]
    python -m decode bench --settings greedy --output runs/bench-greedy   # the greedy sections alone

For each prompt set and sampling setting (a section), methods whose grid is marked `select: dev`
are swept on the dev prompts and only the value chosen there runs on the test prompts (lossless
methods: the fastest; lossy ones: the fastest whose target NLL is within `quality_tolerance` of
the target alone). On each split every method runs back to back on each prompt, in an order
rotated per prompt, so drift of the machine falls on all methods alike; a row's speedup is the
mean of per-prompt tok/s ratios against the target alone, with a 95% bootstrap interval. Each
section is saved as it finishes, so an interrupted run resumes where it stopped.

A grid marked `select: mark` (fixed K) runs every value on test, and the value replay chooses on the dev prompts is
marked (the row's `dev_choice`): goals and the summary name it `fixed-K@dev`. The fastest K on test is chosen in
hindsight, and under sampling that choice is mostly noise.

The YAML and its methods are decode.evaluation.bench_config, the measuring loop and the dev choices
decode.evaluation.measuring; this module runs the sections, caches each split, and writes the tables and plots.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import re
import time
from dataclasses import asdict
from pathlib import Path

import torch

from decode.costs.model import CostModel
from decode.evaluation.bench_config import (
    ROOT,
    BadBenchConfig,
    Method,
    build,
    encode_prompts,
    expand,
    load_config,
    stops_at_eos,
)
from decode.evaluation.goals import goal_lines
from decode.evaluation.measuring import choose, choose_by_replay, generator_for, interleaved, replayable, rows_of
from decode.evaluation.report import (
    PRESENTS_ROWS,
    from_root,
    made_by,
    pareto_plot,
    provenance,
    quality_plot,
    slug,
    table,
    write_atomic,
    write_readme,
)
from decode.evaluation.summary import HEAD, PREV_HEAD
from decode.pair import Pair, Sampling, load_pair

# the names callers and tests import from here (decode.evaluation.tuning, decode.__main__) beside this module's own
__all__ = ["ROOT", "Method", "BadBenchConfig", "build", "choose", "choose_by_replay", "code_fingerprint", "dev_choices",
           "encode_prompts", "expand", "fingerprint", "generator_for", "head_lines", "interleaved", "load_config",
           "replayable", "rows_of", "run", "run_split", "save_json", "split_files", "work_key", "write_outputs"]



def fingerprint(methods: list[Method]) -> str:
    """sha256 of what decides a split's rows beyond its config: the decode and heads sources, the torch and
    transformers versions, and the weights and config of every head the methods read.

    A saved split is resumed only by the code and heads that made it: after a change to the engine or a
    retrained head the split runs again instead of mixing two versions in one table.
    """
    return code_fingerprint([m.head_dir for m in methods if m.head_dir])


def code_fingerprint(head_dirs: list[str]) -> str:
    """sha256 of the decode and heads sources, the torch and transformers versions and these heads' files (fingerprint;
    the batch bench keys its saved sizes by it)."""
    import transformers

    h = hashlib.sha256(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    files = [f for f in sorted((ROOT / "decode").rglob("*.py"))
             if f.relative_to(ROOT / "decode").as_posix() not in PRESENTS_ROWS]
    files += sorted((ROOT / "heads").glob("*.py"))
    for head in dict.fromkeys(head_dirs):  # ROOT / an absolute path is it; a head not (wholly) there hashes as such
        files += [f for f in (ROOT / head / "config.json", ROOT / head / "model.safetensors") if f.exists()]
    for f in files:
        h.update(f"{f.relative_to(ROOT).as_posix() if f.is_relative_to(ROOT) else f.name}:{f.stat().st_size}:".encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def work_key(pair: Pair, label: str, prompts, methods: list[Method], cfg: dict) -> str:
    """16 hex digits naming one split's work: the same key means the same prompts, methods, budget, seeds, pair and
    code, so its saved result can stand in for doing it again."""
    return hashlib.sha256(json.dumps([label, prompts, [asdict(m) for m in methods], cfg["max_new_tokens"],
                                      stops_at_eos(pair, cfg["ignore_eos"]), cfg["seed"], cfg["repeats"], pair.key(),
                                      fingerprint(methods)]).encode()).hexdigest()[:16]


def split_files(out_dir: Path, stem: str) -> list[Path]:
    """The saved splits of one prompt set, split and setting (stem 'instruct_test_t1'), oldest first."""
    named = re.compile(re.escape(stem) + r"-[0-9a-f]{16}\.json")
    return sorted((f for f in (out_dir / "sections").glob(f"{stem}-*.json") if named.fullmatch(f.name)),
                  key=lambda f: f.stat().st_mtime)


def save_json(path: Path, obj, **kw) -> None:
    """obj as JSON at path, its folder made, whole or not at all (write_atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, **kw)))


def dev_choices(pair: Pair, label: str, prompts, methods: list[Method], cfg: dict, cache: Path
                ) -> tuple[list[Method], list[str], set[str]]:
    """choose_by_replay on one dev split, saved in cache/choices and reused by a resumed run: replay prices its
    grids with a cost model measured now, and a fresh one can tip a near-tie (AdaEDL 0.05 one run, 0.1 the next),
    which would change the test split's methods, hence its key, and decode a finished split again."""
    path = cache / "choices" / f"{slug(label)}-{work_key(pair, label, prompts, methods, cfg)}.json"
    if path.exists():
        saved = json.loads(path.read_text())
        print(f"\n## {label}: choices resumed from {path.name}\n" + "\n".join(saved["lines"]), flush=True)
        return [methods[i] for i in saved["kept"]], saved["lines"], set(saved["marked"])
    kept, lines, marked = choose_by_replay(pair, methods, prompts, cfg, stops_at_eos(pair, cfg["ignore_eos"]))
    save_json(path, {"kept": [next(i for i, m in enumerate(methods) if m is k) for k in kept], "lines": lines,
                     "marked": sorted(marked)})
    return kept, lines, marked


def run_split(pair: Pair, label: str, prompts, methods: list[Method], cfg: dict, cache: Path,
              made: dict[str, str]) -> list[dict]:
    """One split of one section, resumed from `cache` when the same code did the same work before. A section whose
    setting the config's ignore_eos names decodes every prompt's whole budget through its EOS (fixed lengths)."""
    stop = stops_at_eos(pair, cfg["ignore_eos"])
    path = cache / f"{slug(label)}-{work_key(pair, label, prompts, methods, cfg)}.json"
    if path.exists():
        saved = json.loads(path.read_text())
        print(f"\n## {label}: resumed from {path.name}\n\n{saved['cost']}\n\n{table(saved['rows'])}", flush=True)
        return saved["rows"]
    n, k_max = cfg["max_new_tokens"], max([m.policy.get("init_args", {}).get("k", 0) for m in methods
                                            if m.policy] + [20]) + 2
    n_max = min(k_max, 24)
    costs = [CostModel.measure(pair, prompts, n_max, cfg["cost_repeats"], growth=n)]

    def remeasure(done: int, total: int) -> None:  # after each quarter of the work
        if done * 4 // total > (done - 1) * 4 // total:
            costs.append(CostModel.measure(pair, prompts, n_max, cfg["cost_repeats"], growth=n, seed=len(costs)))

    generator_for(pair, methods[0])(prompts[0], min(8, n), 0)  # warm-up (prompts leave room for n tokens)
    res = interleaved(pair, methods, prompts, n, cfg["seed"], cfg["repeats"], label, remeasure, stop)
    cost = CostModel.mean(costs)
    rows = [r | made for r in rows_of(pair, methods, res, prompts, label, cost)]
    target = next(r for r in rows if r["kind"] == "target")
    note = (f"cost model (mean of {len(costs)} measurements through the section): {cost.describe()}; "
            f"target alone measured/predicted time "
            f"{1 / target['engine_efficiency']:.3f} (goal within 10%)")
    print(f"\n## {label}: {len(prompts)} prompts x {cfg['repeats']} repeats, {n} new tokens"
          f"{'' if stop else ' (through EOS)'}\n\n{note}\n\n{table(rows)}",
          flush=True)
    # the cost model itself, so that replay can price the same rows (python -m decode replay --check)
    save_json(path, {"rows": rows, "cost": note, "cost_model": asdict(cost), "prompts": prompts}, default=float)
    return rows


def head_lines(methods: list[Method]) -> list[str]:
    """One line per head a section uses: its setting and dev AUROC beside the draft confidence's, same event."""
    lines = []
    for head in dict.fromkeys(m.head_dir for m in methods if m.head_dir):
        cfg = json.loads((ROOT / head / "config.json").read_text())  # ROOT / an absolute path is that path
        m = cfg["metrics"]
        lines.append(f"- head `{head}` (trained for {Sampling(**cfg['sampling']).name}, {cfg['label']['family']}): "
                     f"dev AUROC {m['auroc']:.3f}, draft confidence {m['draft_confidence_auroc']:.3f} "
                     f"for the same event ({m['positions']} positions)")
    return lines


def run(config: str, quick: bool = False, readme: bool = False, repeats: int | None = None,
        output: str | None = None, prompt_sets: list[str] | None = None, settings: list[str] | None = None
        ) -> list[dict]:
    t_start = time.perf_counter()
    if quick and readme:
        raise ValueError("--readme true with --quick true would put a smoke run's figures in README.md: drop one")
    cfg = load_config(config, quick, repeats, output, prompt_sets, settings)
    torch.set_num_threads(cfg["threads"])
    made = provenance()  # read once, before any work: the code and machine this process runs, whatever lands meanwhile
    pair = load_pair(cfg["pair"])
    out_dir = Path(cfg["output"]) if Path(cfg["output"]).is_absolute() else ROOT / cfg["output"]
    out_dir.mkdir(parents=True, exist_ok=True)
    all_rows, dev_rows, md, dev_md = [], [], [], []
    for ps in cfg["prompt_sets"]:
        for sec in cfg["sections"]:
            setting = Sampling(**sec.get("sampling", {}))
            sec_pair = pair.with_sampling(**asdict(setting))
            methods = [m for raw in sec["methods"] for m in expand(dict(raw), sec_pair.head_suffix())]
            if twice := sorted({m.name for m in methods if [x.name for x in methods].count(m.name) > 1}):
                raise ValueError(f"{config}: section {setting.name} names {', '.join(twice)} more than once: give "
                                 "each method, and each grid value ({v}), a name of its own")
            if quick:
                methods = [m for m in methods if m.kind == "target" or m.name in cfg.get("quick_methods", [])]
            stem = f"{ps['name']}_{setting.name}"
            marked: set[str] = set()
            if "dev" in ps and not quick:  # grids our engine runs losslessly: chosen by replay, nothing decoded
                methods, lines, marked = dev_choices(sec_pair, f"{ps['name']}/dev {setting.name}", encode_prompts(
                    sec_pair, ps["dev"], cfg["max_new_tokens"]), methods, cfg, out_dir / "sections")
                if lines:
                    dev_md += [f"### {ps['name']}/dev {setting.name} (chosen by replay)", "\n".join(lines)]
            if "dev" in ps and not quick and any(m.select == "dev" and not replayable(m, setting) for m in methods):
                swept = [m for m in methods if m.kind == "target" or (m.select == "dev" and not replayable(m, setting))]
                rows = run_split(sec_pair, f"{ps['name']}/dev {setting.name}", encode_prompts(sec_pair, ps["dev"], cfg["max_new_tokens"]),
                                 swept, cfg, out_dir / "sections", made)
                dev_rows += rows
                dev_md += [f"### {ps['name']}/dev {setting.name} (full sweep)", table(rows)]
                methods = choose(methods, rows, cfg["quality_tolerance"])
            label = f"{ps['name']}/test {setting.name}"
            rows = run_split(sec_pair, label, encode_prompts(sec_pair, ps["test"], cfg["max_new_tokens"]), methods,
                             cfg, out_dir / "sections", made)
            for r in rows:  # outside the split's cache key: a resumed split takes the choice this run made
                r["dev_choice"] = r["method"] in marked
            lines = head_lines(methods) + goal_lines(rows, cfg.get("goals", []))
            print("\n".join(lines), flush=True)
            pareto_plot(rows, out_dir / f"pareto_{stem}.png", label)
            quality_plot(rows, out_dir / f"speed_quality_{stem}.png", label)
            md += [f"### {label}", table(rows), "\n".join(lines)]
            all_rows += rows
    command = f"--config {config}" + (" --quick true" if quick else "") + \
        (f" --prompt_sets {' '.join(prompt_sets)}" if prompt_sets else "") + \
        (f" --settings {' '.join(settings)}" if settings else "")
    write_outputs(out_dir, all_rows + dev_rows, md, dev_md, command, readme, (cfg["summary_head"], cfg["summary_prev_head"]))
    print(f"bench took {(time.perf_counter() - t_start) / 60:.1f} min (a section resumed from its cache adds nothing)")
    return all_rows


def write_outputs(out_dir: Path, rows: list[dict], md: list[str], dev_md: list[str], command: str,
                  readme: bool, heads: tuple[str, str] = (HEAD, PREV_HEAD)) -> None:
    """bench.csv, bench.md and dev.md into out_dir, and with `readme` the summary table into README.md; heads: the
    SpecDec++ and prev heads' folders (setting suffix left off) whose dev AUROC the summary reads."""
    with open(out_dir / "bench.csv", "w", newline="") as f:
        keys = list(dict.fromkeys(itertools.chain.from_iterable(r.keys() for r in rows)))
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    stamp = time.strftime("%Y-%m-%d")
    head = [f"Generated by `python -m decode bench {command}` on {stamp}, {made_by(rows)}."]
    (out_dir / "bench.md").write_text("\n\n".join(head + md) + "\n")
    if dev_md:
        (out_dir / "dev.md").write_text("\n\n".join(head + dev_md) + "\n")
    if readme:  # the README holds the one summary table; every split's full table is in bench.md
        from decode.evaluation.summary import summary

        where = from_root(out_dir, ROOT)
        write_readme(f"Generated by `python -m decode bench {command}` on {stamp}, {made_by(rows)} (speedup over"
                     f" the target alone, "
                     f"95% interval over prompts; every row of every split in `{where}/bench.md`):\n\n"
                     + summary([{k: str(v) for k, v in r.items()} for r in rows], *heads))
    print(f"\ntables (bench.md, dev.md), CSV and plots in {out_dir}")
