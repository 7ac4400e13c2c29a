"""Bootstrap intervals for paired speedups."""

from __future__ import annotations

import numpy as np


def bootstrap_ci(ratios: np.ndarray, n_boot: int = 4000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """(P, R) per-prompt, per-repeat ratios -> interval of their mean, resampling prompts then repeats."""
    ratios = np.atleast_2d(np.asarray(ratios, dtype=float))
    if ratios.shape[0] == 1 and ratios.shape[1] > 1:
        ratios = ratios.T
    rng = np.random.default_rng(seed)
    p, r = ratios.shape
    rows = rng.integers(0, p, size=(n_boot, p))
    cols = rng.integers(0, r, size=(n_boot, p, r))
    means = ratios[rows[..., None], cols].mean(axis=(1, 2))
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def paired_ratio_ci(a: np.ndarray, b: np.ndarray, n_boot: int = 4000, seed: int = 0,
                    level: float = 0.95) -> tuple[float, float, float]:
    """(P,) per-prompt values of two methods on the same prompts -> (mean(a) / mean(b), interval): prompts are
    resampled together, so what the prompts share (their difficulty) cancels out of the ratio."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    rows = np.random.default_rng(seed).integers(0, len(a), size=(n_boot, len(a)))
    ratios = a[rows].mean(axis=1) / b[rows].mean(axis=1)
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(a.mean() / b.mean()), float(lo), float(hi)
