"""Label sets on disk: Arrow shards written with `datasets`, one metadata record, feature shards.

    <output>/metadata.json                       pair, hashes, sampling, seed, mixing, siblings, code version
    <output>/<split>/<shard>/                    a Dataset.save_to_disk folder, one row per sequence
    <output>/<split>/<shard>.features.safetensors  (sum_i (n_i + 1), H) float16 draft hidden states

A shard appears under its final name only when complete (written under a temporary name and
renamed), so a killed run leaves whole shards or nothing, and a restart skips the prompts found.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import datasets
import torch
from safetensors.torch import load_file, save_file

from heads.io import differing

datasets.disable_progress_bars()

# Keys whose values must match for new records to join an existing label set.
IDENTITY_KEYS = ("pair_hash", "draft", "target", "sampling", "seed", "mixing", "max_new_tokens", "siblings")


class LabelSetMismatch(ValueError):
    """The output folder holds labels made under other settings."""


class OutputBusy(RuntimeError):
    """Another labelling run is writing to the same output folder."""


def lock_output(output: Path):
    """Hold an exclusive lock on output/.lock for this process's lifetime (one writer per folder).

    Returns the open lock file; the lock goes when the process ends, however it ends.
    """
    import fcntl
    import os

    output.mkdir(parents=True, exist_ok=True)
    f = open(output / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise OutputBusy(f"another data_gen run (pid {f.read().strip() or '?'}) is writing to {output}; "
                         "wait for it or stop it (Ctrl-C) before starting another") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def code_version() -> str:
    """Commit of the working tree when it is a git checkout, else 'unknown'."""
    try:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def same(recorded, now) -> bool:
    """One identity field of a label folder against this run's; a model's (draft, target) as heads compare theirs."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        return not differing(recorded, now, recorded.keys() | now.keys())
    return recorded == now


