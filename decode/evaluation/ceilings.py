"""Ceilings that no drafting policy can beat, so that a "share of the gap closed" is measured against a limit.

    calls, n = hindsight(traj, cost, max_context)     # the cheapest call log that emits the recorded response
    PerfectHead()                                     # the cost-aware stop fed each candidate's true alpha
    HindsightOracle()                                 # hindsight's rounds as a policy the engine decodes with
    Oracle()                                          # greedy: draft up to the first disagreement

- hindsight: the round boundaries chosen by dynamic programming over what the recording knows of every candidate
  (under greedy, whether it equals the target's token; under sampling, whether its uniform falls below its
  acceptance probability, the coin that decides it) and the cost model's price of every round. Rounds cost what
  they cost in replay (decode.evaluation.replay.replay): the draft reads the pending token (and the last
  candidate when the previous round was accepted whole), drafts k candidates, the target verifies k + 1. It
  never drafts a candidate it knows is rejected unless a cheaper verify size makes that pay, and it drafts
  past its first sure token only while the cost model says so. Under greedy it is exact, and at or above every
  policy replayed on the same trajectories and cost model: each of them chooses among the same rounds.
- PerfectHead: the best any acceptance head can do with the cost-aware rule, fed alpha = min(1, p/q), the
  probability the target accepts the candidate (known only to the target). Replay of a sampled recording supplies
  it, and so does the engine, which runs the target over each candidate's prefix off the books (the bench's
  sampling sections). Under greedy alpha is the agreement itself, and the hindsight oracle is the limit.
"""

from __future__ import annotations

import torch

from decode.evaluation.replay import ReadsRecording, Trajectory, per_prompt, record
from decode.labels import accept_prob
from decode.policies import Policy, RenewalStop, check_max_len
from decode.sampling import transform


class Oracle(Policy, ReadsRecording):
    """The first-disagreement oracle (SpecDec++ Thm 4.1), greedy: draft exactly up to the first candidate that
    differs from the target's token. peek(i) answers whether candidate i equals it: the one-sequence decoder's
    view of the target (off the books, not a target call) or replay's recording."""

    sees_target = True

    def __init__(self, max_len: int = 20):
        self.max_len = check_max_len(max_len)
        self.peek = None
        self.drafted: list[int] = []

    def bind_view(self, view) -> None:
        super().bind_view(view)
        self.peek = lambda i: int(view.logits_after(view.prefix + self.drafted[:i]).argmax()) == self.drafted[i]

    def recorded_round(self, run, at, response):  # (a decoder binds its view, and so its peek, again on generating)
        self.peek = lambda j: at + j < len(response) and run.tokens[j] == response[at + j]

    def reset(self):
        self.drafted = []

    def stop(self, step):
        self.drafted.append(step.token)
        return not self.peek(step.index)


class PerfectHead(RenewalStop, ReadsRecording):
    """CostAwareStop's rule on each candidate's true acceptance probability: step.alpha from replay under sampling,
    or min(1, p/q) from the one-sequence decoder's view of the target, off the books."""

    sees_target = True

    def recorded(self, traj, max_context):
        self.view = None  # replay supplies alpha under sampling, and nothing under greedy: never a stale view's

    def reset(self):
        super().reset()
        self.drafted: list[int] = []

    def stop(self, step):
        self.drafted.append(step.token)
        alpha = getattr(step, "alpha", None)
        if alpha is None and self.view is None:
            raise ValueError("PerfectHead reads each candidate's true acceptance probability, which replay supplies "
                             "only under sampling: replay a sampled setting, or decode with SpeculativeDecoder")
        return self.given(self.alpha(step) if alpha is None else alpha)

    def alpha(self, step) -> float:
        """min(1, p/q) of the candidate after the round's prefix (q is its one-hot under greedy on the CPU)."""
        v = self.view
        p = transform(v.logits_after(v.prefix + self.drafted[:-1])[None], v.pair.config.sampling)[0]
        q = torch.ones(()) if step.q is None else step.q[step.token]
        return float(accept_prob(p[step.token], q.to(p.device)))


def round_calls(feed: int, k: int) -> list[tuple[str, int]]:
    """A round's call log: the draft reads `feed` tokens, drafts k candidates (reading k - 1 of them), the target
    verifies k + 1."""
    return [("draft", feed)] + [("draft", 1)] * (k - 1) + [("target", k + 1)]


def round_prices(cost, kmax: int) -> dict[tuple[int, int], float]:
    """(feed, k) -> seconds of that round after a target call (the state every round starts in)."""
    base = cost.predict_s([("target", 1)])
    return {(feed, k): cost.predict_s([("target", 1)] + round_calls(feed, k)) - base
            for feed in (1, 2) for k in range(1, kmax + 1)}


