"""The batch decoder's KV cache (decode.cache.rows): rolled-back rows read as fresh caches of their text, with holes
behind the mask and after compaction; windowed models stay contiguous; rows leaving move only what they must."""

import random

import pytest
import torch

from decode.cache import rows as rowcache
from decode.cache.rows import RowCache, compaction, windowed
from tests.test_archs import arch_pairs  # noqa: F401, F811  (a fixture)


def probe(cache: RowCache, pair, texts: list[list[int]], token: int = 5) -> None:
    """Each row's next-token logits after its text equal a fresh cache's of that text alone (then the probe is cut)."""
    got = cache.feed([[token]] * len(texts))[0][:, 0]
    for row, text in zip(got, texts):
        fresh = RowCache(cache.model, pair, 1, cache.name, [])
        assert torch.allclose(row, fresh.prefill([text + [token]])[0][0], atol=1e-4)
    cache.keep(cache.length - 1)


@pytest.mark.parametrize("family,holes", [("llama", True), ("gpt2", True), ("mistral", False), ("gpt-neo", False)])
def test_rolled_back_rows_read_as_fresh_caches_of_their_text(arch_pairs, family, holes, monkeypatch):
    """Rounds of ragged feeds (filler included) and ragged rollbacks, as speculative rounds do: every row reads as
    a fresh cache of the text it kept. Full attention leaves holes and compacts now and then, staying within SLACK
    of its longest row; a sliding window keeps every row's text in its last columns after every rollback."""
    pair = arch_pairs(family, "float32")[1]
    rng = random.Random(0)
    texts = [[1 + rng.randrange(20) for _ in range(2 + 3 * i)] for i in range(5)]
    cache = RowCache(pair.target, pair, 5, "target", [])
    assert cache.holes == holes == (not windowed(pair.target.config))
    packs = []
    monkeypatch.setattr(RowCache, "compact", lambda self, f=RowCache.compact: (packs.append(self.width), f(self))[1])
    cache.prefill(texts)
    saw_hole = False
    for _ in range(14):
        chunks = [[1 + rng.randrange(20) for _ in range(rng.randrange(1, 5))] for _ in texts]
        cache.feed(chunks, trim=False)
        kept = [rng.randrange(len(c) + 1) for c in chunks]
        for text, chunk, k in zip(texts, chunks, kept):
            text += chunk[:k]
        cache.keep(torch.tensor([len(t) for t in texts]))
        assert cache.length.tolist() == [len(t) for t in texts]
        contiguous = torch.equal(cache.valid, torch.arange(cache.width)[None, :] >= (cache.width - cache.length)[:, None])
        saw_hole |= not contiguous
        longest = max(map(len, texts))
        if holes:
            assert cache.width - longest <= max(8, rowcache.SLACK * longest)
        else:
            assert contiguous and 2 * (cache.width - longest) < cache.width
        probe(cache, pair, texts)
    assert saw_hole == holes and packs  # holes were read through, and packed at least once


def test_rows_leaving_move_only_the_rows_that_fill_their_places(tiny_pair):
    """compaction()'s order: rows below the new size stay, the tail fills the places that rows leaving free; the
    cache then copies those rows alone, into the same buffers, and every row goes on as a fresh cache of its text."""
    assert compaction(7, [1, 4, 6]) == [0, 5, 2, 3] and compaction(3, [2]) == [0, 1] and compaction(2, [0, 1]) == []
    texts = [[1 + (i * 5 + j) % 30 for j in range(3 + i)] for i in range(7)]
    cache = RowCache(tiny_pair.target, tiny_pair, 7, "target", [])
    cache.prefill(texts)
    cache.feed([[2 + i] for i in range(7)])
    order = compaction(7, [1, 4, 6])
    layer = cache._layers()[0]
    ptr, rows = layer.buffers[0].data_ptr(), layer.keys[order].clone()
    cache.select(torch.tensor(order))
    assert layer.buffers[0].data_ptr() == ptr and torch.equal(layer.keys, rows)  # in place, each row its own
    logits = cache.feed([[9] for _ in order])[0][:, 0]
    fresh = RowCache(tiny_pair.target, tiny_pair, 4, "target", [])
    want = fresh.prefill([texts[r] + [2 + r, 9] for r in order])[0]
    assert torch.allclose(logits, want, atol=1e-5)
    cache.select(torch.tensor([2, 0]))  # any other order: a full reorder, as correct
    assert torch.allclose(cache.feed([[3], [3]])[0][:, 0],
                          fresh.feed([[3]] * 4)[0][[2, 0], 0], atol=1e-5)
