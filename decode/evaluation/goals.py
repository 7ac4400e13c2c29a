"""Benchmark goals stated from the rows themselves: met, not met, or not separated by the intervals.

Goals are listed in the bench YAML, e.g.
    - {kind: beats, name: "SpecDec++ beats the best fixed-K SD", a: specdec++, b: fixed-K}
    - {kind: each, name: "our SD at least as fast as HF assisted at each K", a: "SD K={v}", b: "HF K={v}", values: [1, 2]}
    - {kind: gap, name: "share of the fixed-K-to-oracle gap SpecDec++ closes", a: specdec++, b: fixed-K, oracle: oracle}
`beats` compares the fastest row of family a with the fastest of family b ("fixed-K@dev": the K chosen on dev).
Rows that ran on the same prompts are compared paired: the 95% bootstrap interval of the geometric mean of the
per-prompt ratio a/b (prompt-to-prompt differences, which both rows share, cancel, so a few percent can be told
from noise).
A goal is met when that interval lies above 1, not met when below, and otherwise the rows are not
separated. Rows without per-prompt ratios (an older bench) fall back to comparing their two intervals.
"""

from __future__ import annotations

import numpy as np

from decode.evaluation.intervals import bootstrap_ci


def member(row: dict, family: str) -> bool:
    """Is the row in the family? "fixed-K@dev": the fixed-K row the bench chose on dev (bench.py's `select: mark`);
    rows read back from bench.csv hold the flag as the text "True"."""
    name, _, dev = family.partition("@")
    return row.get("family") == name and (not dev or row.get("dev_choice") in (True, "True"))


def _best(rows: list[dict], family: str) -> dict | None:
    pool = [r for r in rows if member(r, family) and r.get("speedup_lo") is not None]
    return max(pool, key=lambda r: r["speedup"]) if pool else None


def _fmt(r: dict) -> str:
    return f"{r['method']} {r['speedup']:.2f}x [{r['speedup_lo']:.2f}, {r['speedup_hi']:.2f}]"


def paired(a: dict, b: dict) -> tuple[float, float, float] | None:
    """(geometric mean, lo, hi) of the per-prompt ratio a/b, or None without matching per-prompt ratios.

    Geometric, because an arithmetic mean of ratios is not symmetric: with sampled outputs of different
    lengths a few prompts give large ratios, and both a/b and b/a could then average above 1.
    """
    ra, rb = np.asarray(a.get("ratios") or [], dtype=float), np.asarray(b.get("ratios") or [], dtype=float)
    if ra.size == 0 or ra.shape != rb.shape or (ra <= 0).any() or (rb <= 0).any():  # an empty output has no log
        return None
    log_rel = np.log(ra / rb)
    lo, hi = bootstrap_ci(log_rel)
    return float(np.exp(log_rel.mean())), float(np.exp(lo)), float(np.exp(hi))


def interval_order(a: dict, b: dict) -> int:
    """+1 if a's 95% speedup interval lies above b's, -1 if below, 0 if the two share a point."""
    a_lo, a_hi, b_lo, b_hi = (float(x) for x in (a["speedup_lo"], a["speedup_hi"], b["speedup_lo"], b["speedup_hi"]))
    return 1 if a_lo > b_hi else -1 if a_hi < b_lo else 0


def compare(a: dict, b: dict) -> str:
    """'met' if a is faster than b beyond the 95% interval, 'NOT met' if slower, else 'not separated'."""
    if (rel := paired(a, b)) is not None:
        mean, lo, hi = rel
        verdict = "met" if lo > 1 else "NOT met" if hi < 1 else "not separated"
        return f"{verdict} (paired a/b {mean:.3f} [{lo:.3f}, {hi:.3f}])"
    return {1: "met", -1: "NOT met", 0: "not separated (intervals overlap)"}[interval_order(a, b)]


def goal_line(rows: list[dict], goal: dict) -> str | None:
    """One line for one goal, or None when the section lacks the rows it needs."""
    name, kind = goal["name"], goal["kind"]
    if kind == "beats":
        a, b = _best(rows, goal["a"]), _best(rows, goal["b"])
        if a is None or b is None:
            return None
        return f"- **{name}** — {compare(a, b)}: {_fmt(a)} vs {_fmt(b)}"
    if kind == "each":
        by_name = {r["method"]: r for r in rows}
        pairs = [(by_name.get(goal["a"].format(v=v)), by_name.get(goal["b"].format(v=v))) for v in goal["values"]]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        if not pairs:
            return None
        verdicts = [compare(a, b) for a, b in pairs]
        met = sum(v.startswith("met") for v in verdicts)
        lost = sum(v.startswith("NOT met") for v in verdicts)
        overall = "met" if met == len(pairs) else "NOT met" if lost else "not separated at every value"
        detail = "; ".join(f"{a['method']} {a['speedup']:.2f}x vs {b['method']} {b['speedup']:.2f}x ({v})"
                           for (a, b), v in zip(pairs, verdicts))
        return f"- **{name}** — {overall} ({met} of {len(pairs)} faster beyond the interval): {detail}"
    if kind == "gap":
        a, b = _best(rows, goal["a"]), _best(rows, goal["b"])
        o = next((r for r in rows if member(r, goal["oracle"])), None)
        if a is None or b is None or o is None or o.get("cost_model_tokens_per_s") is None:
            return None
        span = o["cost_model_tokens_per_s"] - b["cost_model_tokens_per_s"]
        share = (a["cost_model_tokens_per_s"] - b["cost_model_tokens_per_s"]) / span if span > 0 else float("nan")
        return (f"- **{name}** (cost model) — {100 * share:.0f}%: {a['method']} {a['cost_model_tokens_per_s']:.1f}, "
                f"{b['method']} {b['cost_model_tokens_per_s']:.1f}, {o['method']} {o['cost_model_tokens_per_s']:.1f} tok/s")
    raise ValueError(f"unknown goal kind {kind!r}; choose beats, each or gap")


def goal_lines(rows: list[dict], goals: list[dict]) -> list[str]:
    return [line for g in goals if (line := goal_line(rows, g)) is not None]
