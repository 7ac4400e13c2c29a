"""Acceptance heads and verifiers (plain torch), their features and their safetensors checkpoints."""

from heads.features import EXTRAS, FeatureSpec
from heads.io import HeadMismatch, check_draft, from_pretrained, save_pretrained
from heads.modules import HEAD_TYPES, AcceptanceHead, Head, LinearVerifier

__all__ = ["EXTRAS", "FeatureSpec", "HeadMismatch", "check_draft", "from_pretrained", "save_pretrained",
           "HEAD_TYPES", "AcceptanceHead", "Head", "LinearVerifier"]
