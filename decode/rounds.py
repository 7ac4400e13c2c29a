"""What one round of the batched loop hands the round that drafts and verifies: decode.batch's chain round
(BatchDecoder._chain_round) and decode.tree's tree round read the same state, as vLLM's SpecDecodeMetadata joins
its drafting and its rejection sampler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from decode.batch import Texts
    from decode.batch_control import BatchControl
    from decode.generation import Stats
    from decode.pair import Sampling
    from decode.rowcache import RowCache
    from decode.streams import Streams


@dataclass
class Round:
    """One round's state over the B rows still decoding."""

    control: BatchControl  # how far to draft (a decode.tree_shapes.TreeShape in a tree round)
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
