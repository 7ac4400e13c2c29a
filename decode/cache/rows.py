"""A KV cache over B rows of different lengths that rolls back per row: what decode.batch decodes on.

Rows are left-padded behind an attention mask, and each forward gets explicit per-row position ids (a row's
positions count its own kept tokens). A forward feeds each row its own number of tokens, right-padded within the
step: causal attention keeps a row's real tokens from reading the filler after them.

Rolling back a row (keep) masks the columns it drops. Where every layer attends over the whole cache, a masked
column is a hole that no later query reads (its key's weight is exactly zero and the positions skip it), so a
round's rollback moves nothing. Rejected positions are never read behind a mask, which is what corrupts rows in the
scheme that leaves them in place without their own position ids. Holes cost attention width, so once they make
the cache a quarter wider than its longest row (SLACK), one move (compact) packs every row right-aligned again.
Where a layer attends over a sliding window, masks measure the window in columns, so holes would stretch it: such
models compact on every rollback that leaves a hole, keeping each row's text contiguous, as the window needs.

Where the moves cost (2 threads, the embedded pair, greedy, fixed K = 1, 32 new tokens): realigning every round
took 14% of the wall at batch 8 and 25% at batch 32.

Storage: GrowingLayers (decode.cache.kv), so a forward writes its new columns in place instead of copying the
cache by torch.cat. A move is one index_select per layer over whole (D,) key and value vectors, written into a
buffer with room to grow: here at batch 32 that was 3x faster than a gather with an index per element, and it
replaces the copy that the next append would make anyway.
"""

from __future__ import annotations

import torch

from decode.cache.kv import forward, new_cache
from decode.pair import Pair, input_device

ROOM = 64  # columns of spare room a moved buffer keeps, so the next rounds append in place
SLACK = 0.25  # holes may make the cache this much wider than its longest row before compact() packs it
SHORT = 64  # feed() builds its own 4-D mask for chunks up to this many tokens (a round's, not a prompt's)
WINDOW_FIELDS = ("sliding_window", "window_size", "attention_window")  # config fields that name an attention window
LIMIT_FIELDS = ("max_position_embeddings", "n_positions")  # config fields that bound positions


def position_limit(config) -> int | None:
    """The most positions a model config takes (None if it names no limit): absolute-position models index an
    embedding by position."""
    return next((int(v) for v in (getattr(config, f, None) for f in LIMIT_FIELDS) if v), None)


def causal_buffer(model) -> int | None:
    """The width of a square causal-mask buffer the model slices by key length (GPT-Neo registers one per layer,
    max_positions wide): a cache wider than it cannot be attended. None where the model keeps none (masks built per
    forward, as most families build them)."""
    return next((int(b.shape[-1]) for _, b in model.named_buffers() if b.dtype == torch.bool and b.dim() == 4
                 and b.shape[-1] == b.shape[-2] > 1), None)


def windowed(config) -> bool:
    """Does any layer of this model config attend over a sliding window (measured in cache columns)? A config
    whose layer_types are all full attention does not, whatever window size it also carries (Qwen2's default)."""
    types = getattr(config, "layer_types", None)
    if types:
        return any(t != "full_attention" for t in types)
    return any(getattr(config, name, None) for name in WINDOW_FIELDS)


