import json
from pathlib import Path

import pytest
import torch
import yaml

from heads import (
    AcceptanceHead,
    FeatureSpec,
    HeadMismatch,
    LinearVerifier,
    check_draft,
    from_pretrained,
    save_pretrained,
)
from train.labels import binary_kl, weighted_bce
from train.sweep import config_with, set_export_name

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "heads").rglob("*.yaml"))  # heads/<recipe>.yaml (smollm2) and heads/pycode/<recipe>.yaml


@pytest.fixture(scope="module")
def tiny_labels(tiny_pair_yaml, tmp_path_factory):
    from tests.tiny import write_tiny_labels

    return write_tiny_labels(tmp_path_factory.mktemp("labels"), tiny_pair_yaml)


@pytest.fixture(scope="module")
def tiny_target_labels(tiny_pair_yaml, tmp_path_factory):
    """Target prefixes only, what the extra accepted_run needs."""
    from tests.tiny import write_tiny_labels

    return write_tiny_labels(tmp_path_factory.mktemp("target-labels"), tiny_pair_yaml, kinds=("target",))


@pytest.fixture(scope="module")
def tiny_tree_labels(tiny_pair_yaml, tmp_path_factory):
    """Target prefixes with 4 siblings labelled per position, what heads/pycode/specdecpp-tree.yaml reads."""
    from tests.tiny import write_tiny_labels

    return write_tiny_labels(tmp_path_factory.mktemp("tree-labels"), tiny_pair_yaml, kinds=("target",), siblings=4)


def test_the_accepted_run_counts_the_accepted_positions_before_each_and_needs_target_prefixes():
    from train.data import accepted_runs

    g = torch.Generator().manual_seed(0)
    row = {"id": "a", "kind": "target", "alpha": [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]}
    assert accepted_runs(row, g).tolist() == [0, 1, 2, 0, 1, 2, 3]
    sampled = accepted_runs({**row, "alpha": [0.5] * 4000}, g)  # under sampling alpha is a probability: drawn
    assert 0.9 < sampled.float().mean() < 1.1  # a geometric run with p = 0.5 has mean 1
    with pytest.raises(ValueError, match="target prefixes.*pycode-target.yaml"):
        accepted_runs({**row, "kind": "mixed"}, g)


def test_depth3_head_has_three_independent_blocks():
    head = AcceptanceHead(in_dim=8, depth=3)
    assert len(head.blocks) == 2 and head.out is not None  # two residual blocks + output layer
    a, b = head.blocks
    assert a.linear.weight.data_ptr() != b.linear.weight.data_ptr()
    with torch.no_grad():
        a.linear.weight.fill_(1.0)
    assert not torch.equal(a.linear.weight, b.linear.weight)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in head.modules())
    assert n_linear == 3
    assert sum(isinstance(m, torch.nn.Linear) for m in AcceptanceHead(8, depth=1).modules()) == 1


def test_weighted_bce_matches_formula():
    logits, a = torch.tensor([0.3, -1.2, 2.0]), torch.tensor([1.0, 0.2, 0.7])
    s = torch.sigmoid(logits)
    expect = -(1 * a * s.log() + 6 * (1 - a) * (1 - s).log()).sum() / (1 * a + 6 * (1 - a)).sum()
    assert torch.allclose(weighted_bce(logits, a, 1.0, 6.0), expect)
    assert torch.allclose(binary_kl(a, a), torch.zeros(3, dtype=torch.float64), atol=1e-6)


def test_head_learns_separable_data():
    from sklearn.metrics import roc_auc_score

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 16, generator=g)
    y = (x[:, :3].sum(-1) + 0.3 * torch.randn(4000, generator=g) > 0).float()
    head = AcceptanceHead(16, depth=3)
    head.set_normalizer(x.mean(0), x.std(0))
    opt = torch.optim.Adam(head.parameters(), 1e-2)
    for _ in range(200):
        loss = weighted_bce(head(x[:3000]), y[:3000], 1.0, 1.0)
        opt.zero_grad(), loss.backward(), opt.step()
    with torch.no_grad():
        assert roc_auc_score(y[3000:].numpy(), head.prob(x[3000:]).numpy()) > 0.95


