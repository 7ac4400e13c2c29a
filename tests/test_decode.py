import platform
import sys

import pytest
import torch
from scipy.stats import chisquare

from decode import labels as L
from decode.allocator import steady_heap
from decode.batch import BatchDecoder
from decode.engine import Autoregressive, SpeculativeDecoder
from decode.evaluation.ceilings import Oracle
from decode.policies import FixedK, SamplingMismatch, SpecDecPP, SprinterVerifier
from decode.rules.chain import FSD, FLy, GreedyMatch, SpeculativeSampling, SprinterCheck, greedy_verify
from decode.sampling import transform
from decode.streams import Streams
from heads import AcceptanceHead, HeadMismatch, LinearVerifier, save_pretrained

PROMPTS = [[1 + (i * 3 + j) % 20 for j in range(2 + i % 4)] for i in range(12)]
ALPHA = 1e-3  # false-alarm rate of each statistical test


def export_head(tmp_path, pair, cls=AcceptanceHead, bias=None, position="own", name="head", sampling=None,
                label=None, extras=(), **kw):
    head = cls(pair.draft.config.hidden_size + len(extras), **kw)
    if bias is not None:
        with torch.no_grad():
            head.out.weight.zero_()
            head.out.bias.fill_(bias)
    meta = {"draft": pair.identity("draft"), "features": {"position": position, "extras": list(extras)},
            "sampling": vars(sampling or pair.config.sampling)} | ({"label": {"family": label}} if label else {})
    return str(save_pretrained(head, tmp_path / name, meta))


@pytest.fixture(scope="module")
def greedy_pair(tiny_pair):
    return tiny_pair.with_sampling(temperature=0)


def test_greedy_paths_equal_target_greedy_token_for_token(greedy_pair, tmp_path):
    head = export_head(tmp_path, greedy_pair, depth=3)
    ref = Autoregressive(greedy_pair)
    for prompt in PROMPTS:
        want = ref.generate(prompt, 24).tokens
        for policy, rule in [(FixedK(3), SpeculativeSampling()), (FixedK(5), GreedyMatch()),
                             (SpecDecPP(head, h=0.5), SpeculativeSampling()), (Oracle(), GreedyMatch())]:
            res = SpeculativeDecoder(greedy_pair, policy, rule).generate(prompt, 24)
            got, stats = res.tokens, res.stats
            assert got == want, (type(policy).__name__, prompt)
            if isinstance(policy, Oracle):
                # the oracle never drafts past the first disagreement
                assert stats.discarded <= stats.rounds


def exact_two_token_law(pair, prompt):
    """(V, V) probability of the target's first two sampled tokens."""
    with torch.no_grad():
        p1 = transform(pair.logits(pair.target(torch.tensor([prompt])).logits[0, -1]), pair.config.sampling)
        V = pair.vocab
        seqs = torch.tensor([prompt + [a] for a in range(V)])
        p2 = transform(pair.logits(pair.target(seqs).logits[:, -1]), pair.config.sampling)
    law = p1[:, None] * p2
    eos = pair.tokenizer.eos_token_id  # generation stops after a first EOS: record it as (EOS, EOS)
    law[eos] = 0.0
    law[eos, eos] = p1[eos]
    return law


