"""The drafting policies driven by an exported head; callers import them from decode.policies.

HeadPolicy loads a head, checks it was trained for this draft and sampling setting, and turns a candidate into the
head's (calibrated) acceptance probability; SpecDecPP, CostAwareStop (on RenewalStop, the cost-aware rule fed any
probability) and SprinterVerifier decide from it. The interface they implement is decode.policies.base's.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path

import numpy as np
import torch

from decode import labels as L
from decode.checks import first_line
from decode.pair import Sampling
from decode.policies.base import DraftStep, Policy, check_max_len, check_unit
from decode.sampling import as_numpy
from heads import EXTRAS, FeatureSpec, HeadMismatch, check_draft, from_pretrained, kernels


class SamplingMismatch(ValueError):
    """A head was trained for another sampling setting than the decoder's: it predicts another event."""


def matching_heads(head_dir: str, config: dict, setting: str) -> list[str]:
    """Sibling folders of the head at head_dir (its config.json as `config`) of the same kind, trained for `setting`."""
    here, out = Path(head_dir), []
    for cfg_path in sorted(here.resolve().parent.glob("*/config.json")):
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(cfg, dict) and isinstance(cfg.get("sampling"), dict) and Sampling.of(cfg["sampling"]).name == setting and \
                _kind(cfg) == _kind(config) and cfg_path.parent != here.resolve():
            out.append(str(here.parent / cfg_path.parent.name))
    return out


def _kind(cfg: dict) -> tuple:
    """(head type, label family, sibling head or not, feature position): an FSD head is an AcceptanceHead too, but
    answers another question, a tree's sibling head another still (decode.tree.head), and a prev head reads another
    state than an own one."""
    features = cfg.get("features") or {}
    return (cfg.get("head_type"), (cfg.get("label") or {}).get("family"), "cand_rank" in features.get("extras", []),
            features.get("position"))


