"""The one-sequence loop: a drafting policy and a verification rule over a draft/target pair, one prompt at a time.

Both models keep a KV cache that covers every committed token but the last ("pending")
one; after each round the caches are cropped back to the accepted text, never recomputed.
Rows of a batch decode in decode.batch; a token tree goes there too, as a batch of one row. This loop stays
apart because it is leaner at one sequence (no row bookkeeping), and its chain rounds are the reference the
batched ones are held to (tests/test_batch.py).

Devices: input ids go to each model's input device, logits meet on the pair's device (Pair.logits), random
draws come from a generator on that device, and every clock read on a GPU waits for its queued work first.
"""

from __future__ import annotations

import torch

from decode.batch import BatchDecoder
from decode.cache.kv import crop_cache, forward, rollback_cache
from decode.clock import clock
from decode.pair import Pair, input_device
from decode.policies import DraftStep, HeadPolicy, Policy
from decode.results import Generation, Stats, check_prompt, check_prompts  # noqa: F401  (re-exported)
from decode.rounds import Texts, prepare, round_limit
from decode.rules.chain import Rule, greedy_rows
from decode.sampling import one_hots, pick, transform
from decode.streams import Streams
from decode.tree.shapes import TreeShape


class Runner:
    """One model with its KV cache; feed() appends tokens, crop() rolls the cache back.

    hidden: also return last-layer hidden states (only a head policy's draft needs them).
    calls: the (model, tokens) log it appends to; runners of one generation share one, so the log keeps
    the order of the calls (the cost model prices a forward by whether the other model ran just before).
    """

    def __init__(self, model, pair: Pair, hidden: bool = False, name: str = "target",
                 calls: list[tuple[str, int]] | None = None):
        self.model, self.pair, self.cache, self.length, self.hidden = model, pair, rollback_cache(), 0, hidden
        self.name, self.calls = name, calls if calls is not None else []
        self.device = input_device(model)

    @torch.no_grad()
    def feed(self, tokens: list[int], last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k new tokens -> (k, V) float32 logits on the pair's device and (k, H) last-layer hidden states on
        the model's (None unless hidden); with last_only, those of the last token alone (a prefill's: no
        (T, V) logits of a long prompt)."""
        x = torch.tensor([tokens], device=self.device)
        out = forward(self.model, x, self.cache, hidden=self.hidden, **({"logits_to_keep": 1} if last_only else {}))
        out, state = out if self.hidden else (out, None)
        self.length += len(tokens)
        self.calls.append((self.name, len(tokens)))
        return self.pair.logits(out.logits[0]), state[0] if self.hidden else None

    def crop(self, length: int) -> None:
        if length < self.length:
            crop_cache(self.cache, length)
            self.length = length


class TargetView:
    """What a ceiling (Policy.sees_target) reads of the target, off the books: the text the round drafts after
    (prefix: committed text and pending token), the generation's prompt, max_new and whether it stops at the EOS,
    and the target's logits after any prefix. Its time goes to stats.t_oracle, which the measured wall leaves out."""

    def __init__(self, pair: Pair, now):
        self.pair, self.now = pair, now
        self.prefix: list[int] = []
        self.prompt: list[int] = []
        self.max_new, self.stats, self.stop_at_eos = 0, Stats(), True

    def off_books(self, fn, *args):
        """fn(*args), its time counted as the oracle's."""
        t0 = self.now()
        out = fn(*args)
        self.stats.t_oracle += self.now() - t0
        return out

    def logits_after(self, prefix: list[int]) -> torch.Tensor:
        """(V,) the target's raw logits after prefix, run over it whole."""
        return self.off_books(self._logits_after, prefix)

    @torch.no_grad()
    def _logits_after(self, prefix: list[int]) -> torch.Tensor:
        x = torch.tensor([prefix], device=self.pair.input_device("target"))
        return self.pair.logits(self.pair.target(x).logits[0, -1])


