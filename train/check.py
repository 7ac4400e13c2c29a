"""Check a draft/target pair end to end on this machine, and print what passed.

    python -m train.check --pair configs/pairs/pycode.yaml
    python -m train.check --pair configs/pairs/qwen2.5-0.5b-7b-instruct.yaml --prompts 16 --max_new_tokens 32

Loads the pair (on the GPU when there is one), labels a few prompts with data_gen, trains a SpecDec++ head
for one epoch and exports it, decodes greedily with fixed-K speculative decoding and with the head (each
must equal the target alone token for token), and runs the Hugging Face assistant with the head. A step
that fails is reported with its reason and the steps after it that need it are skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["def mean(xs):\n    \"\"\"The arithmetic mean of xs.\"\"\"\n", "Write a haiku about the sea.",
         "class Stack:\n    def push(self, x):\n", "Explain what a hash map is in two sentences.",
         "import json\n\ndef load(path):\n", "List three prime numbers and say why they are prime.",
         "for i in range(10):\n", "What is speculative decoding?"]


def prompts_file(folder: Path, n: int) -> Path:
    """n prompts (the built-in texts, cycled) as a JSON-lines prompt set."""
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": TEXTS[i % len(TEXTS)] * (1 + i // len(TEXTS))}) + "\n"
                            for i in range(n)))
    return path


def label(pair_yaml: Path, folder: Path, n: int, max_new: int, accelerator: str) -> Path:
    """Greedy labels of n prompts (half train, half dev) -> the data_gen config that names them."""
    from data_gen.__main__ import run

    path = prompts_file(folder, n)
    sets = [{"name": "jsonl", "path": str(path), "split": s, "skip": k, "limit": n // 2}
            for s, k in (("train", 0), ("dev", n // 2))]
    cfg = folder / "data_gen.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"pair": str(pair_yaml), "output": str(folder / "labels"), "batch_size": 4,
                                            "max_new_tokens": max_new, "prompts": sets},
                                   "settings": [{"temperature": 0.0}], "trainer": {"accelerator": accelerator}}))
    run(["--config", str(cfg)])
    return cfg


def train_head(gen_cfg: Path, folder: Path, accelerator: str, position: str = "prev") -> str:
    """One epoch of the SpecDec++ recipe on those labels -> the exported head's folder."""
    from train.cli import cli
    from train.sweep import config_with, set_export_name

    def edit(cfg):
        cfg["data"] |= {"labels": str(folder / "labels"), "build_config": str(gen_cfg), "batch_size": 64,
                        "train_split": "jsonl_train", "val_split": "jsonl_dev", "features": {"position": position},
                        "sampling": {"temperature": 0.0}}
        cfg["trainer"] |= {"logger": False, "default_root_dir": str(folder), "accelerator": accelerator}
        set_export_name(cfg, "head")
        for cb in cfg["trainer"]["callbacks"]:
            if cb["class_path"].endswith("ExportHead"):
                cb["init_args"]["directory"] = str(folder)

    cli(["fit", "--config", str(config_with(ROOT / "heads" / "specdecpp.yaml", edit)), "--trainer.max_epochs", "1"])
    # exported as head-<setting> where the setting is not the pair's own
    return str(next(p.parent for p in sorted(folder.glob("head*/config.json"))))


def decode_checks(pair, head: str, max_new: int) -> list[tuple[str, bool, str]]:
    """Greedy SD with fixed K, with the head, and the HF assistant with the head, each against the target alone."""
    from decode.engine import Autoregressive, SpeculativeDecoder
    from decode.hf import hf_generate
    from decode.policies import FixedK, SpecDecPP
    from decode.rules.chain import SpeculativeSampling

    greedy, ids = pair.with_sampling(temperature=0.0), pair.encode(TEXTS[0])
    want = Autoregressive(greedy).generate(ids, max_new)
    out = []
    for name, policy in (("decode: fixed K = 4", FixedK(4)), ("decode: SpecDec++ head", SpecDecPP(head, h=0.5))):
        got = SpeculativeDecoder(greedy, policy, SpeculativeSampling()).generate(ids, max_new)
        speed = f"{got.stats.summary()['tokens_per_s']:.1f} tok/s vs target alone {want.stats.summary()['tokens_per_s']:.1f}"
        out.append((name, *same_greedy(greedy, ids, got.tokens, want.tokens, speed)))
    hf, _ = hf_generate(greedy, ids, max_new, {"head": head, "h": 0.5}, seed=0)
    out.append(("HF assistant with the head", *same_greedy(greedy, ids, hf, want.tokens)))
    return out


