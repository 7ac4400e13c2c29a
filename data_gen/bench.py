"""Cost of labelling against the target's bare generation, and what batching buys.

    python -m data_gen.bench --pair configs/pairs/pycode.yaml --prompts 32 --batch-size 16

Same prompts, same seeds, same responses for every row; prints one table.
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from data_gen.generate import Mixing, Phases, RowNoise, label_batch, left_pad, prompt_generator, sample_responses
from data_gen.prompts import PromptSet
from decode.pair import load_pair


def timed_batches(fn, items: list, batch: int) -> tuple[float, int]:
    """Seconds and tokens of fn over items in batches."""
    total, tokens = 0.0, 0
    for i in tqdm(range(0, len(items), batch), leave=False):
        t0 = time.perf_counter()
        tokens += fn(items[i : i + batch])
        total += time.perf_counter() - t0
    return total, tokens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="configs/pairs/pycode.yaml")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = load_pair(args.pair)
    rows = PromptSet("pycode", "dev", limit=args.prompts, seed=0).load()
    budget = pair.config.max_context - args.max_new_tokens  # the labelling stage's truncation rule
    items = [(f"bench/{r['id']}", pair.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"][-budget:])
             for r in rows]

    def generate_only(chunk):
        ids, mask = left_pad([c[1] for c in chunk], pair.tokenizer.eos_token_id)
        noise = RowNoise.response_only([prompt_generator(0, c[0]) for c in chunk], args.max_new_tokens, pair.vocab)
        return int(sample_responses(pair, ids, mask, noise, args.max_new_tokens).lengths.sum())

    phases = Phases()

    def label(chunk):
        recs, _ = label_batch(pair, [c[1] for c in chunk], [c[0] for c in chunk], ["mixed"] * len(chunk),
                              Mixing(), 0, args.max_new_tokens, phases)
        return sum(len(r["z"]) for r in recs)

    generate_only(items[:2])  # warm-up
    g1_s, g1_n = timed_batches(generate_only, items, 1)
    gb_s, gb_n = timed_batches(generate_only, items, args.batch_size)
    lb_s, lb_n = timed_batches(label, items, args.batch_size)
    print(f"\n{len(items)} pycode dev prompts, up to {args.max_new_tokens} new tokens, {args.threads} threads")
    print("| stage | batch | seconds | tokens | tokens/s |\n|---|---|---|---|---|")
    print(f"| target generation only | 1 | {g1_s:.1f} | {g1_n} | {g1_n / g1_s:.1f} |")
    print(f"| target generation only | {args.batch_size} | {gb_s:.1f} | {gb_n} | {gb_n / gb_s:.1f} |")
    print(f"| whole labelling stage | {args.batch_size} | {lb_s:.1f} | {lb_n} | {lb_n / lb_s:.1f} |")
    print(f"\nlabelling adds {100 * (lb_s / gb_s - 1):.1f}% to the bare generation (goal <= 25%); "
          f"batching gives {(gb_n / gb_s) / (g1_n / g1_s):.2f}x over batch 1 (goal >= 3x)")
    print("where the labelling stage's time goes: " + ", ".join(
        f"{name} {100 * t / lb_s:.1f}%" for name, t in phases.seconds.items()))


if __name__ == "__main__":
    main()
