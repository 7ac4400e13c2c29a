"""The compiled one-row paths (heads.kernels) compute what the numpy paths compute, which stay for batches and for
machines without numba; and the engine's greedy shortcuts decide as the general rule does."""

import numpy as np
import pytest
import torch

from decode.batch import BatchDecoder
from decode.control import BatchCostAware, RowsStep
from decode.engine import SpeculativeDecoder
from decode.policies import CostAwareStop, DraftStep, FixedK, SpecDecPP, draft_scalars
from decode.policies import base as P
from decode.rules.chain import SpeculativeSampling
from decode.streams import Streams
from heads import EXTRAS, AcceptanceHead, kernels, tree_kernels
from tests.test_decode import PROMPTS, export_head

pytest.importorskip("numba")


def logits_rows(seed: int = 0) -> np.ndarray:
    """(8, 500) float32 raw logits at several scales, two rows with masked (-inf) tokens."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((8, 500)).astype(np.float32) * np.array([0.1, 1, 3, 10, 30, 3, 3, 60], np.float32)[:, None]
    x[5, ::3] = -np.inf
    x[6, 1:] = -np.inf  # one token left
    return x


def test_softmax_scalars_of_one_row_and_of_rows_equal_the_reference_and_the_numpy_path(monkeypatch):
    x, tokens = logits_rows(), np.array([7, 1, 2, 3, 4, 0, 0, 9])
    p = torch.from_numpy(x).double().softmax(-1)
    want = np.stack([p[range(8), tokens].numpy(), -torch.where(p > 0, p * p.log(), 0).sum(-1).numpy(),
                     p.max(-1).values.numpy()])
    rows = kernels.softmax_scalars_rows(x, tokens)
    ones = np.array([kernels.softmax_scalars(x[r], int(tokens[r])) for r in range(8)]).T
    monkeypatch.setattr(kernels, "HAVE_NUMBA", False)
    numpy_path = np.array(draft_scalars(torch.from_numpy(x), tokens.tolist()))
    for got in (rows, ones, numpy_path):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert ones[1, 6] == pytest.approx(0.0, abs=1e-6) and ones[2, 6] == pytest.approx(1.0)  # one token: no entropy


def test_the_exp_polynomial_is_float32_accurate():
    r = np.linspace(0.0, 1.0, 100_001)
    acc = np.zeros_like(r)
    for c in reversed(kernels.POLY):
        acc = (acc + c) * r
    assert np.abs((1.0 + acc) / 2.0 ** r - 1.0).max() < 1e-6


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_compiled_head_row_equals_the_module_and_the_numpy_rows(depth, monkeypatch):
    torch.manual_seed(depth)
    head = AcceptanceHead(20, depth)
    with torch.no_grad():
        head.set_normalizer(torch.randn(20), torch.rand(20) + 0.5)
        for p in head.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(30, 20) * 2 + 1
    want = torch.sigmoid(0.8 * head(x) - 0.1).detach().numpy()
    fast = head.inference_fn(0.8, -0.1)
    assert fast.params is not None
    rows = x.numpy()
    one = np.array([fast(r) for r in rows])
    split = np.array([fast(r[:16], r[16:]) for r in rows])  # a state and its extras, never concatenated
    np.testing.assert_allclose(one, want, atol=1e-5)
    np.testing.assert_allclose(split, one, atol=1e-6)
    np.testing.assert_allclose(fast(rows), want, atol=1e-5)
    np.testing.assert_allclose(fast(rows[:, :16], rows[:, 16:]), want, atol=1e-5)
    monkeypatch.setattr(kernels, "HAVE_NUMBA", False)  # without numba: the numpy path for one row too
    plain = head.inference_fn(0.8, -0.1)
    assert getattr(plain, "params", None) is None
    np.testing.assert_allclose([plain(r[:16], r[16:]) for r in rows], want, atol=1e-5)


@pytest.mark.parametrize("extras, position", [(list(EXTRAS), "prev"), (["accepted_run"], "own")])
def test_a_head_policy_decides_from_one_call_as_from_the_step_by_step_path(tiny_pair, tmp_path, extras, position):
    """HeadPolicy.prob's one compiled call (scalars, extras and head) gives the probability the numpy features and
    head give, and leaves the step's scalars as DraftStep computes them."""
    head = export_head(tmp_path, tiny_pair, position=position, extras=extras, depth=3)
    fused, plain = CostAwareStop(head), CostAwareStop(head)
    plain.fast_prob.params = None
    g = torch.Generator().manual_seed(3)
    for i in range(20):
        logits = torch.randn(tiny_pair.vocab, generator=g) * (0.5 + i)
        hidden = torch.randn(tiny_pair.draft.config.hidden_size, generator=g)
        fused.run = plain.run = i % 5
        step, again = (DraftStep(i % 4, i, None, logits, hidden, hidden) for _ in range(2))
        assert fused.prob(step) == pytest.approx(plain.prob(again), abs=1e-5)
        want = [float(a[0]) for a in draft_scalars(logits[None], [i])]
        assert [step.confidence, step.entropy, step.top1] == pytest.approx(want, rel=2e-5, abs=1e-7)


