"""A draft built from a target's layers, and what distilling it needs: making it (the target's layers, its final norm,
its embeddings and tied output layer shared), exporting what it owns, storing the target's answers, the forward-KL
step against the target's distribution and the held-out measures (top-1 agreement, alpha at T = 1). train.distill
runs them; decode.pair loads an export with embeddings "target".
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from decode.evaluation.report import write_atomic
from decode.pair import ModelSpec


def make_draft(target, layers: list[int]):
    """A draft of the target's `layers` (copied), its final norm, and its embeddings and output layer (shared)."""
    from transformers import AutoModelForCausalLM

    have = target.config.num_hidden_layers
    if max(layers) >= have or len(set(layers)) != len(layers):
        raise ValueError(f"recipe field layers {layers} must name distinct layers of the target's {have} (0..{have - 1})")
    config = type(target.config).from_dict(target.config.to_dict())
    config.num_hidden_layers = len(layers)
    for key in ("layer_types", "mlp_bias_layers"):  # per-layer lists, where a config keeps them
        if isinstance(getattr(config, key, None), list):
            setattr(config, key, [getattr(target.config, key)[i] for i in layers])
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(target.device)
    for new, old in enumerate(layers):
        draft.model.layers[new].load_state_dict(target.model.layers[old].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    share_embeddings(draft, target)
    return draft


def grow(draft, target, folder: Path) -> int:
    """Start `draft` from an exported draft of the same target, as large or smaller: its layers first, its final norm
    (as large: the same draft under another recipe, e.g. another run's folder and data). The further
    layers (copied from the target by make_draft) start adding nothing: the last weight of each of their sublayers
    (attention's output projection, the MLP's down projection) is zeroed, so the grown draft computes what the smaller
    one did, checked on a probe; training then only adds. For pre-norm residual layers (every decoder transformers
    builds today): a layer whose output is not a residual sum fails the check with a one-line error."""
    from safetensors.torch import load_file

    have = len(draft.model.layers)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise ValueError(f"recipe field grow names {folder}, which holds no exported draft (config.json and "
                         f"model.safetensors, as python -m train.distill writes them)")
    try:
        old = json.loads((folder / "config.json").read_text())
        weights = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}
        if not isinstance(old, dict):
            raise ValueError("config.json is not an object")
    except Exception as e:  # a cut or garbled file: safetensors, json and OS errors alike
        raise ValueError(f"recipe field grow: {folder} is not a readable exported draft ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:120]}); export it again or start the draft anew") from None
    n = old.get("num_hidden_layers", 0)
    if not isinstance(n, int) or not 0 < n <= have or old.get("hidden_size") != draft.config.hidden_size:
        raise ValueError(f"recipe field grow: {folder} has {n} layers of width {old.get('hidden_size')}; a draft of "
                         f"{have} layers of width {draft.config.hidden_size} grows from as many or fewer of its width")
    shape = ("model_type", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
    other = [k for k in shape if k in old and old[k] != getattr(draft.config, k, old[k])]
    if other:
        raise ValueError(f"recipe field grow: {folder} is a draft of another model ({', '.join(f'{k} {old[k]}' for k in other)}"
                         f", the target has {', '.join(str(getattr(draft.config, k)) for k in other)}); grow from a "
                         f"draft of this target")
    mine = draft.state_dict()
    bad = [k for k, v in weights.items() if k not in mine or mine[k].shape != v.shape]
    if bad:
        raise ValueError(f"recipe field grow: {folder} does not fit this draft (e.g. {bad[0]}); grow from a draft of "
                         f"the same target")
    small = make_draft(target, list(range(n)))
    missing = sorted(set(trained_state(small)) - set(weights))
    if missing:
        raise ValueError(f"recipe field grow: {folder} lacks weights of a {n}-layer draft (e.g. {missing[0]}); export "
                         f"it again or start the draft anew")
    draft.load_state_dict(weights, strict=False)
    if n == have:  # a continuation: every weight it owns is the export's
        return n
    small.load_state_dict(weights, strict=False)  # what the grown draft must still compute, checked below
    with torch.no_grad():
        for layer in draft.model.layers[n:]:
            for part in layer.children():
                last = [w for name, w in part.named_parameters() if name.endswith("weight") and w.dim() == 2][-1:]
                for w in last:
                    w.zero_()
        probe = torch.arange(1, 17, device=target.device).remainder(draft.config.vocab_size)[None]
        mask = torch.ones_like(probe)
        same = torch.equal(draft_logits(small, probe, mask), draft_logits(draft, probe, mask))
    if not same:
        raise ValueError(f"recipe field grow: zeroing the output projections of {type(layer).__name__} does not "
                         f"leave the draft unchanged; grow a draft of pre-norm residual layers, or start it anew")
    return n


def share_embeddings(draft, target) -> None:
    """The draft reads and writes through the target's (frozen) embedding matrix."""
    draft.model.embed_tokens.weight = target.model.embed_tokens.weight
    draft.tie_weights() if draft.config.tie_word_embeddings else None
    draft.model.embed_tokens.weight.requires_grad_(False)
    draft.draft_weights = [n for n, _ in draft.named_parameters() if "embed_tokens" not in n and "lm_head" not in n]


def trained_state(draft) -> dict[str, torch.Tensor]:
    """The weights the draft owns: every one but the shared embeddings and output layer."""
    return {k: v for k, v in draft.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}


def export(draft, out: Path, info: dict) -> None:
    """The draft as a folder decode.pair loads with embeddings "target": config and bfloat16 layers. No tokenizer: a
    draft sharing the target's embeddings reads the target's (decode.pair.load_tokenizers), which its file holds."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    draft.config.save_pretrained(out)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in trained_state(draft).items()}
    write_atomic(out / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    write_atomic(out / "training.json", lambda p: p.write_text(json.dumps(info, indent=2) + "\n"))


class Store:
    """The target's answers, one gzipped JSON line each ({"id", "setting", "prompt", "answer"} as token ids), kept
    beside the exported draft: appended per cycle, so the dear part of the run survives any interruption."""

    def __init__(self, path: Path):
        self.path, self.rows = path, []
        if path.exists():
            with gzip.open(path, "rt") as f:
                for line in f:
                    try:
                        self.rows.append(json.loads(line))
                    except json.JSONDecodeError:  # a line cut by an interrupted append: the rest was written whole
                        break

    def add(self, rows: list[dict]) -> None:
        self.rows += rows
        write_atomic(self.path, lambda p: _write_gz(p, self.rows))


def _write_gz(path: Path, rows: list[dict]) -> None:
    with gzip.open(path, "wt") as f:
        for r in rows:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


def answer(pair, prompts: list[list[int]], setting: dict, max_new: int, seed: int) -> list[list[int]]:
    """The target's answers to a batch of prompt ids under a sampling setting, each through its EOS (row i drawing
    from its own stream, seed + i): the project's batched target-alone loop (decode.batch.BatchAutoregressive)."""
    from decode.batch import BatchAutoregressive

    sampled = pair.with_sampling(**{"temperature": 1.0, "top_k": 0, "top_p": 1.0, **setting})
    return [g.tokens for g in BatchAutoregressive(sampled, seed=seed).generate(prompts, max_new)]


