"""Decoding several tokens per forward at the model's own quality (issue 40): learned from the model's trajectories.

:mod:`.commit_rule`: a learned commit rule (Learn2PD) — a small head on the frozen model's hidden states and the
decoding policy that commits what it accepts.
"""

from .commit_rule import CommitHead, CommitRuleData, LearnedCommit, collect_commit_data, train_commit_head

__all__ = ["CommitHead", "CommitRuleData", "LearnedCommit", "collect_commit_data", "train_commit_head"]
