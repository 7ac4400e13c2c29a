"""The package layout the architecture promises: the engine a user imports (decode/*.py) reads nothing from
evaluation (decode/evaluation) or training (train/), evaluation reads nothing from training, and no two
modules import each other."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("decode", "train", "data_gen", "heads")


def imports() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file, lazy imports included)."""
    out = {}
    for f in sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            deps |= {n for n in names if n.split(".")[0] in PACKAGES}
        out[name] = deps
    return out


def test_engine_imports_no_evaluation_and_no_training():
    graph = imports()
    engine = [m for m in graph if m.startswith("decode") and not m.startswith("decode.evaluation")
              and m != "decode.__main__"]
    assert "decode.engine" in engine and "decode.evaluation.bench" in graph
    for m in engine:
        assert not {d for d in graph[m] if d.startswith(("decode.evaluation", "train"))}, m
    for m in (m for m in graph if m.startswith("decode.evaluation")):
        assert not {d for d in graph[m] if d.startswith("train")}, m
    assert not {d for m in graph if m.startswith("heads") for d in graph[m] if not d.startswith("heads")}


def test_no_two_modules_import_each_other():
    graph = imports()
    pairs = {tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph.get(b, ())}
    assert not pairs, pairs
