"""Train heads with LightningCLI, and analyse them.

    python -m train fit --config heads/specdecpp.yaml
    python -m train roc --heads checkpoints/sprinter checkpoints/specdecpp --split dev
    python -m train sweep --config heads/specdecpp.yaml     # SpecDec++'s depth x w_rej grid

The typed __init__ of train.data.LabelData and train.module.HeadModule is the schema; the head
and label family are chosen by class_path, and the feature size and label family are linked
from the data to the model.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

from train.data import LabelData
from train.module import HeadModule


class HeadCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.link_arguments("data.feature_dim", "model.feature_dim", apply_on="instantiate")
        parser.link_arguments("data.label_family", "model.label", apply_on="instantiate")


def cli(args=None, run: bool = True) -> HeadCLI:
    return HeadCLI(HeadModule, LabelData, args=args, run=run, save_config_kwargs={"overwrite": True},
                   trainer_defaults={"accelerator": "cpu", "devices": 1})


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "roc":
        from train.roc import main as roc

        return roc(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "sweep":
        from train.sweep import main as sweep

        return sweep(sys.argv[2:])
    cli()


if __name__ == "__main__":
    main()
