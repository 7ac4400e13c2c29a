"""Verification rules: given k draft tokens and the target's k + 1 distributions, decide.

Every rule maps (k,) draft tokens, (k, V) q, (k + 1, V) p -> (n accepted, next token), where
the next token (correction or bonus) is always emitted after the accepted ones. The decisions
call decode.labels, the same functions data_gen labels with.
"""

from __future__ import annotations

import itertools
import math

import torch

from decode import labels as L
from decode.pair import Sampling
from decode.rules.kernel import HAVE_NUMBA, speculative_rows
from decode.sampling import argmax, as_numpy, sample
from decode.streams import Streams


def coins(gen: Streams, k: int) -> torch.Tensor:
    """(k + 1,) float64 uniforms from one row's stream: one per candidate's accept test, then the final draw's (every
    rule that draws takes them so, so rules that coincide in law also coincide token for token on one seed)."""
    return gen.draw([k + 1])


def draw(law: torch.Tensor, u: torch.Tensor) -> int:
    """(V,) probabilities and a 0-d uniform -> the token decode.sampling.sample draws with it."""
    return int(sample(law[None], u=u.view(1, 1))[0])


class Rule:
    """Base rule; `lossless` rules reproduce the target's distribution exactly."""

    lossless = False
    # Under a greedy target (one-hot p) this rule is greedy matching and draws nothing: a decoder may then verify
    # from the target's argmax alone (decides_by_argmax)
    matches_greedily = False

    def check(self, s: Sampling) -> None:
        """Refuse, in one line and before decoding, a sampling setting this rule cannot serve (decoders call it)."""

    def decides_by_argmax(self, s: Sampling) -> bool:
        """Does the target's argmax alone decide verification under s? Then a decoder builds no one-hot p or q."""
        return s.temperature == 0 and self.matches_greedily

    def verify(self, tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, gen: Streams) -> tuple[int, int]:
        """(k,) candidates, (k, V) q, (k + 1, V) p, one row's stream -> (accepted count, next token)."""
        raise NotImplementedError

    def verify_rows(self, tokens: list[list[int]], q: torch.Tensor | None, p: torch.Tensor,
                    streams: Streams) -> list[tuple[int, int]]:
        """verify() over a batch (decode.batch): row r's candidates tokens[r], (M, R, V) q (row r's in q[:k_r, r];
        None when nothing was drafted), (R, M + 1, V) p (row r's in p[r, :k_r + 1]), its own stream (streams' row r)."""
        out = []
        for r, t in enumerate(tokens):
            q_r = q[: len(t), r] if q is not None else p.new_zeros(0, p.shape[-1])
            out.append(self.verify(torch.tensor(t, dtype=torch.long, device=p.device), q_r, p[r, : len(t) + 1],
                                   streams.select([r])))
        return out


