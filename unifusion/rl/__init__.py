"""Reinforcement learning for diffusion LMs: sequence log-likelihood estimators and the RL objectives on them.

* :func:`sequence_logprob` — ``log p_θ(completion | prompt)`` by every published estimator (ELBO, LLaDA's discrete
  ELBO, DiffuCoder's coupled pairs, GDPO's quadrature, d1's mean field, SPG's EUBO, TraceRL's replay of a rollout's
  commit order) through the fused output head.
* :mod:`unifusion.rl.estimators` — their masks, times and weights (``plan_masks``, ``plan_trace``,
  ``plan_from_masks``), how log-probs combine (``combine_logps``), the quadrature nodes and the per-row
  generators: the plumbing, public in that module only.
* :mod:`unifusion.rl.objectives` — :func:`grpo_loss`, :func:`wd1_loss`, :func:`spg_loss`, :func:`dpo_loss` and
  :func:`group_advantages`, per sample or per token (the caller reduces).
"""

from .estimators import ESTIMATORS
from .logprob import SequenceLogProb, check_estimator, sequence_logprob
from .objectives import dpo_loss, group_advantages, grpo_loss, spg_loss, wd1_loss

__all__ = [
    "ESTIMATORS",
    "SequenceLogProb",
    "check_estimator",
    "dpo_loss",
    "group_advantages",
    "grpo_loss",
    "sequence_logprob",
    "spg_loss",
    "wd1_loss",
]
