"""The replay command: choose each stopping rule's threshold on dev prompts and report test, or check a bench run.

    python -m decode replay --config configs/bench/pycode.yaml --prompt_set pycode
    python -m decode replay --config configs/bench/pycode.yaml --cost "1.20,4.99,0.21"   # runH's cost line
    python -m decode replay --setting t0.7-p0.95 --heads checkpoints/specdecpp-prev-t0.7-p0.95   # an estimate
    python -m decode replay --check runs/bench-greedy     # a run of: python -m decode bench --settings greedy ...

Trajectories are recorded once per prompt set and split into runs/replay/ (keyed by the pair and the prompts);
decode.evaluation.replay does the replaying.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

from decode.evaluation.replay import (
    CostLine,
    Priced,
    Trajectory,
    evaluate,
    grid,
    load_trajectories,
    record,
    replay,
    save_trajectories,
    target_alone_calls,
)
from decode.pair import Pair


def recorded(pair: Pair, bench_cfg: dict, ps: dict, split: str, kmax: int, folder: Path) -> list[Trajectory]:
    """The trajectories of one prompt set's split, recorded once and kept in `folder` (keyed by pair and prompts)."""
    from decode.evaluation.bench import encode_prompts

    prompts = encode_prompts(pair, ps[split], bench_cfg["max_new_tokens"])
    # "plain": the file format (save_trajectories); caches of the pickled format before it get another key
    key = hashlib.sha256(json.dumps([pair.config.hash(), prompts, bench_cfg["max_new_tokens"], kmax, "plain"]).encode())
    path = folder / f"{ps['name']}-{split}-{key.hexdigest()[:12]}.pt"
    if path.exists():
        return load_trajectories(path)
    trajs = []
    for i, prompt in enumerate(prompts):
        trajs.append(record(pair, prompt, bench_cfg["max_new_tokens"], kmax))
        if (i + 1) % 10 == 0 or i + 1 == len(prompts):
            print(f"[replay] recorded {ps['name']}/{split}: {i + 1}/{len(prompts)} prompts", flush=True)
    save_trajectories(trajs, path)
    return trajs


def main(argv: list[str] | None = None) -> None:
    from decode.costs import CostModel
    from decode.evaluation.bench import load_config
    from decode.pair import Sampling, load_pair

    ap = argparse.ArgumentParser(prog="python -m decode replay", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/bench/pycode.yaml", help="bench YAML: pair, prompt sets, length")
    ap.add_argument("--prompt_set", default="pycode")
    ap.add_argument("--setting", default="greedy", help="a section of the bench config by its setting's name: "
                    "greedy (exact) or a sampling one such as t0.7-p0.95 (an estimate: decode.evaluation.replay)")
    ap.add_argument("--heads", nargs="*", default=None, help="heads trained for that setting (default: the "
                    "specdecpp and specdecpp-prev heads for it)")
    ap.add_argument("--cost", default="measure", help="'measure' (this machine) or 'draft_ms,target_ms,per_token_ms'")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--check", type=Path, default=None, metavar="RUN",
                    help="replay the greedy rows of a bench run folder with its own cost models and compare")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, False, None)
    if args.check is not None:
        return check(cfg, args.check)
    sets = {ps["name"]: ps for ps in cfg["prompt_sets"]}
    if args.prompt_set not in sets:
        ap.error(f"--prompt_set {args.prompt_set}: {args.config} has {', '.join(sets)}")
    settings = {Sampling(**sec.get("sampling", {})).name: Sampling(**sec.get("sampling", {})) for sec in cfg["sections"]}
    if args.setting not in settings:
        ap.error(f"--setting {args.setting}: {args.config} has sections {', '.join(settings)}")
    setting = settings[args.setting]
    pair = load_pair(cfg["pair"]).with_sampling(**vars(setting))
    heads = args.heads if args.heads is not None else \
        [f"checkpoints/{name}-{setting.name}" for name in ("specdecpp", "specdecpp-prev")]
    folder = Path("runs/replay")
    trajs = {s: recorded(pair, cfg, sets[args.prompt_set], s, 20, folder) for s in ("dev", "test")}
    if args.cost == "measure":
        prompts = [t.prompt for t in trajs["dev"]]
        cost = Priced(CostModel.measure(pair, prompts, n_max=21, repeats=5))
        print(f"cost model measured here: {cost.model.describe()}")
    else:
        cost = CostLine.parse(args.cost)
    families = grid(heads)
    dev, test = (evaluate(trajs[s], families, cost, pair.config.max_context) for s in ("dev", "test"))
    print(f"\n{args.prompt_set}, {setting.name}{'' if setting.temperature == 0 else ' (an estimate)'}, "
          f"{len(trajs['test'])} test prompts; value chosen on "
          f"{len(trajs['dev'])} dev prompts; predicted speedup over the target alone (cost: {cost.describe()})\n")
    print("| family | chosen on dev | dev speedup | test speedup | test tokens per target call | note |\n|---|---|---|---|---|---|")
    for family, rows in dev.items():
        best = max(range(len(rows)), key=lambda j: rows[j][1])
        edge = len(rows) > 1 and best in (0, len(rows) - 1)
        value, _, _ = rows[best]
        t = test[family][best]
        print(f"| {family} | {value or '-'} | {rows[best][1]:.3f} | {t[1]:.3f} | {t[2]:.2f} | "
              f"{'at the edge of the grid' if edge else ''} |")


