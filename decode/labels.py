"""Label math as pure tensor functions: data_gen labels with them, decode decides with them.

p is the target's next-token distribution, q the draft's, both after decode.sampling.transform.
Zeros are handled exactly: 0 * log 0 = 0, and KL is +inf where p > 0 = q (never NaN).
"""

from __future__ import annotations

import math

import torch

from decode.sampling import as_numpy

LN2 = math.log(2.0)


def accept_prob(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """(...) p(x), q(x) of a draft candidate x -> (...) alpha = min(1, p(x) / q(x)).

    Where q(x) = 0 the draft could not have proposed x; alpha is then 1 by convention.
    """
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny), torch.ones_like(p_x))
    return ratio.clamp(max=1.0)


def sprinter_ratio(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """(...) -> (...) q(x) / p(x), +inf where p(x) = 0 (the target never emits x)."""
    return torch.where(p_x > 0, q_x / p_x.clamp_min(torch.finfo(p_x.dtype).tiny), torch.full_like(p_x, math.inf))


def sprinter_label(ratio: torch.Tensor, gamma: float) -> torch.Tensor:
    """(...) q/p -> (...) float label 1 when q(x)/p(x) <= gamma (SPRINTER's acceptable token)."""
    return (ratio <= gamma).float()


def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(..., V), (..., V) -> (...) KL(p || q) in nats; +inf where some p > 0 = q."""
    return (torch.xlogy(p, p) - torch.xlogy(p, q)).sum(-1).nan_to_num(nan=math.inf, posinf=math.inf)


def js(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) Jensen-Shannon divergence in nats, in [0, ln 2]."""
    m = 0.5 * (p + q)
    out = 0.5 * (torch.xlogy(p, p) - torch.xlogy(p, m)).sum(-1) + 0.5 * (torch.xlogy(q, q) - torch.xlogy(q, m)).sum(-1)
    return out.clamp(0.0, LN2)


def tv(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) total variation distance, in [0, 1]."""
    return (0.5 * (p - q).abs().sum(-1)).clamp(0.0, 1.0)


def divergence(name: str, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) one of kl (KL(p||q)), kl_qp (KL(q||p)), js, tv."""
    fns = {"kl": lambda: kl(p, q), "kl_qp": lambda: kl(q, p), "js": lambda: js(p, q), "tv": lambda: tv(p, q)}
    if name not in fns:
        raise ValueError(f"unknown divergence {name!r}; choose one of {sorted(fns)}")
    return fns[name]()


def fsd_label(div: torch.Tensor, threshold: float) -> torch.Tensor:
    """(...) divergence -> (...) float label 1 when D(p, q) <= T (FSD accepts the position)."""
    return (div <= threshold).float()


def rfsd_accept_prob(div: torch.Tensor, alpha: torch.Tensor, threshold: float) -> torch.Tensor:
    """(...) divergence, (...) alpha of the candidate -> (...) the chance rFSD accepts it: 1 where D(p, q) <= T, else
    the speculative-sampling test's alpha. At T = 0 alpha alone (D = 0 means p = q, where alpha is 1; a divergence
    rounded to 0 over a large vocabulary would otherwise accept outright): rFSD at T = 0 is speculative sampling."""
    return torch.where(div <= threshold, torch.ones_like(alpha), alpha) if threshold > 0 else alpha


def entropy(p: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) Shannon entropy in nats."""
    return -torch.xlogy(p, p).sum(-1)


def expected_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) sum_x min(p(x), q(x)) = E_{x~q}[alpha] = 1 - TV(p, q)."""
    return torch.minimum(p, q).sum(-1)


def one_hot(p: torch.Tensor) -> bool:
    """(..., V) distributions -> True when every row has exactly one token of nonzero mass (a greedy target,
    or a top-p nucleus of one token).

    Then min(1, p(x) / q(x)) is 1 for that token and 0 for any other x with q(x) > 0, and
    norm(max(0, p - q)) is p: speculative sampling reduces to greedy matching and needs no draw.
    """
    if p.device.type != "cpu":  # one bool crosses to the host, not the (k + 1, V) rows
        return bool(((p > 0).sum(-1) == 1).all())
    return bool(((as_numpy(p) > 0).sum(-1) == 1).all())  # numpy: about half torch's time on (5, 4096)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (..., V) norm(max(0, p - q)), the resampling law after a rejection; p where p == q."""
    r = (p - q).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def sibling_tests(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection at N nodes at once: (N, V) target laws p, (N, V) draft laws q, (N, m) children drawn from
    q without replacement (-1: none) -> (N, m) the chance child j is accepted once the children before it were
    rejected, min(1, r_j(x_j) / q_j(x_j)), and (N, V) the law r_{m+1} the token comes from once all are rejected;
    r_1 = p, r_{j+1} = norm(max(r_j - q_j, 0)), q_j = q with x_1..x_{j-1} removed and renormalised.
    Token trees decide with it (decode.tree.round) and data_gen labels siblings with it (sibling_labels)."""
    r, alpha = p, torch.zeros(x.shape, dtype=p.dtype, device=p.device)
    for j in range(x.shape[1]):
        has, xj = x[:, j] >= 0, x[:, j:j + 1].clamp_min(0)
        q_j = q if j == 0 else q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
        alpha[:, j] = torch.where(has, accept_prob(r.gather(1, xj)[:, 0], q_j.gather(1, xj)[:, 0]), 0.0)
        r = torch.where(has[:, None], residual(r, q_j), r)
        q = torch.where(has[:, None], q_j.scatter(1, xj, 0.0), q)
    return alpha, r


def sibling_labels(p: torch.Tensor, q: torch.Tensor, conf: torch.Tensor, sib: torch.Tensor,
                   greedy: bool) -> dict[str, torch.Tensor]:
    """(M, V) p, q, the draft's confidence law and (M, m) siblings (-1: none) -> dict of (M, m) sib_tok, sib_q (the
    sibling's probability under conf, 0 for none) and sib_alpha: greedy, 1 where the sibling is the target's argmax
    (p is one-hot; q is too, so recursive rejection does not apply); sampling, sibling_tests' chance that it is
    accepted once the siblings before it were rejected."""
    has, x = sib >= 0, sib.clamp_min(0)
    alpha = (p.gather(-1, x) > 0).to(p.dtype) if greedy else sibling_tests(p, q, sib)[0]
    return {"sib_tok": sib, "sib_q": torch.where(has, conf.gather(-1, x), 0.0), "sib_alpha": torch.where(has, alpha, 0.0)}


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(...) values, (...) bool mask -> () mean over the masked-in entries (inf/nan elsewhere ignored)."""
    x = torch.where(mask, x, torch.zeros_like(x))
    return x.sum() / mask.sum().clamp_min(1)


CHUNK = 1 << 16  # probabilities per chunk of position_stats: ten (rows, V) temporaries stay in a 1 MiB L2


def position_stats(p: torch.Tensor, q: torch.Tensor, cand: torch.Tensor, q_raw: torch.Tensor | None = None,
                   sib: torch.Tensor | None = None, greedy: bool = False) -> dict[str, torch.Tensor]:
    """(..., V) p, (..., V) q, (...) draft candidates [, (..., V) q_raw] [, (..., m) siblings] -> dict of (...)
    per-position quantities, and with siblings (..., m) sib_tok, sib_q and sib_alpha (sibling_labels).

    Computed over chunks of positions: on a whole batch every one of the ~ten passes below reads and
    writes (B, N, V) floats from main memory; on a chunk they stay in cache.
    """
    rows, V = cand.numel(), p.shape[-1]
    p2, q2, c2 = p.reshape(rows, V), q.reshape(rows, V), cand.reshape(rows)
    r2 = None if q_raw is None else q_raw.reshape(rows, V)
    s2 = None if sib is None else sib.reshape(rows, -1)
    step, parts = max(1, CHUNK // V), []
    for i in range(0, max(rows, 1), step):
        s = slice(i, i + step)
        part = _stats(p2[s], q2[s], c2[s], None if r2 is None else r2[s])
        if s2 is not None:
            part |= sibling_labels(p2[s], q2[s], q2[s] if r2 is None else r2[s], s2[s], greedy)
        parts.append(part)
    return {k: torch.cat([d[k] for d in parts]).reshape(*cand.shape, *parts[0][k].shape[1:]) for k in parts[0]}


def _dot_log(a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """(M, V) a, (M, V) log b -> (M,) sum of xlogy(a, b): 0 where a = 0, -inf where a > 0 = b.

    Three logs shared by six sums: xlogy takes a log per call and is not vectorised, and costs several times a log
    and this product together (docs/engine.md, "Measured fast paths").
    """
    return (a * log_b).nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf).sum(-1)


def _stats(p: torch.Tensor, q: torch.Tensor, cand: torch.Tensor, q_raw: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """(M, V) p, q, (M,) candidates [, (M, V) q_raw] -> dict of (M,) quantities (see position_stats).

    The same values as kl, js, tv, entropy and expected_acceptance above, with the shared terms
    (the logs of p, q and their mixture) computed once per position.
    The draft's confidence (q_cand, draft_top1, draft_entropy) comes from q_raw, the softmax of its raw
    logits, when given: that is what the decoder's confidence rules and head features read, and under
    greedy decoding the transformed q is one-hot and says nothing. The labels always use q.
    """
    p_c = p.gather(-1, cand.unsqueeze(-1)).squeeze(-1)
    q_c = q.gather(-1, cand.unsqueeze(-1)).squeeze(-1)
    conf = q if q_raw is None else q_raw
    log_p, log_q, log_m = p.log(), q.log(), (0.5 * (p + q)).log()
    plogp, qlogq = _dot_log(p, log_p), _dot_log(q, log_q)
    h_p, h_q = -plogp, -qlogq
    js_val = 0.5 * (plogp - _dot_log(p, log_m)) + 0.5 * (qlogq - _dot_log(q, log_m))
    tv_val = (0.5 * (p - q).abs().sum(-1)).clamp(0.0, 1.0)
    kl_pq = (plogp - _dot_log(p, log_q)).nan_to_num(nan=math.inf, posinf=math.inf)
    kl_qp = (qlogq - _dot_log(q, log_p)).nan_to_num(nan=math.inf, posinf=math.inf)
    return {
        "p_cand": p_c,
        "q_cand": conf.gather(-1, cand.unsqueeze(-1)).squeeze(-1),
        "alpha": accept_prob(p_c, q_c),
        "ratio_qp": sprinter_ratio(p_c, q_c),
        "kl": kl_pq,
        "kl_qp": kl_qp,
        "js": js_val.clamp(0.0, LN2),
        "tv": tv_val,
        "expected_accept": torch.minimum(p, q).sum(-1),
        "target_entropy": h_p,
        "draft_entropy": h_q if q_raw is None else entropy(q_raw),
        "draft_top1": conf.max(-1).values,
    }
