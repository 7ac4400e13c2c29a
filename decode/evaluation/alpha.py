"""How much of alpha each predictor knows: its probabilities against the true acceptance probabilities of the
candidates a recording holds (decode.evaluation.replay, sampling), beside the draft's own confidence.

    rows = alpha_table(trajs, {"specdecpp-prev": "checkpoints/specdecpp-prev"})   # what replay --setting t1 prints

Every predictor meets the candidates a fixed-K decoder of the recording's length would draft, in order, with the
accepted run a head counts (HeadPolicy.verified), so a head reads exactly what it reads while decoding. Scores:
- R^2 against alpha = min(1, p/q): 1 - the predictor's squared error over alpha's variance (the probabilities as
  given, no refit: a stopping rule multiplies them as they are); 0 is a constant at alpha's mean. Beside it the
  R^2 of the best line through them (squared correlation): what a recalibration could make of them.
- Brier against alpha; AUROC against the coin that decides each candidate (uniform < alpha), the event the
  training labels hold; mean prediction beside mean alpha (calibration in the large).
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import roc_auc_score

from decode.evaluation.replay import Trajectory, replay
from decode.policies import FixedK, HeadPolicy, SpecDecPP


class _Spy(FixedK):
    """Drafts the recording's full length and writes down what a head (or the draft's confidence) says of each."""

    def __init__(self, k: int, head: HeadPolicy | None):
        super().__init__(k)
        self.head, self.seen = head, []

    def start(self):
        if self.head is not None:
            self.head.start()

    def verified(self, accepted, drafted):
        if self.head is not None:
            self.head.verified(accepted, drafted)

    def stop(self, step):
        said = step.confidence if self.head is None else self.head.prob(step)
        self.seen.append((said, step.alpha, step.uniform < step.alpha))
        return super().stop(step)


def scores(said: np.ndarray, alpha: np.ndarray, coin: np.ndarray) -> dict[str, float]:
    """(N,) predictions, true alphas and coin outcomes -> R^2, Brier, AUROC and the two means."""
    sse, sst = float(((said - alpha) ** 2).sum()), float(((alpha - alpha.mean()) ** 2).sum())
    linear = float(np.corrcoef(said, alpha)[0, 1] ** 2) if said.std() > 0 else 0.0
    return {"r2": 1 - sse / sst, "r2_linear": linear, "brier": sse / len(alpha),
            "auroc": float(roc_auc_score(coin, said)) if 0 < coin.mean() < 1 else float("nan"),
            "mean": float(said.mean()), "alpha": float(alpha.mean())}


def alpha_table(trajs: list[Trajectory], heads: dict[str, str], max_context: int) -> dict[str, dict[str, float]]:
    """name -> scores, for "draft confidence" and each head (name -> head folder), on sampled recordings."""
    k = max(len(r.tokens) for t in trajs for r in t.runs)
    out = {}
    for name, head in {"draft confidence": None, **heads}.items():
        spy = _Spy(k, None if head is None else SpecDecPP(head))
        for traj in trajs:
            replay(traj, spy, max_context)
        said, alpha, coin = (np.array(x, dtype=float) for x in zip(*spy.seen))
        out[name] = scores(said, alpha, coin.astype(bool))
    return out
