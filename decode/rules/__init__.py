"""Verification: what the target keeps of a round's candidates. A chain's rules (chain: speculative sampling, greedy
matching, FSD, FLy, SPRINTER's check; kernel: speculative sampling over a batch in one compiled call on the CPU) and a
token tree's (tree: greedy matching along the argmax, recursive rejection over siblings). Each rule calls the label
maths of decode.labels, so a label and the decision it predicts cannot drift apart."""

from decode.rules.chain import FSD, FLy, GreedyMatch, Rule, SpeculativeSampling, SprinterCheck
from decode.rules.tree import check_tree, walk

__all__ = ["FSD", "FLy", "GreedyMatch", "Rule", "SpeculativeSampling", "SprinterCheck", "check_tree", "walk"]