class RowCache:
    """One model's KV cache over B rows: valid[b] marks the columns that hold row b's kept text (in order), the rest
    are left padding, holes (rolled back) or filler, all masked."""

    def __init__(self, model, pair: Pair, rows: int, name: str, calls: list, hidden: bool = False):
        self.model, self.pair, self.name, self.calls, self.hidden = model, pair, name, calls, hidden
        self.cache, self.device = new_cache(), input_device(model)
        self.holes = not windowed(model.config)
        self.limit = position_limit(model.config)  # positions stay below it (None: unbounded)
        self.max_width = causal_buffer(model)  # the cache's width stays within it (None: unbounded)
        self.valid = torch.zeros(rows, 0, dtype=torch.bool)
        self.length = torch.zeros(rows, dtype=torch.long)  # (B,) tokens each row holds
        self.peak_bytes = 0  # the largest its key and value buffers grew (decode.evaluation.batch reports it)
        self._sized = None  # the first layer's buffer when peak_bytes was last read: buffers change all at once
        self.dtype = model.dtype  # a property that walks the parameters: read once, not per tree forward

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    @torch.no_grad()
    def feed(self, chunks: list[list[int]], trim: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row b's tokens chunks[b] (a prefill's may be empty) -> (B, M, V) float32 logits and (B, M, H) hidden states
        (None unless hidden), M the longest chunk: row b's are at [:len(chunks[b])], the rest is filler, masked at
        once. trim False: the caller's keep() follows (so a model that must stay contiguous moves once, not twice)."""
        sizes = torch.tensor([len(c) for c in chunks])
        m = int(sizes.max())
        ids = self._padded(chunks, m)
        pos = self.length[:, None] + torch.arange(m)[None, :]
        new = torch.arange(m)[None, :] < sizes[:, None]
        if self.holes and m <= SHORT:  # full attention: the 4-D mask itself, kept text and the chunk causally
            # (transformers builds one from a 2-D mask on every forward, a sixth of a draft step's time here); a window
            # needs that build, and a long chunk (a prompt) its boolean mask, a quarter of this float one's bytes
            among = torch.ones(m, m, dtype=torch.bool).tril_().expand(len(chunks), m, m)
            mask = self._float_mask(torch.cat([self.valid[:, None, :].expand(-1, m, -1), among], 2))
        else:
            mask = torch.cat([self.valid, torch.ones_like(new)], 1)
        logits, state = self._forward(ids, self._capped(pos), mask)
        self.valid, self.length = torch.cat([self.valid, new], 1), self.length + sizes
        if trim and bool((sizes < m).any()):
            self.settle()
        return logits, state

    @torch.no_grad()
    def feed_tree(self, chunks: list[list[int]], pos: torch.Tensor, extra: torch.Tensor, among: torch.Tensor,
                  kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row b's tokens chunks[b] at (B, m) positions pos, token j reading the kept text, the (B, m, width) columns
        extra (a tree node's ancestors already in the cache) and the (B, m, m) new tokens among (itself, its
        ancestors in this chunk) -> logits and hidden states as feed()'s. (B, m) kept marks the new tokens that are
        kept text (a round's root); the rest are tree nodes until commit_columns keeps their accepted path."""
        m = max(len(c) for c in chunks)
        ids = self._padded(chunks, m)
        logits, state = self._forward(ids, self._capped(pos),
                                      self._float_mask(torch.cat([self.valid[:, None, :] | extra, among], 2)))
        self.valid, self.length = torch.cat([self.valid, kept], 1), self.length + kept.sum(1)
        return logits, state

    def _float_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """(B, m, width + m) which columns each new token reads -> the (B, 1, m, width + m) additive mask a model
        takes as is (0 where allowed, the dtype's lowest elsewhere)."""
        low = torch.finfo(self.dtype).min
        return torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, low)[:, None]

    def commit_columns(self, cols: list[list[int]]) -> None:
        """Row b's tree columns cols[b] (its accepted path, in order, after every column it keeps) become kept text;
        the round's other tree columns stay masked holes, and settle() packs them as keep() does."""
        at = [(b, c) for b, cs in enumerate(cols) for c in cs]
        if at:
            rows, columns = zip(*at)
            self.valid[list(rows), list(columns)] = True
            self.length = self.length + torch.tensor([len(cs) for cs in cols])
        self.settle()

    def room(self, columns: int) -> int:
        """Make room for `columns` more columns: a model whose cache width is bounded (self.max_width) packs its rows
        when the width would pass it -> the columns it can take now (a large number where nothing bounds it)."""
        if self.max_width is None or not self.width:
            return 1 << 30
        if self.width + columns > self.max_width and self.width > int(self.length.max()):
            self.compact()
        return self.max_width - self.width

    def _padded(self, chunks: list[list[int]], m: int) -> torch.Tensor:
        """(B, m) ids on the model's device: each chunk right-padded with its last token (filler, masked at once)."""
        return torch.tensor([c + [c[-1] if c else 0] * (m - len(c)) for c in chunks], device=self.device)

    def _capped(self, pos: torch.Tensor) -> torch.Tensor:
        """A feed's positions, none past the model's last: filler (a stopped row's columns, a short chunk's padding)
        is discarded, so any position serves it, and a row at the context's end must not index past the last one."""
        return pos if self.limit is None else pos.clamp_max(self.limit - 1)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, **kwargs):
        """(B, m) ids at (B, m) positions, appended after the cache's columns, under the (B, width + m) mask -> the
        float32 logits and the hidden states (None unless hidden) of the positions the output layer ran on."""
        mask = mask.to(self.device) if mask.dim() == 4 else mask.long().to(self.device)  # 4-D: a tree's, as is
        out = forward(self.model, ids, self.cache, hidden=self.hidden, attention_mask=mask,
                      position_ids=pos.to(self.device), **kwargs)
        out, state = out if self.hidden else (out, None)
        self.calls.append((self.name, ids.shape[1]))
        buffers = getattr(self.cache.layers[0], "buffers", None) if self.cache.layers else None
        sized = (buffers[0].data_ptr(), buffers[0].shape) if buffers else None
        if sized != self._sized:  # a forward grew the buffers, or a move or select replaced them
            self.peak_bytes, self._sized = max(self.peak_bytes, self.bytes()), sized
        return self.pair.logits(out.logits), state

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An empty cache reads B prompts (any lengths >= 1) -> (B, V) float32 logits and (B, H) hidden states (None
        unless hidden) after each prompt's last token. The prompts are left-padded behind the mask, so every row ends
        at the last column: the output layer runs on that column alone (logits_to_keep)."""
        if self.width:
            raise ValueError(f"prefill() reads prompts into an empty cache; this {self.name} cache holds {self.width}")
        sizes = torch.tensor([len(p) for p in prompts])
        m = int(sizes.max())
        pad = m - sizes
        ids = torch.tensor([[p[0]] * (m - len(p)) + p for p in prompts], device=self.device)
        valid = torch.arange(m)[None, :] >= pad[:, None]
        logits, state = self._forward(ids, (torch.arange(m)[None, :] - pad[:, None]).clamp_min(0), valid,
                                      logits_to_keep=1)
        self.valid, self.length = valid, sizes
        return logits[:, -1], None if state is None else state[:, -1]

    def _layers(self):
        return [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None
                and layer.keys.numel() and getattr(layer, "buffers", None) is not None]

    def bytes(self) -> int:
        """Bytes the key and value buffers hold (with their spare room, and the buffers kept for the next move)."""
        return sum(b.untyped_storage().nbytes() for layer in self._layers()  # a compacted batch's buffers are
                   for b in (*layer.buffers, *getattr(layer, "spare", ())))  # views of rows of the storage it had

    def keep(self, lengths: torch.Tensor) -> None:
        """Cut row b back to its first lengths[b] tokens (at most what it holds): the columns it drops are masked,
        columns no row holds are cut from the end, and settle() packs the rows if the holes call for it."""
        if bool((lengths > self.length).any()):
            raise ValueError(f"a row cannot keep more tokens than its cache holds: {lengths.tolist()} of "
                             f"{self.length.tolist()}")
        if bool((lengths < self.length).any()):
            self.valid = self.valid & (self.valid.cumsum(1) <= lengths[:, None])
            self.length = lengths.clone()
        self.settle()

    def settle(self) -> None:
        """Cut the columns past every row's last token (shorter views, no copy); then compact() if a windowed model
        holds a hole, or if padding and holes make the cache wider than its longest row by more than SLACK."""
        used = self.valid.any(0).nonzero()
        end = int(used[-1]) + 1 if len(used) else 0
        if end < self.width:
            self.valid = self.valid[:, :end]
            for layer in self._layers():
                layer.keys, layer.values = layer.keys[:, :, :end], layer.values[:, :, :end]
        longest = int(self.length.max()) if len(self.length) else 0
        waste = self.width - longest
        if self.holes:
            if waste > max(8, SLACK * longest):
                self.compact()
        elif 2 * waste >= self.width > 0 or not bool((self.valid.flip(1).cumprod(1).sum(1) == self.length).all()):
            self.compact()  # padding half the width, or a hole: some row's text is not its last columns

    def compact(self) -> None:
        """Pack every row's text into the last columns, in order, and drop the columns that are padding in every row."""
        width, longest = self.width, int(self.length.max())
        key = torch.where(self.valid, torch.arange(width)[None, :], -1)
        cols = key.sort(1).values[:, width - longest:].clamp_min(0)  # each row's columns, left-padded with column 0
        self._move(cols)
        self.valid = torch.arange(longest)[None, :] >= (longest - self.length)[:, None]

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
        self.valid, self.length = self.valid.index_select(0, rows), self.length.index_select(0, rows)
        if m:
            self.settle()


def compaction(n: int, gone: list[int]) -> list[int]:
    """Rows 0..n-1 of a batch, those in `gone` leaving -> the order of the rows that stay that moves the fewest:
    rows below the new size stay in place, and each place a leaving row frees there takes a row from the tail
    (RowCache.select then copies those rows alone, where a full reorder copies every row, which at a few hundred
    rows costs a noticeable share of a second a move)."""
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
