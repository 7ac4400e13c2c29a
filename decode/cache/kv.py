"""KV caches, and the one way the project calls a model forward over one and cuts it back.

Hugging Face's DynamicCache appends by torch.cat: every forward copies the whole cache of every layer
into a freshly allocated tensor. StaticCache avoids the copy but attends over its full preallocated
length behind a padding mask built on every forward.

GrowingLayer keeps the DynamicLayer contract (keys/values are exactly the cached positions, so masks
and the attention see the true length) with the storage of a static cache: the cached positions are a
view into a buffer with spare room, new positions are written in place, and the buffer doubles when
full. Cropping shortens the view; the next update overwrites what was cut.

Where it pays: in batches, where a DynamicCache's concatenation copies every row, so labelling (data_gen,
batched) uses it. At batch 1 the copy is small and the two are within a few percent either way, so the decoder
keeps DynamicCache (docs/engine.md, "Measured fast paths").
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class UnservableModel(ValueError):
    """The model's cache cannot be cut back to a shorter prefix, so speculative decoding cannot serve it."""


class GrowingLayer(DynamicLayer):
    """One layer's cache: keys and values (B, H, L, D) are views of (B, H, capacity, D) buffers.

    reserve: positions the first buffer holds when the caller knows the length (prompt + new tokens): a
    labelling batch then never grows or over-allocates; past it, the buffer doubles.
    """

    def __init__(self, reserve: int = 0):
        super().__init__()
        self.reserve = reserve

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def _in_buffer(self) -> bool:
        """Are keys/values still views of our buffers? (crop keeps them so; beam reorders do not.)"""
        return self.buffers is not None and self.keys.data_ptr() == self.buffers[0].data_ptr() \
            and self.keys.shape[:2] == self.buffers[0].shape[:2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """(B, H, n, D) new keys and values -> (B, H, L + n, D) views of every cached position."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.get_seq_length()
        new = old + key_states.shape[-2]
        if not self._in_buffer() or new > self.buffers[0].shape[-2]:
            capacity = self.reserve if self.buffers is None and new <= self.reserve else 2 * new
            self.buffers = tuple(self._grown(cached, fresh, old, capacity)
                                 for cached, fresh in ((self.keys, key_states), (self.values, value_states)))
        for buf, fresh in zip(self.buffers, (key_states, value_states)):
            buf[:, :, old:new].copy_(fresh)
        self.keys, self.values = (buf[:, :, :new] for buf in self.buffers)
        return self.keys, self.values

    @staticmethod
    def _grown(cached: torch.Tensor, fresh: torch.Tensor, old: int, capacity: int) -> torch.Tensor:
        buf = fresh.new_empty(*fresh.shape[:2], capacity, fresh.shape[-1])
        if old:
            buf[:, :, :old].copy_(cached)
        return buf


def new_cache(reserve: int = 0) -> Cache:
    """An empty cache of GrowingLayers, one added per model layer on first use (as DynamicCache does), each
    reserving `reserve` positions up front."""
    return Cache(layer_class_to_replicate=functools.partial(GrowingLayer, reserve))


def rollback_cache() -> Cache:
    """An empty cache that keeps every position of every layer, so it can always be cut back.

    A model left to build its own cache gives sliding-window layers (Mistral, Phi-3, Gemma-2/3) a layer that
    keeps only the last `window` positions and cannot be cropped once the window is full: a rejected draft
    token could never be taken back. Here those layers keep every position and the attention mask applies the
    window (masks are built from the model config, and with no sliding cache layer the mask covers the whole
    cache), so the outputs are the same and memory grows with prompt + new tokens, which max_context bounds.
    """
    return Cache(layer_class_to_replicate=DynamicLayer)


def check_servable(config, role: str = "model") -> None:
    """Raise UnservableModel, before any weight is read, when a model config's own cache holds layers that a
    position cannot cut back (linear attention, recurrent states): their state after a rejected token has no
    rollback."""
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # a config DynamicCache cannot read describes no special layers: full attention
        return
    odd = sorted({type(layer).__name__ for layer in layers if getattr(layer, "is_linear", False)
                  or getattr(layer, "is_dummy", False) or not isinstance(layer, DynamicLayer)})
    if odd:
        raise UnservableModel(
            f"the {role} ({type(config).__name__}) keeps {', '.join(odd)} cache layers, whose state cannot be cut "
            "back to a prefix after a rejected draft token: use a pair of attention-only models (dynamic or "
            "sliding-window caches)")


@functools.cache
def cache_keyword(model_class: type) -> str:
    """The forward keyword that takes the KV cache: `cache` where transformers asks for it (5.24 on), else the
    older `past_key_values`, so the project runs on both sides of the rename without the deprecation warning."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def forward(model, ids: torch.Tensor, cache: Cache, hidden: bool = False, **kwargs):
    """(B, n) ids -> the model's output, reading and extending `cache` in place (use_cache on).

    hidden: also return (B, n', H) the last-layer state that the output layer reads (after the final norm),
    for the positions whose logits are computed (n' = logits_to_keep when given). It is caught on its way into
    the output layer instead of asking for output_hidden_states, which keeps every layer's states.
    """
    kwargs = {"use_cache": True, cache_keyword(type(model)): cache} | kwargs
    if not hidden:
        return model(ids, **kwargs)
    seen = []
    handle = model.get_output_embeddings().register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        out = model(ids, **kwargs)
    finally:
        handle.remove()
    return out, seen[-1]


def crop_cache(cache, length: int) -> None:
    """Cut a KV cache back to its first `length` positions; a no-op when it holds no more.

    crop() is given the number of positions to drop, as a negative count.
    """
    if cache.get_seq_length() > length:
        cache.crop(length - cache.get_seq_length())
