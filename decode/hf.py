"""Hugging Face generate: the baselines (target alone, assisted at constant K or with the confidence
rule), and an exported SpecDec++ head driving the assistant inside an unmodified `generate()`:

    assistant = specdecpp_assistant(draft, "checkpoints/specdecpp-greedy", h=0.7, tokenizer=tokenizer)
    out = target.generate(**inputs, assistant_model=assistant, do_sample=False, max_new_tokens=64)

The assistant is a shallow copy of the draft (same weights, no extra memory) whose `generate` adds a
stopping criterion: a forward pre-hook on the draft's output embeddings reads the last hidden state
(after the final norm, the state heads are trained on), the head turns it into alpha_hat, and
drafting stops when 1 - prod(alpha_hat) > h. The one thing this relies on beyond public API is that
assisted generation drafts by calling `assistant_model.generate(...)` (ASSISTANT_ENTRY below);
tests/test_hf.py fails loudly if a transformers release stops doing so.
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from decode.engine import Stats, clock
from decode.pair import Pair, Sampling, model_identity
from decode.policies import CostAwareStop, DraftStep, HeadPolicy, SpecDecPP

ASSISTANT_ENTRY = "generate"  # the method of the assistant that transformers' AssistedCandidateGenerator calls


class HeadStop(StoppingCriteria):
    """A head policy's stopping rule (SpecDec++'s, or the cost-aware stop) over the hidden states a hook captured;
    reset per drafting round.

    A "prev" head scores each candidate from the state that produced it, exactly as the engine does.
    An "own" head needs the state after reading the candidate, which the assistant computes only when
    it drafts the next one: its rule is applied one candidate late (one more draft token per round).
    """

    def __init__(self, policy: HeadPolicy, vocab: int | None = None):
        self.policy, self.captured, self.steps, self.head_s, self.vocab = policy, None, 0, 0.0, vocab
        self.drawn: tuple[int, torch.Tensor | None] | None = None  # the last candidate and the logits that drew it
        self.rounds, self.drafted = 0, 0  # over the assistant's life: drafting rounds, candidates
        self.text: torch.Tensor | None = None  # the committed text the last round drafted after

    def reset(self, input_ids: torch.Tensor | None = None) -> None:
        """A drafting round begins after `input_ids` (1, L), the committed text: how it grew since the last round
        tells the policy what verification accepted (L0 + accepted + 1); text that does not extend the last
        round's is a new generation."""
        if input_ids is not None:
            last, k = self.text, self.steps
            if last is None or input_ids.shape[1] <= last.shape[1] or \
                    not torch.equal(input_ids[:, : last.shape[1]], last.to(input_ids.device)):
                self.policy.start()
            else:
                self.policy.verified(min(input_ids.shape[1] - last.shape[1] - 1, k), k)
            self.text = input_ids.detach()
        self.policy.reset()
        self.steps = 0
        self.rounds += 1

    def capture(self, module, args) -> None:
        self.captured = args[0][:, -1].detach()  # (1, H) final-norm state at the last position

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        t0 = time.perf_counter()
        self.steps += 1
        self.drafted += 1
        if isinstance(scores, (tuple, list)):  # some generate paths hand the criteria every step's scores
            scores = scores[-1]
        # DraftStep computes confidence, entropy and top-1 from these logits when the head reads them (extras)
        drawn = (int(input_ids[0, -1]), scores[0, : self.vocab].float() if self.policy.features.extras else None)
        stop = False
        if not self.policy.reads_own_state:
            stop = self.policy.stop(self.step(self.steps - 1, *drawn))
        elif self.steps > 1:  # the state after reading the previous candidate: score that one, with its own q
            stop = self.policy.stop(self.step(self.steps - 2, *self.drawn))
        self.drawn = drawn
        self.head_s += time.perf_counter() - t0
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    def step(self, index: int, token: int, logits: torch.Tensor | None) -> DraftStep:
        """Candidate `index` as the engine would hand it to the policy: the captured state (the one that produced it;
        for an own head, the one after reading it) and, for a head with extras, the logits of the draft's
        distribution that drew it."""
        state = self.captured[0]
        return DraftStep(index, token, None, logits, state, state)


def in_config(kwargs: dict) -> dict:
    """generate() keyword arguments with the generation arguments moved into (a copy of) their generation_config.

    transformers' assisted generation drafts by calling the assistant's generate() with a generation_config and
    min/max_new_tokens and use_cache beside it, a form that its own generate() deprecates (and warns about); the
    assistants here call it in the current form, the config alone.
    """
    if kwargs.get("generation_config") is None:
        return kwargs
    gc = copy.copy(kwargs["generation_config"])  # scalar fields are set below, so a shallow copy is enough
    rest = gc.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return rest | {"generation_config": gc}


