"""python -m decode.evaluation.neighbours --pair configs/pairs/pycode.yaml --rows 32 --seeds 4 --new 32

How often a sampled row decodes other tokens in a batch than alone: each seed decodes `--rows` pycode dev prompts in
one batch (row i seeded seed + i) and then each row alone on its own seed, with FixedK(--k) and speculative
sampling at the pair's temperature, and counts the rows whose tokens differ. A row's law never depends on its
neighbours; its exact tokens can, where a batched matmul's rounding moves a uniform across a token boundary
(docs/batch.md, "Rows never leak into each other").
"""

from __future__ import annotations

import argparse

import torch

from data_gen.prompts import PromptSet
from decode.batch import BatchDecoder
from decode.pair import load_pair
from decode.policies import FixedK
from decode.rules import SpeculativeSampling


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    ap.add_argument("--pair", default="configs/pairs/pycode.yaml")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = load_pair(args.pair)
    prompts = [pair.encode(r["prompt"], 200) for r in PromptSet("pycode", "dev", limit=args.rows, seed=0).load()]
    differ = total = 0
    for seed in range(args.seeds):
        batch = BatchDecoder(pair, FixedK(args.k), SpeculativeSampling(), seed=seed).generate(prompts, args.new)
        for i, p in enumerate(prompts):
            alone = BatchDecoder(pair, FixedK(args.k), SpeculativeSampling(), seed=seed + i).generate([p], args.new)[0]
            differ, total = differ + (alone.tokens != batch[i].tokens), total + 1
        print(f"seed {seed}: {differ} of {total} rows differ so far", flush=True)
    print(f"rows whose tokens differ alone and in a batch of {len(prompts)} ({pair.config.sampling.name}, "
          f"FixedK({args.k}), {args.new} new tokens): {differ} of {total}")


if __name__ == "__main__":
    main()
