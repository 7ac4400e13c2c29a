"""Token trees: the shapes a round's tree takes (shapes: static, Sequoia's, EAGLE-2's confidence tree; head: the tree a
trained sibling head and the measured costs size) and the round that grows, scores and keeps one (round). A tree
shape is a decode.control.BatchControl, so decode.batch decodes with it; its verification is decode.rules.tree."""

from decode.tree.head import HeadTree
from decode.tree.round import RowTree, tree_round
from decode.tree.shapes import ConfidenceTree, NodeBatch, SequoiaTree, StaticTree, TreeShape

__all__ = ["ConfidenceTree", "HeadTree", "NodeBatch", "RowTree", "SequoiaTree", "StaticTree", "TreeShape", "tree_round"]
