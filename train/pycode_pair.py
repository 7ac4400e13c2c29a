"""Train the embedded `pycode` draft/target pair on the Python standard library.

    python -m train.pycode_pair                       # tokenizer, draft, target (resumes)
    python -m train.pycode_pair --target-steps 200    # a shorter run

Builds a byte-level BPE tokenizer and two GPT-2 causal LMs on the stdlib train split
(data_gen.stdlib), and saves them as ordinary Hugging Face folders under
checkpoints/pycode/{draft,target}. Training state is saved every few hundred steps under
checkpoints/pycode/.state/ so an interrupted run continues where it stopped. Weights are
stored in float16 to keep the repository small; load them in float32 on a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from data_gen.stdlib import read_source, stdlib_files

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "checkpoints" / "pycode"
EOS = "<|endoftext|>"


@dataclass
class LMSpec:
    """Shape and schedule of one GPT-2 model of the pair."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    steps: int
    lr: float
    batch: int = 4
    context: int = 512
    warmup: int = 100


DRAFT = LMSpec("draft", n_layer=2, n_embd=128, n_head=4, steps=3000, lr=2e-3)
TARGET = LMSpec("target", n_layer=8, n_embd=384, n_head=6, steps=2000, lr=8e-4)


def build_tokenizer(vocab_size: int, out: Path):
    """Byte-level BPE on the train split, saved as a PreTrainedTokenizerFast in `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (out / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(out)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    texts = [read_source(p) for p in stdlib_files("train")]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS
    )
    fast.model_max_length = TARGET.context
    fast.save_pretrained(out)
    return fast


def token_stream(tokenizer, split: str) -> np.ndarray:
    """All files of a split tokenized and joined by EOS, as one uint16 array."""
    ids: list[int] = []
    texts = [read_source(p) for p in stdlib_files(split)]
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    return np.asarray(ids, dtype=np.uint16)


def windows(stream: np.ndarray, n: int, context: int, gen: torch.Generator) -> torch.Tensor:
    """(n, context) random windows of the stream."""
    starts = torch.randint(0, len(stream) - context - 1, (n,), generator=gen).tolist()
    return torch.from_numpy(np.stack([stream[s : s + context] for s in starts]).astype(np.int64))


def make_model(spec: LMSpec, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=spec.context,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def lr_at(step: int, spec: LMSpec) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    t = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def heldout_loss(model, stream: np.ndarray, context: int, n: int = 32, seed: int = 1) -> float:
    """Mean next-token loss (nats) on n fixed windows of a held-out stream."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    x = windows(stream, n, context, gen)
    losses = [model(x[i : i + 4], labels=x[i : i + 4]).loss.item() for i in range(0, n, 4)]
    model.train()
    return float(np.mean(losses))


def train_lm(spec: LMSpec, tokenizer, train: np.ndarray, dev: np.ndarray, seed: int) -> dict:
    """Train one model (resuming from its saved state) and save it as an HF folder."""
    state_path = OUT / ".state" / f"{spec.name}.pt"
    final = OUT / spec.name
    if (final / "model.safetensors").exists():
        print(f"{spec.name}: already trained at {final}")
        return json.loads((final / "training.json").read_text())
    torch.manual_seed(seed)
    model = make_model(spec, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    step, spent = 0, 0.0
    if state_path.exists():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step, spent = st["step"], st["seconds"]
        print(f"{spec.name}: resuming at step {step}")
    n_params = sum(p.numel() for p in model.parameters())
    bar = tqdm(range(step, spec.steps), desc=f"{spec.name} {n_params / 1e6:.1f}M", initial=step, total=spec.steps)
    t0 = time.perf_counter()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec)
        x = windows(train, spec.batch, spec.context, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % 250 == 0 and step + 1 < spec.steps:
            state_path.parent.mkdir(parents=True, exist_ok=True)
            seconds = spent + time.perf_counter() - t0
            st = {"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                  "step": step + 1, "seconds": seconds}
            torch.save(st, state_path.with_suffix(".tmp"))
            state_path.with_suffix(".tmp").replace(state_path)  # atomic: a kill never leaves half a file
    seconds = spent + time.perf_counter() - t0
    info = {
        "spec": asdict(spec), "seed": seed, "parameters": n_params, "train_seconds": round(seconds, 1),
        "train_tokens": spec.steps * spec.batch * spec.context,
        "dev_loss": round(heldout_loss(model, dev, spec.context), 4),
    }
    print(f"{spec.name}: {n_params / 1e6:.1f}M params, {info['train_tokens'] / 1e6:.2f}M tokens, "
          f"{seconds / 60:.1f} min, dev loss {info['dev_loss']:.3f} nats/token")
    model.half().save_pretrained(final)
    tokenizer.save_pretrained(final)
    (final / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    state_path.unlink(missing_ok=True)
    return info


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--draft-steps", type=int, default=DRAFT.steps)
    ap.add_argument("--target-steps", type=int, default=TARGET.steps)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tok_dir = OUT / ".state" / "tokenizer"
    tokenizer = build_tokenizer(args.vocab_size, tok_dir)
    train, dev = token_stream(tokenizer, "train"), token_stream(tokenizer, "dev")
    print(f"tokens: train {len(train) / 1e6:.2f}M, dev {len(dev) / 1e6:.3f}M "
          f"({time.perf_counter() - t0:.0f} s for tokenizer and tokenization)")
    DRAFT.steps, TARGET.steps = args.draft_steps, args.target_steps
    for spec in (DRAFT, TARGET):
        train_lm(spec, tokenizer, train, dev, args.seed)
    print(f"pair built in {(time.perf_counter() - t0) / 60:.1f} min total -> {OUT}")


if __name__ == "__main__":
    main()
