"""Speculative decoding over a batch of prompts: each row drafts, verifies, accepts and ends on its own.

    gens = BatchDecoder(pair, FixedK(4), SpeculativeSampling()).generate([ids_a, ids_b, ids_c], max_new_tokens=64)

KV caches: decode.cache.rows.RowCache rolls each row back to the text it keeps after verification by masking what it
drops (holes no later query reads, packed now and then; a sliding-window model packs at once).

Rows never leak into each other: each row draws from its own generator (seed + its index in the request), and a
decode.policies policy is copied per row (decode.control.PerRow: each copy keeps its row's state); a head's
probabilities come from one forward over the rows per step. A finished row (EOS or budget) leaves the batch's work.
The verification rules are the engine's (Rule.verify_rows: each row's slice, greedy rules in one argmax).
Host reads: one per draft step (the rows' candidates) and one per verification.
"""

from __future__ import annotations

import torch

from decode.cache.rows import RowCache, compaction
from decode.clock import clock
from decode.control import BatchControl, RowsStep, control_of
from decode.costs.batch import batch_costs, table_sizes
from decode.costs.model import tree_costs
from decode.pair import Pair
from decode.policies import HeadPolicy, Policy
from decode.results import Generation, Stats, check_prompts
from decode.rounds import Round, Texts, prepare, round_limit
from decode.rules.chain import Rule, greedy_rows
from decode.rules.tree import check_tree
from decode.sampling import argmax, pick_rows, transform
from decode.streams import Streams, check_seed
from decode.tree.round import tree_round
from decode.tree.shapes import TreeShape


def row_streams(pair: Pair, seed: int, n: int) -> Streams:
    """Row i's own stream (seed + i), its draws on the pair's device: they do not depend on which rows share its
    batch. The engine's one sequence draws from Streams([seed]), so a row alone draws what the engine does."""
    return Streams(range(seed, seed + n), pair.device)


