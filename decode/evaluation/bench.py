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
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm import tqdm

from decode.costs import CostModel
from decode.engine import Autoregressive, Decoder, Stats
from decode.evaluation.goals import goal_lines
from decode.evaluation.intervals import bootstrap_ci
from decode.evaluation.quality import quality
from decode.evaluation.report import from_root, pareto_plot, quality_plot, slug, table, write_readme
from decode.hf import head_assistant, hf_generate
from decode.pair import Pair, Sampling, load_pair
from decode.streams import Streams

ROOT = Path(__file__).resolve().parents[2]


def build(spec: dict):
    """{'class_path': 'pkg.mod.Class', 'init_args': {...}} -> instance."""
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**spec.get("init_args", {}))


@dataclass
class Method:
    name: str
    kind: str = "spec"  # spec | target | draft | hf
    policy: dict | None = None
    rule: dict | None = None
    hf: dict = field(default_factory=dict)
    family: str = ""  # for plots and goals: fixed-K, specdec++, fsd, sprinter, ...
    select: str = ""  # "dev": only the value chosen on dev runs on test; "mark": all run, the dev choice is marked

    def __post_init__(self):
        if self.select not in ("", "dev", "mark"):
            raise ValueError(f"{self.name}: select: {self.select!r}; use dev (only the dev choice runs on test) or "
                             "mark (every value runs, the dev choice is marked)")

    @property
    def head_dir(self) -> str | None:
        """The exported head this method reads, if any."""
        return (self.policy or {}).get("init_args", {}).get("head_dir") or self.hf.get("head")

    @property
    def lossless(self) -> bool:
        if self.kind != "spec":
            return True
        module, _, name = self.rule["class_path"].rpartition(".")
        return getattr(getattr(importlib.import_module(module), name), "lossless", False)


def expand(raw: dict, suffix: str = "") -> list[Method]:
    """One YAML entry -> methods, one per value of its grid ({'policy.k': [1, 2]} style).

    "{suffix}" in the entry is the head suffix of the section's sampling setting ("" for the pair's
    own, "-greedy" ...), so one entry names the head trained for each setting.
    """
    raw = yaml.safe_load(yaml.safe_dump(raw).replace("{suffix}", suffix))
    grid = raw.pop("grid", None)
    if not grid:
        return [Method(**raw)]
    (key, values), = grid.items()
    out = []
    for v in values:
        r = yaml.safe_load(yaml.safe_dump(raw))
        part, arg = key.split(".")
        if part == "hf":
            r.setdefault("hf", {})[arg] = v
        else:
            r[part].setdefault("init_args", {})[arg] = v
        r["name"] = raw["name"].format(v=v)
        out.append(Method(**r))
    return out


def generator_for(pair: Pair, m: Method):
    """(ids, n, seed) -> (tokens, Stats) for one method, built once per section (heads load once).

    The decoder's generator is reseeded on every call, so every run starts alike.
    """
    if m.kind == "hf":
        assistant = head_assistant(pair, m.hf)
        return lambda ids, n, seed: hf_generate(pair, ids, n, m.hf, seed, assistant)
    if m.kind in ("target", "draft"):
        def alone(ids, n, seed):
            g = Autoregressive(pair, m.kind, seed).generate(ids, n)
            return g.tokens, g.stats

        return alone
    dec = Decoder(pair, build(m.policy), build(m.rule), seed=0)

    def run(ids, n, seed):
        dec.gen = Streams([seed], pair.device)  # the seed's stream, as a decoder made with it draws
        g = dec.generate(ids, n)
        return g.tokens, g.stats

    return run


