"""The head-training LightningCLI: `cli(args)` builds (and by default runs) it.

The typed __init__ of train.data.LabelData and train.module.HeadModule is the schema; the head and
label family are chosen by class_path, and the feature size and label family are linked from the data
to the model. `python -m train` (train/__main__.py) and the sweep both run it.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.cli import LightningCLI

from train.data import LabelData
from train.module import HeadModule


class ResumeCheckpoint(OnExceptionCheckpoint):
    """Lightning's on-exception checkpoint, written to <default_root_dir>/resume/last.ckpt.

    On SIGTERM Lightning finishes the epoch in flight and raises SIGTERMException; this callback then
    saves the whole training state, and `--ckpt_path last` continues from it to the same head.
    """

    def __init__(self):
        super().__init__(dirpath="resume", filename="last")

    def place(self, root: str) -> None:
        self.dirpath = str(Path(root) / "resume")


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


def cli(args=None, run: bool = True) -> HeadCLI:
    return HeadCLI(HeadModule, LabelData, args=args, run=run, save_config_kwargs={"overwrite": True},
                   trainer_defaults={"accelerator": "cpu", "devices": 1, "callbacks": [ResumeCheckpoint()]})