class SpeculativeDecoder:
    """generate(prompt_ids) with a policy and a rule; each call returns its own stats."""

    def __init__(self, pair: Pair, policy: Policy, rule: Rule, seed: int = 0):
        rule.check(pair.config.sampling)
        self.pair, self.policy, self.rule = pair, policy, rule
        self.rows = None
        if isinstance(policy, TreeShape):  # a token tree's round is the batched decoder's, over a batch of one row
            self.rows = BatchDecoder(pair, policy, rule, seed)
        self.gen = Streams([seed], pair.device)
        if self.rows is not None:
            return
        self.now = clock(pair.device)
        prepare(pair, policy, policy if isinstance(policy, HeadPolicy) else None)
        self.view = TargetView(pair, self.now) if policy.sees_target else None

    def _timed(self, which: str, stats: Stats, fn, *args):
        t0 = self.now()
        out = fn(*args)
        setattr(stats, which, getattr(stats, which) + self.now() - t0)
        return out

    def _draft_round(self, draft: Runner, seq: list[int], stats: Stats, limit: int):
        """Draft candidates after seq (committed text + pending token) until the policy stops or
        `limit` is reached -> tokens and their k distributions q (None each under greedy decoding on the CPU).

        The draft first reads what of seq it has not read yet (the pending token, and the last
        candidate of the previous round when that round accepted everything). A candidate is read
        only to draft the next one, or before the stop decision when the policy needs the state
        after it ("own" heads); so a plain policy costs k draft calls for k candidates, not k + 1.
        """
        s, policy = self.pair.config.sampling, self.policy
        policy.reset()
        logits, hidden = self._timed("t_draft", stats, draft.feed, seq[draft.length:])
        stats.draft_calls += 1
        tokens, qs = [], []
        if self.view is not None:
            self.view.prefix = seq
        own, head = policy.reads_own_state, isinstance(policy, HeadPolicy)
        # Greedy on the CPU: the argmax alone per candidate, and the round's one-hot rows built at once when it ends
        # (a (V,) one-hot per candidate, right after each draft forward, cost more: docs/engine.md)
        want_q = not (s.temperature == 0 and logits.device.type == "cpu")
        while True:
            t0 = self.now()
            raw = logits[-1]
            tok, q = pick(raw, s, self.gen, want_q)
            stats.t_sample += self.now() - t0
            tokens.append(tok), qs.append(q)
            if len(tokens) >= min(policy.max_len, limit):
                return tokens, qs
            prev = hidden[-1] if hidden is not None else None
            if own:  # the decision reads the state after the candidate: read it first
                logits, hidden = self._timed("t_draft", stats, draft.feed, [tok])
                stats.draft_calls += 1
            step = DraftStep(len(tokens) - 1, tok, q, raw, prev, hidden[-1] if own else None)
            t0, t_oracle = self.now(), stats.t_oracle
            stop = policy.stop(step)
            stats.t_head += self.now() - t0 - (stats.t_oracle - t_oracle)
            if head:  # the cost model prices each head decision (decode.costs.model.CostModel.head)
                draft.calls.append(("head", 1))
            if stop:
                return tokens, qs
            if not own:
                logits, hidden = self._timed("t_draft", stats, draft.feed, [tok])
                stats.draft_calls += 1

    def _stacked(self, qs: list, tokens: list[int], vocab: int, stats: Stats) -> torch.Tensor:
        """The round's (k, V) q: its candidates' distributions, or under greedy decoding on the CPU (qs of None)
        their one-hot rows, built now in one array (timed as the draft's sampling)."""
        if qs[0] is not None:
            return torch.stack(qs)
        t0 = self.now()
        q = one_hots(tokens, vocab)
        stats.t_sample += self.now() - t0
        return q

    def _verify(self, tokens: list[int], qs: list, logits: torch.Tensor, stats: Stats) -> tuple[int, int]:
        """The rule's verdict on the round -> (accepted, next token), timed as the rule. A rule that is greedy
        matching under a greedy target (Rule.matches_greedily) reads the target's argmax alone: the one-hot
        distributions it would otherwise be handed decide nothing more."""
        s = self.pair.config.sampling
        if self.rule.decides_by_argmax(s):
            t0 = self.now()
            verdict = greedy_rows([tokens], logits[None])[0]
        else:
            q = self._stacked(qs, tokens, logits.shape[-1], stats)
            t0 = self.now()
            verdict = self.rule.verify(torch.tensor(tokens, device=q.device), q, transform(logits, s), self.gen)
        stats.t_rule += self.now() - t0
        return verdict

    def generate(self, prompt_ids: list[int], max_new_tokens: int = 64, on_tokens=None,
                 stop_at_eos: bool = True) -> Generation:
        """Prompt token ids -> new tokens (stops at EOS or max_new_tokens), text and stats.

        on_tokens(list[int]) is called with each round's new tokens, for streaming. stop_at_eos=False decodes all
        max_new_tokens through the EOS (a bench's fixed lengths, as the batched loop's).
        """
        prompt_ids = check_prompt(self.pair, prompt_ids, max_new_tokens)
        if self.rows is not None:
            out = self.rows.generate([prompt_ids], max_new_tokens, stop_at_eos,
                                     streams=self.gen)[0]  # the engine's stream
            if on_tokens is not None and out.tokens:  # a batch emits when its row ends: one call, not one a round
                on_tokens(out.tokens)
            return Generation(out.tokens, out.text, self.rows.stats)
        stats, eos = Stats(), set(self.pair.eos_ids) if stop_at_eos else set()
        draft = Runner(self.pair.draft, self.pair, hidden=self.policy.needs_hidden, name="draft")
        target = Runner(self.pair.target, self.pair, calls=draft.calls)
        t_start = self.now()
        if len(prompt_ids) > 1:
            self._timed("t_draft", stats, draft.feed, prompt_ids[:-1], True)
            self._timed("t_target", stats, target.feed, prompt_ids[:-1], True)
        text = Texts([list(prompt_ids[:-1])], [prompt_ids[-1]], [[]], eos, max_new_tokens)
        committed, out = text.committed[0], text.out[0]  # the one row's, updated in place by text.commit
        if self.view is not None:  # bound anew each generation: a replay in between leaves the policy no stale view
            self.view.prompt, self.view.max_new, self.view.stats = prompt_ids, max_new_tokens, stats
            self.view.stop_at_eos = stop_at_eos
            self.policy.bind_view(self.view)
        self.policy.start()
        while max_new_tokens:
            # Never draft past max_new_tokens or past the context (the target verifies k + 1 positions).
            limit = round_limit(max_new_tokens - len(out), len(committed), self.pair.config.max_context)
            tokens, qs = self._draft_round(draft, committed + [text.pending[0]], stats, limit)
            logits, _ = self._timed("t_target", stats, target.feed, [text.pending[0]] + tokens)
            stats.target_calls += 1
            n_acc, nxt = self._verify(tokens, qs, logits, stats)
            stats.rounds, stats.drafted = stats.rounds + 1, stats.drafted + len(tokens)
            stats.discarded += len(tokens) - n_acc
            stats.accepted.append(n_acc)
            self.policy.verified(n_acc, len(tokens))
            emitted = len(out)
            ended = text.commit(0, tokens[:n_acc], nxt)  # the batched loop's commit and EOS cut (decode.rounds)
            draft.crop(len(committed))
            target.crop(len(committed))
            if on_tokens is not None:
                t0 = self.now()
                on_tokens(out[emitted:])
                stats.t_stream += self.now() - t0
            if ended:
                break
        stats.new_tokens = len(out)
        stats.wall = self.now() - t_start - stats.t_oracle
        stats.calls = draft.calls  # shared with the target's runner: every forward, in order
        self.runners, self.committed = (draft, target), committed  # kept for inspection (cache tests)
        return Generation(out, self.pair.tokenizer.decode(out), stats)


