"""Batched speculative decoding (decode.batch): every row equals the target alone decoding the same batch, token for
token, for every family in float32 and bfloat16 with ragged prompts; a row's output does not depend on its
neighbours; sampled rows keep the target's law."""

import dataclasses

import pytest
import torch

from decode.batch import BatchAutoregressive, BatchDecoder
from decode.engine import SpeculativeDecoder
from decode.policies import DraftConfidence, FixedK
from decode.rules import GreedyMatch, SpeculativeSampling
from tests.test_archs import MATRIX, TEXTS, arch_pairs, no_eos  # noqa: F401  (arch_pairs is a fixture)
from tests.test_decode import ALPHA, two_token_pvalue


def ragged(pair, b: int) -> list[list[int]]:
    """b prompts of different lengths (the texts, cut at different points, repeated)."""
    ids = [pair.encode(TEXTS[i % len(TEXTS)]) for i in range(b)]
    return [x[: max(2, len(x) - (i % 5))] for i, x in enumerate(ids)]


def top2_margin(pair, prompt, tokens, at: int) -> float:
    """The target's top-2 logit gap where a row first differs: a near-tie that padding's rounding may flip."""
    with torch.no_grad():
        logits = pair.target(torch.tensor([prompt + tokens[:at]])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_rows_equal(pair, prompts, got, want, tag):
    for i, (g, w) in enumerate(zip(got, want)):
        if g.tokens != w.tokens:
            at = next(j for j, (a, b) in enumerate(zip(g.tokens, w.tokens)) if a != b)
            margin = top2_margin(pair, prompts[i], w.tokens, at)
            assert pair.target.dtype != torch.float32 and margin < 0.02 * abs(margin) + 0.1, \
                (tag, i, at, margin, g.tokens, w.tokens)


@pytest.mark.parametrize("family,dtype", MATRIX)
def test_batched_greedy_rows_equal_the_target_alone_on_the_same_batch(arch_pairs, family, dtype):
    pair = no_eos(arch_pairs(family, dtype)[1])
    for b, policy, rule in ((3, DraftConfidence(0.3), GreedyMatch()), (8, FixedK(3), SpeculativeSampling())):
        prompts = ragged(pair, b)
        want = BatchAutoregressive(pair).generate(prompts, 16)
        got = BatchDecoder(pair, policy, rule).generate(prompts, 16)
        assert_rows_equal(pair, prompts, got, want, (family, dtype, b, type(policy).__name__))


def test_batch_of_32_with_eos_and_a_budget_per_row(arch_pairs):
    """Rows end on their own EOS or budget and leave the batch; the rest go on unchanged."""
    pair = arch_pairs("mistral", "float32")[1]
    prompts = ragged(pair, 32)
    want = BatchAutoregressive(pair).generate(prompts, 24)
    got = BatchDecoder(pair, FixedK(4), SpeculativeSampling()).generate(prompts, 24)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    ends = [g.tokens[-1] in pair.eos_ids for g in got]
    assert any(ends) or all(len(g.tokens) == 24 for g in got)


def test_a_row_alone_and_inside_a_batch_of_32_gives_the_same_tokens(arch_pairs):
    pair = no_eos(arch_pairs("llama", "float32")[1])
    prompts = ragged(pair, 32)
    batch = BatchDecoder(pair, FixedK(3), SpeculativeSampling()).generate(prompts, 16)
    for i in (0, 7, 31):
        alone = BatchDecoder(pair, FixedK(3), SpeculativeSampling()).generate([prompts[i]], 16)[0]
        assert alone.tokens == batch[i].tokens
        assert SpeculativeDecoder(pair, FixedK(3), SpeculativeSampling()).generate(prompts[i], 16).tokens == alone.tokens


class Rows:
    """decoder.generate(prompt, n) for two_token_pvalue, served from batches of 8 ragged rows in which the first four
    rows decode `prompt`: each batch a new seed (rows draw from streams seed + row)."""

    def __init__(self, pair, others):
        self.pair, self.others, self.buffer, self.seed = pair, others, [], 0

    def generate(self, prompt, n):
        if not self.buffer:
            self.seed += 8
            dec = BatchDecoder(self.pair, FixedK(2), SpeculativeSampling(), seed=self.seed)
            self.buffer = dec.generate([prompt] * 4 + self.others, n)[:4]
        return self.buffer.pop()


@pytest.mark.slow
def test_sampled_rows_of_a_batch_of_8_keep_the_targets_law(tiny_pair):
    pair = dataclasses.replace(tiny_pair.with_sampling(temperature=1.0), eos_ids=(-1,))
    prompt = [3, 7]
    with torch.no_grad():
        p1 = pair.logits(pair.target(torch.tensor([prompt])).logits[0, -1]).softmax(-1)
        nxt = pair.logits(pair.target(torch.tensor([prompt + [a] for a in range(pair.vocab)])).logits[:, -1]).softmax(-1)
    law = p1[:, None] * nxt
    others = [[5, 1, 2, 9, 4], [8], [2, 2, 2], [11, 3, 6, 1, 1, 7]]
    assert two_token_pvalue(Rows(pair, others), law, prompt, n=1500) > ALPHA


def test_a_sampled_row_draws_from_its_own_stream_whatever_its_neighbours(arch_pairs):
    """Row i of a request draws from seed + i: alone with that seed it gives the same tokens (float32), so what a row
    emits never depends on the rows beside it."""
    pair = no_eos(arch_pairs("llama", "float32")[1]).with_sampling(temperature=1.0)
    prompts = ragged(pair, 8)
    batch = BatchDecoder(pair, FixedK(3), SpeculativeSampling(), seed=5).generate(prompts, 16)
    for i in (0, 3, 7):
        alone = BatchDecoder(pair, FixedK(3), SpeculativeSampling(), seed=5 + i).generate([prompts[i]], 16)[0]
        assert alone.tokens == batch[i].tokens
    assert SpeculativeDecoder(pair, FixedK(3), SpeculativeSampling(), seed=5).generate(prompts[0], 16).tokens == \
        batch[0].tokens  # and row 0 is the one-sequence engine's draw for draw
