"""What the project's Lightning commands print: its own lines, Lightning's progress and results, nothing else.

Lightning and the libraries under it log lines that describe themselves, not the user's run: an advert for a
logging product, a note that it loads a dataloader to count steps, and deprecations that Lightning's own code
triggers in torch. Each is dropped where it arises, by its logger and its message, never by hiding warnings
wholesale: a warning about the user's data or configuration still shows.

A labelling run that `train fit` starts for a missing label set runs nested (SPECHEADS_NESTED=1 in its
environment): the device and seed lines that the outer run has already printed are dropped there too, so each
message appears once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

NESTED = "SPECHEADS_NESTED"

# Lightning's info lines (logger lightning.pytorch.utilities.rank_zero) that say nothing about this run.
ADVERTS = ("💡 Tip:", "Loading `train_dataloader` to estimate number of stepping batches")
# Lines a nested run repeats after its parent: the device summary and the global seed.
REPEATS = ("GPU available:", "TPU available:", "HPU available:", "Seed set to")


class DropLines(logging.Filter):
    """Drops log records whose message starts with one of `starts`."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.starts)


def quiet_lightning() -> None:
    """Install the filters (idempotent). Called by the entry points of `train` and `data_gen`."""
    starts = ADVERTS + (REPEATS if os.environ.get(NESTED) == "1" else ())
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.fabric.utilities.seed"):
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, DropLines)]:
            logger.removeFilter(f)
        logger.addFilter(DropLines(starts))
    # torch deprecates LeafSpec; Lightning's pytree helper still builds one on every batch it moves.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    # jsonargparse deprecates APIs that LightningCLI's own code still calls (skip_none, add_instantiator, ...).
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"lightning\.pytorch\.cli")


@contextlib.contextmanager
def own_args(args):
    """A LightningCLI given `args` reads them, not the command line: Lightning warns when both are present (a
    command such as `python -m train sweep` builds the fit arguments itself), so the command line is set aside."""
    if args is None:
        yield
        return
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        yield
    finally:
        sys.argv = argv