class HeadPolicy(Policy):
    """Base of policies driven by an exported head; checks it was trained for this draft and setting.

    allow_sampling_mismatch: use a head trained under another sampling setting anyway (warns).
    """

    needs_hidden = True

    def __init__(self, head_dir: str, allow_sampling_mismatch: bool = False):
        head, config = from_pretrained(head_dir)
        self._use(head, config, head_dir)
        self.head_dir, self.allow_sampling_mismatch = head_dir, allow_sampling_mismatch

    @classmethod
    def in_memory(cls, head, config: dict) -> HeadPolicy:
        """A head policy over a head that is in memory, not exported (config as an export's: its "features"): what
        the cost model times a head decision with (decode.costs.model)."""
        self = cls.__new__(cls)
        HeadPolicy._use(self, head, config)
        self.head_dir, self.allow_sampling_mismatch = "(in memory)", False
        return self

    def _use(self, head, config: dict, where: str = "(in memory)") -> None:
        self.head, self.config = head, config
        try:  # a config.json edited by hand or cut short; the kernels' warm-up below is not the config's to blame
            self.features = FeatureSpec(**self.config["features"])
            # Platt scaling fitted on dev at export (weighted BCE skews the raw probabilities that a rule
            # multiplies), folded into the head's numpy path, whose cost at batch 1 is dispatch
            cal = self.config.get("calibration") or {"a": 1.0, "b": 0.0}
            self.fast_prob = self.head.inference_fn(cal["a"], cal["b"])
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"head checkpoint {where} has a corrupt or incomplete config.json "
                             f"({type(e).__name__}: {first_line(e)}): export it again") from None
        self.reads_own_state = self.features.position == "own"
        self.run = 0  # accepted positions right before this round's first candidate (the extra accepted_run)
        self._extras = np.empty(len(self.features.extras), dtype=np.float32)  # prob()'s, rewritten per candidate
        self._codes = np.array([EXTRAS.index(e) for e in self.features.extras], dtype=np.int64)
        self._reads = bool(set(self.features.extras) & {"draft_entropy", "draft_top1", "cand_logq"})  # the softmax
        params = getattr(self.fast_prob, "params", None)
        if params is not None and self.features.extras:  # compiled (or loaded from numba's cache) before decoding
            hidden = np.zeros((1, len(params[0]) - len(self._codes)), dtype=np.float32)
            logits = np.zeros((1, 8), dtype=np.float32) if self._reads else None
            kernels.head_step(None if logits is None else logits[0], 0, hidden[0], 0, self._codes, params)
            kernels.head_rows(logits, np.zeros(1, dtype=np.int64), hidden, np.zeros(1, dtype=np.int64), self._codes,
                              params)  # a batch's rows (decode.control.RowsStep.head_probs)

    def start(self) -> None:
        self.run = 0

    def verified(self, accepted: int, drafted: int) -> None:
        """A rejection ends the run (the corrected position's candidate was rejected); a round accepted whole
        extends it by its candidates and the target's bonus token, whose position no candidate was drafted for
        (counted as accepted: in an accepted stretch a candidate there would most likely have been)."""
        self.run = 0 if accepted < drafted else self.run + drafted + 1

    def bind(self, draft_identity: dict, sampling: Sampling | None = None) -> None:
        check_draft(self.config, draft_identity, where=f"head {self.head_dir}")
        width, extras = self.head.init_args.get("in_dim"), len(self.features.extras)
        if width is not None and width != draft_identity["hidden_size"] + extras:
            raise HeadMismatch(f"head {self.head_dir} reads {width} features, but this draft's state of "
                               f"{draft_identity['hidden_size']} and the {extras} extras its config.json names make "
                               f"{draft_identity['hidden_size'] + extras}: its config does not match its weights; "
                               "export it again")
        if sampling is None or "sampling" not in self.config:
            return
        try:
            trained, used = Sampling.of(self.config["sampling"]).name, sampling.name
        except ValueError as e:  # a hand-edited config.json
            raise ValueError(f"head {self.head_dir}'s config.json: {e}; export the head again") from e
        if trained == used:
            return
        others = matching_heads(self.head_dir, self.config, used)
        hint = f"use {others[0]}" if others else \
            f"train one with --data.sampling '{{temperature: {sampling.temperature}, top_k: {sampling.top_k}, top_p: {sampling.top_p}}}'"
        msg = (f"head {self.head_dir} was trained for sampling {trained} but the decoder samples {used}: "
               f"{hint}, or pass allow_sampling_mismatch to use it anyway")
        if not self.allow_sampling_mismatch:
            raise SamplingMismatch(msg)
        warnings.warn(msg.split(": ")[0] + ": its probabilities describe another acceptance event", stacklevel=2)

    @torch.no_grad()
    def prob(self, step: DraftStep) -> float:
        state = step.hidden_own if self.features.position == "own" else step.hidden_prev
        if self._reads and state.device.type != "cpu" and "_scalars" not in vars(step):
            hidden = self._read_with_scalars(step, state)
        else:
            hidden = as_numpy(state)
        if not self.features.extras:  # no scalars to build (batch 1 pays per op made)
            return self.fast_prob(hidden)
        run = self.run + step.index
        params = getattr(self.fast_prob, "params", None)  # the compiled one-row path (heads.kernels)
        fresh = step.logits is not None and step.logits.device.type == "cpu" and "_scalars" not in vars(step)
        if params is not None and (fresh or not self._reads):  # scalars, extras and head in one call
            logits = as_numpy(step.logits) if self._reads else None
            p, *scalars = kernels.head_step(logits, step.token, hidden, run, self._codes, params)
            if self._reads:
                vars(step)["_scalars"] = tuple(scalars)  # a rule or a caller reading them does not pay again
            return p
        extras = self.features.extras_into(self._extras, step.entropy, step.top1, step.confidence, run)
        return self.fast_prob(hidden, extras)

    @staticmethod
    def _read_with_scalars(step: DraftStep, state: torch.Tensor) -> np.ndarray:
        """On a GPU: the candidate's softmax scalars and the (H,) state in one host read (two reads cost 11% of wall
        at batch 1 on an H200); the scalars are left on the step as DraftStep computes them."""
        p = step.logits.float().softmax(-1)
        packed = torch.cat([torch.stack([p[step.token], L.entropy(p), p.max()]), state.float().to(p.device)])
        packed = packed.cpu().numpy()
        vars(step)["_scalars"] = tuple(float(x) for x in packed[:3])
        return packed[3:]

    def probs(self, hidden: torch.Tensor, entropy: np.ndarray, top1: np.ndarray, confidence: np.ndarray,
              runs: np.ndarray) -> np.ndarray:
        """prob() over R rows in one head forward, in numpy (decode.batch): (R, H) states, (R,) scalars and accepted
        runs before each row's candidate -> (R,) probabilities."""
        x = as_numpy(hidden)
        if self.features.extras:
            x = self.features.rows(x, entropy, top1, confidence, runs)
        return np.atleast_1d(self.fast_prob(x[0] if len(x) == 1 else x))  # one row: the compiled path

    def stop(self, step):
        return self.given(self.prob(step))

    def given(self, prob: float) -> bool:
        """The stop decision once the head has said this candidate's probability (decode.batch computes the
        probabilities of every row in one forward, then asks each row's copy)."""
        raise NotImplementedError


