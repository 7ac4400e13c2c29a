"""python -m decode.evaluation.tree_plan --pair configs/pairs/pycode.yaml --settings greedy t0.7-p0.95 t1
    python -m decode.evaluation.tree_plan --pair configs/pairs/smollm2.yaml --set instruct --out docs/bench/smollm2/trees.json

Sequoia's static tree for a pair on this machine: the positional acceptance vector of each sampling setting
(teacher-forced over the target's own text on dev prompts), the cost tables of a draft level by width and of a
verification by node count (decode.costs.model.CostModel, as the bench measures its steps), the tree that maximises tokens
per millisecond under both, and what decoding the dev prompts with that tree then measured beside the prediction.
The plan of the same pair in --out keeps the settings not planned now (each tree with the cost tables it was sized by).

v[j] is the chance that the draft's (j+1)-th choice at a position is the token the round emits there: under greedy,
that the target's argmax is the draft's (j+1)-th most likely token; under sampling, that recursive rejection over
children drawn from q without replacement accepts the (j+1)-th (decode.rules.tree.first_accepted, the rule decoding runs).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from decode.costs.model import CostModel, tree_costs
from decode.evaluation.report import write_atomic
from decode.pair import Pair, load_pair
from decode.rules.tree import first_accepted
from decode.sampling import transform
from decode.tree.round import without_replacement
from decode.tree.shapes import expected_tokens, sequoia_paths

SETTINGS = {"greedy": {"temperature": 0.0}, "t0.7-p0.95": {"temperature": 0.7, "top_p": 0.95},
            "t1": {"temperature": 1.0}}


@torch.no_grad()
def positional_vector(pair: Pair, prompts: list[list[int]], new: int = 48, ranks: int = 4, draws: int = 8,
                      seed: int = 0) -> list[float]:
    """(ranks,) v: the share of the target's own next tokens that the draft's j-th choice gives (see the module)."""
    from decode.batch import BatchAutoregressive

    s, hits, total = pair.config.sampling, np.zeros(ranks), 0
    gen = torch.Generator().manual_seed(seed)
    outs = BatchAutoregressive(pair, seed=seed).generate(prompts, new)
    for ids, out in zip(prompts, outs):
        seq = torch.tensor([ids + out.tokens], device=pair.input_device("target"))
        at = slice(len(ids) - 1, len(ids) - 1 + len(out.tokens))
        p = transform(pair.logits(pair.target(seq).logits[0, at]), s)
        raw = pair.logits(pair.draft(seq.to(pair.input_device("draft"))).logits[0, at])
        total += len(out.tokens)
        if s.temperature == 0:  # the target's argmax among the draft's logits (its one-hot q ranks nothing)
            rank = (raw > raw.gather(-1, p.argmax(-1, keepdim=True).to(raw.device))).sum(-1)
            hits += np.bincount(rank.clamp_max(ranks).cpu().numpy(), minlength=ranks + 1)[:ranks]
            continue
        q = transform(raw, s)
        for i in range(len(out.tokens)):
            for _ in range(draws):
                u = torch.rand(2 * ranks, generator=gen, dtype=torch.float64).tolist()
                kids = without_replacement(q[i][None], [ranks], u[:ranks])[0]
                j = first_accepted(p[i], q[i], kids, u[ranks:])
                if j is not None:
                    hits[j] += 1 / draws
    return (hits / max(1, total)).tolist()


def round_ms(costs: CostModel, paths: list[tuple[int, ...]]) -> float:
    """A static tree's round: the draft reads the root (with up to one unread token), then each level's nodes that
    have children in one forward, then the target scores the root and every node."""
    parents = {p[:-1] for p in paths}
    widths = [sum(1 for p in parents if len(p) == d) for d in range(1, 1 + max(map(len, paths)))]
    draft = costs.call_ms("draft", 2) + sum(costs.call_ms("draft", w) for w in widths if w)
    return draft + costs.call_ms("target", len(paths) + 1, switched=True)


def best_tree(v: list[float], costs: CostModel, most: int = 64, depth: int = 10) -> tuple[list[tuple[int, ...]], float, float]:
    """The Sequoia tree of at most `most` nodes and `depth` levels with the most tokens per ms -> (paths, tokens per
    round, ms per round) predicted."""
    best = None
    for d in range(1, depth + 1):
        for n in range(1, most + 1):
            paths = sequoia_paths(v, n, d)
            if len(paths) < n:
                break
            tokens, ms = expected_tokens(v, paths), round_ms(costs, paths)
            if best is None or tokens / ms > best[1] / best[2]:
                best = (paths, tokens, ms)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pair", default="configs/pairs/pycode.yaml")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--set", default="pycode", choices=["pycode", "instruct"], help="whose dev split is measured")
    ap.add_argument("--prompts", type=int, default=16, help="dev prompts measured")
    ap.add_argument("--new", type=int, default=48, help="tokens per prompt")
    ap.add_argument("--nodes", type=int, default=64, help="the most nodes a tree may verify")
    ap.add_argument("--repeats", type=int, default=3, help="timings per cost-table cell (medians)")
    ap.add_argument("--out", default="docs/bench/trees.json", help="where the vectors and trees are written")
    args = ap.parse_args(argv)
    from decode.batch import BatchDecoder
    from decode.evaluation.bench_config import encode_prompts
    from decode.rules.chain import GreedyMatch, SpeculativeSampling
    from decode.tree.shapes import StaticTree

    base = load_pair(args.pair)
    prompts = encode_prompts(base, {"name": args.set, "split": "dev", "limit": args.prompts, "seed": 0}, args.new)
    t0 = time.perf_counter()
    costs = tree_costs(base, prompts, nodes=args.nodes, width=min(16, args.nodes), repeats=args.repeats)
    print(f"costs ({time.perf_counter() - t0:.0f} s): draft level of 1/4/16 nodes "
          f"{costs.call_ms('draft', 1):.2f}/{costs.call_ms('draft', 4):.2f}/{costs.call_ms('draft', 16):.2f} ms; "
          f"verify of 1/9/17/33/65 tokens " + "/".join(f"{costs.call_ms('target', n, True):.1f}"
                                                       for n in (1, 9, 17, 33, 65) if n <= args.nodes + 1) + " ms", flush=True)
    # a plan of the same pair keeps its other settings' trees: one setting can be planned at a time
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {}
    plan = {"pair": base.config.name}
    if old.get("pair") == base.config.name:
        older = {"costs": old["costs"]} if "costs" in old else {}  # a plan written before each tree kept its tables
        plan |= {name: older | tree for name, tree in old.items() if isinstance(tree, dict) and name != "costs"}
    measured = {"draft": costs.step["draft"], "verify": costs.switched["target"]}
    print("| setting | v (ranks 1-4) | tree: nodes, depth, level widths | tokens/round predicted | measured "
          "| nodes/round | tok/s |\n|---|---|---|---|---|---|---|")
    for name in args.settings:
        pair = base.with_sampling(**SETTINGS[name])
        v = positional_vector(pair, prompts, args.new)
        paths, tokens, _ = best_tree(v, costs, most=args.nodes)
        rule = GreedyMatch() if pair.config.sampling.temperature == 0 else SpeculativeSampling()
        dec, n, rounds, nodes, wall = BatchDecoder(pair, StaticTree(paths), rule), 0, 0, 0, 0.0
        for ids in prompts:
            g = dec.generate([ids], args.new)[0]
            n, rounds, nodes, wall = n + len(g.tokens), rounds + dec.stats.rounds, nodes + dec.stats.drafted, \
                wall + dec.stats.wall
        widths = [sum(1 for p in paths if len(p) == d) for d in range(1, 1 + max(map(len, paths)))]
        print(f"| {name} | {' '.join(f'{x:.3f}' for x in v)} | {len(paths)}, {len(widths)}, "
              f"{'/'.join(map(str, widths))} | {tokens:.2f} | {n / rounds:.2f} | {nodes / rounds:.1f} | "
              f"{n / wall:.0f} |", flush=True)
        plan[name] = {"v": v, "paths": [list(p) for p in paths], "predicted": tokens, "measured": n / rounds,
                      "costs": measured}  # the tables this tree was sized by
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda tmp: tmp.write_text(json.dumps(plan, indent=1)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