def interleaved(pair: Pair, methods: list[Method], prompts: list[list[int]], n: int, seed: int, repeats: int,
                label: str, between=None) -> dict[str, list[list[tuple[list[int], Stats]]]]:
    """name -> [prompt][repeat] -> (tokens, stats); methods back to back per prompt, order rotated.

    `between(done, total)` is called after each prompt (the cost model re-measures itself there).
    """
    out = {m.name: [[None] * repeats for _ in prompts] for m in methods}
    runners = {m.name: generator_for(pair, m) for m in methods}
    bar = tqdm(total=len(prompts) * repeats * len(methods), desc=f"bench {label}")
    for r in range(repeats):
        for i, ids in enumerate(prompts):
            shift = (i + r) % len(methods)
            for m in methods[shift:] + methods[:shift]:
                out[m.name][i][r] = runners[m.name](ids, n, seed + 1000 * r + i)
                bar.update()
            if between is not None:
                between(r * len(prompts) + i + 1, repeats * len(prompts))
    bar.close()
    return out


def rows_of(pair: Pair, methods: list[Method], res: dict, prompts: list[list[int]], label: str,
            cost: CostModel) -> list[dict]:
    """Per-method rows: summed counters, paired speedup and interval, cost-model figures, quality."""
    def tps(tokens_stats):
        return len(tokens_stats[0]) / max(tokens_stats[1].wall, 1e-9)

    base = next(m.name for m in methods if m.kind == "target")
    base_tps = np.array([[tps(x) for x in per] for per in res[base]])
    rows = []
    for m in methods:
        runs = res[m.name]
        total = Stats()
        for per in runs:
            for _, st in per:
                total.add(st)
        ratios = np.array([[tps(x) for x in per] for per in runs]) / base_tps
        lo, hi = bootstrap_ci(ratios)
        row = {"prompts": label, "method": m.name, "kind": m.kind, "family": m.family or m.kind, **total.summary(),
               "speedup": float(ratios.mean()), "speedup_lo": lo, "speedup_hi": hi, "ratios": ratios.tolist(),
               **quality(pair, prompts, [per[0][0] for per in runs])}
        row["target_calls_per_token"] = row["verification_rate"]
        if m.kind == "hf":  # Hugging Face does not report its calls: no figure rather than a wrong one
            for k in ("discard_rate", "verification_rate", "mean_accepted", "target_calls_per_token"):
                row[k] = None
        else:
            predicted = cost.predict_s(total.calls)
            row["cost_model_tokens_per_s"] = total.new_tokens / max(predicted, 1e-9)
            row["engine_efficiency"] = predicted / max(total.wall, 1e-9)
        rows.append(row)
    return rows + random_allocation(rows)


def random_allocation(rows: list[dict], shares=(0.25, 0.5, 0.75)) -> list[dict]:
    """FSD's baseline: each prompt goes to the draft with share s, else to the target (expected values)."""
    t = next(r for r in rows if r["kind"] == "target")
    d = next((r for r in rows if r["kind"] == "draft"), None)
    if d is None:
        return []
    out = []
    for s in shares:
        wall = s * d["wall_s"] + (1 - s) * t["wall_s"]
        tokens = s * d["new_tokens"] + (1 - s) * t["new_tokens"]
        out.append({"prompts": t["prompts"], "method": f"random allocation s={s}", "kind": "random",
                    "family": "random", "new_tokens": tokens, "tokens_per_s": tokens / wall,
                    "speedup": (tokens / wall) / t["tokens_per_s"],
                    **{k: s * d[k] + (1 - s) * t[k] for k in ("target_nll", "greedy_agreement", "parse_rate")}})
    return out


def choose(methods: list[Method], dev_rows: list[dict], tolerance: float) -> list[Method]:
    """Keep every method, except that each `select: dev` grid keeps only the value chosen on dev."""
    by_name = {r["method"]: r for r in dev_rows}
    target_nll = next(r for r in dev_rows if r["kind"] == "target")["target_nll"]
    kept, groups = [], {}
    for m in methods:
        (groups.setdefault(m.family, []) if m.select == "dev" else kept).append(m)
    for group in groups.values():
        if any(m.name not in by_name for m in group):  # chosen by replay before the dev split ran
            kept += group
            continue
        ok = [m for m in group if group[0].lossless or by_name[m.name]["target_nll"] <= target_nll + tolerance]
        pool = ok or [min(group, key=lambda m: by_name[m.name]["target_nll"])]
        kept.append(max(pool, key=lambda m: by_name[m.name]["speedup"]))
    return sorted(kept, key=methods.index)


