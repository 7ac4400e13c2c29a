"""Label every draft token of a prompt set for SpecDec++, SPRINTER and FSD.

    python -m data_gen --config configs/data_gen/pycode.yaml
    python -m data_gen --config configs/data_gen/pycode.yaml --trainer.devices 2 --trainer.strategy ddp
    python -m data_gen --config configs/data_gen/pycode.yaml --settings '[{temperature: 0}]'

Each sampling setting of `settings` (default: the pair's own) is labelled into its own folder
<data.output>/<setting name> (greedy, t1, t0.7-p0.95, ...), the setting recorded in its metadata:
a head is trained for one setting and decodes only under it.

Runs as Lightning Trainer.predict (data_gen.module), writes Arrow shards (data_gen.store),
resumes where a killed run stopped, and closes with a summary per split.
"""

from __future__ import annotations

import shlex
import signal
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI

from data_gen.module import Labeller, PromptData, ShardWriter
from data_gen.quiet import own_args, quiet_lightning
from data_gen.store import done_ids, load_split, shard_dirs
from decode.allocator import steady_heap
from decode.pair import PairConfig, Sampling

JS_THRESHOLDS = (0.05, 0.1, 0.2, 0.3)
GAMMAS = (1.0, 1.2, 1.5)


class LabelCLI(LightningCLI):
    def __init__(self, *args, **kwargs):
        # Records are seeded per prompt; the global seed is fixed too (0), not drawn: Lightning warns when it draws one.
        super().__init__(*args, **({"seed_everything_default": 0} | kwargs))

    def add_arguments_to_parser(self, parser):
        parser.link_arguments("data.pair", "model.pair")
        parser.link_arguments("data.max_new_tokens", "model.max_new_tokens")
        parser.add_argument("--settings", type=list[Sampling] | None, default=None,
                            help="sampling settings to label, each into <data.output>/<name> (default: the pair's)")


def settings_of(cli) -> list[Sampling]:
    """The sampling settings a run labels: --settings, else the pair's own."""
    return cli.config.get("settings") or [PairConfig.from_yaml(cli.datamodule.pair).sampling]


