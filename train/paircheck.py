"""Measure whether a draft/target pair is fit for speculative decoding.

    python -m train.paircheck --pair configs/pairs/pycode.yaml [--curve] [--skip-generate]

Prints, on held-out stdlib code (splits dev and test, never trained on): the cost of one
decoding step of each model (batch 1, KV cache), held-out loss of each, greedy agreement and
mean expected acceptance sum_x min(p(x), q(x)) at temperature 1, and the wall time of Hugging
Face `target.generate(assistant_model=draft)` at constant K against the target alone on the same
prompts (greedy, so every method emits the same tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from decode.cache.kv import forward, rollback_cache
from decode.clock import clock
from decode.hf import hf_generate
from decode.labels import accept_prob, expected_acceptance
from decode.pair import ROOT, Pair, input_device, load_pair


@torch.no_grad()
def step_cost_ms(model, prefix: torch.Tensor, steps: int = 40) -> float:
    """Median ms of one cached decoding step after a (1, T) prefix."""
    prefix, cache = prefix.to(input_device(model)), rollback_cache()
    now = clock(prefix.device)
    out = forward(model, prefix, cache)
    nxt, times = out.logits[:, -1:].argmax(-1), []
    for _ in range(steps):
        t0 = now()
        out = forward(model, nxt, cache)
        times.append(now() - t0)
        nxt = out.logits[:, -1:].argmax(-1)
    return 1e3 * statistics.median(times[5:])


def auroc(score: torch.Tensor, event: torch.Tensor) -> float:
    """(N,) scores, (N,) bool events -> area under the ROC curve (ties count one half)."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(event.numpy(), score.numpy())) if 0 < int(event.sum()) < len(event) else float("nan")


@torch.no_grad()
def heldout_figures(pair: Pair, texts: list[str], window: int = 256, windows: int = 96) -> dict:
    """Teacher-forced figures of the pair on seeded held-out windows, at T = 1.

    Losses, greedy agreement, expected acceptance sum_x min(p, q), the share of positions where the
    target's top-1 probability is >= 0.5, and how well the draft's own top-1 probability predicts
    two events: acceptance u < alpha of a candidate drawn from q (T = 1), and greedy agreement.
    """
    ids = pair.tokenizer(texts, add_special_tokens=False)["input_ids"]  # documents, not prompts: no template
    stream = torch.tensor([t for doc in ids for t in doc + [pair.eos_ids[0]]])
    n = len(stream) // window
    gen = torch.Generator().manual_seed(0)
    pick = torch.randperm(n, generator=gen)[:windows]
    chunks = stream[: n * window].view(n, window)[pick.sort().values]
    sums = {"draft_loss": 0.0, "target_loss": 0.0, "agree": 0.0, "accept": 0.0, "confident": 0.0}
    top1, accepted, agreed = [], [], []
    for batch in tqdm(chunks.split(8), desc="held-out", leave=False):
        lp = pair.logits(pair.target(batch.to(pair.input_device("target"))).logits[:, :-1]).log_softmax(-1)
        lq = pair.logits(pair.draft(batch.to(pair.input_device("draft"))).logits[:, :-1]).log_softmax(-1)
        lp, lq = lp.cpu(), lq.cpu()  # the figures are sums over a few windows: on the CPU, with the generator
        p, q, y = lp.exp(), lq.exp(), batch[:, 1:]
        sums["target_loss"] -= lp.gather(-1, y.unsqueeze(-1)).sum().item()
        sums["draft_loss"] -= lq.gather(-1, y.unsqueeze(-1)).sum().item()
        agree = lp.argmax(-1) == lq.argmax(-1)
        sums["agree"] += agree.sum().item()
        sums["accept"] += expected_acceptance(p, q).sum().item()
        sums["confident"] += (p.max(-1).values >= 0.5).sum().item()
        cand = torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=gen).view(y.shape)
        alpha = accept_prob(p.gather(-1, cand.unsqueeze(-1)), q.gather(-1, cand.unsqueeze(-1))).squeeze(-1)
        accepted.append((torch.rand(alpha.shape, generator=gen) < alpha).flatten())
        agreed.append(agree.flatten())
        top1.append(q.max(-1).values.flatten())
    count = sum(len(a) for a in agreed)
    score = torch.cat(top1)
    return {k: v / count for k, v in sums.items()} | {
        "tokens": count, "auroc_accept": auroc(score, torch.cat(accepted)), "auroc_agree": auroc(score, torch.cat(agreed))}


# Issue 9's bar for a pair that behaves like a real one: (figure, goal, higher is better).
GOALS = [("target_loss", 3.0, False), ("gap", 0.7, False), ("confident", 0.45, True), ("agree", 0.62, True),
         ("accept", 0.70, True), ("auroc_accept", 0.62, True), ("auroc_agree", 0.80, True)]


def goal_lines(f: dict) -> list[str]:
    """One 'met'/'not met' line per goal, from the figures."""
    f = f | {"gap": f["draft_loss"] - f["target_loss"]}
    out = []
    for key, goal, higher in GOALS:
        met = f[key] >= goal if higher else f[key] <= goal
        out.append(f"{key} {f[key]:.3f} (goal {'>=' if higher else '<='} {goal}): {'met' if met else 'NOT met'}")
    return out


