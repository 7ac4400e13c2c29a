"""The bench's YAML: its methods (Method, expanded from a grid entry per sampling setting), the config with its
command-line overrides (load_config), and the prompts each split encodes. decode.evaluation.bench runs it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from decode.evaluation.summary import HEAD, PREV_HEAD
from decode.pair import Pair, Sampling, read_yaml

ROOT = Path(__file__).resolve().parents[2]


def build(spec: dict):
    """{'class_path': 'pkg.mod.Class', 'init_args': {...}} -> instance."""
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**spec.get("init_args", {}))


@dataclass
class Method:
    name: str
    kind: str = "spec"  # spec | target | draft | hf
    policy: dict | None = None
    rule: dict | None = None
    hf: dict = field(default_factory=dict)
    family: str = ""  # for plots and goals: fixed-K, specdec++, fsd, sprinter, ...
    select: str = ""  # "dev": only the value chosen on dev runs on test; "mark": all run, the dev choice is marked

    def __post_init__(self):
        if self.select not in ("", "dev", "mark"):
            raise ValueError(f"{self.name}: select: {self.select!r}; use dev (only the dev choice runs on test) or "
                             "mark (every value runs, the dev choice is marked)")

    @property
    def head_dir(self) -> str | None:
        """The exported head this method reads, if any."""
        return (self.policy or {}).get("init_args", {}).get("head_dir") or self.hf.get("head")

    @property
    def lossless(self) -> bool:
        if self.kind != "spec":
            return True
        module, _, name = self.rule["class_path"].rpartition(".")
        return getattr(getattr(importlib.import_module(module), name), "lossless", False)


def expand(raw: dict, suffix: str = "") -> list[Method]:
    """One YAML entry -> methods, one per value of its grid ({'policy.k': [1, 2]} style).

    "{suffix}" in the entry is the head suffix of the section's sampling setting ("" for the pair's
    own, "-greedy" ...), so one entry names the head trained for each setting.
    """
    raw = yaml.safe_load(yaml.safe_dump(raw).replace("{suffix}", suffix))
    grid = raw.pop("grid", None)
    if not grid:
        return [Method(**raw)]
    (key, values), = grid.items()
    out = []
    for v in values:
        r = yaml.safe_load(yaml.safe_dump(raw))
        part, arg = key.split(".")
        if part == "hf":
            r.setdefault("hf", {})[arg] = v
        else:
            r[part].setdefault("init_args", {})[arg] = v
        r["name"] = raw["name"].format(v=v)
        out.append(Method(**r))
    return out


def encode_prompts(pair: Pair, ps_raw: dict, n: int) -> list[list[int]]:
    from data_gen.prompts import PromptSet

    budget = pair.config.max_context - n
    return [pair.encode(t, budget) for t in PromptSet(**ps_raw).load()["prompt"]]


class BadBenchConfig(ValueError):
    """The bench YAML does not parse, or --prompt_sets, --settings or ignore_eos named a set or a sampling setting it
    does not have: the command says so in one line."""


def read_bench_yaml(path: Path) -> dict:
    """The bench YAML as a mapping, or BadBenchConfig in one line."""
    try:
        return read_yaml(path)
    except ValueError as e:
        raise BadBenchConfig(str(e)) from None


def check_ignore_eos(ignore, settings: list[str], where: str = "") -> None:
    """ignore_eos (of the bench or the batch bench) must be a list of the config's setting names: a typo would
    silently leave EOS on."""
    if not isinstance(ignore, list) or not all(isinstance(n, str) for n in ignore):
        raise BadBenchConfig(f"{where}ignore_eos is {ignore!r}; give a list of setting names, e.g. [t1]")
    if unknown := sorted(set(ignore) - set(settings)):
        raise BadBenchConfig(f"{where}ignore_eos names {unknown}, which are not among its settings "
                               f"{settings}: name settings as the bench does (greedy, t0.7-p0.95, t1)")


def stops_at_eos(pair, ignore_eos: list[str]) -> bool:
    """False where ignore_eos (the bench's or the batch bench's) names the pair's setting: its rows decode their whole
    budget through their EOS."""
    return pair.config.sampling.name not in ignore_eos


def load_config(config: str, quick: bool, repeats: int | None, output: str | None = None,
                prompt_sets: list[str] | None = None, settings: list[str] | None = None) -> dict:
    path = Path(config) if Path(config).is_absolute() else ROOT / config
    cfg = {"max_new_tokens": 64, "seed": 0, "repeats": 1, "cost_repeats": 7, "threads": 2, "quality_tolerance": 0.05,
           "output": "runs/bench", "ignore_eos": [], "summary_head": HEAD, "summary_prev_head": PREV_HEAD
           } | read_bench_yaml(path)
    setting_names = [Sampling(**sec.get("sampling", {})).name for sec in cfg["sections"]]
    check_ignore_eos(cfg["ignore_eos"], setting_names, f"{path.name}: ")
    if repeats is not None:
        cfg["repeats"] = repeats
    if output is not None:
        cfg["output"] = output
    if prompt_sets:
        names = [ps["name"] for ps in cfg["prompt_sets"]]
        if unknown := [n for n in prompt_sets if n not in names]:
            raise BadBenchConfig(f"--prompt_sets {' '.join(unknown)}: {path.name} has {', '.join(names)}")
        cfg["prompt_sets"] = [ps for ps in cfg["prompt_sets"] if ps["name"] in prompt_sets]
    if settings:  # e.g. the greedy sections alone: --settings greedy
        if unknown := [n for n in settings if n not in setting_names]:
            raise BadBenchConfig(f"--settings {' '.join(unknown)}: {path.name} has {', '.join(setting_names)}")
        cfg["sections"] = [sec for sec, name in zip(cfg["sections"], setting_names) if name in settings]
    if quick:  # a smoke run: few prompts, few methods, no dev sweep, a coarse cost model
        cfg["repeats"], cfg["cost_repeats"] = 1, 3
        if output is None:  # never into the committed results: a scratch folder that git ignores
            cfg["output"] = str(Path("runs/bench-quick") / Path(cfg["output"]).name)
        for ps in cfg["prompt_sets"]:
            for split in ("dev", "test"):
                if split in ps:
                    ps[split] = ps[split] | {"limit": cfg.get("quick_prompts", 3)}
    return cfg
