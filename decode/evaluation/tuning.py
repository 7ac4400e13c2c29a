"""The replay command: every policy on the same recorded draws, choices made on dev, paired intervals on test.

    python -m decode replay --setting t1                  # pycode and HumanEval test, under T = 1 (an estimate)
    python -m decode replay --setting t0.7-p0.95 --prompt_sets pycode
    python -m decode replay --setting greedy --cost "1.20,4.99,0.21"   # exact; a cost line instead of the bench's
    python -m decode replay --check runs/bench-greedy     # a run of: python -m decode bench --settings greedy ...

configs/replay/pycode.yaml names the bench config (pair, sampling sections, response length) and the prompts:
each prompt set's dev split chooses every family's value and the best fixed K, test reports them once, each
beside the best fixed K chosen on dev with a paired bootstrap interval over prompts, and beside the ceilings
(decode.evaluation.ceilings): the perfect head (under sampling) and the hindsight oracle. A learned policy's
"gap closed" is its share of the way from the best fixed K (dev) to the perfect head (sampling) or the oracle
(greedy). Both splits' rounds are priced by one cost model: the bench's own of that prompt set and setting (the
mean of its saved sections', docs/bench/sections), else one measured here. Trajectories are recorded once per prompt set, split and setting into runs/replay/ (keyed by
the pair and the prompts; resumable); decode.evaluation.replay does the replaying.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from decode.evaluation.ceilings import PerfectHead, hindsight_speedups
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
from decode.policies import SpecDecPP


@dataclass
class ReplayConfig:
    """configs/replay/*.yaml: the bench config whose pair, sections and response length replay uses, how many
    candidates to record after every prefix, and the prompt sets (each with a dev split that chooses and a test
    split that reports, as data_gen.prompts.PromptSet arguments)."""

    bench: str
    prompt_sets: list[dict]
    kmax: int = 12

    def __post_init__(self):
        if not 1 <= self.kmax <= 64:
            raise ValueError(f"kmax must be in 1..64, got {self.kmax}")
        for ps in self.prompt_sets:
            if not {"name", "dev", "test"} <= set(ps):
                raise ValueError(f"a replay prompt set needs name, dev and test, got {sorted(ps)}")


def recorded(pair: Pair, max_new: int, ps: dict, split: str, kmax: int, folder: Path, stop_at_eos: bool = True
             ) -> list[Trajectory]:
    """The trajectories of one prompt set's split, recorded once and kept in `folder` (keyed by pair and prompts).
    Resumable: every 20 prompts the ones recorded so far are saved beside it, and a rerun goes on from them.
    stop_at_eos=False records through the EOS, as the bench decodes a section its config's ignore_eos names."""
    from decode.evaluation.bench import encode_prompts

    prompts = encode_prompts(pair, ps[split], max_new)
    # "plain": the file format (save_trajectories); caches of the pickled format before it get another key
    key = hashlib.sha256(json.dumps([pair.key(), prompts, max_new, kmax, "plain"]
                                    + ([] if stop_at_eos else ["through EOS"])).encode())
    path = folder / f"{ps['name']}-{split}-{pair.config.sampling.name}-{key.hexdigest()[:12]}.pt"
    if path.exists():
        return load_trajectories(path)
    partial = path.with_name(path.name + ".partial")
    trajs = load_trajectories(partial) if partial.exists() else []
    if trajs:
        print(f"[replay] {ps['name']}/{split}: resuming after {len(trajs)} recorded prompts ({partial})", flush=True)
    t0 = time.perf_counter()
    for i in range(len(trajs), len(prompts)):
        trajs.append(record(pair, prompts[i], max_new, kmax, stop_at_eos=stop_at_eos))
        done = i + 1
        if done % 20 == 0 or done == len(prompts):
            save_trajectories(trajs, partial)
            print(f"[replay] recorded {ps['name']}/{split} {pair.config.sampling.name}: {done}/{len(prompts)} "
                  f"prompts ({time.perf_counter() - t0:.0f} s)", flush=True)
    save_trajectories(trajs, path)
    partial.unlink(missing_ok=True)
    return trajs


def main(argv: list[str] | None = None) -> None:
    import yaml

    from decode.evaluation.bench import load_config
    from decode.evaluation.bench_config import stops_at_eos
    from decode.pair import Sampling, load_pair

    ap = argparse.ArgumentParser(prog="python -m decode replay", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/replay/pycode.yaml", help="replay YAML (ReplayConfig), or a bench "
                    "YAML to replay the bench's own prompts")
    ap.add_argument("--prompt_sets", nargs="*", default=None, help="some of the config's prompt sets (default: all)")
    ap.add_argument("--setting", default="greedy", help="a section of the bench config by its setting's name: "
                    "greedy (exact) or a sampling one such as t1 or t0.7-p0.95 (an estimate: decode.evaluation.replay)")
    ap.add_argument("--heads", nargs="*", default=None, help="heads trained for that setting (default: the "
                    "specdecpp and specdecpp-prev heads for it)")
    ap.add_argument("--cost", default="bench", help="'bench' (the bench's saved cost model of each split, else "
                    "one measured here), 'measure', or 'draft_ms,target_ms,per_token_ms'")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--check", type=Path, default=None, metavar="RUN",
                    help="replay the rows of a bench run folder with its own cost models and compare")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    raw = yaml.safe_load(Path(args.config).read_text())
    # a bench config replays its own prompt sets (the bench chooses its thresholds so)
    rc = ReplayConfig(args.config, raw["prompt_sets"]) if "sections" in raw else ReplayConfig(**raw)
    cfg = load_config(rc.bench, False, None)
    if args.check is not None:
        return check(cfg, args.check)
    sets = {ps["name"]: ps for ps in rc.prompt_sets}
    if unknown := [n for n in args.prompt_sets or () if n not in sets]:
        ap.error(f"--prompt_sets {' '.join(unknown)}: {args.config} has {', '.join(sets)}")
    settings = {Sampling(**sec.get("sampling", {})).name: Sampling(**sec.get("sampling", {})) for sec in cfg["sections"]}
    if args.setting not in settings:
        ap.error(f"--setting {args.setting}: {rc.bench} has sections {', '.join(settings)}")
    base = load_pair(cfg["pair"])
    setting = settings[args.setting]
    pair = base.with_sampling(**vars(setting))
    # the bench config's own heads (its summary's), for this setting: a pair's heads live beside its name
    heads = args.heads if args.heads is not None else [f"{cfg[k]}{pair.head_suffix()}"
                                                       for k in ("summary_head", "summary_prev_head")]
    for head in heads:  # replay runs no decoder, so it checks what a decoder's prepare() would, before any recording
        try:
            SpecDecPP(head, 0.5).bind(pair.identity("draft"), pair.config.sampling)
        except (ValueError, FileNotFoundError) as e:
            where = "" if args.heads is not None else f" (set summary_head and summary_prev_head in {rc.bench}, or pass --heads)"
            ap.error(f"--heads {head}: {' '.join(str(e).split())}{where}")
    for name in args.prompt_sets or sets:
        trajs = {s: recorded(pair, cfg["max_new_tokens"], sets[name], s, rc.kmax, Path("runs/replay"),
                             stops_at_eos(pair, cfg["ignore_eos"])) for s in ("dev", "test")}
        cost = cost_of(args.cost, pair, cfg, name, trajs["dev"])
        report(name, setting, trajs, cost, heads, pair.config.max_context)


def cost_of(spec: str, pair: Pair, cfg: dict, name: str, trajs: list[Trajectory]):
    """The one cost model that prices a prompt set's rounds, dev and test alike (a machine's costs do not depend on
    which prompts are being chosen on): the mean of the bench's saved ones of its sections in this setting, else
    one measured here on the dev prompts, or a line."""
    from decode.costs.model import CostModel
    from decode.evaluation.bench import split_files

    if spec not in ("bench", "measure"):
        return CostLine.parse(spec)
    if spec == "bench":
        saved = [json.loads(f.read_text()).get("cost_model") for split in ("dev", "test")
                 for f in split_files(Path(cfg["output"]), f"{name}_{split}_{pair.config.sampling.name}")[-1:]]
        if saved and all(saved):
            cost = Priced(CostModel.mean([CostModel(**raw) for raw in saved]))
            print(f"[replay] {name}: the bench's cost model (the mean of its {len(saved)} sections' in "
                  f"{cfg['output']}/sections): {cost.describe()}", flush=True)
            return cost
    cost = Priced(CostModel.measure(pair, [t.prompt for t in trajs], n_max=21, repeats=5))
    print(f"[replay] {name}: cost model measured here: {cost.describe()}", flush=True)
    return cost


def report(name: str, setting, trajs: dict, cost, heads: list[str], max_context: int) -> None:
    """Print one prompt set's table: every family's dev choice on test against the best fixed K chosen on dev."""
    from decode.evaluation.intervals import paired_ratio_ci

    sampled = setting.temperature > 0
    families = grid(heads)
    if sampled:
        families["perfect head"] = [("", PerfectHead)]
    dev, test = (evaluate(trajs[s], families, cost, max_context) for s in ("dev", "test"))
    oracle = {s: hindsight_speedups(trajs[s], cost, max_context) for s in ("dev", "test")}
    pick = {f: max(range(len(rows)), key=lambda j: rows[j][1].mean()) for f, rows in dev.items()}
    k_dev = test["fixed-K"][pick["fixed-K"]]
    k_hind = max(test["fixed-K"], key=lambda r: r[1].mean())
    ceiling = test["perfect head"][0] if sampled else ("", *oracle["test"])
    gap = ceiling[1].mean() - k_dev[1].mean()
    print(f"\n{name}, {setting.name}{' (an estimate: decode.evaluation.replay)' if sampled else ''}: "
          f"{len(trajs['test'])} test prompts, values chosen on {len(trajs['dev'])} dev prompts; predicted speedup "
          f"over the target alone, and against the best fixed K chosen on dev ({k_dev[0]}) with a paired 95% "
          f"interval over prompts; gap: from that K to the {'perfect head' if sampled else 'hindsight oracle'}\n"
          f"(cost: {cost.describe()})\n")
    print("| policy | chosen on dev | dev speedup | test speedup | vs best K (dev) [95%] | gap closed | tokens per target call |\n"
          "|---|---|---|---|---|---|---|")
    def chosen(f):  # a choice at either end of a grid wider than one value may want a wider grid
        edge = len(dev[f]) > 1 and pick[f] in (0, len(dev[f]) - 1)
        return dev[f][pick[f]][0] + (" (grid edge)" if edge else "")

    rows = [(f, chosen(f), dev[f][pick[f]][1], *test[f][pick[f]][1:]) for f in dev]
    rows.insert(1, ("fixed-K in hindsight (test)", k_hind[0], None, *k_hind[1:]))
    rows.append(("hindsight oracle", "", oracle["dev"][0], *oracle["test"]))
    for family, value, d, t, per_call in rows:
        r, lo, hi = paired_ratio_ci(t, k_dev[1])
        ceiling_row = family == "hindsight oracle" and sampled  # the other ceiling, past the gap's end
        share = (t.mean() - k_dev[1].mean()) / gap if gap > 0 and family != "fixed-K" and not ceiling_row else None
        print(f"| {family} | {value or '-'} | {'-' if d is None else f'{d.mean():.3f}'} | {t.mean():.3f} | "
              f"{r:.3f} [{lo:.3f}, {hi:.3f}] | {'-' if share is None else f'{100 * share:.0f}%'} | {per_call:.2f} |",
              flush=True)
    if sampled:
        alpha_report(trajs, heads, max_context)


def alpha_report(trajs: dict[str, list[Trajectory]], heads: list[str], max_context: int) -> None:
    """Print how much of alpha each head and the draft's confidence know, on sampled dev and test trajectories."""
    from decode.evaluation.alpha import alpha_table

    sizes = ", ".join(f"{len(t)} {split}" for split, t in trajs.items())
    print(f"\nHow much of alpha = min(1, p/q) each predictor knows, on the candidates of fixed-K rounds over the "
          f"prompts ({sizes}; decode.evaluation.alpha)\n")
    print("| predictor | split | R^2 vs alpha | R^2 of a line | Brier vs alpha | AUROC vs the coin | mean | mean alpha |\n"
          "|---|---|---|---|---|---|---|---|")
    tables = {split: alpha_table(t, {Path(h).name: h for h in heads}, max_context) for split, t in trajs.items()}
    for pred in tables["test"]:
        for split, table in tables.items():
            m = table[pred]
            print(f"| {pred} | {split} | {m['r2']:.3f} | {m['r2_linear']:.3f} | {m['brier']:.4f} | {m['auroc']:.4f} | "
                  f"{m['mean']:.3f} | {m['alpha']:.3f} |", flush=True)


def check(cfg: dict, run: Path) -> None:
    """For every section of a bench run: replay its rows that our engine decoded with a lossless rule, on the
    section's prompts, priced by the section's own cost model, and print replay's speedup beside the bench's
    cost-model speedup (both: the target alone's predicted time over the method's, summed over prompts). Greedy
    replay is exact (goal: within 5%); under sampling it is an estimate, and its own draws meet the bench's."""
    from decode.costs.model import CostModel
    from decode.evaluation.bench import build, expand, replayable
    from decode.evaluation.bench_config import stops_at_eos
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
        methods = {m.name: m for raw in sec["methods"] for m in expand(dict(raw), pair.head_suffix())}
        for f in (f for f in files if f.stem.rsplit("-", 1)[0].split("_", 2)[2] == setting.name):
            saved = json.loads(f.read_text())
            cost, rows = Priced(CostModel(**saved["cost_model"])), saved["rows"]
            target = next(r for r in rows if r["kind"] == "target")
            trajs = [record(pair, p, cfg["max_new_tokens"], stop_at_eos=stops_at_eos(pair, cfg["ignore_eos"]))
                     for p in saved["prompts"]]
            alone = sum(cost.predict_s(target_alone_calls(t)) for t in trajs)
            for r in rows:
                m = methods.get(r["method"])
                if m is None or not replayable(m, setting, estimate=True):
                    continue
                policy = build(m.policy)
                if policy.needs_costs:
                    policy.set_costs(*cost.costs(), head_ms=cost.head_ms)
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