def hindsight(traj: Trajectory, cost, max_context: int) -> tuple[list[tuple[str, int]], int]:
    """A trajectory and a cost model (predict_s over a call log) -> the cheapest call log and its new tokens.

    State: tokens out so far and how many tokens the draft reads first (1, or 2 after a round accepted whole);
    from each state every round length the recording and the context allow, as replay() bounds it."""
    y, T = traj.response, len(traj.prompt)
    kmax = max(len(r.tokens) for r in traj.runs)
    price = round_prices(cost, kmax)
    best: dict[tuple[int, int], tuple[float, int]] = {}  # (out, feed) -> (seconds to the end, k)
    for out in range(len(y) - 1, -1, -1):
        run = traj.runs[out]
        limit = max(1, min(traj.max_new - out, max_context - (T - 1 + out) - 2))
        agree = run.leading(y, out, len(run.tokens))
        for feed in (1, 2):
            options = []
            for k in range(1, min(len(run.tokens), limit) + 1):
                n = min(k, agree)
                nxt = out + n + 1
                rest = best[(nxt, 2 if n == k else 1)][0] if nxt < len(y) else 0.0
                options.append((price[(feed, k)] + rest, k))
            best[(out, feed)] = min(options)
    calls = [("draft", T - 1), ("target", T - 1)] if T > 1 else []
    out, feed = 0, 1
    while out < len(y):
        k = best[(out, feed)][1]
        calls += round_calls(feed, k)
        n = traj.runs[out].leading(y, out, k)
        out, feed = out + n + 1, 2 if n == k else 1
    return calls, min(out, len(y))


def hindsight_speedups(trajs: list[Trajectory], cost, max_context: int):
    """decode.evaluation.replay.per_prompt() of the hindsight oracle: ((P,) speedups, tokens per target call)."""
    return per_prompt(trajs, lambda t: hindsight(t, cost, max_context), cost)


class StepCosts:
    """A draft step and the target's verify table (what a decoder hands set_costs) priced as a call log: a
    draft call costs a step (it reads one or two tokens; the prompt's prefill is the same in every plan)."""

    def __init__(self, draft_ms: float, verify_ms: list[float]):
        self.draft_ms, self.verify_ms = draft_ms, list(verify_ms)

    def predict_s(self, calls: list[tuple[str, int]]) -> float:
        v, slope = self.verify_ms, (self.verify_ms[-1] - self.verify_ms[0]) / max(1, len(self.verify_ms) - 1)
        return 1e-3 * sum(self.draft_ms if m == "draft" else v[n - 1] if n <= len(v) else v[-1] + slope * (n - len(v))
                          for m, n in calls)


class HindsightOracle(Policy, ReadsRecording):
    """Greedy only: decode with the rounds hindsight() finds, so the bench's oracle is the cost-optimal limit.

    When a generation starts (start) it reads the prompt from the engine's view of the target, records the target's
    greedy response and the draft's run after every prefix, off the books, and chooses every round's length by
    dynamic programming over the decoder's measured step costs. Under greedy decoding the engine then meets the
    recorded rounds; in bfloat16 its verify of k + 1 tokens can round a near-tie of the target's top two logits
    the other way than the recording's forward did, and where the text leaves the recording the rest is recorded
    and planned again from there."""

    sees_target = True
    needs_costs = True

    def __init__(self, max_len: int = 20):
        self.max_len = check_max_len(max_len)
        self.cost: StepCosts | None = None
        self.rounds: list[int] = []

    def set_costs(self, draft_ms: float, verify_ms: list[float], head_ms: float = 0.0) -> None:
        self.cost = StepCosts(draft_ms, verify_ms)  # it decides with no head

    def plan(self, pair, prompt: list[int], max_new: int, stop_at_eos: bool = True) -> None:
        """Record the generation ahead (decode.evaluation.replay.record; through the EOS as the generation decodes)
        and plan its rounds."""
        if pair.config.sampling.temperature > 0:
            raise ValueError("HindsightOracle plans greedy decoding only (a sampled text differs from any recording): "
                             "decode with temperature 0, or compare sampling policies in replay against its ceilings")
        self.plan_rounds(record(pair, prompt, max_new, self.max_len, hidden=False, stop_at_eos=stop_at_eos),
                         pair.config.max_context)

    def recorded(self, traj, max_context):
        self.view = None  # replay: plan from the recording (a decoder binds its view again before its generation)
        self.plan_rounds(traj, max_context)

    def plan_rounds(self, traj: Trajectory, max_context: int) -> None:
        if self.cost is None:
            raise ValueError("HindsightOracle has no step costs: decode with SpeculativeDecoder, which measures them")
        calls = hindsight(traj, self.cost, max_context)[0]
        self.rounds = [n - 1 for m, n in calls[2 if len(traj.prompt) > 1 else 0:] if m == "target"]
        self.recording, self.round = (traj.prompt, traj.response), 0

    def start(self):
        """A generation begins: with a view of the target, record it ahead and plan its rounds, off the books."""
        if self.view is not None:
            self.view.off_books(self.plan, self.view.pair, self.view.prompt, self.view.max_new, self.view.stop_at_eos)
        self.round = 0

    def stop(self, step):
        if step.index == 0 and self.view is not None and self.left_recording():
            v = self.view  # the round's prefix is the prompt and every token out so far
            self.view.off_books(self.plan, v.pair, v.prefix, v.max_new - (len(v.prefix) - len(v.prompt)), v.stop_at_eos)
        return step.index + 1 >= self.rounds[self.round]

    def left_recording(self) -> bool:
        """Has the decoded text left the recorded response (or its planned rounds), as a bfloat16 near-tie can make
        it? The round's prefix is the recording's prompt and the tokens out since."""
        (prompt, response), prefix = self.recording, self.view.prefix
        out = prefix[len(prompt):]
        return (self.round >= len(self.rounds) or prefix[:len(prompt)] != prompt
                or out != response[:len(out)])

    def verified(self, accepted, drafted):
        self.round += 1