class Autoregressive:
    """One model alone (target-only or draft-only baseline) with the same sampling and stats."""

    def __init__(self, pair: Pair, which: str = "target", seed: int = 0):
        self.pair, self.which = pair, which
        self.gen = Streams([seed], pair.device)
        self.now = clock(pair.device)

    def generate(self, prompt_ids: list[int], max_new_tokens: int = 64, on_tokens=None,
                 stop_at_eos: bool = True) -> Generation:
        """Prompt token ids -> new tokens, text and stats, one target (or draft) call per token (stop_at_eos as
        SpeculativeDecoder.generate's)."""
        prompt_ids = check_prompt(self.pair, prompt_ids, max_new_tokens)
        stats, eos = Stats(), set(self.pair.eos_ids) if stop_at_eos else set()
        runner = Runner(getattr(self.pair, self.which), self.pair, name=self.which)
        slot = "t_target" if self.which == "target" else "t_draft"
        t0 = self.now()
        logits, _ = runner.feed(prompt_ids, last_only=True)
        out = []
        while len(out) < max_new_tokens:
            s = self.pair.config.sampling
            tok, _ = pick(logits[-1], s, self.gen)
            out.append(tok)
            if on_tokens is not None:
                t1 = self.now()
                on_tokens([tok])
                stats.t_stream += self.now() - t1
            if tok in eos or len(out) == max_new_tokens:
                break
            t1 = self.now()
            logits, _ = runner.feed([tok])
            setattr(stats, slot, getattr(stats, slot) + self.now() - t1)
        if self.which == "target":
            stats.target_calls = len(out)
        else:
            stats.draft_calls = len(out)
        stats.new_tokens, stats.wall, stats.calls = len(out), self.now() - t0, runner.calls
        return Generation(out, self.pair.tokenizer.decode(out), stats)


