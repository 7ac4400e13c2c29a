"""At the end of fit: restore the best head, measure it on the validation split, export it."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from sklearn.metrics import roc_auc_score

from heads.io import save_pretrained
from train.labels import binary_kl
from train.roc import plot_rocs, rank_lines, rank_rows, youden_threshold

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
            state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
            pl_module.load_state_dict(state)
        data = trainer.datamodule
        x, target, event = data.tensors[data.val_split].tensors
        head = pl_module.head.eval()
        logits = head(x)  # once: the raw probabilities, Platt's fit and the calibrated ones all read it
        prob = torch.sigmoid(logits)
        p, e = prob.numpy(), event.numpy()
        a, b = platt(logits, event)
        calibrated = torch.sigmoid(a * logits + b)
        metrics = {
            "split": data.val_split, "positions": len(e), "positive_rate": float(e.mean()),
            "auroc": float(roc_auc_score(e, p)) if 0 < e.mean() < 1 else float("nan"),
            "binary_kl": float(binary_kl(target, prob).mean()),
            "brier": float(((prob - event) ** 2).mean()),
            "draft_confidence_auroc": float(roc_auc_score(e, data.columns[data.val_split]["q_cand"].numpy())),
            "ece_raw": ece(prob, event), "ece": ece(calibrated, event),
            "draft_confidence_ece": ece(data.columns[data.val_split]["q_cand"], event),
            "epochs": trainer.current_epoch,
        }
        conf, rank = data.columns[data.val_split]["q_cand"].numpy(), data.columns[data.val_split].get("rank")
        by_rank = None if rank is None else rank_rows(p, e, conf, rank.numpy())
        if by_rank is not None:  # a tree's head: how it ranks the children a chain never drafts, by themselves
            metrics["by_rank"] = by_rank
        meta = data.meta() | {"metrics": metrics, "recommended_threshold": youden_threshold(p, e),
                              "calibration": {"a": a, "b": b, "fitted_on": data.val_split},
                              "train": dict(pl_module.hparams)}
        out = Path(self.directory)
        name = self.name + data.head_suffix
        out = (out if out.is_absolute() else ROOT / out) / name
        save_pretrained(head, out, meta)
        curves = [(name, p, e), ("draft confidence q(x)", conf, e)]
        if by_rank is not None and 0 < by_rank[0]["positive_rate"] < 1:  # a curve needs both outcomes
            m = rank.numpy() >= 1
            curves += [(f"{name}, siblings of rank >= 1", p[m], e[m]), ("draft confidence q(x), rank >= 1", conf[m], e[m])]
        plot_rocs(curves, out / "roc.png", f"{name} on {data.labels}:{data.val_split}")
        print(f"\nexported head -> {out}\n{data.val_split}: AUROC {metrics['auroc']:.4f} "
              f"(draft confidence {metrics['draft_confidence_auroc']:.4f}), binary KL {metrics['binary_kl']:.4f}, "
              f"Brier {metrics['brier']:.4f}, calibration error {metrics['ece_raw']:.4f} -> {metrics['ece']:.4f} "
              f"calibrated (draft confidence {metrics['draft_confidence_ece']:.4f}), positions {metrics['positions']}",
              flush=True)
        for line in rank_lines(data.val_split, by_rank or []):
            print(line, flush=True)
        self.exported = out
        self.metrics = metrics


def platt(logits: torch.Tensor, event: torch.Tensor, steps: int = 200) -> tuple[float, float]:
    """(N,) head logits, (N,) 0/1 events -> (a, b) so that sigmoid(a * logit + b) is calibrated: Platt scaling,
    BCE minimised by L-BFGS (two parameters; weighted BCE in training skews the raw probabilities)."""
    z, y = logits.detach().double(), event.detach().double()
    ab = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([ab], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(ab[0] * z + ab[1], y)
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return float(ab[0]), float(ab[1])


def ece(prob: torch.Tensor, event: torch.Tensor, bins: int = 15) -> float:
    """Expected calibration error: the mean |observed rate - mean probability| over equal-width bins, by count."""
    prob, event = prob.double().flatten(), event.double().flatten()
    idx = (prob * bins).long().clamp(0, bins - 1)
    total = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            total += float(m.sum()) * abs(float(event[m].mean()) - float(prob[m].mean()))
    return total / max(1, len(prob))
