"""Every shipped YAML parses through the code that reads it, so configs cannot rot."""

import importlib
import inspect
from pathlib import Path

import pytest
import yaml

from decode.evaluation.bench import expand

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "data_gen").glob("*.yaml")), ids=lambda p: p.stem)
def test_data_gen_configs_parse_through_the_cli(path):
    from data_gen.__main__ import LabelCLI
    from data_gen.module import Labeller, PromptData
    from data_gen.quiet import own_args

    with own_args(["--config"]):
        cli = LabelCLI(Labeller, PromptData, run=False, args=["--config", str(path)], save_config_callback=None,
                       trainer_defaults={"logger": False})
    assert cli.model.pair_path == cli.datamodule.pair  # linked
    assert cli.datamodule.prompt_sets and cli.model.mixing.r == 0.15


def resolve(class_path):
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def recipe_heads() -> set[str]:
    """checkpoints/<name> that the shipped recipes export (heads/<recipe>.yaml's ExportHead name)."""
    names = set()
    for recipe in (ROOT / "heads").rglob("*.yaml"):
        for cb in yaml.safe_load(recipe.read_text())["trainer"].get("callbacks", []):
            if cb["class_path"].endswith("ExportHead"):
                names.add(cb["init_args"].get("directory", "checkpoints") + "/" + cb["init_args"]["name"])
    return names


BATCH_BENCHES = sorted((ROOT / "configs" / "bench").glob("batch*.yaml"))
SECTION_BENCHES = sorted(p for p in (ROOT / "configs" / "bench").glob("*.yaml") if p not in BATCH_BENCHES)


@pytest.mark.parametrize("path", BATCH_BENCHES, ids=lambda p: p.stem)
def test_the_batch_bench_configs_are_their_schema_and_name_existing_heads(path):
    """configs/bench/batch*.yaml parse into decode.evaluation.batch's typed schema; every setting has its heads (the
    batch controller's and the head tree's)."""
    from decode.evaluation.batch import BatchBenchConfig
    from decode.pair import PairConfig, Sampling

    cfg = BatchBenchConfig(**yaml.safe_load(path.read_text()))
    own = PairConfig.from_yaml(cfg.pair).sampling
    assert cfg.batch_sizes == sorted(cfg.batch_sizes) and all(b >= 1 for b in cfg.batch_sizes)
    for raw in cfg.settings:
        head = ROOT / cfg.head.format(suffix=Sampling.of(raw).head_suffix(own))
        assert (head / "config.json").exists(), head
        tree = ROOT / cfg.tree_head.format(suffix=Sampling.of(raw).head_suffix(own))
        assert not cfg.tree_head or (tree / "config.json").exists(), tree
    assert cfg.ignore_eos == ["t1"]  # sampled rows at fixed lengths; greedy rows stop at EOS
    with pytest.raises(ValueError, match="ignore_eos names"):
        BatchBenchConfig(settings=[{"temperature": 1.0}], ignore_eos=["t1.0"])


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "replay").glob("*.yaml")), ids=lambda p: p.stem)
def test_replay_configs_are_their_schema_with_disjoint_dev_and_test(path):
    """configs/replay/*.yaml parse into ReplayConfig, name an existing bench config, and every prompt set's dev and
    test are PromptSet arguments that select different prompts (choices on dev never see a test prompt)."""
    from data_gen.prompts import PromptSet
    from decode.evaluation.tuning import ReplayConfig

    cfg = ReplayConfig(**yaml.safe_load(path.read_text()))
    assert (ROOT / cfg.bench).exists()
    for ps in cfg.prompt_sets:
        dev, test = PromptSet(**ps["dev"]), PromptSet(**ps["test"])
        if (dev.name, dev.split) == (test.name, test.split):
            assert dev.seed == test.seed and (dev.skip or 0) + dev.limit <= (test.skip or 0), ps["name"]


