"""Replay speculative decoding on recorded trajectories against a cost model: exact under greedy, in seconds.

    traj = record(pair, prompt_ids, max_new=64)                       # once per prompt
    calls, n = replay(traj, SpecDecPP("checkpoints/specdecpp-prev-greedy", h=0.5), max_context)
    (the command: python -m decode replay, decode/evaluation/tuning.py)

Under greedy decoding every round starts from a prefix of the target's greedy response y, and the draft is
deterministic: a round starting after y_<i drafts the draft's own greedy continuation of y_<i, whatever the
policy, and accepts its leading tokens that equal y. So one recording per prompt (y, and for every start i
the draft's free run with what a policy reads: its tokens, confidence, entropy, top-1 and hidden states)
lets any drafting policy be replayed exactly, rejected candidates included. Each replay writes the call log
the engine would (model, tokens fed, in order) and the cost model prices it, as the bench prices a row.

Under sampling it is an estimate: the response is drawn from the target, every free run draws its
candidates from q and records each one's acceptance probability min(1, p/q) and the uniform that decides it, so
every policy meets the same draws. What it cannot replay exactly is the text after a round: decoding continues
after the accepted candidates and a corrected token, the replay after the same number of tokens of the response,
text of the same law (the target's) but not the same text.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from decode.engine import Autoregressive, Runner
from decode.labels import accept_prob
from decode.pair import Pair
from decode.policies import DraftStep, HeadPolicy, Policy
from decode.sampling import pick, transform


@dataclass
class FreeRun:
    """The draft's greedy continuation after one prefix: k tokens and what a policy reads of each."""

    tokens: list[int]
    confidence: list[float]  # raw probability of each token (its top-1 under greedy)
    entropy: list[float]
    top1: list[float]
    states: torch.Tensor | None  # (k + 1, H): state j produced token j; state j + 1 is the one after reading it
    accept: list[float] | None = None  # under sampling: min(1, p/q) of each token, given the run before it
    uniform: list[float] | None = None  # under sampling: token j is accepted when uniform[j] < accept[j]

    def accepted(self, j: int, target_token: int) -> bool:
        """Would verification accept token j, the response having target_token there? (Greedy: equal tokens.)"""
        return self.tokens[j] == target_token if self.accept is None else self.uniform[j] < self.accept[j]

    def leading(self, response: list[int], at: int, k: int) -> int:
        """How many of the first k tokens verification accepts when the run starts after response[:at] (none past
        the response's end)."""
        return next((j for j in range(k) if at + j >= len(response) or not self.accepted(j, response[at + j])), k)


@dataclass
class Trajectory:
    """One prompt: the target's greedy response and the draft's free run after every prefix of it."""

    prompt: list[int]
    response: list[int]
    runs: list[FreeRun]  # runs[i]: the draft after prompt + response[:i]
    max_new: int


