"""Every method on the same prompts in one process: a table, a CSV and plots.

    python -m decode bench --config configs/bench/pycode.yaml [--quick true]

Methods are listed in the YAML as a policy and a rule by class_path (with optional grids over
one init argument), plus the baselines: target alone, draft alone, Hugging Face assisted
generation at constant K and with its dynamic confidence threshold, and FSD's random
allocation (each prompt to the draft with share s, derived from the two baselines' runs).
"""

from __future__ import annotations

import csv
import importlib
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm import tqdm

from decode.engine import Autoregressive, Decoder, Stats
from decode.hf import hf_generate
from decode.pair import Pair, load_pair
from decode.quality import quality
from decode.report import pareto_plot, quality_plot, table

ROOT = Path(__file__).resolve().parents[1]


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
    family: str = ""  # for plots: fixed, specdecpp, fsd, sprinter, ...


def expand(raw: dict) -> list[Method]:
    """One YAML entry -> methods, one per value of its grid ({'policy.k': [1, 2]} style)."""
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


def run_method(pair: Pair, m: Method, prompts: list[list[int]], n: int, seed: int) -> tuple[Stats, list[list[int]]]:
    total, outs = Stats(), []
    for i, ids in enumerate(prompts):
        if m.kind == "hf":
            out, st = hf_generate(pair, ids, n, m.hf, seed + i)
        else:
            dec = Autoregressive(pair, m.kind, seed + i) if m.kind in ("target", "draft") else \
                Decoder(pair, build(m.policy), build(m.rule), seed=seed + i)
            g = dec.generate(ids, n)
            out, st = g.tokens, g.stats
        total.add(st)
        outs.append(out)
    return total, outs


def cost_fit(rows: list[dict]) -> tuple[float, float]:
    """Least-squares t_draft, t_target (s per forward call) from wall = draft_calls t_d + target_calls t_t."""
    a = np.array([[r["draft_calls"], r["target_calls"]] for r in rows if r["kind"] != "hf"], dtype=float)
    b = np.array([r["wall_s"] for r in rows if r["kind"] != "hf"])
    (t_d, t_t), *_ = np.linalg.lstsq(a, b, rcond=None)
    return float(t_d), float(t_t)


def run_section(pair: Pair, label: str, prompts: list[list[int]], methods: list[Method], n: int, seed: int,
                shares: list[float]) -> list[dict]:
    """All methods on one prompt set under one sampling setting -> rows (also printed)."""
    run_method(pair, Method("warm-up", "spec", {"class_path": "decode.policies.FixedK"},
                            {"class_path": "decode.rules.SpeculativeSampling"}), prompts[:1], 8, seed)
    rows = []
    for m in tqdm(methods, desc=f"bench {label}"):
        st, outs = run_method(pair, m, prompts, n, seed)
        rows.append({"prompts": label, "method": m.name, "kind": m.kind, "family": m.family or m.kind,
                     **st.summary(), **quality(pair, prompts, outs)})
    base = next(r for r in rows if r["kind"] == "target")
    t_d, t_t = cost_fit(rows)
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["target_calls_per_token"] = r["verification_rate"]
        if r["kind"] == "hf":  # Hugging Face does not report its calls: no figure rather than a wrong one
            for k in ("discard_rate", "verification_rate", "mean_accepted", "target_calls_per_token"):
                r[k] = None
        else:
            r["cost_model_tokens_per_s"] = r["new_tokens"] / max(1e-9, r["draft_calls"] * t_d + r["target_calls"] * t_t)
    rows += random_allocation(rows, shares)
    print(f"\n## {label}: {len(prompts)} prompts, {n} new tokens, t_draft {1e3 * t_d:.2f} ms, "
          f"t_target {1e3 * t_t:.2f} ms per call (linear fit)\n")
    print(table(rows), flush=True)
    return rows


README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"


def write_readme(markdown: str, readme: Path = ROOT / "README.md") -> None:
    """Replace the README's generated block (between the bench markers) with `markdown`."""
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise ValueError(f"{readme} has no {README_START} ... {README_END} block to fill")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_START}\n{markdown}\n{README_END}{tail}")


def run(config: str, quick: bool = False, readme: bool = False) -> list[dict]:
    cfg = yaml.safe_load((ROOT / config if not Path(config).is_absolute() else Path(config)).read_text())
    torch.set_num_threads(cfg.get("threads", 2))
    pair = load_pair(cfg["pair"])
    from data_gen.prompts import PromptSet

    out_dir = Path(cfg.get("output", "runs/bench"))
    out_dir = out_dir if out_dir.is_absolute() else ROOT / out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    n, seed, all_rows = cfg.get("max_new_tokens", 64), cfg.get("seed", 0), []
    sections = cfg.get("sections") or [{"name": "", "temperature": None, "methods": cfg["methods"]}]
    for ps_raw in cfg["prompt_sets"]:
        ps = PromptSet(**ps_raw | ({"limit": cfg.get("quick_prompts", 3)} if quick else {}))
        budget = pair.config.max_context - n
        prompts = [pair.tokenizer(t, add_special_tokens=False)["input_ids"][-budget:] for t in ps.load()["prompt"]]
        for sec in sections:
            methods = [m for raw in sec["methods"] for m in expand(dict(raw))]
            if quick:
                methods = [m for m in methods if m.kind in ("target", "draft") or m.name in cfg.get("quick_methods", [])]
            label = f"{ps.name}/{ps.split}" + (f" {sec['name']}" if sec["name"] else "")
            sec_pair = pair if sec.get("temperature") is None else pair.with_sampling(temperature=sec["temperature"])
            rows = run_section(sec_pair, label, prompts, methods, n, seed,
                               cfg.get("random_shares", [0.25, 0.5, 0.75]))
            stem = f"{ps.name}_{ps.split}" + (f"_{sec['name']}" if sec["name"] else "")
            pareto_plot(rows, out_dir / f"pareto_{stem}.png", label)
            quality_plot(rows, out_dir / f"speed_quality_{stem}.png", label)
            all_rows += rows
    with open(out_dir / "bench.csv", "w", newline="") as f:
        keys = list(dict.fromkeys(itertools.chain.from_iterable(r.keys() for r in all_rows)))
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(all_rows)
    stamp = time.strftime("%Y-%m-%d")
    md = [f"Generated by `python -m decode bench --config {config}{' --quick true' if quick else ''}` on {stamp}."]
    for label in dict.fromkeys(r["prompts"] for r in all_rows):
        md += [f"### {label}", table([r for r in all_rows if r["prompts"] == label])]
    (out_dir / "bench.md").write_text("\n\n".join(md) + "\n")
    if readme:
        write_readme("\n\n".join(md))
    print(f"\ntable (bench.md), CSV and plots in {out_dir}")
    return all_rows


def random_allocation(rows: list[dict], shares: list[float]) -> list[dict]:
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
                    "target_nll": s * d["target_nll"] + (1 - s) * t["target_nll"],
                    "greedy_agreement": s * d["greedy_agreement"] + (1 - s) * t["greedy_agreement"],
                    "parse_rate": s * d["parse_rate"] + (1 - s) * t["parse_rate"]})
    return out
