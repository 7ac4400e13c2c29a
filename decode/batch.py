"""Speculative decoding over a batch of prompts: each row drafts, verifies, accepts and ends on its own.

    gens = BatchDecoder(pair, FixedK(4), SpeculativeSampling()).generate([ids_a, ids_b, ids_c], max_new_tokens=64)

KV caches (RowCache): every row's text is contiguous and ends at the cache's last column; rows are left-padded
behind an attention mask, and each forward gets explicit per-row position ids. A forward feeds each row its own
number of tokens, right-padded within the step: causal attention keeps a row's real tokens from reading the filler
after them. After the forward (and after verification) each row is cut back to the text it keeps by moving its
cache right and widening its left padding (one gather per layer), so the rows stay right-aligned. So the physical
distance between two real tokens is their distance in the text, which is what sliding-window masks measure, and
rejected positions never stay behind a mask (the scheme that corrupts rows at larger batch sizes).

Rows never leak into each other: each row draws from its own generator (seed + its index in the request), and
the drafting policy is copied per row (decode.policies: each copy keeps its row's state). A finished row (EOS or
budget) leaves the batch's work. The verification rules are the engine's, applied to each row's slice.
"""

from __future__ import annotations

import copy

import torch

from decode.costs import clock, measure_costs
from decode.engine import Generation, Stats, check_prompt
from decode.kvcache import forward, rollback_cache
from decode.pair import Pair, input_device
from decode.policies import DraftStep, HeadPolicy, Policy
from decode.rules import Rule
from decode.sampling import pick, transform


