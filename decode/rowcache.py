"""A KV cache over B rows of different lengths that rolls back per row: what decode.batch decodes on.

Every row's text is contiguous and ends at the cache's last column; rows are left-padded behind an attention mask,
and each forward gets explicit per-row position ids. A forward feeds each row its own number of tokens,
right-padded within the step: causal attention keeps a row's real tokens from reading the filler after them. After
the forward (and after verification) each row is cut back to the text it keeps by moving its cache right and
widening its left padding, so the rows stay right-aligned. So the physical distance between two real tokens is
their distance in the text, which is what sliding-window masks measure, and rejected positions never stay behind a
mask (the scheme that corrupts rows at larger batch sizes).

Storage: GrowingLayers (decode.kvcache), so a forward writes its new columns in place instead of copying the
cache by torch.cat. A realignment is one index_select per layer over whole (D,) key and value vectors, written
into a fresh buffer with room to grow: here at batch 32 that was 3x faster than a gather with an index per
element, and it replaces the copy that the next append would make anyway.
"""

from __future__ import annotations

import torch

from decode.kvcache import forward, new_cache
from decode.pair import Pair, input_device

ROOM = 64  # columns of spare room a realigned buffer keeps, so the next rounds append in place


class RowCache:
    """One model's KV cache over B rows, right-aligned: row b's tokens fill the last columns, the first pad[b] columns
    are padding (masked). Rows that hold filler after a feed hold it at the end, until keep() cuts it."""

    def __init__(self, model, pair: Pair, rows: int, name: str, calls: list, hidden: bool = False):
        self.model, self.pair, self.name, self.calls, self.hidden = model, pair, name, calls, hidden
        self.cache, self.device = new_cache(), input_device(model)
        self.pad = torch.zeros(rows, dtype=torch.long)
        self.width = 0
        self.peak_bytes = 0  # the largest its key and value buffers grew (decode.evaluation.batch reports it)

    @property
    def length(self) -> torch.Tensor:
        """(B,) tokens each row holds."""
        return self.width - self.pad

    def mask(self, extra: int) -> torch.Tensor:
        """(B, width + extra) attention mask: 0 on each row's left padding."""
        cols = torch.arange(self.width + extra)
        return (cols[None, :] >= self.pad[:, None]).long().to(self.device)

    @torch.no_grad()
    def feed(self, chunks: list[list[int]], trim: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row b's tokens chunks[b] (a prefill's may be empty) -> (B, M, V) float32 logits and (B, M, H) hidden states
        (None unless hidden), M the longest chunk: row b's are at [:len(chunks[b])], the rest is filler, cut here
        unless trim is False (the caller's keep() cuts it with what verification rejects: one move, not two)."""
        sizes = torch.tensor([len(c) for c in chunks])
        m = int(sizes.max())
        ids = torch.tensor([c + [c[-1] if c else 0] * (m - len(c)) for c in chunks], device=self.device)
        before = self.length
        logits, state = self._forward(ids, before[:, None] + torch.arange(m)[None, :])
        if trim and bool((sizes < m).any()):
            self.keep(before + sizes)
        return logits, state

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, m) ids at (B, m) positions, appended after the cache's columns -> the float32 logits and the hidden
        states (None unless hidden) of the positions the output layer ran on; the width, calls and peak follow."""
        m = ids.shape[1]
        out = forward(self.model, ids, self.cache, hidden=self.hidden, attention_mask=self.mask(m),
                      position_ids=pos.to(self.device), **kwargs)
        out, state = out if self.hidden else (out, None)
        self.width += m
        self.calls.append((self.name, m))
        self.peak_bytes = max(self.peak_bytes, self.bytes())
        return self.pair.logits(out.logits), state

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An empty cache reads B prompts (any lengths >= 1) -> (B, V) float32 logits and (B, H) hidden states (None
        unless hidden) after each prompt's last token. The prompts are left-padded behind the mask, so every row ends
        at the last column: the output layer runs on that column alone (logits_to_keep), and no realignment follows."""
        if self.width:
            raise ValueError(f"prefill() reads prompts into an empty cache; this {self.name} cache holds {self.width}")
        sizes = torch.tensor([len(p) for p in prompts])
        m = int(sizes.max())
        self.pad = m - sizes
        ids = torch.tensor([[p[0]] * (m - len(p)) + p for p in prompts], device=self.device)
        logits, state = self._forward(ids, (torch.arange(m)[None, :] - self.pad[:, None]).clamp_min(0), logits_to_keep=1)
        return logits[:, -1], None if state is None else state[:, -1]

    def _layers(self):
        return [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None
                and layer.keys.numel() and getattr(layer, "buffers", None) is not None]

    def bytes(self) -> int:
        """Bytes the key and value buffers hold (with their spare room, and the buffers kept for the next move)."""
        return sum(b.untyped_storage().nbytes() for layer in self._layers()  # a compacted batch's buffers are
                   for b in (*layer.buffers, *getattr(layer, "spare", ())))  # views of rows of the storage it had

    def keep(self, lengths: torch.Tensor) -> None:
        """Cut row b back to its first lengths[b] tokens (at most what it holds): its cache moves right by what it
        drops beyond the row that drops least, and columns that every row pads are cut from the left."""
        drop = self.length - lengths
        if bool((drop < 0).any()):
            raise ValueError(f"a row cannot keep more tokens than its cache holds: {lengths.tolist()}")
        if not bool(drop.any()):  # nothing to cut (a plain step fed one token a row): some column is real in every row
            return
        shift, width = drop - drop.min(), self.width - int(drop.min())
        left = int((width - lengths).min())  # columns that are padding in every row
        if left or bool(shift.any()):
            cols = (torch.arange(left, width)[None, :] - shift[:, None]).clamp_min(0)
            self._move(cols)
        else:  # every row drops the same tail: shorter views of the same buffers
            for layer in self._layers():
                layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
        self.width = width - left
        self.pad = self.width - lengths

    def _move(self, cols: torch.Tensor) -> None:
        """New column j of row b is old column cols[b, j]: one index_select of (D,) vectors per buffer, into buffers
        with ROOM spare columns. The buffers a move leaves behind are kept and written by the next move: at batch 256
        a fresh allocation (the kernel zeroing hundreds of MiB of new pages) cost more than the copy itself."""
        rows, new = cols.shape
        for layer in self._layers():
            buf = layer.buffers[0]
            b, h, cap, d = buf.shape
            base = (torch.arange(rows)[:, None, None] * h + torch.arange(h)[None, :, None]) * cap
            src = torch.cat([cols, cols.new_zeros(rows, ROOM)], 1)  # the room is filled with whatever: never read
            flat = (base + src[:, None, :]).reshape(-1).to(buf.device)
            moved = [torch.index_select(x.reshape(-1, d), 0, flat, out=y.view(-1, d))
                     for x, y in zip(layer.buffers, _spare(layer, flat.numel() * d))]
            layer.buffers = tuple(x.view(rows, h, new + ROOM, d) for x in moved)
            layer.keys, layer.values = (x[:, :, :new] for x in layer.buffers)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (indices into the current batch), in this order. An order from compaction() copies
        only the rows it moves into the places of rows that left, and the batch becomes the first len(rows) rows of
        the same buffers; any other order is one index_select of every kept row."""
        m, src = len(rows), rows.tolist()
        moved = [i for i, r in enumerate(src) if r != i]
        in_place = all(src[i] >= m for i in moved)  # sources past the new size: no row is overwritten before it moves
        to, frm = torch.tensor(moved, dtype=torch.long), torch.tensor([src[i] for i in moved], dtype=torch.long)
        for layer in self._layers():
            if in_place:
                if moved:
                    to_d, frm_d = to.to(layer.keys.device), frm.to(layer.keys.device)
                    for x in layer.buffers:
                        x.index_copy_(0, to_d, x.index_select(0, frm_d))
                layer.buffers = tuple(x[:m] for x in layer.buffers)
            else:
                r = rows.to(layer.keys.device)
                shape = (m, *layer.buffers[0].shape[1:])
                layer.buffers = tuple(torch.index_select(x, 0, r, out=y.view(shape))
                                      for x, y in zip(layer.buffers, _spare(layer, m * layer.buffers[0][0].numel())))
            layer.keys, layer.values = (x[:, :, :self.width] for x in layer.buffers)
        self.pad = self.pad.index_select(0, rows)
        left = int(self.pad.min()) if m else 0
        if 2 * left >= self.width > 0:  # padding in every row: cut it once it is half the width (a move copies all)
            self.keep(self.length)


def compaction(n: int, gone: list[int]) -> list[int]:
    """Rows 0..n-1 of a batch, those in `gone` leaving -> the order of the rows that stay that moves the fewest:
    rows below the new size stay in place, and each place a leaving row frees there takes a row from the tail
    (RowCache.select then copies those rows alone, where a full reorder copies every row: 0.28 s a move at batch
    256 on the embedded pair)."""
    left, m = set(gone), n - len(set(gone))
    tail = [i for i in range(m, n) if i not in left]
    return [tail.pop() if i in left else i for i in range(m)]


def _spare(layer, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two flat tensors of numel elements to write a layer's moved keys and values into: the buffers the layer's
    previous move left behind when they are large enough, else fresh ones. The current buffers become the spare."""
    spare = getattr(layer, "spare", None)
    if spare is None or spare[0].numel() < numel or spare[0].dtype != layer.buffers[0].dtype:
        spare = tuple(x.new_empty(numel) for x in layer.buffers)
    layer.spare = tuple(x.reshape(-1) for x in layer.buffers)
    return tuple(x[:numel] for x in spare)
