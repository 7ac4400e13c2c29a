"""LightningModule that trains one head with weighted BCE and reports ROC/AUC, binary KL, calibration."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision, BinaryCalibrationError

from heads.modules import AcceptanceHead, Head
from train.labels import LabelFamily, SoftAcceptance, binary_kl, weighted_bce


class HeadModule(L.LightningModule):
    """Trains `head(feature_dim)`; feature_dim is linked from the data module, the label family too."""

    def __init__(self, head: Callable[[int], Head] = AcceptanceHead, feature_dim: int = 128,
                 label: LabelFamily | None = None, lr: float = 1e-3, weight_decay: float = 0.0):
        super().__init__()
        if lr <= 0 or weight_decay < 0:
            raise ValueError(f"--model.lr must be > 0 and --model.weight_decay >= 0, got {lr} and {weight_decay}")
        self.save_hyperparameters(ignore=["head", "label"])
        self.head = head(feature_dim)
        self.label = label or SoftAcceptance()
        self.auroc, self.ap = BinaryAUROC(), BinaryAveragePrecision()
        self.ece = BinaryCalibrationError(n_bins=15)
        self._val: list[tuple[torch.Tensor, ...]] = []

    def on_fit_start(self) -> None:
        # Standardise features with training statistics (stored in the head, so decode does the same).
        x = self.trainer.datamodule.tensors[self.trainer.datamodule.train_split].tensors[0]
        if hasattr(self.head, "set_normalizer"):
            self.head.set_normalizer(*moments(x))

    def training_step(self, batch, batch_idx):
        x, target, _ = batch
        loss = weighted_bce(self.head(x), target, self.label.w_pos, self.label.w_neg)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, target, event = batch
        logits = self.head(x)
        prob = torch.sigmoid(logits)
        self.log("val/loss", weighted_bce(logits, target, self.label.w_pos, self.label.w_neg))
        self.auroc.update(prob, event.long())
        self.ap.update(prob, event.long())
        self.ece.update(prob, event.long())
        self._val.append((prob.detach(), target, event))

    def on_validation_epoch_end(self) -> None:
        prob, target, event = (torch.cat(t) for t in zip(*self._val))
        self._val.clear()
        self.log_dict({
            "val/auroc": self.auroc.compute(), "val/ap": self.ap.compute(), "val/ece": self.ece.compute(),
            "val/binary_kl": binary_kl(target, prob).mean().float(), "val/brier": ((prob - event) ** 2).mean(),
            "val/pos_rate": event.mean(),
        }, prog_bar=True)
        for m in (self.auroc, self.ap, self.ece):
            m.reset()
        self.last_val = (prob, target, event)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, self.trainer.estimated_stepping_batches))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def moments(x: torch.Tensor, chunk: int = 1 << 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, D) features in any float dtype -> (D,) float32 mean and (unbiased) std, in float64 sums over chunks
    of rows, so half-precision features are never copied whole to float32."""
    total, sq = torch.zeros(x.shape[1], dtype=torch.float64), torch.zeros(x.shape[1], dtype=torch.float64)
    for part in x.split(chunk):
        part = part.double()
        total += part.sum(0)
        sq += (part * part).sum(0)
    n = x.shape[0]
    mean = total / n
    var = (sq - n * mean * mean) / max(1, n - 1)
    return mean.float(), var.clamp_min(0).sqrt().float()
