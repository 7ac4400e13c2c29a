"""Quality of generated continuations as the target judges them (for lossy methods)."""

from __future__ import annotations

import ast

import torch

from decode.pair import Pair
from decode.sampling import transform


def parses(text: str) -> bool:
    """Does prompt + completion, cut after its last complete line, parse as Python?"""
    cut = text[: text.rfind("\n") + 1] if "\n" in text else text
    try:
        ast.parse(cut)
        return True
    except (SyntaxError, ValueError):
        return False


@torch.no_grad()
def quality(pair: Pair, prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    """Target's mean per-token NLL of the outputs (nats), agreement with the target's greedy
    choice at each output position, and the share of completions that parse."""
    nll, agree, count, parsed = 0.0, 0, 0, 0
    for ids, out in zip(prompts, outputs):
        if not out:
            continue
        seq = torch.tensor([ids + out], device=pair.input_device("target"))
        logits = pair.logits(pair.target(seq).logits[0, len(ids) - 1 : -1])
        p = transform(logits, pair.config.sampling) if pair.config.sampling.temperature > 0 else logits.softmax(-1)
        y = torch.tensor(out, device=p.device)
        nll -= p.gather(-1, y[:, None]).clamp_min(1e-12).log().sum().item()
        agree += (logits.argmax(-1) == y).sum().item()
        count += len(out)
        parsed += parses(pair.tokenizer.decode(ids + out))
    return {"target_nll": nll / max(1, count), "greedy_agreement": agree / max(1, count),
            "parse_rate": parsed / max(1, len(outputs))}