@pytest.mark.parametrize("path", SECTION_BENCHES, ids=lambda p: p.stem)
def test_bench_configs_name_real_classes_arguments_and_heads(path):
    from decode.pair import PairConfig, Sampling

    cfg = yaml.safe_load(path.read_text())
    own = PairConfig.from_yaml(cfg["pair"]).sampling
    methods = []
    for sec in cfg["sections"]:
        suffix = Sampling(**sec.get("sampling", {})).head_suffix(own)
        methods += [(suffix, m) for raw in sec["methods"] for m in expand(dict(raw), suffix)]
    assert any(m.kind == "target" for _, m in methods)
    exported = recipe_heads()
    for suffix, m in methods:
        for spec in (m.policy, m.rule):
            if spec is None:
                continue
            params = inspect.signature(resolve(spec["class_path"])).parameters
            unknown = set(spec.get("init_args", {})) - set(params)
            assert not unknown, f"{path.name}: {m.name}: {spec['class_path']} has no argument {unknown}"
        head = (m.policy or {}).get("init_args", {}).get("head_dir") or m.hf.get("head")
        if head:  # a shipped head, or one that a shipped recipe exports for this setting
            assert (ROOT / head / "config.json").exists() or any(head == h + suffix for h in exported), \
                f"{path.name}: {m.name} names {head}, which no recipe in heads/ exports"
    assert {m.select for _, m in methods} <= {"", "dev", "mark"}
    assert all(m.family == "fixed-K" for _, m in methods if m.select == "mark")  # what goals call fixed-K@dev


@pytest.mark.parametrize("module, args, option", [
    ("data_gen", ["--config", "configs/data_gen/pycode.yaml", "--data.max_new_tokens", "-3"], "max_new_tokens"),
    ("data_gen", ["--config", "configs/data_gen/pycode.yaml", "--data.batch_size", "0"], "batch_size"),
    ("train", ["fit", "--config", "heads/specdecpp.yaml", "--model.lr", "-1"], "lr"),
])
def test_lightning_clis_reject_out_of_range_numbers(module, args, option, capsys, monkeypatch):
    """In process (a subprocess per case spent 6 s importing torch and Lightning): exit 2, one error line."""
    from data_gen.__main__ import main as data_gen
    from train.__main__ import fit

    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as out:
        {"data_gen": data_gen, "train": fit}[module](args)
    stderr = capsys.readouterr().err
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert out.value.code == 2 and len(errors) == 1 and option in errors[0], stderr[-2000:]


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "distill").glob("*.yaml")), ids=lambda p: p.stem)
def test_distillation_recipes_parse(path):
    from train.distill import Recipe

    recipe = Recipe.from_yaml(path)
    assert recipe.layers and recipe.settings
    # its draft is committed, or the committed draft it grows from (configs/distill/smollm2-3l.yaml)
    assert (ROOT / recipe.out).is_dir() or (recipe.grow and (ROOT / recipe.grow / "model.safetensors").is_file())
    assert not recipe.answers or (ROOT / recipe.answers / "answers-train.jsonl.gz").is_file()


def test_a_config_that_is_not_valid_yaml_or_not_a_mapping_is_named_in_one_line(tmp_path, capsys):
    from decode.__main__ import bench
    from decode.pair import read_yaml

    bad = tmp_path / "bad.yaml"
    bad.write_text("pair: configs/pairs/pycode.yaml\nignore_eos: [t1]\n- t0.7\n")
    with pytest.raises(ValueError, match=r"bad.yaml is not valid YAML at line 3, column 1"):
        read_yaml(bad)
    (tmp_path / "list.yaml").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="holds a list, not a mapping"):
        read_yaml(tmp_path / "list.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert read_yaml(tmp_path / "empty.yaml") == {}
    with pytest.raises(SystemExit):
        bench(["--config", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()
    assert "is not valid YAML at line 3" in err[-1] and not any("Traceback" in line for line in err)
