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


def test_the_front_door_names_the_public_api_and_loads_nothing_until_asked():
    """`import decode` lists the public API in __all__, every name resolves to the class or function it names, and
    the import itself loads no model library (python -m decode sets its defaults before transformers loads)."""
    import subprocess
    import sys

    code = ("import sys, decode; assert 'torch' not in sys.modules and 'transformers' not in sys.modules; "
            "print(len(decode.__all__)); [getattr(decode, n) for n in decode.__all__]; "
            "assert decode.SpeculativeDecoder.__module__ == 'decode.engine'")
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert int(got.stdout) >= 30


def test_nothing_cites_a_file_the_repository_does_not_hold():
    """Every relative link of the README and docs names a file that exists; no file cites the design outside it."""
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), (page.name, target)
    texts = [p.read_text() for p in pages + sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))]
    assert not [t for t in texts if "DESIGN.md" in t]
