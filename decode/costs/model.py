"""A measured cost model of the pair: what the bench prices call logs with, and what CostAwareStop reads.

The cost model times each model's step the way decoding runs it, at the start of a bench section and again
after each quarter of its prompts (the mean is used, so drift during the section falls on it as on the runs):
a cached forward of n new tokens, with the cache growing through the generation's length, followed by the
section's sampling work on its logits (the transform of the rows decoding reads and one draw: under top-p that
is a sort of the vocabulary per row, 5 to 8% of a target step on a fast machine, and it also leaves the next
forward running as it runs in decoding, after that work rather than straight after another forward), in two states:
right after a forward of the same model ("warm") and right after the other model's ("switched": a small
model can run slower once a large one has evicted its weights and cache; describe() prints both). Every n up
to 9 is timed, a sparse tail beyond (linear between), each cell in a seeded shuffled order so slow spells of
the machine fall on all cells alike; the prefill of prompts at a few lengths is timed too (interpolated).
A generation's predicted time is the sum over its ordered call log (decode.engine.Stats.calls), each call
costed in the state it ran in, so measured / predicted shows what the engine loses to everything that is not
a model forward, and the table can be re-costed for another hardware ratio.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

import numpy as np
import torch

from decode.cache.kv import crop_cache, forward, rollback_cache
from decode.clock import clock
from decode.pair import Pair, input_device
from decode.sampling import argmax, pick, sample, transform
from decode.streams import Streams

MODELS = ("draft", "target")


def _grid(n_max: int) -> list[int]:
    """Token counts to time: every n up to 9 (the verify sizes of fixed-K rounds), then a sparse tail, linear between."""
    return sorted({*range(1, min(n_max, 9) + 1), *range(12, n_max, 4), n_max})


@torch.no_grad()
def _prefill_ms(model, ids: torch.Tensor, repeats: int) -> float:
    ids = ids.to(input_device(model))
    now, times = clock(ids.device), []
    for _ in range(repeats):
        t0 = now()
        forward(model, ids, rollback_cache(), logits_to_keep=1)
        times.append(now() - t0)
    return 1e3 * statistics.median(times)


class _Timer:
    """Both models with their caches over one prefix; forward(name, n) feeds n tokens, growing the cache
    as decoding does and cropping back to the prefix once it has grown by `growth` positions, then picks a
    token under the pair's sampling setting: the target transforms all n rows (the verification reads each),
    the draft its last row (the new candidate's q)."""

    def __init__(self, pair, prefix: torch.Tensor, growth: int):
        self.models = {m: getattr(pair, m) for m in MODELS}
        self.prefix, self.growth, self.pair = prefix.to(pair.input_device("target")), growth, pair
        self.gen = Streams([0], pair.device)
        self.now = clock(pair.device)
        self.caches = {m: rollback_cache() for m in MODELS}
        with torch.no_grad():
            for m in MODELS:
                forward(self.models[m], self.prefix.to(pair.input_device(m)), self.caches[m], logits_to_keep=1)

    @torch.no_grad()
    def head_ms(self, repeats: int) -> float:
        """Median ms of one head decision right after a draft step, as decoding makes it (HeadPolicy.prob over the
        step's raw logits and state): a depth-3 acceptance head reading the draft's state and every extra, the
        shape of the shipped heads (its weights do not change its time)."""
        from decode.policies import DraftStep, HeadPolicy
        from heads import AcceptanceHead
        from heads.features import CHAIN_EXTRAS as EXTRAS

        width = self.models["draft"].config.hidden_size
        with torch.random.fork_rng(devices=[]):  # the head's random weights leave the caller's stream alone
            head = AcceptanceHead(width + len(EXTRAS), depth=3).eval()
        policy = HeadPolicy.in_memory(head, {"features": {"position": "prev", "extras": list(EXTRAS)}})
        state, times = torch.zeros(width), []
        for _ in range(repeats):
            self.forward("draft", 1)
            raw = self.last
            t0 = self.now()
            policy.prob(DraftStep(0, 0, None, raw, state, None))
            times.append(self.now() - t0)
        return 1e3 * statistics.median(times)

    @torch.no_grad()
    def forward(self, name: str, n: int) -> float:
        cache, length = self.caches[name], self.prefix.shape[1]
        if cache.get_seq_length() + n > length + self.growth:
            crop_cache(cache, length)
        x = self.prefix[:, -n:] if length >= n else self.prefix.repeat(1, n)[:, :n]
        x = x.to(self.pair.input_device(name))
        t0 = self.now()
        logits = self.pair.logits(forward(self.models[name], x, cache).logits[0])
        s = self.pair.config.sampling
        if name == "target":  # the rule transforms every verified row, then takes the last one's token
            probs = transform(logits, s)[-1]
            int(argmax(probs)) if s.temperature == 0 else int(sample(probs, self.gen))
        else:
            pick(logits[-1], s, self.gen)
            self.last = logits[-1]  # what a head decision after this step reads (head_ms)
        return 1e3 * (self.now() - t0)


@dataclass
class CostModel:
    """ms per step (forward and sampling work) of n new tokens: step[model][n - 1] after a step of the same model, switched[model][n - 1]
    after one of the other model (absent: as step); prefill[model] as (lengths, ms)."""

    step: dict[str, list[float]] = field(default_factory=dict)
    prefill: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    switched: dict[str, list[float]] = field(default_factory=dict)
    head: float = 0.0  # ms of one head decision after a draft step: a ("head", 1) entry of a call log

    @classmethod
    def measure(cls, pair, prompts: list[list[int]], n_max: int, repeats: int = 7, growth: int = 64,
                draft_n_max: int = 4, seed: int = 0) -> CostModel:
        """Time both models on these prompts (decode.pair.Pair; prompts as token ids). The draft is fed at
        most draft_n_max tokens outside prefill (the pending token and one candidate), the target up to n_max."""
        lengths = sorted(len(p) for p in prompts)
        typical = torch.tensor([prompts[[len(p) for p in prompts].index(lengths[len(lengths) // 2])]])
        typical = typical[:, -max(1, pair.config.max_context - n_max - growth):]  # room to grow
        timer = _Timer(pair, typical, growth)
        sizes = {"draft": min(draft_n_max, n_max), "target": n_max}
        grid = {m: _grid(sizes[m]) for m in MODELS}
        cells = [(m, n, sw) for m in MODELS for n in grid[m] for sw in (False, True)] * repeats
        random.Random(seed).shuffle(cells)
        for m in MODELS:  # warm-up
            timer.forward(m, 1)
        samples: dict[tuple[str, int, bool], list[float]] = {}
        for m, n, sw in cells:
            timer.forward(m if not sw else MODELS[1 - MODELS.index(m)], 1)  # the state the timed call runs in
            samples.setdefault((m, n, sw), []).append(timer.forward(m, n))
        def med(m, sw):  # medians on the grid, interpolated to every n
            return np.interp(np.arange(1, sizes[m] + 1), grid[m],
                             [statistics.median(samples[(m, n, sw)]) for n in grid[m]]).tolist()

        by_len = {len(p): p for p in prompts}
        picks = sorted({lengths[int(q * (len(lengths) - 1))] for q in (0.0, 0.25, 0.5, 0.75, 1.0)})
        return cls(step={m: med(m, False) for m in MODELS}, switched={m: med(m, True) for m in MODELS},
                   prefill={m: (picks, [_prefill_ms(timer.models[m], torch.tensor([by_len[n]]), 3) for n in picks])
                            for m in MODELS}, head=timer.head_ms(3 * repeats))

    @classmethod
    def mean(cls, models: list[CostModel]) -> CostModel:
        """Entry-wise mean of several measurements: taken through a run, machine drift averages out."""
        def avg(tables):
            return {k: np.mean([t[k] for t in tables], axis=0).tolist() for k in tables[0]}

        prefill = {k: (models[0].prefill[k][0], np.mean([m.prefill[k][1] for m in models], axis=0).tolist())
                   for k in models[0].prefill}
        return cls(step=avg([m.step for m in models]), prefill=prefill, switched=avg([m.switched for m in models]),
                   head=float(np.mean([m.head for m in models])))

    def call_ms(self, model: str, n: int, switched: bool = False) -> float:
        """Predicted ms of one forward of n tokens in that state: the step tables, else the prefill curve; of n
        head decisions ("head")."""
        if model == "head":
            return n * self.head
        table = self.switched.get(model) if switched else None
        if table and n <= len(table):
            return table[n - 1]
        steps = self.step[model]
        if n <= len(steps):
            return steps[n - 1]
        lengths, ms = self.prefill[model]
        if n > lengths[-1]:  # past the longest measured, in proportion: np.interp would price every longer forward
            return ms[-1] * n / lengths[-1]  # alike (a tree over 8 rows, 264 tokens, at a 64-token prompt's ms)
        return float(np.interp(n, lengths, ms))

    def predict_s(self, calls: list[tuple[str, int]]) -> float:
        """Seconds predicted for an ordered call log of (model, tokens) pairs."""
        total, prev = 0.0, None
        for model, n in calls:
            total += self.call_ms(model, n, switched=prev is not None and prev != model)
            prev = prev if model == "head" else model  # a head decision evicts no model's weights
        return 1e-3 * total

    def describe(self) -> str:
        d, t = self.step["draft"], self.step["target"]
        sd, st = self.switched.get("draft", d), self.switched.get("target", t)
        return (f"draft step {d[0]:.2f} ms ({sd[0]:.2f} after a target step), target step {t[0]:.2f} ms "
                f"(1 token; {st[0]:.2f} after a draft step) .. {t[-1]:.2f} ms ({len(t)} tokens), "
                f"ratio {t[0] / d[0]:.1f}x, head decision {1e3 * self.head:.0f} us")


_COSTS: dict[tuple[int, int, int], CostModel] = {}


@torch.no_grad()
def tree_costs(pair: Pair, prompts: list[list[int]], nodes: int = 64, width: int = 16, repeats: int = 3) -> CostModel:
    """ms of a draft forward of 1..width tokens and of a target forward of 1..nodes + 1 right after a draft's."""
    return CostModel.measure(pair, prompts, n_max=nodes + 1, repeats=repeats, draft_n_max=width)


def measure_costs(pair: Pair, prefix: int = 32, n_max: int = 21, repeats: int = 5) -> tuple[float, list[float]]:
    """(draft step, verify_ms) in ms on this machine, measured once per pair of loaded models, the way the bench's
    cost model times steps (CostModel: a cached forward plus the sampling work, medians over
    shuffled repeats): a draft step after another, and verify_ms[n - 1], the target verifying n tokens right after
    a draft step, for n up to n_max. The whole table, not a line: on CPUs some sizes run faster than smaller
    ones, and CostAwareStop looks for them."""
    model = _measured(pair, prefix, n_max, repeats)
    return model.step["draft"][0], model.switched["target"]


def head_cost(pair: Pair) -> float:
    """ms of one head decision after a draft step, measured with measure_costs' steps (CostModel.head)."""
    return _measured(pair).head


def _measured(pair: Pair, prefix: int = 32, n_max: int = 21, repeats: int = 5) -> CostModel:
    key = (id(pair.draft), id(pair.target), n_max)
    if key not in _COSTS:
        ids = [1 + i % max(1, pair.vocab - 1) for i in range(prefix)]
        _COSTS[key] = CostModel.measure(pair, [ids], n_max=n_max, repeats=repeats, draft_n_max=1)
    return _COSTS[key]
