"""python -m decode.evaluation.tree_bench --plan docs/bench/trees.json --settings greedy t1 [--test 16 --dev 8]

Token trees against chains at batch 1 on the embedded pair: the target alone, fixed-K chains (K chosen on dev
prompts, and the best K on test in hindsight), the Sequoia tree of decode.evaluation.tree_plan's plan and EAGLE-2's confidence
tree, decoded one after another per test prompt in a seeded shuffled order. Under sampling every method decodes its
whole budget through EOS (fixed lengths, as the batch bench), so each prompt's tok/s ratio compares equal work.
Each method's speedup over the dev-chosen chain is the geometric mean of per-prompt ratios, with a 95% bootstrap
interval over prompts. Prints a markdown table per setting and writes them to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path

import numpy as np

from decode.engine import Autoregressive, SpeculativeDecoder
from decode.evaluation.bench_config import encode_prompts
from decode.evaluation.intervals import bootstrap_ci
from decode.evaluation.tree_plan import SETTINGS
from decode.pair import load_pair
from decode.policies import FixedK
from decode.rules import GreedyMatch, SpeculativeSampling
from decode.tree_shapes import ConfidenceTree, StaticTree

CHAINS = (1, 2, 3, 4, 6)


def decoders(pair, paths) -> dict:
    """name -> decoder with generate(ids, n, stop_at_eos) -> (tokens, stats) (decode.engine's, one sequence)."""
    rule = GreedyMatch() if pair.config.sampling.temperature == 0 else SpeculativeSampling()
    out = {"target": Autoregressive(pair)} | {f"chain K={k}": SpeculativeDecoder(pair, FixedK(k), rule) for k in CHAINS}
    out["tree sequoia"] = SpeculativeDecoder(pair, StaticTree(paths), rule)
    out["tree confidence"] = SpeculativeDecoder(pair, ConfidenceTree(top_k=4, depth=6, nodes=16), rule)
    return out


def run(decs: dict, prompts: list[list[int]], n: int, seed: int) -> dict[str, list[tuple[float, int, int, int]]]:
    """name -> per prompt (tok/s, tokens, rounds, nodes verified); methods in a seeded shuffled order per prompt."""
    order, res = random.Random(seed), {name: [] for name in decs}
    names = list(decs)
    for ids in prompts:
        order.shuffle(names)
        for name in names:
            g = decs[name].generate(ids, n)
            s = g.stats
            res[name].append((len(g.tokens) / max(s.wall, 1e-9), len(g.tokens), s.rounds, s.drafted))
    return res


def table(res: dict, dev_k: int) -> str:
    base = np.array([r[0] for r in res[f"chain K={dev_k}"]])
    best_k = max(CHAINS, key=lambda k: np.mean([r[0] for r in res[f"chain K={k}"]]))
    lines = [f"chain chosen on dev: K = {dev_k}; best on test in hindsight: K = {best_k}", "",
             "| method | tok/s | tokens/round | nodes/round | over the dev K (geo. mean) | 95% interval |",
             "|---|---|---|---|---|---|"]
    for name, rows in res.items():
        tps = np.array([r[0] for r in rows])
        logs = np.log(tps / base)
        lo, hi = bootstrap_ci(logs[:, None])
        rounds = sum(r[2] for r in rows)
        per = (f"{sum(r[1] for r in rows) / rounds:.2f} | {sum(r[3] for r in rows) / rounds:.1f}" if rounds
               else "1.00 | 0.0")
        lines.append(f"| {name} | {tps.mean():.1f} | {per} | {np.exp(logs.mean()):.3f}x | "
                     f"[{np.exp(lo):.3f}, {np.exp(hi):.3f}] |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("--pair", default="configs/pairs/pycode.yaml")
    ap.add_argument("--plan", default="docs/bench/trees.json", help="python -m decode.evaluation.tree_plan's output")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--dev", type=int, default=8, help="dev prompts the chain's K is chosen on")
    ap.add_argument("--test", type=int, default=16, help="pycode test prompts")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/bench/trees.md")
    args = ap.parse_args(argv)
    plan, base, parts = json.loads(Path(args.plan).read_text()), load_pair(args.pair), []
    dev = encode_prompts(base, {"name": "pycode", "split": "dev", "limit": args.dev, "seed": 1}, args.new)
    test = encode_prompts(base, {"name": "pycode", "split": "test", "limit": args.test, "seed": 0}, args.new)
    for name in args.settings:
        if name not in plan:
            raise SystemExit(f"{args.plan} has no tree for {name}: run python -m decode.evaluation.tree_plan --settings {name}")
        pair = base.with_sampling(**SETTINGS[name])
        if pair.config.sampling.temperature > 0:  # fixed lengths: every method decodes its budget through EOS
            pair = dataclasses.replace(pair, eos_ids=(-1,))
        decs = decoders(pair, [tuple(p) for p in plan[name]["paths"]])
        for d in decs.values():
            d.generate(dev[0], 8)  # warm-up: compiled kernels, first allocations
        chains = run({k: v for k, v in decs.items() if k.startswith("chain")}, dev, args.new, args.seed)
        dev_k = max(CHAINS, key=lambda k: np.mean([r[0] for r in chains[f"chain K={k}"]]))
        text = f"## {name} ({len(test)} pycode test prompts, {args.new} new tokens)\n\n" + \
            table(run(decs, test, args.new, args.seed), dev_k)
        print(text + "\n", flush=True)
        parts.append(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("# Token trees against chains at batch 1\n\nWritten by `python -m "
                              "decode.evaluation.tree_bench`.\n\n" + "\n\n".join(parts) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