def claim_output(output: Path, meta: dict) -> None:
    """Write metadata.json, or check that an existing one describes the same labelling."""
    path = output / "metadata.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = [k for k in IDENTITY_KEYS if not same(old.get(k), meta.get(k))]
        if diff:
            details = "; ".join(f"{k}: folder has {old.get(k)!r}, this run has {meta.get(k)!r}" for k in diff)
            raise LabelSetMismatch(
                f"{output} holds labels made under other settings ({details}). Use another --data.output "
                "or delete the folder; records of different settings are never mixed."
            )
        return
    output.mkdir(parents=True, exist_ok=True)
    # Every DDP rank claims the folder at once: each writes its own temporary file (a shared name let one
    # rank move the file away before the other's replace) and the atomic replace leaves one whole file.
    tmp = path.with_name(f".metadata.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(meta, indent=2, default=str) + "\n")
    tmp.replace(path)


def shard_dirs(output: Path, split: str) -> list[Path]:
    """Complete shards of one split, in name order."""
    d = output / split
    return sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")) if d.exists() else []


def all_shards(output: Path) -> list[Path]:
    """Complete shards of every split."""
    return [s for d in sorted(output.iterdir()) if d.is_dir() for s in shard_dirs(output, d.name)] \
        if output.exists() else []


def done_ids(output: Path, check: bool = False) -> set[str]:
    """Prompt ids already labelled in any split (read from the shards' small id files); with check, only those
    of shards that open whole (shard_problem)."""
    ids: set[str] = set()
    for shard in all_shards(output):
        if not (check and shard_problem(shard)):
            ids.update(json.loads((shard / "ids.json").read_text()))
    return ids


class DamagedShard(ValueError):
    """A label shard on disk does not open whole: written atomically, it can only have been damaged from outside
    (an interrupted copy to another machine, a full disk)."""

    def __init__(self, shard: Path, problem: str):
        super().__init__(f"label shard {shard} does not open whole ({problem})")
        self.shard, self.problem = shard, problem


def shard_problem(shard: Path) -> str | None:
    """What keeps a shard from opening whole, in a few words (None: it is whole): its id list, every row of its
    Arrow table (datasets reads the whole stream on load) and the byte length its features header promises."""
    try:
        ids = json.loads((shard / "ids.json").read_text())
    except (OSError, ValueError) as e:
        return f"ids.json: {_first_line(e)}"
    try:
        rows = len(datasets.load_from_disk(str(shard)))
    except Exception as e:  # pyarrow and datasets raise several types for a cut stream
        return f"Arrow table: {_first_line(e)}"
    if rows != len(ids):
        return f"Arrow table: {rows} rows for {len(ids)} prompt ids"
    f = shard / "features.safetensors"
    return f"features.safetensors: {bad}" if f.exists() and (bad := safetensors_problem(f)) else None


def safetensors_problem(path: Path) -> str | None:
    """A safetensors file is 8 bytes of header length, the JSON header, then the data the header's offsets cover:
    a file cut short is shorter than that (None: whole)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 8 + n <= size else None
    except (OSError, ValueError) as e:
        return _first_line(e)
    if header is None:
        return f"truncated: {size} bytes, header alone promises {8 + n}"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return None if size == 8 + n + end else f"truncated: {size} of {8 + n + end} bytes"


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def set_aside_damaged(output: Path) -> list[str]:
    """Move every shard that does not open whole to <split>/.damaged-<name> (kept for a look, never read), so its
    prompts count as not labelled and are labelled again; returns one line per shard moved."""
    lines = []
    for shard in all_shards(output):
        problem = shard_problem(shard)
        if problem:
            aside = shard.with_name(f".damaged-{shard.name}")
            shutil.rmtree(aside, ignore_errors=True)
            shard.rename(aside)
            lines.append(f"damaged shard {shard} ({problem}): moved to {aside.name}, its prompts are labelled again")
    return lines


def write_shard(output: Path, split: str, records: list[dict], feats: list[torch.Tensor] | None, rank: int) -> Path:
    """Write one shard atomically; returns its final folder."""
    name = f"r{rank}-{uuid.uuid4().hex[:10]}"
    tmp = output / split / f".{name}.tmp"
    ds = datasets.Dataset.from_list(records)
    ds.save_to_disk(str(tmp))
    (tmp / "ids.json").write_text(json.dumps([r["id"] for r in records]))
    if feats is not None:
        save_file({"hidden": torch.cat(feats), "rows": torch.tensor([f.shape[0] for f in feats])},
                  str(tmp / "features.safetensors"))
    final = output / split / name
    tmp.rename(final)  # the shard exists under its real name only once complete
    return final


def clean_partial(output: Path) -> int:
    """Remove temporary shards left by a killed run; returns how many."""
    n = 0
    for tmp in output.glob("*/.*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
        n += 1
    return n


def load_split(output: str | Path, split: str) -> datasets.Dataset:
    """All sequences of one split as one Dataset (rows sorted by prompt id, so order is stable)."""
    output = Path(output)
    shards = shard_dirs(output, split)
    if not shards:
        raise FileNotFoundError(f"no label shards under {output / split}; run `python -m data_gen` first")
    ds = datasets.concatenate_datasets([_open(datasets.load_from_disk, s, s, "Arrow table") for s in shards])
    # Sorted by index (Dataset.sort goes through pyarrow's deprecated null_placement); a prompt labelled twice
    # (only possible if shards were copied in by hand) is kept once.
    ids = ds["id"]
    order = sorted(range(len(ids)), key=ids.__getitem__)
    keep = [i for n, i in enumerate(order) if n == 0 or ids[i] != ids[order[n - 1]]]
    return ds if keep == list(range(len(ids))) else ds.select(keep)


def _open(load, path: Path, shard: Path, what: str):
    """load(str(path)), a shard's `what`, or DamagedShard naming the shard when it does not open whole."""
    try:
        return load(str(path))
    except Exception as e:  # pyarrow, datasets and safetensors raise several types for a cut file
        raise DamagedShard(shard, f"{what}: {_first_line(e)}") from e


def load_features(output: str | Path, split: str) -> dict[str, torch.Tensor]:
    """Prompt id -> (n + 1, H) float16 hidden states, for label sets written with features."""
    out = {}
    for shard in shard_dirs(Path(output), split):
        f = shard / "features.safetensors"
        if not f.exists():
            raise FileNotFoundError(f"{shard} has no cached features; relabel with --model.cache_features true")
        t = _open(load_file, f, shard, f.name)
        ids = json.loads((shard / "ids.json").read_text())
        out.update(zip(ids, torch.split(t["hidden"], t["rows"].tolist())))
    return out


def metadata(output: str | Path) -> dict:
    path = Path(output) / "metadata.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: {output} is not a label set written by data_gen")
    return json.loads(path.read_text())
