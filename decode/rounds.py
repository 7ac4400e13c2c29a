"""The steps both loops share, and what one round of the batched loop hands the round that drafts and verifies.

Both decode.engine (one sequence) and decode.batch (rows) set up with prepare(), bound each round with round_limit()
and commit a round's verdict, with its EOS and budget cut, through Texts.commit(). Round is the state decode.batch's
chain round (BatchDecoder._chain_round) and decode.tree.round's tree round read, as vLLM's SpecDecodeMetadata joins
its drafting and its rejection sampler. The loops keep their own drafting and verification calls: the one-sequence
loop's are leaner at batch 1, where the batched decoder read 4-6% slower (docs/batch.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from decode.costs import head_cost, measure_costs
from decode.policies import HeadPolicy, Policy
from decode.rules import kernel as rule_kernel
from heads import kernels

if TYPE_CHECKING:
    import torch

    from decode.cache.rows import RowCache
    from decode.control import BatchControl
    from decode.pair import Sampling
    from decode.results import Stats
    from decode.streams import Streams


def prepare(pair, policy, head: HeadPolicy | None) -> None:
    """What both loops do before decoding: compile the CPU kernels before any timed step, check that the head a policy
    or control reads was trained for this draft and setting, and hand a cost-aware policy the machine's step costs
    (a policy with no head prices none)."""
    kernels.warm(pair.vocab)  # the draft's softmax scalars
    rule_kernel.warm(pair.vocab)
    if head is not None:
        head.bind(pair.identity("draft"), pair.config.sampling)
    if isinstance(policy, Policy) and policy.needs_costs:
        policy.set_costs(*measure_costs(pair), head_ms=head_cost(pair))


def round_limit(left: int, committed: int, max_context: int) -> int:
    """The most tokens a row's next round may emit: its budget left, and the context, where the target verifies the
    pending token and the candidates after the committed text (at least 1: the next token)."""
    return max(1, min(left, max_context - committed - 2))


@dataclass
class Round:
    """One round's state over the B rows still decoding."""

    control: BatchControl  # how far to draft (a decode.tree.TreeShape in a tree round)
    sampling: Sampling
    now: Callable[[], float]  # the decoder's clock (synchronised on a GPU)
    draft: RowCache
    target: RowCache
    rows: list[int]  # (B,) the request index of each batch row
    text: Texts  # each request's committed text, pending token and output
    streams: Streams  # (B,) the rows' random streams, in batch order
    limits: list[int]  # (B,) the most tokens each row may still emit this round
    first: torch.Tensor | None  # (B, 1, V) the prefill's last logits, the first round's p_0; None after it
    stats: Stats  # the batch's counters, which the round adds to
    depth: int  # how far the control chose to draft: a chain's most candidates, a tree's levels


@dataclass
class Texts:
    """Each request's text as its batch decodes it: committed (what the caches keep), pending (its next token, which
    the target reads with the round's candidates), out (what it emitted), its end tokens and token budget."""

    committed: list[list[int]]
    pending: list[int]
    out: list[list[int]]
    eos: set[int]
    budget: int

    def commit(self, r: int, accepted: list[int], nxt: int) -> bool:
        """Request r keeps its pending token and accepted candidates and emits them and nxt -> whether it ended."""
        self.committed[r] += [self.pending[r]] + accepted
        new = accepted + [nxt]
        end = next((j for j, t in enumerate(new) if t in self.eos), None)
        self.out[r] += new[: None if end is None else end + 1]
        self.pending[r] = nxt
        if end is not None or len(self.out[r]) >= self.budget:
            del self.out[r][self.budget:]  # in place: a caller holding the row's list (the one-sequence loop) sees it
            return True
        return False

    def step(self, r: int, nxt: int) -> bool:
        """commit(r, [], nxt) of a plain target step, as lean as the target alone's."""
        self.committed[r].append(self.pending[r])
        self.out[r].append(nxt)
        self.pending[r] = nxt
        return nxt in self.eos or len(self.out[r]) >= self.budget