@pytest.mark.parametrize("extras, position", [(list(EXTRAS), "prev"), (["accepted_run"], "own")])
def test_a_batch_controllers_compiled_rows_decide_as_its_numpy_path(tiny_pair, tmp_path, extras, position):
    """RowsStep.head_probs' one compiled call over rows gives the numpy features' and head's probabilities and the
    rows' scalars; kernels.round_progress gives the numpy progress of every lookahead, rows stopped and at the far
    end of the budgets included."""
    head = export_head(tmp_path, tiny_pair, position=position, extras=extras, depth=3)
    ctl = BatchCostAware(head)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, tiny_pair.vocab, generator=g) * torch.tensor([0.5, 1, 3, 10, 2, 30])[:, None]
    hidden = torch.randn(6, tiny_pair.draft.config.hidden_size, generator=g)
    runs = [0, 3, 1, 7, 2, 40]
    fused = RowsStep(1, list(range(6)), [5, 1, 2, 3, 4, 0], None, logits, hidden, hidden)
    plain = RowsStep(1, list(range(6)), [5, 1, 2, 3, 4, 0], None, logits, hidden, hidden)
    got = fused.head_probs(ctl, runs)
    ctl.fast_prob.params = None  # the numpy features and head
    want = plain.head_probs(ctl, runs)
    np.testing.assert_allclose(got, want, atol=1e-5)
    if ctl._reads:
        np.testing.assert_allclose(np.array(fused.scalars), np.array(plain.scalars), rtol=2e-5, atol=1e-7)
    rng = np.random.default_rng(0)
    for trial in range(6):
        b, k, later = int(rng.integers(1, 9)), int(rng.integers(1, 4)), int(rng.integers(0, 4))
        ctl.reach = rng.integers(1, 30, b).astype(np.float64)
        ctl.reach[0] = 60.0 if trial % 2 else ctl.reach[0]  # one row far ahead of the rest
        ctl.surv = np.zeros((b, 12))
        ctl.surv[:, 0] = 1.0
        for m in range(1, k + 1):
            ctl.surv[:, m] = ctl.surv[:, m - 1] * rng.uniform(0.2, 0.95, b)
        rows = sorted(rng.choice(b, size=int(rng.integers(1, b + 1)), replace=False).tolist())
        stopped = [i for i in range(b) if i not in rows]
        ctl.surv[stopped, k] = 0.0  # they drafted one candidate fewer
        a = rng.uniform(0.1, 0.9, len(rows))
        deciding, last = np.zeros(b, dtype=bool), np.zeros(b)
        deciding[rows], last[rows] = True, a
        compiled = kernels.round_progress(ctl.reach.astype(np.int64), ctl.surv, deciding, last, k, later)
        np.testing.assert_allclose(compiled, ctl._progress(rows, a, k, later), atol=1e-9)