def assistant_of(draft):
    """A shallow copy of the draft (same modules and weights, and the same generation_config object) that
    transformers' assisted generation calls in the current form (in_config)."""
    assistant = copy.copy(draft)
    plain_generate = draft.generate
    setattr(assistant, ASSISTANT_ENTRY, lambda *args, **kwargs: plain_generate(*args, **in_config(kwargs)))
    return assistant


def sampling_of(generation_config) -> Sampling:
    """The Sampling a generation config decodes under (greedy unless do_sample)."""
    if not generation_config.do_sample:
        return Sampling(temperature=0.0)
    return Sampling(temperature=generation_config.temperature or 1.0, top_k=generation_config.top_k or 0,
                    top_p=generation_config.top_p if generation_config.top_p is not None else 1.0)


def specdecpp_assistant(draft, head_dir: str, h: float = 0.7, max_len: int = 20, tokenizer=None,
                        allow_sampling_mismatch: bool = False, costs: tuple | None = None):
    """A copy of `draft` for `generate(assistant_model=...)` whose drafting stops by an exported head.

    costs: the machine's step costs in ms, as decode.costs.model.measure_costs(pair) returns them (a draft step and
    the target's verify time per number of tokens) or as a line (draft step, target forward of one token, each
    further verified token): the cost-aware stop (decode.policies.CostAwareStop) replaces SpecDec++'s threshold
    h. Refuses (HeadMismatch) a head trained for another draft; the sampling setting is checked at the first
    generate call, against the one the target decodes under (SamplingMismatch).
    """
    if costs is None:
        policy = SpecDecPP(head_dir, h=h, max_len=max_len, allow_sampling_mismatch=allow_sampling_mismatch)
    else:
        line = len(costs) == 3
        policy = CostAwareStop(head_dir, *(costs if line else ()), max_len=max_len,
                               allow_sampling_mismatch=allow_sampling_mismatch)
        if not line:
            policy.set_costs(*costs)
    recorded = policy.config.get("draft") or {}
    vocab = len(tokenizer) if tokenizer is not None else recorded.get("vocab_size")
    policy.bind(model_identity(draft, vocab, recorded.get("path", "")))
    stop = HeadStop(policy, vocab)
    assistant = copy.copy(draft)  # shares modules and weights; only its attributes are its own
    assistant.generation_config = copy.deepcopy(draft.generation_config)
    gc = assistant.generation_config
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = max_len, "constant"
    gc.assistant_confidence_threshold = 0.0  # the head decides, not the confidence rule
    lm_head = draft.get_output_embeddings()
    plain_generate, checked = draft.generate, []

    def generate(*args, **kwargs):
        if not checked:  # the setting the target decodes under, known only now
            policy.bind(model_identity(draft, vocab, recorded.get("path", "")), sampling_of(kwargs["generation_config"]))
            checked.append(True)
        ids = kwargs.get("input_ids", args[0] if args else None)
        stop.reset(ids if isinstance(ids, torch.Tensor) else None)
        criteria = StoppingCriteriaList(list(kwargs.pop("stopping_criteria", None) or []) + [stop])
        handle = lm_head.register_forward_pre_hook(stop.capture)
        try:
            return plain_generate(*args, stopping_criteria=criteria, **in_config(kwargs))
        finally:
            handle.remove()

    setattr(assistant, ASSISTANT_ENTRY, generate)
    assistant.specdecpp_stop = stop  # counters for tests and the bench
    return assistant


def clean_config(pair: Pair, n: int, stop_at_eos: bool = True) -> GenerationConfig:
    """The generation config a baseline runs on: the pair's sampling, its EOS ids, at most n new tokens, and
    nothing else. A checkpoint's own config carries extras (Qwen2.5-Instruct: repetition_penalty 1.05, applied
    even without sampling) that would make the baseline decode another distribution than the engine."""
    s = pair.config.sampling
    fields = dict(max_new_tokens=n, min_new_tokens=0, eos_token_id=list(pair.eos_ids) if stop_at_eos else None,
                  pad_token_id=pair.eos_ids[0],
                  do_sample=s.temperature > 0)
    if s.temperature > 0:  # top_k 0, not None: generate() fills a None from the model's config (GPT-2's: 50), and
        # the assistant's generate() from the draft's, so the draft sampled under top-k 50 beside a target without it
        fields |= dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    else:
        fields |= dict(temperature=None, top_k=None, top_p=None)
    return GenerationConfig(**fields)