class SpeculativeSampling(Rule):
    """Leviathan et al. / Chen et al.: accept x with min(1, p/q), else resample norm(max(0, p - q)).

    compiled: on the CPU, verify in decode.rules.kernel's one compiled call (False: the tensor ops, as on a GPU).
    """

    lossless = True
    matches_greedily = True  # a one-hot p makes every alpha 0 or 1 and every residual p (verify_rows)

    def __init__(self, compiled: bool = True):
        self.compiled = compiled

    def verify(self, tokens, q, p, gen):
        return self.verify_rows([tokens.tolist()], q[:, None], p[None], gen)[0]

    def resample(self, p_i: torch.Tensor, q_i: torch.Tensor) -> torch.Tensor:
        return L.residual(p_i, q_i)

    def verify_rows(self, tokens, q, p, streams):
        """Each row draws k + 1 uniforms from its own stream, one per candidate and one for the final draw, whatever
        the outcome, even where its p is one-hot (top-p often truncates to one token: a shortcut taken only when every
        row's p is one-hot made a row's draws depend on its neighbours); accepts while u < alpha; then draws its next
        token from its bonus p or, after a rejection, from resample() there, by inverse CDF with the last uniform.
        On the CPU one compiled call does it all (decode.rules.kernel) unless a subclass changes resample()."""
        ks, dev = [len(t) for t in tokens], p.device
        if (self.compiled and HAVE_NUMBA and dev.type == "cpu" and q is not None
                and type(self).resample is SpeculativeSampling.resample):
            return speculative_rows(as_numpy(p), as_numpy(q), tokens, streams.draw_numpy([k + 1 for k in ks]))
        us = streams.draw([k + 1 for k in ks])
        if any(ks):  # every alpha in one gather
            at = torch.tensor([(r, i, x) for r, t in enumerate(tokens) for i, x in enumerate(t)], device=dev).T
            host = torch.cat([L.accept_prob(p[at[0], at[1], at[2]], q[at[1], at[0], at[2]]).double(), us]).tolist()
        else:
            host = us.tolist()
        alpha, u = host[: len(host) - len(us)], host[len(host) - len(us):]
        accepted, a0, u0 = [], 0, 0
        for k in ks:
            accepted.append(next((i for i in range(k) if u[u0 + i] >= alpha[a0 + i]), k))
            a0, u0 = a0 + k, u0 + k + 1
        n = torch.tensor(accepted, device=dev)
        laws = p[torch.arange(len(ks), device=dev), n]  # (R, V) each row's bonus law (a copy)
        rejected = [r for r, (a, k) in enumerate(zip(accepted, ks)) if a < k]
        if rejected:
            at = torch.tensor(rejected, device=dev)
            laws[at] = self.resample(laws[at], q[n[at], at])
        last = torch.tensor(list(itertools.accumulate(k + 1 for k in ks)), device=dev) - 1
        return list(zip(accepted, sample(laws, u=us[last][:, None]).tolist()))


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

    def check(self, s: Sampling) -> None:
        # it reads the target's argmax alone: under sampling it would decode greedily while calling itself lossless
        if s.temperature > 0 and s.top_k != 1:  # (top_k 1 samples the argmax: greedy)
            raise ValueError(f"GreedyMatch accepts only the target's argmax, so at temperature {s.temperature:g} it "
                             "would decode greedily instead of sampling: use SpeculativeSampling (lossless at any "
                             "temperature), or set the pair's temperature to 0")

    def verify(self, tokens, q, p, gen):
        return greedy_verify(tokens, p)

    def verify_rows(self, tokens, q, p, streams):
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
        us = coins(gen, k)  # as SpeculativeSampling draws them: rFSD at T = 0 is it, token for token
        u = us.tolist()
        for i, x in enumerate(tokens.tolist()):
            # a divergence over the vocabulary costs more than the rest of a verify: it is read only at the positions
            # reached, and by rFSD only where the lossless test rejects (where that test accepts, rFSD does too)
            if self.relaxed:  # the chance an rFSD head learns (train.labels.RelaxedDivergence)
                alpha = L.accept_prob(p[i, x], q[i, x])
                if u[i] < float(alpha) or u[i] < float(L.rfsd_accept_prob(self.div(p[i], q[i]), alpha, self.threshold)):
                    continue
                return i, draw(L.residual(p[i], q[i]), us[k])
            if L.fsd_label(self.div(p[i], q[i]), self.threshold):
                continue
            return i, draw(p[i], us[k])
        return k, draw(p[k], us[k])

    def div(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """(V,), (V,) -> () the rule's divergence at one position."""
        return L.divergence(self.divergence, p[None], q[None])[0]


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
        us = coins(gen, 1)  # as SpeculativeSampling draws them for one candidate
        if float(us[0]) < float(L.accept_prob(p[k - 1, x], q[k - 1, x])):
            return k, draw(p[k], us[1])
        return k - 1, draw(L.residual(p[k - 1], q[k - 1]), us[1])
