"""ROC/AUC of exported heads on a label set, against the draft-confidence baseline.

    python -m train roc --heads checkpoints/sprinter-g1.0 checkpoints/sprinter-g1.2 --split dev

Each head is scored on its own label family's event (recorded in its config.json); the
training-free baseline is the draft's probability of its own token (the rule behind Hugging
Face's assistant_confidence_threshold), scored on the first head's event. Writes one PNG with
all curves and prints AUC and TPR/FPR at the chosen thresholds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import roc_auc_score, roc_curve

import train.labels as labels_mod
from data_gen.store import load_features, load_split
from heads import FeatureSpec, from_pretrained
from train.data import flatten, resolve


def family_from_meta(meta: dict) -> labels_mod.LabelFamily:
    """Rebuild the label family recorded in a head's config."""
    args = {k: v for k, v in meta.items() if k != "family"}
    return getattr(labels_mod, meta["family"])(**args)


def youden_threshold(prob: np.ndarray, event: np.ndarray) -> float:
    """Probability threshold that maximises TPR - FPR."""
    fpr, tpr, thr = roc_curve(event, prob)
    return float(np.clip(thr[int(np.argmax(tpr - fpr))], 0.0, 1.0))


def rates_at(prob: np.ndarray, event: np.ndarray, threshold: float) -> tuple[float, float]:
    """(TPR, FPR) of the rule `accept when prob >= threshold`."""
    pred = prob >= threshold
    pos, neg = event == 1, event == 0
    return float(pred[pos].mean()) if pos.any() else float("nan"), float(pred[neg].mean()) if neg.any() else float("nan")


def auroc(event: np.ndarray, score: np.ndarray) -> float:
    """AUROC of a score against 0/1 events; nan where the events are all of one kind (no curve exists)."""
    return float(roc_auc_score(event, score)) if 0 < event.mean() < 1 else float("nan")


def rank_rows(prob: np.ndarray, event: np.ndarray, conf: np.ndarray, rank: np.ndarray) -> list[dict]:
    """(N,) head probabilities, events, draft confidences and sibling ranks -> one dict per group of rows: the
    siblings of rank >= 1 together (the children only a tree drafts), then each rank; positions, positive rate,
    the head's AUROC and the draft confidence's on the same rows."""
    groups = [(">= 1", rank >= 1)] + [(str(j), rank == j) for j in range(int(rank.max()) + 1 if len(rank) else 0)]
    return [{"ranks": name, "positions": int(m.sum()), "positive_rate": float(event[m].mean()) if m.any() else float("nan"),
             "auroc": auroc(event[m], prob[m]) if m.any() else float("nan"),
             "draft_confidence_auroc": auroc(event[m], conf[m]) if m.any() else float("nan")} for name, m in groups]


def rank_lines(split: str, rows: list[dict]) -> list[str]:
    """The report's lines of rank_rows: siblings of rank >= 1, then one line per rank."""
    return [f"{split} siblings of rank {r['ranks']}: AUROC "
            f"{r['auroc']:.4f} (draft confidence {r['draft_confidence_auroc']:.4f}), positions {r['positions']}"
            for r in rows]


def plot_rocs(curves: list[tuple[str, np.ndarray, np.ndarray]], path: Path, title: str) -> Path:
    """curves of (label, prob, event) -> one PNG of ROC curves with AUCs in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for name, prob, event in curves:
        fpr, tpr, _ = roc_curve(event, prob)
        ax.plot(fpr, tpr, label=f"{name} (AUC {roc_auc_score(event, prob):.3f})",
                linestyle="--" if name.startswith("draft confidence") else "-")
    ax.plot([0, 1], [0, 1], color="grey", linewidth=0.5)
    ax.set(xlabel="false positive rate (rejected tokens accepted)", ylabel="true positive rate", title=title)
    ax.legend(fontsize=7, loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


@torch.no_grad()
def score_head(head_dir: str, labels: str | None, split: str) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """(name, head prob, event, draft confidence, sibling rank or None) over the positions the head was trained for
    (a head trained on siblings: its sibling rows)."""
    head, cfg = from_pretrained(head_dir)
    spec = FeatureSpec(**cfg["features"])
    labels = labels or cfg["labels"]  # by default the label set (and sampling setting) the head was trained on
    ds = load_split(resolve(labels), split)
    siblings = bool(cfg.get("siblings"))
    x, cols = flatten(ds, load_features(resolve(labels), split), spec, siblings, cfg["sampling"]["temperature"] == 0)
    event = family_from_meta(cfg["label"]).event(cols, seed=0).numpy()
    return Path(head_dir).name, head.prob(x).numpy(), event, cols["q_cand"].numpy(), \
        cols["rank"].numpy() if siblings else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m train roc", description=__doc__.splitlines()[0])
    ap.add_argument("--heads", nargs="+", required=True, help="exported head folders")
    ap.add_argument("--labels", default=None, help="label folder (default: the first head's own)")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--out", default="runs/roc.png")
    ap.add_argument("--thresholds", nargs="+", type=float, default=[0.3, 0.5, 0.7])
    args = ap.parse_args(argv)
    curves, rows = [], []
    for h in args.heads:
        name, prob, event, conf, rank = score_head(h, args.labels, args.split)
        curves.append((name, prob, event))
        rows.append((name, prob, event))
        rows.append((f"draft confidence vs {name} labels", conf, event))
        if rank is not None:  # a tree's head: the children only a tree drafts, alone
            m = rank >= 1
            rows.append((f"{name}, siblings of rank >= 1", prob[m], event[m]))
            rows.append((f"draft confidence vs {name} labels, siblings of rank >= 1", conf[m], event[m]))
    name0, _, event0, conf0, _ = score_head(args.heads[0], args.labels, args.split)
    curves.append((f"draft confidence q(x) ({name0} labels)", conf0, event0))
    out = plot_rocs(curves, resolve(args.out), f"ROC on {args.labels or from_pretrained(args.heads[0])[1]['labels']}:{args.split}")
    head = "| scorer | positions | positive rate | AUC | " + " | ".join(f"TPR/FPR @{t}" for t in args.thresholds) + " |"
    print(head + "\n|" + "---|" * (head.count("|") - 1))
    for name, prob, event in rows:
        cells = [name, str(len(event)), f"{event.mean():.3f}", f"{roc_auc_score(event, prob):.4f}"]
        cells += ["{:.3f}/{:.3f}".format(*rates_at(prob, event, t)) for t in args.thresholds]
        print("| " + " | ".join(cells) + " |")
    print(f"ROC figure: {out}")


if __name__ == "__main__":
    main()
