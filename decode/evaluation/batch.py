"""Batched decoding against batch size: throughput, per-row latency and KV memory of every method, greedy and T = 1.

    python -m decode batch-bench --config configs/bench/batch.yaml [--quick true] [--output DIR]

For each sampling setting and batch size B, the test prompts are cut into batches of B (each prompt's last
prompt_tokens tokens: a padded batch attends over its longest row); every method decodes each batch, back to back
in a seeded random order per batch, from the same row seeds. Under the settings named in ignore_eos (T = 1) every row
decodes max_new_tokens through its EOS, as serving benchmarks fix output lengths: each method draws other text, and
where rows stop at EOS a batch's tok/s is set by where its draws put the EOS. A method's speedup is the mean over batches of its tok/s
over our batched target alone on the same batch, with a 95% bootstrap interval over batches (paired).

Methods: the target alone (ours, twice: the second run is the A/A check of the run's noise, and Hugging Face
generate() on the left-padded batch), fixed K = 1..6, draft
confidence per row, vLLM's batch-size table (decode.control.BatchSizeK: per B, the best of K = 0..6 on one
dev batch), and the batch controller (BatchCostAware on the setting's head, its cost tables measured at the powers of
2 up to the largest batch size; before the test batches it decodes the dev batches the table is chosen on, so that
it, like the table, has learned on dev what drafting yields at each size), and at tree_sizes the head tree
(decode.tree.HeadTree on the setting's sibling head, its cost tables measured once on a dev batch; it decodes
the dev batches at tree_sizes first, learning there where its trees pay). The fixed K
best over all batch sizes on dev (geometric mean) is marked: a user who sets one K.
Writes batch.csv, batch.md and batch_speedup.png to the output folder; each (setting, B) is saved as it finishes
(batch_cache/, keyed by the config, pair, code and heads), so an interrupted run resumes there and a changed one
measures again.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from data_gen.prompts import PromptSet
from decode.batch import BatchAutoregressive, BatchDecoder
from decode.control import BatchCostAware, BatchSizeK
from decode.costs.batch import batch_costs, table_sizes
from decode.costs.model import tree_costs
from decode.evaluation.bench import code_fingerprint, save_json
from decode.evaluation.bench_config import check_ignore_eos, stops_at_eos
from decode.evaluation.intervals import bootstrap_ci
from decode.evaluation.report import made_by, provenance, pyplot
from decode.hf import hf_generate_batch
from decode.pair import Pair, Sampling, load_pair, read_yaml
from decode.policies import DraftConfidence, FixedK
from decode.rules.chain import SpeculativeSampling
from decode.tree.head import HeadTree

AGAIN = "target alone again (A/A)"
TREE = "tree head"  # decodes at cfg.tree_sizes only
COLUMNS = ["prompts", "setting", "batch_size", "method", "tokens_per_s", "speedup", "lo", "hi",
           "row_latency_s", "peak_kv_mib", "drafted", "batches", "note", "commit", "machine"]


@dataclass
class BatchBenchConfig:
    """The YAML's schema (configs/bench/batch.yaml)."""

    pair: str = "configs/pairs/pycode.yaml"
    test: dict = field(default_factory=lambda: {"name": "pycode", "split": "test"})
    dev: dict = field(default_factory=lambda: {"name": "pycode", "split": "dev"})
    settings: list[dict] = field(default_factory=lambda: [{"temperature": 0.0}, {"temperature": 1.0}])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32, 128, 256])
    repeats: dict[int, int] = field(default_factory=dict)  # batches per size on test (default 2)
    fixed_k: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6])
    confidence: float = 0.4
    head: str = "checkpoints/specdecpp-prev{suffix}"  # {suffix}: "" at the pair's own setting, "-greedy", ...
    tree_head: str = "checkpoints/specdecpp-tree{suffix}"  # the head tree's sibling head ("": no head tree)
    tree_sizes: list[int] = field(default_factory=lambda: [1, 8])  # the batch sizes the head tree decodes at
    max_new_tokens: int = 32
    # Settings (by name) whose rows decode max_new_tokens through their EOS, as serving benchmarks fix output lengths:
    # under sampling each method draws other text, and where rows stop at EOS a batch's tok/s is set by where its draws
    # put the EOS (the target alone ranged 77-222 tok/s over batches of one prompt at T = 1), not by the method
    ignore_eos: list[str] = field(default_factory=lambda: ["t1"])
    prompt_tokens: int = 64
    threads: int = 2
    seed: int = 0
    output: str = "docs/bench"

    def __post_init__(self):
        self.repeats = {int(b): int(n) for b, n in self.repeats.items()}  # "8" (a quoted key) is B = 8 too
        check_ignore_eos(self.ignore_eos, [Sampling.of(raw).name for raw in self.settings])


