"""Step costs of the batched decoder per batch size: what decode.control.BatchCostAware prices rounds with.

    python -m decode batch-costs --sizes '[1, 8, 32]'        (prints the tables; decode.evaluation.batch uses them)

Timed on the decoder's own caches (decode.cache.rows.RowCache: masks, position ids, realignment) over b copies of a
prompt of the request's typical length: a draft step (one token per row), the target verifying n tokens per row
for n = 1 .. max_len + 1, and the rollback a speculative round ends with (both caches, rows cut back by 0..3
tokens). Where rollbacks leave holes (decode.cache.rows), the packing they call for now and then is priced per
round as its measured time times the share of the slack that such a rollback's holes use up. Medians over repeats,
the cells in a seeded shuffled order so slow spells of the machine fall on all alike. Between measured sizes the
costs are interpolated linearly (rows leave a batch as they finish).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import numpy as np
import torch

from decode.cache.rows import SLACK, RowCache
from decode.clock import clock
from decode.pair import Pair


@dataclass
class BatchCosts:
    """ms at each batch size in sizes: draft_ms[i] a draft step, verify_ms[i][n - 1] the target verifying n tokens per
    row, move_ms[i] the end-of-round rollback of both caches (with its share of packing)."""

    sizes: list[int]
    draft_ms: list[float]
    verify_ms: list[list[float]]
    move_ms: list[float]

    def at(self, b: int) -> tuple[float, list[float], float]:
        """(draft ms, verify ms by tokens per row, realign ms) at batch size b, linear between measured sizes."""
        def interp(values):
            return float(np.interp(b, self.sizes, values))

        verify = [interp([v[n] for v in self.verify_ms]) for n in range(len(self.verify_ms[0]))]
        return interp(self.draft_ms), verify, interp(self.move_ms)

    @classmethod
    @torch.no_grad()
    def measure(cls, pair: Pair, sizes: list[int], prefix: int = 128, max_len: int = 8, repeats: int = 3,
                seed: int = 0) -> BatchCosts:
        """Time the steps at each batch size (module docstring); prefix: the prompt length the rows hold."""
        ids = [1 + i % max(1, pair.vocab - 1) for i in range(prefix)]
        now, rng = clock(pair.device), random.Random(seed)
        draft, verify, move = [], [], []
        for b in sorted(sizes):
            caches = {m: RowCache(getattr(pair, m), pair, b, m, []) for m in ("draft", "target")}
            for c in caches.values():
                c.feed([ids] * b)
            cells = [("draft", 1)] + [("target", n) for n in range(1, max_len + 2)] + [("move", 0), ("pack", 0)]
            cells = cells * repeats
            rng.shuffle(cells)
            times: dict = {}
            cut = torch.tensor([prefix - (r % 4) for r in range(b)])  # rows keep prefix - (0..3) tokens
            warm = [("draft", 1), ("target", 1), ("pack", 0)]  # a first pack also allocates the buffers packs reuse
            for i, (name, n) in enumerate(warm + cells):
                if name == "pack":  # the packing of the holes such a rollback leaves (none: nothing to time)
                    for c in caches.values():
                        c.keep(cut)
                t0 = now()
                if name == "move":
                    for c in caches.values():
                        c.keep(cut)
                elif name == "pack":
                    for c in caches.values():
                        if c.holes and b > 1:
                            c.compact()
                else:
                    caches[name].feed([ids[:n]] * b)
                if i >= len(warm):
                    times.setdefault((name, n), []).append(1e3 * (now() - t0))
                for c in caches.values():  # back to the prompt
                    if bool((c.length > prefix).any()):  # every row grew alike: a shorter view, no move
                        c.keep(torch.full((b,), prefix))
                    if bool((c.length < prefix).any()):
                        c.feed([ids[int(x):prefix] for x in c.length])
            draft.append(statistics.median(times[("draft", 1)]))
            verify.append([statistics.median(times[("target", n)]) for n in range(1, max_len + 2)])
            # a rollback's holes widen the cache by 3 columns; packing comes once the slack is used up
            share = 3 / max(8, SLACK * prefix) if caches["target"].holes and b > 1 else 0.0
            move.append(statistics.median(times[("move", 0)]) + share * statistics.median(times[("pack", 0)]))
        return cls(sorted(sizes), draft, verify, move)

    def describe(self) -> str:
        lines = [f"{'batch':>6} {'draft':>8} " + " ".join(f"{'v' + str(n):>7}" for n in range(1, len(self.verify_ms[0]) + 1))
                 + f" {'realign':>8}   (ms)"]
        for b, d, v, m in zip(self.sizes, self.draft_ms, self.verify_ms, self.move_ms):
            lines.append(f"{b:>6} {d:8.2f} " + " ".join(f"{x:7.2f}" for x in v) + f" {m:8.2f}")
        return "\n".join(lines)


_CACHE: dict[tuple, BatchCosts] = {}


def table_sizes(n: int) -> list[int]:
    """The batch sizes a controller's tables are measured at for requests of up to n rows: the powers of 2 below n,
    and n. Rows leave a batch as they finish, so its rounds run at every size below its start, and the costs
    between two measured sizes are not linear in the rows (on the embedded pair, plain steps at 3 to 6 rows cost
    1.27x the line between the tables' 1 and 8 rows); a controller's measurements are also kept per measured size."""
    return sorted({1 << i for i in range(max(1, n).bit_length()) if 1 << i < n} | {max(1, n)})


def batch_costs(pair: Pair, sizes: list[int], prefix: int = 128, max_len: int = 8) -> BatchCosts:
    """BatchCosts.measure once per pair of loaded models and arguments."""
    key = (id(pair.draft), id(pair.target), tuple(sorted(sizes)), prefix, max_len)
    if key not in _CACHE:
        _CACHE[key] = BatchCosts.measure(pair, sizes, prefix, max_len)
    return _CACHE[key]


def main(argv: list[str]) -> None:
    import argparse
    import json

    from decode.pair import load_pair

    ap = argparse.ArgumentParser(prog="python -m decode batch-costs")
    ap.add_argument("--pair", default="configs/pairs/pycode.yaml")
    ap.add_argument("--sizes", type=json.loads, default=[1, 8, 32], help="batch sizes, a JSON list")
    ap.add_argument("--prefix", type=int, default=80, help="tokens each row holds")
    ap.add_argument("--max_len", type=int, default=8, help="most candidates per row (verify up to max_len + 1)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(BatchCosts.measure(load_pair(args.pair), args.sizes, args.prefix, args.max_len).describe())