def test_greedy_verification_from_the_argmax_decides_as_the_rule(tiny_pair, tmp_path, monkeypatch):
    """Under greedy decoding the engine and the batch decoder verify a rule that matches greedily from the target's
    argmax, with no one-hot rows: the same tokens and accepted counts as the rule handed the one-hot distributions."""
    greedy = tiny_pair.with_sampling(temperature=0)
    head = export_head(tmp_path, greedy, position="prev", extras=list(EXTRAS), depth=2)

    def run():
        out = []
        for policy in (FixedK(3), SpecDecPP(head, h=0.5)):
            dec = SpeculativeDecoder(greedy, policy, SpeculativeSampling())
            out += [(g.tokens, g.stats.accepted) for g in (dec.generate(p, 20) for p in PROMPTS[:6])]
            batch = BatchDecoder(greedy, policy, SpeculativeSampling())
            out += [[g.tokens for g in batch.generate(PROMPTS[:6], 20)], batch.stats.accepted]
        return out

    fast = run()
    monkeypatch.setattr(SpeculativeSampling, "matches_greedily", False)
    assert run() == fast
    assert sum(sum(acc) for _, acc in fast[:6]) > 0  # candidates were accepted: the comparison means something


def test_the_draft_step_reads_its_scalars_without_numba(monkeypatch):
    monkeypatch.setattr(kernels, "HAVE_NUMBA", False)
    logits = torch.from_numpy(logits_rows()[3])
    step = DraftStep(0, 4, None, logits, None, None)
    p = logits.double().softmax(-1)
    assert step.confidence == pytest.approx(float(p[4]), rel=1e-5) and P.kernels.HAVE_NUMBA is False


def test_a_gpu_step_reads_its_scalars_and_state_in_one_transfer():
    """HeadPolicy._read_with_scalars (the path of steps on a GPU, run here on CPU tensors): the state as it is, and
    the step's scalars as DraftStep computes them."""
    from decode.policies import HeadPolicy

    g = torch.Generator().manual_seed(5)
    logits, state = torch.randn(300, generator=g) * 4, torch.randn(16, generator=g)
    step = DraftStep(0, 11, None, logits, state, None)
    np.testing.assert_allclose(HeadPolicy._read_with_scalars(step, state), state.numpy(), rtol=1e-6)
    want = [float(a[0]) for a in draft_scalars(logits[None], [11])]
    assert [step.confidence, step.entropy, step.top1] == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_compiled_speculative_sampling_gives_the_tensor_paths_verdicts():
    """decode.rules.kernel against the rule's tensor ops on the same uniforms: 12 rows of ragged candidates drawn from
    q (some rows none), targets from near the draft to far from it and a top-p-like one with tokens of no mass, over
    40 seeds: every (accepted, next token) equal, with rejections, full acceptances and bonus draws among them."""
    g = np.random.default_rng(0)
    rows, m, v = 12, 5, 300
    scale = np.array([0.3, 1, 3, 5, 1, 3, 0.3, 1, 3, 5, 1, 3], np.float32)[:, None, None]
    q = torch.from_numpy(g.standard_normal((rows, m, v)).astype(np.float32) * scale)
    p = q[:, :1].expand(rows, m + 1, v) * 0.5 + torch.from_numpy(g.standard_normal((rows, m + 1, v)).astype(np.float32))
    p[3, :, ::2] = -np.inf  # the target gives half the vocabulary no mass
    q, p = q.softmax(-1).transpose(0, 1).contiguous(), p.softmax(-1)  # (M, R, V) and (R, M + 1, V)
    ks = [0, 1, 2, 3, 4, 5, 5, 4, 3, 2, 1, 5]
    tokens = [[int(torch.multinomial(q[i, r], 1, generator=torch.Generator().manual_seed(r * 10 + i))) for i in range(k)]
              for r, k in enumerate(ks)]
    fast, slow = SpeculativeSampling(), SpeculativeSampling(compiled=False)
    seen = []
    for seed in range(40):
        def gens(seed=seed):
            return Streams([seed * 100 + r for r in range(rows)])
        got = fast.verify_rows(tokens, q, p, gens())
        assert got == slow.verify_rows(tokens, q, p, gens())
        seen += [(n, k) for (n, _), k in zip(got, ks)]
    assert any(n < k for n, k in seen) and any(n == k > 0 for n, k in seen)


