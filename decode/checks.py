"""The shared pieces of decode's one-line refusals: what counts as a whole or a real number, and the line of a
library's error worth quoting."""

from __future__ import annotations

import numbers


def is_whole(v) -> bool:
    """A whole number: Python's or numpy's integers, never a bool (True is 1 to Python, a mistake to a caller)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v) -> bool:
    """A real number: Python's or numpy's, never a bool (a comparison with a string fails inside Python, not here)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def first_line(e: Exception) -> str:
    """An error's first non-empty line, whitespace folded and cut to 200 characters (a library's report can run to
    dozens of lines)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return " ".join((lines[0] if lines else type(e).__name__).split())[:200]
