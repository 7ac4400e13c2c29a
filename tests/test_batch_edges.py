"""Batched decoding at its edges: rows that fill the context beside short ones, caches whose width a model bounds,
top-p rows whose law truncates to one token, and bad requests refused in one line naming the row."""

import dataclasses
from pathlib import Path

import pytest

from decode.batch import BatchAutoregressive, BatchDecoder
from decode.engine import Autoregressive, SpeculativeDecoder
from decode.pair import load_pair
from decode.policies import FixedK
from decode.rules.chain import GreedyMatch, SpeculativeSampling
from decode.tree.shapes import ConfidenceTree, SequoiaTree, StaticTree
from tests.test_archs import MATRIX, TEXTS, arch_pairs, no_eos  # noqa: F401, F811  (arch_pairs is a fixture)
from tests.test_batch import assert_rows_equal

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pycode():
    return load_pair(ROOT / "configs/pairs/pycode.yaml")


def full_beside_short(pair, new: int, short: int = 6) -> list[list[int]]:
    """One prompt whose length + new fills the pair's context exactly, after `short` prompts of 1-20 tokens."""
    text = "".join(TEXTS) * 40
    long = pair.encode(text)[: pair.config.max_context - new]
    assert len(long) + new == pair.config.max_context
    return [pair.encode(TEXTS[i % len(TEXTS)])[: 1 + 3 * i] for i in range(short)] + [long]


@pytest.mark.parametrize("family,dtype", MATRIX)
def test_a_row_that_fills_the_context_beside_short_rows_decodes_as_the_target_alone(arch_pairs, family, dtype):
    """Filler columns of a row near the context's end never take a position past the model's last (absolute
    positions), and the cache never grows wider than a model's causal buffer (GPT-Neo), at every family."""
    pair = no_eos(arch_pairs(family, dtype)[1])
    prompts = full_beside_short(pair, 20)
    want = BatchAutoregressive(pair).generate(prompts, 20)
    for policy in (FixedK(4), FixedK(1)):
        got = BatchDecoder(pair, policy, GreedyMatch()).generate(prompts, 20)
        assert_rows_equal(pair, prompts, got, want, (family, dtype, policy.max_len))


def test_the_embedded_pair_decodes_a_full_context_row_at_every_offset(pycode):
    """Issue #54's case: 452 + 60 = 512 tokens beside six short prompts, FixedK(6), at offsets that had crashed."""
    pair = dataclasses.replace(pycode.with_sampling(temperature=0.0), eos_ids=(-1,))
    for offset in range(0, 40, 5):
        prompts = full_beside_short(pair, 60 - offset)
        got = BatchDecoder(pair, FixedK(6), GreedyMatch()).generate(prompts, 60 - offset)
        assert [len(g.tokens) for g in got] == [60 - offset] * 7


def test_gpt_neo_rows_left_behind_by_the_longest_stay_within_its_causal_buffer(arch_pairs):
    """Issue #54's GPT-Neo case: the longest rows leave, the one left keeps their padding; the width must not pass
    the model's max_position_embeddings (128)."""
    pair = no_eos(arch_pairs("gpt-neo", "float32")[1])
    text = "".join(TEXTS) * 20
    prompts = [pair.encode(text)[:n] for n in (97, 1, 30, 60, 90, 5, 97, 40)]
    want = BatchAutoregressive(pair).generate(prompts, 30)
    got = BatchDecoder(pair, FixedK(1), GreedyMatch()).generate(prompts, 30)
    assert_rows_equal(pair, prompts, got, want, "gpt-neo")


