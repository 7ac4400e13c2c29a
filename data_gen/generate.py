"""Label one batch of prompts: target responses, mixed draft sequences, per-position quantities.

For each prompt x (left-padded batch, KV caches):
  1. the target samples a response y_1..y_N under the pair's sampling transform;
  2. the draft walks the response once: at position i it draws a candidate c_i ~ q(. | x, z_<i),
     then reads z_i = y_i (from_target, probability r of the sequence's prefix kind) or c_i;
  3. teacher-forced target passes over (x, z), a stretch at a time as the walk goes (data_gen.scores),
     give p(. | x, z_<i) at every position, and the labels keep per-position scalars only.
So p, q, c_i and every label are conditioned on the same mixed prefix z_<i the head reads, and
c_i is an exact sample of q at that prefix (the acceptance event decode will face).
Every random draw uses a per-prompt generator, so a prompt's record does not depend on which
batch, process or resumed run labelled it.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from data_gen.scores import PositionScores
from decode.cache.kv import forward, new_cache
from decode.pair import Pair
from decode.sampling import transform

KINDS = ("prompt", "draft", "target", "mixed")  # SPRINTER's four prefix kinds


@dataclass
class Mixing:
    """Shares of the prefix kinds per sequence, and r (share of target tokens) for 'mixed'.

    prompt: only the first response position is labelled (the bare prompt as condition);
    draft: z = candidates only (r = 0); target: z = y (r = 1); mixed: z_i = y_i w.p. r.
    """

    shares: dict[str, float] = field(default_factory=lambda: {"prompt": 0.1, "draft": 0.1, "target": 0.1, "mixed": 0.7})
    r: float = 0.15

    def __post_init__(self):
        unknown = set(self.shares) - set(KINDS)
        if unknown or not self.shares or any(v < 0 for v in self.shares.values()) or sum(self.shares.values()) <= 0:
            raise ValueError(f"mixing shares {self.shares} must be non-negative weights over {KINDS}")
        if not 0 <= self.r <= 1:
            raise ValueError(f"mixing ratio r={self.r} must lie in [0, 1]")

    def ratio(self, kind: str) -> float:
        return {"prompt": 0.0, "draft": 0.0, "target": 1.0, "mixed": self.r}[kind]


def prompt_generator(seed: int, prompt_id: str) -> torch.Generator:
    """A generator seeded by (run seed, prompt id): the same prompt always draws the same numbers."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


class RowNoise:
    """Every random number a batch needs, drawn per row from that row's generator, a position at a time.

    A row's stream is, in order: (N, V) uniforms for the target's response tokens, (N, V) for the draft's
    candidates, (N,) for the token-mixing coin. Positions are drawn when they are used, so no (B, N, V) noise
    is ever held (0.93 GB each at V = 151,665, B = 16, N = 96), and the numbers are the ones a draw of the
    whole stream up front gives (torch's CPU generator fills a tensor in stream order), so a record does not
    depend on its batch, its device, or this laziness. The draws stay on the CPU for that reason; each
    position's (B, V) goes to the device that uses it.
    """

    def __init__(self, gens: list[torch.Generator], n: int, vocab: int):
        self.gens, self.n, self.vocab = gens, n, vocab
        self.drawn = 0  # (., V) rows taken from every generator so far: responses first, then candidates
        self._mix = None

    def _next(self) -> torch.Tensor:
        """(B, V) exponential noise of the next position of every row's stream."""
        u = torch.empty(len(self.gens), self.vocab)
        for b, g in enumerate(self.gens):
            torch.rand(self.vocab, generator=g, out=u[b])
        self.drawn += 1
        return exponential_(u)

    def response(self, t: int) -> torch.Tensor:
        """(B, V) noise of response position t (positions in order)."""
        assert t == self.drawn, "response noise is drawn in order"
        return self._next()

    def candidate(self, t: int) -> torch.Tensor:
        """(B, V) noise of candidate position t (in order, after the responses: the ones not used are skipped)."""
        if self.drawn < self.n:  # the responses ended early: their unused positions still precede the candidates
            skip(self.gens, (self.n - self.drawn) * self.vocab)
            self.drawn = self.n
        assert t == self.drawn - self.n, "candidate noise is drawn in order"
        return self._next()

    @property
    def mix(self) -> torch.Tensor:
        """(B, N) mixing uniforms, which follow all 2 N V others: drawn from copies of the generators moved past
        them, so that the originals keep their place for the candidates."""
        if self._mix is None:
            copies = []
            for g in self.gens:
                c = torch.Generator()
                c.set_state(g.get_state())
                copies.append(c)
            skip(copies, (2 * self.n - self.drawn) * self.vocab)
            self._mix = torch.stack([torch.rand(self.n, generator=c) for c in copies])
        return self._mix


