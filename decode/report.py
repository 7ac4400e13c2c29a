"""Tables and plots of bench rows (dicts as decode.bench makes them)."""

from __future__ import annotations

from pathlib import Path

COLUMNS = [("method", "method", "{}"), ("tokens_per_s", "tok/s", "{:.1f}"), ("speedup", "speedup", "{:.2f}x"),
           ("discard_rate", "discard rate", "{:.3f}"), ("verification_rate", "verification rate", "{:.3f}"),
           ("mean_accepted", "mean accepted", "{:.2f}"), ("target_calls_per_token", "target calls/token", "{:.3f}"),
           ("cost_model_tokens_per_s", "cost-model tok/s", "{:.1f}"), ("target_nll", "target NLL", "{:.3f}"),
           ("greedy_agreement", "greedy agreement", "{:.3f}"), ("parse_rate", "parses", "{:.2f}")]


def table(rows: list[dict]) -> str:
    """Markdown table; a dash where a method has no such figure."""
    head = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pareto_plot(rows: list[dict], path: Path, title: str) -> Path:
    """Discard rate vs verification rate per family (SpecDec++ Fig. 3): lower-left is better."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for fam in dict.fromkeys(r["family"] for r in rows if r.get("discard_rate") is not None and r["kind"] == "spec"):
        pts = sorted((r["verification_rate"], r["discard_rate"], r["method"]) for r in rows
                     if r["family"] == fam and r.get("discard_rate") is not None)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam)
    ax.set(xlabel="verification rate (target calls / token)", ylabel="discard rate (discarded / token)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def quality_plot(rows: list[dict], path: Path, title: str) -> Path:
    """Speedup vs target NLL of the output for lossy families and random allocation (FSD Fig. 2)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for fam in dict.fromkeys(r["family"] for r in rows):
        pts = sorted((r["speedup"], r["target_nll"]) for r in rows if r["family"] == fam and r.get("target_nll") is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam,
                    linestyle="--" if fam == "random" else "-")
    ax.set(xlabel="speedup over target alone", ylabel="target NLL of output (nats/token, lower is better)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
