"""Verification rules: given k draft tokens and the target's k + 1 distributions, decide.

Every rule maps (k,) draft tokens, (k, V) q, (k + 1, V) p -> (n accepted, next token), where
the next token (correction or bonus) is always emitted after the accepted ones. The decisions
call decode.labels, the same functions data_gen labels with.
"""

from __future__ import annotations

import math

import torch

from decode import labels as L
from decode.pair import Sampling
from decode.sampling import argmax, sample, uniform


class Rule:
    """Base rule; `lossless` rules reproduce the target's distribution exactly."""

    lossless = False
    # Under a greedy target (one-hot p) this rule is greedy matching and draws nothing: a decoder may then verify
    # from the target's argmax alone (decides_by_argmax)
    matches_greedily = False

    def decides_by_argmax(self, s: Sampling) -> bool:
        """Does the target's argmax alone decide verification under s? Then a decoder builds no one-hot p or q."""
        return s.temperature == 0 and self.matches_greedily

    def verify(self, tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, gen: torch.Generator) -> tuple[int, int]:
        raise NotImplementedError

    def verify_rows(self, tokens: list[list[int]], q: torch.Tensor | None, p: torch.Tensor,
                    gens: list[torch.Generator]) -> list[tuple[int, int]]:
        """verify() over a batch (decode.batch): row r's candidates tokens[r], (M, R, V) q (row r's in q[:k_r, r];
        None when nothing was drafted), (R, M + 1, V) p (row r's in p[r, :k_r + 1]), its own generator gens[r]."""
        out = []
        for r, t in enumerate(tokens):
            q_r = q[: len(t), r] if q is not None else p.new_zeros(0, p.shape[-1])
            out.append(self.verify(torch.tensor(t, dtype=torch.long, device=p.device), q_r, p[r, : len(t) + 1], gens[r]))
        return out


class SpeculativeSampling(Rule):
    """Leviathan et al. / Chen et al.: accept x with min(1, p/q), else resample norm(max(0, p - q))."""

    lossless = True
    matches_greedily = True  # a one-hot p makes every alpha 0 or 1 and every residual p (verify_rows)

    def verify(self, tokens, q, p, gen):
        return self.verify_rows([tokens.tolist()], q[:, None], p[None], [gen])[0]

    def resample(self, p_i: torch.Tensor, q_i: torch.Tensor) -> torch.Tensor:
        return L.residual(p_i, q_i)

    def verify_rows(self, tokens, q, p, gens):
        """Each row: every alpha in one tensor op, the uniforms drawn one per candidate from the row's own stream,
        in order, until a rejection; then the correction (or bonus) token. The rows' final draws are one inverse-CDF
        over the batch, each with the uniform its row's stream gives at that point (as sample() alone draws it)."""
        if L.one_hot(p):  # greedy target: every alpha is 0 or 1 and every residual is p, so nothing is drawn
            return greedy_rows(tokens, p)
        laws, us, accepted = [], [], []
        for r, t in enumerate(tokens):
            k = len(t)
            alphas = []
            if k:
                idx, tt = torch.arange(k, device=p.device), torch.tensor(t, device=p.device)
                alphas = L.accept_prob(p[r, idx, tt], q[idx, r, tt]).tolist()
            n = next((i for i, alpha in enumerate(alphas) if uniform(gens[r]).item() >= alpha), k)
            laws.append(p[r, k] if n == k else self.resample(p[r, n], q[n, r]))
            us.append(torch.rand(1, 1, generator=gens[r], dtype=torch.float64, device=p.device))
            accepted.append(n)
        return list(zip(accepted, sample(torch.stack(laws), u=torch.cat(us)).tolist()))


def greedy_verify(tokens: torch.Tensor, p: torch.Tensor) -> tuple[int, int]:
    """(k,) draft tokens, (k + 1, V) p -> accepted while each is the target's argmax, then the argmax."""
    best = argmax(p).tolist()  # one conversion, then plain ints: no tensor indexing per token
    for i, x in enumerate(tokens.tolist()):
        if x != best[i]:
            return i, best[i]
    return len(tokens), best[len(tokens)]


