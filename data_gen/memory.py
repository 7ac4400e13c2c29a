"""Peak memory of labelling one batch at a real vocabulary size, with tiny random models.

    python -m data_gen.memory                      # V = 151,665 (Qwen2.5), batch 16, 96 new tokens
    python -m data_gen.memory --vocab 128256 --device cuda

Memory in labelling scales with the vocabulary, not the models: every (B, N, V) float32 tensor at
V = 151,665, B = 16, N = 96 is 0.93 GB. The models here are two layers of width 32, so what the command
prints is the labelling code's own footprint. On the CPU it is the growth of the process's peak resident
memory over one label_batch call (run in a fresh process: the peak is a high-water mark); on a GPU, torch's
peak allocation over the call.
"""

from __future__ import annotations

import argparse
import resource
import time
from types import SimpleNamespace

import torch


def tiny_pair(vocab: int, device: str):
    """A Pair of two random Qwen2-shaped models with `vocab` rows, sampling at T = 1 (no tokenizer needed)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from decode.pair import ModelSpec, Pair, PairConfig, Sampling

    models = []
    for layers, seed in ((1, 1), (2, 2)):
        torch.manual_seed(seed)
        cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=64, num_hidden_layers=layers, max_position_embeddings=512)
        models.append(Qwen2ForCausalLM(cfg).eval().requires_grad_(False).to(device))
    config = PairConfig("memory", ModelSpec("draft"), ModelSpec("target"), Sampling(1.0), max_context=512)
    # an object with the tokenizer's EOS is all labelling reads of a tokenizer
    return Pair(config, models[0], models[1], SimpleNamespace(eos_token_id=0), vocab)


def rss_mb() -> float:
    """Resident memory of this process now, in MB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m data_gen.memory", description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151_665)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    from data_gen.generate import Mixing, label_batch

    pair = tiny_pair(args.vocab, args.device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, args.vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.batch_size)]
    ids, kinds = [f"memory/{i}" for i in range(args.batch_size)], ["mixed"] * args.batch_size
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    before_rss, t0 = rss_mb(), time.perf_counter()
    records, _ = label_batch(pair, prompts, ids, kinds, Mixing(), 0, args.max_new_tokens)
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before_rss
    where = "GPU peak allocation" if cuda else "growth of peak resident memory"
    positions = sum(len(r["z"]) for r in records)
    print(f"labelling V = {args.vocab:,}, batch {args.batch_size}, {args.max_new_tokens} new tokens, "
          f"{args.prompt_tokens}-token prompts on {args.device}: {where} {peak:,.0f} MB over one batch "
          f"({positions} positions, {seconds:.1f} s; one (B, N, V) float32 tensor is "
          f"{args.batch_size * args.max_new_tokens * args.vocab * 4 / 2**20:,.0f} MB)")


if __name__ == "__main__":
    main()
