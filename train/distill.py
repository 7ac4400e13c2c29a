"""Distil a draft for a target that has none, from the target's own answers. Resumes wherever it stopped.

    nohup python -m train.distill --config configs/distill/smollm2.yaml > distill.log 2>&1 &   # starts or resumes
    python -m train.distill --config configs/distill/smollm2.yaml --cycles 2                   # a short run
    python -m train.distill --config configs/distill/smollm2.yaml --plot                       # the learning curve
    python -m train.distill --config configs/distill/smollm2.yaml --measure                    # held out vs trained on
    python -m train.distill --config configs/distill/smollm2.yaml --head-tokens 16384          # a cut output layer

Each cycle the target answers a chunk of the recipe's instructions (batched generate(), at the sampling settings
the heads will serve, cycled), the answers join the store, and the draft trains on the new chunk and a replay of
older ones by forward KL against the target's distribution at every answer position (the teacher's logits are
recomputed, which costs less than storing them). The draft starts from some of the target's layers with its final
norm, and shares its embeddings and tied output layer, frozen: only the layers and the norm are trained, saved and
committed (decode.pair.ModelSpec, embeddings "target"). Every `eval_every` cycles the draft is measured on held-out
answers to the dev instructions (greedy, generated once): top-1 agreement with the target's greedy token and mean
alpha at T = 1 (sum over the vocabulary of min(p, q)), logged against the tokens seen in curve.jsonl and drawn in
curve.png. State (the draft, the optimiser, the cycle, the store) is saved after every cycle, each file written
aside and renamed into place, so a killed run resumes from its last cycle; without the state (a fresh clone), it
resumes from the exported draft and its committed answers with a fresh optimiser. The export holds no tokenizer: a
draft sharing the target's embeddings reads the target's.

A recipe's `grow` starts a new draft from a smaller exported one (its layers first, the further ones adding nothing
until trained), or continues one as large in a folder of its own (a candidate trained apart from the draft a pair's
heads were trained for), and `answers` names another run's folder whose stored answers this run shares and adds to
(configs/distill/smollm2-3l.yaml and smollm2-candidate.yaml do both). Two runs sharing a store take turns: each
rewrites the whole file.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import random
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path

import torch

from decode.cut import cut_head, rank_tokens
from decode.evaluation.report import write_atomic
from decode.pair import ROOT, ModelSpec, eos_ids, load_model, read_yaml
from decode.prompting import encode
from train.draft import Store, answer, export, grow, kl_step, make_draft, measure, teacher_pair, trained_state


@dataclass
class Recipe:
    """A distillation recipe (configs/distill/*.yaml). target: the teacher (decode.pair.ModelSpec fields); layers:
    the target's layers the draft starts from; out: where the draft is exported (and its answers kept)."""

    target: dict
    out: str
    layers: list[int] = field(default_factory=lambda: [0, 1])
    grow: str = ""  # an exported draft a new one starts from (its layers first, the further ones adding nothing yet)
    answers: str = ""  # the folder whose stored answers the run reads and adds to (default: out); a target's drafts share them
    prompts: str = "instruct"  # a data_gen.prompts set; its train split is answered, its dev split measured
    also: list[str] = field(default_factory=list)  # further sets whose train splits are answered (never measured)
    settings: list[dict] = field(default_factory=lambda: [{"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.95},
                                                          {"temperature": 1.0}])
    answers_per_cycle: int = 32
    max_new_tokens: int = 128
    max_prompt_tokens: int = 256
    dev_prompts: int = 48
    batch: int = 8
    steps_per_cycle: int = 8
    replay: float = 0.5  # share of a cycle's sequences drawn from earlier cycles' answers
    lr: float = 1e-3
    warmup: int = 20  # steps of linear warm-up whenever the optimiser starts fresh (a new draft, or from an export)
    decay_steps: int = 0  # cosine decay of lr to a tenth by this step (counted over the whole run); 0: flat
    rows: int = 32  # instructions the target answers in one batch (a GPU takes hundreds)
    device: str = "auto"  # "auto": cuda when a GPU is present, else cpu; or "cpu", "cuda", "cuda:1"
    eval_every: int = 5
    seed: int = 0
    threads: int = 0  # 0: torch's default

    def __post_init__(self):
        """Each field of the type and range it takes, or a one-line ValueError naming it. YAML reads 1e-3 (no dot)
        as a string: a number written so is taken as the number."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("float", "int") and isinstance(v, str):
                try:
                    setattr(self, f.name, v := float(v) if f.type == "float" else int(v))
                except ValueError:
                    raise ValueError(f"recipe field {f.name} takes a number, got {v!r}") from None
            if f.type in ("float", "int") and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"recipe field {f.name} takes a number, got {v!r}")
        for f in fields(self):
            least = 1 if f.name not in ("warmup", "seed", "threads", "decay_steps") else 0
            if f.type == "int" and (not isinstance(getattr(self, f.name), int) or getattr(self, f.name) < least):
                raise ValueError(f"recipe field {f.name} takes a whole number >= {least}, got {getattr(self, f.name)!r}")
        if not isinstance(self.out, str) or not self.out:
            raise ValueError(f"recipe field out is the folder the draft is exported to, got {self.out!r}")
        if not 0 <= self.replay <= 1 or not 0 < self.lr < float("inf"):
            raise ValueError(f"recipe fields: replay takes a share in [0, 1] and lr a finite rate > 0; got replay "
                             f"{self.replay}, lr {self.lr}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"recipe field device takes auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not isinstance(self.layers, list) or not self.layers or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layers):
            raise ValueError(f"recipe field layers lists the target's layers the draft starts from (e.g. [0, 1]), "
                             f"got {self.layers!r}")
        from data_gen.prompts import NAMES

        if not isinstance(self.also, list) or not all(isinstance(x, str) and x for x in self.also):
            raise ValueError(f"recipe field also lists prompt sets whose train splits the target answers too (e.g. "
                             f"[instruct-packages]), got {self.also!r}")
        usable = [n for n in NAMES if n != "jsonl"]  # a jsonl set needs a path a recipe cannot give
        for name in [self.prompts, *self.also]:  # before the target loads, not after
            if name not in usable:
                raise ValueError(f"recipe fields prompts and also name prompt sets ({', '.join(usable)}), got {name!r}")
        for name in ("grow", "answers"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"recipe field {name} takes a folder path (or nothing), got {getattr(self, name)!r}")
        if self.answers and (ROOT / self.answers).exists() and not (ROOT / self.answers).is_dir():
            raise ValueError(f"recipe field answers names {self.answers}, a file: it takes the folder whose "
                             f"answers-*.jsonl.gz the run shares")
        if not isinstance(self.target, dict):
            raise ValueError(f"recipe field target is a model spec (path, dtype), e.g. {{path: model.gguf, dtype: "
                             f"bfloat16}}, got {self.target!r}")
        try:
            ModelSpec(**self.target)
        except TypeError as e:
            raise ValueError(f"recipe field target: {e} (it takes path, dtype, device_map, revision)") from None
        if not isinstance(self.settings, list) or not self.settings:
            raise ValueError(f"recipe field settings lists sampling settings, e.g. [{{temperature: 0.0}}], got "
                             f"{self.settings!r}")
        for one in self.settings:
            try:
                setting_name(one)
            except (TypeError, ValueError) as e:
                raise ValueError(f"recipe field settings: {one!r} is not a sampling setting (temperature, top_k, "
                                 f"top_p): {' '.join(str(e).split())}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> Recipe:
        path = Path(path) if Path(path).exists() else ROOT / path
        if not path.exists():
            raise FileNotFoundError(f"distillation recipe {path} not found; the shipped ones are in configs/distill/")
        raw = read_yaml(path)
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown recipe keys {sorted(unknown)}; see configs/distill/smollm2.yaml")
        try:
            return cls(**raw)
        except TypeError as e:
            raise ValueError(f"{path}: malformed recipe ({e}); see configs/distill/smollm2.yaml") from e


def lr_at(step: int, recipe: Recipe, fresh_at: int = 0) -> float:
    """The learning rate at a step: a linear warm-up over recipe.warmup steps from `fresh_at`, the step the optimiser
    started fresh at (none at 0), times a cosine decay to a tenth by recipe.decay_steps (flat at 0)."""
    warm = min(1.0, (step - fresh_at + 1) / max(1, recipe.warmup))
    if not recipe.decay_steps:
        return recipe.lr * warm
    done = min(1.0, step / recipe.decay_steps)
    return recipe.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))


def device_of(recipe: Recipe) -> torch.device:
    """The recipe's device; "auto" is cuda when a GPU is present."""
    if recipe.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if recipe.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"recipe field device is {recipe.device} but torch sees no GPU here: set device: auto or cpu")
    return torch.device(recipe.device)


def log(msg: str) -> None:
    print(f"[distill {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Run:
    """One recipe's run: the loaded target, the draft, the optimiser and the stores, resumed from what is saved."""

    def __init__(self, recipe: Recipe):
        from transformers import AutoTokenizer

        from data_gen.prompts import PromptSet

        self.recipe, self.out = recipe, ROOT / recipe.out
        self.state_dir = self.out / ".state"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        spec = ModelSpec(**recipe.target)
        self.device = device_of(recipe)
        log(f"loading the target {spec.path} ({spec.dtype}, on {self.device})")
        self.target = load_model(spec, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(spec.resolved())
        self.vocab = len(self.tokenizer)
        self.pair = teacher_pair(self.target, self.tokenizer, spec, recipe.max_prompt_tokens + recipe.max_new_tokens)
        self.draft = make_draft(self.target, recipe.layers)
        self.opt = torch.optim.AdamW([p for n, p in self.draft.named_parameters() if n in self.draft.draft_weights],
                                     lr=recipe.lr, weight_decay=0.0)
        self.cycle, self.step, self.tokens, self.curve, self.fresh_at = 0, 0, 0, [], 0
        # a run begun anew takes a name of its own: a store can hold answers an earlier run in the same folder
        # stored under the same cycle numbers, and this run must not take them for its killed cycles' ones
        self.run = datetime.now().isoformat(timespec="microseconds")
        self._resume()
        kept = ROOT / (recipe.answers or recipe.out)
        # what the store's rows name the run that answered them by (runs begun before runs had names: the folder)
        self.me = str(Path(recipe.out)) + (f"@{self.run}" if self.run else "")
        kept.mkdir(parents=True, exist_ok=True)
        self.answers = Store(kept / "answers-train.jsonl.gz")
        for i, x in enumerate(self.answers.rows):  # rows stored before they carried their cycle: answers_per_cycle each
            x.setdefault("cycle", i // recipe.answers_per_cycle)
            x.setdefault("by", str(Path(recipe.answers or recipe.out)))  # ... or the run that owns the store
            x.setdefault("n", x["cycle"])  # ... or the number of their chunk
        self.dev = Store(kept / "answers-dev.jsonl.gz")
        # the recipe's own dev instructions, each answered once, whichever run sharing the store answered it: the
        # learning curve stays on one set
        wanted = [(r["id"], r["prompt"]) for r in PromptSet(recipe.prompts, "dev").load()][: recipe.dev_prompts]
        missing = [w for w in wanted if w[0] not in {x["id"] for x in self.dev.rows}]
        if missing:
            log(f"the target answers {len(missing)} dev instructions (greedy), once, for the learning curve")
            rows = []
            for i in range(0, len(missing), recipe.rows):
                rows += self.answered(missing[i: i + recipe.rows], {"temperature": 0.0}, recipe.seed)
            self.dev.add(rows)
        first = {}
        for x in self.dev.rows:
            first.setdefault(x["id"], x)
        self.held_out = [first[k] for k, _ in wanted]

    @functools.cached_property
    def train_prompts(self) -> list[tuple[str, str]]:
        """(id, text) of every train instruction, shuffled by the seed; read at the first cycle (parsing the package
        sets takes most of a minute, which --measure need not wait for)."""
        from data_gen.prompts import PromptSet

        r = self.recipe
        texts = {x["prompt"]: x["id"] for name in reversed([r.prompts, *dict.fromkeys(r.also)])
                 for x in PromptSet(name, "train").load()}  # a prompt two sets hold: once, under the first set's id
        got = [(k, text) for text, k in texts.items()]
        log(f"{len(got):,} train instructions ({', '.join([r.prompts, *r.also])})")
        random.Random(r.seed).shuffle(got)
        return got

    def answered(self, chunk: list[tuple[str, str]], setting: dict, seed: int) -> list[dict]:
        """(id, text) instructions -> stored rows of the target's answers, prompts in the chat template."""
        ids = [encode(self.tokenizer, text, True, self.recipe.max_prompt_tokens) for _, text in chunk]
        got = answer(self.pair, ids, setting, self.recipe.max_new_tokens, seed)
        return [{"id": k, "setting": setting_name(setting), "prompt": p, "answer": a}
                for (k, _), p, a in zip(chunk, ids, got)]

    def _resume(self) -> None:
        """From the saved state; else from the exported draft (a fresh clone: fresh optimiser); else from scratch."""
        from safetensors.torch import load_file

        state, exported = self.state_dir / "state.pt", self.out / "model.safetensors"
        if state.exists():
            got = torch.load(state, weights_only=False, map_location=self.device)
            self.draft.load_state_dict(got["draft"], strict=False)
            self.opt.load_state_dict(got["opt"])
            self.cycle, self.step, self.tokens, self.curve = got["cycle"], got["step"], got["tokens"], got["curve"]
            self.fresh_at, self.run = got.get("fresh_at", 0), got.get("run", "")
            log(f"resumed from {state}: cycle {self.cycle}, {self.tokens:,} tokens seen")
        # (a run killed between the two files of its first export has no training.json: it starts again)
        elif exported.exists() and (self.out / "training.json").exists():
            self.draft.load_state_dict({k: v.float() for k, v in load_file(exported).items()}, strict=False)
            info = json.loads((self.out / "training.json").read_text())
            self.cycle, self.step, self.tokens, self.curve = info["cycle"], info["step"], info["tokens"], info["curve"]
            self.fresh_at, self.run = self.step, info.get("run", "")
            log(f"resumed from the exported draft {exported} (fresh optimiser): cycle {self.cycle}, "
                f"{self.tokens:,} tokens seen")
        elif self.recipe.grow:
            n = grow(self.draft, self.target, ROOT / self.recipe.grow)
            more = self.recipe.layers[n:]
            log(f"a new draft grown from {self.recipe.grow}: its {n} layers" +
                (f", then the target's layers {more} adding nothing yet" if more else " (fresh optimiser)"))
        else:
            log(f"a new draft of the target's layers {self.recipe.layers}")

    def info(self) -> dict:
        return {"recipe": asdict(self.recipe), "run": self.run, "cycle": self.cycle, "step": self.step,
                "tokens": self.tokens, "answers": len(self.answers.rows), "curve": self.curve}

    def save(self) -> None:
        state = {"draft": trained_state(self.draft), "opt": self.opt.state_dict(), "cycle": self.cycle,
                 "step": self.step, "tokens": self.tokens, "curve": self.curve, "fresh_at": self.fresh_at,
                 "run": self.run}
        write_atomic(self.state_dir / "state.pt", lambda p: torch.save(state, p))

    def evaluate(self) -> None:
        got = measure(self.draft, self.target, self.held_out, self.vocab)
        self.curve.append({"cycle": self.cycle, "tokens": self.tokens, **got})
        log(f"cycle {self.cycle}: {self.tokens:,} tokens seen, held-out top-1 {got['top1']:.3f}, "
            f"alpha(T=1) {got['alpha']:.3f} over {got['positions']} positions")
        export(self.draft, self.out, self.info())
        plot(self.curve, self.out / "curve.png")

    def measure_gap(self) -> None:
        """The draft on the held-out answers and on a seeded draw of as many greedy answers it trained on."""
        greedy = [x for x in self.answers.rows if x.get("setting") == setting_name({"temperature": 0.0})]
        seen = random.Random(self.recipe.seed).sample(greedy, min(len(greedy), len(self.held_out)))
        for name, rows in (("held-out dev answers", self.held_out), ("greedy train answers", seen)):
            self.log_measured(f"{name} ({len(rows)})", measure(self.draft, self.target, rows, self.vocab))

    def log_measured(self, what: str, got: dict) -> None:
        log(f"cycle {self.cycle}, {what}: top-1 {got['top1']:.3f}, alpha(T=1) {got['alpha']:.3f} over "
            f"{got['positions']} positions")

    def cut(self, top: int) -> None:
        """Write OUT/head-TOP.json, the `top` tokens the target's stored train answers use most (and its EOS), and
        measure the draft on the held-out answers with its output layer cut to them, beside the full one."""
        got = rank_tokens([x["answer"] for x in self.answers.rows], top, eos_ids(self.target, self.tokenizer))
        path = self.out / f"head-{top}.json"
        write_atomic(path, lambda p: p.write_text(json.dumps(
            {**got, "from": f"{len(self.answers.rows):,} train answers in {shown(self.answers.path)}"})
            + "\n"))
        log(f"{shown(path)}: {len(got['tokens']):,} of the {got['distinct']:,} tokens the target's "
            f"{got['positions']:,} answer positions use, covering {got['covered']:.4f} of them")
        self.log_measured("held-out dev answers, full output layer",
                          measure(self.draft, self.target, self.held_out, self.vocab))
        cut_head(self.draft, torch.tensor(got["tokens"], device=self.device))
        self.log_measured(f"held-out dev answers, cut to {top:,} tokens",
                          measure(self.draft, self.target, self.held_out, self.vocab))

    def target_answers(self) -> tuple[list[dict], str]:
        """This cycle's chunk of the target's answers (stored, so a killed cycle reuses them) and what it cost."""
        r, t0, mine = self.recipe, time.time(), self.me
        # a cycle killed after its answers were stored trains on them again rather than drawing them twice
        rows = [x for x in self.answers.rows if x.get("cycle") == self.cycle and x.get("by") == mine]
        if rows:
            return rows, f"{len(rows)} stored answers reused"
        # n numbers the chunks of the store, whichever run answered them: a run sharing another's answers takes the
        # next setting and seeds, instead of the same answers again under its own cycle numbers
        n = 1 + max((x["n"] for x in self.answers.rows), default=-1)
        setting = r.settings[n % len(r.settings)]
        name = setting_name(setting)
        chunk = least_answered(self.train_prompts, self.answers.rows, name, r.answers_per_cycle)
        seed = r.seed + n * max(1000, r.answers_per_cycle)  # no two chunks' rows share a stream
        for i in range(0, len(chunk), r.rows):
            rows += self.answered(chunk[i: i + r.rows], setting, seed + i)
        for x in rows:
            x["cycle"], x["by"], x["n"] = self.cycle, mine, n
        self.answers.add(rows)
        made = sum(len(x["answer"]) for x in rows)
        return rows, f"{len(rows)} answers ({name}, {made} tokens, {made / (time.time() - t0):.0f} tok/s)"

    def run_cycle(self) -> None:
        r = self.recipe
        rows, how = self.target_answers()
        t1 = time.time()
        rng = random.Random(r.seed + self.cycle)
        old = [x for x in self.answers.rows if x.get("cycle") != self.cycle or x.get("by") != self.me]
        loss_sum = 0.0
        self.draft.train()
        for pick in batches(rows, old, r, rng):
            for g in self.opt.param_groups:
                g["lr"] = lr_at(self.step, r, self.fresh_at)
            loss, n = kl_step(self.draft, self.target, pick, self.vocab)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in self.draft.parameters() if p.requires_grad], 1.0)
            self.opt.step()
            self.step, self.tokens, loss_sum = self.step + 1, self.tokens + n, loss_sum + loss.item()
        self.draft.eval()
        self.cycle += 1
        log(f"cycle {self.cycle}: {how}, "
            f"{r.steps_per_cycle} steps (KL {loss_sum / r.steps_per_cycle:.3f}, "
            f"{r.steps_per_cycle * r.batch / (time.time() - t1):.2f} seq/s); {self.tokens:,} tokens seen, "
            f"{len(self.answers.rows)} answers stored")


def shown(path: Path) -> str:
    """A path as the repository's configs name it: relative to its root where it lies inside."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def least_answered(prompts: list[tuple[str, str]], rows: list[dict], setting: str, k: int) -> list[tuple[str, str]]:
    """The k (id, text) instructions a chunk at `setting` answers next, in the order of `prompts`: those least often
    answered at any setting first, then at this one. The draft learns instructions by heart (it agrees with the target
    more on its train answers than on held-out ones) and an instruction's answers at three settings share much of
    their text, so new instructions teach more than new settings of old ones. A greedy answer drawn twice is the same
    answer: greedy takes an instruction it has answered only when every one has its greedy answer."""
    anywhere = Counter(x["id"] for x in rows)
    here = Counter(x["id"] for x in rows if x.get("setting") == setting)
    again = setting == setting_name({"temperature": 0.0})
    return sorted(prompts, key=lambda t: (again and here[t[0]] > 0, anywhere[t[0]], here[t[0]]))[:k]


def batches(new: list, old: list, recipe: Recipe, rng: random.Random) -> list[list]:
    """A cycle's steps_per_cycle batches: each sequence an older answer with probability replay (drawn at random),
    else the next of the new answers in shuffled rounds, so each is trained on before any is twice."""
    if not new:
        raise ValueError("a cycle has no new answers to train on: its chunk of instructions was empty")
    fresh = itertools.chain.from_iterable(rng.sample(new, len(new)) for _ in itertools.count())
    return [[rng.choice(old) if old and rng.random() < recipe.replay else next(fresh) for _ in range(recipe.batch)]
            for _ in range(recipe.steps_per_cycle)]


def setting_name(setting: dict) -> str:
    from decode.pair import Sampling

    return Sampling(**{"temperature": 1.0, **setting}).name


def plot(curve: list[dict], path: Path) -> None:
    """Top-1 agreement and alpha at T = 1 on held-out answers against the tokens the draft has trained on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not curve:
        return
    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = [c["tokens"] / 1e3 for c in curve]
    ax.plot(x, [c["top1"] for c in curve], "o-", label="top-1 agreement (greedy)")
    ax.plot(x, [c["alpha"] for c in curve], "s-", label="alpha at T = 1")
    ax.set_xlabel("answer tokens trained on (thousands)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("draft distillation, held-out dev answers")
    fig.tight_layout()
    write_atomic(path, lambda p: fig.savefig(p, format="png", dpi=110))
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a distillation recipe, e.g. configs/distill/smollm2.yaml")
    ap.add_argument("--cycles", type=int, default=0, help="stop after this many more cycles (0: run until killed)")
    ap.add_argument("--minutes", type=float, default=0,
                    help="stop after the cycle that passes this many minutes (0: no limit); it is measured and saved")
    ap.add_argument("--plot", action="store_true", help="only draw the learning curve from the exported draft")
    ap.add_argument("--measure", action="store_true",
                    help="only measure the draft on the held-out answers and on as many of its own greedy train answers: "
                         "a gap says it learns its instructions by heart and needs more of them")
    ap.add_argument("--head-tokens", type=int, default=0, metavar="N",
                    help="only write OUT/head-N.json, the N tokens the target's stored answers use most (a pair's "
                         "draft spec names it as head_tokens, decode.cut), and measure the draft cut to them")
    args = ap.parse_args(argv)
    if args.head_tokens < 0:
        ap.error(f"--head-tokens takes a number of tokens >= 1, got {args.head_tokens}")
    if args.cycles < 0 or not 0 <= args.minutes < float("inf"):
        ap.error(f"--cycles takes a whole number >= 0 and --minutes a finite number >= 0 (0: no limit), got "
                 f"{args.cycles} and {args.minutes}")
    try:
        recipe = Recipe.from_yaml(args.config)
        if args.plot:
            info = json.loads((ROOT / recipe.out / "training.json").read_text())
            plot(info["curve"], ROOT / recipe.out / "curve.png")
            return
        if recipe.threads:
            torch.set_num_threads(recipe.threads)
        torch.manual_seed(recipe.seed)
        run = Run(recipe)
        if not (args.measure or args.head_tokens):
            _ = run.train_prompts  # read here, so a set without a train split fails in one line, not mid-run
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.measure:
        run.measure_gap()
    if args.head_tokens:
        run.cut(args.head_tokens)
    if args.measure or args.head_tokens:
        return
    if not run.curve or (run.cycle % run.recipe.eval_every == 0 and run.curve[-1]["cycle"] != run.cycle):
        run.evaluate()  # the first point, or one a run killed between its save and its measure left out
    done, start = 0, time.time()
    while not args.cycles or done < args.cycles:
        run.run_cycle()
        done += 1
        run.save()
        last = (args.cycles and done == args.cycles) or (args.minutes and time.time() - start > 60 * args.minutes)
        if run.cycle % run.recipe.eval_every == 0 or last:
            run.evaluate()
            run.save()
        if last:
            break


if __name__ == "__main__":
    main()
