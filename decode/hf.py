"""Hugging Face generate as a baseline: the target alone, or assisted by the draft."""

from __future__ import annotations

import time

import torch

from decode.engine import Stats
from decode.pair import Pair


def hf_generate(pair: Pair, ids: list[int], n: int, hf: dict, seed: int) -> tuple[list[int], Stats]:
    """Hugging Face generate, assisted (hf: {'k': K} or {'confidence': c}) or not; sampling as the pair."""
    s = pair.config.sampling
    kwargs = dict(max_new_tokens=n, min_new_tokens=0, pad_token_id=pair.tokenizer.eos_token_id,
                  do_sample=s.temperature > 0)
    if s.temperature > 0:
        kwargs |= dict(temperature=s.temperature, top_k=s.top_k or None, top_p=s.top_p)
    if hf:
        if pair.draft.config.vocab_size != pair.target.config.vocab_size:
            raise ValueError(f"Hugging Face assisted generation needs equal embedding sizes, got draft "
                             f"{pair.draft.config.vocab_size} and target {pair.target.config.vocab_size}: "
                             "drop the kind: hf methods from the bench config for this pair")
        gc = pair.draft.generation_config
        gc.num_assistant_tokens = hf.get("k", 20)
        gc.num_assistant_tokens_schedule = "constant"
        gc.assistant_confidence_threshold = hf.get("confidence", 0.0)
        kwargs["assistant_model"] = pair.draft
    torch.manual_seed(seed)
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    out = pair.target.generate(x, attention_mask=torch.ones_like(x), **kwargs)[0, len(ids):].tolist()
    st = Stats(new_tokens=len(out), wall=time.perf_counter() - t0)
    return out, st
