"""What a user reads: no deprecations from the project's own calls into transformers, Lightning or torch, one line
for a bad path given to `train`, label sets that repair a damaged shard, caches that cannot run code."""

import contextlib
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from decode.engine import Autoregressive, SpeculativeDecoder
from decode.hf import hf_generate, specdecpp_assistant
from decode.policies import DraftConfidence, FixedK
from decode.rules.chain import SpeculativeSampling
from tests.test_data_gen import label_here
from tests.test_hf import export

ROOT = Path(__file__).resolve().parents[1]
DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


@contextlib.contextmanager
def transformers_log():
    """The records transformers logs at warning level inside the block, its once-per-process cache cleared first
    (transformers reports some lines, such as the generation_config form, through its logger, once per process)."""
    import transformers.utils.logging as tf_logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger, level = tf_logging.get_logger("transformers"), tf_logging.get_verbosity()
    tf_logging.set_verbosity_warning()
    tf_logging.warning_once.cache_clear()
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        tf_logging.set_verbosity(level)


@contextlib.contextmanager
def no_deprecations():
    """Fails on a deprecation from any library, as a Python warning or as a transformers log line."""
    with transformers_log() as records, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    bad = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, DEPRECATIONS)]
    bad += [r.getMessage() for r in records if "deprecat" in r.getMessage().lower()]
    assert not bad, "\n".join(bad)


def test_decoding_and_the_hf_paths_raise_no_deprecation(hf_pair, tmp_path):
    ids = hf_pair.encode("abc(abc(")
    head = export(tmp_path, hf_pair, "h", 1.0)
    greedy_head = export(tmp_path, hf_pair, "g", 0.0)
    with no_deprecations():
        SpeculativeDecoder(hf_pair, FixedK(3), SpeculativeSampling()).generate(ids, 8)
        SpeculativeDecoder(hf_pair, DraftConfidence(0.3), SpeculativeSampling()).generate(ids, 8)
        Autoregressive(hf_pair).generate(ids, 8)
        for method in ({}, {"k": 3}, {"confidence": 0.3}, {"head": head, "h": 0.5}):
            hf_generate(hf_pair, ids, 8, method, seed=0)
        assistant = specdecpp_assistant(hf_pair.draft, greedy_head, h=0.7, tokenizer=hf_pair.tokenizer)
        x = torch.tensor([ids])
        hf_pair.target.generate(x, attention_mask=torch.ones_like(x), assistant_model=assistant, do_sample=False,
                                max_new_tokens=8)


def test_decoding_a_lone_eos_token_prints_no_padding_advice(hf_pair):
    """A response that holds the EOS token, which is also the pad token, is fed to the models unpadded: transformers'
    "we strongly recommend passing in an attention_mask" line does not apply, and is not printed."""
    eos, saved = hf_pair.eos_ids[0], [m.config.pad_token_id for m in (hf_pair.draft, hf_pair.target)]
    try:
        with transformers_log() as records:
            for m in (hf_pair.draft, hf_pair.target):
                m.config.pad_token_id = eos  # the pycode pair's case: pad = EOS = BOS
                with torch.no_grad():
                    m(torch.tensor([[3, eos]]))
    finally:
        for m, pad in zip((hf_pair.draft, hf_pair.target), saved):
            m.config.pad_token_id = pad
    assert not [r.getMessage() for r in records if "attention_mask" in r.getMessage()]


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    from decode.pair import load_pair
    from tests.tiny import write_tiny_pair

    return load_pair(write_tiny_pair(tmp_path_factory.mktemp("quiet_pair"), pad_rows=0))


