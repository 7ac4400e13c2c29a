"""Per-row random streams that a whole batch draws from at once.

Row r's n-th uniform is a hash of (its seed, n) (SplitMix64: Steele, Lea and Flood 2014, the generator that seeds
Java's SplittableRandom and xoshiro), so what a row draws depends on its seed and on how much it has drawn, never on
which rows share its batch. A round's draws for every row are one vectorised host computation and one transfer to the
device. One torch.Generator per row needed a call per row instead: a kernel launch each on a GPU (docs/batch.md).

    s = Streams([7, 8, 9], "cpu")     # three rows, seeds 7, 8, 9
    s.draw([2, 0, 1])                 # (3,) float64: row 0's next two uniforms, then row 2's next one
    s.select([2]).draw(1)             # (1,) row 2's next one: a view shares its rows' counters
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from decode.checks import is_whole

_MASK = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment (the odd integer nearest 2^64 / golden ratio)
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = (np.uint64(s) for s in (30, 27, 31, 11))
_FEW = 16  # draws at most this many go through Python ints (a few us at batch 1, where numpy's dozen calls take 17)


def mix(z: np.ndarray) -> np.ndarray:
    """(...) uint64 -> (...) uint64: SplitMix64's output function (a bijection; uint64 products wrap mod 2^64)."""
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return z ^ (z >> _S31)


def mix_int(z: int) -> int:
    """mix() of one Python int in [0, 2^64)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def check_seed(seed) -> int:
    """A seed as a Python int (numpy integers welcome), or a one-line ValueError for one that is no whole number."""
    if not is_whole(seed):
        raise ValueError(f"a seed is a whole number, got {seed!r}")
    return int(seed)


class Streams:
    """Rows' uniform streams: draw(counts) -> (sum of counts,) float64 uniforms in [0, 1) on `device`, row by row.

    A view from select() draws from the same rows (it shares their counters), so a batch that loses finished rows
    keeps each remaining row's stream where it was.
    """

    def __init__(self, seeds: Sequence[int], device: torch.device | str = "cpu"):
        self.key = mix(np.array([check_seed(s) & _MASK for s in seeds], dtype=np.uint64))
        self.count = np.zeros(len(seeds), dtype=np.uint64)  # uniforms each row has drawn
        self.ids = np.arange(len(seeds))
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, rows: Sequence[int]) -> Streams:
        """A view of this one's rows[i], i = 0.. (its row i draws from theirs)."""
        view = object.__new__(Streams)
        view.key, view.count, view.device = self.key, self.count, self.device
        view.ids = self.ids[np.asarray(rows, dtype=np.intp)]
        return view

    def draw_numpy(self, counts: Sequence[int] | int) -> np.ndarray:
        """counts (one per row, or one for all) -> (sum,) float64: row 0's next counts[0] uniforms, then row 1's..."""
        counts = [counts] * len(self.ids) if isinstance(counts, int) else list(counts)
        if sum(counts) <= _FEW:
            return np.array(self._draw_few(counts), dtype=np.float64)
        counts = np.asarray(counts, dtype=np.int64)
        ids = np.repeat(self.ids, counts)
        ends = np.cumsum(counts)
        # how many each uniform's row had drawn before it: its row's counter plus its place in the row's run
        before = self.count[ids] + (np.arange(len(ids)) - np.repeat(ends - counts, counts)).astype(np.uint64)
        self.count[self.ids] += counts.astype(np.uint64)  # (a view names each row once)
        x = mix(self.key[ids] + (before + np.uint64(1)) * _GAMMA)
        return (x >> _S11).astype(np.float64) * 2.0 ** -53  # the top 53 bits: a double's mantissa, never 1.0

    def _draw_few(self, counts: list[int]) -> list[float]:
        """draw_numpy's uniforms, computed one by one in Python ints (tests hold the two paths equal)."""
        out, gamma = [], int(_GAMMA)
        for i, c in zip(self.ids.tolist(), counts):
            key, n = int(self.key[i]), int(self.count[i])
            out += [(mix_int((key + j * gamma) & _MASK) >> 11) * 2.0 ** -53 for j in range(n + 1, n + c + 1)]
            self.count[i] = n + c
        return out

    def draw(self, counts: Sequence[int] | int) -> torch.Tensor:
        """draw_numpy on the streams' device, in one transfer."""
        return torch.from_numpy(self.draw_numpy(counts)).to(self.device)
