"""The decoders' clock: wall time that, on a GPU, counts the work queued there (decode.engine, decode.batch, the
cost tables of decode.costs)."""

from __future__ import annotations

import time

import torch


def clock(device: torch.device):
    """A perf_counter that, on a GPU, first waits for the work queued there: else a forward's time would land
    in whatever step next reads a result (sampling, the rule)."""
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now