def summarize(output: Path, splits: list[str]) -> list[str]:
    """Closing table: sequences, positions, mean alpha vs expected acceptance, label shares."""
    head = ("| split | sequences | positions | mean alpha | mean sum min(p,q) | "
            + " | ".join(f"q/p<={g}" for g in GAMMAS) + " | " + " | ".join(f"JS<={t}" for t in JS_THRESHOLDS) + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for split in splits:
        if not shard_dirs(output, split):
            continue
        ds = load_split(output, split).select_columns(["alpha", "expected_accept", "ratio_qp", "js"])
        col = {k: torch.tensor([v for row in ds[k] for v in row], dtype=torch.float64) for k in ds.column_names}
        n = len(col["alpha"])
        cells = [split, str(len(ds)), str(n), f"{col['alpha'].mean():.4f}", f"{col['expected_accept'].mean():.4f}"]
        cells += [f"{(col['ratio_qp'] <= g).double().mean():.3f}" for g in GAMMAS]
        cells += [f"{(col['js'] <= t).double().mean():.3f}" for t in JS_THRESHOLDS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summarize_siblings(output: Path, splits: list[str]) -> list[str]:
    """Closing table of a set with sibling labels (none without): per split and rank j, how often recursive rejection
    reaches j (the chance every earlier sibling is rejected, prod (1 - alpha_k); greedy: the earlier ones all missed),
    and the chance j is accepted once reached: Sequoia's positional acceptance v_j on these prefixes."""
    lines = []
    for split in splits:
        if not shard_dirs(output, split):
            continue
        ds = load_split(output, split)
        if "sib_alpha" not in ds.column_names:
            return []
        ds = ds.select_columns(["sib_alpha", "sib_q"])
        alpha, conf = (torch.tensor([v for row in ds[k] for v in row], dtype=torch.float64) for k in ds.column_names)
        reach = torch.cat([torch.ones_like(alpha[:, :1]), (1 - alpha).cumprod(1)[:, :-1]], 1)
        for j in range(alpha.shape[1]):
            w = reach[:, j]
            lines.append(f"| {split} | {j} | {w.sum():.1f} | {(w * alpha[:, j]).sum() / w.sum().clamp_min(1e-12):.4f} | "
                         f"{(w * conf[:, j]).sum() / w.sum().clamp_min(1e-12):.4f} |")
    head = "| split | sibling rank | positions reaching it | accepted once reached | its draft probability |"
    return [head, "|---|---|---|---|---|", *lines] if lines else []


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived: stop labelling now (BaseException, so nothing on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopOnSignal(Callback):
    """Turns SIGTERM/SIGINT into Interrupted during predict, on every rank.

    Installed at predict start, after Lightning's own SIGTERM handler (which only sets a flag that
    the predict loop never reads). Shards are written atomically, so stopping anywhere keeps every
    finished shard and drops the one in flight; a resumed run skips what was kept.
    """

    def on_predict_start(self, trainer, pl_module) -> None:
        def handler(signum, frame):
            launcher = trainer.strategy.launcher
            if launcher is not None and trainer.is_global_zero:
                launcher.kill(signum)  # DDP ranks started by this process stop the same way
            raise Interrupted(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)


class ProgressLine(Callback):
    """One plain line per `every` batches and at the end (rank 0): prompts labelled, rate and time left. Lightning's
    bar redraws itself in place, which a log file of a run under nohup shows as one unreadable line."""

    def __init__(self, every: int = 5):
        self.every = every

    def on_predict_start(self, trainer, pl_module) -> None:
        self.t0, self.done = time.perf_counter(), 0
        self.total = len(trainer.datamodule.items)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.done += len(batch) * trainer.world_size
        batches = trainer.num_predict_batches[dataloader_idx] if trainer.num_predict_batches else 0
        if trainer.is_global_zero and ((batch_idx + 1) % self.every == 0 or batch_idx + 1 == batches):
            done, rate = min(self.done, self.total), self.done / max(time.perf_counter() - self.t0, 1e-9)
            left = (self.total - done) / max(rate, 1e-9)
            print(f"[data_gen] {trainer.datamodule.output_dir.name}: {done}/{self.total} prompts labelled "
                  f"({100 * done / max(1, self.total):.0f}%), {rate:.2f} prompts/s, about {left / 60:.1f} min left",
                  flush=True)


def stop_message(cli, stop: Interrupted) -> str:
    """What was kept and how to resume, after an interruption."""
    data = cli.datamodule
    kept = len(done_ids(data.output_dir)) if data.output_dir.exists() else 0
    cmd = "python -m data_gen " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    return (f"\ninterrupted by {stop}: {kept} prompts are labelled in {data.output_dir} (every finished shard kept, "
            f"the one in flight dropped); the lock is released. Resume with:\n  {cmd}")


def main(args=None) -> None:
    steady_heap()  # freed vocabulary-sized tensors serve the next batch (decode.allocator)
    try:
        run(args)
    except Interrupted as stop:
        sys.exit(128 + stop.signum)
    except (ValueError, FileNotFoundError) as e:  # a bad setting or path: one line, exit 2 as argparse does
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


def run(args=None) -> None:
    quiet_lightning()
    with own_args(args):
        cli = LabelCLI(
            Labeller, PromptData, run=False, args=args, save_config_callback=None,
            trainer_defaults={"logger": False, "enable_checkpointing": False, "use_distributed_sampler": False,
                              "accelerator": "cpu", "devices": 1,
                              "callbacks": [ShardWriter(), StopOnSignal(), ProgressLine()], "enable_progress_bar": False},
        )
    base = cli.datamodule.output_dir
    for setting in settings_of(cli):
        setting = Sampling.of(vars(setting) if not isinstance(setting, dict) else setting)
        cli.model.sampling, cli.datamodule.output = setting, str(base / setting.name)
        try:
            cli.trainer.predict(cli.model, datamodule=cli.datamodule, return_predictions=False)
        except Interrupted as stop:
            lock = getattr(cli.datamodule, "_lock", None)
            if lock is not None:
                lock.close()  # released now, not at exit
            print(f"[rank {cli.trainer.global_rank}]" * (cli.trainer.world_size > 1) + stop_message(cli, stop),
                  flush=True)
            raise
        cli.trainer.strategy.barrier()
        report(cli)


def report(cli) -> None:
    """Closing summary of one setting's label folder (rank 0 only)."""
    if cli.trainer.is_global_zero:
        data = cli.datamodule
        c = data.counts
        print(f"\nlabel set: {data.output_dir} (sampling {cli.model.pair.config.sampling})")
        print(f"prompts {c['prompts']}: {c['empty_skipped']} empty skipped, {c['truncated']} truncated to their "
              f"last tokens, {c['already_done']} already labelled (resumed)")
        splits = sorted({i["split"] for i in data.items} | {p.name for p in data.output_dir.iterdir() if p.is_dir()})
        sib = summarize_siblings(data.output_dir, splits)
        for line in summarize(data.output_dir, splits) + ([""] + sib if sib else []):
            print(line)


if __name__ == "__main__":
    main()
