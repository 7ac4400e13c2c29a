import math

import pytest
import torch

from decode import labels as L
from decode.pair import Sampling
from decode.sampling import argmax, pick, sample, transform


def rand_dist(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).mul(2).softmax(-1)


def test_hand_computed_values():
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.25, 0.25, 0.5])
    assert math.isclose(L.tv(p, q).item(), 0.5, abs_tol=1e-6)
    assert math.isclose(L.expected_acceptance(p, q).item(), 0.5, abs_tol=1e-6)
    assert math.isclose(L.kl(p, q).item(), math.log(2), abs_tol=1e-6)  # 0.5 ln2 + 0.5 ln2
    assert L.kl(q, p).item() == math.inf  # q puts mass where p has none
    m = torch.tensor([0.375, 0.375, 0.25])
    js = 0.5 * (p * (p / m).log()).nansum() + 0.5 * (q * (q / m).log()).sum()
    assert math.isclose(L.js(p, q).item(), js.item(), abs_tol=1e-6)
    assert math.isclose(L.entropy(p).item(), math.log(2), abs_tol=1e-6)
    assert torch.allclose(L.residual(p, q), torch.tensor([0.5, 0.5, 0.0]))
    assert torch.allclose(L.accept_prob(torch.tensor([0.1, 0.6]), torch.tensor([0.2, 0.3])), torch.tensor([0.5, 1.0]))
    assert torch.allclose(L.sprinter_ratio(torch.tensor([0.1, 0.0]), torch.tensor([0.2, 0.3])),
                          torch.tensor([2.0, math.inf]))


def test_identical_distributions():
    p = rand_dist(4, 7, 50)
    assert torch.allclose(L.accept_prob(p[..., 0], p[..., 0]), torch.ones(4, 7))
    for name in ("kl", "kl_qp", "js", "tv"):
        assert L.divergence(name, p, p).abs().max() < 1e-5
    assert torch.allclose(L.expected_acceptance(p, p), torch.ones(4, 7), atol=1e-5)
    assert torch.allclose(L.residual(p, p), p)


def test_bounds_on_random_and_disjoint_distributions():
    p, q = rand_dist(100, 30, seed=1), rand_dist(100, 30, seed=2)
    assert (L.js(p, q) <= L.LN2 + 1e-7).all() and (L.js(p, q) >= 0).all()
    assert ((L.tv(p, q) >= 0) & (L.tv(p, q) <= 1)).all()
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])  # disjoint supports
    assert math.isclose(L.js(a, b).item(), math.log(2), abs_tol=1e-6)
    assert L.tv(a, b).item() == 1.0
    assert not torch.isnan(L.kl(a, b)) and L.kl(a, b).item() == math.inf
    assert (L.accept_prob(torch.tensor([0.0]), torch.tensor([0.0])) == 1).all()  # never NaN


def test_js_tv_alpha_relation():
    p, q = rand_dist(200, 20, seed=3), rand_dist(200, 20, seed=4)
    # E_{x~q}[min(1, p/q)] == sum min(p, q) == 1 - TV
    alpha_mean = (q * L.accept_prob(p, q)).sum(-1)
    assert torch.allclose(alpha_mean, L.expected_acceptance(p, q), atol=1e-5)
    assert torch.allclose(1 - L.tv(p, q), L.expected_acceptance(p, q), atol=1e-5)


def test_masked_mean_ignores_masked_positions():
    x = torch.tensor([1.0, 3.0, math.inf, float("nan")])
    mask = torch.tensor([True, True, False, False])
    assert L.masked_mean(x, mask).item() == 2.0


def test_labels_thresholds():
    ratio = torch.tensor([0.5, 1.0, 1.2, 1.3, math.inf])
    assert L.sprinter_label(ratio, 1.2).tolist() == [1, 1, 1, 0, 0]
    assert L.fsd_label(torch.tensor([0.0, 0.1, 0.2]), 0.1).tolist() == [1, 1, 0]


def test_position_stats_shapes():
    p, q = rand_dist(2, 5, 11, seed=5), rand_dist(2, 5, 11, seed=6)
    cand = sample(q, torch.Generator().manual_seed(0))
    stats = L.position_stats(p, q, cand)
    for v in stats.values():
        assert v.shape == (2, 5)
    assert torch.allclose(stats["q_cand"], q.gather(-1, cand[..., None])[..., 0])