@pytest.mark.parametrize("temperature,top_p,k", [(0.7, 0.95, 4), (1.0, 0.5, 3)])
def test_a_top_p_row_in_a_batch_draws_what_it_draws_alone(pycode, temperature, top_p, k):
    """A row whose truncated law is one-hot draws its uniforms all the same, so its tokens never depend on whether
    its neighbours' laws are one-hot too."""
    pair = dataclasses.replace(pycode.with_sampling(temperature=temperature, top_p=top_p), eos_ids=(-1,))
    prompts = [pair.encode(t) for t in ("def f(x):\n    return", "import os\n", "class A:\n    def __init__(self",
                                        "for i in range(10):\n", "x = [", "    if not self.")]
    batch = BatchDecoder(pair, FixedK(k), SpeculativeSampling(), seed=11).generate(prompts, 50)
    for i, ids in enumerate(prompts):
        alone = BatchDecoder(pair, FixedK(k), SpeculativeSampling(), seed=11 + i).generate([ids], 50)[0]
        assert alone.tokens == batch[i].tokens, i
    assert SpeculativeDecoder(pair, FixedK(k), SpeculativeSampling(), seed=11).generate(prompts[0], 50).tokens == \
        batch[0].tokens


@pytest.mark.parametrize("cls", [BatchDecoder, BatchAutoregressive])
def test_bad_batch_requests_are_refused_in_one_line_naming_the_row(pycode, cls):
    greedy = pycode.with_sampling(temperature=0.0)
    dec = cls(greedy, FixedK(2), GreedyMatch()) if cls is BatchDecoder else cls(greedy)
    good = pycode.encode("def f(x):")
    assert dec.generate([]) == []
    assert [g.tokens for g in dec.generate([good, good], max_new_tokens=0)] == [[], []]
    cases = [([good, good + [10_000_000]], 8, r"prompt 1 of the batch: token id 10000000 is outside the pair's "
                                              r"vocabulary of 4096 ids"),
             ([good, [-1] + good], 8, r"prompt 1 of the batch: token id -1"),
             ([good], -3, r"max_new_tokens=-3: give a whole number"),
             ([good, good, []], 8, r"prompt 2 of the batch: the prompt is empty"),
             ([good, good * 200], 8, r"prompt 1 of the batch: prompt of \d+ tokens"),
             (good, 8, r"prompts must be a list of token-id lists")]
    for prompts, n, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            dec.generate(prompts, max_new_tokens=n)
        assert "\n" not in str(info.value)


def test_the_one_sequence_decoder_refuses_the_same_inputs(pycode):
    dec = SpeculativeDecoder(pycode.with_sampling(temperature=0.0), FixedK(2), GreedyMatch())
    with pytest.raises(ValueError, match="token id 4096 is outside"):
        dec.generate([1, 2, 4096], 4)
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        dec.generate([1, 2], -1)
    assert dec.generate([1, 2], 0).tokens == []


@pytest.mark.parametrize("policy", [FixedK(3), ConfidenceTree(top_k=3, depth=4, nodes=64)], ids=["chain", "tree"])
def test_a_sampled_row_beside_a_row_at_the_contexts_end_draws_what_it_draws_alone(pycode, policy):
    """A neighbour near max_context caps nothing on a model without a causal buffer (GPT-2 builds its masks per
    forward): row 0 drafts and draws as it does alone."""
    pair = pycode.with_sampling(temperature=1.0)
    p0, long = pair.encode("def add(a, b):\n    return"), (pair.encode("import os\n") * 200)[:505]
    for seed in (11, 12):
        batch = BatchDecoder(pair, policy, SpeculativeSampling(), seed=seed).generate([p0, long], 7)
        alone = BatchDecoder(pair, policy, SpeculativeSampling(), seed=seed).generate([p0], 7)
        assert batch[0].tokens == alone[0].tokens


