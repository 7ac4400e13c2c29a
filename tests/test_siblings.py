"""Sibling labels (data_gen's `siblings`) and heads trained on them (LabelData(siblings=True))."""

import pytest
import torch

from data_gen.generate import Mixing, exponential_, label_batch, prompt_generator
from decode.sampling import transform

TARGET = Mixing(shares={"target": 1.0})
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [3, 1, 4, 1, 5]]
IDS = ["a", "b", "c", "d"]


def label(pair, m=4, max_new=8, seed=0):
    recs, _ = label_batch(pair, PROMPTS, IDS, ["target"] * 4, TARGET, seed, max_new, siblings=m)
    return recs


def brute_force(p, q, toks):
    """Recursive rejection one position and one sibling at a time, in float64: (V,) p, q, sibling tokens -> alphas."""
    r, left, out = p.double(), q.double(), []
    for x in toks:
        q_j = left / left.sum()
        out.append(1.0 if q_j[x] == 0 else min(1.0, float(r[x] / q_j[x])))
        res = (r - q_j).clamp_min(0)
        r = res / res.sum() if res.sum() > 0 else r
        left = q_j.clone()
        left[x] = 0
    return out


@torch.no_grad()
def fresh_laws(pair, rec):
    """One fresh pass of each model over prompt + z -> (n, V) raw draft softmax, draft q and target p."""
    seq, n = torch.tensor([rec["prompt_ids"] + rec["z"]]), len(rec["prompt_ids"])
    d = pair.logits(pair.draft(seq).logits[0, n - 1: n - 1 + len(rec["z"])])
    t = pair.logits(pair.target(seq).logits[0, n - 1: n - 1 + len(rec["z"])])
    s = pair.config.sampling
    return d.softmax(-1), transform(d, s), transform(t, s)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sibling_labels_equal_a_brute_force_from_p_and_q(tiny_pair, temperature):
    pair, m, max_new = tiny_pair.with_sampling(temperature=temperature), 4, 8
    checked = 0
    for rec, pid in zip(label(pair, m, max_new), IDS):
        raw, q, p = fresh_laws(pair, rec)
        g = prompt_generator(0, pid)  # the candidates' noise follows the max_new rows of the responses'
        e = exponential_(torch.rand(2 * max_new, pair.vocab, generator=g)[max_new:])
        for i in range(len(rec["z"])):
            if temperature == 0:  # the draft's top m by its raw softmax; 1 where it is the target's argmax
                toks = raw[i].argsort(descending=True)[:m].tolist()
                alpha = [float(x == int(p[i].argmax())) for x in toks]
            else:  # the race q / E ordered: draws without replacement, rank 0 the candidate
                toks = (q[i] / e[i]).argsort(descending=True)[:m].tolist()
                alpha = brute_force(p[i], q[i], toks)
                assert toks[0] == rec["candidate"][i] and rec["sib_alpha"][i][0] == pytest.approx(rec["alpha"][i], abs=1e-5)
            assert rec["sib_tok"][i] == toks
            assert rec["sib_q"][i] == pytest.approx((raw if temperature == 0 else q)[i, toks].tolist(), abs=1e-5)
            assert rec["sib_alpha"][i] == pytest.approx(alpha, abs=1e-4)
            checked += 1
    assert checked > 20


def test_siblings_pad_where_the_law_has_fewer_tokens_and_rerun_the_same(tiny_pair):
    pair = tiny_pair.with_sampling(temperature=1.0, top_k=2)  # two tokens of mass at every position
    recs = label(pair, m=4)
    for rec in recs:
        for tok, q, a in zip(rec["sib_tok"], rec["sib_q"], rec["sib_alpha"]):
            assert tok[2:] == [-1, -1] and q[2:] == [0.0, 0.0] and a[2:] == [0.0, 0.0]
            assert min(tok[:2]) >= 0 and tok[0] != tok[1] and min(q[:2]) > 0
    assert label(pair, m=4) == recs  # seeded per prompt: a rerun (or a resumed run) labels the same
    plain, _ = label_batch(pair, PROMPTS, IDS, ["target"] * 4, TARGET, 0, 8)
    assert [{k: v for k, v in r.items() if not k.startswith("sib_")} for r in recs] == plain  # other columns as before


def test_a_siblings_setting_change_is_refused_like_any_other(tmp_path):
    from data_gen.module import Labeller
    from data_gen.store import LabelSetMismatch, claim_output

    meta = {"pair_hash": "h", "seed": 0, "mixing": {"r": 0.15}}
    claim_output(tmp_path, meta)  # a set labelled without siblings records none: sets from before stay resumable
    with pytest.raises(LabelSetMismatch, match="siblings: folder has None, this run has 4"):
        claim_output(tmp_path, meta | {"siblings": 4})
    with pytest.raises(ValueError, match="--model.siblings must be >= 0"):
        Labeller(siblings=-1)


def test_a_label_folder_refuses_a_draft_trained_on_and_keeps_its_older_sets(tmp_path):
    """The draft's weights digest is part of a label set's identity: a draft distilled on is refused; a folder
    labelled before the digest was recorded resumes."""
    from data_gen.store import LabelSetMismatch, claim_output

    draft = {"path": "d", "config_hash": "c", "num_layers": 2}
    claim_output(tmp_path / "old", {"pair_hash": "h", "draft": draft})
    claim_output(tmp_path / "old", {"pair_hash": "h", "draft": draft | {"weights": "aaa"}})
    claim_output(tmp_path / "new", {"pair_hash": "h", "draft": draft | {"weights": "aaa"}})
    with pytest.raises(LabelSetMismatch, match="draft: folder has"):
        claim_output(tmp_path / "new", {"pair_hash": "h", "draft": draft | {"weights": "bbb"}})


