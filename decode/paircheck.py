"""Measure whether a draft/target pair is fit for speculative decoding.

    python -m decode.paircheck --pair configs/pairs/pycode.yaml

Prints, on held-out stdlib code (splits dev and test, never trained on): the cost of one
decoding step of each model (batch 1, KV cache), held-out loss of each, greedy agreement and
mean expected acceptance sum_x min(p(x), q(x)) at temperature 1, and the wall time of Hugging
Face `target.generate(assistant_model=draft)` at constant K against the target alone on the same
prompts (greedy, so every method emits the same tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from decode.hf import hf_generate
from decode.labels import expected_acceptance
from decode.pair import Pair, load_pair


@torch.no_grad()
def step_cost_ms(model, prefix: torch.Tensor, steps: int = 40) -> float:
    """Median ms of one cached decoding step after a (1, T) prefix."""
    out = model(prefix, use_cache=True)
    cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(nxt, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        nxt = out.logits[:, -1:].argmax(-1)
    return 1e3 * statistics.median(times[5:])


@torch.no_grad()
def heldout_figures(pair: Pair, texts: list[str], window: int = 256, windows: int = 96) -> dict:
    """Teacher-forced losses, greedy agreement and expected acceptance on seeded held-out windows."""
    ids = pair.tokenizer(texts, add_special_tokens=False)["input_ids"]
    stream = torch.tensor([t for doc in ids for t in doc + [pair.tokenizer.eos_token_id]])
    n = len(stream) // window
    pick = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:windows]
    chunks = stream[: n * window].view(n, window)[pick.sort().values]
    sums = {"draft_loss": 0.0, "target_loss": 0.0, "agree": 0.0, "accept": 0.0}
    count = 0
    for batch in tqdm(chunks.split(8), desc="held-out", leave=False):
        lp = pair.logits(pair.target(batch).logits[:, :-1]).log_softmax(-1)
        lq = pair.logits(pair.draft(batch).logits[:, :-1]).log_softmax(-1)
        y = batch[:, 1:]
        sums["target_loss"] -= lp.gather(-1, y.unsqueeze(-1)).sum().item()
        sums["draft_loss"] -= lq.gather(-1, y.unsqueeze(-1)).sum().item()
        sums["agree"] += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
        sums["accept"] += expected_acceptance(lp.exp(), lq.exp()).sum().item()
        count += y.numel()
    return {k: v / count for k, v in sums.items()} | {"tokens": count}


def time_generate(pair: Pair, prompts: list[str], new_tokens: int, k: int | None) -> tuple[float, int]:
    """Seconds and new tokens for greedy generation over prompts; k=None is the target alone."""
    greedy, total_s, total_n = pair.with_sampling(temperature=0), 0.0, 0
    for i, prompt in enumerate(prompts):
        ids = pair.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        out, st = hf_generate(greedy, ids, new_tokens, {} if k is None else {"k": k}, seed=i)
        total_s, total_n = total_s + st.wall, total_n + len(out)
    return total_s, total_n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="configs/pairs/pycode.yaml")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from data_gen.prompts import PromptSet
    from data_gen.stdlib import read_source, stdlib_files

    pair = load_pair(args.pair)
    prompts = PromptSet("pycode", "test", limit=args.prompts, seed=0).load()["prompt"]
    prefix = pair.tokenizer(prompts[0], return_tensors="pt")["input_ids"]
    c_d, c_t = step_cost_ms(pair.draft, prefix), step_cost_ms(pair.target, prefix)
    print(f"decoding step (batch 1, KV cache, {args.threads} threads): draft {c_d:.2f} ms, "
          f"target {c_t:.2f} ms, ratio {c_t / c_d:.1f}x")

    f = heldout_figures(pair, [read_source(p) for p in stdlib_files("dev") + stdlib_files("test")])
    print(f"held-out stdlib ({f['tokens']} tokens): target loss {f['target_loss']:.3f}, "
          f"draft loss {f['draft_loss']:.3f} nats/token")
    print(f"greedy agreement {f['agree']:.3f}; mean expected acceptance sum_x min(p,q) at T=1: {f['accept']:.3f}")

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
    print(f"best constant K = {best[0]}: {base / best[1]:.2f}x over the target alone")


if __name__ == "__main__":
    main()
