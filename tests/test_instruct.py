"""The instruct prompt sets (data_gen.instruct) and how a distillation cycle draws its batches (train.distill): the
stdlib's requests stay split by file, the package requests form a train-only set of unique prompts, and a cycle
trains on each new answer before any twice."""

import random
import re
import sys
from collections import Counter

import pytest

from data_gen import instruct
from data_gen.prompts import PromptSet
from train.distill import Recipe, batches


@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    """Importable packages with documented functions: two with a repeated (generated) docstring, private, test and
    vendored parts, a namespace package in two folders and a single-file module."""
    doc = "Return the number of widgets in the given box, counting nested boxes."
    for name in ("alpha", "beta"):
        pkg = tmp_path / name
        for sub in ("tests", "_private", "externals", "test_utils"):
            (pkg / sub).mkdir(parents=True)
            (pkg / sub / "mod.py").write_text(f'def hidden(x):\n    """{doc} Hidden in {sub}."""\n')
        (pkg / "testing_utils.py").write_text(f'def helper(x):\n    """{doc} A test helper."""\n')
        (pkg / "__init__.py").write_text(f'"""The {name} package computes widget counts for boxes of all kinds."""\n')
        (pkg / "core.py").write_text(f'def count(box):\n    """{doc}"""\n\n\ndef _hidden(x):\n    """{doc} Privately."""\n\n'
                                     f'def short(x):\n    """Too short."""\n\n\ndef {name}_only(x, *rest, key=None):\n'
                                     f'    """Make one {name} widget from x and the rest, keyed as asked by the caller."""\n')
    for part in ("a", "b"):  # a namespace package: no __init__, two folders
        (tmp_path / part / "nsp").mkdir(parents=True)
        (tmp_path / part / "nsp" / f"part_{part}.py").write_text(f'def from_{part}(x):\n    """{doc} From {part}."""\n')
        monkeypatch.syspath_prepend(str(tmp_path / part))
    (tmp_path / "single.py").write_text(f'def one(x):\n    """{doc} From one file."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(instruct, "PACKAGES", ("alpha", "beta", "nsp", "single", "not_installed_anywhere"))
    for name in ("alpha", "beta", "nsp", "single"):
        sys.modules.pop(name, None)


def test_package_requests_are_a_train_only_set_of_unique_public_prompts(fake_packages):
    rows = instruct.package_records()
    where = [r["id"].rsplit(":", 1)[0] for r in rows]
    assert sorted(where) == ["site:alpha/__init__.py", "site:alpha/core.py", "site:alpha/core.py", "site:beta/__init__.py",
                     "site:beta/core.py", "site:nsp/part_a.py", "site:nsp/part_b.py", "site:single.py"]
    assert all(re.fullmatch(r"[0-9a-f]{12}", r["id"].rsplit(":", 1)[1]) for r in rows)  # beta's count() repeats alpha's
    assert len({r["id"] for r in rows}) == len(rows) == len({r["prompt"] for r in rows})
    text = " | ".join(r["prompt"] for r in rows)
    assert "`alpha_only(x, *rest, key)`" in text and "module `beta` for" in text and "Hidden" not in text
    again = instruct.package_records()  # an id names its prompt, wherever the installed version puts it
    assert [r["id"] for r in again] == [r["id"] for r in rows]
    assert len(PromptSet("instruct-packages", "train").load()) == 8
    with pytest.raises(ValueError, match="only the split 'train'"):
        PromptSet("instruct-packages", "dev").load()
    with pytest.raises(ValueError, match="choose one of .*instruct-packages"):
        PromptSet("instruct-pkgs", "train").load()


def test_a_recipe_names_further_prompt_sets_as_a_list():
    assert Recipe(target={"path": "x.gguf"}, out="d", also=["instruct-packages"]).also == ["instruct-packages"]
    for bad in ("instruct-packages", [""], [3]):
        with pytest.raises(ValueError, match="recipe field also lists prompt sets"):
            Recipe(target={"path": "x.gguf"}, out="d", also=bad)
    for bad in (["instruct-pkgs"], ["jsonl"]):  # told before the target loads
        with pytest.raises(ValueError, match="name prompt sets .*got 'instruct-pkgs'|got 'jsonl'"):
            Recipe(target={"path": "x.gguf"}, out="d", also=bad)


def test_a_cycle_trains_on_every_new_answer_before_any_twice():
    recipe = Recipe(target={"path": "x.gguf"}, out="d", batch=5, steps_per_cycle=4, replay=0.0)
    new = [{"n": i} for i in range(7)]
    drawn = [x["n"] for b in batches(new, [{"n": -1}], recipe, random.Random(0)) for x in b]
    assert len(drawn) == 20 and sorted(drawn[:7]) == sorted(drawn[7:14]) == list(range(7))
    half = Recipe(target={"path": "x.gguf"}, out="d", batch=50, steps_per_cycle=20, replay=0.5)
    drawn = Counter(x["n"] for b in batches(new, [{"n": -1}], half, random.Random(1)) for x in b)
    assert 0.45 < drawn[-1] / 1000 < 0.55 and max(drawn[i] for i in range(7)) - min(drawn[i] for i in range(7)) <= 1
    assert all(x["n"] >= 0 for b in batches(new, [], half, random.Random(2)) for x in b)  # nothing older: all new
    with pytest.raises(ValueError, match="no new answers"):
        batches([], [{"n": -1}], half, random.Random(3))
