"""A draft whose output layer is cut to some tokens (decode.cut): its logits are the full layer's at those tokens and
-inf elsewhere; it decodes greedily as the target alone and keeps the target's law under sampling, in chains and
trees, even cut to the tokens the target likes least (every other token reached only through the residual); its
weights digest is not the full draft's; a bad file or a cut target gets one line naming what is wrong."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from decode.batch import BatchAutoregressive, BatchDecoder
from decode.cut import CutHead, rank_tokens
from decode.pair import load_pair
from decode.policies import FixedK
from decode.rules.chain import GreedyMatch
from decode.tree.shapes import ConfidenceTree
from tests.test_decode import ALPHA
from tests.test_tree_law import PROMPT, conditional_pvalue
from tests.tiny import write_tiny_pair


def with_cut(pair_yaml, ids, to: str = "draft"):
    """The pair YAML with `to`'s output layer cut to `ids` (written beside it)."""
    path = pair_yaml.parent / "head.json"
    path.write_text(json.dumps({"tokens": ids}))
    cfg = yaml.safe_load(pair_yaml.read_text())
    cfg[to]["head_tokens"] = str(path)
    out = pair_yaml.parent / f"pair-cut-{to}.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The tiny pair at T = 1, and the same with its draft cut to EOS and the 11 tokens the target likes least
    after PROMPT."""
    root = tmp_path_factory.mktemp("cut")
    full = load_pair(write_tiny_pair(root))
    with torch.no_grad():
        p = full.logits(full.target(torch.tensor([PROMPT])).logits[0, -1]).softmax(-1)
    ids = [0] + [int(t) for t in p.argsort() if t != 0][:11]
    assert float(p[[t for t in range(full.vocab) if t not in ids]].sum()) > 0.5  # most of p is out of the draft's reach
    return full, load_pair(with_cut(root / "pair.yaml", ids)), ids


def test_a_cut_layer_scores_its_tokens_as_the_full_one_and_gives_the_rest_nothing(pairs):
    full, cut, ids = pairs
    assert isinstance(cut.draft.get_output_embeddings(), CutHead)
    assert cut.draft.get_output_embeddings().weight.shape == full.draft.get_output_embeddings().weight.shape
    x = torch.tensor([[3, 5, 7, 1, 2]])
    with torch.no_grad():
        a, b = full.draft(x).logits, cut.draft(x).logits
    out = torch.ones(a.shape[-1], dtype=torch.bool)
    out[ids] = False
    assert torch.allclose(a[..., ids], b[..., ids]) and torch.isneginf(b[..., out]).all()
    assert cut.identity("draft")["weights"] != full.identity("draft")["weights"]  # heads of the full draft refuse it
    swapped = ids[:-1] + [next(t for t in range(full.vocab) if t not in ids)]  # (rewrites the fixture's file: loaded)
    other = load_pair(with_cut(Path(cut.config.draft.head_tokens).parent / "pair.yaml", swapped))
    assert other.identity("draft")["weights"] != cut.identity("draft")["weights"]  # one id apart: another draft


def test_a_cut_draft_decodes_greedily_as_the_target_and_keeps_its_law(pairs):
    _, cut, _ = pairs
    prompts = [[1, 2, 3], [14], [5, 6, 7, 8, 9]]
    greedy = dataclasses.replace(cut.with_sampling(temperature=0.0), eos_ids=(-1,))
    want = BatchAutoregressive(greedy).generate(prompts, 12)
    assert [g.tokens for g in BatchDecoder(greedy, FixedK(3), GreedyMatch()).generate(prompts, 12)] == \
        [w.tokens for w in want]
    sampled = dataclasses.replace(cut, eos_ids=(-1,))
    assert conditional_pvalue(sampled, FixedK(2), n=4000) > ALPHA
    assert conditional_pvalue(sampled, ConfidenceTree(top_k=4, depth=2, nodes=5), n=4000) > ALPHA


def test_a_bad_head_tokens_file_or_a_cut_target_gets_one_line(pairs, tmp_path):
    root = tmp_path
    pair_yaml = write_tiny_pair(root)
    for ids, says in (([0, 1, 1], "repeated ids or ids outside"), ([0, 999], "repeated ids or ids outside"),
                      ([], "holds no list of token ids"), (["a"], "holds no list of token ids")):
        with pytest.raises(ValueError, match=says) as e:
            load_pair(with_cut(pair_yaml, ids))
        assert "head.json" in str(e.value) and "\n" not in str(e.value)
    cut_yaml = with_cut(pair_yaml, [0, 1])
    (root / "head.json").write_text('{"tokens": [0, 1')
    with pytest.raises(ValueError, match=r"head\.json cannot be read .*--head-tokens N"):
        load_pair(cut_yaml)
    (root / "head.json").unlink()
    with pytest.raises(ValueError, match=r"head\.json is not there"):
        load_pair(cut_yaml)
    with pytest.raises(ValueError, match="the target scores every token"):
        load_pair(with_cut(pair_yaml, [0, 1], to="target"))


def test_ranked_tokens_keep_eos_first_then_the_most_frequent_and_say_what_they_cover():
    got = rank_tokens([[5, 5, 5, 7, 9], [7, 5, 2]], top=3, keep=(2,))
    assert got["tokens"] == [2, 5, 7] and got["positions"] == 8 and got["distinct"] == 4
    assert got["covered"] == pytest.approx(7 / 8)
    assert re.fullmatch(r"[\d.]+", str(got["covered"]))


def test_hf_assisted_generation_with_a_cut_draft_matches_the_target_or_is_refused_in_one_line(tmp_path):
    from decode.hf import hf_generate

    for pad_rows in (0, 8):  # equal embedding sizes; unequal ones (transformers' two-tokenizer path)
        root = tmp_path / str(pad_rows)
        root.mkdir()
        greedy = load_pair(with_cut(write_tiny_pair(root, pad_rows=pad_rows), list(range(3, 12)))).with_sampling(
            temperature=0.0)
        want = hf_generate(greedy, [5, 6, 7, 8, 9], 16, {}, 0, stop_at_eos=False)[0]
        for hf in ({"k": 3}, {"confidence": 0.4}):
            if pad_rows:
                with pytest.raises(ValueError, match="head_tokens .* two-tokenizer assisted path") as e:
                    hf_generate(greedy, [5, 6, 7, 8, 9], 16, hf, 0, stop_at_eos=False)
                assert "\n" not in str(e.value)
            else:
                assert hf_generate(greedy, [5, 6, 7, 8, 9], 16, hf, 0, stop_at_eos=False)[0] == want
