"""Instruction prompts built offline from what the interpreter ships: requests an instruct model answers in chat.

    python -m data_gen.instruct            # prints the counts of every split and three examples

Three kinds, each split as data_gen.stdlib splits files (a hash of the source's name), so no request appears in
two splits:
- a stdlib function with a docstring becomes a coding request: "Write a Python function `name(args)` that ..." with
  the docstring's first paragraph;
- a stdlib module's docstring becomes a question about the module;
- a pydoc topic (the language reference's help topics) becomes a question about that part of the language.
HumanEval (data_gen.prompts) stays out of every split: it is the out-of-distribution test set.

A second set, instruct-packages, makes the same coding requests and module questions from the installed packages the
project depends on (PACKAGES). It has a train split only, for training a draft on more distinct instructions than the
stdlib holds; what it holds follows the installed versions, so a run stores the prompts it answered (train.distill).
"""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

from data_gen.stdlib import SPLITS, read_source, split_of, stdlib_files, stdlib_root

MIN_WORDS = 6  # a docstring's first paragraph shorter than this says too little to ask for
MAX_CHARS = 600


def _paragraph(doc: str | None) -> str | None:
    """A docstring's first paragraph on one line, or None when it is too short to make a request of."""
    if not doc:
        return None
    first = " ".join(doc.strip().split("\n\n")[0].split())
    return first[:MAX_CHARS] if len(first.split()) >= MIN_WORDS else None


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
    args += [f"*{node.args.vararg.arg}"] if node.args.vararg else []
    args += [a.arg for a in node.args.kwonlyargs]
    args += [f"**{node.args.kwarg.arg}"] if node.args.kwarg else []
    return f"{node.name}({', '.join(args)})"


# the project's own dependencies (pyproject.toml), so wherever it is installed they are
PACKAGES = ("torch", "transformers", "lightning", "jsonargparse", "tokenizers", "datasets", "torchmetrics", "sklearn",
            "safetensors", "matplotlib", "yaml", "tqdm", "numba", "gguf", "accelerate", "numpy")


def _public(parts: tuple[str, ...]) -> bool:
    """A package file's path parts (folders, then the file) name public, shipped code: no private folder or module, no
    tests or test helpers, no vendored copy of another project."""
    stems = [q.removesuffix(".py") for q in parts]
    return not any((q.startswith("_") and q != "__init__") or q.startswith("test") or "testing" in q or "vendor" in q
                   or q in ("externals", "conftest") for q in stems)


def stdlib_requests(split: str) -> list[dict]:
    """Every coding request and module question of one split, in file order then line order (deterministic)."""
    return _requests(stdlib_root(), stdlib_files(split), "")


def package_records(split: str = "train") -> list[dict]:
    """instruct-packages: the coding requests and module questions of PACKAGES' files (train only), each prompt once."""
    import importlib.util

    if split != "train":
        raise ValueError(f"instruct-packages has only the split 'train' (it trains drafts), not {split!r}")
    out, seen = [], set()
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        # a package's folders (a namespace package has several), or a module's one file
        roots = [Path(p) for p in spec.submodule_search_locations or []]
        files = [(root.parent, f) for root in roots for f in sorted(root.rglob("*.py"))
                 if _public(f.relative_to(root.parent).parts)]
        if not roots and spec.origin and spec.origin.endswith(".py"):
            files = [(Path(spec.origin).parent, Path(spec.origin))]
        for top, f in files:
            for r in _requests(top, [f], "site:"):
                if r["prompt"] not in seen:  # generated model files repeat their docstrings
                    seen.add(r["prompt"])
                    # named by the prompt, not a line: an answer store outlives the installed versions
                    out.append({**r, "id": f"{r['source']}:{hashlib.sha256(r['prompt'].encode()).hexdigest()[:12]}"})
    return out


def _requests(root: Path, files: list[Path], prefix: str) -> list[dict]:
    """The coding requests and module questions of some .py files under root, ids prefixed."""
    out = []
    for path in files:
        local = path.relative_to(root).as_posix()
        rel = prefix + local
        try:
            tree = ast.parse(read_source(path))
        except SyntaxError:
            continue
        module = local[:-3].replace("/", ".").removesuffix(".__init__")
        about = _paragraph(ast.get_docstring(tree))
        if about and not module.split(".")[-1].startswith("_"):
            out.append({"id": f"{rel}:module", "source": rel,
                        "prompt": f"What is the Python module `{module}` for? Its documentation begins: \"{about}\" "
                                  "Explain it briefly and show a short example of using it."})
        for node in sorted((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                           key=lambda n: n.lineno):
            what = _paragraph(ast.get_docstring(node))
            if what is None or node.name.startswith("_"):
                continue
            out.append({"id": f"{rel}:{node.lineno}", "source": rel,
                        "prompt": f"Write a Python function `{_signature(node)}`. {what}"})
    return out


def topic_requests(split: str) -> list[dict]:
    """pydoc's help topics of one split as questions about the language."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        if split_of(f"pydoc:{name}") != split:
            continue
        text = " ".join(topics[name].split())
        head = re.split(r"(?<=[.:])\s", text, maxsplit=1)[0][:200]
        out.append({"id": f"pydoc:{name}", "source": "pydoc_data.topics",
                    "prompt": f"In Python, what does the language reference say about {name.replace('-', ' ')}? "
                              f"It starts: \"{head}\" Explain it with a small example."})
    return out


def instruct_records(split: str) -> list[dict]:
    """Every instruction of one split: coding requests and module questions, then pydoc topics."""
    if split not in SPLITS:
        raise ValueError(f"instruct has splits {SPLITS}, not {split!r}")
    return stdlib_requests(split) + topic_requests(split)


def main() -> None:
    for split in SPLITS:
        rows = instruct_records(split)
        print(f"instruct {split:5s} {len(rows):6d} prompts")
    print(f"instruct-packages train {len(package_records()):6d} prompts")
    for row in instruct_records("dev")[:3]:
        print("  ", row["id"], "|", row["prompt"][:160])


if __name__ == "__main__":
    main()
