"""Tables and plots of bench rows (dicts as decode.evaluation.bench makes them), and the one way results reach disk
whole (write_atomic)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the project root: the README, and git for provenance()

COLUMNS = [("method", "method", "{}"), ("tokens_per_s", "tok/s", "{:.1f}"), ("speedup", "speedup", "{:.2f}x"),
           ("speedup_ci", "95% interval", "{}"),
           ("discard_rate", "discard rate", "{:.3f}"), ("verification_rate", "verification rate", "{:.3f}"),
           ("mean_accepted", "mean accepted", "{:.2f}"), ("nodes_per_round", "nodes/round", "{:.1f}"), ("target_calls_per_token", "target calls/token", "{:.3f}"),
           ("cost_model_tokens_per_s", "cost-model tok/s", "{:.1f}"), ("engine_efficiency", "measured/predicted speed", "{:.2f}"),
           ("target_nll", "target NLL", "{:.3f}"),
           ("greedy_agreement", "greedy agreement", "{:.3f}"), ("parse_rate", "parses", "{:.2f}")]


def write_atomic(path: Path, write) -> None:
    """write(tmp_path), then rename over path: a reader sees the old file or the new one, never half of one (a run
    killed while writing leaves nothing a resume would choke on)."""
    tmp = path.with_name(path.name + ".part")
    write(tmp)
    os.replace(tmp, path)


def provenance() -> dict[str, str]:
    """What made a result, saved with it: the commit and the machine.

    The commit is the last one that changed what decides a result (decode/, heads/, checkpoints/, configs/), so a
    bench resumed across sessions, with only docs committed between, names one commit; "+changes" where those
    folders differ from it, "unknown" outside a git checkout. The machine is the CPU, the kernels torch picks, AMX or
    not, and the threads (and the GPU if any): trees pay or lose with the verify's cost curve, which is the CPU's."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    decides = ("decode", "heads", "checkpoints", "configs")
    commit = git("log", "-1", "--format=%h", "--abbrev=7", "--", *decides) or "unknown"
    if commit != "unknown" and git("status", "--porcelain", "--", *decides):
        commit += "+changes"
    cpu, flags = "unknown CPU", ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next(ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name"))
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    except (OSError, StopIteration):
        pass
    machine = f"{cpu}, {torch.backends.cpu.get_cpu_capability()}, {'AMX' if 'amx_bf16' in flags else 'no AMX'}, " \
              f"{torch.get_num_threads()} threads"
    if torch.cuda.is_available():
        machine += f", {torch.cuda.get_device_name()}"
    return {"commit": commit, "machine": machine}


def made_by(rows: list[dict]) -> str:
    """'decoded at <commit> on <machine>' from rows that carry provenance(), one clause per distinct pair (a run
    resumed across machines names each)."""
    made = dict.fromkeys((r.get("commit") or "an unrecorded commit", r.get("machine") or "an unrecorded machine") for r in rows)
    return "decoded " + " and ".join(f"at {c} on {m}" for c, m in made)


def table(rows: list[dict]) -> str:
    """Markdown table; a dash where a method has no such figure."""
    head = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if r.get("speedup_lo") is not None:
            r = r | {"speedup_ci": f"[{r['speedup_lo']:.2f}, {r['speedup_hi']:.2f}]"}
        cells = [fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def slug(label: str) -> str:
    """A split's label ("pycode/test greedy") as a file-name part ("pycode_test_greedy")."""
    return label.replace("/", "_").replace(" ", "_")


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display on a cluster node), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _line_plot(series: dict[str, list[tuple]], path: Path, xlabel: str, ylabel: str,
               title: str, dashed: tuple[str, ...] = ()) -> Path:
    """One line per named series of (x, y) or (x, y, x_lo, x_hi) points, saved as a PNG."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, pts in series.items():
        pts = sorted(pts)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                        linestyle="--" if name in dashed else "-")
        if any(len(p) == 4 for p in pts):  # 95% intervals of the speedup as horizontal bars
            xerr = [[max(0.0, p[0] - p[2]) for p in pts], [max(0.0, p[3] - p[0]) for p in pts]]
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], xerr=xerr, fmt="none", ecolor=line.get_color(),
                        alpha=0.6, capsize=2)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def pareto_plot(rows: list[dict], path: Path, title: str) -> Path:
    """Discard rate vs verification rate per family (SpecDec++ Fig. 3): lower-left is better."""
    series: dict[str, list] = {}
    for r in rows:
        if r["kind"] == "spec" and r.get("discard_rate") is not None:
            series.setdefault(r["family"], []).append((r["verification_rate"], r["discard_rate"]))
    return _line_plot(series, path, "verification rate (target calls / token)", "discard rate (discarded / token)",
                      title)


def quality_plot(rows: list[dict], path: Path, title: str) -> Path:
    """Speedup (with its 95% interval) vs target NLL of the output per family and random allocation (FSD Fig. 2)."""
    series: dict[str, list] = {}
    for r in rows:
        if r.get("target_nll") is not None:
            ci = (r["speedup_lo"], r["speedup_hi"]) if r.get("speedup_lo") is not None else (r["speedup"],) * 2
            series.setdefault(r["family"], []).append((r["speedup"], r["target_nll"], *ci))
    return _line_plot(series, path, "speedup over target alone", "target NLL of output (nats/token, lower is better)",
                      title, dashed=("random",))


README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"


README = ROOT / "README.md"


def from_root(path: Path, root: Path) -> Path:
    """A run folder as the README names it: relative to the project root when inside it, else as given."""
    return path.relative_to(root) if path.is_relative_to(root) else path


def write_readme(markdown: str, readme: Path = README) -> None:
    """Replace the README's generated block (between the bench markers) with `markdown`."""
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise ValueError(f"{readme} has no {README_START} ... {README_END} block to fill")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_START}\n{markdown}\n{README_END}{tail}")
