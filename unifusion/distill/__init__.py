"""Distillation of a diffusion LM on its own trajectories, so that it decodes several tokens per forward.

* :mod:`unifusion.distill.trajectories` — :func:`record_trajectories` (a teacher's answers and the step it
  committed each token at, filtered by a reward) and :class:`Trajectories` (safetensors on disk).
* :mod:`unifusion.distill.replay` — :func:`replay`: the tokens a model predicts along a recorded order.
* :mod:`unifusion.distill.masks` — d3LLM's pseudo-trajectory masks, dParallel's random block masks, complements and
  curricula.
* :mod:`unifusion.distill.losses` — dParallel's certainty forcing and a CDLM-style KL to a teacher, on logits.
* :mod:`unifusion.distill.fused` — certainty forcing through the output head without ``(N, V)`` logits.
* :mod:`unifusion.distill.step` — the loss of a view and of a complementary pair on a model, and LoRA students.
* :mod:`unifusion.distill.commit_rule` — a learned commit rule (Learn2PD): a small head on the frozen model's hidden
  states and the decoding policy that commits what it accepts; :class:`OracleCommit`, the rule it learns, read
  from a reference decode (the ceiling of any such rule).
"""

from .commit_rule import (
    CommitHead,
    CommitRuleData,
    LearnedCommit,
    OracleCommit,
    collect_commit_data,
    train_commit_head,
)
from .fused import default_rows_per_block, fused_certainty_forcing_loss
from .losses import (
    CertaintyForcingTerms,
    certainty_forcing_loss,
    certainty_forcing_terms,
    check_certainty_options,
    teacher_kl_loss,
)
from .masks import (
    DistillMask,
    block_size_curriculum,
    draw_trajectory_steps,
    fill_steps,
    mask_ratio_curriculum,
    pseudo_trajectory_mask,
    random_block_mask,
    view_times,
)
from .replay import replay
from .step import add_lora, complementary_pair_loss, distillation_loss, view_loss
from .trajectories import RewardFn, Trajectories, record_trajectories

__all__ = [
    "CommitHead",
    "CommitRuleData",
    "LearnedCommit",
    "OracleCommit",
    "collect_commit_data",
    "train_commit_head",
    "CertaintyForcingTerms",
    "DistillMask",
    "RewardFn",
    "Trajectories",
    "add_lora",
    "block_size_curriculum",
    "certainty_forcing_loss",
    "certainty_forcing_terms",
    "check_certainty_options",
    "complementary_pair_loss",
    "default_rows_per_block",
    "distillation_loss",
    "draw_trajectory_steps",
    "fill_steps",
    "fused_certainty_forcing_loss",
    "mask_ratio_curriculum",
    "pseudo_trajectory_mask",
    "random_block_mask",
    "record_trajectories",
    "replay",
    "teacher_kl_loss",
    "view_loss",
    "view_times",
]