def save_trajectories(trajs: list[Trajectory], path: Path) -> None:
    """Write trajectories as plain data (dicts, lists, numbers, tensors), which load_trajectories reads back
    without unpickling any class: a cache file copied from elsewhere cannot run code on the machine that reads it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save([dataclasses.asdict(t) for t in trajs], tmp)
    tmp.replace(path)


def load_trajectories(path: Path) -> list[Trajectory]:
    """The trajectories save_trajectories wrote; ValueError naming the file when it holds anything but plain data."""
    import pickle

    try:
        raw = torch.load(path, weights_only=True)
        return [Trajectory(**(t | {"runs": [FreeRun(**r) for r in t["runs"]]})) for t in raw]
    except (pickle.UnpicklingError, RuntimeError, TypeError, KeyError) as e:
        raise ValueError(f"{path} is not a replay cache of plain data (loading it would unpickle "
                         f"{str(e).splitlines()[0][:120]!r}...): delete it, and replay records the trajectories "
                         "again") from None


class RecordedStep(DraftStep):
    """A DraftStep read from a recording: the scalars are given, there are no (V,) logits."""

    def __init__(self, run: FreeRun, j: int):
        states = run.states
        super().__init__(j, run.tokens[j], None, None, None if states is None else states[j],
                         None if states is None else states[j + 1])
        self.__dict__.update(confidence=run.confidence[j], entropy=run.entropy[j], top1=run.top1[j])
        # under sampling the true acceptance probability, for the ceilings (decode.evaluation.ceilings.PerfectHead)
        self.alpha = None if run.accept is None else run.accept[j]
        self.uniform = None if run.uniform is None else run.uniform[j]  # the coin: accepted when uniform < alpha


@torch.no_grad()
def record(pair: Pair, prompt: list[int], max_new: int, kmax: int = 20, hidden: bool = True,
           seed: int = 0, stop_at_eos: bool = True) -> Trajectory:
    """Prompt ids -> its trajectory under the pair's sampling setting (the draft reads as the engine's does).

    Greedy: the target's greedy response and the draft's greedy run after every prefix (exact). Sampling (an
    estimate, module docstring): a response drawn from the target and, after every prefix, the draft's run of
    candidates drawn from q, with each one's acceptance probability under the target and a uniform.
    stop_at_eos=False records all max_new tokens through the EOS, as a section that decodes fixed lengths does."""
    s = pair.config.sampling
    sampled = s.temperature > 0
    # a seed per prompt: with one seed for all, every response starts from the same uniform, and one that lands in
    # the EOS token's mass (6% of it at the first step here) ended every response at once
    seed = seed * 1_000_003 + zlib.crc32(json.dumps(prompt).encode())
    response = Autoregressive(pair, seed=seed).generate(prompt, max_new, stop_at_eos=stop_at_eos).tokens
    gen, coins = torch.Generator(device=pair.device).manual_seed(seed + 1), torch.Generator().manual_seed(seed + 2)
    draft, target = Runner(pair.draft, pair, hidden=hidden, name="draft"), Runner(pair.target, pair)
    if len(prompt) > 1:
        draft.feed(prompt[:-1], last_only=True)
        if sampled:
            target.feed(prompt[:-1], last_only=True)
    seq, runs = list(prompt), []
    for i in range(len(response)):
        draft.crop(len(seq) - 1)
        logits, h = draft.feed([seq[-1]])  # the pending token, as a round after a rejection feeds it
        run, q_tok = FreeRun([], [], [], [], None), []
        states = [h[-1]] if hidden else []
        for j in range(min(kmax, max_new - i)):
            tok, q = pick(logits[-1], s, gen)  # the token and the scalars exactly as the engine's
            step = DraftStep(j, tok, q, logits[-1], None, None)
            run.tokens.append(tok), run.confidence.append(step.confidence), run.top1.append(step.top1)
            run.entropy.append(step.entropy), q_tok.append(q[tok])
            logits, h = draft.feed([tok])
            if hidden:
                states.append(h[-1])
        if sampled:
            target.crop(len(seq) - 1)
            p = transform(target.feed([seq[-1]] + run.tokens)[0], s)  # row j: the target's law at token j
            rows = torch.arange(len(run.tokens), device=p.device)
            run.accept = accept_prob(p[rows, run.tokens], torch.stack(q_tok).to(p.device)).float().tolist()
            run.uniform = torch.rand(len(run.tokens), generator=coins).tolist()
        run.states = torch.stack(states).float().cpu() if hidden else None
        runs.append(run)
        seq.append(response[i])
    return Trajectory(list(prompt), response, runs, max_new)


class ReadsRecording:
    """A ceiling (decode.evaluation.ceilings) that reads in replay what it reads of the target through the engine's
    view: the whole recording before the generation, and each round's recorded run before the round."""

    def recorded(self, traj: Trajectory, max_context: int) -> None:
        pass

    def recorded_round(self, run, at: int, response: list[int]) -> None:
        pass


def replay(traj: Trajectory, policy: Policy, max_context: int) -> tuple[list[tuple[str, int]], int]:
    """A policy's rounds over one trajectory -> the engine's call log and the number of new tokens.

    Mirrors decode.engine.SpeculativeDecoder.generate: the draft first reads what of the committed text and the
    pending token it has not read, a plain policy reads a candidate only to draft the next one, an "own" policy
    reads it before deciding, the target verifies k + 1 tokens, and both caches are cut back to the text.
    """
    T, y, out = len(traj.prompt), traj.response, 0
    calls = [("draft", T - 1), ("target", T - 1)] if T > 1 else []
    committed, draft_len = T - 1, T - 1
    reads = isinstance(policy, ReadsRecording)
    if reads:
        policy.recorded(traj, max_context)
    policy.start()
    while out < len(y):
        limit = max(1, min(traj.max_new - out, max_context - committed - 2))
        run = traj.runs[out]
        policy.reset()
        if reads:
            policy.recorded_round(run, out, y)
        calls.append(("draft", committed + 1 - draft_len))
        draft_len, k = committed + 1, 0
        own, head = policy.reads_own_state, isinstance(policy, HeadPolicy)
        while True:
            k += 1
            if k >= min(policy.max_len, limit, len(run.tokens)):  # the recording's candidates end the round too
                break
            if own:
                calls.append(("draft", 1))
                draft_len += 1
            stop = policy.stop(RecordedStep(run, k - 1))
            if head:
                calls.append(("head", 1))
            if stop:
                break
            if not own:
                calls.append(("draft", 1))
                draft_len += 1
        calls.append(("target", k + 1))
        n_acc = run.leading(y, out, k)
        policy.verified(n_acc, k)
        committed += 1 + n_acc
        draft_len = min(draft_len, committed)
        out += n_acc + 1
    return calls, min(out, len(y))


def target_alone_calls(traj: Trajectory) -> list[tuple[str, int]]:
    """The target alone's call log: the prompt, then one token at a time."""
    return [("target", len(traj.prompt))] + [("target", 1)] * (len(traj.response) - 1)