def encode(pair: Pair, spec: dict, tokens: int) -> list[list[int]]:
    """A prompt set's prompts as ids, each its last `tokens` tokens."""
    return [pair.encode(r["prompt"], max_tokens=tokens) for r in PromptSet(**spec).load()]


def batches(prompts: list[list[int]], b: int, count: int) -> list[list[list[int]]]:
    """count batches of b consecutive prompts (wrapping around when the set is short)."""
    return [[prompts[(i * b + j) % len(prompts)] for j in range(b)] for i in range(count)]


def dev_batches(dev: list[list[int]], b: int) -> list[list[list[int]]]:
    """The dev batches of size b that the table is chosen on and the controller calibrates on (four at B = 1)."""
    return batches(dev, b, 4 if b == 1 else 1)


def runners(pair: Pair, cfg: BatchBenchConfig, table: dict[int, int] | None, sizes: list[int],
            calibration: list[list[list[int]]] = ()) -> dict:
    """name -> run(batch, seed) -> (tokens per row, wall s, per-row latency s, peak KV bytes or None, candidates drafted
    per row and round or None). calibration:
    dev batches the batch controller decodes first, as a server calibrates once (the table is chosen on them)."""
    stop = stops_at_eos(pair, cfg.ignore_eos)

    def ours(make):
        def run(batch, seed):
            dec = make(seed)
            gens = dec.generate(batch, cfg.max_new_tokens, stop)
            drafted = dec.stats.drafted / max(dec.stats.rounds, 1) if isinstance(dec, BatchDecoder) else None
            return ([g.tokens for g in gens], dec.stats.wall, float(np.mean([g.stats.wall for g in gens])),
                    dec.peak_bytes, drafted)
        return run

    def hf(batch, seed):
        tokens, wall = hf_generate_batch(pair, batch, cfg.max_new_tokens, seed, stop)
        return tokens, wall, wall, None, None

    rule = SpeculativeSampling()
    alone = ours(lambda seed: BatchAutoregressive(pair, seed=seed))
    out = {"target": alone}
    out |= {f"SD K={k}": ours(lambda seed, k=k: BatchDecoder(pair, FixedK(k), rule, seed)) for k in cfg.fixed_k}
    if table is None:  # the dev pass: what the table and the single best K are chosen from
        return out
    head = cfg.head.format(suffix=pair.head_suffix())
    ctl = BatchCostAware(head)  # one instance: its head loads once, its cost tables are measured once
    ctl.bind(pair.identity("draft"), pair.config.sampling)
    typical = min(cfg.prompt_tokens, 64) + cfg.max_new_tokens // 2
    ctl.set_batch_costs(batch_costs(pair, table_sizes(max(sizes)), prefix=typical, max_len=ctl.max_len))
    for i, batch in enumerate(calibration):
        BatchDecoder(pair, ctl, rule, cfg.seed + 7 + 1000 * i).generate(batch, cfg.max_new_tokens, stop)
        print(f"batch-bench: the batch controller calibrates on dev batch {i + 1}/{len(calibration)} of {len(batch)} "
              "rows", flush=True)
    tree = cfg.tree_head.format(suffix=pair.head_suffix()) if cfg.tree_head else ""
    if tree and (Path(tree) / "config.json").exists():  # one shape: its head loads once, its costs are measured once
        shape = HeadTree(tree)
        shape.set_tree_costs(tree_costs(pair, calibration[0] if calibration else [[0]], nodes=shape.nodes,
                                        width=min(16, shape.nodes)))
        for i, batch in enumerate(calibration):  # where its trees pay, learnt on dev as the controller learns
            if len(batch) in cfg.tree_sizes:
                BatchDecoder(pair, shape, rule, cfg.seed + 7 + 1000 * i).generate(batch, cfg.max_new_tokens, stop)
        out[TREE] = ours(lambda seed: BatchDecoder(pair, shape, rule, seed))
    elif tree:
        print(f"batch-bench: no {tree}, so no head tree rows (README: rebuild the heads)", flush=True)
    out |= {AGAIN: alone,  # the same work once more on the same batch: the run's A/A check (noise_floor)
            "HF generate (padded)": hf,
            f"draft confidence {cfg.confidence}": ours(lambda seed: BatchDecoder(pair, DraftConfidence(cfg.confidence), rule, seed)),
            "batch-size table (dev)": ours(lambda seed: BatchDecoder(pair, BatchSizeK(table), rule, seed)),
            "batch controller": ours(lambda seed: BatchDecoder(pair, ctl, rule, seed))}
    return out


