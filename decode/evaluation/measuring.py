"""The bench's measuring loop and its dev choices: every method on the same prompts back to back, in an order rotated
per prompt (interleaved), their rows with paired speedups, intervals and cost-model figures (rows_of), and which value
of a grid goes on to the test prompts (choose on dev rows, choose_by_replay on replayed ones).
decode.evaluation.bench runs it split by split.
"""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from decode.costs.model import CostModel
from decode.engine import Autoregressive, SpeculativeDecoder, Stats
from decode.evaluation.bench_config import Method, build
from decode.evaluation.intervals import bootstrap_ci
from decode.evaluation.quality import quality
from decode.hf import head_assistant, hf_generate
from decode.pair import Pair, Sampling
from decode.streams import Streams


def generator_for(pair: Pair, m: Method, stop_at_eos: bool = True):
    """(ids, n, seed) -> (tokens, Stats) for one method, built once per section (heads load once).

    The decoder's generator is reseeded on every call, so every run starts alike. stop_at_eos=False: every method
    decodes all n tokens through its EOS (a section in the bench's ignore_eos).
    """
    if m.kind == "hf":
        assistant = head_assistant(pair, m.hf)
        return lambda ids, n, seed: hf_generate(pair, ids, n, m.hf, seed, assistant, stop_at_eos)
    if m.kind in ("target", "draft"):
        def alone(ids, n, seed):
            g = Autoregressive(pair, m.kind, seed).generate(ids, n, stop_at_eos=stop_at_eos)
            return g.tokens, g.stats

        return alone
    dec = SpeculativeDecoder(pair, build(m.policy), build(m.rule), seed=0)

    def run(ids, n, seed):
        dec.gen = Streams([seed], pair.device)  # the seed's stream, as a decoder made with it draws
        g = dec.generate(ids, n, stop_at_eos=stop_at_eos)
        return g.tokens, g.stats

    return run


def interleaved(pair: Pair, methods: list[Method], prompts: list[list[int]], n: int, seed: int, repeats: int,
                label: str, between=None, stop_at_eos: bool = True) -> dict[str, list[list[tuple[list[int], Stats]]]]:
    """name -> [prompt][repeat] -> (tokens, stats); methods back to back per prompt, order rotated.

    `between(done, total)` is called after each prompt (the cost model re-measures itself there).
    """
    out = {m.name: [[None] * repeats for _ in prompts] for m in methods}
    runners = {m.name: generator_for(pair, m, stop_at_eos) for m in methods}
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
            for k in ("discard_rate", "verification_rate", "mean_accepted", "nodes_per_round", "target_calls_per_token"):
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


def choose_by_replay(pair: Pair, methods: list[Method], prompts: list[list[int]], cfg: dict,
                     stop_at_eos: bool = True) -> tuple[list[Method], list[str], set[str]]:
    """Each replayable `select: dev` grid keeps the value with the best replayed speedup on the dev prompts, priced by
    a cost model measured now (under sampling replay's estimate: decode.evaluation.replay); every other method is
    kept (its grid, if any, still decodes dev). A `select: mark` grid keeps every value and its dev choice is
    returned too -> (methods, the lines saying what was chosen, the names of the marked choices). stop_at_eos=False
    replays recordings through the EOS, as the section's test split decodes them."""
    from decode.evaluation.replay import Priced, record, speedup

    grids: dict[str, list[Method]] = {}
    for m in methods:
        if m.select in ("dev", "mark") and replayable(m, pair.config.sampling, estimate=True):
            grids.setdefault(m.family, []).append(m)
    if not grids:
        return methods, [], set()
    n = cfg["max_new_tokens"]
    trajs = [record(pair, p, n, stop_at_eos=stop_at_eos) for p in prompts]
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