class SpecDecPP(HeadPolicy):
    """SpecDec++: stop when 1 - prod_i alpha_hat_i > h (the chance some candidate is rejected).

    With a head reading the "own" position the draft must read candidate i before the decision;
    the engine does that pass anyway to draft candidate i + 1, so the extra cost is one draft
    step per round (the pass after the last candidate). A "prev" head decides with no extra pass.
    """

    def __init__(self, head_dir: str, h: float = 0.7, max_len: int = 20, allow_sampling_mismatch: bool = False):
        super().__init__(head_dir, allow_sampling_mismatch)
        check_unit("h", h, open_ends=True)
        self.h, self.max_len = h, check_max_len(max_len)
        self.survive = 1.0

    def reset(self):
        self.survive = 1.0

    def given(self, prob: float) -> bool:
        """Fold in one candidate's acceptance probability; True once the round should stop."""
        self.survive *= prob
        return 1.0 - self.survive > self.h


class RenewalStop(Policy):
    """The cost-aware stop's rule, fed any acceptance probability: CostAwareStop feeds a head's, the perfect head
    (decode.evaluation.ceilings) the true one. Subclasses say where the probability comes from (stop)."""

    needs_costs = True

    def __init__(self, draft_ms: float | None = None, target_ms: float | None = None,
                 per_token_ms: float | None = None, h: float | None = None, max_len: int = 20):
        if h is not None:
            check_unit("h", h, open_ends=True)
        costs = (draft_ms, target_ms, per_token_ms)
        if any(c is not None and c < 0 for c in costs) or (target_ms is not None and target_ms <= 0):
            raise ValueError(f"step costs must be >= 0 ms (the target's > 0), got {costs}")
        self.h, self.max_len = h, check_max_len(max_len)
        self.costs: tuple[float, list[float]] | None = None
        if None not in costs:
            self.costs = (draft_ms, [target_ms + n * per_token_ms for n in range(self.max_len + 1)])
        self.tokens = self.spent = 0.0  # expected tokens and ms of the rounds finished so far
        self.k, self.head_ms = 0, 0.0
        self.reset()

    def set_costs(self, draft_ms: float, verify_ms: list[float], head_ms: float = 0.0) -> None:
        """The machine's step costs in ms (verify_ms[n - 1]: the target verifying n tokens; head_ms: one head
        decision, which a policy driven by a head spends on every candidate), when the constructor was not given
        them. A table shorter than max_len + 1 is extended along its last step."""
        if self.costs is None:
            self.head_ms = head_ms if isinstance(self, HeadPolicy) else 0.0
            v = [float(x) for x in verify_ms]
            slope = max(0.0, v[-1] - v[-2]) if len(v) > 1 else 0.0
            v += [v[-1] + slope * (i + 1) for i in range(self.max_len + 1 - len(v))]
            self.costs = (float(draft_ms), v)

    def cost(self, k: int) -> float:
        """C_k, the round's cost with k candidates, each a draft step and a head decision; a head reading the "own"
        state adds the draft pass over the last candidate (SpecDecPP's docstring)."""
        d, verify = self.costs
        return k * (d + self.head_ms) + verify[k] + (d if self.reads_own_state else 0.0)

    @functools.cached_property
    def round_costs(self) -> list[float]:
        """C_0 .. C_max_len, once: the rule reads them per candidate (a Python loop the decoder pays at batch 1)."""
        return [self.cost(k) for k in range(self.max_len + 1)]

    def reset(self):
        if self.k and self.costs is not None:  # a round ended: it joins the long-run rate
            self.tokens += self.expected
            self.spent += self.round_costs[self.k]
        self.survive, self.expected, self.k = 1.0, 1.0, 0

    def given(self, a: float) -> bool:
        self.k += 1
        self.survive *= a
        self.expected += self.survive
        if self.h is not None:
            return 1.0 - self.survive > self.h
        if self.costs is None:
            raise ValueError(f"{type(self).__name__} has no step costs: give draft_ms, target_ms and per_token_ms, "
                             "or decode with SpeculativeDecoder, which measures them")
        k, gain, survive, c = self.k, 0.0, self.survive, self.round_costs
        rate = self.tokens / self.spent if self.spent else self.expected / c[k]
        for j in range(k + 1, self.max_len + 1):  # E_j - E_k - rate * (C_j - C_k) > 0 for some j: draft on
            survive *= a
            gain += survive
            if gain > rate * (c[j] - c[k]):
                return False
        return True


