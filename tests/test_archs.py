"""Every model family the project serves, as tiny random-weight pairs built from configs, in float32 and
bfloat16, on the CPU (and on a GPU when one is present: the `cuda` marker): greedy speculative output equals
the target's greedy output, the whole pipeline (data_gen -> train fit -> export -> decode -> the HF
assistant) runs, prompts are framed by BOS and the chat template, and every EOS id ends a response."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from decode.batch import BatchDecoder
from decode.cache.kv import UnservableModel, check_servable
from decode.engine import Autoregressive, SpeculativeDecoder
from decode.hf import hf_generate
from decode.pair import load_pair
from decode.policies import DraftConfidence, FixedK
from decode.rules.chain import GreedyMatch, SpeculativeSampling
from tests.archs import FAMILIES, WINDOW, chat_tokenizer

TEXTS = ["def f(x):\n  return (x)", "a = b(c, d)\n", "if a == 1:\n  b(2)", "x = 10\nfor i in x:\n", "def g():",
         "h(0) == (1)", "c = 3 ", "bad(d)\n", "aa == bb", "12 + 34 "]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU here: the cuda-marked matrix runs where one is present")])]
MATRIX = [(f, d) for f in FAMILIES for d in ("float32", "bfloat16")]


@pytest.fixture
def arch_pairs(arch_pair_cache):
    """(family, dtype, device) -> (pair YAML, loaded pair), built on first use in the session (tests/conftest.py),
    shared by every module that decodes them (test_batch, test_tree, test_rowcache import this fixture)."""
    return arch_pair_cache


def no_eos(pair):
    """The pair with no token that ends a response, so every generation runs its full length."""
    return dataclasses.replace(pair, eos_ids=(-1,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family,dtype", MATRIX)
def test_greedy_speculative_equals_target_greedy(arch_pairs, family, dtype, device):
    pair = no_eos(arch_pairs(family, dtype, device)[1])
    # the target drafting for itself: every round takes every candidate (the draft's cache lags one token)
    agree = dataclasses.replace(pair, draft=pair.target)
    ref, rounds = Autoregressive(pair), []
    for text in TEXTS[:4]:
        ids = pair.encode(text)
        assert len(ids) > WINDOW  # the sliding windows are full before the first draft token
        want = ref.generate(ids, 20).tokens
        for p, policy, rule in [(pair, FixedK(3), SpeculativeSampling()), (pair, FixedK(6), GreedyMatch()),
                                (pair, DraftConfidence(0.3), SpeculativeSampling()),
                                (agree, FixedK(4), SpeculativeSampling())]:
            out = SpeculativeDecoder(p, policy, rule).generate(ids, 20)
            assert out.tokens == want, (family, dtype, type(policy).__name__, text)
            rounds += out.stats.accepted
    # both paths behind a round ran: a rejection (crop the target) and a round that took every candidate
    assert 0 in rounds and max(rounds) >= 4, rounds


def test_sampled_sliding_window_pair_emits_the_targets_law(arch_pairs):
    """Speculative sampling on a Mistral pair whose window is full keeps the target's law (chi-square), drawn as the
    rows of one batch (the one-sequence engine's own law test is test_decode's)."""
    from tests.test_decode import ALPHA, two_token_pvalue

    pair = no_eos(arch_pairs("mistral", "float32")[1]).with_sampling(temperature=1.0)
    ids = pair.encode(TEXTS[0])
    with torch.no_grad():
        def next_law(prefixes):
            out = pair.target(torch.tensor(prefixes)).logits[:, -1]
            return pair.logits(out).softmax(-1)

        p1 = next_law([ids])[0]
        law = p1[:, None] * next_law([ids + [a] for a in range(pair.vocab)])
    dec = BatchDecoder(pair, FixedK(2), SpeculativeSampling(), seed=3)  # 1500 rows of one batch: 1500 streams
    assert two_token_pvalue(dec, law, ids, n=1500, rows=1500) > ALPHA


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family,dtype", MATRIX)
def test_pipeline_labels_trains_exports_and_decodes(arch_pairs, tmp_path, family, dtype, device):
    """data_gen -> train fit -> export -> decode generate with the head -> the HF assistant with the head,
    as `python -m train.check` runs them on a user's pair."""
    from data_gen.store import load_split
    from train.check import decode_checks, label, train_head

    pair_yaml, pair = arch_pairs(family, dtype, device)
    accelerator = "gpu" if device == "cuda" else "cpu"
    gen_cfg = label(pair_yaml, tmp_path, 10, 10, accelerator)
    records = load_split(tmp_path / "labels" / "greedy", "jsonl_train")
    head_ids = pair.encode("x")[:3]  # BOS and the template's header frame every labelled prompt
    assert all(r["prompt_ids"][:3] == head_ids for r in records) and head_ids[0] == pair.tokenizer.bos_token_id
    head = train_head(gen_cfg, tmp_path, accelerator)
    assert json.loads((Path(head) / "config.json").read_text())["draft"]["hidden_size"] == 32
    rows = decode_checks(no_eos(pair), head, 16)
    assert len(rows) == 3 and all(ok for _, ok, _ in rows), rows


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_every_eos_id_of_the_generation_config_ends_a_response(arch_pairs, tmp_path, family):
    """A token listed second in the generation config's eos_token_id ends the engine's, the target alone's and
    the HF baseline's response, as the first EOS does."""
    from transformers import GenerationConfig

    pair_yaml, pair = arch_pairs(family, "float32")
    ids = pair.encode(TEXTS[0])
    free = Autoregressive(no_eos(pair)).generate(ids, 12).tokens
    stop_at = 5 if free[5] not in free[:5] else next(i for i in range(1, 12) if free[i] not in free[:i])
    folder = tmp_path / "target"
    pair.target.save_pretrained(folder)
    pair.tokenizer.save_pretrained(folder)
    GenerationConfig(eos_token_id=[1, free[stop_at]], bos_token_id=0, pad_token_id=1).save_pretrained(folder)
    raw = yaml.safe_load(pair_yaml.read_text())
    raw["target"]["path"] = str(folder)
    (tmp_path / "pair.yaml").write_text(yaml.safe_dump(raw))
    two = load_pair(tmp_path / "pair.yaml")
    assert two.eos_ids == (1, free[stop_at])
    want = free[: stop_at + 1]
    assert Autoregressive(two).generate(ids, 12).tokens == want
    assert SpeculativeDecoder(two, FixedK(4), SpeculativeSampling()).generate(ids, 12).tokens == want
    assert hf_generate(two, ids, 12, {}, seed=0)[0] == want


