"""Train heads with LightningCLI, and analyse them.

    python -m train fit --config heads/specdecpp.yaml
    python -m train roc --heads checkpoints/smollm2/sprinter checkpoints/smollm2/specdecpp --split instruct_dev
    python -m train sweep --config heads/pycode/specdecpp.yaml     # SpecDec++'s depth x w_rej grid

The typed __init__ of train.data.LabelData and train.module.HeadModule is the schema; the head
and label family are chosen by class_path, and the feature size and label family are linked
from the data to the model.
"""

from __future__ import annotations

import sys

from lightning.pytorch.utilities.exceptions import SIGTERMException

from train.cli import cli


def fit(args=None) -> None:
    """The LightningCLI run; SIGTERM exits 143 after saving the state to resume from."""
    try:
        cli(args)
    except SIGTERMException:
        print("\nSIGTERM: training state saved under <trainer.default_root_dir>/resume/last.ckpt; continue with "
              "the same command plus --ckpt_path last", file=sys.stderr, flush=True)
        sys.exit(143)
    except (ValueError, FileNotFoundError) as e:  # a bad setting or path: one line, exit 2 as argparse does
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "roc":
        from train.roc import main as roc

        return roc(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "sweep":
        from train.sweep import main as sweep

        return sweep(sys.argv[2:])
    fit()


if __name__ == "__main__":
    main()