def two_token_pvalue(decoder, law, prompt, n=2000, rows=None):
    """Chi-square p-value of n two-token draws after prompt against law. A one-sequence decoder (generate(prompt, 2))
    draws them one at a time; with rows, a BatchDecoder draws them as batches of `rows` copies of the prompt, each row
    its own stream (seed + its index; the seed moves on by each batch's rows): independent draws of the same law, one
    batched forward for many draws."""
    if rows is None:
        draws = [decoder.generate(prompt, 2).tokens for _ in range(n)]
    else:
        draws, start = [], decoder.seed
        for first in range(0, n, rows):
            decoder.seed = start + first
            draws += [g.tokens for g in decoder.generate([prompt] * min(rows, n - first), 2)]
        decoder.seed = start
    counts = torch.zeros_like(law)
    for out in draws:
        counts[out[0], out[1] if len(out) > 1 else out[0]] += 1
    expected = law.flatten() * n
    big = expected >= 5  # pool the rare cells into one so the chi-square approximation holds
    obs = torch.cat([counts.flatten()[big], counts.flatten()[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    return chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


class BrokenResample(SpeculativeSampling):
    """Resamples from p instead of norm(max(0, p - q)): biased towards the draft."""

    def resample(self, p_i, q_i):
        return p_i


@pytest.mark.slow
def test_speculative_sampling_is_lossless_and_a_broken_resample_is_caught(tiny_pair, tmp_path):
    """The one-sequence engine's own path on 600 draws; a head's stopping and the broken resample as rows of batches
    (the rule's verify_rows is the code both decoders run). 600 draws still fail the broken resample (p < 1e-4 at
    500 for five seeds; 2000 rows give p < 1e-40), so each test keeps the power to see that bias."""
    pair = tiny_pair.with_sampling(temperature=1.0)
    prompt = [3, 7]
    law = exact_two_token_law(pair, prompt)
    head = export_head(tmp_path, pair, depth=2)
    assert two_token_pvalue(SpeculativeDecoder(pair, FixedK(2), SpeculativeSampling(), seed=1), law, prompt,
                            n=600) > ALPHA
    assert two_token_pvalue(BatchDecoder(pair, SpecDecPP(head, h=0.5), SpeculativeSampling(), seed=2 * 10**6),
                            law, prompt, n=2000, rows=1000) > ALPHA
    assert two_token_pvalue(BatchDecoder(pair, FixedK(2), BrokenResample(), seed=3 * 10**6), law, prompt,
                            n=2000, rows=1000) < ALPHA


def test_call_log_keeps_the_order_of_the_forwards(tiny_pair):
    """Prefill of both models, then per round: the draft's steps, then one target check of pending + k."""
    stats = SpeculativeDecoder(tiny_pair.with_sampling(temperature=0.0), FixedK(2), GreedyMatch()).generate(
        PROMPTS[5], 12).stats
    prompt = len(PROMPTS[5])
    assert stats.calls[:5] == [("draft", prompt - 1), ("target", prompt - 1), ("draft", 1), ("draft", 1), ("target", 3)]
    assert all(n in (2, 3) for m, n in stats.calls[5:] if m == "target")  # pending + 2, or + 1 at the end
    assert len(stats.calls) == stats.draft_calls + stats.target_calls + 2  # + the two prefills
    # every round starts with the draft reading what it has not read yet, right after the target's check
    after_target = [stats.calls[i + 1][0] for i, (m, _) in enumerate(stats.calls[1:-1], 1) if m == "target"]
    assert set(after_target) == {"draft"}


def test_streaming_is_timed_apart_from_the_engine(tiny_pair):
    """The caller's on_tokens runs inside wall but is its own line of the profile, not engine overhead."""
    seen = []

    def slow_stream(new):  # work the caller does, in the timed loop
        seen.extend(new)
        sum(i * i for i in range(20000))

    greedy = tiny_pair.with_sampling(temperature=0.0)
    for dec in (SpeculativeDecoder(greedy, FixedK(2), GreedyMatch()), Autoregressive(greedy)):
        out = dec.generate(PROMPTS[5], 12, on_tokens=slow_stream)
        s = out.stats.summary()
        assert seen[-len(out.tokens):] == out.tokens and 0 < s["t_stream_s"] < s["wall_s"]
        parts = sum(s[k] for k in ("t_draft_s", "t_target_s", "t_head_s", "t_sample_s", "t_rule_s", "t_other_s",
                                   "t_stream_s"))
        assert parts == pytest.approx(s["wall_s"], rel=1e-6) or s["t_other_s"] == 0
    assert "streaming" in out.stats.profile() and "minus model forwards and streaming" in out.stats.profile()


def test_fsd_with_zero_threshold_samples_only_from_the_target(tiny_pair):
    dec = SpeculativeDecoder(tiny_pair, FixedK(3), FSD("js", threshold=0.0))
    for prompt in PROMPTS[:4]:
        stats = dec.generate(prompt, 12).stats
        assert sum(stats.accepted) == 0  # every token came from p, none from the draft


@pytest.mark.parametrize("divergence", ["js", "tv", "kl"])
def test_rfsd_with_zero_threshold_is_speculative_sampling(tiny_pair, divergence):
    for prompt in PROMPTS[:4]:
        a = SpeculativeDecoder(tiny_pair, FixedK(3), FSD(divergence, 0.0, relaxed=True), seed=5).generate(prompt, 16).tokens
        b = SpeculativeDecoder(tiny_pair, FixedK(3), SpeculativeSampling(), seed=5).generate(prompt, 16).tokens
        assert a == b


def test_sprinter_with_always_rejecting_verifier_is_sd_with_k1(tiny_pair, tmp_path):
    verifier = export_head(tmp_path, tiny_pair, cls=LinearVerifier, bias=-50.0, position="prev")
    for prompt in PROMPTS[:4]:
        ra = SpeculativeDecoder(tiny_pair, SprinterVerifier(verifier, eta=0.5), SprinterCheck(), seed=7).generate(prompt, 16)
        rb = SpeculativeDecoder(tiny_pair, FixedK(1), SpeculativeSampling(), seed=7).generate(prompt, 16)
        assert ra.tokens == rb.tokens and ra.stats.target_calls == rb.stats.target_calls


def test_speculative_sampling_on_a_one_hot_target_decides_as_greedy_matching_and_draws_its_uniforms():
    """(k,) candidates drawn from q, (k + 1, V) one-hot p: min(1, p/q) and the residual decide what greedy matching
    decides, and the row draws its k + 1 uniforms all the same (under top-p a row's law is often one-hot; skipping its
    draws then made them depend on whether its neighbours' laws were one-hot too)."""
    g = torch.Generator().manual_seed(13)
    for _ in range(300):
        k = int(torch.randint(1, 6, (), generator=g))
        q = torch.softmax(torch.randn(k, 30, generator=g) * 2, -1)
        tokens = torch.multinomial(q, 1, generator=g)[:, 0]
        agree = torch.rand(k + 1, generator=g) < 0.7  # the target's argmax is the candidate, or any token
        best = torch.where(agree, torch.cat([tokens, tokens[:1]]), torch.randint(0, 30, (k + 1,), generator=g))
        p = torch.zeros(k + 1, 30).scatter_(-1, best[:, None], 1.0)
        gen = Streams([0])
        assert SpeculativeSampling().verify(tokens, q, p, gen) == greedy_verify(tokens, p)
        assert int(gen.count[0]) == k + 1


def test_fly_with_theta_one_is_greedy_match(tiny_pair):
    greedy = tiny_pair.with_sampling(temperature=0.0)
    for prompt in PROMPTS[:4]:
        a = SpeculativeDecoder(greedy, FixedK(4), FLy(theta=1.0), seed=9).generate(prompt, 16).tokens
        b = SpeculativeDecoder(greedy, FixedK(4), GreedyMatch(), seed=9).generate(prompt, 16).tokens
        assert a == b


def test_greedy_match_under_sampling_is_refused_in_one_line(tiny_pair):
    """GreedyMatch reads the target's argmax alone: on a sampled pair it would decode greedily while counted lossless,
    so every decoder refuses it before decoding, a chain as a tree does."""
    sampled = tiny_pair.with_sampling(temperature=0.7, top_p=0.9)
    for make in (SpeculativeDecoder, BatchDecoder):
        with pytest.raises(ValueError, match=r"^GreedyMatch accepts only the target's argmax, so at temperature 0.7 "
                                             r"it would decode greedily instead of sampling: use SpeculativeSampling"):
            make(sampled, FixedK(2), GreedyMatch())
    SpeculativeDecoder(tiny_pair.with_sampling(temperature=0.0), FixedK(2), GreedyMatch())  # greedy: served
    SpeculativeDecoder(tiny_pair.with_sampling(temperature=0.7, top_k=1), FixedK(2), GreedyMatch())  # the argmax too


def test_cache_rollback_equals_fresh_forward(tiny_pair):
    dec = SpeculativeDecoder(tiny_pair, FixedK(4), SpeculativeSampling(), seed=11)
    stats = dec.generate(PROMPTS[5], 30).stats
    assert stats.discarded > 0 and sum(stats.accepted) > 0  # a mix of accepts and rejects happened
    draft, target = dec.runners
    assert target.length == len(dec.committed)
    # the draft reads a fully accepted round's last candidate only when the next round starts
    assert draft.length in (len(dec.committed) - 1, len(dec.committed))
    for runner in dec.runners:
        with torch.no_grad():
            fresh = runner.model(torch.tensor([dec.committed[: runner.length]]), use_cache=True).past_key_values
        for layer, ref in zip(runner.cache.layers, fresh.layers):
            assert torch.allclose(layer.keys, ref.keys, atol=1e-5) and torch.allclose(layer.values, ref.values, atol=1e-5)


def test_bad_input_errors(tiny_pair, tmp_path):
    dec = SpeculativeDecoder(tiny_pair, FixedK(2), SpeculativeSampling())
    with pytest.raises(ValueError, match="empty"):
        dec.generate([], 4)
    with pytest.raises(ValueError, match="exceeds the context"):
        dec.generate([1] * 120, 64)
    other = export_head(tmp_path, tiny_pair, name="other")
    import json
    from pathlib import Path

    cfg = json.loads((Path(other) / "config.json").read_text())
    cfg["draft"]["config_hash"] = "0123456789ab"
    (Path(other) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadMismatch, match="config_hash"):
        SpeculativeDecoder(tiny_pair, SpecDecPP(other), SpeculativeSampling())
    cfg["draft"] = tiny_pair.identity("draft") | {"weights": "0123456789ab"}  # the same draft distilled on
    (Path(other) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadMismatch, match="weights: .*Retrain it for this draft"):
        SpeculativeDecoder(tiny_pair, SpecDecPP(other), SpeculativeSampling())
    (Path(other) / "config.json").write_text(json.dumps(cfg | {"draft": None}))  # hand-edited: no draft recorded
    with pytest.raises(HeadMismatch, match=r"was trained on draft None, not on .*config_hash: .* was trained for None"):
        SpeculativeDecoder(tiny_pair, SpecDecPP(other), SpeculativeSampling())
    del cfg["draft"]["weights"]  # a head exported before heads recorded the weights: loads as before
    (Path(other) / "config.json").write_text(json.dumps(cfg))
    SpeculativeDecoder(tiny_pair, SpecDecPP(other), SpeculativeSampling())
    (Path(other) / "config.json").write_text(json.dumps(cfg | {"sampling": None}))  # hand-edited: no setting recorded
    with pytest.raises(ValueError, match=r"^head \S*other's config.json: a sampling setting is a mapping .*got None; "):
        SpeculativeDecoder(tiny_pair, SpecDecPP(other), SpeculativeSampling())
    # a config naming other extras than its weights read: refused at bind, not by the kernel mid-decode
    (Path(other) / "config.json").write_text(json.dumps(cfg | {"features": {"position": "own", "extras": ["draft_top1"]}}))
    with pytest.raises(HeadMismatch, match="reads 32 features, but this draft.s state of 32 and the 1 extras .* make 33"):
        SpeculativeDecoder(tiny_pair, SpecDecPP(other), SpeculativeSampling())
    for broken in ([], {k: v for k, v in cfg.items() if k != "features"}, cfg | {"calibration": {"a": 1.0}},
                   cfg | {"init_args": cfg["init_args"] | {"bogus": 1}}):  # hand-edited or cut short: one ValueError
        (Path(other) / "config.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match="corrupt or incomplete"):
            SpecDecPP(other)
    # the weights' shapes against another depth, a head type or feature position no export writes, bytes that are no
    # text: one line naming the folder and the fix (torch's state-dict report alone runs to several lines)
    depth = cfg["init_args"].get("depth", 1) + 1
    for broken in (json.dumps(cfg | {"init_args": cfg["init_args"] | {"depth": depth}}).encode(),
                   json.dumps(cfg | {"head_type": "Nope"}).encode(),
                   json.dumps(cfg | {"features": {"position": "nowhere", "extras": []}}).encode(), b"\xff\xfe{"):
        (Path(other) / "config.json").write_bytes(broken)
        with pytest.raises(ValueError, match=r"^head checkpoint \S*other .*corrupt or incomplete .*export it again$") as e:
            SpecDecPP(other)
        assert "\n" not in str(e.value)
    (Path(other) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="h must be a number in \\(0, 1\\), got 'a'"):
        SpecDecPP(other, h="a")


def test_generate_cli_streams_text_and_metrics(tiny_pair_yaml, capsys):
    """The command's own process: exit 0 with the text and the metrics on stdout; exit 2 with one line for a bad
    request, in this process as the other exit-2 cases (test_cli_rejects_out_of_range_numbers_with_one_line): the
    exit code is the SystemExit's, a process each spent seconds importing torch and transformers."""
    import os
    import subprocess

    cmd = [sys.executable, "-m", "decode", "generate", "--pair", str(tiny_pair_yaml), "--prompt", "abc(",
           "--max_new_tokens", "12", "--policy", "FixedK", "--policy.k", "3", "--rule", "FSD", "--rule.threshold", "0.2",
           "--threads", str(torch.get_num_threads())]  # the suite's share of the cores (tests/conftest.py)
    res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("abc(") and "[FixedK + FSD]" in res.stdout and "verification rate" in res.stdout
    code, _, lines = run_generate(capsys, "--pair", str(tiny_pair_yaml), "--prompt", "")
    assert code == 2 and "prompt is empty" in "\n".join(lines), lines


def test_text_stream_writes_exactly_the_decoded_text(tiny_pair):
    import io

    from decode.__main__ import TextStream

    tok = tiny_pair.tokenizer
    ids = tok("def f(x):\n    return x  # é ü\n\nprint(f(1))\n", add_special_tokens=False)["input_ids"]
    out = io.StringIO()
    stream = TextStream(tok, out)
    for i in range(0, len(ids), 3):  # rounds of three tokens, as a decoder delivers them
        stream(ids[i : i + 3])
    stream.close()
    assert out.getvalue() == tok.decode(ids)


def test_head_of_another_sampling_setting_is_refused_or_warned(tiny_pair, tmp_path):
    greedy = tiny_pair.with_sampling(temperature=0)
    t1_head = export_head(tmp_path, tiny_pair, name="specdecpp", label="SoftAcceptance")  # trained for t1
    # an FSD head has the same head type but another label family: never the one to suggest
    export_head(tmp_path, greedy, name="fsd-greedy", label="DivergenceThreshold")
    with pytest.raises(SamplingMismatch, match="trained for sampling t1 but the decoder samples greedy.*train one"):
        SpeculativeDecoder(greedy, SpecDecPP(t1_head), SpeculativeSampling())
    export_head(tmp_path, greedy, name="specdecpp-greedy", label="SoftAcceptance")  # named in the error
    with pytest.raises(SamplingMismatch, match="use .*specdecpp-greedy"):
        SpeculativeDecoder(greedy, SpecDecPP(t1_head), SpeculativeSampling())
    with pytest.warns(UserWarning, match="another acceptance event"):
        dec = SpeculativeDecoder(greedy, SpecDecPP(t1_head, allow_sampling_mismatch=True), SpeculativeSampling())
    assert 1 <= len(dec.generate(PROMPTS[0], 6).tokens) <= 6  # it decodes (EOS may come early)
    SpeculativeDecoder(tiny_pair, SpecDecPP(t1_head), SpeculativeSampling())  # same setting: accepted


def run_generate(capsys, *args):
    """`python -m decode generate ARGS` in this process (a process each spent seconds importing torch and
    transformers): (exit code, stdout, stderr lines). The torch threads the command sets are put back."""
    from decode.__main__ import main

    argv, threads, code = sys.argv, torch.get_num_threads(), 0
    sys.argv = ["python -m decode", "generate", *args]
    try:
        main()
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    return code, out.out, [line for line in out.err.splitlines() if line.strip()]


@pytest.mark.parametrize("args, option", [
    (["--max_new_tokens", "-3"], "max_new_tokens"), (["--max_new_tokens", "0"], "max_new_tokens"),
    (["--temperature", "-0.5"], "temperature"), (["--temperature", "nan"], "temperature"),
    (["--temperature", ".nan"], "temperature"), (["--temperature", ".inf"], "temperature"), (["--top_p", ".nan"], "top_p"), (["--top_p", "0"], "top_p"), (["--top_p", "1.5"], "top_p"),
    (["--policy", "FixedK", "--policy.k", "0"], "FixedK's k is a whole number"), (["--rule", "FSD", "--rule.threshold", "-1"], "threshold"),
])
def test_cli_rejects_out_of_range_numbers_with_one_line(tiny_pair_yaml, args, option, capsys):
    code, _, lines = run_generate(capsys, "--pair", str(tiny_pair_yaml), "--prompt", "abc(", *args)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error:") and option in lines[0]


def test_cli_refuses_head_of_other_setting_and_flag_allows_it(tiny_pair, tiny_pair_yaml, tmp_path, capsys):
    head = export_head(tmp_path, tiny_pair, name="t1head")
    base = ["--pair", str(tiny_pair_yaml), "--prompt", "abc(", "--head", head, "--temperature", "0", "--max_new_tokens", "4"]
    code, _, lines = run_generate(capsys, *base)
    assert code == 2 and len(lines) == 1
    assert "trained for sampling t1 but the decoder samples greedy" in lines[0]
    with pytest.warns(UserWarning, match="another acceptance event"):  # which Python prints to stderr, once
        code, out, _ = run_generate(capsys, *base, "--allow_sampling_mismatch", "true")
    assert code == 0 and out.startswith("abc(")


def test_the_batch_one_head_path_reads_what_the_batched_one_does():
    """DraftStep's numpy scalars equal the torch softmax's, and FeatureSpec.row equals build() on one row, for
    every extra: the decoder's lean batch-1 path feeds a head exactly the features it was trained on."""
    import torch

    from decode.policies import DraftStep
    from heads import FeatureSpec

    g = torch.Generator().manual_seed(0)
    for scale in (0.1, 3.0, 30.0, -1.0):
        logits = torch.randn(500, generator=g) * abs(scale)
        if scale < 0:  # masked tokens, as a logits processor leaves them
            logits[::3] = -float("inf")
        step, p = DraftStep(0, 7, None, logits, None, None), logits.softmax(-1)
        assert step.confidence == pytest.approx(float(p[7]), rel=1e-5, abs=1e-12)
        assert step.entropy == pytest.approx(float(L.entropy(p)), rel=1e-4, abs=1e-6)
        assert step.top1 == pytest.approx(float(p.max()), rel=1e-5)
    spec = FeatureSpec("prev", ["draft_entropy", "draft_top1", "cand_logq", "accepted_run"])
    hidden = torch.randn(16, generator=g)
    for run in (0, 3, 40):
        built = spec.build(hidden, torch.tensor(1.5), torch.tensor(0.4), torch.tensor(1e-30), accepted_run=torch.tensor(run))
        assert spec.row(hidden.numpy(), 1.5, 0.4, 1e-30, run) == pytest.approx(built.numpy(), rel=1e-6)


def test_steady_heap_fixes_glibcs_thresholds_or_says_it_did_not(monkeypatch):
    """decode.allocator: on Linux with glibc the thresholds are set (mallopt reports success); SPECHEADS_MALLOC=default
    and other C libraries leave the allocator alone and say so."""
    monkeypatch.setenv("SPECHEADS_MALLOC", "default")
    assert steady_heap() is False
    monkeypatch.delenv("SPECHEADS_MALLOC")
    assert steady_heap() is (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc")