def check(cfg: dict, run: Path) -> None:
    """For every section of a bench run: replay its rows that our engine decoded with a lossless rule, on the
    section's prompts, priced by the section's own cost model, and print replay's speedup beside the bench's
    cost-model speedup (both: the target alone's predicted time over the method's, summed over prompts). Greedy
    replay is exact (goal: within 5%); under sampling it is an estimate, and its own draws meet the bench's."""
    from decode.costs import CostModel
    from decode.evaluation.bench import build, expand, replayable
    from decode.pair import Sampling, load_pair

    base = load_pair(cfg["pair"])
    files = sorted(p for p in (run / "sections").glob("*.json") if "cost_model" in json.loads(p.read_text()))
    if not files:
        raise SystemExit(f"{run}/sections holds no section with a saved cost model: run the bench with this code")
    print("| split | method | bench cost-model speedup | replay | replay / bench |\n|---|---|---|---|---|")
    worst = {"greedy": 0.0, "sampling": 0.0}
    for sec in cfg["sections"]:
        setting = Sampling(**sec.get("sampling", {}))
        pair = base.with_sampling(**vars(setting))
        methods = {m.name: m for raw in sec["methods"] for m in expand(dict(raw), f"-{setting.name}")}
        for f in (f for f in files if f.stem.rsplit("-", 1)[0].split("_", 2)[2] == setting.name):
            saved = json.loads(f.read_text())
            cost, rows = Priced(CostModel(**saved["cost_model"])), saved["rows"]
            target = next(r for r in rows if r["kind"] == "target")
            trajs = [record(pair, p, cfg["max_new_tokens"]) for p in saved["prompts"]]
            alone = sum(cost.predict_s(target_alone_calls(t)) for t in trajs)
            for r in rows:
                m = methods.get(r["method"])
                if m is None or not replayable(m, setting, estimate=True):
                    continue
                policy = build(m.policy)
                if policy.needs_costs:
                    policy.set_costs(*cost.costs())
                ours = alone / sum(cost.predict_s(replay(t, policy, pair.config.max_context)[0]) for t in trajs)
                bench = r["cost_model_tokens_per_s"] / target["cost_model_tokens_per_s"]
                kind = "greedy" if setting.temperature == 0 else "sampling"
                worst[kind] = max(worst[kind], abs(ours / bench - 1))
                print(f"| {r['prompts']} {setting.name} | {r['method']} | {bench:.3f} | {ours:.3f} | {ours / bench:.3f} |",
                      flush=True)
    print(f"\ngreedy: largest difference {100 * worst['greedy']:.1f}% (goal: within 5%: "
          f"{'met' if worst['greedy'] <= 0.05 else 'NOT met'})")
    print(f"sampling (an estimate: one draw of the text against the bench's): largest difference "
          f"{100 * worst['sampling']:.1f}%")


if __name__ == "__main__":
    main()
