import torch

from decode.cache.kv import GrowingLayer, crop_cache, forward, new_cache
from tests.tiny import tiny_model


@torch.no_grad()
def test_growing_cache_equals_a_fresh_pass_through_feeds_crops_and_growth():
    model = tiny_model(vocab=40, layers=2, width=16, seed=0)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 40, (1, 60), generator=g)
    cache = new_cache()
    forward(model, seq[:, :5], cache)
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers) and cache.get_seq_length() == 5
    start = cache.layers[0].buffers[0].data_ptr()
    length = 5
    for n, back in ((3, 2), (4, 0), (1, 1), (30, 10), (2, 0)):  # feed n, then crop `back` of them away
        out = forward(model, seq[:, length : length + n], cache)
        fresh = model(seq[:, : length + n]).logits[:, -n:]
        assert torch.allclose(out.logits, fresh, atol=1e-5)
        if length + n <= 10:  # within the first buffer (room for 2 x 5): written in place, never copied
            assert cache.layers[0].buffers[0].data_ptr() == start
        length += n - back
        crop_cache(cache, length)
        assert cache.get_seq_length() == length
    assert cache.layers[0].buffers[0].data_ptr() != start  # it grew once the 30 tokens came
    ref = model(seq[:, :length], use_cache=True).past_key_values
    for layer, r in zip(cache.layers, ref.layers):
        assert layer.keys.shape == r.keys.shape and torch.allclose(layer.keys, r.keys, atol=1e-5)
        assert torch.allclose(layer.values, r.values, atol=1e-5)


@torch.no_grad()
def test_growing_cache_follows_a_batch_reorder():
    model = tiny_model(vocab=40, layers=1, width=16, seed=1)
    seq = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(1))
    cache = new_cache()
    forward(model, seq[:, :6], cache)
    cache.layers[0].batch_select_indices(torch.tensor([2, 0]))  # no longer a view of its buffer
    out = forward(model, seq[[2, 0], 6:8], cache)
    assert torch.allclose(out.logits, model(seq[[2, 0], :8]).logits[:, -2:], atol=1e-5)


@torch.no_grad()
def test_reserved_cache_holds_prompt_and_new_tokens_in_one_buffer():
    model = tiny_model(vocab=40, layers=1, width=16, seed=2)
    seq = torch.randint(0, 40, (2, 30), generator=torch.Generator().manual_seed(2))
    cache = new_cache(reserve=30)
    forward(model, seq[:, :20], cache)
    first = cache.layers[0].buffers[0]
    assert first.shape[-2] == 30  # not twice the prompt
    for i in range(20, 30):
        out = forward(model, seq[:, i : i + 1], cache)
    assert cache.layers[0].buffers[0].data_ptr() == first.data_ptr()  # never grown
    assert torch.allclose(out.logits[:, -1], model(seq).logits[:, -1], atol=1e-5)
