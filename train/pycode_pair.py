"""Train the embedded `pycode` draft/target pair: a code target and a draft distilled from it.

    nohup python -m train.pycode_pair > pair.log 2>&1 &     # tokenizer, corpus, target, draft (resumes)
    python -m train.pycode_pair --target-steps 200 --draft-steps 100    # a shorter run

The tokenizer is a 4096-token byte-level BPE of the stdlib train split. The corpus (train.corpus) is
the stdlib train split plus the filtered Python source of the installed packages; windows are drawn
from the stdlib with probability `--stdlib-share`, else from the packages. The target is a GPT-2 of 12
layers x 256 (deep and narrow: decode cost on a CPU is per layer, training cost is FLOPs); the draft
(2 x 128) is then trained on the same windows against the target's distribution (forward KL at
T = 1), as production drafts are. Training steps are compiled (torch.compile) in float32.

State is saved every `--save-every` steps under checkpoints/pycode/.state/ so an interrupted run
continues where it stopped, and four snapshots per model are kept there for the learning curve
(`python -m train.paircheck --curve`). The pair replaces checkpoints/pycode/{draft,target} only when
both models are done; the weights are stored in float16.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from data_gen.stdlib import read_source, stdlib_files

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "checkpoints" / "pycode"
EOS = "<|endoftext|>"
SNAPSHOTS = 4  # per model, evenly spaced, for the learning curve


@dataclass
class LMSpec:
    """Shape and schedule of one GPT-2 model of the pair."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    steps: int
    lr: float
    batch: int = 8
    context: int = 512
    warmup: int = 100
    distill: bool = False  # train against the target's distribution instead of the data


DRAFT = LMSpec("draft", n_layer=2, n_embd=128, n_head=4, steps=900, lr=3e-3, batch=16, distill=True)
TARGET = LMSpec("target", n_layer=12, n_embd=256, n_head=4, steps=2400, lr=1.5e-3)


def build_tokenizer(vocab_size: int, out: Path):
    """Byte-level BPE on the stdlib train split, saved as a PreTrainedTokenizerFast in `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (out / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(out)
    if (OUT / "target" / "tokenizer.json").exists():  # keep the shipped pair's tokens: prompts stay comparable
        fast = PreTrainedTokenizerFast.from_pretrained(OUT / "target")
        fast.save_pretrained(out)
        return fast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    texts = [read_source(p) for p in stdlib_files("train")]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS)
    fast.model_max_length = TARGET.context
    fast.save_pretrained(out)
    return fast


def encode(tokenizer, texts: list[str], desc: str, chunk: int = 256) -> np.ndarray:
    """Texts tokenized and joined by EOS, as one uint16 array."""
    parts = []
    for i in tqdm(range(0, len(texts), chunk), desc=f"tokenize {desc}", unit="chunk"):
        for ids in tokenizer(texts[i : i + chunk], add_special_tokens=False)["input_ids"]:
            parts.append(np.asarray(ids + [tokenizer.eos_token_id], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def load_streams(tokenizer, state: Path) -> tuple[dict[str, np.ndarray], dict]:
    """Token streams {stdlib, packages, dev}, cached under .state by the corpus fingerprint."""
    from train.corpus import build_corpus

    corpus = build_corpus()
    fp = corpus.fingerprint()
    cache = state / f"corpus-{fp}.npz"
    if cache.exists():
        streams = dict(np.load(cache))
    else:
        streams = {"stdlib": encode(tokenizer, corpus.stdlib, "stdlib"),
                   "packages": encode(tokenizer, corpus.packages, "packages"),
                   "dev": encode(tokenizer, [read_source(p) for p in stdlib_files("dev")], "dev")}
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.savez(cache.with_suffix(".tmp.npz"), **streams)
        cache.with_suffix(".tmp.npz").replace(cache)
    info = {"fingerprint": fp, "stdlib_train_tokens": int(len(streams["stdlib"])),
            "package_tokens": int(len(streams["packages"])), "package_files": len(corpus.packages),
            "dropped_files": dict(corpus.dropped), "distributions": corpus.distributions}
    return streams, info


def windows(streams: dict[str, np.ndarray], share: float, n: int, context: int, gen: torch.Generator) -> torch.Tensor:
    """(n, context) random windows: from the stdlib with probability `share`, else from the packages."""
    pick = torch.rand(n, generator=gen) < share
    rows = []
    for from_stdlib in pick.tolist():
        s = streams["stdlib" if from_stdlib or len(streams["packages"]) <= context + 1 else "packages"]
        start = int(torch.randint(0, len(s) - context - 1, (1,), generator=gen))
        rows.append(s[start : start + context])
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def make_model(spec: LMSpec, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=len(tokenizer), n_positions=spec.context, n_embd=spec.n_embd, n_layer=spec.n_layer,
                     n_head=spec.n_head, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.eos_token_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
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
    x = windows({"stdlib": stream, "packages": stream}, 1.0, n, context, torch.Generator().manual_seed(seed))
    losses = [model(x[i : i + 8], labels=x[i : i + 8]).loss.item() for i in range(0, n, 8)]
    model.train()
    return float(np.mean(losses))


def loss_fn(model, teacher):
    """(B, T) ids -> scalar loss: next-token CE on the data, or forward KL to the teacher's distribution."""

    def step(x: torch.Tensor) -> torch.Tensor:
        logits = model(x[:, :-1]).logits
        if teacher is None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        else:
            with torch.no_grad():
                p_log = teacher(x[:, :-1]).logits.log_softmax(-1)
            q_log = logits.log_softmax(-1)
            loss = (p_log.exp() * (p_log - q_log)).sum(-1).mean()
        loss.backward()
        return loss.detach()

    return step