@contextlib.contextmanager
def clean_generation(pair: Pair, n: int, stop_at_eos: bool = True):
    """The target's generation config is clean_config(pair, n) inside. generate() fills every field a passed config
    leaves unset from the model's own generation config, so the clean config stands in for the model's for the
    call instead of being passed beside it."""
    own, pair.target.generation_config = pair.target.generation_config, clean_config(pair, n, stop_at_eos)
    try:
        yield
    finally:
        pair.target.generation_config = own


def head_assistant(pair: Pair, hf: dict):
    """The assistant of an {'head': dir, 'h': h} method, or None: built once, so the head loads once."""
    if "head" not in hf:
        return None
    return specdecpp_assistant(pair.draft, hf["head"], hf.get("h", 0.7), hf.get("max_len", 20), pair.tokenizer)


def hf_generate(pair: Pair, ids: list[int], n: int, hf: dict, seed: int, assistant=None,
                stop_at_eos: bool = True) -> tuple[list[int], Stats]:
    """Hugging Face generate, assisted (hf: {'k': K}, {'confidence': c} or {'head': dir, 'h': h}) or not;
    stop_at_eos=False generates all n tokens through the EOS.

    A head method reuses `assistant` (from head_assistant) when given; constant-K and confidence methods
    set the draft's generation config on every call, since methods share one draft.
    """
    kwargs = {}
    if hf:
        if pair.config.sampling.temperature > 0 and pair.draft.config.vocab_size != pair.target.config.vocab_size:
            raise ValueError(f"Hugging Face assisted sampling needs equal embedding sizes, got draft "
                             f"{pair.draft.config.vocab_size} and target {pair.target.config.vocab_size}: "
                             "drop the kind: hf methods from the bench config for this pair")
        if "head" in hf:
            kwargs["assistant_model"] = assistant or head_assistant(pair, hf)
        else:
            gc = pair.draft.generation_config
            gc.num_assistant_tokens = hf.get("k", 20)
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = hf.get("confidence", 0.0)
            kwargs["assistant_model"] = assistant_of(pair.draft)
        if pair.draft.config.vocab_size != pair.target.config.vocab_size:
            # transformers takes unequal embedding sizes for two tokenizers: its universal assisted decoding maps
            # the (here identical) tokens across, which is exact under greedy decoding
            if pair.config.draft.head_tokens:
                raise ValueError(f"a draft cut to head_tokens ({pair.config.draft.head_tokens}) with embedding sizes "
                                 f"unlike its target's goes through transformers' two-tokenizer assisted path, which "
                                 f"fails on it: drop head_tokens or the kind: hf methods for this pair")
            kwargs |= {"tokenizer": pair.tokenizer, "assistant_tokenizer": pair.tokenizer}
    stop = getattr(kwargs.get("assistant_model"), "specdecpp_stop", None)
    head_before = stop.head_s if stop else 0.0
    torch.manual_seed(seed)
    x = torch.tensor([ids], device=pair.input_device("target"))
    now = clock(pair.device)
    t0 = now()
    with clean_generation(pair, n, stop_at_eos):
        out = pair.target.generate(x, attention_mask=torch.ones_like(x), **kwargs)[0, len(ids):].tolist()
    st = Stats(new_tokens=len(out), wall=now() - t0)
    if stop:
        st.t_head = stop.head_s - head_before
    return out, st


def hf_generate_batch(pair: Pair, prompts: list[list[int]], n: int, seed: int,
                      stop_at_eos: bool = True) -> tuple[list[list[int]], float]:
    """Hugging Face generate() of the target alone over a left-padded batch -> each row's new tokens (up to and
    including its EOS; stop_at_eos=False: all n, through it) and the wall time. Its assisted generation takes one
    sequence only, so this is its batch."""
    width, pad = max(map(len, prompts)), pair.eos_ids[0]
    x = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=pair.input_device("target"))
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=x.device)
    torch.manual_seed(seed)
    now = clock(pair.device)
    t0 = now()
    with clean_generation(pair, n, stop_at_eos):
        out = pair.target.generate(x, attention_mask=mask)[:, width:].tolist()
    wall, eos = now() - t0, set(pair.eos_ids) if stop_at_eos else set()
    return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in out], wall