@dataclass
class CostLine:
    """A cost model of three numbers (ms): a draft step, a target forward of one token, each extra token; and a
    fourth, a head decision (0 if not given)."""

    draft_ms: float
    target_ms: float
    per_token_ms: float
    head_ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> CostLine:
        parts = [float(x) for x in text.split(",")]
        if len(parts) not in (3, 4) or min(parts) < 0:
            raise ValueError("--cost takes 'draft_ms,target_ms,per_token_ms[,head_ms]' (e.g. 1.20,4.99,0.21,0.04), "
                             f"got {text!r}")
        return cls(*parts)

    def call_ms(self, model: str, n: int, switched: bool = False) -> float:
        """A target forward of n tokens is target_ms + (n - 1) per_token_ms; the draft's grows in the same
        proportion (its prefill is a forward of the prompt, not one step per token); n head decisions n head_ms."""
        if model == "head":
            return n * self.head_ms
        target = self.target_ms + self.per_token_ms * (n - 1)
        return self.draft_ms * target / self.target_ms if model == "draft" else target

    def predict_s(self, calls: list[tuple[str, int]]) -> float:
        return 1e-3 * sum(self.call_ms(m, n) for m, n in calls)

    def costs(self, n_max: int = 21) -> tuple[float, list[float]]:
        """What CostAwareStop prices with: a draft step and the target verifying 1..n_max tokens."""
        return self.draft_ms, [self.call_ms("target", n) for n in range(1, n_max + 1)]

    def describe(self) -> str:
        return (f"draft step {self.draft_ms:g} ms, target {self.target_ms:g} ms + {self.per_token_ms:g} ms per extra "
                f"token, head decision {self.head_ms:g} ms")


def per_prompt(trajs: list[Trajectory], play: Callable[[Trajectory], tuple[list, int]], cost) -> tuple[np.ndarray, float]:
    """play(traj) -> (call log, new tokens), e.g. a policy's replay -> ((P,) predicted speedup over the target
    alone of each prompt, mean tokens per target call)."""
    ratios, per_call = [], []
    for traj in trajs:
        calls, n = play(traj)
        ratios.append(cost.predict_s(target_alone_calls(traj)) / cost.predict_s(calls))
        per_call.append(n / max(1, sum(1 for m, _ in calls if m == "target") - (len(traj.prompt) > 1)))
    return np.array(ratios), statistics.fmean(per_call)


def speedup(trajs: list[Trajectory], policy: Policy, cost, max_context: int) -> tuple[float, float]:
    """(mean over prompts of the predicted speedup over the target alone, mean tokens per target call)."""
    ratios, per_call = per_prompt(trajs, lambda t: replay(t, policy, max_context), cost)
    return float(ratios.mean()), per_call


def grid(heads: list[str]) -> dict[str, list[tuple[str, Callable[[], Policy]]]]:
    """family -> [(value, policy factory)]: wide grids, so that a value chosen on dev is not at an edge."""
    from decode.policies import AdaEDL, CostAwareStop, DraftConfidence, FixedK, SpecDecPP

    out = {"fixed-K": [(f"K={k}", functools.partial(FixedK, k)) for k in range(1, 11)],
           "draft-confidence": [(f"{c:g}", functools.partial(DraftConfidence, c)) for c in
                                (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)],
           "adaedl": [(f"lam={v:g}", functools.partial(AdaEDL, v)) for v in
                      (0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)]}
    for head in heads:
        name = Path(head).name
        out[f"SpecDec++ {name}"] = [(f"h={h:g}", functools.partial(SpecDecPP, head, h)) for h in
                                    (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)]
        out[f"cost-aware {name}"] = [("", functools.partial(CostAwareStop, head))]
    return out


def evaluate(trajs, families, cost, max_context: int) -> dict[str, list[tuple[str, np.ndarray, float]]]:
    """family -> [(value, (P,) predicted speedups per prompt, tokens per target call)] over the trajectories."""
    out = {}
    for family, values in families.items():
        rows = []
        for value, make in values:
            policy = make()
            if policy.needs_costs:
                policy.set_costs(*cost.costs(), head_ms=cost.head_ms)
            rows.append((value, *per_prompt(trajs, lambda t, p=policy: replay(t, p, max_context), cost)))
        out[family] = rows
    return out


class Priced:
    """A measured decode.costs.model.CostModel with the CostLine interface (predict_s, costs, describe)."""

    def __init__(self, model):
        self.model, self.head_ms = model, model.head

    def predict_s(self, calls):
        return self.model.predict_s(calls)

    def costs(self) -> tuple[float, list[float]]:
        """What decode.costs.model.measure_costs measures: a draft step after another, and the target verifying n
        tokens after a draft step."""
        return self.model.step["draft"][0], self.model.switched.get("target", self.model.step["target"])

    def describe(self) -> str:
        return self.model.describe()

