"""Save and load heads as model.safetensors + config.json, and refuse a head made for another draft."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from heads.modules import HEAD_TYPES, Head

# Fields of the draft identity that must match for a head's features to mean anything.
DRAFT_KEYS = ("config_hash", "weights", "hidden_size", "vocab_size", "num_layers")


class HeadMismatch(ValueError):
    """A head checkpoint was trained on another draft model."""


def save_pretrained(head: Head, directory: str | Path, meta: dict) -> Path:
    """Write model.safetensors and config.json (head type and sizes plus `meta`); returns the dir."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    config = {"head_type": type(head).__name__, "init_args": head.init_args, **meta}
    (directory / "config.json").write_text(json.dumps(config, indent=2, default=float) + "\n")
    return directory


def from_pretrained(directory: str | Path) -> tuple[Head, dict]:
    """Rebuild a head from a directory written by save_pretrained; returns (head in eval mode, config)."""
    directory = Path(directory)
    cfg_path, weights = directory / "config.json", directory / "model.safetensors"
    if not cfg_path.exists() or not weights.exists():
        raise FileNotFoundError(f"{directory} is not a head checkpoint (needs config.json and model.safetensors)")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
        kind = config["head_type"]
        if kind not in HEAD_TYPES:
            raise ValueError(f"unknown head_type {kind!r}, not one of {sorted(HEAD_TYPES)}")
        head = HEAD_TYPES[kind](**config["init_args"])
        head.load_state_dict(load_file(str(weights)))
    except (OSError, ValueError, KeyError, TypeError, SafetensorError, RuntimeError) as e:  # ValueError: bad JSON too
        # one line: torch's state-dict report lists every missing and unexpected key on lines of their own
        reason = f"no {e} entry in config.json" if isinstance(e, KeyError) else " ".join(str(e).split())[:200]
        raise ValueError(f"head checkpoint {directory} is corrupt or incomplete ({reason}): export it again") from e
    return head.eval().requires_grad_(False), config


def differing(recorded: dict, now: dict, keys) -> list[str]:
    """The keys where a recorded model identity (decode.pair.model_identity) and this one differ. The weights digest
    counts only where both have one: heads and label folders made before it was recorded have none, and weights
    offloaded by device_map read ""."""
    return [k for k in keys if recorded.get(k) != now.get(k) and (k != "weights" or (recorded.get(k) and now.get(k)))]


def check_draft(config: dict, draft_identity: dict, where: str = "head") -> None:
    """Raise HeadMismatch naming every field where the head's recorded draft differs from this one."""
    recorded = config.get("draft") or {}
    diff = [f"{k}: {where} was trained for {recorded.get(k)!r}, this draft has {draft_identity.get(k)!r}"
            for k in differing(recorded, draft_identity, DRAFT_KEYS)]
    if diff:
        same = recorded.get("path") == draft_identity.get("path")
        raise HeadMismatch(f"{where} was trained on " + (f"another version of draft {recorded.get('path')!r}" if same else
                           f"draft {recorded.get('path')!r}, not on {draft_identity.get('path')!r}") + ": " +
                           "; ".join(diff) + ". Retrain it for this draft.")
