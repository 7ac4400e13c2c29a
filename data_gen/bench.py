"""Cost of labelling against the target's bare generation, and what batching buys.

    python -m data_gen.bench --pair configs/pairs/pycode.yaml --prompts 48 --batch-size 16 --repeats 3

Same prompts, same seeds, same responses for every stage. The three stages (bare generation at batch 1,
bare at batch B, labelling at batch B) run back to back on each chunk of B prompts, in an order rotated
per chunk and repeat, so drift of the machine falls on all of them alike. Ratios are paired per chunk
and repeat; each comes with the 95% bootstrap interval of its geometric mean (one run of each stage
moved the ratio by more than 10 points between sessions, so a single figure says little).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from tqdm import tqdm

from data_gen.generate import Mixing, Phases, RowNoise, label_batch, left_pad, prompt_generator, sample_responses
from data_gen.prompts import PromptSet
from decode.allocator import steady_heap
from decode.evaluation.intervals import bootstrap_ci
from decode.pair import load_pair


def interleaved(stages: list[Callable[[list], int]], chunks: list[list], repeats: int) -> tuple[np.ndarray, np.ndarray]:
    """Run every stage on every chunk, repeats times -> (C, R, S) seconds, (S,) tokens of one repeat.

    Stage order is rotated by (chunk + repeat), so no stage always runs first or after the same one.
    """
    S = len(stages)
    seconds, tokens = np.zeros((len(chunks), repeats, S)), np.zeros(S, dtype=np.int64)
    with tqdm(total=len(chunks) * repeats * S, desc="data_gen.bench", leave=False) as bar:
        for r in range(repeats):
            for c, chunk in enumerate(chunks):
                for k in range(S):
                    s = (k + c + r) % S
                    t0 = time.perf_counter()
                    n = stages[s](chunk)
                    seconds[c, r, s] = time.perf_counter() - t0
                    if r == 0:
                        tokens[s] += n
                    bar.update()
    return seconds, tokens


def paired_ratio(num: np.ndarray, den: np.ndarray) -> tuple[float, float, float]:
    """(C, R) seconds of two stages -> geometric mean of num/den and its 95% bootstrap interval (chunks, repeats)."""
    logs = np.log(num / den)
    lo, hi = bootstrap_ci(logs)
    return float(np.exp(logs.mean())), float(np.exp(lo)), float(np.exp(hi))


def verdict(lo: float, hi: float, goal: float, at_most: bool) -> str:
    """'met' / 'NOT met' when the whole interval is on one side of the goal, else 'not separated'."""
    good, bad = (hi <= goal, lo > goal) if at_most else (lo >= goal, hi < goal)
    return "met" if good else "NOT met" if bad else "not separated by the interval"


def main(argv: list[str] | None = None) -> None:
    steady_heap()  # as python -m data_gen labels (decode.allocator)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="configs/pairs/pycode.yaml")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = load_pair(args.pair)
    rows = PromptSet("pycode", "dev", limit=args.prompts, seed=0).load()
    budget = pair.config.max_context - args.max_new_tokens  # the labelling stage's truncation rule
    items = [(f"bench/{r['id']}", pair.encode(r["prompt"], budget)) for r in rows]
    B = args.batch_size

    def bare(chunk):
        ids, mask = left_pad([c[1] for c in chunk], pair.eos_ids[0])
        noise = RowNoise([prompt_generator(0, c[0]) for c in chunk], args.max_new_tokens, pair.vocab)
        return int(sample_responses(pair, ids, mask, noise, args.max_new_tokens).lengths.sum())

    phases = Phases()

    def label(chunk):
        recs, _ = label_batch(pair, [c[1] for c in chunk], [c[0] for c in chunk], ["mixed"] * len(chunk),
                              Mixing(), 0, args.max_new_tokens, phases)
        return sum(len(r["z"]) for r in recs)

    bare(items[:2])  # warm-up
    names = ["target generation only", "target generation only", "whole labelling stage"]
    stages = [lambda chunk: sum(bare([item]) for item in chunk), bare, label]
    chunks = [items[i : i + B] for i in range(0, len(items), B)]
    seconds, tokens = interleaved(stages, chunks, args.repeats)
    per_repeat = seconds.sum(0).mean(0)  # (S,) seconds of one pass over all prompts
    print(f"\n{len(items)} pycode dev prompts in {len(chunks)} chunks of {B}, up to {args.max_new_tokens} new tokens, "
          f"{args.repeats} interleaved repeats, {args.threads} threads; seconds are the mean of one repeat")
    print("| stage | batch | seconds | tokens | tokens/s |\n|---|---|---|---|---|")
    for name, batch, s, n in zip(names, [1, B, B], per_repeat, tokens):
        print(f"| {name} | {batch} | {s:.1f} | {n} | {n / s:.1f} |")
    lab, lab_lo, lab_hi = paired_ratio(seconds[..., 2], seconds[..., 1])
    bat, bat_lo, bat_hi = paired_ratio(seconds[..., 0], seconds[..., 1])
    print(f"\nlabelling takes {lab:.3f}x [{lab_lo:.3f}, {lab_hi:.3f}] the bare generation's time "
          f"(goal <= 1.25x: {verdict(lab_lo, lab_hi, 1.25, at_most=True)}); "
          f"batching gives {bat:.2f}x [{bat_lo:.2f}, {bat_hi:.2f}] over batch 1 "
          f"(goal >= 3x: {verdict(bat_lo, bat_hi, 3.0, at_most=False)})")
    total = seconds[..., 2].sum()
    print("where the labelling stage's time goes: " + ", ".join(
        f"{name} {100 * t / total:.1f}%" for name, t in phases.seconds.items()))


if __name__ == "__main__":
    main()