def measure(pair: Pair, methods: dict, groups: list[list[list[int]]], seed: int, label: str) -> dict[str, list]:
    """name -> per batch (tok/s, row latency s, peak KV bytes, drafted); methods interleaved, in a seeded random order
    per batch: a rotation kept each method behind the same neighbour, whose leftovers (the heap it grew, caches it
    warmed) then biased one method's every batch the same way."""
    names, res = list(methods), {m: [] for m in methods}
    for i, batch in enumerate(groups):
        t0 = time.perf_counter()
        for j in np.random.default_rng([seed, i]).permutation(len(names)):
            name = names[j]
            tokens, wall, latency, peak, drafted = methods[name](batch, seed + 1000 * i)
            res[name].append((sum(map(len, tokens)) / max(wall, 1e-9), latency, peak, drafted))
        print(f"batch-bench {label}: batch {i + 1}/{len(groups)} of {len(batch)} rows, {time.perf_counter() - t0:.1f} s",
              flush=True)
    return res


def summarise(res: dict[str, list], prompts: str, setting: str, b: int, notes: dict[str, str]) -> list[dict]:
    base = np.array([x[0] for x in res["target"]])
    rows = []
    for name, runs in res.items():
        ratios = np.array([x[0] for x in runs]) / base
        lo, hi = bootstrap_ci(ratios[:, None]) if len(ratios) > 1 else (float(ratios[0]),) * 2
        peaks = [x[2] for x in runs if x[2] is not None]
        drafted = [x[3] for x in runs if x[3] is not None]
        rows.append({"prompts": prompts, "setting": setting, "batch_size": b, "method": name,
                     "tokens_per_s": float(np.mean([x[0] for x in runs])), "speedup": float(ratios.mean()),
                     "lo": lo, "hi": hi, "row_latency_s": float(np.mean([x[1] for x in runs])),
                     "peak_kv_mib": max(peaks) / 2 ** 20 if peaks else None, "batches": len(runs),
                     "drafted": float(np.mean(drafted)) if drafted else None,
                     "note": notes.get(name, ""), "per_batch": [x[0] for x in runs]})
    return rows


# the config's fields that the dev pass (the table, the single K) does not read: changing them keeps its choice
TEST_ONLY = ("test", "repeats", "confidence", "head", "tree_head", "tree_sizes")


def cached(cache: Path, pair: Pair, cfg: BatchBenchConfig, b: int | None = None) -> Path:
    """Where one piece of the run is saved: the dev choice of the pair's setting (b None) or its test batches of b rows,
    named by a key of everything that made it (the config's fields that piece reads, the pair, the code and heads:
    code_fingerprint; a size's piece also its setting's dev choice, whose table it decodes), so a run with other
    fields, code or heads measures it again instead of reading a stale result."""
    setting = pair.config.sampling.name
    fields = {k: v for k, v in asdict(cfg).items() if k not in ("output", "settings", "repeats")}
    if b is None:
        stem, heads, fields = f"dev_{setting}", [], {k: v for k, v in fields.items() if k not in TEST_ONLY}
    else:
        stem = f"{setting}_b{b}"
        heads = [h.format(suffix=pair.head_suffix()) for h in (cfg.head, cfg.tree_head) if h]
        fields |= {"repeats": cfg.repeats.get(b, 2), "dev": cached(cache, pair, cfg).name}
    key = hashlib.sha256(json.dumps([stem, fields, pair.key(), code_fingerprint(heads)], sort_keys=True,
                                    default=str).encode()).hexdigest()[:16]
    return cache / f"{stem}-{key}.json"


def prune(cache: Path, keep: list[Path]) -> None:
    """The cache keeps this config's pieces alone: another config's (or code's) are stale, and a count of what the
    cache holds (train.gpucheck) must not read them as done."""
    stale = [f for f in cache.glob("*.json") if f not in keep]
    for f in stale:
        f.unlink()
    if stale:
        print(f"batch-bench: removed {len(stale)} saved pieces of another config, code or heads from {cache}", flush=True)


