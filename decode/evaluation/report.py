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


# decode modules (paths under decode/) that read, compare or present a split's saved rows and never make them: a
# change to them re-renders the tables from the saved splits instead of decoding every split again (two hours on a
# 2-core CPU), and leaves provenance()'s commit where it was. By path: decode/policies/__init__.py and
# decode/control/__init__.py say which class a config's class_path names, so they make rows
PRESENTS_ROWS = ("__init__.py", "__main__.py", "evaluation/__init__.py", "evaluation/compare.py", "evaluation/goals.py",
                 "evaluation/report.py", "evaluation/summary.py")


def provenance() -> dict[str, str]:
    """What made a result, saved with it: {"commit", "machine"}.

    The commit is the last one that changed what decides a result (decode/ less PRESENTS_ROWS, heads/, data_gen/,
    checkpoints/, configs/), so a bench resumed across sessions with only docs or presentation committed between
    names one commit; "+changes" where those folders differ from it, "+changes?" where git could not tell, "unknown"
    outside a git checkout. The machine is the CPU (the kernels torch picks, AMX or not, threads) and the GPU if
    any: trees pay or lose with the verify's cost curve, which is the hardware's. Never raises."""
    def git(*args: str) -> str | None:  # None where git is missing, fails or hangs
        try:
            return subprocess.run(["git", "--no-optional-locks", "-C", str(ROOT), *args], capture_output=True,
                                  text=True, timeout=10, check=True).stdout.strip()
        except Exception:  # noqa: BLE001 - provenance is a note on a result: it must never cost the result
            return None

    decides = ["decode", "heads", "data_gen", "checkpoints", "configs",
               *(f":(exclude)decode/{f}" for f in PRESENTS_ROWS)]
    commit = git("log", "-1", "--format=%h", "--abbrev=7", "--", *decides) or "unknown"
    if commit != "unknown":
        status = git("status", "--porcelain", "--", *decides)
        commit += "+changes?" if status is None else "+changes" if status else ""
    cpu, flags = "an unknown CPU", ""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), cpu)
        flags = next((ln for ln in info if ln.startswith("flags")), "")
    except OSError:
        pass
    machine = f"{cpu} ({torch.backends.cpu.get_cpu_capability()}, {'AMX' if 'amx_bf16' in flags else 'no AMX'}, " \
              f"{torch.get_num_threads()} threads)"
    try:
        if torch.cuda.is_available():
            machine += f" with {torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    except Exception:  # noqa: BLE001 - as above
        pass
    return {"commit": commit, "machine": machine}


def made_by(rows: list[dict]) -> str:
    """'decoded at <commit> on <machine>' from rows that carry provenance(), one clause per distinct pair, in the
    order the rows give them (a run resumed across machines names each; each row's pair is in the CSV)."""
    made = dict.fromkeys((r.get("commit") or "an unrecorded commit", r.get("machine") or "an unrecorded machine")
                         for r in rows)
    def words(commit: str) -> str:
        if commit == "unknown":
            return "an unknown commit"
        return commit.replace("+changes?", " (uncommitted changes unknown)").replace("+changes", " with uncommitted changes")

    return "decoded " + "; ".join(f"at {words(c)} on {m}" for c, m in made)


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
