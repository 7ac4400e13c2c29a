"""A measured cost model of the pair, and bootstrap intervals for paired speedups.

The cost model times each model's forward directly, at the start of a bench section and again after each
quarter of its prompts (the mean is used, so drift during the section falls on it as on the runs): one cached
forward of n = 1 .. n_max new tokens after a prompt of typical length (median of repeats), and the
prefill of prompts at a few lengths (interpolated). A generation's predicted time is the sum over its
exact call log (decode.engine.Stats.calls), so measured / predicted shows what the engine loses to
everything that is not a model forward, and the table can be re-costed for another hardware ratio.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch


@torch.no_grad()
def _forward_ms(model, prefix: torch.Tensor, n: int, repeats: int) -> float:
    """Median ms of one forward of n new tokens after a cached (1, T) prefix."""
    out = model(prefix, use_cache=True)
    cache = out.past_key_values
    x = prefix[:, -n:] if prefix.shape[1] >= n else prefix.repeat(1, n)[:, :n]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(x, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cache.crop(-n)  # negative: drop the n tokens just added
    return 1e3 * statistics.median(times)


@torch.no_grad()
def _prefill_ms(model, ids: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(ids, use_cache=True)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


@dataclass
class CostModel:
    """ms per forward: step[model][n - 1] for n new tokens, prefill[model] as (lengths, ms)."""

    step: dict[str, list[float]] = field(default_factory=dict)
    prefill: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)

    @classmethod
    def measure(cls, pair, prompts: list[list[int]], n_max: int, repeats: int = 15) -> CostModel:
        """Time both models on these prompts (decode.pair.Pair; prompts as token ids)."""
        lengths = sorted(len(p) for p in prompts)
        typical = torch.tensor([prompts[[len(p) for p in prompts].index(lengths[len(lengths) // 2])]])
        typical = typical[:, -max(1, pair.config.max_context - n_max):]  # room for n_max more positions
        picks = sorted({lengths[int(q * (len(lengths) - 1))] for q in (0.0, 0.25, 0.5, 0.75, 1.0)})
        by_len = {len(p): p for p in prompts}
        cm = cls()
        for name in ("draft", "target"):
            model = getattr(pair, name)
            _forward_ms(model, typical, 1, 3)  # warm-up
            cm.step[name] = [_forward_ms(model, typical, n, repeats) for n in range(1, n_max + 1)]
            cm.prefill[name] = (picks, [_prefill_ms(model, torch.tensor([by_len[n]]), 3) for n in picks])
        return cm

    @classmethod
    def mean(cls, models: list[CostModel]) -> CostModel:
        """Entry-wise mean of several measurements: taken through a run, machine drift averages out."""
        step = {k: np.mean([m.step[k] for m in models], axis=0).tolist() for k in models[0].step}
        prefill = {k: (models[0].prefill[k][0], np.mean([m.prefill[k][1] for m in models], axis=0).tolist())
                   for k in models[0].prefill}
        return cls(step=step, prefill=prefill)

    def call_ms(self, model: str, n: int) -> float:
        """Predicted ms of one forward of n tokens: the step table, else the prefill curve."""
        steps = self.step[model]
        if n <= len(steps):
            return steps[n - 1]
        lengths, ms = self.prefill[model]
        return float(np.interp(n, lengths, ms))

    def predict_s(self, calls: list[tuple[str, int]]) -> float:
        """Seconds predicted for a call log of (model, tokens) pairs."""
        return 1e-3 * sum(self.call_ms(m, n) for m, n in calls)

    def describe(self) -> str:
        d, t = self.step["draft"], self.step["target"]
        return (f"draft step {d[0]:.2f} ms, target forward {t[0]:.2f} ms (1 token) .. {t[-1]:.2f} ms "
                f"({len(t)} tokens), ratio {t[0] / d[0]:.1f}x")


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
