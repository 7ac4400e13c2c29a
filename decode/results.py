"""What a decoder returns (Generation and its Stats, docs/design.md's metrics) and the checks every decoder makes of a
request before it decodes: the one-sequence engine (decode.engine) and the batched one (decode.batch) share them."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from decode.pair import Pair


@dataclass
class Stats:
    """Counters of one or more generations (docs/design.md's metrics)."""

    new_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    discarded: int = 0
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)
    calls: list[tuple[str, int]] = field(default_factory=list)  # (model, tokens fed) per forward: the cost model's log
    t_draft: float = 0.0
    t_target: float = 0.0
    t_head: float = 0.0
    t_sample: float = 0.0  # the draft's sampling transform and draws
    t_rule: float = 0.0  # the target's sampling transform and the verification rule
    t_oracle: float = 0.0  # the oracle's off-the-books look-ahead, excluded from wall
    t_stream: float = 0.0  # the caller's on_tokens (the CLI prints text there): in wall, not the engine's work
    wall: float = 0.0

    def add(self, other: Stats) -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)

    def summary(self) -> dict:
        n = max(1, self.new_tokens)
        return {"new_tokens": self.new_tokens, "tokens_per_s": self.new_tokens / max(self.wall, 1e-9),
                "discard_rate": self.discarded / n, "verification_rate": self.target_calls / n,
                "mean_accepted": sum(self.accepted) / max(1, len(self.accepted)),
                "nodes_per_round": self.drafted / max(1, self.rounds),  # a chain's candidates, a tree's nodes verified
                "target_calls": self.target_calls, "draft_calls": self.draft_calls, "wall_s": self.wall,
                "t_draft_s": self.t_draft, "t_target_s": self.t_target, "t_head_s": self.t_head,
                "t_sample_s": self.t_sample, "t_rule_s": self.t_rule, "t_stream_s": self.t_stream,
                "t_other_s": max(0.0, self.wall - self.t_draft - self.t_target - self.t_head - self.t_sample
                                 - self.t_rule - self.t_stream)}

    def profile(self) -> str:
        """Where the wall time went, as shares: forwards, head, sampling, rule, bookkeeping, streaming.

        The engine's overhead is what it adds to the model forwards; the caller's streaming is shown beside it,
        not in it (the bench streams nothing).
        """
        s, wall = self.summary(), max(self.wall, 1e-9)
        parts = [("draft forward", s["t_draft_s"]), ("target forward", s["t_target_s"]), ("head", s["t_head_s"]),
                 ("draft sampling", s["t_sample_s"]), ("rule", s["t_rule_s"]), ("bookkeeping", s["t_other_s"]),
                 ("streaming", s["t_stream_s"])]
        overhead = wall - s["t_draft_s"] - s["t_target_s"] - s["t_stream_s"]
        return (", ".join(f"{name} {100 * t / wall:.1f}%" for name, t in parts)
                + f"; engine overhead (wall minus model forwards and streaming) {100 * overhead / wall:.1f}%"
                + f" of {wall:.3f} s")


@dataclass
class Generation:
    """What generate() returns: new token ids, their text, and the counters."""

    tokens: list[int]
    text: str
    stats: Stats


def token_ids(ids, where: str = "") -> list[int]:
    """A prompt as a list of Python ints (from a list, tuple, numpy array or 1-D tensor of integer ids), or a
    one-line ValueError that says what it is instead."""
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):  # a numpy array or a tensor
        if getattr(ids, "ndim", 1) != 1:
            raise ValueError(f"{where}a prompt is a 1-D sequence of token ids, got an array of shape {tuple(ids.shape)}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise ValueError(f"{where}a prompt is a list of token ids, got {type(ids).__name__}: encode text with the pair's "
                         "tokenizer (pair.encode)")
    bad = next((x for x in ids if isinstance(x, bool) or not isinstance(x, numbers.Integral)), None)
    if bad is not None:
        raise ValueError(f"{where}token ids are integers, got {bad!r}: encode text with the pair's tokenizer (pair.encode)")
    return [int(x) for x in ids]


def check_prompt(pair: Pair, prompt_ids: list[int], max_new_tokens: int, row: int | None = None) -> list[int]:
    """Refuse, in one line that says how to fix it, a prompt or budget the decoders cannot serve -> the prompt as a
    list of ints (token_ids); row names the prompt's place in a batch request."""
    where = "" if row is None else f"prompt {row} of the batch: "
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: give a whole number of new tokens, 0 or more")
    prompt_ids = token_ids(prompt_ids, where)
    if len(prompt_ids) == 0:
        raise ValueError(f"{where}the prompt is empty: give at least one token of text to continue")
    low, high = min(prompt_ids), max(prompt_ids)
    if low < 0 or high >= pair.vocab:
        bad = low if low < 0 else high
        raise ValueError(f"{where}token id {bad} is outside the pair's vocabulary of {pair.vocab} ids: encode the "
                         f"text with the pair's tokenizer (pair.encode)")
    limit = pair.config.max_context
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(f"{where}prompt of {len(prompt_ids)} tokens + max_new_tokens={max_new_tokens} exceeds the "
                         f"context of {limit} tokens of pair {pair.config.name}: shorten the prompt or lower max_new_tokens")
    return prompt_ids


def check_prompts(pair: Pair, prompts, max_new_tokens: int) -> list[list[int]]:
    """check_prompt over a batch request, naming the row at fault -> the prompts as lists of ints (a 2-D array or
    tensor gives one prompt per row)."""
    if hasattr(prompts, "tolist") and getattr(prompts, "ndim", 0) == 2:
        prompts = prompts.tolist()
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or \
            (len(prompts) and isinstance(prompts[0], numbers.Integral)):
        raise ValueError("prompts must be a list of token-id lists (one per row): wrap a single prompt as [ids]")
    return [check_prompt(pair, ids, max_new_tokens, row=i) for i, ids in enumerate(prompts)]