def same_greedy(pair, ids: list[int], got: list[int], want: list[int], speed: str = "") -> tuple[bool, str]:
    """Does a speculative greedy text equal the target alone's? Exactly; or, for a target in lower precision than
    float32, up to a first difference where the target's top two logits after the common text are a near-tie (its
    multi-token verify and its one-token step round differently there, as the test suite tolerates)."""
    if got == want:
        return True, "equals the target's greedy text" + (f"; {speed}" if speed else "")
    at = first_diff(got, want)
    with torch.no_grad():
        x = torch.tensor([ids + want[:at]], device=pair.input_device("target"))
        top = pair.target(x).logits[0, -1].float().topk(2).values
    margin = float(top[0] - top[1])
    # two steps of the target's precision at its top logit's size: a verify of k tokens and a step of one round apart
    ulp = torch.finfo(pair.target.dtype).eps * 2.0 ** math.floor(math.log2(max(abs(float(top[0])), 1e-6)))
    if pair.target.dtype != torch.float32 and margin <= 2 * ulp:
        return True, (f"equals the target's greedy text up to token {at}, where its top two logits are {margin:.3f} "
                      f"apart ({str(pair.target.dtype).removeprefix('torch.')} near-tie)" + (f"; {speed}" if speed else ""))
    return False, f"differs at token {at} (the target's top two logits {margin:.3f} apart there)"


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check(pair_yaml: str, n: int = 8, max_new: int = 24, folder: Path | None = None) -> list[tuple[str, bool, str]]:
    """Run every step; -> (step, passed, detail) rows. A failed step skips the steps that need it."""
    from decode.pair import load_pair

    folder = Path(folder or tempfile.mkdtemp(prefix="specheads-check-"))
    folder.mkdir(parents=True, exist_ok=True)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    rows, state = [], {}
    steps = [("load the pair", lambda: load_step(pair_yaml, state, load_pair)),
             ("label prompts (data_gen)", lambda: state.update(gen=label(Path(pair_yaml).resolve(), folder, n, max_new,
                                                                          accelerator)) or f"{n} prompts"),
             ("train and export a head", lambda: state.update(head=train_head(state["gen"], folder, accelerator))
              or json.dumps(json.loads((Path(state["head"]) / "config.json").read_text())["metrics"])[:120])]
    for name, fn in steps:
        t0 = time.perf_counter()
        try:
            detail = fn()
            rows.append((name, True, f"{detail} ({time.perf_counter() - t0:.1f} s)"))
        except Exception as e:  # reported as a failed step; the traceback's last line says where
            rows.append((name, False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                         f"[{traceback.extract_tb(e.__traceback__)[-1].filename}]"))
            return rows
    try:
        rows += decode_checks(state["pair"], state["head"], max_new)
    except Exception as e:
        rows.append(("decode", False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    return rows


def load_step(pair_yaml: str, state: dict, load_pair) -> str:
    pair = state["pair"] = load_pair(pair_yaml)
    ids = pair.encode(TEXTS[1])
    return (f"{pair.config.name} on {pair.device}, {pair.draft.dtype} / {pair.target.dtype}, V = {pair.vocab}, "
            f"EOS ids {list(pair.eos_ids)}, prompt starts {pair.tokenizer.decode(ids[:6])!r}")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m train.check", description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="configs/pairs/pycode.yaml", help="pair YAML")
    ap.add_argument("--prompts", type=int, default=8, help="prompts to label (half train, half dev)")
    ap.add_argument("--max_new_tokens", type=int, default=24)
    ap.add_argument("--output", default=None, help="working folder (default: a new temporary one)")
    args = ap.parse_args()
    if args.prompts < 2:
        ap.error(f"--prompts must be >= 2 (one train and one dev prompt), got {args.prompts}")
    rows = check(args.pair, args.prompts, args.max_new_tokens, args.output)
    print("\n| step | result | detail |\n|---|---|---|")
    for name, ok, detail in rows:
        print(f"| {name} | {'PASS' if ok else 'FAIL'} | {detail} |")
    passed = sum(ok for _, ok, _ in rows)
    print(f"\n{passed} of {len(rows)} steps passed")
    raise SystemExit(0 if passed == len(rows) == 6 else 1)


if __name__ == "__main__":
    main()