def test_a_greedy_tree_levels_children_are_topk_of_the_softmax():
    """kernels.top_children against torch's topk of the softmax, ragged counts (0 to 5 a row), masked tokens and a
    row with one token left (its other children are -1)."""
    x = logits_rows(1)
    x[2, 10] = x[2, 11] = x[2].max() + 1  # a tie: the lower id first, as torch.argmax
    counts = np.array([1, 5, 3, 0, 2, 4, 3, 1])
    tokens, probs = tree_kernels.top_children(x, counts)
    p = torch.from_numpy(x).double().softmax(-1)
    top = p.topk(5, -1)
    for r, k in enumerate(counts):
        left = min(k, int(np.isfinite(x[r]).sum()))  # past it, tokens of no mass (as topk gives them)
        if r != 2:  # torch orders ties as it likes
            assert tokens[r, :left].tolist() == top.indices[r, :left].tolist(), r
        np.testing.assert_allclose(probs[r, :k], top.values[r, :k].numpy(), rtol=2e-5, atol=1e-12)
        assert (tokens[r, :k] >= 0).all() and (tokens[r, k:] == -1).all()
    assert tokens[2, :2].tolist() == [10, 11]


def test_the_compiled_sibling_head_equals_the_head_trees_array_path(tiny_pair, tmp_path):
    """tree_kernels.head_children (HeadTree.weigh on the CPU) against HeadTree._weigh_rows, its numpy twin, on a random
    depth-2 sibling head: ragged children, runs and depths."""
    from decode.tree.head import HeadTree
    from decode.tree.shapes import NodeBatch

    extras = ["draft_entropy", "draft_top1", "cand_logq", "accepted_run", "cand_rank"]
    shape = HeadTree(export_head(tmp_path, tiny_pair, position="prev", extras=extras, depth=2))
    shape.start(3)
    shape.runs = np.array([0, 4, 9])
    g = torch.Generator().manual_seed(0)
    h = tiny_pair.draft.config.hidden_size
    logits, hidden = torch.randn(5, tiny_pair.vocab, generator=g) * 3, torch.randn(5, h, generator=g)
    toks = [[3, 9, 1, 4], [7], [2, 5], [11, 12, 13], [6, 0, 8, 10]]
    nodes = NodeBatch([0, 0, 1, 2, 2], [0, 1, 2, 1, 3], logits, hidden, toks, [[0.0] * len(t) for t in toks])
    got = shape.weigh(1, nodes)
    want = shape._weigh_rows(nodes, [len(t) for t in toks], shape.runs[[0, 0, 1, 2, 2]] + np.array([0, 1, 2, 1, 3]))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    assert len(set(np.round(np.concatenate(got), 6))) > 10  # the head's values differ by child


def test_compiled_draws_without_replacement_are_the_tensor_paths_token_for_token(monkeypatch):
    """decode.tree.round.without_replacement's compiled path against its tensor path on the same uniforms: 40 laws from
    flat to peaked, some with most tokens of no mass (top-p / top-k) and one with fewer tokens than its count (it
    gives them all), 0 to 5 draws each, over 20 seeds."""
    from decode.tree import round as tree

    g = np.random.default_rng(0)
    x = g.standard_normal((40, 300)).astype(np.float32) * np.linspace(0.1, 8, 40, dtype=np.float32)[:, None]
    q = torch.from_numpy(x).softmax(-1)
    q[::3, 20:] = 0.0  # a nucleus of 20 tokens
    q[7, 2:] = 0.0  # two tokens left for five draws
    counts = [int(c) for c in g.integers(0, 6, 40)]
    counts[7] = 5
    for seed in range(20):
        u = np.random.default_rng(seed + 1).random(sum(counts)).tolist()
        fast = tree.without_replacement(q, counts, u)
        monkeypatch.setattr(kernels, "HAVE_NUMBA", False)
        assert fast == tree.without_replacement(q, counts, u), seed
        monkeypatch.setattr(kernels, "HAVE_NUMBA", True)
        assert len(fast[7]) == 2 and all(len(set(d)) == len(d) for d in fast)