def teacher_pair(target, tokenizer, spec: ModelSpec, context: int):
    """The target as a decode.pair.Pair of itself: what the batched loop answers with."""
    from decode.pair import Pair, PairConfig

    cfg = PairConfig(name="distill-teacher", draft=spec, target=spec, chat_template=True, max_context=context)
    return Pair(cfg, target, target, tokenizer, len(tokenizer))


def batch_of(rows: list[dict], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stored answers -> (B, T) ids right-padded, (B, T) attention mask, (B, T) which positions predict an answer
    token (the last prompt token's through the answer's second-to-last), on device."""
    seqs = [r["prompt"] + r["answer"] for r in rows]
    width = max(map(len, seqs))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    scored = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, (r, s) in enumerate(zip(rows, seqs)):
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, :len(s)] = 1
        scored[b, len(r["prompt"]) - 1: len(s) - 1] = True
    return ids.to(device), mask.to(device), scored.to(device)


def draft_logits(draft, ids: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) ids -> (B, T', V) the draft's logits at the `keep` positions (all when None), its float32 layers run in
    bfloat16 beside the shared bfloat16 embeddings (autocast; the exported draft is bfloat16)."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        return draft(input_ids=ids, attention_mask=mask, **kept(keep)).logits


def kept(keep: torch.Tensor | None) -> dict:
    """Only the scored columns' logits: the output layer and softmax over 49k tokens are most of a small draft's cost."""
    return {} if keep is None else {"logits_to_keep": keep}


def pair_logits(draft, target, rows: list[dict], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored answers -> the target's (no grad) and the draft's (N, V) float32 logits at their N answer positions."""
    ids, mask, scored = batch_of(rows, target.device)
    keep = scored.any(0).nonzero().squeeze(1)  # columns where some row predicts an answer token
    with torch.no_grad():
        p_logits = target(input_ids=ids, attention_mask=mask, **kept(keep)).logits[scored[:, keep]][:, :vocab].float()
    q_logits = draft_logits(draft, ids, mask, keep)[scored[:, keep]][:, :vocab].float()
    return p_logits, q_logits


def kl_step(draft, target, rows: list[dict], vocab: int) -> tuple[torch.Tensor, int]:
    """Forward KL(p || q) at the answer positions of a batch, averaged -> (loss, positions)."""
    p_logits, q_logits = pair_logits(draft, target, rows, vocab)
    loss = F.kl_div(q_logits.log_softmax(-1), p_logits.log_softmax(-1), log_target=True, reduction="batchmean")
    return loss, p_logits.shape[0]


@torch.no_grad()
def measure(draft, target, rows: list[dict], vocab: int) -> dict:
    """Top-1 agreement with the target's greedy token and mean alpha at T = 1 over held-out answer positions."""
    agree = alpha = n = 0.0
    for i in range(0, len(rows), 8):
        p, q = (x.softmax(-1) for x in pair_logits(draft, target, rows[i: i + 8], vocab))
        agree += float((p.argmax(-1) == q.argmax(-1)).sum())
        alpha += float(torch.minimum(p, q).sum())
        n += p.shape[0]
    return {"top1": agree / max(n, 1), "alpha": alpha / max(n, 1), "positions": int(n)}
