"""The drafting-policy interface and the training-free policies; callers import them from decode.policies.

DraftStep is what a policy reads of one candidate (its scalars from draft_scalars, which the batched decoder runs over
all rows at once), Policy the base every policy extends (decode.policies describes its methods), and FixedK,
DraftConfidence and AdaEDL the policies that need no trained head: they read only the draft's distribution. The
head-driven policies build on these in decode.policies.heads; the bench's ceilings, in decode.evaluation.ceilings.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from decode import labels as L
from decode.checks import is_real, is_whole
from heads import kernels

_SCRATCH: dict[tuple, np.ndarray] = {}  # draft_scalars' work arrays by shape: fresh (R, V) arrays each step cost more
# than the arithmetic (at batch 64, 5x: new pages faulted in); the decoder calls it from one thread


def _scratch(name: str, like: np.ndarray) -> np.ndarray:
    key = (name, like.shape)
    if key not in _SCRATCH:
        _SCRATCH[key] = np.empty_like(like)
    return _SCRATCH[key]


def draft_scalars(logits: torch.Tensor, tokens: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(R, V) raw logits and R candidates -> (R,) confidence (the candidate's probability), entropy in nats and top-1
    probability of the softmax, as numpy arrays. On the CPU in numpy, a few array ops for all rows (at small batches a
    decoder pays per tensor op); on a GPU in torch, then one read."""
    if logits.device.type != "cpu":
        p = logits.float().softmax(-1)
        rows = torch.arange(len(tokens), device=p.device)
        out = torch.stack([p[rows, torch.tensor(tokens, device=p.device)], L.entropy(p), p.max(-1).values])
        return tuple(out.cpu().numpy())
    x = logits.detach().float().numpy()
    if kernels.HAVE_NUMBA:  # as fast as the numpy path at batch 64, and the one path of every batch size
        return tuple(kernels.softmax_scalars_rows(x, np.asarray(tokens, dtype=np.int64)))
    shifted, e = _scratch("shifted", x), _scratch("exp", x)
    np.subtract(x, x.max(-1)[:, None], out=shifted)
    np.exp(shifted, out=e)
    total = e.sum(-1)
    with np.errstate(invalid="ignore"):
        dot = np.vecdot(e, shifted)
    bad = np.isnan(dot)
    if bad.any():  # -inf logits (a processor masked tokens): 0 * -inf; those tokens add nothing
        dot[bad] = np.vecdot(e[bad], np.where(e[bad] > 0, shifted[bad], 0.0))
    return e[np.arange(len(tokens)), tokens] / total, np.log(total) - dot / total, 1.0 / total


@dataclass
class DraftStep:
    index: int  # 0-based position of the candidate in this round
    token: int
    q: torch.Tensor | None  # (V,) the draft's distribution the token was drawn from (after the sampling transform);
    # None under greedy decoding on the CPU, where it is the token's one-hot (the engine builds a round's at once)
    logits: torch.Tensor  # (V,) the draft's raw logits behind q
    hidden_prev: torch.Tensor | None  # (H,) state that produced q (None unless the policy needs_hidden)
    hidden_own: torch.Tensor | None  # (H,) state after reading the token (None unless reads_own_state)

    @functools.cached_property
    def probs(self) -> torch.Tensor:
        """(V,) softmax of the raw logits, computed only for policies that ask. Confidence and entropy
        rules read this rather than q, so they still work under greedy decoding, where q is one-hot."""
        return self.logits.softmax(-1)

    # What the rules and head extras read of the draft's distribution: three scalars, so that a recorded
    # trajectory (decode.evaluation.replay) can hand a policy the same step without the (V,) logits.
    @functools.cached_property
    def _scalars(self) -> tuple[float, float, float]:
        """(confidence, entropy, top1) of the raw softmax in one pass: one compiled call on the CPU
        (heads.kernels.softmax_scalars), draft_scalars of one row elsewhere or without numba."""
        if self.logits.device.type == "cpu" and kernels.HAVE_NUMBA:
            return kernels.softmax_scalars(self.logits.detach().float().numpy(), self.token)
        return tuple(float(x[0]) for x in draft_scalars(self.logits[None], [self.token]))

    @functools.cached_property
    def confidence(self) -> float:
        """The draft's raw probability of its own token."""
        return self._scalars[0]

    @functools.cached_property
    def entropy(self) -> float:
        """Entropy of the draft's raw distribution, in nats."""
        return self._scalars[1]

    @functools.cached_property
    def top1(self) -> float:
        """The draft's largest raw probability."""
        return self._scalars[2]


class Policy:
    """How far to draft, one round at a time (see the module). What a decoder asks of a policy is declared here:"""

    max_len: int = 20
    needs_hidden = False  # the engine asks the draft for hidden states only when True
    reads_own_state = False  # stop() needs the state after reading the candidate (one more draft pass)
    needs_costs = False  # the decoder hands it the machine's step costs (set_costs) before decoding
    # A ceiling of the bench (decode.evaluation.ceilings) sees the target, off the books: the one-sequence decoder
    # binds it a view of the target (bind_view) before each generation, and the time spent through the view is kept
    # out of the measured wall. No policy a user decodes with sets it; batched decoding refuses one that does.
    sees_target = False
    view = None  # the view bind_view hands it (None: none bound, or replay reads the recording instead)

    def bind_view(self, view) -> None:
        """view: decode.engine.TargetView (the round's prefix, the prompt, the target's logits after a prefix)."""
        self.view = view

    def reset(self) -> None:
        pass

    def stop(self, step: DraftStep) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        pass

    def verified(self, accepted: int, drafted: int) -> None:
        pass


def check_unit(name: str, value: float, open_ends: bool = False) -> None:
    """Raise ValueError naming the argument unless value is in [0, 1] ((0, 1) with open_ends)."""
    ok = is_real(value) and (0 < value < 1 if open_ends else 0 <= value <= 1)
    if not ok:
        shown = f"{value:g}" if is_real(value) else repr(value)
        raise ValueError(f"{name} must be a number in {'(0, 1)' if open_ends else '[0, 1]'}, got {shown}")


def check_max_len(max_len: int) -> int:
    if not (is_whole(max_len) and 1 <= max_len <= 64):
        raise ValueError(f"max_len must be a whole number in 1..64, got {max_len!r}")
    return max_len


class FixedK(Policy):
    """Draft exactly k candidates per round (classic speculative decoding)."""

    def __init__(self, k: int = 4):
        if not is_whole(k) or not 1 <= k <= 64:
            raise ValueError(f"FixedK's k is a whole number in 1..64 (K < 1 drafts nothing), got {k!r}")
        k = int(k)
        self.k = self.max_len = k

    def stop(self, step):
        return step.index + 1 >= self.k


class DraftConfidence(Policy):
    """Hugging Face's assistant_confidence_threshold rule: stop when q(token) < threshold."""

    def __init__(self, threshold: float = 0.4, max_len: int = 20):
        check_unit("threshold", threshold)
        self.threshold, self.max_len = threshold, check_max_len(max_len)

    def stop(self, step):
        return step.confidence < self.threshold


class AdaEDL(Policy):
    """AdaEDL: stop when the entropy lower bound on acceptance 1 - sqrt(gamma * H(q)) < lam."""

    def __init__(self, lam: float = 0.5, gamma: float = 0.6, max_len: int = 20):
        check_unit("lam", lam)
        if gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {gamma:g}")
        self.lam, self.gamma, self.max_len = lam, gamma, check_max_len(max_len)

    def stop(self, step):
        return 1.0 - math.sqrt(self.gamma * step.entropy) < self.lam