def test_export_load_round_trip_and_draft_check(tmp_path):
    head = AcceptanceHead(10, depth=3)
    meta = {"draft": {"path": "a", "config_hash": "h1", "hidden_size": 8, "vocab_size": 24, "num_layers": 1},
            "features": FeatureSpec("prev", ["draft_top1", "draft_entropy"]).to_dict()}
    save_pretrained(head, tmp_path / "h", meta)
    loaded, cfg = from_pretrained(tmp_path / "h")
    assert type(loaded) is AcceptanceHead and cfg["features"]["extras"] == ["draft_entropy", "draft_top1"]
    for (k, v), (k2, v2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    check_draft(cfg, meta["draft"])
    with pytest.raises(HeadMismatch, match="hidden_size: head was trained for 8, this draft has 16"):
        check_draft(cfg, meta["draft"] | {"hidden_size": 16, "path": "b"})
    (tmp_path / "h" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt"):
        from_pretrained(tmp_path / "h")
    save_pretrained(LinearVerifier(4), tmp_path / "v", {})
    assert type(from_pretrained(tmp_path / "v")[0]) is LinearVerifier


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "heads").with_suffix("")))
def test_every_recipe_parses_through_the_cli(recipe):
    from data_gen.quiet import own_args
    from train.cli import HeadCLI
    from train.data import LabelData
    from train.module import HeadModule

    # the real parser and instantiation (no I/O happens in any constructor), without running fit
    with own_args(["--config"]):
        cli = HeadCLI(HeadModule, LabelData, run=False, args=["--config", str(recipe)])
    cfg = cli.config
    assert cli.model.head.init_args["in_dim"] == cli.datamodule.feature_dim
    assert cfg.model.head.class_path.startswith("heads.")
    assert cfg.data.label.class_path.startswith("train.labels.")
    assert cfg.trainer.max_epochs >= 1


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "heads").with_suffix("")))
def test_short_fit_and_export_per_recipe(recipe, tiny_labels, tiny_target_labels, tiny_tree_labels, tmp_path, capsys):
    from train.cli import cli

    data = yaml.safe_load(recipe.read_text())["data"]
    if "accepted_run" in data["features"]["extras"]:
        tiny_labels = tiny_tree_labels if data.get("siblings") else tiny_target_labels

    def edit(cfg):
        cfg["data"]["labels"] = str(yaml.safe_load(tiny_labels.read_text())["data"]["output"])
        cfg["data"]["build_config"] = str(tiny_labels)
        cfg["data"].pop("train_split", None), cfg["data"].pop("val_split", None)  # the tiny set's are train and dev
        cfg["trainer"]["logger"] = False
        cfg["trainer"]["default_root_dir"] = str(tmp_path)
        set_export_name(cfg, "exported")
        if cfg["data"]["label"]["class_path"].endswith("DivergenceThreshold"):
            cfg["data"]["label"]["init_args"]["threshold"] = 0.4  # the random tiny pair is far apart
        for cb in cfg["trainer"]["callbacks"]:
            if cb["class_path"].endswith("ExportHead"):
                cb["init_args"]["directory"] = str(tmp_path)

    run = cli(["fit", "--config", str(config_with(recipe, edit)), "--trainer.max_epochs", "2"])
    out = tmp_path / "exported"
    head, cfg = from_pretrained(out)
    assert (out / "roc.png").stat().st_size > 1000
    assert 0.0 <= cfg["metrics"]["auroc"] <= 1.0 and cfg["draft"]["hidden_size"] == 32
    assert cfg["label"]["family"] == type(run.datamodule.label).__name__
    assert isinstance(run.model.label, type(run.datamodule.label))  # linked from data to model
    x = run.datamodule.tensors["dev"].tensors[0]
    assert torch.allclose(head.prob(x), run.model.head.eval().prob(x))
    assert json.loads((out / "config.json").read_text())["features"]["position"] in ("own", "prev")
    said = capsys.readouterr().out
    if data.get("siblings"):  # a tree's head: trained on siblings, and its report ranks the children beyond the first
        assert cfg["siblings"] == 4 and [r["ranks"] for r in cfg["metrics"]["by_rank"]][:2] == [">= 1", "0"]
        assert "dev siblings of rank >= 1: AUROC" in said and "dev siblings of rank 1: AUROC" in said
        assert set(run.datamodule.columns["dev"]["rank"].tolist()) == {0.0, 1.0, 2.0, 3.0}
        from train.roc import main as roc

        roc(["--heads", str(out), "--out", str(tmp_path / "roc.png")])  # python -m train roc reads the same rows
        assert "| exported, siblings of rank >= 1 |" in capsys.readouterr().out
    else:
        assert "siblings" not in cfg and "siblings of rank" not in said


