"""Acceptance heads and verifiers: plain torch modules that read draft features and give one logit.

Features are the draft's last-layer hidden state, optionally followed by scalar extras
(decode.features.EXTRAS). Every head maps (..., in_dim) features -> (..., ) logits; the
probability that a draft token is accepted is sigmoid(logit).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import heads.kernels as kernels


class Head(nn.Module):
    """Base of every head: remembers its constructor arguments so it can be saved and rebuilt."""

    def __init__(self, **kwargs):
        super().__init__()
        self.init_args = dict(kwargs)

    def prob(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_dim) -> (...) acceptance probability."""
        return torch.sigmoid(self(x))


class ResidualBlock(nn.Module):
    """x + SiLU(Linear(x)), as in SpecDec++'s ResNet head."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class AcceptanceHead(Head):
    """SpecDec++ head: depth-1 residual blocks, each with its own weights, then Linear(in_dim, 1).

    depth = 1 is a linear layer. Features are standardised by stored statistics (set from the
    training data by `set_normalizer`) so the head trains with one learning rate on any draft.
    """

    def __init__(self, in_dim: int, depth: int = 3):
        super().__init__(in_dim=in_dim, depth=depth)
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.register_buffer("mean", torch.zeros(in_dim))
        self.register_buffer("std", torch.ones(in_dim))
        # A ModuleList of distinct blocks: never [block] * n, which would share one block's weights.
        self.blocks = nn.ModuleList(ResidualBlock(in_dim) for _ in range(depth - 1))
        self.out = nn.Linear(in_dim, 1)

    def set_normalizer(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        self.mean.copy_(mean)
        self.std.copy_(std.clamp_min(1e-4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_dim) -> (...) logits."""
        x = (x.float() - self.mean) / self.std
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1)

    @torch.inference_mode()
    def inference_fn(self, a: float = 1.0, b: float = 0.0):
        """A (in_dim,) -> float probability function for decoding one token at a time; (R, in_dim) -> (R,) array
        for a batch's rows (decode.batch: one call per draft step serves every row). a, b: a Platt calibration
        sigmoid(a * logit + b) (the export's), folded into the output layer. prob(x, extras) reads the features
        as x followed by extras, (H,) and (E,) or (R, H) and (R, E), with no copy into one row where it can.

        At batch 1 a head's cost is per-op dispatch, not arithmetic: the normalisation is folded into the first
        layer, and one row runs in one compiled call (heads.kernels.mlp_prob) where numba is installed, else on
        numpy float32 arrays (a depth-1 head is one dot product, each residual block three array ops), as rows do.
        """
        inv = (1.0 / self.std).numpy().astype(np.float32)
        shift = (-self.mean / self.std).numpy().astype(np.float32)
        layers = [(b.linear.weight.numpy().astype(np.float32).T.copy(), b.linear.bias.numpy().astype(np.float32))
                  for b in self.blocks]  # transposed: x @ w reads a row or a batch of rows alike
        w_out, b_out = a * self.out.weight[0].numpy().astype(np.float32), a * float(self.out.bias[0]) + b
        if layers:
            w0, b0 = layers[0]
            layers[0] = (w0 * inv[:, None], b0 + shift @ w0)  # the first block's linear reads the raw features
        rows = _numpy_prob(inv, shift, layers, w_out, b_out)
        if not kernels.HAVE_NUMBA:
            return rows
        d = len(inv)
        w = np.stack([lw.T for lw, _ in layers]) if layers else np.zeros((0, d, d), np.float32)
        bias = np.stack([lb for _, lb in layers]) if layers else np.zeros((0, d), np.float32)
        params = (inv, shift, np.ascontiguousarray(w, np.float32), bias.astype(np.float32), w_out, b_out)

        none = np.zeros(0, np.float32)

        def prob(x, extras=None):
            x = np.asarray(x, dtype=np.float32)
            if x.ndim == 2:
                return rows(x, extras)
            return kernels.mlp_prob(x, none if extras is None else extras, params)

        prob(np.zeros(len(inv), np.float32))  # compiled (or loaded from numba's cache) now, not in a timed step
        prob.params = params  # what heads.kernels.head_step reads (decode.policies.HeadPolicy.prob)
        return prob


def _numpy_prob(inv, shift, layers, w_out, b_out):
    """AcceptanceHead.inference_fn's numpy path over folded parameters: (D,) -> float, (R, D) -> (R,)."""
    if not layers:  # fold x * inv + shift into the output layer itself
        w, b = w_out * inv, float(w_out @ shift)

        def logit(x):
            return x @ w + b
    else:
        w0, b0 = layers[0]

        def logit(x):
            z = x @ w0 + b0
            h = x * inv + shift + z / (1.0 + np.exp(-z))  # normalised skip + SiLU
            for w, b in layers[1:]:
                z = h @ w + b
                h = h + z / (1.0 + np.exp(-z))
            return h @ w_out

    def prob(x, extras=None):
        x = np.asarray(x, dtype=np.float32)
        if extras is not None:
            x = np.concatenate([x, np.asarray(extras, dtype=np.float32)], axis=-1)
        p = 1.0 / (1.0 + np.exp(-(logit(x) + b_out)))
        return float(p) if x.ndim == 1 else p

    return prob


class LinearVerifier(AcceptanceHead):
    """SPRINTER's verifier: one linear layer and a sigmoid (an AcceptanceHead of depth 1)."""

    def __init__(self, in_dim: int):
        super().__init__(in_dim=in_dim, depth=1)
        self.init_args = {"in_dim": in_dim}


HEAD_TYPES: dict[str, type[Head]] = {cls.__name__: cls for cls in (AcceptanceHead, LinearVerifier)}