class CostAwareStop(RenewalStop, HeadPolicy):
    """Stop when drafting on is worth less than it costs, from the head's (calibrated) probabilities and the
    step costs of the machine, with no tuned threshold.

    After candidates 1..k with acceptance probabilities a_1..a_k and survival S_k = a_1 ... a_k, the round is
    expected to yield E_k = 1 + S_1 + ... + S_k tokens for C_k = k * draft_ms + verify_ms[k] (the target
    verifying k + 1 tokens). Rounds repeat, so the rate to maximise is the long-run one, tokens over time across
    rounds (a renewal-reward ratio r): a round should end where E_k - r * C_k is largest. Drafting goes on while
    some j more candidates would raise it, their acceptances estimated by the last one's (a_k). With a verify
    cost linear in the tokens, one step ahead decides; a measured verify cost is not linear (on CPUs some sizes
    run faster than smaller ones), so the rule looks to the end of max_len. r is estimated as the expected
    tokens over the cost of the rounds so far (the current round's own rate in the first). Costs left None are
    measured once per pair by the decoder (decode.costs.model.measure_costs); h, when given, replaces the rule by SpecDec++'s
    threshold.
    """

    def __init__(self, head_dir: str, draft_ms: float | None = None, target_ms: float | None = None,
                 per_token_ms: float | None = None, h: float | None = None, max_len: int = 20,
                 allow_sampling_mismatch: bool = False):
        """draft_ms, target_ms, per_token_ms: the machine's costs as a line (verifying n tokens costs target_ms +
        (n - 1) * per_token_ms), instead of the decoder's measurement."""
        HeadPolicy.__init__(self, head_dir, allow_sampling_mismatch)
        RenewalStop.__init__(self, draft_ms, target_ms, per_token_ms, h, max_len)


class SprinterVerifier(HeadPolicy):
    """SPRINTER's drafting side: keep drafting while the verifier accepts (prob >= eta).

    Pair it with decode.rules.SprinterCheck: the round ends at the first token the verifier
    rejects, and only that token is checked by the target.
    """

    def __init__(self, head_dir: str, eta: float = 0.5, max_len: int = 20, allow_sampling_mismatch: bool = False):
        super().__init__(head_dir, allow_sampling_mismatch)
        check_unit("eta", eta)
        self.eta, self.max_len = eta, check_max_len(max_len)

    def given(self, prob: float) -> bool:
        return prob < self.eta
