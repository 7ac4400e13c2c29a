"""Label sets -> (features, target, event) tensors for head training.

If the label set named by `labels` is missing, `prepare_data` builds it first with data_gen
(the command is logged), so `python -m train fit --config heads/specdecpp.yaml` works from a
fresh clone. Features come from the cached draft hidden states, or live from the frozen draft
(`feature_source: live`) when a label set was written without them.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from data_gen.quiet import NESTED
from data_gen.store import DamagedShard, load_features, load_split, metadata
from decode.pair import Sampling
from heads.features import FeatureSpec
from train.labels import LabelFamily, SoftAcceptance

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger(__name__)
COLUMNS = ("alpha", "ratio_qp", "kl", "kl_qp", "js", "tv", "draft_entropy", "draft_top1", "q_cand", "p_cand")
# A sibling's row: alpha and q_cand are the sibling's own, the divergences and the draft's scalars its position's;
# p_cand and ratio_qp exist for the candidate alone (rank 0), so they are left out.
SIBLING_COLUMNS = tuple(c for c in COLUMNS if c not in ("ratio_qp", "p_cand")) + ("rank",)


def resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else ROOT / p


@torch.no_grad()
def live_features(pair_yaml: str, rows) -> dict[str, torch.Tensor]:
    """Prompt id -> (n + 1, H) draft last-layer states recomputed over prompt + z."""
    from data_gen.generate import feature_dtype
    from decode.cache.kv import forward, rollback_cache
    from decode.pair import load_pair

    pair, out = load_pair(pair_yaml), {}
    for r in rows:
        seq = torch.tensor([r["prompt_ids"] + r["z"]], device=pair.input_device("draft"))
        _, h = forward(pair.draft, seq, rollback_cache(), hidden=True)
        out[r["id"]] = h[0, len(r["prompt_ids"]) - 1 :].to("cpu", feature_dtype(pair))
    return out


def flatten(ds, feats: dict[str, torch.Tensor], spec: FeatureSpec, siblings: bool = False,
            greedy: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sequences -> (N, dim) features and (N,) columns, one row per usable position, or with `siblings` one per
    usable sibling of each position (sibling_rows; greedy: the label set's setting is temperature 0).

    "own" features exist only where the draft read its own candidate (z_i = c_i), the positions
    the loss is defined on; "prev" features exist at every position.
    """
    if siblings:
        check_siblings(spec)
        if "sib_tok" not in ds.column_names:
            raise ValueError("this label set has no sibling labels (no sib_tok column): relabel it with "
                             "configs/data_gen/pycode-tree.yaml (model.siblings > 0) or set data.siblings false")
    xs, cols = [], {c: [] for c in (SIBLING_COLUMNS if siblings else COLUMNS)}
    gen = torch.Generator().manual_seed(0)  # the acceptances behind accepted_run under sampling (alpha is a probability)
    for r in ds:
        h = feats[r["id"]]
        # Kept in the stored half dtype (the head casts each batch): float32 would double the largest tensor of
        # training. Extras are float32 scalars that half precision would round, so with extras it is float32.
        dtype = torch.float32 if spec.extras else h.dtype
        keep = torch.tensor([not ft for ft in r["from_target"]]) if spec.position == "own" else \
            torch.ones(len(r["z"]), dtype=torch.bool)
        hid = h[1:] if spec.position == "own" else h[:-1]
        c = {k: torch.tensor(r[k], dtype=torch.float32)[keep] for k in COLUMNS}
        run = accepted_runs(r, gen)[keep] if "accepted_run" in spec.extras else None
        rank = None
        if siblings:  # position "prev": every position is kept, so index i is the position itself
            i, rank = sibling_rows(r, greedy)
            hid, run = hid[i], None if run is None else run[i]  # a position's siblings share its accepted run
            c = {k: c[k][i] for k in SIBLING_COLUMNS[:-1]} | {"rank": rank.float()}
            c["alpha"], c["q_cand"] = (torch.tensor(r[k], dtype=torch.float32)[i, rank] for k in ("sib_alpha", "sib_q"))
        xs.append(spec.build(hid[keep] if rank is None else hid, c["draft_entropy"], c["draft_top1"], c["q_cand"],
                             dtype, run, rank))
        for k in cols:
            cols[k].append(c[k])
    return torch.cat(xs), {k: torch.cat(v) for k, v in cols.items()}