def choose_on_dev(pair: Pair, cfg: BatchBenchConfig, dev: list[list[int]], cache: Path, setting: str):
    """-> ({B: best K in 0..max, 0 being the target alone}, the single K best over all sizes), from one dev batch per
    size (four at B = 1), timed like the test batches."""
    path = cached(cache, pair, cfg)
    if path.exists():
        got = json.loads(path.read_text())
        return {int(b): k for b, k in got["table"].items()}, got["single"]
    speed: dict[int, dict[int, float]] = {}
    for b in cfg.batch_sizes:
        res = measure(pair, runners(pair, cfg, None, cfg.batch_sizes), dev_batches(dev, b),
                      cfg.seed + 7, f"dev {setting} B={b}")
        base = np.array([x[0] for x in res["target"]])
        speed[b] = {0: 1.0} | {k: float(np.mean(np.array([x[0] for x in res[f"SD K={k}"]]) / base)) for k in cfg.fixed_k}
    table = {b: max(s, key=s.get) for b, s in speed.items()}
    single = max(cfg.fixed_k, key=lambda k: float(np.mean([np.log(speed[b][k]) for b in speed])))
    save_json(path, {"table": table, "single": single, "speedups": speed})
    return table, single


def run(config: str, quick: bool = False, output: str | None = None) -> list[dict]:
    """Every setting and batch size of the config; prints the table and writes csv, markdown and the plot."""
    cfg = BatchBenchConfig(**read_yaml(Path(config)))
    if quick:  # minutes: two sizes, one batch each, three Ks
        cfg.batch_sizes, cfg.repeats, cfg.fixed_k = [1, 8], {1: 2, 8: 1}, [1, 2, 4]
    out_dir = Path(output or cfg.output)
    cache = out_dir / ("batch_cache_quick" if quick else "batch_cache")
    cache.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    made = provenance()  # read once, before any work: the code and machine this process runs, saved with each size
    base = load_pair(cfg.pair)
    t_start, rows = time.perf_counter(), []
    pairs = [base.with_sampling(**raw) for raw in cfg.settings]
    prune(cache, [cached(cache, p, cfg, b) for p in pairs for b in [None, *cfg.batch_sizes]])
    for pair in pairs:
        setting = pair.config.sampling.name

        test, dev = (encode(pair, spec, cfg.prompt_tokens) for spec in (cfg.test, cfg.dev))
        table, single = choose_on_dev(pair, cfg, dev, cache, setting)
        print(f"batch-bench {setting}: dev chose the table {table} and the single K = {single}", flush=True)
        methods = None  # built on first need: a finished run only rewrites its outputs
        for b in cfg.batch_sizes:
            path = cached(cache, pair, cfg, b)
            if not path.exists():
                if methods is None:  # the controller calibrates on the dev batches the table is chosen on
                    calibration = [g for size in cfg.batch_sizes for g in dev_batches(dev, size)]
                    methods = runners(pair, cfg, table, cfg.batch_sizes, calibration)
                groups = batches(test, b, cfg.repeats.get(b, 2))
                here = {k: v for k, v in methods.items() if k != TREE or b in cfg.tree_sizes}
                res = measure(pair, here, groups, cfg.seed, f"{setting} B={b}")
                notes = {f"SD K={single}": "the single K best over all sizes on dev",
                         "batch-size table (dev)": f"K = {BatchSizeK(table).begin(b)} at this size"}
                save_json(path, [r | made for r in summarise(res, f"{cfg.test['name']}/{cfg.test['split']}", setting,
                                                              b, notes)])
            rows += json.loads(path.read_text())
    write(rows, out_dir, quick)
    print(f"batch bench took {(time.perf_counter() - t_start) / 60:.1f} min; {out_dir}/batch.csv, batch.md, batch_speedup.png")
    return rows