def test_sample_draws_each_token_with_its_probability_and_never_a_zero():
    from scipy.stats import chisquare

    law = torch.tensor([0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0])  # zeros first, inside and last
    n = 20000
    draws = sample(law.expand(n, -1), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=law.numel()).double()
    assert draws.shape == (n,) and (counts[law == 0] == 0).all()
    assert chisquare(counts[law > 0].numpy(), (n * law[law > 0]).double().numpy()).pvalue > 1e-3
    # unnormalised weights, and rows whose whole mass is on the first or the last token
    edge = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]]).repeat(50, 1)
    assert sample(edge, torch.Generator().manual_seed(1)).tolist() == [0, 2] * 50
    again = sample(law.expand(n, -1), torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)  # one generator, one sequence of draws


def test_sampling_transform():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    greedy = transform(logits, Sampling(temperature=0))
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    top2 = transform(logits, Sampling(top_k=2))
    assert (top2[0, 2:] == 0).all() and math.isclose(top2.sum().item(), 1.0, abs_tol=1e-6)
    # top-p: first token has mass ~0.64 < 0.7, so the second is kept, the rest dropped
    nucleus = transform(logits, Sampling(top_p=0.7))
    assert (nucleus[0, :2] > 0).all() and (nucleus[0, 2:] == 0).all()
    hot = transform(logits, Sampling(temperature=0.5))
    assert hot[0, 0] > transform(logits, Sampling())[0, 0]
    assert torch.equal(hot, (logits / 0.5).softmax(-1))
    wide = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(transform(wide, Sampling()), (wide / 1.0).softmax(-1))  # T = 1 skips the division exactly


def test_argmax_and_pick_give_what_torch_and_transform_give():
    g = torch.Generator().manual_seed(3)
    ties = torch.randint(0, 4, (64, 50), generator=g).float()  # many rows with several maxima: the first wins
    for x in (ties, ties[0], ties.view(4, 16, 50), ties.to(torch.bfloat16), ties.t()):  # also not contiguous
        assert torch.equal(argmax(x), x.argmax(-1))
    assert L.one_hot(transform(ties, Sampling(temperature=0))) and not L.one_hot(transform(ties, Sampling()))
    for s in (Sampling(temperature=0), Sampling(), Sampling(temperature=0.7, top_p=0.9)):
        for row in ties[:8]:
            tok, q = pick(row, s, torch.Generator().manual_seed(1))
            ref = transform(row, s)
            expect = int(row.argmax()) if s.temperature == 0 else int(sample(ref, torch.Generator().manual_seed(1)))
            assert tok == expect and q.dtype == ref.dtype and torch.equal(q, ref)


def test_nucleus_keeps_the_sorted_prefix_whose_preceding_mass_is_below_top_p():
    g = torch.Generator().manual_seed(5)
    for scale, top_p in ((0.5, 0.9), (3.0, 0.95), (6.0, 0.5), (2.0, 0.999)):
        logits = torch.randn(64, 300, generator=g) * scale
        kept = transform(logits, Sampling(top_p=top_p)) > 0
        probs = logits.softmax(-1)
        sorted_p, order = probs.sort(-1, descending=True)  # the definition, token by token
        ref = torch.zeros_like(kept).scatter(-1, order, (sorted_p.cumsum(-1) - sorted_p) < top_p)
        assert torch.equal(kept, ref)
        mass = (probs * kept).sum(-1)
        assert (mass >= top_p - 1e-5).all()  # the kept set reaches top_p, and is the smallest one that does:
        assert ((mass - (probs * kept).masked_fill(~kept, 2).min(-1).values) < top_p + 1e-5).all()


