"""The Python standard library of the running interpreter as a corpus, split by file.

    python -m data_gen.stdlib          # prints the file counts and sizes per split

Tests, site-packages and generated data files are left out. The split is a hash of the
file's path relative to the stdlib root, so it is the same on every machine with the same
interpreter version and no function can appear in two splits.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

SPLITS = ("train", "dev", "test")
# Percent of files per split, in the order of SPLITS.
SPLIT_PERCENT = (90, 5, 5)
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
# Larger files are tables or generated data (unicode maps, pydoc topics), not code.
MAX_FILE_BYTES = 300_000


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """Stable split of one file, from the hash of its stdlib-relative path."""
    bucket = int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % 100
    edge = 0
    for name, pct in zip(SPLITS, SPLIT_PERCENT):
        edge += pct
        if bucket < edge:
            return name
    raise AssertionError("split percentages must sum to 100")


def stdlib_files(split: str | None = None) -> list[Path]:
    """Sorted .py files of the stdlib (all splits when split is None)."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    root = stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        if rel.parts[0].startswith("config-"):
            continue
        if split is None or split_of(rel.as_posix()) == split:
            out.append(path)
    return out


def read_source(path: Path) -> str:
    """File text, undecodable bytes replaced (a few stdlib files are latin-1)."""
    return path.read_bytes().decode("utf-8", errors="replace")


def main() -> None:
    for split in SPLITS:
        files = stdlib_files(split)
        size = sum(f.stat().st_size for f in files)
        print(f"{split:5s} {len(files):4d} files {size / 1e6:6.2f} MB")


if __name__ == "__main__":
    main()
