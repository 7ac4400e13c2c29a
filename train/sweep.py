"""SpecDec++'s grid: depth in {1, 3} x w_rej in {1, 3, 6, 12}, one exported head each, one table.

    python -m train sweep --config heads/specdecpp.yaml
    python -m train sweep --config heads/specdecpp.yaml --depths 1 3 --w-rej 1 6 --max-epochs 1

Each cell is an ordinary `fit` of the recipe with the two values replaced; heads are exported to
checkpoints/<prefix>-d<depth>-w<w_rej>/ and the table gives train and eval binary KL and AUROC.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
import yaml

from train.labels import binary_kl


def config_with(base: str | Path, edit) -> Path:
    """Copy of a recipe YAML after `edit(dict)` changed it, written to a temporary file."""
    cfg = copy.deepcopy(yaml.safe_load(Path(base).read_text()))
    edit(cfg)
    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    yaml.safe_dump(cfg, f)
    f.close()
    return Path(f.name)


def set_export_name(cfg: dict, name: str) -> None:
    for cb in cfg["trainer"]["callbacks"]:
        if cb["class_path"].endswith("ExportHead"):
            cb.setdefault("init_args", {})["name"] = name


def run_cell(base: str, depth: int, w_rej: float, prefix: str, extra: list[str]) -> dict:
    from train.__main__ import cli

    name = f"{prefix}-d{depth}-w{w_rej:g}"

    def edit(cfg):
        cfg["model"]["head"]["init_args"] = {"depth": depth}
        cfg["data"]["label"]["init_args"]["w_rej"] = w_rej
        set_export_name(cfg, name)
        cfg["trainer"]["logger"] = False

    path = config_with(base, edit)
    run = cli(["fit", "--config", str(path), *extra])
    export = next(cb for cb in run.trainer.callbacks if type(cb).__name__ == "ExportHead")
    data, head = run.datamodule, run.model.head.eval()
    with torch.no_grad():
        x, t, _ = data.tensors[data.train_split].tensors
        train_kl = float(binary_kl(t, head.prob(x)).mean())
    return {"head": name, "depth": depth, "w_rej": w_rej, "train_binary_kl": train_kl,
            "eval_binary_kl": export.metrics["binary_kl"], "eval_auroc": export.metrics["auroc"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m train sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="heads/specdecpp.yaml")
    ap.add_argument("--depths", nargs="+", type=int, default=[1, 3])
    ap.add_argument("--w-rej", nargs="+", type=float, default=[1, 3, 6, 12])
    ap.add_argument("--prefix", default="specdecpp")
    args, extra = ap.parse_known_args(argv)
    rows = [run_cell(args.config, d, w, args.prefix, extra) for d in args.depths for w in args.w_rej]
    print("\n| head | depth | w_rej | train binary KL | eval binary KL | eval AUROC |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['head']} | {r['depth']} | {r['w_rej']:g} | {r['train_binary_kl']:.4f} | "
              f"{r['eval_binary_kl']:.4f} | {r['eval_auroc']:.4f} |")


if __name__ == "__main__":
    main()
