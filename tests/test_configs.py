"""Every shipped YAML parses through the code that reads it, so configs cannot rot."""

import importlib
import inspect
from pathlib import Path

import pytest
import yaml

from decode.bench import expand

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "data_gen").glob("*.yaml")), ids=lambda p: p.stem)
def test_data_gen_configs_parse_through_the_cli(path):
    from data_gen.__main__ import LabelCLI
    from data_gen.module import Labeller, PromptData

    cli = LabelCLI(Labeller, PromptData, run=False, args=["--config", str(path)], save_config_callback=None,
                   trainer_defaults={"logger": False})
    assert cli.model.pair_path == cli.datamodule.pair  # linked
    assert cli.datamodule.prompt_sets and cli.model.mixing.r == 0.15


def resolve(class_path):
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "bench").glob("*.yaml")), ids=lambda p: p.stem)
def test_bench_configs_name_real_classes_and_arguments(path):
    cfg = yaml.safe_load(path.read_text())
    methods = [m for sec in cfg.get("sections") or [{"methods": cfg["methods"]}] for raw in sec["methods"]
               for m in expand(dict(raw))]
    assert any(m.kind == "target" for m in methods)
    for m in methods:
        for spec in (m.policy, m.rule):
            if spec is None:
                continue
            params = inspect.signature(resolve(spec["class_path"])).parameters
            unknown = set(spec.get("init_args", {})) - set(params)
            assert not unknown, f"{path.name}: {m.name}: {spec['class_path']} has no argument {unknown}"
            head = spec.get("init_args", {}).get("head_dir")
            if head:
                assert (ROOT / head / "config.json").exists(), f"{path.name} names a head that is not shipped: {head}"
