"""Label families: how stored per-position quantities become a training target and a loss weight.

Each family maps columns of a label set to a (N,) target in [0, 1] (soft or hard) and an (N,)
binary event used for ROC analysis, and carries the positive/negative weights of its loss:
    loss = -(w_pos * t * log s + w_neg * (1 - t) * log(1 - s)) / sum(w_pos * t + w_neg * (1 - t))
The thresholding itself is decode.labels, so a label and the decision it predicts cannot drift.
"""

from __future__ import annotations

import torch

from decode import labels as L


def seeded_outcome(chance: torch.Tensor, seed: int) -> torch.Tensor:
    """(N,) acceptance chances -> (N,) the outcome of a test with a seeded coin: a soft family's ROC event."""
    u = torch.rand(len(chance), generator=torch.Generator().manual_seed(seed))
    return (u < chance).float()


def check_divergence(name: str) -> None:
    """A divergence family's name, or a one-line ValueError listing the ones decode.labels computes."""
    if name not in ("kl", "kl_qp", "js", "tv"):
        raise ValueError(f"divergence must be one of kl, kl_qp, js, tv; got {name!r}")


class LabelFamily:
    """Base: subclasses set w_pos, w_neg and implement target(cols)."""

    w_pos: float = 1.0
    w_neg: float = 1.0

    def target(self, cols: dict[str, torch.Tensor]) -> torch.Tensor:
        """(N,) columns -> (N,) target in [0, 1]."""
        raise NotImplementedError

    def event(self, cols: dict[str, torch.Tensor], seed: int = 0) -> torch.Tensor:
        """(N,) binary outcome the head is judged on; hard labels are their own event."""
        return self.target(cols).round()

    def meta(self) -> dict:
        return {"family": type(self).__name__, **{k: v for k, v in vars(self).items() if not k.startswith("_")}}


class SoftAcceptance(LabelFamily):
    """SpecDec++: soft target alpha = min(1, p(c)/q(c)); weights w_acc (accept) and w_rej (reject).

    The ROC event is the speculative-sampling outcome itself, u < alpha with a seeded u.
    """

    def __init__(self, w_acc: float = 1.0, w_rej: float = 6.0):
        self.w_acc, self.w_rej = w_acc, w_rej
        self.w_pos, self.w_neg = w_acc, w_rej

    def target(self, cols):
        return cols["alpha"].float()

    def event(self, cols, seed: int = 0):
        return seeded_outcome(cols["alpha"], seed)

    def meta(self):
        return {"family": "SoftAcceptance", "w_acc": self.w_acc, "w_rej": self.w_rej}


class RatioThreshold(LabelFamily):
    """SPRINTER: hard label 1 when q(c)/p(c) <= gamma; class weights w_pos, w_neg."""

    def __init__(self, gamma: float = 1.2, w_pos: float = 1.0, w_neg: float = 1.0):
        self.gamma, self.w_pos, self.w_neg = gamma, w_pos, w_neg

    def target(self, cols):
        return L.sprinter_label(cols["ratio_qp"].float(), self.gamma)


class DivergenceThreshold(LabelFamily):
    """FSD: hard label 1 when D(p, q) <= T at the position, D one of kl, kl_qp, js, tv."""

    def __init__(self, divergence: str = "js", threshold: float = 0.1, w_pos: float = 1.0, w_neg: float = 1.0):
        check_divergence(divergence)
        self.divergence, self.threshold, self.w_pos, self.w_neg = divergence, threshold, w_pos, w_neg

    def target(self, cols):
        return L.fsd_label(cols[self.divergence].float(), self.threshold)


class RelaxedDivergence(LabelFamily):
    """rFSD (decode.rules.FSD with relaxed=True): soft target 1 where D(p, q) <= T, else alpha = min(1, p(c)/q(c)),
    the chance the position is accepted; weights w_acc and w_rej as SoftAcceptance's. The ROC event is rFSD's outcome
    with a seeded u, as SoftAcceptance's is speculative sampling's."""

    def __init__(self, divergence: str = "js", threshold: float = 0.1, w_acc: float = 1.0, w_rej: float = 6.0):
        check_divergence(divergence)
        self.divergence, self.threshold, self.w_acc, self.w_rej = divergence, threshold, w_acc, w_rej
        self.w_pos, self.w_neg = w_acc, w_rej

    def target(self, cols):
        return L.rfsd_accept_prob(cols[self.divergence].float(), cols["alpha"].float(), self.threshold)

    def event(self, cols, seed: int = 0):
        return seeded_outcome(self.target(cols), seed)

    def meta(self):
        return {"family": "RelaxedDivergence", "divergence": self.divergence, "threshold": self.threshold,
                "w_acc": self.w_acc, "w_rej": self.w_rej}


def weighted_bce(logits: torch.Tensor, target: torch.Tensor, w_pos: float, w_neg: float) -> torch.Tensor:
    """(N,) logits and soft or hard targets -> () weighted BCE normalised by the weights."""
    logs, log1ms = torch.nn.functional.logsigmoid(logits), torch.nn.functional.logsigmoid(-logits)
    w = w_pos * target + w_neg * (1 - target)
    return -(w_pos * target * logs + w_neg * (1 - target) * log1ms).sum() / w.sum().clamp_min(1e-8)


def binary_kl(target: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    """(N,), (N,) -> (N,) KL(Bernoulli(target) || Bernoulli(prob)), SpecDec++ Table 3's metric."""
    t, s = target.double(), prob.double().clamp(1e-7, 1 - 1e-7)
    return torch.xlogy(t, t) - torch.xlogy(t, s) + torch.xlogy(1 - t, 1 - t) - torch.xlogy(1 - t, 1 - s)