class RowCache:
    """One model's KV cache over B rows, right-aligned: row b's tokens fill the last columns, the first pad[b] columns
    are padding (masked). Rows that hold filler after a feed hold it at the end, until keep() cuts it."""

    def __init__(self, model, pair: Pair, rows: int, name: str, calls: list, hidden: bool = False):
        self.model, self.pair, self.name, self.calls, self.hidden = model, pair, name, calls, hidden
        self.cache, self.device = rollback_cache(), input_device(model)
        self.pad = torch.zeros(rows, dtype=torch.long)
        self.width = 0

    @property
    def length(self) -> torch.Tensor:
        """(B,) tokens each row holds."""
        return self.width - self.pad

    def mask(self, extra: int) -> torch.Tensor:
        """(B, width + extra) attention mask: 0 on each row's left padding."""
        cols = torch.arange(self.width + extra)
        return (cols[None, :] >= self.pad[:, None]).long().to(self.device)

    @torch.no_grad()
    def feed(self, chunks: list[list[int]], trim: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row b's tokens chunks[b] (a prefill's may be empty) -> (B, M, V) float32 logits and (B, M, H) hidden states
        (None unless hidden), M the longest chunk: row b's are at [:len(chunks[b])], the rest is filler, cut here
        unless trim is False (the caller's keep() cuts it with what verification rejects: one move, not two)."""
        sizes = torch.tensor([len(c) for c in chunks])
        m = int(sizes.max())
        ids = torch.tensor([c + [c[-1] if c else 0] * (m - len(c)) for c in chunks], device=self.device)
        before = self.length
        pos = (before[:, None] + torch.arange(m)[None, :]).to(self.device)
        out = forward(self.model, ids, self.cache, hidden=self.hidden, attention_mask=self.mask(m), position_ids=pos)
        out, state = out if self.hidden else (out, None)
        self.width += m
        self.calls.append((self.name, m))
        if trim and bool((sizes < m).any()):
            self.keep(before + sizes)
        return self.pair.logits(out.logits), state

    def keep(self, lengths: torch.Tensor) -> None:
        """Cut row b back to its first lengths[b] tokens (at most what it holds): its cache moves right by what it
        drops beyond the row that drops least, and columns that every row pads are cut from the left."""
        drop = self.length - lengths
        if bool((drop < 0).any()):
            raise ValueError(f"a row cannot keep more tokens than its cache holds: {lengths.tolist()}")
        shift, width = drop - drop.min(), self.width - int(drop.min())
        left = int((width - lengths).min())  # columns that are padding in every row
        idx = (torch.arange(left, width)[None, :] - shift[:, None]).clamp_min(0)
        moved = bool(shift.any())
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            if moved:
                k = layer.keys
                g = idx.to(k.device)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
                layer.keys, layer.values = k.gather(2, g), layer.values.gather(2, g)
            else:
                layer.keys, layer.values = layer.keys[:, :, left:width], layer.values[:, :, left:width]
        self.width = width - left
        self.pad = self.width - lengths

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (indices into the current batch), in this order."""
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                r = rows.to(layer.keys.device)
                layer.keys, layer.values = layer.keys.index_select(0, r), layer.values.index_select(0, r)
        self.pad = self.pad.index_select(0, rows)
        left = int(self.pad.min()) if len(rows) else 0
        if left:
            self.keep(self.length)


def row_generators(pair: Pair, seed: int, n: int) -> list[torch.Generator]:
    """Row i's own stream (seed + i), on the device its draws are used: its draws do not depend on which rows share
    its batch."""
    return [torch.Generator(device=pair.device).manual_seed(seed + i) for i in range(n)]


class BatchDecoder:
    """generate(prompts) over a batch with a policy and a rule; returns one Generation per prompt, in order.

    The policy is copied for each row (its state is the row's); a HeadPolicy is bound once, so its head is shared.
    """

    def __init__(self, pair: Pair, policy: Policy, rule: Rule, seed: int = 0):
        self.pair, self.policy, self.rule, self.seed = pair, policy, rule, seed
        self.now = clock(pair.device)
        if isinstance(policy, HeadPolicy):
            policy.bind(pair.identity("draft"), pair.config.sampling)
        if policy.needs_costs:
            policy.set_costs(*measure_costs(pair))
        if policy.needs_target_peek:
            raise ValueError(f"{type(policy).__name__} peeks at the target off the books and decodes one sequence at "
                             "a time: use decode.engine.SpeculativeDecoder")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 64) -> list[Generation]:
        """B prompts (token ids, any lengths) -> B generations, each stopping at its own EOS or max_new_tokens."""
        for ids in prompts:
            check_prompt(self.pair, ids, max_new_tokens)
        n, stats, t_start = len(prompts), Stats(), self.now()
        gens, eos, ctx = row_generators(self.pair, self.seed, n), set(self.pair.eos_ids), self.pair.config.max_context
        calls: list = []
        draft = RowCache(self.pair.draft, self.pair, n, "draft", calls, hidden=self.policy.needs_hidden)
        target = RowCache(self.pair.target, self.pair, n, "target", calls)
        for cache, slot in ((draft, "t_draft"), (target, "t_target")):
            t0 = self.now()
            cache.feed([list(ids[:-1]) for ids in prompts])
            setattr(stats, slot, getattr(stats, slot) + self.now() - t0)
        rows = list(range(n))  # the request index of each batch row still decoding
        committed = [list(ids[:-1]) for ids in prompts]
        pending = [ids[-1] for ids in prompts]
        unread: list[list[int]] = [[] for _ in prompts]  # accepted text the draft has not read yet
        out: list[list[int]] = [[] for _ in prompts]
        policies = [copy.copy(self.policy) for _ in prompts]
        for pol in policies:
            pol.start()
        while rows:
            limits = [max(1, min(max_new_tokens - len(out[r]), ctx - len(committed[r]) - 2)) for r in rows]
            tokens, qs = self._draft(draft, rows, pending, unread, policies, gens, limits, stats)
            t0 = self.now()
            logits, _ = target.feed([[pending[r]] + tokens[i] for i, r in enumerate(rows)], trim=False)
            stats.t_target += self.now() - t0
            stats.target_calls += 1
            t0 = self.now()
            p = transform(logits, self.pair.config.sampling)
            done, keep_t, keep_d = [], [], []
            for i, r in enumerate(rows):
                k = len(tokens[i])
                n_acc, nxt = self.rule.verify(torch.tensor(tokens[i], device=p.device), qs[i], p[i, : k + 1], gens[r])
                stats.rounds, stats.drafted, stats.discarded = stats.rounds + 1, stats.drafted + k, stats.discarded + k - n_acc
                stats.accepted.append(n_acc)
                policies[r].verified(n_acc, k)
                read = int(draft.length[i]) - len(committed[r])  # of pending + candidates, what the draft has read
                committed[r] += [pending[r]] + tokens[i][:n_acc]
                keep_t.append(len(committed[r]))
                keep_d.append(len(committed[r]) - max(0, 1 + n_acc - read))
                unread[r] = committed[r][keep_d[-1]:]
                new = tokens[i][:n_acc] + [nxt]
                end = next((j for j, t in enumerate(new) if t in eos), None)
                out[r] += new[: None if end is None else end + 1]
                pending[r] = nxt
                if end is not None or len(out[r]) >= max_new_tokens:
                    out[r] = out[r][:max_new_tokens]
                    done.append(i)
            target.keep(torch.tensor(keep_t))
            draft.keep(torch.tensor(keep_d))
            stats.t_rule += self.now() - t0
            if done:
                stay = torch.tensor([i for i in range(len(rows)) if i not in set(done)], dtype=torch.long)
                target.select(stay)
                draft.select(stay)
                rows = [rows[i] for i in stay.tolist()]
        stats.new_tokens, stats.wall, stats.calls = sum(map(len, out)), self.now() - t_start, calls
        self.stats = stats  # the batch's counters: calls and times are the batch's, not one row's
        return [Generation(o, self.pair.tokenizer.decode(o), Stats(new_tokens=len(o))) for o in out]

    def _draft(self, draft: RowCache, rows, pending, unread, policies, gens, limits, stats):
        """One drafting round for every row -> each row's candidates and (k, V) q. A row stops on its own (its policy
        or its limit); the batch drafts while any row does, and a stopped row's further feeds are filler that the
        verification's keep() cuts. As in the engine, a candidate is read only to draft the next one, or before the
        stop decision when the policy needs the state after it ("own" heads)."""
        s, own, idx = self.pair.config.sampling, self.policy.reads_own_state, torch.arange(len(rows))
        for r in rows:
            policies[r].reset()
        t0 = self.now()
        logits, hidden = draft.feed([unread[r] + [pending[r]] for r in rows])
        stats.t_draft, stats.draft_calls = stats.t_draft + self.now() - t0, stats.draft_calls + 1
        last = torch.tensor([len(unread[r]) for r in rows])  # each row's last real position in that chunk
        raw = logits[idx, last]
        state = None if hidden is None else hidden[idx, last.to(hidden.device)]
        tokens, qs, live = [[] for _ in rows], [[] for _ in rows], [True] * len(rows)
        while True:
            t0 = self.now()
            for i, r in enumerate(rows):
                if live[i]:
                    tok, q = pick(raw[i], s, gens[r])
                    tokens[i].append(tok), qs[i].append(q)
            stats.t_sample += self.now() - t0
            deciding = [i for i, r in enumerate(rows) if live[i] and len(tokens[i]) < min(policies[r].max_len, limits[i])]
            live = [i in set(deciding) for i in range(len(rows))]
            if not own:
                self._decide(rows, deciding, live, tokens, qs, raw, state, None, policies, stats)
            if not any(live) if not own else not deciding:
                break
            drew = raw
            t0 = self.now()
            logits, hidden = draft.feed([[t[-1]] for t in tokens])
            stats.t_draft, stats.draft_calls = stats.t_draft + self.now() - t0, stats.draft_calls + 1
            raw, after = logits[:, 0], None if hidden is None else hidden[:, 0]
            if own:  # the decision reads the state after the candidate, which this feed computed
                self._decide(rows, deciding, live, tokens, qs, drew, state, after, policies, stats)
                if not any(live):
                    break
            state = after
        return tokens, [torch.stack(q) for q in qs]

    def _decide(self, rows, deciding, live, tokens, qs, raw, before, after, policies, stats) -> None:
        """Each deciding row's policy sees its last candidate (DraftStep as the engine builds it); live[i] = go on."""
        t0 = self.now()
        for i in deciding:
            step = DraftStep(len(tokens[i]) - 1, tokens[i][-1], qs[i][-1], raw[i],
                             None if before is None else before[i], None if after is None else after[i])
            live[i] = not policies[rows[i]].stop(step)
        stats.t_head += self.now() - t0


class BatchAutoregressive:
    """The target (or draft) alone over a batch, on the same caches and row streams: the batched baseline, and the
    reference batched speculative output is compared with."""

    def __init__(self, pair: Pair, which: str = "target", seed: int = 0):
        self.pair, self.which, self.seed = pair, which, seed
        self.now = clock(pair.device)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 64) -> list[Generation]:
        """B prompts -> B generations, one forward of the batch per token."""
        for ids in prompts:
            check_prompt(self.pair, ids, max_new_tokens)
        n, stats, t_start, eos = len(prompts), Stats(), self.now(), set(self.pair.eos_ids)
        gens = row_generators(self.pair, self.seed, n)
        cache = RowCache(getattr(self.pair, self.which), self.pair, n, self.which, stats.calls)
        cache.feed([list(ids[:-1]) for ids in prompts])
        rows, nxt, out = list(range(n)), [ids[-1] for ids in prompts], [[] for _ in prompts]
        while rows:
            logits, _ = cache.feed([[nxt[r]] for r in rows])
            stay = []
            for i, r in enumerate(rows):
                tok, _ = pick(logits[i, 0], self.pair.config.sampling, gens[r])
                out[r].append(tok)
                nxt[r] = tok
                if tok not in eos and len(out[r]) < max_new_tokens:
                    stay.append(i)
            if len(stay) < len(rows):
                cache.select(torch.tensor(stay, dtype=torch.long))
                rows = [rows[i] for i in stay]
        stats.new_tokens, stats.wall = sum(map(len, out)), self.now() - t_start
        setattr(stats, f"{self.which}_calls", len(stats.calls) - 1)  # batch forwards after the prefill
        self.stats = stats
        return [Generation(o, self.pair.tokenizer.decode(o), Stats(new_tokens=len(o))) for o in out]
