"""An exported head inside an unmodified Hugging Face generate(): greedy equality, the sampling law,
and the one transformers behaviour the helper relies on (the assistant's generate is what drafts)."""

import json
from pathlib import Path

import pytest
import torch

from decode.hf import specdecpp_assistant
from decode.policies import SamplingMismatch
from heads import AcceptanceHead, HeadMismatch, save_pretrained
from tests.test_decode import ALPHA, PROMPTS, exact_two_token_law

ROOT = Path(__file__).resolve().parents[1]


def export(tmp_path, pair, name, temperature, position="prev", bias=None, extras=()):
    head = AcceptanceHead(pair.draft.config.hidden_size + len(extras), 2)
    if bias is not None:
        with torch.no_grad():
            head.out.weight.zero_()
            head.out.bias.fill_(bias)
    sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0}
    meta = {"draft": pair.identity("draft"), "features": {"position": position, "extras": list(extras)},
            "sampling": sampling}
    return str(save_pretrained(head, tmp_path / name, meta))


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    from decode.pair import load_pair
    from tests.tiny import write_tiny_pair

    return load_pair(write_tiny_pair(tmp_path_factory.mktemp("hf_pair"), pad_rows=0))  # HF needs equal sizes


def greedy(model, ids, n, **kw):
    x = torch.tensor([ids])
    return model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                          pad_token_id=0, eos_token_id=None, **kw)[0, len(ids):].tolist()


@pytest.mark.parametrize("position", ["prev", "own"])
def test_greedy_generate_with_the_head_equals_target_greedy(hf_pair, tmp_path, position):
    head = export(tmp_path, hf_pair, "h", 0.0, position)
    assistant = specdecpp_assistant(hf_pair.draft, head, h=0.5, tokenizer=hf_pair.tokenizer)
    for prompt in PROMPTS[:6]:
        assert greedy(hf_pair.target, prompt, 16, assistant_model=assistant) == greedy(hf_pair.target, prompt, 16)
    # transformers drafted through the assistant's generate (decode.hf.ASSISTANT_ENTRY) and the head was read
    assert assistant.specdecpp_stop.steps > 0 and assistant.specdecpp_stop.captured is not None


def test_head_bias_sets_the_draft_length(hf_pair, tmp_path):
    lengths = {}
    for name, bias in (("sure", 20.0), ("doubt", -20.0)):
        assistant = specdecpp_assistant(hf_pair.draft, export(tmp_path, hf_pair, name, 0.0, bias=bias), h=0.5,
                                        max_len=6, tokenizer=hf_pair.tokenizer)
        greedy(hf_pair.target, PROMPTS[0], 12, assistant_model=assistant)
        stop = assistant.specdecpp_stop
        lengths[name] = stop.drafted / stop.rounds
    assert lengths["doubt"] == 1 and lengths["sure"] > 2  # stop after every candidate vs draft up to max_len


def test_head_of_another_setting_or_draft_is_refused(hf_pair, tiny_pair, tmp_path):
    t1 = export(tmp_path, hf_pair, "t1", 1.0)
    assistant = specdecpp_assistant(hf_pair.draft, t1, tokenizer=hf_pair.tokenizer)
    with pytest.raises(SamplingMismatch, match="trained for sampling t1 but the decoder samples greedy"):
        greedy(hf_pair.target, PROMPTS[0], 4, assistant_model=assistant)
    with pytest.raises(HeadMismatch):
        specdecpp_assistant(tiny_pair.target, t1)  # not the draft it was trained for