def sibling_records():
    """Two positions of hand-made sibling labels: rank 1 is the argmax at the first, none is at the second, whose
    law had three tokens (rank 3 padded)."""
    import datasets

    row = {"id": "s", "kind": "target", "z": [5, 6], "from_target": [True, True], "alpha": [0.0, 0.0],
           "ratio_qp": [2.0, 3.0], "kl": [0.1, 0.2], "kl_qp": [0.1, 0.2], "js": [0.1, 0.2], "tv": [0.1, 0.2],
           "draft_entropy": [1.0, 2.0], "draft_top1": [0.5, 0.4], "q_cand": [0.5, 0.4], "p_cand": [0.1, 0.2],
           "sib_tok": [[3, 4, 7, 8], [6, 2, 9, -1]], "sib_q": [[0.5, 0.3, 0.1, 0.05], [0.4, 0.3, 0.2, 0.0]],
           "sib_alpha": [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]}
    return datasets.Dataset.from_list([row]), {"s": torch.arange(9.0).reshape(3, 3)}


def test_flatten_with_siblings_keeps_a_greedy_rank_only_after_earlier_misses():
    from heads.features import FeatureSpec
    from train.data import flatten

    ds, feats = sibling_records()
    spec = FeatureSpec("prev", ["cand_logq", "accepted_run", "cand_rank"])
    x, cols = flatten(ds, feats, spec, siblings=True, greedy=True)
    # position 0: ranks 0, 1 (rank 1 was accepted, so 2 and 3 are never tested); position 1: ranks 0-2 (3 padded)
    assert cols["rank"].tolist() == [0, 1, 0, 1, 2] and cols["alpha"].tolist() == [0, 1, 0, 0, 0]
    assert cols["q_cand"].tolist() == pytest.approx([0.5, 0.3, 0.4, 0.3, 0.2])
    assert cols["draft_entropy"].tolist() == [1, 1, 2, 2, 2] and "p_cand" not in cols  # p_cand: rank 0's alone
    assert x[:, :3].tolist() == [[0, 1, 2]] * 2 + [[3, 4, 5]] * 3  # the state that produced the position's q
    assert x[:, 3].tolist() == pytest.approx(torch.tensor([0.5, 0.3, 0.4, 0.3, 0.2]).log().tolist())
    assert x[:, 4].tolist() == [0, 0, 0, 0, 0] and x[:, 5].tolist() == [0, 1, 0, 1, 2]  # one run per position
    _, sampled = flatten(ds, feats, spec, siblings=True, greedy=False)  # alpha is conditional: every rank tested
    assert sampled["rank"].tolist() == [0, 1, 2, 3, 0, 1, 2]


def test_sibling_training_refuses_own_states_other_families_and_sets_without_siblings(tiny_pair):
    import datasets

    from heads.features import FeatureSpec
    from train.data import LabelData, flatten
    from train.labels import RatioThreshold

    with pytest.raises(ValueError, match="position prev: .*sibling's own state does not exist"):
        LabelData(siblings=True, features=FeatureSpec("own"))
    with pytest.raises(ValueError, match="SoftAcceptance, not RatioThreshold"):
        LabelData(siblings=True, features=FeatureSpec("prev"), label=RatioThreshold())
    recs, feats = label_batch(tiny_pair, PROMPTS[:1], IDS[:1], ["target"], TARGET, 0, 4)
    with pytest.raises(ValueError, match="no sibling labels.*relabel it with configs/data_gen/pycode-tree.yaml"):
        flatten(datasets.Dataset.from_list(recs), dict(zip(IDS, feats)), FeatureSpec("prev"), siblings=True)


def test_the_closing_summary_gives_each_rank_its_reach_and_acceptance(tiny_pair_yaml, tmp_path):
    from data_gen.__main__ import summarize_siblings
    from data_gen.store import load_split
    from tests.tiny import write_tiny_labels

    write_tiny_labels(tmp_path, tiny_pair_yaml, n_train=4, n_dev=2, max_new=6, kinds=("target",), siblings=2)
    out = tmp_path / "labels" / "t1"
    lines = summarize_siblings(out, ["dev", "train"])
    assert lines[0].startswith("| split | sibling rank | positions reaching it |") and len(lines) == 2 + 2 * 2
    rows = load_split(out, "dev")
    n, alpha0 = sum(len(r) for r in rows["z"]), [a[0] for r in rows["sib_alpha"] for a in r]
    reach1 = sum(1 - a for a in alpha0)  # rank 1 is reached where rank 0 is rejected
    assert lines[2].startswith(f"| dev | 0 | {n:.1f} | {sum(alpha0) / n:.4f} |")
    assert lines[3].startswith(f"| dev | 1 | {reach1:.1f} |")
    plain = write_tiny_labels(tmp_path / "plain", tiny_pair_yaml, n_train=2, n_dev=2, max_new=4)
    assert summarize_siblings(plain.parent / "labels" / "t1", ["dev"]) == []  # a set without siblings: no table
