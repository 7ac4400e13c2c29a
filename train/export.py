"""At the end of fit: restore the best head, measure it on the validation split, export it."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from sklearn.metrics import roc_auc_score

from heads.io import save_pretrained
from train.labels import binary_kl
from train.roc import plot_rocs, youden_threshold

ROOT = Path(__file__).resolve().parents[1]


class ExportHead(Callback):
    """Writes checkpoints/<name>/ (model.safetensors, config.json, roc.png) and prints the path.

    A head trained for another sampling setting than the pair's own is exported as <name>-<setting>
    (checkpoints/specdecpp-greedy), so heads of different settings never overwrite each other.
    """

    def __init__(self, name: str = "specdecpp", directory: str = "checkpoints"):
        self.name, self.directory = name, directory

    @torch.no_grad()
    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        ckpt = getattr(trainer.checkpoint_callback, "best_model_path", "")
        if ckpt:
            state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
            pl_module.load_state_dict(state)
        data = trainer.datamodule
        x, target, event = data.tensors[data.val_split].tensors
        head = pl_module.head.eval()
        prob = head.prob(x)
        p, e = prob.numpy(), event.numpy()
        metrics = {
            "split": data.val_split, "positions": len(e), "positive_rate": float(e.mean()),
            "auroc": float(roc_auc_score(e, p)) if 0 < e.mean() < 1 else float("nan"),
            "binary_kl": float(binary_kl(target, prob).mean()),
            "brier": float(((prob - event) ** 2).mean()),
            "draft_confidence_auroc": float(roc_auc_score(e, data.columns[data.val_split]["q_cand"].numpy())),
            "epochs": trainer.current_epoch,
        }
        meta = data.meta() | {"metrics": metrics, "recommended_threshold": youden_threshold(p, e),
                              "train": dict(pl_module.hparams)}
        out = Path(self.directory)
        name = self.name + data.head_suffix
        out = (out if out.is_absolute() else ROOT / out) / name
        save_pretrained(head, out, meta)
        conf = data.columns[data.val_split]["q_cand"].numpy()
        plot_rocs([(name, p, e), ("draft confidence q(x)", conf, e)], out / "roc.png",
                  f"{name} on {data.labels}:{data.val_split}")
        print(f"\nexported head -> {out}\n{data.val_split}: AUROC {metrics['auroc']:.4f} "
              f"(draft confidence {metrics['draft_confidence_auroc']:.4f}), binary KL {metrics['binary_kl']:.4f}, "
              f"Brier {metrics['brier']:.4f}, positions {metrics['positions']}", flush=True)
        self.exported = out
        self.metrics = metrics