def snapshot_dir(snapshots: Path, model: str, step: int) -> Path:
    """Where a snapshot of `model` ("target" | "draft") at `step` lives: <snapshots>/<model>-<step:05d>."""
    return snapshots / f"{model}-{step:05d}"


def parse_snapshot(folder: Path) -> tuple[str, int] | None:
    """(model, step) of a snapshot folder written by snapshot_dir, None for anything else."""
    which, _, step = folder.name.rpartition("-")
    return (which, int(step)) if which in ("draft", "target") and step.isdigit() else None


def save_hf(model, tokenizer, folder: Path, info: dict | None = None) -> None:
    """Model as an fp16 Hugging Face folder (written aside, then renamed into place)."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    half = type(model)(model.config)
    half.load_state_dict(model.state_dict())
    half.half().save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if info is not None:
        (tmp / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)


def train_lm(spec: LMSpec, tokenizer, streams: dict, corpus: dict, args, teacher=None) -> Path:
    state = args.out / ".state"
    """Train one model (resuming from its saved state); returns its finished fp16 folder under .state."""
    final = state / "final" / spec.name
    if (final / "training.json").exists() and json.loads((final / "training.json").read_text())["spec"] == asdict(spec):
        print(f"{spec.name}: already trained at {final}")
        return final
    state_path = state / f"{spec.name}.pt"
    torch.manual_seed(args.seed)
    model = make_model(spec, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    step, spent = 0, 0.0
    if state_path.exists():
        st = torch.load(state_path, weights_only=True)  # plain: tensors, dicts, numbers
        if st["spec"] != asdict(spec):
            raise SystemExit(f"{state_path} was saved by a run with {st['spec']}, not {asdict(spec)}: "
                             "run with the same options, or delete the file to start this model again")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step, spent = st["step"], st["seconds"]
        print(f"{spec.name}: resuming at step {step}")
    step_fn = torch.compile(loss_fn(model, teacher)) if args.compile else loss_fn(model, teacher)
    n_params = sum(p.numel() for p in model.parameters())
    snap_every = max(1, spec.steps // SNAPSHOTS)
    bar = tqdm(range(step, spec.steps), desc=f"{spec.name} {n_params / 1e6:.1f}M", initial=step, total=spec.steps)
    t0 = time.perf_counter()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec)
        loss = step_fn(windows(streams, args.stdlib_share, spec.batch, spec.context + 1, gen))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        done = step + 1
        if done % snap_every == 0 and done < spec.steps:
            save_hf(model, tokenizer, snapshot_dir(state / "snapshots", spec.name, done),
                    {"step": done, "train_tokens": done * spec.batch * spec.context})
        if done % args.save_every == 0 and done < spec.steps:
            st = {"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": done,
                  "seconds": spent + time.perf_counter() - t0, "spec": asdict(spec)}
            torch.save(st, state_path.with_suffix(".tmp"))
            state_path.with_suffix(".tmp").replace(state_path)  # atomic: a kill never leaves half a file
    seconds = spent + time.perf_counter() - t0
    import transformers

    info = {"spec": asdict(spec), "seed": args.seed, "parameters": n_params, "train_seconds": round(seconds, 1),
            "train_tokens": spec.steps * spec.batch * spec.context, "stdlib_share": args.stdlib_share,
            "objective": "forward KL to the target at T=1" if teacher is not None else "next-token cross-entropy",
            "dev_loss": round(heldout_loss(model, streams["dev"], spec.context), 4),
            "torch": torch.__version__, "transformers": transformers.__version__, "corpus": corpus}
    print(f"{spec.name}: {n_params / 1e6:.1f}M params, {info['train_tokens'] / 1e6:.2f}M tokens, "
          f"{seconds / 60:.1f} min, dev loss {info['dev_loss']:.3f} nats/token")
    save_hf(model, tokenizer, final, info)
    save_hf(model, tokenizer, snapshot_dir(state / "snapshots", spec.name, spec.steps),
            {"step": spec.steps, "train_tokens": info["train_tokens"]})
    state_path.unlink(missing_ok=True)
    return final


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--draft-steps", type=int, default=DRAFT.steps)
    ap.add_argument("--target-steps", type=int, default=TARGET.steps)
    ap.add_argument("--stdlib-share", type=float, default=0.25, help="share of windows drawn from the stdlib")
    ap.add_argument("--save-every", type=int, default=100, help="steps between resumable states")
    ap.add_argument("--compile", type=int, default=1, help="1: torch.compile the training step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT, help="where the pair goes (its state in OUT/.state)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.stdlib_share <= 1.0:
        ap.error(f"--stdlib-share must be in [0, 1], got {args.stdlib_share}")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tokenizer = build_tokenizer(args.vocab_size, args.out / ".state" / "tokenizer")
    streams, corpus = load_streams(tokenizer, args.out / ".state")
    print(f"tokens: stdlib train {corpus['stdlib_train_tokens'] / 1e6:.2f}M, packages {corpus['package_tokens'] / 1e6:.1f}M "
          f"({corpus['package_files']} files), dev {len(streams['dev']) / 1e6:.3f}M "
          f"({time.perf_counter() - t0:.0f} s for tokenizer and corpus)")
    DRAFT.steps, TARGET.steps = args.draft_steps, args.target_steps
    target_dir = train_lm(TARGET, tokenizer, streams, corpus, args)
    from transformers import GPT2LMHeadModel

    teacher = GPT2LMHeadModel.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)
    draft_dir = train_lm(DRAFT, tokenizer, streams, corpus, args, teacher=teacher)
    for name, src in (("target", target_dir), ("draft", draft_dir)):
        shutil.rmtree(args.out / name, ignore_errors=True)
        shutil.copytree(src, args.out / name)
    print(f"pair built in {(time.perf_counter() - t0) / 60:.1f} min this run -> {args.out}")


if __name__ == "__main__":
    main()
