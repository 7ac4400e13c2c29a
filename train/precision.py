"""Which precision serves each model of a pair fastest on this machine, measured: a forward by tokens fed after a
cache of `--prefix` tokens, in every dtype asked for.

    python -m train.precision --pair configs/pairs/smollm2.yaml
    python -m train.precision --pair configs/pairs/smollm2.yaml --dtypes float32 bfloat16 --tokens 1 4 16 64
    python -m train.precision --pair configs/pairs/smollm2.yaml --draft checkpoints/smollm2-draft-3l --dtypes bfloat16
    python -m train.precision --pair configs/pairs/smollm2.yaml --dtypes bfloat16 --head-tokens DRAFT/head-8192.json

CPUs differ: with AMX or AVX-512 bf16 a bfloat16 matmul is fast, elsewhere slow, so a pair's dtypes are chosen here
and not assumed. Prints a table (median ms of `--repeats` forwards by dtype and tokens), each model's fastest
dtype at one token (the step decoding repeats most), and the draft's one-token step over the target's, each in
that dtype: the figure that bounds what speculative decoding can gain.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from decode.cache.kv import crop_cache, forward, rollback_cache
from decode.pair import PairConfig, load_model


@torch.no_grad()
def forward_ms(model, prefix: int, tokens: list[int], repeats: int, seed: int = 0) -> dict[int, float]:
    """Median ms of a forward of n tokens after a `prefix`-token cache, for each n in tokens."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    cache = rollback_cache()
    forward(model, torch.randint(0, vocab, (1, prefix), generator=gen), cache, logits_to_keep=1)
    out = {}
    for n in tokens:
        forward(model, torch.randint(0, vocab, (1, n), generator=gen), cache)  # untimed: a new shape's first call
        crop_cache(cache, prefix)
        times = []
        for _ in range(repeats):
            x = torch.randint(0, vocab, (1, n), generator=gen)
            t0 = time.perf_counter()
            forward(model, x, cache)
            times.append(time.perf_counter() - t0)
            crop_cache(cache, prefix)
        out[n] = 1e3 * statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", required=True)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--prefix", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--draft", default=None,
                    help="another draft folder in the pair's place (its embeddings as the pair's draft's), e.g. one "
                         "being distilled")
    ap.add_argument("--head-tokens", default=None, metavar="FILE",
                    help="the draft's output layer cut to this file's tokens (decode.cut) in place of the pair's "
                         "head_tokens; '' for the full layer")
    args = ap.parse_args(argv)

    def fail(e: Exception):
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        raise SystemExit(2) from None

    try:
        cfg = PairConfig.from_yaml(args.pair)
        if args.draft:
            cfg = dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, path=args.draft))
            cfg.draft.resolved()  # a folder that is not a model says so here
        if args.head_tokens is not None:
            cfg = dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, head_tokens=args.head_tokens))
        bad = [d for d in args.dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]
        if bad:
            raise ValueError(f"--dtypes takes torch dtype names (float32, bfloat16, float16), got {bad}")
    except (ValueError, FileNotFoundError) as e:
        fail(e)
    tokens = sorted({1, *args.tokens})
    table: dict[tuple[str, str], dict[int, float]] = {}
    for dtype in args.dtypes:
        try:
            target = load_model(dataclasses.replace(cfg.target, dtype=dtype))
            draft = load_model(dataclasses.replace(cfg.draft, dtype=dtype), donor=target)
        except ValueError as e:  # a draft that does not fit its target, a bad head_tokens file
            fail(e)
        for role, model in (("draft", draft), ("target", target)):
            table[role, dtype] = forward_ms(model, args.prefix, tokens, args.repeats)
            print(f"{role} {dtype}: " + ", ".join(f"{n}: {ms:.1f}" for n, ms in table[role, dtype].items()) + " ms",
                  file=sys.stderr, flush=True)
        del draft, target
    print(f"\nms of one forward after a {args.prefix}-token cache, by tokens fed (median of {args.repeats}), "
          f"{torch.get_num_threads()} threads:\n")
    print("| model | dtype | " + " | ".join(map(str, tokens)) + " |")
    print("|---|---|" + "---|" * len(tokens))
    for (role, dtype), ms in table.items():
        print(f"| {role} | {dtype} | " + " | ".join(f"{ms[n]:.1f}" for n in tokens) + " |")
    best = {role: min(args.dtypes, key=lambda d: table[role, d][1]) for role in ("draft", "target")}
    step = {role: table[role, best[role]][1] for role in best}
    print(f"\nfastest at one token: draft {best['draft']} ({step['draft']:.1f} ms), target {best['target']} "
          f"({step['target']:.1f} ms); a draft step costs {step['draft'] / step['target']:.3f} of a target step")
    for n in tokens[1:]:
        print(f"  target {best['target']}: a verify of {n} tokens costs {table['target', best['target']][n] / step['target']:.2f}x one")
    own = (cfg.draft.dtype, cfg.target.dtype)
    if all((role, d) in table for role, d in zip(("draft", "target"), own)):
        d, t = table["draft", own[0]][1], table["target", own[1]]
        verifies = "; verifies of " + ", ".join(f"{n}: {t[n] / t[1]:.2f}x" for n in tokens[1:]) + " one"
        print(f"in the pair's own dtypes (draft {own[0]}, target {own[1]}): a draft step costs {d / t[1]:.3f} of a "
              f"target step" + (verifies if tokens[1:] else ""))


if __name__ == "__main__":
    main()