def skip(gens: list[torch.Generator], count: int, block: int = 1 << 20) -> None:
    """Move every generator past `count` uniforms (drawn into one reused buffer: torch has no skip-ahead)."""
    buf = torch.empty(min(count, block))
    for g in gens:
        left = count
        while left > 0:
            torch.rand(min(left, block), generator=g, out=buf[: min(left, block)])
            left -= block


def exponential_(u: torch.Tensor) -> torch.Tensor:
    """Uniforms -> standard exponential noise E = -log u, in place (clamped so that E is positive and finite)."""
    return u.clamp_(1e-12, 1 - 1e-7).log_().neg_()


def race_argmax(probs: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """(B, V) probabilities, (B, V) exponential noise -> (B,) exact samples.

    argmax p / E is the Gumbel-max trick argmax log p - log E without a logarithm per position:
    token x wins the race of independent exponential clocks E_x / p_x with probability p_x.
    """
    return (probs.clamp_min(0) / e).argmax(-1)


def siblings_of(q: torch.Tensor, q_raw: torch.Tensor | None, e: torch.Tensor, m: int, greedy: bool) -> torch.Tensor:
    """(B, V) q, q_raw (None: q), the candidate's exponential noise -> (B, m) siblings, rank 0 first, -1 past the
    tokens with mass. Greedy: the draft's top m by its raw softmax (q is one-hot). Sampling: m draws from q without
    replacement, in the order the race q / E finishes (the Gumbel-top-k trick), so rank 0 is the candidate itself
    and the siblings cost no noise of their own."""
    keys = (q if q_raw is None else q_raw) if greedy else q.clamp_min(0) / e
    vals, tok = keys.topk(min(m, keys.shape[-1]), dim=-1)
    tok = torch.where(vals > 0, tok, -1)
    return torch.nn.functional.pad(tok, (0, m - tok.shape[-1]), value=-1)  # a vocabulary smaller than m


def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists -> (B, T) ids and (B, T) attention mask, padded on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) attention mask -> (B, T) position ids that start at 0 on each row's first real token."""
    return (mask.cumsum(-1) - 1).clamp_min(0)


@dataclass
class Responses:
    """What sample_responses returns: the responses, and the target state labelling reuses."""

    tokens: torch.Tensor  # (B, N) response ids (EOS included, EOS after it)
    lengths: torch.Tensor  # (B,) response lengths
    first_logits: torch.Tensor  # (B, V) the target's logits after the prompt
    cache: object  # the target's KV cache over the prompt and the responses


@torch.no_grad()
def sample_responses(pair: Pair, ids, mask, noise: RowNoise, max_new: int) -> Responses:
    """(B, T) left-padded prompts, their noise streams -> the target's responses.

    Tokens, lengths and each position's noise meet the probabilities on the pair's device; the ids fed back go
    to the target's input device. A row ends at any of the pair's EOS ids, and EOS pads it after that.
    """
    s, dev, into = pair.config.sampling, pair.device, pair.input_device("target")
    eos = torch.tensor(pair.eos_ids, device=dev)
    B = ids.shape[0]
    ids, mask = ids.to(into), mask.to(into)
    out = torch.full((B, max_new), pair.eos_ids[0], dtype=torch.long, device=dev)
    lengths = torch.full((B,), max_new, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    cache = new_cache(reserve=ids.shape[1] + max_new)
    # logits_to_keep=1: only the last prompt position's logits are read, not (B, T, V) of them
    logits = forward(pair.target, ids, cache, attention_mask=mask, position_ids=positions(mask), logits_to_keep=1)
    first = pair.logits(logits.logits[:, -1])
    for t in range(max_new):
        probs = transform(pair.logits(logits.logits[:, -1]), s)
        tok = race_argmax(probs, noise.response(t).to(dev, non_blocking=True))
        tok = torch.where(done, out[:, t], tok)
        out[:, t] = tok
        newly = torch.isin(tok, eos) & ~done
        lengths[newly] = t + 1
        done |= newly
        if done.all():  # one host read per step: the loop must know when to end
            return Responses(out[:, : t + 1], lengths, first, cache)
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=into)], dim=1)
        logits = forward(pair.target, tok[:, None].to(into), cache, attention_mask=mask,
                         position_ids=positions(mask)[:, -1:])
    return Responses(out, lengths, first, cache)