def fit(args, capsys) -> tuple[int, list[str]]:
    """`python -m train fit ARGS` in process -> (exit code, the lines it wrote to stderr)."""
    from train.__main__ import fit as train_fit

    with pytest.raises(SystemExit) as out:
        train_fit(["fit", *args])
    return out.value.code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_train_names_a_missing_build_config_or_unlabellable_label_folder_in_one_line(tmp_path, tiny_pair_yaml, capsys):
    recipe = str(ROOT / "heads" / "pycode" / "specdecpp.yaml")
    code, err = fit(["--config", recipe, "--data.build_config", "nope.yaml"], capsys)
    assert code == 2 and len(err) == 1 and "nope.yaml" in err[0] and "configs/data_gen/pycode.yaml" in err[0], err
    # a label folder that is missing and cannot be labelled: its build config names a prompt file that is not there
    build = tmp_path / "build.yaml"
    build.write_text(yaml.safe_dump({"data": {"pair": str(tiny_pair_yaml), "output": str(tmp_path / "labels"),
                                              "prompts": [{"name": "jsonl", "split": "train",
                                                           "path": str(tmp_path / "missing.jsonl")}]}}))
    code, err = fit(["--config", recipe, "--data.build_config", str(build), "--data.labels", str(tmp_path / "labels")],
                    capsys)
    assert code == 2 and len(err) == 1, err
    assert str(tmp_path / "labels") in err[0] and "missing.jsonl" in err[0], err


def damage(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.slow
def test_a_label_set_with_damaged_shards_names_them_relabels_their_prompts_and_trains(tmp_path, tiny_pair_yaml,
                                                                                      capsys):
    from data_gen.store import load_features, load_split
    from tests.test_data_gen import write_config
    from train.sweep import config_with, set_export_name

    cfg = write_config(tmp_path, tiny_pair_yaml, 14)
    raw = yaml.safe_load(cfg.read_text())
    raw["data"]["prompts"].append(dict(raw["data"]["prompts"][0], split="dev"))
    cfg.write_text(yaml.safe_dump(raw))
    assert label_here(cfg).returncode == 0
    out = tmp_path / "labels" / "t1"
    ids = {s: sorted(load_split(out, s)["id"]) for s in ("jsonl_train", "jsonl_dev")}
    first, second = sorted((out / "jsonl_train").iterdir())[:2]
    damage(next(first.glob("*.arrow")))
    damage(second / "features.safetensors")

    def train_args():
        def edit(c):
            c["data"] |= {"labels": str(tmp_path / "labels"), "build_config": str(cfg), "train_split": "jsonl_train",
                          "val_split": "jsonl_dev"}
            c["trainer"] |= {"logger": False, "default_root_dir": str(tmp_path / "run"), "max_epochs": 1}
            set_export_name(c, "exported")
            for cb in c["trainer"]["callbacks"]:
                if cb["class_path"].endswith("ExportHead"):
                    cb["init_args"]["directory"] = str(tmp_path)
        return ["--config", str(config_with(ROOT / "heads" / "pycode" / "specdecpp.yaml", edit))]

    code, err = fit(train_args(), capsys)  # training first: it names one bad shard and the command that repairs it
    assert code == 2 and len(err) == 1 and "python -m data_gen" in err[0], err
    assert first.name in err[0] or second.name in err[0], err

    res = label_here(cfg)
    assert res.returncode == 0, res.stderr[-3000:]
    for shard in (first, second):
        assert f"damaged shard {shard}" in res.stdout and (shard.parent / f".damaged-{shard.name}").exists()
    assert {s: sorted(load_split(out, s)["id"]) for s in ids} == ids  # every prompt labelled once again
    assert set(load_features(out, "jsonl_train")) == set(ids["jsonl_train"])
    from train.cli import cli

    cli(["fit", *train_args()])
    assert (tmp_path / "exported" / "model.safetensors").exists()


class Payload:
    def __reduce__(self):
        return (shutil.copyfile, (__file__, "/tmp/specheads-payload-ran"))


def test_a_replay_cache_that_carries_a_payload_is_refused(tmp_path):
    from decode.evaluation.replay import FreeRun, Trajectory, load_trajectories, save_trajectories

    traj = Trajectory([1, 2], [3, 4], [FreeRun([5], [0.5], [1.0], [0.5], torch.zeros(2, 4))], 4)
    save_trajectories([traj], tmp_path / "ok.pt")
    back = load_trajectories(tmp_path / "ok.pt")[0]
    assert (back.prompt, back.response, back.max_new, back.runs[0].tokens) == ([1, 2], [3, 4], 4, [5])
    assert torch.equal(back.runs[0].states, traj.runs[0].states)
    Path("/tmp/specheads-payload-ran").unlink(missing_ok=True)
    torch.save([Payload()], tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="bad.pt is not a replay cache of plain data.*delete it"):
        load_trajectories(tmp_path / "bad.pt")
    assert not Path("/tmp/specheads-payload-ran").exists()
