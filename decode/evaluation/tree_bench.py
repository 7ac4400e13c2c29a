"""python -m decode.evaluation.tree_bench --plan docs/bench/trees.json --settings greedy t1 [--sets pycode humaneval]
    python -m decode.evaluation.tree_bench --pair configs/pairs/smollm2.yaml --plan docs/bench/smollm2/trees.json \\
        --sets instruct humaneval --chain_head "checkpoints/smollm2/specdecpp-prev{suffix}" \\
        --tree_head "checkpoints/smollm2/specdecpp-tree{suffix}" --out docs/bench/smollm2/trees.md

Token trees against chains at batch 1 (the embedded pair by default): the target alone, fixed-K chains (K chosen on dev
prompts, and the best K on test in hindsight), the cost-aware chain (decode.policies.CostAwareStop on the setting's
prev head), the Sequoia tree of decode.evaluation.tree_plan's plan, EAGLE-2's confidence tree and the head tree
(decode.tree.HeadTree on the setting's sibling head), decoded one after another per test prompt in a seeded
shuffled order. A head the checkpoints lack leaves its row out, saying so. Under sampling every method decodes its
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
from decode.evaluation.report import made_by, provenance
from decode.evaluation.tree_plan import SETTINGS
from decode.pair import load_pair
from decode.policies import CostAwareStop, FixedK
from decode.rules.chain import GreedyMatch, SpeculativeSampling
from decode.tree.head import HeadTree
from decode.tree.shapes import ConfidenceTree, StaticTree

CHAINS = (1, 2, 3, 4, 6)
# each set's dev prompts (the chain's K is chosen there) and test prompts, as configs/bench/pycode.yaml and
# configs/bench/smollm2.yaml split them (instruct is the smollm2 pair's own prompt set, HumanEval posed as chat there)
SETS = {"pycode": ({"name": "pycode", "split": "dev", "seed": 1}, {"name": "pycode", "split": "test", "seed": 0}),
        "instruct": ({"name": "instruct", "split": "dev", "seed": 1}, {"name": "instruct", "split": "test", "seed": 0}),
        "humaneval": ({"name": "humaneval", "split": "test", "seed": 0},
                      {"name": "humaneval", "split": "test", "skip": 16, "seed": 0})}


def decoders(pair, paths, chain_head: str, tree_head: str) -> dict:
    """name -> decoder with generate(ids, n) -> Generation (decode.engine's, one sequence); the heads' folders as
    templates of the setting's suffix."""
    rule = GreedyMatch() if pair.config.sampling.temperature == 0 else SpeculativeSampling()
    out = {"target": Autoregressive(pair)} | {f"chain K={k}": SpeculativeDecoder(pair, FixedK(k), rule) for k in CHAINS}
    heads = {name: path.format(suffix=pair.head_suffix()) for name, path in
             (("chain cost-aware", chain_head), ("tree head", tree_head))}
    for name, path in heads.items():
        if not (Path(path) / "config.json").exists():
            print(f"no {path}: the row {name!r} is left out (README: rebuild the heads)", flush=True)
    if (Path(heads["chain cost-aware"]) / "config.json").exists():
        out["chain cost-aware"] = SpeculativeDecoder(pair, CostAwareStop(heads["chain cost-aware"]), rule)
    out["tree sequoia"] = SpeculativeDecoder(pair, StaticTree(paths), rule)
    out["tree confidence"] = SpeculativeDecoder(pair, ConfidenceTree(top_k=4, depth=6, nodes=16), rule)
    if (Path(heads["tree head"]) / "config.json").exists():
        out["tree head"] = SpeculativeDecoder(pair, HeadTree(heads["tree head"]), rule)
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
    ap.add_argument("--test", type=int, default=16, help="test prompts of each set")
    ap.add_argument("--sets", nargs="+", default=["pycode"], choices=list(SETS))
    ap.add_argument("--chain_head", default="checkpoints/specdecpp-prev{suffix}", help="the cost-aware chain's head")
    ap.add_argument("--tree_head", default="checkpoints/specdecpp-tree{suffix}", help="the head tree's sibling head")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/bench/trees.md")
    args = ap.parse_args(argv)
    made = provenance()  # read once, before any work: the code and machine this process runs
    plan, base, parts = json.loads(Path(args.plan).read_text()), load_pair(args.pair), []
    for name in args.settings:
        if name not in plan:
            raise SystemExit(f"{args.plan} has no tree for {name}: run python -m decode.evaluation.tree_plan --settings {name}")
    for set_name in args.sets:
        dev_raw, test_raw = SETS[set_name]
        dev = encode_prompts(base, dev_raw | {"limit": args.dev}, args.new)
        test = encode_prompts(base, test_raw | {"limit": args.test}, args.new)
        for name in args.settings:
            pair = base.with_sampling(**SETTINGS[name])
            if pair.config.sampling.temperature > 0:  # fixed lengths: every method decodes its budget through EOS
                pair = dataclasses.replace(pair, eos_ids=(-1,))
            decs = decoders(pair, [tuple(p) for p in plan[name]["paths"]], args.chain_head, args.tree_head)
            for d in decs.values():
                d.generate(dev[0], 8)  # warm-up: compiled kernels, first allocations, a head tree's cost tables
            chains = run({k: v for k, v in decs.items() if k.startswith("chain K")}, dev, args.new, args.seed)
            dev_k = max(CHAINS, key=lambda k: np.mean([r[0] for r in chains[f"chain K={k}"]]))
            text = f"## {set_name} {name} ({len(test)} {set_name} test prompts, {args.new} new tokens)\n\n" + \
                table(run(decs, test, args.new, args.seed), dev_k)
            print(text + "\n", flush=True)
            parts.append(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("# Token trees against chains at batch 1\n\nWritten by `python -m decode.evaluation."
                              f"tree_bench`, {made_by([made])}.\n\n" + "\n\n".join(parts) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