class BatchDecoder:
    """generate(prompts) over a batch with a drafting control and a rule; returns one Generation per prompt, in order.

    policy: a decode.policies policy (copied per row, decode.control.PerRow) or a BatchControl.
    cost_sizes: the batch sizes a BatchCostAware control's cost tables are measured at (decode.costs.batch; None:
    table_sizes of the request's size).
    """

    def __init__(self, pair: Pair, policy: Policy | BatchControl, rule: Rule, seed: int = 0,
                 cost_sizes: list[int] | None = None):
        rule.check(pair.config.sampling)
        self.control = control_of(policy)
        if isinstance(self.control, TreeShape):
            check_tree(pair, rule)
        self.pair, self.policy, self.rule, self.cost_sizes = pair, policy, rule, cost_sizes
        self.seed = check_seed(seed)
        self.now = clock(pair.device)
        # a policy's or a control's head (a tree's, the controller's own); a per-row CostAwareStop prices rounds at
        # batch 1
        prepare(pair, policy, policy if isinstance(policy, HeadPolicy) else self.control.head_policy())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 64, stop_at_eos: bool = True,
                 streams: Streams | None = None) -> list[Generation]:
        """B prompts (token ids, any lengths) -> B generations, each stopping at its own EOS or max_new_tokens; a
        generation's stats.wall is when its row finished (per-row latency). stop_at_eos=False decodes every row to
        max_new_tokens, through its EOS (vLLM's ignore_eos: a throughput bench's fixed lengths). streams: the rows'
        random streams, drawn on from where they are (default: fresh ones, row i seeded seed + i)."""
        prompts = check_prompts(self.pair, prompts, max_new_tokens)
        if not prompts or not max_new_tokens:  # nothing to decode: no forward, as the engine returns no tokens
            self.stats, self.peak_bytes = Stats(), 0
            return [Generation([], "", Stats()) for _ in prompts]
        ctl, n = self.control, len(prompts)
        if ctl.needs_batch_costs and ctl.costs is None:
            sizes = self.cost_sizes or table_sizes(n)
            typical = sorted(map(len, prompts))[n // 2] + max_new_tokens // 2
            ctl.set_batch_costs(batch_costs(self.pair, sizes, prefix=typical, max_len=ctl.max_len))
        if ctl.needs_tree_costs and ctl.costs is None:  # a tree priced by width and node count
            ctl.set_tree_costs(tree_costs(self.pair, prompts[:8], nodes=ctl.nodes, width=min(16, ctl.nodes)))
        stats, t_start, ctx = Stats(), self.now(), self.pair.config.max_context
        eos = set(self.pair.eos_ids) if stop_at_eos else set()
        streams, calls = row_streams(self.pair, self.seed, n) if streams is None else streams, []  # the streams of the rows still decoding
        draft = RowCache(self.pair.draft, self.pair, n, "draft", calls, hidden=ctl.needs_hidden)
        target = RowCache(self.pair.target, self.pair, n, "target", calls)
        t0 = self.now()  # the draft reads the prompts with its first round (a request that never drafts never does)
        # The target reads each whole prompt: its last logits are the first round's p_0, so that round verifies its
        # candidates alone, and a first round that drafts nothing needs no target forward (as the target alone).
        first = target.prefill([list(ids) for ids in prompts])[0][:, None]
        stats.t_target += self.now() - t0
        rows = list(range(n))  # the request index of each batch row still decoding
        text = Texts([list(ids[:-1]) for ids in prompts], [ids[-1] for ids in prompts], [[] for _ in prompts], eos,
                     max_new_tokens)
        ends = [0.0] * n
        ctl.start(n)
        while rows:
            t_round = self.now()
            limits = [round_limit(max_new_tokens - len(text.out[r]), len(text.committed[r]), ctx) for r in rows]
            # the control chooses how far to draft (a tree shape prices this many rows' forwards); a plain target
            # step is a chain of no candidates, whatever the control
            k = ctl.begin(len(rows), limits)
            round_ = tree_round if k and isinstance(ctl, TreeShape) else self._chain_round
            done = round_(Round(ctl, self.pair.config.sampling, self.now, draft, target, rows, text, streams, limits,
                                first, stats, k))
            first = None  # the prefill's logits serve the first round alone
            if done:
                for i in done:
                    ends[rows[i]] = self.now() - t_start
                stay = compaction(len(rows), done)
                target.select(torch.tensor(stay, dtype=torch.long))
                draft.select(torch.tensor(stay, dtype=torch.long))
                ctl.select(stay)
                rows = [rows[i] for i in stay]
                streams = streams.select(stay)
            ctl.timed(1e3 * (self.now() - t_round))
        stats.new_tokens, stats.wall, stats.calls = sum(map(len, text.out)), self.now() - t_start, calls
        self.stats = stats  # the batch's counters: calls and times are the batch's, not one row's
        self.peak_bytes = draft.peak_bytes + target.peak_bytes
        return [Generation(o, self.pair.tokenizer.decode(o), Stats(new_tokens=len(o), wall=e)) for o, e in zip(text.out, ends)]

    def _chain_round(self, r: Round) -> list[int]:
        """One round of chains (as decode.tree.round.tree_round, a tree's): each row drafts up to r.depth candidates (the
        control decides how far), the target verifies, the caches keep the accepted text -> the batch positions of
        rows done."""
        ctl, draft, target, rows, text, streams, limits, first, stats = (
            r.control, r.draft, r.target, r.rows, r.text, r.streams, r.limits, r.first, r.stats)
        k_max = min(r.depth, max(limits))
        if k_max:
            k_max = self._fit(draft, target, rows, text, k_max)
        tokens, q, read = self._draft(draft, rows, text, streams, limits, k_max, stats)
        logits = self._verify_logits(target, rows, text.pending, tokens, first, stats)
        t0 = self.now()
        verdicts = self._verdicts(tokens, q, logits, streams)
        if any(tokens):
            done = self._commit(text, rows, tokens, verdicts, read, stats, target, draft)
            ctl.verified([v[0] for v in verdicts], [len(t) for t in tokens])
        else:  # a plain step: each row's one token, and no rollback (the draft read nothing, the target 1 each)
            done = [i for i, (r, (_, nxt)) in enumerate(zip(rows, verdicts)) if text.step(r, nxt)]
            none = [0] * len(rows)
            stats.rounds += len(rows)
            stats.accepted += none
            ctl.verified(none, none)
        stats.t_rule += self.now() - t0
        return done

    @staticmethod
    def _fit(draft: RowCache, target: RowCache, rows, text: Texts, k_max: int) -> int:
        """The round's most candidates, capped so neither cache grows past its model's width limit (RowCache.room).
        Each row fits alone (its limit keeps its text within the context); only a row near the context's end beside
        rows that draft more can lower the others' count, and only on models whose cache width is bounded (a causal
        buffer: GPT-Neo). There a sampled row's tokens can depend on such a neighbour; nowhere else."""
        if draft.max_width is None and target.max_width is None:  # nothing bounds the width (most models)
            return k_max
        unread = max(len(text.committed[r]) + 1 - int(x) for r, x in zip(rows, draft.length))
        fit = min(k_max, draft.room(unread + k_max - 1) - unread + 1, target.room(k_max + 1) - 1)
        return max(0, fit)

    @staticmethod
    def _commit(text: Texts, rows, tokens, verdicts, read, stats, target: RowCache, draft: RowCache) -> list[int]:
        """A drafting round's verdicts into each row's text and both caches -> the batch positions of rows done."""
        done, keep_t, keep_d = [], [], []
        for i, (r, (n_acc, nxt)) in enumerate(zip(rows, verdicts)):
            k = len(tokens[i])
            stats.rounds, stats.drafted, stats.discarded = stats.rounds + 1, stats.drafted + k, stats.discarded + k - n_acc
            stats.accepted.append(n_acc)
            if text.commit(r, tokens[i][:n_acc], nxt):
                done.append(i)
            keep_t.append(len(text.committed[r]))
            keep_d.append(min(read[i], len(text.committed[r])))  # what the draft read of the text that stands
        target.keep(torch.tensor(keep_t))
        draft.keep(torch.tensor(keep_d))
        return done

    def _verdicts(self, tokens, q, logits, row_streams: Streams) -> list[tuple[int, int]]:
        """Each row's (accepted, next token): the rule's verification, or in a plain target step (no candidates) the
        target's own pick, as the target alone draws it (the rule's bonus token has the same law, at more cost)."""
        s = self.pair.config.sampling
        greedy = self.rule.decides_by_argmax(s)  # as in the engine
        if not any(tokens):
            picks = argmax(logits[:, 0]).tolist() if greedy else pick_rows(logits[:, 0], s, row_streams, want_q=False)[0]
            return [(0, t) for t in picks]
        if greedy:
            return greedy_rows(tokens, logits)
        return self.rule.verify_rows(tokens, q, transform(logits, s), row_streams)

    def _verify_logits(self, target: RowCache, rows, pending, tokens, first, stats) -> torch.Tensor:
        """(B, M + 1, V) the target's logits after each row's pending token and after each of its candidates: one
        forward over [pending] + candidates, or, in the first round, the prefill's (B, 1, V) first and a forward over
        the candidates alone (none if no row drafted)."""
        if first is not None and not any(tokens):
            return first
        t0 = self.now()
        chunks = [t if first is not None else [pending[r]] + t for r, t in zip(rows, tokens)]
        logits, _ = target.feed(chunks, trim=False)
        stats.t_target += self.now() - t0
        stats.target_calls += 1
        return logits if first is None else torch.cat([first, logits], 1)

    def _draft(self, draft: RowCache, rows, text: Texts, row_streams: Streams, limits, k_max, stats):
        """One drafting round for every row -> each row's candidates, (M, R, V) their q (None if none, or if greedy
        verification reads none) and the tokens each row's draft cache holds of real text. A row stops on its own (the control or its limit); the batch
        drafts while any row does, feeding a stopped row filler that the round's keep() cuts. As in the engine, a
        candidate is read only to draft the next one, or before the stop decision when the control needs the state
        after it ("own" heads)."""
        tokens: list[list[int]] = [[] for _ in rows]
        if k_max == 0:  # a plain target step: the draft reads the text later, when a round drafts
            return tokens, None, draft.length.tolist()
        s, own = self.pair.config.sampling, self.control.reads_own_state
        want_q = not self.rule.decides_by_argmax(s)  # else verification reads no q (_verdicts)
        unread = [text.committed[r][int(x):] + [text.pending[r]] for r, x in zip(rows, draft.length)]
        t0 = self.now()
        logits, hidden = draft.feed(unread)
        stats.t_draft, stats.draft_calls = stats.t_draft + self.now() - t0, stats.draft_calls + 1
        idx, last = torch.arange(len(rows)), torch.tensor([len(u) - 1 for u in unread])
        raw = logits[idx, last]
        state = None if hidden is None else hidden[idx, last.to(hidden.device)]
        read, qs, live = draft.length.tolist(), [], list(range(len(rows)))
        while True:
            t0 = self.now()
            if len(live) < len(rows):  # only rows still drafting draw (a row's stream never depends on others)
                picked, q_live = pick_rows(raw[torch.tensor(live)], s, row_streams.select(live), want_q)
                q = None if q_live is None else \
                    raw.new_zeros(raw.shape).index_copy_(0, torch.tensor(live, device=raw.device), q_live)
                picked = dict(zip(live, picked))
            else:
                picked, q = pick_rows(raw, s, row_streams, want_q)
            stats.t_sample += self.now() - t0
            qs.append(q)
            for i in live:
                tokens[i].append(picked[i])
            deciding = [i for i in live if len(tokens[i]) < min(k_max, limits[i])]
            if not own and deciding:
                deciding = self._decide(deciding, tokens, q, raw, state, None, stats)
            if not deciding:
                break
            feed = [[t[-1]] for t in tokens]  # a row that stopped is fed its last token again: filler
            t0 = self.now()
            logits, hidden = draft.feed(feed, trim=False)
            stats.t_draft, stats.draft_calls = stats.t_draft + self.now() - t0, stats.draft_calls + 1
            for i in deciding:
                read[i] += 1
            drew, raw, after = raw, logits[:, 0], None if hidden is None else hidden[:, 0]
            if own:  # the decision reads the state after the candidate, which this feed computed
                deciding = self._decide(deciding, tokens, q, drew, state, after, stats)
                if not deciding:
                    break
            state, live = after, deciding
        return tokens, None if qs[0] is None else torch.stack(qs), read

    def _decide(self, deciding, tokens, q, raw, before, after, stats) -> list[int]:
        """The control sees each deciding row's last candidate -> the rows that draft on."""
        t0 = self.now()
        if len(deciding) == len(tokens):  # every row decides (as always at batch 1): the tensors as they are
            def pick(x):
                return x
        else:
            rows = torch.tensor(deciding)

            def pick(x):
                return None if x is None else x[rows.to(x.device)]
        step = RowsStep(len(tokens[deciding[0]]) - 1, deciding, [tokens[i][-1] for i in deciding], pick(q), pick(raw),
                        pick(before), pick(after))
        go = self.control.decide(step)
        stats.t_head += self.now() - t0
        return [i for i, g in zip(deciding, go) if g]


class BatchAutoregressive:
    """The target (or draft) alone over a batch, on the same caches and row streams: the batched baseline, and the
    reference batched speculative output is compared with."""

    def __init__(self, pair: Pair, which: str = "target", seed: int = 0):
        self.pair, self.which, self.seed = pair, which, check_seed(seed)
        self.now = clock(pair.device)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 64, stop_at_eos: bool = True) -> list[Generation]:
        """B prompts -> B generations, one forward of the batch per token (the first token's is the prefill);
        stop_at_eos as BatchDecoder.generate's."""
        prompts = check_prompts(self.pair, prompts, max_new_tokens)
        if not prompts or not max_new_tokens:
            self.stats, self.peak_bytes = Stats(), 0
            return [Generation([], "", Stats()) for _ in prompts]
        n, stats, t_start = len(prompts), Stats(), self.now()
        eos = set(self.pair.eos_ids) if stop_at_eos else set()
        streams = row_streams(self.pair, self.seed, n)  # the streams of the rows still decoding
        cache = RowCache(getattr(self.pair, self.which), self.pair, n, self.which, stats.calls)
        logits, _ = cache.prefill([list(ids) for ids in prompts])  # the first token comes from the prefill
        rows, nxt, out = list(range(n)), [0] * n, [[] for _ in prompts]
        ends = [0.0] * n
        while True:
            picked, _ = pick_rows(logits, self.pair.config.sampling, streams, want_q=False)
            gone = []
            for i, (r, tok) in enumerate(zip(rows, picked)):
                out[r].append(tok)
                nxt[r] = tok
                if tok in eos or len(out[r]) >= max_new_tokens:
                    ends[r] = self.now() - t_start
                    gone.append(i)
            if gone:
                stay = compaction(len(rows), gone)
                cache.select(torch.tensor(stay, dtype=torch.long))
                rows = [rows[i] for i in stay]
                streams = streams.select(stay)
            if not rows:
                break
            cache.room(1)  # a model whose cache width is bounded packs its rows before passing it
            logits = cache.feed([[nxt[r]] for r in rows])[0][:, 0]
        stats.new_tokens, stats.wall = sum(map(len, out)), self.now() - t_start
        setattr(stats, f"{self.which}_calls", len(stats.calls))  # batch forwards, the prefill's included
        self.stats, self.peak_bytes = stats, cache.peak_bytes
        return [Generation(o, self.pair.tokenizer.decode(o), Stats(new_tokens=len(o), wall=e)) for o, e in zip(out, ends)]