def greedy_rows(tokens: list[list[int]], p: torch.Tensor) -> list[tuple[int, int]]:
    """greedy_verify over rows: (R, M + 1, V) p, one argmax and one host read for the batch."""
    best = argmax(p).tolist()
    out = []
    for t, b in zip(tokens, best):
        n = next((i for i, x in enumerate(t) if x != b[i]), len(t))
        out.append((n, b[n]))
    return out


class GreedyMatch(Rule):
    """Accept while the draft token is the target's argmax; emit the target's argmax next."""

    lossless = True
    matches_greedily = True

    def verify(self, tokens, q, p, gen):
        return greedy_verify(tokens, p)

    def verify_rows(self, tokens, q, p, gens):
        return greedy_rows(tokens, p)


class FSD(Rule):
    """Fuzzy speculative decoding: accept while D(p_i, q_i) <= T; on rejection sample from p.

    relaxed=True is rFSD: also accept when the ordinary SD test accepts; a rejection then
    resamples from norm(max(0, p - q)), so T = 0 is exactly speculative sampling.
    """

    def __init__(self, divergence: str = "js", threshold: float = 0.1, relaxed: bool = False):
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold:g}")
        L.divergence(divergence, torch.ones(1), torch.ones(1))  # unknown names fail here, not mid-generation
        self.divergence, self.threshold, self.relaxed = divergence, threshold, relaxed

    def verify(self, tokens, q, p, gen):
        k = len(tokens)
        div = L.divergence(self.divergence, p[:k], q)
        for i, x in enumerate(tokens.tolist()):
            if div[i] <= self.threshold:
                continue
            if self.relaxed:
                if uniform(gen) < L.accept_prob(p[i, x], q[i, x]):
                    continue
                return i, int(sample(L.residual(p[i], q[i]), gen))
            return i, int(sample(p[i], gen))
        return k, int(sample(p[k], gen))


class FLy(Rule):
    """Training-free loose verification over greedy mismatches.

    A mismatch at i is tolerated when the target is uncertain there (entropy / ln V > theta)
    and the next W draft tokens of the block all match the target's argmax (deferred window);
    with fewer than W tokens left in the block the mismatch is rejected. theta = 1 never
    tolerates a mismatch, which is GreedyMatch.
    """

    def __init__(self, theta: float = 0.3, window: int = 6):
        if not 0 <= theta <= 1 or window < 0:
            raise ValueError(f"FLy needs theta in [0, 1] and window >= 0, got theta={theta:g}, window={window}")
        self.theta, self.window = theta, window

    def verify(self, tokens, q, p, gen):
        k, best = len(tokens), argmax(p)
        match = (tokens == best[:k]).tolist()
        h_norm = (L.entropy(p[:k]) / math.log(p.shape[-1])).tolist()
        for i in range(k):
            if match[i]:
                continue
            ahead = match[i + 1 : i + 1 + self.window]
            if h_norm[i] > self.theta and len(ahead) == self.window and all(ahead):
                continue
            return i, int(best[i])
        return k, int(best[k])


class SprinterCheck(Rule):
    """SPRINTER: tokens the verifier accepted stand unchecked; the target checks only the last one.

    The drafting policy (decode.policies.SprinterVerifier) ends a round at the first token its
    verifier rejects; that token gets the SD test (min(1, p/q), else norm(max(0, p - q))).
    """

    def verify(self, tokens, q, p, gen):
        k = len(tokens)
        x = int(tokens[-1])
        if uniform(gen) < L.accept_prob(p[k - 1, x], q[k - 1, x]):
            return k, int(sample(p[k], gen))
        return k - 1, int(sample(L.residual(p[k - 1], q[k - 1]), gen))
