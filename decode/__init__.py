"""specheads' decoding: load a pair, pick how far to draft and how to verify, decode one sequence or a batch.

    from decode import load_pair, SpeculativeDecoder, BatchDecoder, SpecDecPP, GreedyMatch
    pair = load_pair("configs/pairs/pycode.yaml").with_sampling(temperature=0.0)  # GreedyMatch: greedy decoding
    gen = SpeculativeDecoder(pair, SpecDecPP("checkpoints/specdecpp-greedy"), GreedyMatch()).generate(ids, 64)

The names below are the public API; each is imported on first use (importing this package loads no model library,
so `python -m decode` can set its defaults first). Where each lives:
- the pair: decode.pair (load_pair, Pair, PairConfig, Sampling), GGUF files through decode.gguf;
- the loops: decode.engine (SpeculativeDecoder, Autoregressive: one sequence), decode.batch (BatchDecoder,
  BatchAutoregressive: rows);
- how far to draft: decode.policies (per round), decode.control (per batch), token tree shapes in
  decode.tree.shapes and decode.tree.head;
- verification: decode.rules.chain;
- Hugging Face assisted generation driven by a head: decode.hf.specdecpp_assistant.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "decode.pair": ["load_pair", "Pair", "PairConfig", "Sampling", "ModelSpec"],
    "decode.vocab": ["VocabularyMismatch"],
    "decode.engine": ["SpeculativeDecoder", "Autoregressive"],
    "decode.batch": ["BatchDecoder", "BatchAutoregressive"],
    "decode.results": ["Generation", "Stats"],
    "decode.rules.chain": ["Rule", "GreedyMatch", "SpeculativeSampling", "FSD", "FLy", "SprinterCheck"],
    "decode.policies": ["Policy", "FixedK", "DraftConfidence", "AdaEDL", "SpecDecPP", "CostAwareStop", "RenewalStop",
                        "SprinterVerifier", "HeadPolicy"],
    "decode.control": ["BatchControl", "PerRow", "BatchSizeK", "BatchCostAware"],
    "decode.tree.shapes": ["TreeShape", "StaticTree", "SequoiaTree", "ConfidenceTree"],
    "decode.tree.head": ["HeadTree"],
    "decode.hf": ["specdecpp_assistant"],
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}
__all__ = [name for names in _WHERE.values() for name in names]


def __getattr__(name: str):
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(_MODULE_OF[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'decode' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
