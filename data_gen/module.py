"""Lightning pieces of the labelling stage: prompts in, label shards out, via Trainer.predict.

`--trainer.devices N --trainer.strategy ddp` spreads prompts over processes or nodes: each rank
takes every N-th prompt (no DistributedSampler padding, so no prompt is labelled twice) and
writes its own shards.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader

from data_gen.generate import KINDS, Mixing, label_batch
from data_gen.prompts import PromptSet
from data_gen.store import (
    claim_output,
    clean_partial,
    code_version,
    done_ids,
    lock_output,
    set_aside_damaged,
    write_shard,
)
from decode.pair import PairConfig, Sampling, load_pair, load_tokenizers
from decode.prompting import encode

ROOT = Path(__file__).resolve().parents[1]


class PromptData(L.LightningDataModule):
    """Prompt sets -> batches of token-id prompts not yet labelled in `output`.

    Rule for bad prompts: empty (or whitespace-only) prompts are skipped; prompts longer than
    pair.max_context - max_new_tokens tokens keep their last tokens (the ones nearest to the
    continuation). Both are counted in `self.counts` and in the closing summary.
    """

    def __init__(self, pair: str = "configs/pairs/pycode.yaml", output: str = "data/pycode",
                 prompts: list[PromptSet] | None = None, batch_size: int = 16, max_new_tokens: int = 96):
        super().__init__()
        for name, value in (("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
            if value < 1:
                raise ValueError(f"--data.{name} must be >= 1, got {value}")
        self.pair, self.output, self.batch_size, self.max_new_tokens = pair, output, batch_size, max_new_tokens
        self.prompt_sets = prompts if prompts is not None else [PromptSet("pycode", "train")]
        self.counts: dict[str, int] = {}
        self.items: list[dict] = []

    @property
    def output_dir(self) -> Path:
        p = Path(self.output)
        return p if p.is_absolute() else ROOT / p

    def setup(self, stage: str) -> None:
        cfg = PairConfig.from_yaml(self.pair)
        _, tok = load_tokenizers(cfg)
        budget = cfg.max_context - self.max_new_tokens
        if budget < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} leaves no room for a prompt in "
                             f"max_context={cfg.max_context} of pair {cfg.name}")
        if self.trainer is None or self.trainer.global_rank == 0:
            # Rank 0 holds the folder's lock for the whole run; other ranks are part of the same run.
            if getattr(self, "_lock", None) is not None:
                self._lock.close()  # the previous setting's folder is finished
            self._lock = lock_output(self.output_dir)
            clean_partial(self.output_dir)
            for line in set_aside_damaged(self.output_dir):
                print(f"[data_gen] {line}", flush=True)
            done = done_ids(self.output_dir)
        else:  # rank 0 may not have set damaged shards aside yet: count only whole ones
            done = done_ids(self.output_dir, check=True)
        counts = {"prompts": 0, "empty_skipped": 0, "truncated": 0, "already_done": 0}
        items = []
        for ps in self.prompt_sets:
            ds = ps.load()
            for row in ds:
                counts["prompts"] += 1
                pid = f"{ps.name}/{ps.split}/{row['id']}"
                ids = encode(tok, row["prompt"], cfg.chat_template)
                if not ids:
                    counts["empty_skipped"] += 1
                    continue
                if len(ids) > budget:  # the text's oldest tokens go; BOS and the chat template stay
                    ids, counts["truncated"] = encode(tok, row["prompt"], cfg.chat_template, budget), counts["truncated"] + 1
                if pid in done:
                    counts["already_done"] += 1
                    continue
                items.append({"id": pid, "split": ps.split if ps.name == "pycode" else f"{ps.name}_{ps.split}",
                              "prompt_ids": ids})
        self.counts, self.items = counts, items

    def teardown(self, stage: str) -> None:
        if getattr(self, "_lock", None) is not None:  # released when the folder is done, not at process exit
            self._lock.close()
            self._lock = None

    def predict_dataloader(self) -> DataLoader:
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        mine = self.items[rank::world]
        return DataLoader(mine, batch_size=self.batch_size, shuffle=False, collate_fn=list)


class Labeller(L.LightningModule):
    """Runs data_gen.generate.label_batch on each batch; the pair is loaded in setup, frozen."""

    def __init__(self, pair: str = "configs/pairs/pycode.yaml", mixing: Mixing | None = None, seed: int = 0,
                 max_new_tokens: int = 96, cache_features: bool = True, threads: int = 0,
                 sampling: Sampling | None = None, siblings: int = 0):
        """sampling: the setting responses and labels are made under (None: the pair's own). siblings: m > 0 also
        labels, at every position, the m children a token tree drafts there (data_gen.generate.siblings_of)."""
        super().__init__()
        if siblings < 0:
            raise ValueError(f"--model.siblings must be >= 0 (0: no sibling labels), got {siblings}")
        self.siblings = siblings
        self.pair_path, self.mixing, self.seed, self.sampling = pair, mixing or Mixing(), seed, sampling
        self.max_new_tokens, self.cache_features, self.threads = max_new_tokens, cache_features, threads
        self.pair = None

    def setup(self, stage: str) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        if self.pair is None:  # once per process: each sampling setting reuses the loaded models
            self.pair = load_pair(self.pair_path, device=self.rank_device())
        if self.sampling is not None:
            self.pair = self.pair.with_sampling(**vars(self.sampling))
        claim_output(self.trainer.datamodule.output_dir, self.identity())

    def rank_device(self) -> torch.device:
        """This rank's own device. The pair is not a submodule (it must not be trained or checkpointed), so
        Lightning never moves it: each rank loads it straight onto its device instead. A sharded model
        (device_map) under several ranks would put every rank's copy on every GPU: refused."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        cfg = PairConfig.from_yaml(self.pair_path)
        if strategy is not None and self.trainer.world_size > 1 and (cfg.draft.device_map or cfg.target.device_map):
            raise ValueError(f"pair {cfg.name} shards a model with device_map, and {self.trainer.world_size} ranks "
                             "would each spread a copy over every GPU: set device_map: null to give each rank the "
                             "pair on its own GPU, or label with one process (--trainer.devices 1)")
        return strategy.root_device if strategy is not None else torch.device("cpu")

    def identity(self) -> dict:
        cfg = self.pair.config
        return {
            "pair": cfg.name, "pair_hash": cfg.hash(), "draft": self.pair.identity("draft"),
            "target": self.pair.identity("target"), "sampling": vars(cfg.sampling), "seed": self.seed,
            "mixing": {"shares": self.mixing.shares, "r": self.mixing.r}, "max_new_tokens": self.max_new_tokens,
            "prompts": [vars(p) for p in self.trainer.datamodule.prompt_sets], "code_version": code_version(),
            "hidden_states": "draft last layer (after final norm); row 0 = last prompt token, row i = after z_i",
        } | ({"siblings": self.siblings} if self.siblings else {})  # absent at 0: older label sets stay resumable

    def kind_of(self, pid: str) -> str:
        """Prefix kind of one prompt, drawn by the shares from a hash of (seed, id): stable across runs."""
        u = int(hashlib.sha256(f"kind:{self.seed}:{pid}".encode()).hexdigest()[:12], 16) / 16**12
        names = [k for k in KINDS if self.mixing.shares.get(k, 0) > 0]
        weights = torch.tensor([self.mixing.shares[k] for k in names], dtype=torch.float64)
        edges = (weights / weights.sum()).cumsum(0).tolist()
        return next((k for k, e in zip(names, edges) if u < e), names[-1])

    def predict_step(self, batch: list[dict], batch_idx: int):
        kinds = [self.kind_of(b["id"]) for b in batch]
        records, feats = label_batch(self.pair, [b["prompt_ids"] for b in batch], [b["id"] for b in batch], kinds,
                                     self.mixing, self.seed, self.max_new_tokens, siblings=self.siblings)
        return {"splits": [b["split"] for b in batch], "records": records,
                "feats": feats if self.cache_features else None}


class ShardWriter(BasePredictionWriter):
    """Writes each predicted batch as one shard per split, as soon as it is done."""

    def __init__(self):
        super().__init__(write_interval="batch")

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        out = trainer.datamodule.output_dir
        for split in dict.fromkeys(prediction["splits"]):
            pick = [i for i, s in enumerate(prediction["splits"]) if s == split]
            feats = [prediction["feats"][i] for i in pick] if prediction["feats"] is not None else None
            write_shard(out, split, [prediction["records"][i] for i in pick], feats, trainer.global_rank)