def replayable(m: Method, setting: Sampling, estimate: bool = False) -> bool:
    """Can decode.evaluation.replay price this method? Our engine and a lossless rule: exactly under greedy, as an
    estimate (estimate=True) under sampling."""
    return (setting.temperature == 0 or estimate) and m.kind == "spec" and m.lossless


def choose_by_replay(pair: Pair, methods: list[Method], prompts: list[list[int]], cfg: dict
                     ) -> tuple[list[Method], list[str], set[str]]:
    """Each replayable `select: dev` grid keeps the value with the best replayed speedup on the dev prompts, priced by
    a cost model measured now (under sampling replay's estimate: decode.evaluation.replay); every other method is
    kept (its grid, if any, still decodes dev). A `select: mark` grid keeps every value and its dev choice is
    returned too -> (methods, the lines saying what was chosen, the names of the marked choices)."""
    from decode.evaluation.replay import Priced, record, speedup

    grids: dict[str, list[Method]] = {}
    for m in methods:
        if m.select in ("dev", "mark") and replayable(m, pair.config.sampling, estimate=True):
            grids.setdefault(m.family, []).append(m)
    if not grids:
        return methods, [], set()
    n = cfg["max_new_tokens"]
    trajs = [record(pair, p, n) for p in prompts]
    cost = Priced(CostModel.measure(pair, prompts, 24, cfg["cost_repeats"], growth=n))
    chosen, lines = {}, []
    for family, group in grids.items():
        scores = [speedup(trajs, build(m.policy), cost, pair.config.max_context)[0] for m in group]
        best = max(range(len(group)), key=scores.__getitem__)
        edge = len(group) > 1 and best in (0, len(group) - 1)
        lines.append(f"- {family}, replayed speedup on {len(prompts)} dev prompts: " + ", ".join(
            f"{m.name} {s:.3f}" for m, s in zip(group, scores)) + f" -> {group[best].name}"
            + (" (**at the edge of the grid**)" if edge else ""))
        chosen[family] = group[best]
    print("\n".join(lines), flush=True)
    marked = {m.name for m in chosen.values() if m.select == "mark"}
    return [m for m in methods if m.select != "dev" or m.family not in chosen or m is chosen[m.family]], lines, marked


def encode_prompts(pair: Pair, ps_raw: dict, n: int) -> list[list[int]]:
    from data_gen.prompts import PromptSet

    budget = pair.config.max_context - n
    return [pair.encode(t, budget) for t in PromptSet(**ps_raw).load()["prompt"]]


# decode modules that read, compare or present a split's saved rows and never make them: a change to them
# re-renders the tables from the saved splits instead of decoding all twelve again (an hour on this machine)
PRESENTS_ROWS = ("__init__.py", "__main__.py", "compare.py", "goals.py", "report.py")