@pytest.mark.parametrize("chunk", [1 << 16, 150, 1])  # one chunk; 3 positions per chunk; one position per chunk
def test_one_pass_position_stats_equal_the_separate_functions(chunk, monkeypatch):
    monkeypatch.setattr(L, "CHUNK", chunk)
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, 7, 50, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(4, 7, 50, generator=g) * 3, -1)
    q[0, 0, :25] = 0  # q = 0 where p > 0: KL(p || q) is infinite
    q[0, 0] /= q[0, 0].sum()
    cand = torch.randint(0, 50, (4, 7), generator=g)
    st = L.position_stats(p, q, cand)
    for name, ref in (("kl", L.kl(p, q)), ("kl_qp", L.kl(q, p)), ("js", L.js(p, q)), ("tv", L.tv(p, q)),
                      ("expected_accept", L.expected_acceptance(p, q)), ("target_entropy", L.entropy(p)),
                      ("draft_entropy", L.entropy(q))):
        assert torch.allclose(st[name], ref, atol=1e-5, equal_nan=False), name
    assert st["kl"][0, 0] == float("inf")
    q_raw = torch.softmax(torch.randn(4, 7, 50, generator=g), -1)
    st = L.position_stats(p, q, cand, q_raw)
    assert torch.allclose(st["draft_entropy"], L.entropy(q_raw)) and st["q_cand"].shape == (4, 7)
    assert torch.equal(st["q_cand"], q_raw.gather(-1, cand[..., None])[..., 0])


def test_the_rfsd_label_is_the_chance_the_relaxed_rule_accepts():
    """RelaxedDivergence's target is the acceptance chance decode.rules.FSD(relaxed=True) acts on: counted over draws
    of the rule's coin at fixed p and q, acceptance of the first candidate matches it, for a close and a far pair."""
    from decode.rules.chain import FSD
    from train.labels import RelaxedDivergence

    torch.manual_seed(0)
    for scale in (0.2, 3.0):  # JS below and above T = 0.1
        p = torch.softmax(torch.randn(2, 6), -1)
        q = torch.softmax(torch.log(p[:1]) + scale * torch.randn(1, 6), -1)
        x = int(torch.argmax(q[0]))
        cols = {"js": L.js(p[:1], q), "alpha": L.accept_prob(p[0, x], q[0, x]).reshape(1)}
        want = float(RelaxedDivergence("js", 0.1).target(cols))
        assert want >= float(cols["alpha"]) and (want == 1.0) == bool(cols["js"] <= 0.1)
        from decode.streams import Streams

        rule, gen = FSD("js", 0.1, relaxed=True), Streams([1])
        got = sum(rule.verify(torch.tensor([x]), q, p, gen)[0] for _ in range(4000)) / 4000
        assert abs(got - want) < 0.03, (scale, got, want)


def test_rfsd_at_threshold_zero_is_the_lossless_test_even_where_the_divergence_rounds_to_zero():
    div, alpha = torch.tensor([0.0, 0.0, 0.3]), torch.tensor([0.5, 1.0, 0.2])
    assert L.rfsd_accept_prob(div, alpha, 0.0).tolist() == pytest.approx([0.5, 1.0, 0.2])
    assert L.rfsd_accept_prob(div, alpha, 0.1).tolist() == pytest.approx([1.0, 1.0, 0.2])


def test_fsd_reads_the_divergence_only_where_it_decides_and_decides_as_over_the_whole_block():
    """FSD.verify computes a divergence only at the positions it reaches (rFSD: only where the lossless test rejects);
    its decisions and tokens equal those of the whole block's divergences read up front, coin for coin."""
    from decode.rules.chain import FSD, coins, draw
    from decode.streams import Streams

    def whole_block(rule, tokens, q, p, gen):
        k = len(tokens)
        us = coins(gen, k)
        div = L.divergence(rule.divergence, p[:k], q)
        for i, x in enumerate(tokens.tolist()):
            if rule.relaxed:
                if us[i] < float(L.rfsd_accept_prob(div[i], L.accept_prob(p[i, x], q[i, x]), rule.threshold)):
                    continue
                return i, draw(L.residual(p[i], q[i]), us[k])
            if div[i] <= rule.threshold:
                continue
            return i, draw(p[i], us[k])
        return k, draw(p[k], us[k])

    g = torch.Generator().manual_seed(3)
    for trial in range(300):
        k, v = 1 + trial % 4, 7
        p = torch.softmax(torch.randn(k + 1, v, generator=g) * 2, -1)
        q = torch.softmax(torch.log(p[:k]) + torch.randn(k, v, generator=g) * (0.1 + trial % 3), -1)
        tokens = torch.multinomial(q, 1, generator=g)[:, 0]
        for rule in (FSD("js", 0.05), FSD("tv", 0.2, relaxed=True), FSD("kl", 0.0, relaxed=True)):
            assert rule.verify(tokens, q, p, Streams([trial])) == whole_block(rule, tokens, q, p, Streams([trial]))