def time_generate(pair: Pair, prompts: list[str], new_tokens: int, k: int | None) -> tuple[float, int]:
    """Seconds and new tokens for greedy generation over prompts; k=None is the target alone."""
    greedy, total_s, total_n = pair.with_sampling(temperature=0), 0.0, 0
    for i, prompt in enumerate(prompts):
        ids = pair.encode(prompt)
        out, st = hf_generate(greedy, ids, new_tokens, {} if k is None else {"k": k}, seed=i)
        total_s, total_n = total_s + st.wall, total_n + len(out)
    return total_s, total_n


def curve(pair: Pair, texts: list[str], snapshots: Path) -> None:
    """Held-out figures at every saved snapshot of training (a learning curve), as a table."""
    import dataclasses

    from decode.pair import ModelSpec, load_model
    from train.pycode_pair import parse_snapshot

    rows = []
    for snap in sorted(snapshots.iterdir()):
        if (parsed := parse_snapshot(snap)) is None:
            continue
        which, step = parsed
        model = load_model(ModelSpec(str(snap), dtype="float32"))
        info = json.loads((snap / "training.json").read_text())
        f = heldout_figures(dataclasses.replace(pair, **{which: model}), texts)
        rows.append((which, int(step), info["train_tokens"], f))
    if not rows:
        raise SystemExit(f"no snapshots in {snapshots}: they are written by python -m train.pycode_pair")
    print(f"\nlearning curve ({snapshots}; each snapshot beside the other model's final weights)")
    print("| model | step | train tokens | target NLL | draft NLL | top-1 >= 0.5 | greedy agreement | "
          "sum min(p,q) | AUROC accept (T=1) | AUROC agreement |\n|---|---|---|---|---|---|---|---|---|---|")
    for which, step, tokens, f in rows:
        print(f"| {which} | {step} | {tokens / 1e6:.1f}M | {f['target_loss']:.3f} | {f['draft_loss']:.3f} | "
              f"{f['confident']:.3f} | {f['agree']:.3f} | {f['accept']:.3f} | {f['auroc_accept']:.3f} | "
              f"{f['auroc_agree']:.3f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="configs/pairs/pycode.yaml")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--curve", type=Path, nargs="?", const=Path("checkpoints/pycode/.state/snapshots"),
                    help="also print the figures at every training snapshot in this folder")
    ap.add_argument("--skip-generate", action="store_true", help="held-out figures only, no HF timing")
    args = ap.parse_args(argv)
    for name in ("prompts", "new_tokens", "max_k", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from data_gen.prompts import PromptSet
    from data_gen.stdlib import read_source, stdlib_files

    pair = load_pair(args.pair)
    prompts = PromptSet("pycode", "test", limit=args.prompts, seed=0).load()["prompt"]
    prefix = pair.tokenizer(prompts[0], return_tensors="pt")["input_ids"]
    step_cost_ms(pair.draft, prefix, steps=10)  # warm-up: the first model timed must not pay for the allocator
    c_d, c_t = step_cost_ms(pair.draft, prefix), step_cost_ms(pair.target, prefix)
    print(f"decoding step (batch 1, KV cache, {args.threads} threads): draft {c_d:.2f} ms, "
          f"target {c_t:.2f} ms, ratio {c_t / c_d:.1f}x (goal >= 6x: {'met' if c_t / c_d >= 6 else 'NOT met'})")

    texts = [read_source(p) for p in stdlib_files("dev") + stdlib_files("test")]
    f = heldout_figures(pair, texts)
    print(f"held-out stdlib ({f['tokens']} tokens): target loss {f['target_loss']:.3f}, "
          f"draft loss {f['draft_loss']:.3f} nats/token")
    print(f"greedy agreement {f['agree']:.3f}; mean expected acceptance sum_x min(p,q) at T=1: {f['accept']:.3f}; "
          f"target top-1 >= 0.5 at {f['confident']:.3f} of positions")
    print(f"AUROC of the draft's top-1 probability: {f['auroc_accept']:.3f} for acceptance u < alpha at T=1, "
          f"{f['auroc_agree']:.3f} for greedy agreement")
    print("\n".join(goal_lines(f)))
    if args.curve is not None:
        curve(pair, texts, args.curve if args.curve.is_absolute() else ROOT / args.curve)
    if args.skip_generate:
        return

    time_generate(pair, prompts[:2], 8, None)  # warm-up
    time_generate(pair, prompts[:2], 8, 2)
    rows = []
    for k in tqdm([None] + list(range(1, args.max_k + 1)), desc="HF generate"):
        s, n = time_generate(pair, prompts, args.new_tokens, k)
        rows.append((k, s, n))
    base = rows[0][1]
    print(f"\nHF generate, {len(prompts)} pycode test prompts, greedy, {args.new_tokens} new tokens")
    print("| method | seconds | tokens | tokens/s | speedup |\n|---|---|---|---|---|")
    for k, s, n in rows:
        name = "target alone" if k is None else f"assisted K={k}"
        print(f"| {name} | {s:.2f} | {n} | {n / s:.1f} | {base / s:.2f}x |")
    best = min(rows[1:], key=lambda r: r[1])
    speedup = base / best[1]
    print(f"best constant K = {best[0]}: {speedup:.2f}x over the target alone "
          f"(goal >= 1.3x: {'met' if speedup >= 1.3 else 'NOT met'})")


if __name__ == "__main__":
    main()
