"""The package layout the architecture promises: the engine a user imports (decode/*.py) reads nothing from
evaluation (decode/evaluation) or training (train/), evaluation reads nothing from training, decode's subpackages
stand in layers (each imports only the layers below it), and no two modules import each other."""

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


# decode's rooms by layer: a module imports only its own layer's foundations or layers below it
LAYERS = [
    {"decode", "decode.pair", "decode.gguf", "decode.prompting", "decode.sampling", "decode.streams", "decode.labels",
     "decode.clock", "decode.allocator", "decode.results", "decode.cache", "decode.cut", "decode.checks",
     "decode.vocab"},  # foundations: models, caches, maths
    {"decode.rules", "decode.policies"},  # verification; how far to draft, one round at a time
    {"decode.costs"},  # what drafting and verifying cost on this machine
    {"decode.control"},  # how far to draft over a batch
    {"decode.rounds"},  # the state a round of the batched loop hands its round
    {"decode.tree"},  # token trees: shapes and their round
    {"decode.batch"},  # the batched loop
    {"decode.engine"},  # the one-sequence loop (a token tree goes to the batched one as a batch of one row)
    {"decode.hf"},  # Hugging Face assisted generation driven by a head
    {"decode.evaluation"},  # the bench, its cost model and reports
    {"decode.__main__"},  # the command line
]


def test_decodes_subpackages_stand_in_layers():
    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    level = {name: i for i, names in enumerate(LAYERS) for name in names}
    graph = imports()
    assert {room(m) for m in graph if m.startswith("decode")} <= set(level), "a decode room no layer names"
    for m, deps in graph.items():
        if not m.startswith("decode"):
            continue
        for d in deps:
            if d.startswith("decode") and room(d) != room(m):
                up = level[room(d)] > level[room(m)]
                across = level[room(d)] == level[room(m)] and level[room(m)] > 0
                assert not up and not across, f"{m} imports {d}: layer {level[room(m)]} reaching layer {level[room(d)]}"
