"""The head-training LightningCLI: `cli(args)` builds (and by default runs) it.

The typed __init__ of train.data.LabelData and train.module.HeadModule is the schema; the head and
label family are chosen by class_path, and the feature size and label family are linked from the data
to the model. `python -m train` (train/__main__.py) and the sweep both run it.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.cli import LightningCLI

from data_gen.quiet import own_args, quiet_lightning
from train.data import LabelData
from train.module import HeadModule


class ResumeCheckpoint(Checkpoint):
    """The whole training state, written to <default_root_dir>/resume/last.ckpt when fit stops on an exception.

    On SIGTERM Lightning finishes the epoch in flight and raises SIGTERMException; this callback then saves
    the state, and `--ckpt_path last` continues from it to the same head. It does what Lightning's
    OnExceptionCheckpoint does but is not one: with one of those present Lightning reads ckpt_path=None as
    "last" and warns twice on every fresh run; here a run resumes only when asked (HeadCLI.fit).
    """

    def __init__(self):
        self.dirpath = "resume"

    @property
    def ckpt_path(self) -> str:
        return str(Path(self.dirpath) / "last.ckpt")

    def place(self, root: str) -> None:
        self.dirpath = str(Path(root) / "resume")

    def on_exception(self, trainer, *args, **kwargs) -> None:
        if trainer.global_step > 0:  # a run that failed before training (bad data, say) has nothing to resume
            trainer.save_checkpoint(self.ckpt_path, weights_only=False)  # the whole state: optimiser, loops, callbacks

    def teardown(self, trainer, *args, **kwargs) -> None:  # a finished run leaves nothing to resume
        trainer.strategy.remove_checkpoint(self.ckpt_path)


class HeadCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.link_arguments("data.feature_dim", "model.feature_dim", apply_on="instantiate")
        parser.link_arguments("data.label_family", "model.label", apply_on="instantiate")

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        for cb in trainer.callbacks:
            if isinstance(cb, ResumeCheckpoint):  # known only now: where this run keeps its state
                cb.place(trainer.default_root_dir)
        return trainer

    def fit(self, model, datamodule=None, ckpt_path=None, **kwargs) -> None:
        """Trainer.fit, with `--ckpt_path last` read as this run's resume checkpoint (from the start when there
        is none, so a script may always pass it)."""
        if ckpt_path == "last":
            resume = next(cb for cb in self.trainer.callbacks if isinstance(cb, ResumeCheckpoint)).ckpt_path
            ckpt_path = resume if Path(resume).exists() else None
            print(f"resuming from {resume}" if ckpt_path else f"no interrupted run to resume ({resume} does not "
                  "exist): training from the start", flush=True)
        self.trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, **kwargs)


def cli(args=None, run: bool = True) -> HeadCLI:
    quiet_lightning()
    with own_args(args):
        return HeadCLI(HeadModule, LabelData, args=args, run=run, save_config_kwargs={"overwrite": True},
                       trainer_defaults={"accelerator": "cpu", "devices": 1, "callbacks": [ResumeCheckpoint()]})