def markdown(rows: list[dict]) -> str:
    """One table per setting: methods down, batch sizes across, speedup [interval]; tok/s and KV memory below."""
    lines = [f"Batch bench {made_by(rows)}.", ""]
    for setting in dict.fromkeys(r["setting"] for r in rows):
        sub = [r for r in rows if r["setting"] == setting]
        sizes = sorted({r["batch_size"] for r in sub})
        cell = {(r["method"], r["batch_size"]): r for r in sub}
        lines += [f"### {sub[0]['prompts']}, {setting}: speedup over our batched target alone [95% interval]", "",
                  "| method | " + " | ".join(f"B = {b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for m in dict.fromkeys(r["method"] for r in sub):
            cells = [cell.get((m, b)) for b in sizes]
            lines.append(f"| {m} | " + " | ".join("-" if c is None else f"{c['speedup']:.2f}x [{c['lo']:.2f}, {c['hi']:.2f}]"
                                                   for c in cells) + " |")
        target = [cell[("target", b)] for b in sizes]
        lines += ["", "target alone: " + ", ".join(f"B = {t['batch_size']} {t['tokens_per_s']:.0f} tok/s, row latency "
                                                   f"{t['row_latency_s']:.2f} s, peak KV {t['peak_kv_mib']:.0f} MiB"
                                                   for t in target)]
        for m in ("batch controller", "batch-size table (dev)", TREE):
            got = [cell[(m, b)] for b in sizes if cell.get((m, b), {}).get("drafted") is not None]
            if got:
                lines.append(f"\n{m}, candidates (a tree's nodes) drafted per row and round: " +
                             ", ".join(f"B = {c['batch_size']} {c['drafted']:.2f}" for c in got))
        notes = sorted({f"{r['method']} at B = {r['batch_size']}: {r['note']}" for r in sub if r["note"]})
        lines += [""] + [f"- {n}" for n in notes] + ["", paired(sub, sizes), "", noise_floor(sub, sizes), ""]
    return "\n".join(lines)


def noise_floor(sub: list[dict], sizes: list[int]) -> str:
    """The target alone decoded twice on every batch, in the shuffle with the other methods: the per-batch ratios
    of the second run over the first are what this run's machine noise does to one batch (an A/A check). (The dev
    table at K = 0 is no such check: once rows leave, a smaller size's K applies.)"""
    cell = {(r["method"], r["batch_size"]): r for r in sub}
    spans = []
    for b in sizes:
        again, base = cell.get((AGAIN, b)), cell.get(("target", b))
        if again and base:
            ratios = np.array(again["per_batch"]) / np.array(base["per_batch"])
            spans.append(f"B = {b} {ratios.mean():.2f}x ({ratios.min():.2f}-{ratios.max():.2f})")
    if not spans:
        return "Noise floor: this run decoded the target alone once per batch, so it has no A/A check."
    return ("Noise floor (the target alone again on the same batches over the target alone: mean, and the range over "
            "batches): " + ", ".join(spans) + ".")


def paired(sub: list[dict], sizes: list[int]) -> str:
    """The batch controller against the baselines a user would pick, per batch size: the ratio of tok/s on the same
    batches (mean over batches, 95% bootstrap interval)."""
    cell = {(r["method"], r["batch_size"]): r for r in sub}
    single = next((r["method"] for r in sub if r["note"].startswith("the single K")), None)
    lines = ["| batch controller over | " + " | ".join(f"B = {b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for label in ("best fixed K at this size (hindsight)", f"{single} (one K for all sizes, dev)",
                  "batch-size table (dev)", "draft confidence", "target"):
        cells = []
        for b in sizes:
            ctl = np.array(cell[("batch controller", b)]["per_batch"])
            if label.startswith("best"):
                name = max((m for m, bb in cell if bb == b and m.startswith("SD K=")), key=lambda m: cell[(m, b)]["speedup"])
            else:
                name = next(m for m, bb in cell if bb == b and (m == label if label == "target" else
                                                                 m.startswith(label.split(" (")[0])))
            ratios = ctl / np.array(cell[(name, b)]["per_batch"])
            lo, hi = bootstrap_ci(ratios[:, None]) if len(ratios) > 1 else (float(ratios[0]),) * 2
            tag = f" ({name.removeprefix('SD ')})" if label.startswith("best") else ""
            cells.append(f"{ratios.mean():.2f}x [{lo:.2f}, {hi:.2f}]{tag}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(rows: list[dict], out_dir: Path, quick: bool) -> None:
    stem = "batch_quick" if quick else "batch"
    with open(out_dir / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    md = markdown(rows)
    (out_dir / f"{stem}.md").write_text(md)
    print(md)
    plt = pyplot()
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.5), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        sub = [r for r in rows if r["setting"] == setting]
        for m in dict.fromkeys(r["method"] for r in sub if r["method"] not in ("target", AGAIN)):  # the line at 1
            pts = sorted((r["batch_size"], r["speedup"], r["lo"], r["hi"]) for r in sub if r["method"] == m)
            b, s, lo, hi = map(np.array, zip(*pts))
            bold = m in ("batch controller", "batch-size table (dev)")
            ax.errorbar(b, s, yerr=[s - lo, hi - s], marker="o", capsize=2, label=m, lw=2.2 if bold else 1,
                        alpha=1 if bold or not m.startswith("SD") else 0.5)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup over the batched target alone")
        ax.set_title(f"{sub[0]['prompts']}, {setting}")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out_dir / f"{stem}_speedup.png", dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m decode batch-bench")
    ap.add_argument("--config", default="configs/bench/batch.yaml", help="batch bench YAML")
    ap.add_argument("--quick", type=lambda v: v.lower() in ("1", "true", "yes"), default=False,
                    help="B = 1 and 8, one batch each, K = 1, 2, 4 (minutes)")
    ap.add_argument("--output", default=None, help="output folder (default: the YAML's)")
    args = ap.parse_args(argv)
    run(args.config, quick=args.quick, output=args.output)
