"""The instruct prompt sets (data_gen.instruct) and how a distillation cycle draws its batches (train.distill): the
stdlib's requests stay split by file, the package requests form a train-only set of unique prompts, and a cycle
trains on each new answer before any twice."""

import random
import sys
from collections import Counter

import pytest

from data_gen import instruct
from data_gen.prompts import PromptSet
from train.distill import Recipe, batches


@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    """Two importable packages with documented functions, a test folder and a repeated (generated) docstring."""
    doc = "Return the number of widgets in the given box, counting nested boxes."
    for name in ("alpha", "beta"):
        pkg = tmp_path / name
        (pkg / "tests").mkdir(parents=True)
        (pkg / "__init__.py").write_text(f'"""The {name} package computes widget counts for boxes of all kinds."""\n')
        (pkg / "core.py").write_text(f'def count(box):\n    """{doc}"""\n\n\ndef _hidden(x):\n    """{doc} Privately."""\n\n'
                                     f'def short(x):\n    """Too short."""\n\n\ndef {name}_only(x, *rest, key=None):\n'
                                     f'    """Make one {name} widget from x and the rest, keyed as asked by the caller."""\n')
        (pkg / "tests" / "test_core.py").write_text(f'def test_count():\n    """{doc} In a test."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(instruct, "PACKAGES", ("alpha", "beta", "not_installed_anywhere"))
    for name in ("alpha", "beta"):
        sys.modules.pop(name, None)


def test_package_requests_are_a_train_only_set_of_unique_prompts(fake_packages):
    rows = instruct.package_records()
    ids = [r["id"] for r in rows]
    assert ids == ["site:alpha/__init__.py:module", "site:alpha/core.py:1", "site:alpha/core.py:12",
                   "site:beta/__init__.py:module", "site:beta/core.py:12"]  # beta's count() repeats alpha's prompt
    assert "`alpha_only(x, *rest, key)`" in rows[2]["prompt"] and "module `beta` for" in rows[3]["prompt"]
    assert len(PromptSet("instruct-packages", "train").load()) == 5
    with pytest.raises(ValueError, match="only the split 'train'"):
        PromptSet("instruct-packages", "dev").load()
    with pytest.raises(ValueError, match="'instruct-packages'"):
        PromptSet("instruct-pkgs", "train").load()


def test_a_recipe_names_further_prompt_sets_as_a_list():
    assert Recipe(target={"path": "x.gguf"}, out="d", also=["instruct-packages"]).also == ["instruct-packages"]
    for bad in ("instruct-packages", [""], [3]):
        with pytest.raises(ValueError, match="recipe field also lists prompt sets"):
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