def fingerprint(methods: list[Method]) -> str:
    """sha256 of what decides a split's rows beyond its config: the decode and heads sources, the torch and
    transformers versions, and the weights and config of every head the methods read.

    A saved split is resumed only by the code and heads that made it: after a change to the engine or a
    retrained head the split runs again instead of mixing two versions in one table.
    """
    import transformers

    h = hashlib.sha256(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    files = [f for f in sorted((ROOT / "decode").rglob("*.py")) if f.name not in PRESENTS_ROWS]
    files += sorted((ROOT / "heads").glob("*.py"))
    for head in dict.fromkeys(m.head_dir for m in methods if m.head_dir):
        files += [ROOT / head / "config.json", ROOT / head / "model.safetensors"]  # ROOT / an absolute path is it
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}:".encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def run_split(pair: Pair, label: str, prompts, methods: list[Method], cfg: dict, cache: Path) -> list[dict]:
    """One split of one section, resumed from `cache` when the same code did the same work before."""
    key = hashlib.sha256(json.dumps([label, prompts, [asdict(m) for m in methods], cfg["max_new_tokens"],
                                     cfg["seed"], cfg["repeats"], pair.config.hash(),
                                     fingerprint(methods)]).encode()).hexdigest()[:16]
    path = cache / f"{slug(label)}-{key}.json"
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

    generator_for(pair, methods[0])(prompts[0], 8, 0)  # warm-up
    res = interleaved(pair, methods, prompts, n, cfg["seed"], cfg["repeats"], label, remeasure)
    cost = CostModel.mean(costs)
    rows = rows_of(pair, methods, res, prompts, label, cost)
    target = next(r for r in rows if r["kind"] == "target")
    note = (f"cost model (mean of {len(costs)} measurements through the section): {cost.describe()}; "
            f"target alone measured/predicted time "
            f"{1 / target['engine_efficiency']:.3f} (goal within 10%)")
    print(f"\n## {label}: {len(prompts)} prompts x {cfg['repeats']} repeats, {n} new tokens\n\n{note}\n\n{table(rows)}",
          flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    # the cost model itself, so that replay can price the same rows (python -m decode replay --check)
    path.write_text(json.dumps({"rows": rows, "cost": note, "cost_model": asdict(cost), "prompts": prompts},
                               default=float))
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


class UnknownPromptSet(ValueError):
    """--prompt_sets or --settings named a set or a sampling setting the bench YAML does not have."""


def load_config(config: str, quick: bool, repeats: int | None, output: str | None = None,
                prompt_sets: list[str] | None = None, settings: list[str] | None = None) -> dict:
    path = Path(config) if Path(config).is_absolute() else ROOT / config
    cfg = {"max_new_tokens": 64, "seed": 0, "repeats": 1, "cost_repeats": 7, "threads": 2, "quality_tolerance": 0.05,
           "output": "runs/bench"} | yaml.safe_load(path.read_text())
    if repeats is not None:
        cfg["repeats"] = repeats
    if output is not None:
        cfg["output"] = output
    if prompt_sets:
        names = [ps["name"] for ps in cfg["prompt_sets"]]
        if unknown := [n for n in prompt_sets if n not in names]:
            raise UnknownPromptSet(f"--prompt_sets {' '.join(unknown)}: {path.name} has {', '.join(names)}")
        cfg["prompt_sets"] = [ps for ps in cfg["prompt_sets"] if ps["name"] in prompt_sets]
    if settings:  # e.g. the greedy sections alone: --settings greedy
        names = [Sampling(**sec.get("sampling", {})).name for sec in cfg["sections"]]
        if unknown := [n for n in settings if n not in names]:
            raise UnknownPromptSet(f"--settings {' '.join(unknown)}: {path.name} has {', '.join(names)}")
        cfg["sections"] = [sec for sec, name in zip(cfg["sections"], names) if name in settings]
    if quick:  # a smoke run: few prompts, few methods, no dev sweep, a coarse cost model
        cfg["repeats"], cfg["cost_repeats"] = 1, 3
        if output is None:  # never into the committed results: a scratch folder that git ignores
            cfg["output"] = str(Path("runs/bench-quick") / Path(cfg["output"]).name)
        for ps in cfg["prompt_sets"]:
            for split in ("dev", "test"):
                if split in ps:
                    ps[split] = ps[split] | {"limit": cfg.get("quick_prompts", 3)}
    return cfg


def run(config: str, quick: bool = False, readme: bool = False, repeats: int | None = None,
        output: str | None = None, prompt_sets: list[str] | None = None, settings: list[str] | None = None
        ) -> list[dict]:
    t_start = time.perf_counter()
    if quick and readme:
        raise ValueError("--readme true with --quick true would put a smoke run's figures in README.md: drop one")
    cfg = load_config(config, quick, repeats, output, prompt_sets, settings)
    torch.set_num_threads(cfg["threads"])
    pair = load_pair(cfg["pair"])
    out_dir = Path(cfg["output"]) if Path(cfg["output"]).is_absolute() else ROOT / cfg["output"]
    out_dir.mkdir(parents=True, exist_ok=True)
    own = pair.config.sampling.name
    all_rows, dev_rows, md, dev_md = [], [], [], []
    for ps in cfg["prompt_sets"]:
        for sec in cfg["sections"]:
            setting = Sampling(**sec.get("sampling", {}))
            sec_pair = pair.with_sampling(**asdict(setting))
            suffix = "" if setting.name == own else f"-{setting.name}"
            methods = [m for raw in sec["methods"] for m in expand(dict(raw), suffix)]
            if quick:
                methods = [m for m in methods if m.kind == "target" or m.name in cfg.get("quick_methods", [])]
            stem = f"{ps['name']}_{setting.name}"
            marked: set[str] = set()
            if "dev" in ps and not quick:  # grids our engine runs losslessly: chosen by replay, nothing decoded
                methods, lines, marked = choose_by_replay(sec_pair, methods, encode_prompts(
                    sec_pair, ps["dev"], cfg["max_new_tokens"]), cfg)
                if lines:
                    dev_md += [f"### {ps['name']}/dev {setting.name} (chosen by replay)", "\n".join(lines)]
            if "dev" in ps and not quick and any(m.select == "dev" and not replayable(m, setting) for m in methods):
                swept = [m for m in methods if m.kind == "target" or (m.select == "dev" and not replayable(m, setting))]
                rows = run_split(sec_pair, f"{ps['name']}/dev {setting.name}", encode_prompts(sec_pair, ps["dev"], cfg["max_new_tokens"]),
                                 swept, cfg, out_dir / "sections")
                dev_rows += rows
                dev_md += [f"### {ps['name']}/dev {setting.name} (full sweep)", table(rows)]
                methods = choose(methods, rows, cfg["quality_tolerance"])
            label = f"{ps['name']}/test {setting.name}"
            rows = run_split(sec_pair, label, encode_prompts(sec_pair, ps["test"], cfg["max_new_tokens"]), methods,
                             cfg, out_dir / "sections")
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
    write_outputs(out_dir, all_rows + dev_rows, md, dev_md, command, readme)
    print(f"bench took {(time.perf_counter() - t_start) / 60:.1f} min (a section resumed from its cache adds nothing)")
    return all_rows


def write_outputs(out_dir: Path, rows: list[dict], md: list[str], dev_md: list[str], command: str,
                  readme: bool) -> None:
    with open(out_dir / "bench.csv", "w", newline="") as f:
        keys = list(dict.fromkeys(itertools.chain.from_iterable(r.keys() for r in rows)))
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    stamp = time.strftime("%Y-%m-%d")
    head = [f"Generated by `python -m decode bench {command}` on {stamp}."]
    (out_dir / "bench.md").write_text("\n\n".join(head + md) + "\n")
    if dev_md:
        (out_dir / "dev.md").write_text("\n\n".join(head + dev_md) + "\n")
    if readme:  # the README holds the one summary table; every split's full table is in bench.md
        from decode.evaluation.summary import summary

        where = from_root(out_dir, ROOT)
        write_readme(f"Generated by `python -m decode bench {command}` on {stamp} (speedup over the target alone, "
                     f"95% interval over prompts; every row of every split in `{where}/bench.md`):\n\n"
                     + summary([{k: str(v) for k, v in r.items()} for r in rows]))
    print(f"\ntables (bench.md, dev.md), CSV and plots in {out_dir}")