def test_sweep_grid_parsing_and_paths():
    from train.sweep import parse_set, set_path

    grid = parse_set(["model.head.init_args.depth=1,3", "data.label.init_args.gamma=1,1.2"])
    assert grid == {"model.head.init_args.depth": [1, 3], "data.label.init_args.gamma": [1, 1.2]}
    cfg = {"model": {"head": {"class_path": "heads.AcceptanceHead"}}}
    set_path(cfg, "model.head.init_args.depth", 3)
    assert cfg["model"]["head"]["init_args"]["depth"] == 3
    with pytest.raises(ValueError, match="path=v1,v2"):
        parse_set(["model.lr"])


def test_label_folder_and_head_name_follow_the_sampling_setting(tiny_labels):
    from decode.pair import Sampling
    from train.data import LabelData

    base = yaml.safe_load(tiny_labels.read_text())["data"]["output"]
    own = LabelData(labels=base, build_config=str(tiny_labels))
    assert own.folder.name == "t1" and own.head_suffix == ""  # the pair's own setting keeps the plain name
    greedy = LabelData(labels=base, build_config=str(tiny_labels), sampling=Sampling(temperature=0))
    assert greedy.folder.name == "greedy" and greedy.head_suffix == "-greedy"
    warm = LabelData(labels=base, build_config=str(tiny_labels), sampling=Sampling(temperature=0.7, top_p=0.95))
    assert warm.head_suffix == "-t0.7-p0.95"
    assert own.meta()["sampling"]["temperature"] == 1.0  # recorded from the label set, read back by decode


@pytest.mark.slow
def test_sigterm_during_fit_saves_state_and_the_resumed_run_exports_the_same_head(tiny_labels, tmp_path):
    import logging
    import os
    import signal
    import subprocess
    import sys
    import time
    import warnings

    from train.cli import cli

    def config(tag, slow):
        def edit(cfg):
            cfg["data"]["labels"] = str(yaml.safe_load(tiny_labels.read_text())["data"]["output"])
            cfg["data"]["build_config"] = str(tiny_labels)
            cfg["trainer"] |= {"logger": False, "default_root_dir": str(tmp_path / tag), "max_epochs": 4}
            set_export_name(cfg, "exported")
            for cb in cfg["trainer"]["callbacks"]:
                if cb["class_path"].endswith("ExportHead"):
                    cb["init_args"]["directory"] = str(tmp_path / tag)
            if slow:
                cfg["trainer"]["callbacks"].append({"class_path": "tests.tiny.SlowEpochs"})
        path = config_with(ROOT / "heads" / "pycode" / "specdecpp.yaml", edit)
        return path.rename(tmp_path / f"{tag}.yaml")

    cli(["fit", "--config", str(config("whole", slow=False))])
    cmd = [sys.executable, "-m", "train", "fit", "--config", str(config("cut", slow=True))]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not list((tmp_path / "cut").rglob("epoch=0*.ckpt")):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143 and time.time() - t0 < 30, out[-3000:]
    assert (tmp_path / "cut" / "resume" / "last.ckpt").exists() and not (tmp_path / "cut" / "exported").exists()
    # the resume needs no process of its own: it runs here, and Lightning's log lines are read from its logger
    records, handler = [], logging.Handler()
    handler.emit = records.append
    logging.getLogger("lightning.pytorch").addHandler(handler)
    try:
        with warnings.catch_warnings():  # the cut run's checkpoints are there: that is what a resume reads
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
            cli(["fit", "--config", str(tmp_path / "cut.yaml"), "--ckpt_path", "last"])
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)
    said = "\n".join(r.getMessage() for r in records)
    assert "Restoring states from the checkpoint path" in said  # resumed, not restarted
    assert "resume/last.ckpt" in said
    whole, _ = from_pretrained(tmp_path / "whole" / "exported")
    resumed, _ = from_pretrained(tmp_path / "cut" / "exported")
    for (k, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-5), k
