"""Transfer schedules: how many masked positions of a block a fixed-count mask policy commits at each step.

A schedule maps the undecided count r of each row, the step index i and the block's step budget N to the count
n_i ``(B,)`` the policy commits (:meth:`~unifusion.samplers.policies.MaskPolicy.commit_counts`):

====================  ==================================================================  ============================
schedule              n_i                                                                 reference
====================  ==================================================================  ============================
:class:`EvenSplit`    ⌈r / (N − i)⌉: the block's count split evenly, remainder first      LLaDA ``generate.py``
:class:`TimeGrid`     ⌊r (1 − t_{i+1} / t_i)⌋, t = linspace(1, ε, N + 1); r at the last   Dream ``diffusion_generate``
:class:`RoundedSplit`  round(r (1 − s/t)), t = (N − i)/N, s = t − 1/N (half to even);     dllm's ``MDLMSampler``
                      steps that commit nothing are skipped, model call included
====================  ==================================================================  ============================

:class:`EvenSplit` recomputed from the live count equals LLaDA's split fixed at the block's start (10 over 4 steps:
3, 3, 2, 2) whenever each step commits its count. :class:`TimeGrid` is MDLM's expected count under the linear
schedule; it commits nothing on early steps of long runs, so a block may take more steps than it has positions.

Example::

    policy = uf.samplers.policies.TopKMargin(schedule=TimeGrid(eps=1e-3))
"""

from __future__ import annotations

import math

import torch

__all__ = ["EvenSplit", "RoundedSplit", "TimeGrid", "TransferSchedule"]


class TransferSchedule:
    """Base class of the transfer schedules (module docstring)."""

    bounded_by_block: bool = True
    """Whether every step commits at least one position while some are left (then a block of K positions takes at
    most K steps)."""

    skips_empty_steps: bool = False
    """Whether a step whose count is 0 in every running row is skipped, model call included (one host sync per
    step); otherwise it runs the model and commits nothing (Dream's, whose draws such a step still makes)."""

    def counts(self, left: torch.Tensor, step: int, num_steps: int) -> torch.Tensor:
        """n_i ``(B,)`` int64 for the undecided counts ``left`` ``(B,)`` at step ``step`` of ``num_steps``."""
        raise NotImplementedError  # abstractmethod

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(vars(self).items()))))


class EvenSplit(TransferSchedule):
    """n_i = ⌈r / (N − i)⌉, LLaDA's ``get_num_transfer_tokens`` (the default of every fixed-count policy)."""

    def counts(self, left: torch.Tensor, step: int, num_steps: int) -> torch.Tensor:
        rest = num_steps - step
        return (left + (rest - 1)) // rest


class TimeGrid(TransferSchedule):
    """Dream's schedule: on the grid t_k = linspace(1, ε, N + 1) (float32, as Dream builds it), step i commits
    n_i = ⌊r (1 − t_{i+1} / t_i)⌋ of the r undecided positions, and all of them at the last step.

    Dream counts m̄, the batch's mean number of masked positions; its rows always hold the same number (each step
    commits the same count in every row), so m̄ = r.

    Args:
        eps: ε in (0, 1), the grid's last time (Dream's ``eps``, default 1e-3).
    """

    bounded_by_block = False

    def __init__(self, eps: float = 1e-3) -> None:
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"eps: expected a float in (0, 1), got {type(eps).__name__}")
        if not (math.isfinite(eps) and 0.0 < eps < 1.0):
            raise ValueError(f"eps: expected a float in (0, 1), got {eps}")
        self.eps = float(eps)

    def __repr__(self) -> str:
        return f"TimeGrid(eps={self.eps})"

    def counts(self, left: torch.Tensor, step: int, num_steps: int) -> torch.Tensor:
        if step >= num_steps - 1:
            return left.clone()
        t = torch.linspace(1, self.eps, num_steps + 1, device=left.device)
        fraction = 1 - t[step + 1] / t[step]
        return (left.float() * fraction).long()  # truncation: Dream's int() of a positive float


class RoundedSplit(TransferSchedule):
    """dllm's ``MDLMSampler`` schedule (``get_num_transfer_tokens`` with its ``LinearAlphaScheduler``): step i of N
    commits n_i = min(round(r (1 − (1 − α_s) / (1 − α_t))), r) of the r undecided positions, α(u) = 1 − u at
    t = (N − i)/N and s = t − 1/N in float32, the product in float64 rounded half to even (``torch.round``): 5 over
    2 steps gives 2, 3 where :class:`EvenSplit` gives 3, 2. Steps whose count is 0 are skipped, model call included
    (dllm drops them from its schedule). Equal to :class:`EvenSplit` whenever N divides the block's count.
    """

    bounded_by_block = False
    skips_empty_steps = True

    def counts(self, left: torch.Tensor, step: int, num_steps: int) -> torch.Tensor:
        t = torch.tensor((num_steps - step) / num_steps, dtype=torch.float32)
        s = torch.tensor((num_steps - step - 1) / num_steps, dtype=torch.float32)
        ratio = float((1 - (1 - s)) / (1 - (1 - t)))  # dllm's reverse_mask_prob(s, t), read back as a float
        n = torch.round(left.to(torch.float64) * (1 - ratio)).long()
        return torch.minimum(n, left)