def test_prompts_of_any_plausible_type_work_or_are_refused_in_one_line(pycode):
    import numpy as np
    import torch

    dec, ids = BatchDecoder(pycode.with_sampling(temperature=0.0), FixedK(2), GreedyMatch()), pycode.encode("def f(x):")
    want = [g.tokens for g in dec.generate([ids, ids], 4)]
    for form in (np.array([ids, ids]), torch.tensor([ids, ids]), [np.array(ids), torch.tensor(ids)], ((*ids,), ids)):
        assert [g.tokens for g in dec.generate(form, 4)] == want
    for bad, message in ((["def f():"], "prompt 0 of the batch: a prompt is a list of token ids, got str"),
                         ([ids, None], "prompt 1 of the batch: a prompt is a list of token ids, got NoneType"),
                         ([[ids]], "prompt 0 of the batch: token ids are integers"),
                         ([[1.0, 2.0]], "prompt 0 of the batch: token ids are integers, got 1.0"),
                         (np.array(ids), "prompts must be a list of token-id lists"),
                         (torch.tensor(ids), "prompts must be a list of token-id lists")):
        with pytest.raises(ValueError, match=message):
            dec.generate(bad, 4)
    with pytest.raises(ValueError, match="max_new_tokens=True"):
        dec.generate([ids], True)
    one = SpeculativeDecoder(pycode.with_sampling(temperature=0.0), FixedK(2), GreedyMatch())
    assert one.generate(torch.tensor(ids), 3).tokens == one.generate(ids, 3).tokens


def test_a_fixed_k_or_a_seed_that_is_no_whole_number_is_refused_in_one_line(pycode):
    import numpy as np

    for k in ("3", 2.5, True, 0, 65):
        with pytest.raises(ValueError, match=rf"^FixedK's k is a whole number in 1..64 .*got {k!r}$"):
            FixedK(k)
    assert FixedK(np.int64(3)).k == 3 and type(FixedK(np.int64(3)).k) is int
    greedy = pycode.with_sampling(temperature=0.0)
    for seed in (None, "a", 1.5, True):
        for make in (lambda s: SpeculativeDecoder(greedy, FixedK(2), GreedyMatch(), seed=s),
                     lambda s: BatchDecoder(greedy, FixedK(2), GreedyMatch(), seed=s),
                     lambda s: BatchAutoregressive(greedy, seed=s), lambda s: Autoregressive(greedy, seed=s)):
            with pytest.raises(ValueError, match=rf"^a seed is a whole number, got {seed!r}$"):
                make(seed)
    sampled, ids = pycode.with_sampling(temperature=1.0), pycode.encode("def f(x):")
    assert SpeculativeDecoder(sampled, FixedK(2), SpeculativeSampling(), seed=np.int64(3)).generate(ids, 8).tokens == \
        SpeculativeDecoder(sampled, FixedK(2), SpeculativeSampling(), seed=3).generate(ids, 8).tokens


def test_tree_shapes_refuse_bad_sizes_in_one_line():
    for make, message in ((lambda: StaticTree([0, 1]), "StaticTree's paths are a list of rank paths"),
                          (lambda: StaticTree([[-1]]), "StaticTree's paths are a list of rank paths"),
                          (lambda: SequoiaTree(0.7), "SequoiaTree's accept is the positional acceptance vector"),
                          (lambda: SequoiaTree([0.5, 0.0]), "each in \\(0, 1\\]"),
                          (lambda: SequoiaTree([0.5], depth=0), "SequoiaTree needs depth to be a whole number"),
                          (lambda: ConfidenceTree(top_k=2.5), "ConfidenceTree needs top_k to be a whole number")):
        with pytest.raises(ValueError, match=message):
            make()


def test_a_greedy_tree_wider_than_the_vocabulary_proposes_every_token_once(arch_pairs):
    pair = no_eos(arch_pairs("llama", "float32")[1])
    prompts = [pair.encode(t) for t in TEXTS[:3]]
    want = BatchAutoregressive(pair).generate(prompts, 8)
    got = BatchDecoder(pair, ConfidenceTree(top_k=pair.vocab + 5, depth=2, nodes=64), GreedyMatch()).generate(prompts, 8)
    assert [g.tokens for g in got] == [w.tokens for w in want]
