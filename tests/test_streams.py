"""decode.streams: SplitMix64's published outputs, the two computing paths equal, a row's draws independent of its
batch, and uniforms that pass frequency, serial and cross-row checks."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, pearsonr

import decode.streams as S
from decode.streams import Streams, mix, mix_int


def test_mix_is_splitmix64():
    """The reference generator's first outputs from state 1234567 (Vigna's splitmix64.c), from both mixes."""
    gamma, state, want = int(S._GAMMA), 1234567, [6457827717110365317, 3203168211198807973, 9817491932198370423]
    states = [(state + i * gamma) & S._MASK for i in (1, 2, 3)]
    assert [mix_int(s) for s in states] == want
    assert mix(np.array(states, dtype=np.uint64)).tolist() == want


def test_python_and_numpy_paths_draw_the_same_uniforms(monkeypatch):
    """Ragged counts (zeros included), seeds of any sign, over several rounds: the few-draw path and numpy's agree."""
    g = np.random.default_rng(0)
    for _ in range(100):
        seeds = [int(s) for s in g.integers(-2 ** 62, 2 ** 63 - 1, int(g.integers(1, 12)))]
        a, b = Streams(seeds), Streams(seeds)
        for _ in range(4):
            counts = g.integers(0, 6, len(seeds)).tolist()
            few = a.draw_numpy(counts)
            monkeypatch.setattr(S, "_FEW", -1)
            assert np.array_equal(few, b.draw_numpy(counts))
            monkeypatch.undo()
        assert np.array_equal(a.count, b.count)


def test_a_rows_draws_do_not_depend_on_its_batch():
    """Row 2 of a batch, drawing through views as rows leave, draws what a stream of its seed alone draws."""
    batch, alone = Streams([10, 11, 12, 13], "cpu"), Streams([12])
    got = [batch.draw([1, 3, 2, 1])[4:6], batch.select([0, 2]).draw([4, 1])[4:], batch.select([2]).draw(20)]
    want = [alone.draw(2), alone.draw(1), alone.draw(20)]
    for x, y in zip(got, want):
        assert x.dtype == torch.float64 and torch.equal(x, y)
    assert batch.count.tolist() == [5, 3, 23, 1]


@pytest.mark.parametrize("seeds", [range(200), range(10 ** 6, 10 ** 6 + 200)], ids=["from 0", "from 1e6"])
def test_uniforms_pass_frequency_serial_and_cross_row_checks(seeds):
    """200 adjacent seeds x 500 draws: 20 equal bins (chi-square), pairs of successive draws in a 10 x 10 grid, and
    no correlation between neighbouring rows' streams or a row's successive draws."""
    u = Streams(seeds).draw_numpy(500).reshape(200, 500)
    assert 0 <= u.min() and u.max() < 1
    assert chisquare(np.bincount((u.ravel() * 20).astype(int), minlength=20)).pvalue > 1e-3
    pairs = (u[:, :-1:2] * 10).astype(int) * 10 + (u[:, 1::2] * 10).astype(int)
    assert chisquare(np.bincount(pairs.ravel(), minlength=100)).pvalue > 1e-3
    assert abs(pearsonr(u[:-1].ravel(), u[1:].ravel())[0]) < 0.01  # row r against row r + 1, draw by draw
    assert abs(pearsonr(u[:, :-1].ravel(), u[:, 1:].ravel())[0]) < 0.01
