"""Drafting policies: how long to draft before the target verifies.

A policy is two methods, in the spirit of transformers' CandidateGenerator:
    reset()            a new drafting round begins
    stop(step) -> bool after candidate i was drafted: end the round now?
`step` is a DraftStep holding the candidate's index, its token, q (V,) and the draft's
hidden states (H,) before and after reading it. Every policy is also capped by max_len.
Two optional hooks tell it what verification did (a head reading the extra accepted_run needs them):
    start()                      a new generation begins
    verified(accepted, drafted)  the round's first `accepted` of `drafted` candidates were accepted

The policies live in two modules by what drives them, and this one names them all, as configs (class_path
decode.policies.X), the command line and callers do: decode.policies.base (DraftStep, Policy, the training-free
policies) and decode.policies.heads (the policies driven by an exported head).
"""

from decode.policies.base import (
    AdaEDL,
    DraftConfidence,
    DraftStep,
    FixedK,
    Policy,
    check_max_len,
    check_unit,
    draft_scalars,
)
from decode.policies.heads import (
    CostAwareStop,
    HeadPolicy,
    RenewalStop,
    SamplingMismatch,
    SpecDecPP,
    SprinterVerifier,
    matching_heads,
)

__all__ = ["AdaEDL", "CostAwareStop", "DraftConfidence", "DraftStep", "FixedK", "HeadPolicy", "Policy",
           "RenewalStop", "SamplingMismatch", "SpecDecPP", "SprinterVerifier", "check_max_len", "check_unit",
           "draft_scalars", "matching_heads"]