def test_compiled_sibling_tests_equal_the_label_maths():
    """kernels.sibling_tests (a tree's walk on the CPU) against decode.labels.sibling_tests (labelling's and the
    walk's tensor path): 30 nodes, targets near to far from the draft, some of no mass on most tokens, 0 to 4
    children drawn without replacement (-1 past them)."""
    from decode.labels import sibling_tests

    g = np.random.default_rng(3)
    q = torch.from_numpy(g.standard_normal((30, 200)).astype(np.float32) * 2).softmax(-1)
    p = (q.log() * 0.5 + torch.from_numpy(g.standard_normal((30, 200)).astype(np.float32))).softmax(-1)
    p[::4, 50:] = 0.0
    p = p / p.sum(-1, keepdim=True)
    x = torch.full((30, 4), -1)
    for n in range(30):
        k = n % 5
        x[n, :k] = torch.multinomial(q[n], k, replacement=False, generator=torch.Generator().manual_seed(n)) if k else x[n, :0]
    alpha, left = tree_kernels.sibling_tests(p.numpy(), q.numpy(), x.numpy())
    want_a, want_left = sibling_tests(p.double(), q.double(), x)
    np.testing.assert_allclose(alpha, want_a.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(left, want_left.numpy(), rtol=1e-4, atol=1e-7)
    assert 0 < (alpha[:, 1:] > 0).mean() and (alpha[:, 0] < 1).any()


def test_a_head_trees_compiled_width_is_its_numpy_twins():
    """tree_kernels.best_width against decode.tree.head.best_width on 300 random levels: trees of 0 to 30 nodes, 0 to
    4 frontier nodes of 1 to 4 children, steep to flat verifies, cheap to dear draft levels; every width is chosen
    somewhere."""
    from decode.tree.head import best_width

    g, chosen = np.random.default_rng(5), set()
    for _ in range(300):
        existing = g.uniform(0, 1, g.integers(0, 31)) ** 2
        guess = g.uniform(0, 0.6, (g.integers(0, 5), g.integers(1, 5)))
        nodes = int(g.integers(1, 33))
        verify = 10 + np.cumsum(g.uniform(0, 2, nodes + 1))
        level = np.concatenate([[0.0], np.cumsum(g.uniform(0.5, 4, 4))])
        spent = float(g.uniform(1, 10))
        want = best_width(existing, guess, spent, level, verify, nodes)
        assert tree_kernels.best_width(existing, guess, spent, level, verify, nodes) == want
        chosen.add(want)
    assert chosen == {0, 1, 2, 3, 4}, chosen
    # an exact tie, where summing in another order than 1 + cumsum chose the wider level
    tie = (np.array([0.2, 0.6]), np.array([[0.6, 0.2]]), 1.0, np.array([0.0, 1.0, 2.0]),
           np.array([1.0, 2, 2, 2] + [3.0] * 6), 9)
    assert tree_kernels.best_width(*tie) == best_width(*tie) == 0


def test_compiled_head_paths_refuse_a_state_of_another_width():
    """The kernels index without bounds checks: a state wider than the head reads (a head for another draft, fed
    by a caller that skipped its check) raised nothing before and wrote past the kernel's buffers."""
    head = AcceptanceHead(10 + 2, depth=2)
    prob = head.inference_fn(1.0, 0.0)
    codes = np.array([EXTRAS.index("draft_entropy"), EXTRAS.index("draft_top1")], dtype=np.int64)
    logits = logits_rows()[:2]
    assert 0 < kernels.head_step(logits[0], 3, np.zeros(10, np.float32), 0, codes, prob.params)[0] < 1
    wide = np.zeros((2, 130), np.float32)
    with pytest.raises(ValueError, match="reads 12 features, got a state of 130"):
        prob(wide[0], np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="another draft"):
        kernels.head_step(logits[0], 3, wide[0], 0, codes, prob.params)
    with pytest.raises(ValueError, match="another draft"):
        kernels.head_rows(logits, np.array([3, 4]), wide, np.zeros(2, np.int64), codes, prob.params)
    with pytest.raises(ValueError, match="another draft"):
        tree_kernels.head_children(logits, np.array([[3, 4], [5, -1]]), wide, np.zeros(2, np.int64), codes,
                                   prob.params)
    with pytest.raises(ValueError, match="outside the draft's 500 logits"):
        kernels.head_step(logits[0], 500, np.zeros(10, np.float32), 0, codes, prob.params)