def sibling_rows(r: dict, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence with sibling labels -> (R,) positions and (R,) ranks of its rows, position by position.

    A row predicts the chance sibling j is accepted once siblings 0..j-1 were rejected. Under greedy only the
    target's argmax is accepted, so rank j is tested only where no earlier sibling was it; under sampling alpha is
    already that conditional chance, and every rank has a row. Padding (-1: the law had fewer tokens) has none."""
    tok, alpha = (torch.tensor(r[k]).reshape(len(r["z"]), -1) for k in ("sib_tok", "sib_alpha"))
    keep = tok >= 0
    if greedy:
        keep &= (alpha.cumsum(1) - alpha) == 0
    return keep.nonzero(as_tuple=True)


def check_siblings(spec: FeatureSpec) -> None:
    """Refuse what sibling rows cannot feed: the state after a sibling (only one token was read per position)."""
    if spec.position == "own":
        raise ValueError("sibling rows need features at position prev: the draft reads one token per position, so a "
                         "sibling's own state does not exist (set --data.features.position prev)")


def accepted_runs(r: dict, gen: torch.Generator) -> torch.Tensor:
    """One sequence -> (n,) how many positions right before each were accepted: candidate i is accepted with
    probability alpha_i (drawn once, as decoding draws it; 0 or 1 under greedy). Only along text that decoding
    would have accepted, so only for sequences of kind "target"."""
    if r["kind"] != "target":
        raise ValueError(f"the extra accepted_run needs a label set of target prefixes, but sequence {r['id']} is of "
                         f"kind {r['kind']!r}: label with configs/data_gen/pycode-target.yaml (mixing shares "
                         "{target: 1.0}) or drop the extra")
    accepted = torch.rand(len(r["alpha"]), generator=gen) < torch.tensor(r["alpha"])
    run, out = 0, []
    for a in accepted.tolist():
        out.append(run)
        run = run + 1 if a else 0
    return torch.tensor(out)


class EpochSampler(torch.utils.data.Sampler):
    """A shuffle that depends on (seed, epoch) alone: Lightning calls set_epoch, so a run resumed at an
    epoch boundary sees exactly the batches an uninterrupted run would have seen."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


class LabelData(L.LightningDataModule):
    """A data_gen label set, a label family and a feature spec -> train/val loaders of (x, target, event)."""

    def __init__(self, labels: str = "data/pycode", build_config: str = "configs/data_gen/pycode.yaml",
                 label: LabelFamily | None = None, features: FeatureSpec | None = None, train_split: str = "train",
                 val_split: str = "dev", batch_size: int = 512, feature_source: str = "cache", seed: int = 0,
                 sampling: Sampling | None = None, siblings: bool = False):
        """labels: the label set's base folder; the records are read from <labels>/<sampling name>.
        sampling: the setting the head is trained for and will decode under (None: the pair's own).
        siblings: one row per sibling a token tree drafts (flatten), for heads that value a tree's children; needs a
        label set with sibling labels (configs/data_gen/pycode-tree.yaml)."""
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"--data.batch_size must be >= 1, got {batch_size}")
        if siblings:
            check_siblings(features or FeatureSpec())
            if not isinstance(label or SoftAcceptance(), SoftAcceptance):
                raise ValueError(f"sibling labels hold each sibling's acceptance alone: train them with "
                                 f"train.labels.SoftAcceptance, not {type(label).__name__}")
        self.siblings = siblings
        self.labels, self.build_config, self.sampling = labels, build_config, sampling
        self.label, self.features = label or SoftAcceptance(), features or FeatureSpec()
        self.train_split, self.val_split, self.batch_size = train_split, val_split, batch_size
        self.feature_source, self.seed = feature_source, seed
        self.tensors: dict[str, TensorDataset] = {}
        self.columns: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def feature_dim(self) -> int:
        """Input size of the head: the draft's hidden size (from the pair) plus the extras."""
        from decode.pair import PairConfig, load_config

        pair = PairConfig.from_yaml(yaml_pair(self.build_config))
        size = load_config(pair.draft).hidden_size  # a local folder or a hub id (from the local hub cache)
        return self.features.dim(size)

    @property
    def label_family(self) -> LabelFamily:
        """The label family object, linked to the model (which needs its loss weights)."""
        return self.label

    @property
    def setting(self) -> Sampling:
        """The sampling setting of the labels (and so of the head)."""
        from decode.pair import PairConfig

        return self.sampling or PairConfig.from_yaml(yaml_pair(self.build_config)).sampling

    @property
    def head_suffix(self) -> str:
        """'' for the pair's own setting, else '-<setting name>' (checkpoints/specdecpp-greedy)."""
        from decode.pair import PairConfig

        return self.setting.head_suffix(PairConfig.from_yaml(yaml_pair(self.build_config)).sampling)

    @property
    def folder(self) -> Path:
        return resolve(self.labels) / self.setting.name

    def build_command(self) -> list[str]:
        """The data_gen command that labels (or resumes and repairs) this label set for this setting."""
        s = self.setting
        return ["python", "-m", "data_gen", "--config", str(resolve(self.build_config)), "--data.output",
                str(resolve(self.labels)), "--settings", f"[{{temperature: {s.temperature}, top_k: {s.top_k}, top_p: {s.top_p}}}]"]

    def prepare_data(self) -> None:
        out = self.folder
        if (out / "metadata.json").exists() and (out / self.val_split).exists():
            return
        cmd = self.build_command()
        log.warning("label set %s is missing: building it with `%s`", out, shlex.join(cmd))
        # Nested: the labelling run leaves out the device and seed lines this run has printed (data_gen.quiet).
        proc = subprocess.Popen([sys.executable, *cmd[1:]], cwd=ROOT, env=os.environ | {NESTED: "1"},
                                stderr=subprocess.PIPE, text=True)
        reason = None
        for line in proc.stderr:  # passed through as it comes, but its one-line error becomes part of ours
            if line.startswith("error: "):
                reason = line.removeprefix("error: ").strip()
            else:
                sys.stderr.write(line)
        if proc.wait() != 0:
            raise ValueError(f"labelling the missing label set {out} failed ({reason or f'exit {proc.returncode}'}): "
                             f"fix that and run again; `{shlex.join(cmd)}` labels it alone")

    def split_tensors(self, split: str) -> tuple[TensorDataset, dict[str, torch.Tensor]]:
        out = self.folder
        try:
            ds = load_split(out, split)
            feats = load_features(out, split) if self.feature_source == "cache" else None
        except DamagedShard as e:
            raise ValueError(f"{e}: `{shlex.join(self.build_command())}` sets it aside and labels its prompts "
                             "again") from e
        if feats is None:
            pair_yaml = yaml_pair(self.build_config)
            feats = live_features(pair_yaml, ds)
        x, cols = flatten(ds, feats, self.features, self.siblings, self.setting.temperature == 0)
        target, event = self.label.target(cols), self.label.event(cols, self.seed)
        return TensorDataset(x, target, event), cols

    def setup(self, stage: str) -> None:
        for split in {self.train_split, self.val_split}:
            if split not in self.tensors:
                self.tensors[split], self.columns[split] = self.split_tensors(split)

    def meta(self) -> dict:
        """What the exported head records about its data."""
        m = metadata(self.folder)
        return {"labels": str(Path(self.labels) / self.setting.name), "label": self.label.meta(), "features": self.features.to_dict(),
                "draft": m["draft"], "target": m["target"], "sampling": m["sampling"], "pair": m["pair"]} | \
            ({"siblings": m["siblings"]} if self.siblings else {})  # a tree's head, recorded so that decode can refuse it for a chain

    def train_dataloader(self) -> DataLoader:
        sampler = EpochSampler(len(self.tensors[self.train_split]), self.seed)
        return DataLoader(self.tensors[self.train_split], batch_size=self.batch_size, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.tensors[self.val_split], batch_size=4096)


def yaml_pair(build_config: str) -> str:
    """The pair YAML named by a data_gen config."""
    import yaml

    path = resolve(build_config)
    if not path.is_file():
        raise ValueError(f"--data.build_config {build_config}: no such file ({path}); give a data_gen config such as "
                         "configs/data_gen/pycode.yaml")
    try:
        return yaml.safe_load(path.read_text())["data"]["pair"]
    except (yaml.YAMLError, KeyError, TypeError) as e:
        raise ValueError(f"--data.build_config {build_config} is not a data_gen config with data.pair "
                         f"({type(e).__name__}); see configs/data_gen/pycode.yaml") from e