@torch.no_grad()
def draft_walk(pair: Pair, ids, mask, y, ratios: torch.Tensor, noise: RowNoise, scores: PositionScores, phase,
               siblings: int = 0):
    """Draft pass over the response with candidates and mixing; each position goes to `scores` as it is made.

    (B, T) prompts, (B, N) responses, (B,) r per row -> dict of (B, N) candidate, z, from_target and
    (B, N + 1, H) draft last-layer hidden states (index 0: last prompt token). scores receives (B, V) q, q_raw
    (the softmax of the raw logits; None when the setting is plain T = 1, where it equals q), the candidate, z,
    and with `siblings` m > 0 the (B, m) siblings a token tree would draft there (siblings_of).
    """
    s, dev, into = pair.config.sampling, pair.device, pair.input_device("draft")
    plain = s.temperature == 1.0 and s.top_k == 0 and s.top_p >= 1.0
    B, N = y.shape
    ids, mask, y, ratios, mix = ids.to(into), mask.to(into), y.to(dev), ratios.to(dev), noise.mix.to(dev)
    cache = new_cache(reserve=ids.shape[1] + N)
    with phase("draft walk"):
        out, state = forward(pair.draft, ids, cache, hidden=True, attention_mask=mask, position_ids=positions(mask),
                             logits_to_keep=1)
    hidden, cands, zs, froms = [state[:, -1]], [], [], []
    for t in range(N):
        with phase("draft walk"):
            logits = pair.logits(out.logits[:, -1])
            q = transform(logits, s)
            e = noise.candidate(t).to(dev, non_blocking=True)
            c = race_argmax(q, e)
            from_target = mix[:, t] < ratios
            z = torch.where(from_target, y[:, t], c)
            cands.append(c), zs.append(z), froms.append(from_target)
            raw = None if plain else logits.softmax(-1)
            sib = siblings_of(q, raw, e, siblings, s.temperature == 0) if siblings else None
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=into)], dim=1)
            out, state = forward(pair.draft, z[:, None].to(into), cache, hidden=True, attention_mask=mask,
                                 position_ids=positions(mask)[:, -1:])
            hidden.append(state[:, -1])
        scores.add(q, raw, c, z, sib)
    return {"candidate": torch.stack(cands, 1), "z": torch.stack(zs, 1), "from_target": torch.stack(froms, 1),
            "hidden": torch.stack(hidden, 1)}


def feature_dtype(pair: Pair) -> torch.dtype:
    """Stored features: the draft's own half-precision dtype (bfloat16 states overflow float16), float16 for a
    float32 draft (half the disk; heads train in float32 and cast each batch)."""
    dtype = pair.draft.get_output_embeddings().weight.dtype
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16


class Phases:
    """Seconds spent per phase of label_batch, summed over calls: `with phases("draft walk"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


@torch.no_grad()
def label_batch(pair: Pair, prompts: list[list[int]], ids: list[str], kinds: list[str], mixing: Mixing,
                seed: int, max_new: int, phases: Phases | None = None,
                siblings: int = 0) -> tuple[list[dict], list[torch.Tensor]]:
    """Token-id prompts -> one record per prompt and its (n_i + 1, H) float16 draft hidden states.

    `phases` (optional) accumulates the seconds of each phase, for data_gen.bench's breakdown. With `siblings` m > 0
    each record also holds (n_i, m) sib_tok, sib_q and sib_alpha (decode.labels.sibling_labels); the other columns
    are the same as without.
    """
    phase = phases or (lambda name: nullcontext())
    with phase("noise"):
        noise = RowNoise([prompt_generator(seed, pid) for pid in ids], max_new, pair.vocab)
        noise.mix  # noqa: B018 (drawn here, where its time belongs)
    x, mask = left_pad(prompts, pair.eos_ids[0])
    with phase("target sampling"):
        resp = sample_responses(pair, x, mask, noise, max_new)
    y, lengths = resp.tokens, resp.lengths
    scores = PositionScores(pair, resp, mask, PositionScores.chunk_for(len(prompts), pair.vocab), phase)
    walk = draft_walk(pair, x, mask, y, torch.tensor([mixing.ratio(k) for k in kinds]), noise, scores, phase, siblings)
    stats = scores.result()
    with phase("records"):
        records, feats = [], []
        rows = {"y": y, "z": walk["z"], "candidate": walk["candidate"], "from_target": walk["from_target"]} | stats
        rows = {k: v.tolist() for k, v in rows.items()}  # one conversion per column, not per record
        for b in range(len(prompts)):
            n = 1 if kinds[b] == "prompt" else int(lengths[b])
            rec = {"id": ids[b], "kind": kinds[b], "prompt_ids": prompts[b]} | {k: v[b][:n] for k, v in rows.items()}
            records.append(rec)
            feats.append(walk["hidden"][b, : n + 1].to("cpu", feature_dtype(pair)).contiguous())
    return records, feats
