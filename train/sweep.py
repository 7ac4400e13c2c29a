"""Grids of recipes: one exported head per cell and one table of train/eval binary KL and AUROC.

    python -m train sweep --config heads/pycode/specdecpp.yaml --prefix specdecpp \
        --set model.head.init_args.depth=1,3 --set data.label.init_args.w_rej=1,3,6,12
    python -m train sweep --config heads/pycode/sprinter.yaml --prefix sprinter --set data.label.init_args.gamma=1,1.2,1.5

Each cell is an ordinary `fit` of the recipe with the listed values replaced (dotted paths into
the YAML); heads are exported to checkpoints/<prefix>-<short values>/. Other arguments pass
through to fit (e.g. --trainer.max_epochs 1).
"""

from __future__ import annotations

import argparse
import copy
import itertools
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


def set_path(cfg: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def parse_set(items: list[str]) -> dict[str, list]:
    """['a.b=1,2'] -> {'a.b': [1, 2]} with YAML typing of each value."""
    out = {}
    for item in items:
        key, _, values = item.partition("=")
        if not values:
            raise ValueError(f"--set needs path=v1,v2,...; got {item!r}")
        out[key] = [yaml.safe_load(v) for v in values.split(",")]
    return out


def run_cell(base: str, values: dict, name: str, extra: list[str]) -> dict:
    from train.cli import cli

    def edit(cfg):
        for k, v in values.items():
            set_path(cfg, k, v)
        set_export_name(cfg, name)
        cfg["trainer"]["logger"] = False

    run = cli(["fit", "--config", str(config_with(base, edit)), *extra])
    export = next(cb for cb in run.trainer.callbacks if type(cb).__name__ == "ExportHead")
    data, head = run.datamodule, run.model.head.eval()
    with torch.no_grad():
        x, t, _ = data.tensors[data.train_split].tensors
        train_kl = float(binary_kl(t, head.prob(x)).mean())
    return {"head": name, **values, "train_binary_kl": train_kl, "eval_binary_kl": export.metrics["binary_kl"],
            "eval_auroc": export.metrics["auroc"], "draft_confidence_auroc": export.metrics["draft_confidence_auroc"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m train sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="heads/pycode/specdecpp.yaml")
    ap.add_argument("--prefix", default="sweep")
    ap.add_argument("--set", action="append", default=[], help="dotted.path=v1,v2 (repeatable)")
    args, extra = ap.parse_known_args(argv)
    grid = parse_set(args.set) or {"model.head.init_args.depth": [1, 3], "data.label.init_args.w_rej": [1, 3, 6, 12]}
    rows = []
    for combo in itertools.product(*grid.values()):
        values = dict(zip(grid, combo))
        name = args.prefix + "".join(f"-{k.split('.')[-1]}{v:g}" if isinstance(v, (int, float)) else f"-{v}"
                                     for k, v in values.items())
        rows.append(run_cell(args.config, values, name, extra))
    keys = [k.split(".")[-1] for k in grid]
    print("\n| head | " + " | ".join(keys) + " | train binary KL | eval binary KL | eval AUROC | draft-confidence AUROC |")
    print("|" + "---|" * (len(keys) + 5))
    for r in rows:
        vals = " | ".join(f"{r[k]}" for k in grid)
        print(f"| {r['head']} | {vals} | {r['train_binary_kl']:.4f} | {r['eval_binary_kl']:.4f} | "
              f"{r['eval_auroc']:.4f} | {r['draft_confidence_auroc']:.4f} |")


if __name__ == "__main__":
    main()