@pytest.mark.slow
def test_sampling_with_the_head_keeps_the_target_law(hf_pair, tmp_path):
    from scipy.stats import chisquare

    pair = hf_pair.with_sampling(temperature=1.0)
    prompt, n = [3, 7], 800  # assisted generation decodes one sequence a call; 600 draws already fail a broken
    # resample (test_decode: p < 1e-6), so 800 keep the power to see a head that biases what the target accepts
    law = exact_two_token_law(pair, prompt)
    assistant = specdecpp_assistant(pair.draft, export(tmp_path, pair, "s", 1.0), h=0.5, tokenizer=pair.tokenizer)
    counts = torch.zeros_like(law)
    x = torch.tensor([prompt])
    torch.manual_seed(0)
    for _ in range(n):
        out = pair.target.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0, top_k=None,
                                   top_p=1.0, max_new_tokens=2, pad_token_id=0, assistant_model=assistant)[0, 2:].tolist()
        counts[out[0], out[1] if len(out) > 1 else out[0]] += 1
    expected = law.flatten() * n
    big = expected >= 5
    obs = torch.cat([counts.flatten()[big], counts.flatten()[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > ALPHA


@pytest.mark.slow
def test_embedded_pair_greedy_equality(tmp_path):
    from data_gen.prompts import PromptSet
    from decode.pair import load_pair

    pair = load_pair(ROOT / "configs/pairs/pycode.yaml")
    assistant = specdecpp_assistant(pair.draft, export(tmp_path, pair, "p", 0.0), h=0.7, tokenizer=pair.tokenizer)
    for text in PromptSet("pycode", "test", limit=3, seed=0).load()["prompt"]:
        ids = pair.tokenizer(text, add_special_tokens=False)["input_ids"][-300:]
        assert greedy(pair.target, ids, 24, assistant_model=assistant) == greedy(pair.target, ids, 24)


@pytest.mark.parametrize("position", ["prev", "own"])
def test_a_head_with_the_drafts_distribution_among_its_features_drives_generate(hf_pair, tmp_path, position):
    """The extras (entropy, top-1, log q of the candidate) come from the scores the assistant drew that candidate
    from; an own head scores a candidate one step late, with the scores kept from that step."""
    extras = ("draft_entropy", "draft_top1", "cand_logq")
    head = export(tmp_path, hf_pair, position, 0.0, position, extras=extras)
    assistant = specdecpp_assistant(hf_pair.draft, head, h=0.5, tokenizer=hf_pair.tokenizer)
    seen, stop = [], assistant.specdecpp_stop
    policy_stop = stop.policy.stop
    stop.policy.stop = lambda step: seen.append(step) or policy_stop(step)
    for prompt in PROMPTS[:4]:
        assert greedy(hf_pair.target, prompt, 16, assistant_model=assistant) == greedy(hf_pair.target, prompt, 16)
    # greedy: each candidate is the argmax of the scores it was drawn from, so its probability is their top-1
    assert seen and all(0 < s.confidence <= 1 and s.confidence == pytest.approx(s.top1) for s in seen)
    assert all(s.token == int(s.logits.argmax()) for s in seen)  # the scores that drew this very token


def test_the_cost_aware_stop_drives_generate_from_the_machines_step_costs(hf_pair, tmp_path):
    """A head that says 0.8 everywhere, with a 1.2 ms draft step, a 4.99 ms target call and 0.21 ms per extra token:
    three candidates a round (tests/test_replay.py works the rule through), where SpecDec++'s h = 0.5 stops at 4."""
    import math

    head = export(tmp_path, hf_pair, "c", 0.0, "prev", bias=math.log(0.8 / 0.2))
    costly = specdecpp_assistant(hf_pair.draft, head, tokenizer=hf_pair.tokenizer, max_len=8, costs=(1.2, 4.99, 0.21))
    for prompt in PROMPTS[:4]:
        assert greedy(hf_pair.target, prompt, 16, assistant_model=costly) == greedy(hf_pair.target, prompt, 16)
    stop = costly.specdecpp_stop
    assert 2.5 < stop.drafted / stop.rounds <= 3.0, (stop.drafted, stop.rounds)


def test_a_head_for_top_p_sampling_drives_the_baseline_under_that_setting(hf_pair, tmp_path):
    """The baseline's config says top-k off (0): left None, generate() filled it from the draft's config (GPT-2's
    top-k 50), the assistant drafted under another setting than the head's, and the head was refused."""
    from decode.hf import clean_config, hf_generate

    pair = hf_pair.with_sampling(temperature=0.7, top_p=0.95)
    head = export(tmp_path, pair, "t07", 0.7)
    cfg = json.loads((Path(head) / "config.json").read_text())
    cfg["sampling"] = {"temperature": 0.7, "top_k": 0, "top_p": 0.95}
    (Path(head) / "config.json").write_text(json.dumps(cfg))
    assert clean_config(pair, 8).top_k == 0
    shipped = pair.draft.generation_config.top_k, pair.target.generation_config.top_k
    pair.draft.generation_config.top_k = pair.target.generation_config.top_k = 50  # as GPT-2 checkpoints ship
    try:
        tokens, _ = hf_generate(pair, PROMPTS[0], 8, {"head": head, "h": 0.5}, seed=0)  # no SamplingMismatch
    finally:
        pair.draft.generation_config.top_k, pair.target.generation_config.top_k = shipped
    assert 1 <= len(tokens) <= 8  # a sampled EOS may end it early


def test_the_assistant_tells_the_head_what_each_round_accepted(hf_pair, tmp_path):
    """transformers reports no acceptances to an assistant; it learns them from how the text it is asked to continue
    grew (accepted + 1 tokens a round), and a text that does not extend the last one starts a generation. A prev
    head decides as in our engine, so the rounds it is told of are the engine's, but the last."""
    from decode.engine import SpeculativeDecoder
    from decode.policies import SpecDecPP
    from decode.rules.chain import SpeculativeSampling

    extras = ("draft_entropy", "draft_top1", "cand_logq", "accepted_run")
    head = export(tmp_path, hf_pair, "run", 0.0, "prev", extras=extras)
    assistant = specdecpp_assistant(hf_pair.draft, head, h=0.5, tokenizer=hf_pair.tokenizer)
    policy, told = assistant.specdecpp_stop.policy, []
    start, verified = policy.start, policy.verified
    policy.start = lambda: told.append("start") or start()
    policy.verified = lambda a, k: told.append((a, k)) or verified(a, k)
    ours, rounds = SpecDecPP(head, h=0.5), []
    ours_verified = ours.verified
    ours.verified = lambda a, k: rounds.append((a, k)) or ours_verified(a, k)
    engine = SpeculativeDecoder(hf_pair.with_sampling(temperature=0.0), ours, SpeculativeSampling())
    compared = 0
    for prompt in PROMPTS:
        told.clear(), rounds.clear()
        x = torch.tensor([prompt])
        hf_pair.target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16,
                                pad_token_id=0, eos_token_id=list(hf_pair.eos_ids), assistant_model=assistant)
        engine.generate(prompt, 16)  # both stop at the pair's EOS
        assert told[0] == "start" and "start" not in told[1:]
        assert told[1:] == rounds[:-1], (prompt, told, rounds)
        compared += len(rounds) - 1
    assert compared >= 8
