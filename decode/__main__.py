"""Generate with a drafting policy and a verification rule, or benchmark every method.

    python -m decode generate --pair configs/pairs/pycode.yaml --head checkpoints/specdecpp --prompt "def add(a, b):"
    python -m decode generate --policy FixedK --policy.k 4 --rule FSD --rule.threshold 0.2 --prompt "import os"
    python -m decode bench --config configs/bench/pycode.yaml
    python -m decode compare docs/bench/bench.csv runs/bench2/bench.csv
    python -m decode batch-bench --config configs/bench/batch.yaml

Policies (decode.policies) and rules (decode.rules.chain) are chosen by class name or class_path,
with their typed init arguments; `--head DIR` alone means SpecDec++ stopping with that head.
Every command first fixes glibc's malloc thresholds (decode.allocator; SPECHEADS_MALLOC=default keeps them).
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from decode.allocator import steady_heap  # noqa: E402
from decode.policies import FixedK, HeadPolicy, Policy, SpecDecPP  # noqa: E402
from decode.rules.chain import Rule, SpeculativeSampling  # noqa: E402


class BadOption(ValueError):
    """A command-line number outside its range."""


def check_range(name: str, value: float, low: float | None = None, high: float | None = None,
                low_open: bool = False) -> None:
    """Raise BadOption naming the option when value is outside [low, high] ((low, high] if low_open) or not finite."""
    if not math.isfinite(value):
        raise BadOption(f"--{name} must be a finite number, got {value:g}")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        lo = "" if low is None else ("> " if low_open else ">= ") + f"{low:g}"
        hi = "" if high is None else f"<= {high:g}"
        raise BadOption(f"--{name} must be {' and '.join(x for x in (lo, hi) if x)}, got {value:g}")


class TextStream:
    """on_tokens callback that writes each round's new text, decoding only the current line.

    Decoding everything shown so far on every round costs O(n^2) over a generation, inside the timed
    wall; text is cut at a newline, where byte-level tokens split cleanly.
    """

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out = tokenizer, out
        self.line: list[int] = []  # tokens since the last newline
        self.written = 0  # characters of the line's text already written

    def __call__(self, new: list[int]) -> None:
        self.line.extend(new)
        text = self.tokenizer.decode(self.line)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for its last byte
            return
        self.out.write(text[self.written:])
        self.out.flush()
        self.line, self.written = ([], 0) if text.endswith("\n") else (self.line, len(text))

    def close(self) -> None:
        """Write what a split character held back at the end of the generation."""
        self.out.write(self.tokenizer.decode(self.line)[self.written:])
        self.line, self.written = [], 0


@dataclass
class Generate:
    """Stream the continuation of `prompt`, then print the round metrics.

    Args:
        prompt: text to continue.
        pair: pair YAML.
        head: an exported acceptance head: SpecDec++ stopping at h = 0.7 unless --policy is given.
        policy: drafting policy (default FixedK(4), or SpecDecPP when --head is given).
        rule: verification rule (default SpeculativeSampling, lossless).
        max_new_tokens: at most this many new tokens.
        temperature: override the pair's sampling temperature (0 = greedy).
        top_p: override the pair's top-p (nucleus) mass, in (0, 1].
        seed: seed of every random draw.
        threads: torch CPU threads.
        allow_sampling_mismatch: use a head trained under another sampling setting (warns).
        profile: also print where the time went (forwards, head, sampling, rule, bookkeeping).
    """

    prompt: str
    pair: str = "configs/pairs/pycode.yaml"
    head: str | None = None
    policy: Policy | None = None
    rule: Rule | None = None
    max_new_tokens: int = 64
    temperature: float | None = None
    top_p: float | None = None
    seed: int = 0
    threads: int = 2
    allow_sampling_mismatch: bool = False
    profile: bool = False

    def __post_init__(self):
        check_range("max_new_tokens", self.max_new_tokens, low=1)
        check_range("threads", self.threads, low=1)
        if self.temperature is not None:
            check_range("temperature", self.temperature, low=0.0)
        if self.top_p is not None:
            check_range("top_p", self.top_p, low=0.0, high=1.0, low_open=True)


def generate(args: Generate) -> None:
    """Decode args.prompt with its policy and rule, streaming the text, then print the round metrics."""
    import torch

    from decode.engine import SpeculativeDecoder
    from decode.pair import load_pair

    torch.set_num_threads(args.threads)
    p = load_pair(args.pair)
    overrides = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p)) if v is not None}
    p = p.with_sampling(**overrides) if overrides else p
    policy = args.policy or (SpecDecPP(args.head, h=0.7) if args.head else FixedK(4))
    if args.allow_sampling_mismatch and isinstance(policy, HeadPolicy):
        policy.allow_sampling_mismatch = True
    dec = SpeculativeDecoder(p, policy, args.rule or SpeculativeSampling(), seed=args.seed)
    ids = p.encode(args.prompt)
    sys.stdout.write(args.prompt)
    stream = TextStream(p.tokenizer, sys.stdout)
    out = dec.generate(ids, args.max_new_tokens, on_tokens=stream)
    stream.close()
    s = out.stats.summary()
    print(f"\n\n[{type(policy).__name__} + {type(dec.rule).__name__}] {s['new_tokens']} tokens, "
          f"{s['tokens_per_s']:.1f} tok/s, target calls {s['target_calls']}, draft calls {s['draft_calls']}, "
          f"discard rate {s['discard_rate']:.3f}, verification rate {s['verification_rate']:.3f}, "
          f"mean accepted {s['mean_accepted']:.2f}; time draft {s['t_draft_s']:.3f}s target "
          f"{s['t_target_s']:.3f}s head {s['t_head_s']:.3f}s")
    if args.profile:
        print(f"profile: {out.stats.profile()}")


def bench(argv: list[str]) -> None:
    """Run every method of a bench config on its prompt sets; print and save the table and plots."""
    import argparse

    from decode.evaluation.bench import BadBenchConfig, run

    ap = argparse.ArgumentParser(prog="python -m decode bench")
    ap.add_argument("--config", default="configs/bench/pycode.yaml", help="bench YAML")
    ap.add_argument("--quick", type=lambda v: v.lower() in ("1", "true", "yes"), default=False,
                    help="a few prompts and methods (minutes)")
    ap.add_argument("--readme", type=lambda v: v.lower() in ("1", "true", "yes"), default=False,
                    help="also rewrite README.md's generated results block")
    ap.add_argument("--repeats", type=int, default=None, help="runs of every method per prompt (default: the YAML's)")
    ap.add_argument("--output", default=None, help="output folder (default: the YAML's); a new one runs afresh")
    ap.add_argument("--prompt_sets", nargs="+", default=None, metavar="NAME",
                    help="run only these of the YAML's prompt sets (default: all)")
    ap.add_argument("--settings", nargs="+", default=None, metavar="NAME",
                    help="run only the sections of these sampling settings, e.g. greedy t0.7-p0.95 (default: all)")
    args = ap.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    try:
        run(args.config, quick=args.quick, readme=args.readme, repeats=args.repeats, output=args.output,
            prompt_sets=args.prompt_sets, settings=args.settings)
    except BadBenchConfig as e:
        ap.error(str(e))


def main() -> None:
    steady_heap()  # every command decodes: freed tensor memory serves the next forward (decode.allocator)
    # bench takes its own --config (the bench YAML), which jsonargparse would read as its own option.
    if len(sys.argv) > 1 and sys.argv[1] == "bench":
        return bench(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        from decode.evaluation.compare import main as compare

        return compare(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "replay":
        from decode.evaluation.tuning import main as replay

        return replay(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "batch-bench":
        from decode.evaluation.batch import main as batch_bench

        return batch_bench(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "batch-costs":
        from decode.costs.batch import main as batch_costs

        return batch_costs(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "summary":
        from decode.evaluation.summary import main as summary

        return summary(sys.argv[2:])
    if len(sys.argv) < 2 or sys.argv[1] != "generate":
        sys.exit("usage: python -m decode {generate,bench,batch-bench,batch-costs,compare,replay,summary} ...  (see python -m decode generate --help)")
    from jsonargparse import CLI, ArgumentError

    try:
        generate(CLI(Generate, args=sys.argv[2:], as_positional=False, exit_on_error=False))
    except ArgumentError as e:  # jsonargparse tried each type of a Union: keep the reason that is ours
        sys.exit(fail(one_line(str(e))))
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback, exit 2 as argparse does
        sys.exit(fail(one_line(str(e))))


def one_line(message: str) -> str:
    """The informative line of a jsonargparse error (the first '- reason' not about NoneType)."""
    reasons = [ln.strip()[2:] for ln in message.splitlines() if ln.strip().startswith("- ") and "NoneType" not in ln]
    if not reasons:
        return " ".join(ln.strip() for ln in message.splitlines())
    key = re.search(r'Parser key "([^"]+)"', message)
    given = re.search(r"Given value: (.*)", message)
    got = f", got {given[1].strip()}" if given and reasons[0].startswith("Expected") else ""  # a plain value's type
    return (f"--{key[1]}: " if key else "") + reasons[0] + got


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    main()
