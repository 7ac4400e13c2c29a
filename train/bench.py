"""Head costs: training throughput on cached features, and forward cost per decoding step.

    python -m train.bench --pair configs/pairs/pycode.yaml --labels data/pycode/t1

Prints labelled tokens/s of head training (cached features, batch 512), and the time of one
head forward at batch 1 as a share of one draft decoding step (goal: under 2%).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decode.pair import load_pair
from heads import AcceptanceHead, FeatureSpec, LinearVerifier
from train.data import flatten, resolve
from train.labels import weighted_bce
from train.paircheck import step_cost_ms


def median_ms(fn, warmup: int = 20, runs: int = 300) -> float:
    """Median ms of fn() over `runs` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="configs/pairs/pycode.yaml")
    ap.add_argument("--labels", default="data/pycode/t1")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from data_gen.store import load_features, load_split

    pair = load_pair(args.pair)
    x, cols = flatten(load_split(resolve(args.labels), "train"), load_features(resolve(args.labels), "train"),
                      FeatureSpec())
    prefix = pair.tokenizer("def main(argv=None):\n    parser = ", return_tensors="pt")["input_ids"]
    draft_ms = step_cost_ms(pair.draft, prefix, steps=60)
    print(f"{len(x)} cached training positions, hidden size {x.shape[1]}; draft step {draft_ms:.3f} ms")
    print("| head | train tokens/s (batch 512) | forward ms (batch 1) | share of a draft step |\n|---|---|---|---|")
    for name, head in (("AcceptanceHead depth 3", AcceptanceHead(x.shape[1], 3)),
                       ("AcceptanceHead depth 1", AcceptanceHead(x.shape[1], 1)),
                       ("LinearVerifier", LinearVerifier(x.shape[1]))):
        opt = torch.optim.Adam(head.parameters(), 1e-3)
        t0, seen = time.perf_counter(), 0
        for i in range(0, len(x) - 512, 512):
            loss = weighted_bce(head(x[i : i + 512]), cols["alpha"][i : i + 512], 1.0, 6.0)
            opt.zero_grad(), loss.backward(), opt.step()
            seen += 512
        train_tps = seen / (time.perf_counter() - t0)
        one = x[0]
        fast = head.eval().inference_fn()  # what decode runs (decode.policies.HeadPolicy)
        with torch.inference_mode():
            fwd = median_ms(lambda h=head, v=one: h.prob(v[None]))
        one_np = one.numpy()
        fast_ms = median_ms(lambda f=fast, v=one_np: f(v))
        print(f"| {name} | {train_tps:,.0f} | {fwd:.4f} | {100 * fwd / draft_ms:.2f}% |")
        print(f"| {name}, decode path (numpy, normalisation folded) | - | {fast_ms:.4f} | {100 * fast_ms / draft_ms:.2f}% "
              f"(goal <= 2%: {'met' if fast_ms / draft_ms <= 0.02 else 'NOT met'}) |")


if __name__ == "__main__":
    main()