def test_hf_baseline_runs_on_a_clean_generation_config(arch_pairs, tmp_path):
    """A checkpoint's generation extras (Qwen2.5-Instruct ships repetition_penalty) do not reach the baseline."""
    pair = no_eos(arch_pairs("llama", "float32")[1])
    ids = pair.encode(TEXTS[2])
    want = Autoregressive(pair).generate(ids, 16).tokens
    pair.target.generation_config.repetition_penalty = 3.0
    try:
        assert hf_generate(pair, ids, 16, {}, seed=0)[0] == want
        assert hf_generate(pair, ids, 16, {"k": 3}, seed=0)[0] == want
    finally:
        pair.target.generation_config.repetition_penalty = 1.0


def test_prompts_keep_bos_and_template_when_truncated():
    from decode.prompting import encode

    tok = chat_tokenizer()
    whole = encode(tok, "abc" * 20, chat_template=True)
    assert whole[0] == tok.bos_token_id and whole.count(tok.bos_token_id) == 1
    assert tok.decode(whole) == "<bos>u:" + "abc" * 20 + "<eot>a:"
    cut = encode(tok, "abc" * 20, chat_template=True, max_tokens=12)
    assert len(cut) == 12 and tok.decode(cut) == "<bos>u:" + ("abc" * 20)[-6:] + "<eot>a:"
    plain = encode(tok, "abcdef", chat_template=False, max_tokens=4)
    assert tok.decode(plain) == "<bos>def"  # the tokenizer's own BOS, then the text's last tokens
    assert encode(tok, "  ", chat_template=True) == []
    with pytest.raises(ValueError, match="no room for text"):
        encode(tok, "abc" * 20, chat_template=True, max_tokens=5)


def test_a_model_whose_cache_cannot_roll_back_is_refused_up_front():
    from transformers import MistralConfig, Qwen3NextConfig

    check_servable(MistralConfig(sliding_window=WINDOW), "target")  # a sliding window is served
    with pytest.raises(UnservableModel, match="cannot be cut back") as err:
        check_servable(Qwen3NextConfig(num_hidden_layers=4), "target")
    assert "\n" not in str(err.value)


def test_forwards_use_the_cache_keyword_transformers_asks_for(arch_pairs, recwarn):
    """No deprecation warning from transformers on the project's own forwards."""
    import warnings

    pair = arch_pairs("llama", "float32")[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpeculativeDecoder(pair, FixedK(3), SpeculativeSampling()).generate(pair.encode(TEXTS[0]), 8)
