"""Drafting control over a batch (decode.batch): how many candidates each round drafts, for every row at once.

A BatchControl answers three questions a round asks: how many candidates at most (begin: 0 means a plain target
step), whether to draft on after each candidate (decide, per deciding row), and what verification kept (verified).

    PerRow(policy)        any decode.policies policy, one copy per row (its state is the row's); a head policy's
                          probabilities come from one head forward over the rows per step
    BatchSizeK(table)     vLLM's dynamic rule: K by the number of rows still decoding, from a table chosen on dev
    BatchCostAware(head)  the batch-aware cost-aware controller: drafts on while the rows' expected extra tokens pay
                          for the extra draft step and the wider verify at this batch size, else stops; falls back to
                          K = 0 when no K pays (decode.costs.batch measures the tables)

A batch verifies every row at the width of its longest draft, so a row that stops before the others saves nothing:
the batch-level controllers draft every live row to the batch's K.

The interface and the controllers without cost tables live in decode.control.base, BatchCostAware and its progress
math in decode.control.cost_aware; this module names them all, as the decoder, configs and callers do.
"""

from decode.control.base import BatchControl, BatchSizeK, PerRow, RowsStep, control_of
from decode.control.cost_aware import (
    FACTOR_ROUNDS,
    LOOKAHEAD,
    PRIOR_ROUNDS,
    RECHECK_ROUNDS,
    BatchCostAware,
    acceptance,
    expected_max,
    level_progress,
    optimistic,
)

__all__ = ["FACTOR_ROUNDS", "LOOKAHEAD", "PRIOR_ROUNDS", "RECHECK_ROUNDS", "BatchControl", "BatchCostAware",
           "BatchSizeK", "PerRow", "RowsStep", "acceptance", "control_of", "expected_max", "level_progress",
           "optimistic"]
