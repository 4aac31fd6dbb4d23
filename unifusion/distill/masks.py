"""Training masks for distillation: views of a completion that say which positions a student predicts.

Every function returns a :class:`DistillMask` over the completion columns ``(B, C)`` (block ``b`` is columns
``[bK, (b + 1)K)``, as in :class:`~unifusion.distill.Trajectories`; with ``lead`` prompt tokens in a row's first
block, a ``"sequence_start"`` kind's trajectories, columns ``[bK − lead, (b + 1)K − lead)``): ``masked``, the
positions replaced by the mask token and scored, and ``active``, the positions the view is about (the block being
decoded); its :meth:`~DistillMask.complement` is the same view with the active positions' roles swapped (dParallel's
complementary pair: every active position is scored in exactly one of the two views).

* :func:`pseudo_trajectory_mask` — d3LLM's mask from a teacher trajectory: the decoder's state after model call
  ``s``. With one step per row, the active block is the block the decoder was working on (the first block with a
  token committed after ``s``): its tokens committed after ``s`` are masked, earlier blocks are clean (the decoder
  had committed them). **Later blocks**: the decoder saw them masked, but a block model's prediction of the active
  block attends only to the clean blocks before it and to the active block itself, never to a later block, so they
  are not part of the view: ``later_blocks="clean"`` (default) leaves them clean and unscored (the forward computes
  them, the loss ignores them); ``"masked"`` masks and scores them too, each a view of its block's first step (extra
  training signal from the same forward). With one step per block (``(B, nb)``), every block is at its own state in
  one forward — a block model predicts each block from the clean blocks before it only, so the blocks' views are
  independent, as block diffusion training draws one time per block.
* :func:`random_block_mask` — dParallel's mask: one active block per row, each of its positions masked with
  probability ``ratio``; earlier blocks clean, later blocks as above.
* :func:`mask_ratio_curriculum`, :func:`block_size_curriculum` — d3LLM's curricula as plain schedules of the
  training step.

**Positions after EOS** (``commit_step == -1``): the decoder keeps a row running until every position before its
EOS is decided, and only then writes the fill; until then a position after the EOS is masked or holds a token the
decoder committed and later replaced, which the trace does not keep. They count as committed at the row's last step
(:func:`fill_steps`): masked in every view, and scored like the tokens (the student learns to end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from .. import _validation as V
from .._device import rand

__all__ = ["DistillMask", "fill_steps", "pseudo_trajectory_mask", "draw_trajectory_steps", "random_block_mask",
           "view_times", "mask_ratio_curriculum", "block_size_curriculum"]


@dataclass(frozen=True)
class DistillMask:
    """A view of a completion (module docstring).

    Attributes:
        masked: ``(B, C)`` bool, positions given as the mask token and scored.
        active: ``(B, C)`` bool, the positions of the view (``masked`` is a subset).
    """

    masked: torch.Tensor
    active: torch.Tensor

    def complement(self) -> DistillMask:
        """The complementary view: the active positions not masked here are masked, and the masked ones clean."""
        return DistillMask(masked=self.active & ~self.masked, active=self.active)


def _check_steps(commit_step: object, block_size: object) -> tuple[torch.Tensor, int]:
    if not isinstance(commit_step, torch.Tensor) or commit_step.dim() != 2 or \
            not V.is_integer_dtype(commit_step.dtype):
        got = f"{tuple(commit_step.shape)} {commit_step.dtype}" if isinstance(commit_step, torch.Tensor) else \
            type(commit_step).__name__
        raise ValueError(f"commit_step: expected a (B, C) integer tensor of commit steps "
                         f"(Trajectories.commit_step), got {got}")
    return commit_step.long(), V.check_positive_int("block_size", block_size)


def fill_steps(step: torch.Tensor) -> torch.Tensor:
    """Commit steps ``(B, C)`` with the fill after EOS (``-1``) at the row's last step (module docstring)."""
    return torch.where(step >= 0, step, step.amax(-1, keepdim=True))


_effective = fill_steps


def _blocks(C: int, K: int, device: torch.device, lead: object = None) -> tuple[torch.Tensor, int]:
    """Each completion column's block ``(1, C)`` or, with ``lead`` ``(B,)`` (the prompt tokens in each row's first
    block, :attr:`Trajectories.block_leads`), ``(B, C)`` — column c in block ``⌊(c + lead) / K⌋`` — and the number
    of blocks ``nb``."""
    col = torch.arange(C, device=device)[None]
    if lead is None:
        return col.div(K, rounding_mode="floor"), -(-C // K)
    if not isinstance(lead, torch.Tensor) or lead.dim() != 1 or not V.is_integer_dtype(lead.dtype):
        raise ValueError(f"lead: expected a (B,) integer tensor (Trajectories.block_leads), got "
                         f"{tuple(lead.shape) if isinstance(lead, torch.Tensor) else type(lead).__name__}")
    lead = lead.to(device, torch.long)
    V.fail_if(((lead < 0) | (lead >= K)).any(), lambda: f"lead: expected values in [0, {K}), got {lead.tolist()[:8]}")
    return (col + lead[:, None]).div(K, rounding_mode="floor"), -(-(C + int(lead.max())) // K)


def pseudo_trajectory_mask(commit_step: torch.Tensor, step: torch.Tensor | int, *, block_size: int,
                           later_blocks: Literal["clean", "masked"] = "clean",
                           lead: torch.Tensor | None = None) -> DistillMask:
    """d3LLM's pseudo-trajectory mask: the decoder's state after model call ``step`` (module docstring).

    Args:
        commit_step: ``(B, C)`` commit steps of the completion (:attr:`Trajectories.commit_step`).
        step: ``s``: an int, ``(B,)`` (one state per row: the active block is the first block with a token
            committed after ``s``) or ``(B, nb)`` (one state per block, every block active). ``-1`` is the state
            before the first commit; a state must leave something to commit: ``-1 <= s < max step`` (of the row,
            or of the block). Outside: ``ValueError`` naming ``step``.
        block_size: the decoder's block size ``K``.
        later_blocks: ``"clean"`` or ``"masked"``, with one state per row (module docstring).
        lead: ``(B,)`` the prompt tokens in each row's first block (:attr:`Trajectories.block_leads`, a
            ``"sequence_start"`` kind's decoder), ``None``: 0 (blocks from the completion's first column).

    Returns:
        :class:`DistillMask`: ``masked = active & (commit_step > s)``.
    """
    steps, K = _check_steps(commit_step, block_size)
    if later_blocks not in ("clean", "masked"):
        raise ValueError(f"later_blocks: expected 'clean' or 'masked', got {later_blocks!r}")
    B, C = steps.shape
    eff = _effective(steps)
    block, nb = _blocks(C, K, steps.device, lead)
    block = block.expand(B, C)
    s = torch.as_tensor(step, device=steps.device)
    if s.dtype.is_floating_point or s.dtype == torch.bool:
        raise TypeError(f"step: expected integer steps, got {s.dtype}")
    s = s.long()
    if s.dim() == 0:
        s = s.expand(B)
    if tuple(s.shape) == (B,):
        last = eff.amax(-1)
        outside = (s < -1) | (s >= last)
        V.fail_if(outside.any(), lambda: (
            f"step: expected -1 <= s < the row's last commit step (a state with something left to commit), got "
            f"s = {s[outside].tolist()[:8]} against last steps {last[outside].tolist()[:8]}"))
        after = eff > s[:, None]
        first = torch.where(after, block, nb).amin(-1, keepdim=True)  # (B, 1) the active block
        active = block == first
        if later_blocks == "masked":
            active = block >= first
        return DistillMask(masked=after & active, active=active)
    if tuple(s.shape) != (B, nb):
        raise ValueError(f"step: expected an int, ({B},) or ({B}, {nb}) (one per block of {K}), got "
                         f"{tuple(s.shape)}")
    s_pos = s.gather(1, block)
    block_last = torch.full((B, nb), -2, dtype=torch.long, device=steps.device).scatter_reduce(
        1, block, eff, "amax")
    outside = (s < -1) | (s >= block_last)
    V.fail_if(outside.any(), lambda: (
        f"step: expected -1 <= s_b < the block's last commit step for every block, got s = "
        f"{s[outside].tolist()[:8]} against last steps {block_last[outside].tolist()[:8]}"))
    return DistillMask(masked=eff > s_pos, active=torch.ones_like(eff, dtype=torch.bool))


def draw_trajectory_steps(commit_step: torch.Tensor, *, block_size: int, per_block: bool = False,
                          generator: torch.Generator | None = None, lead: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """Draw states for :func:`pseudo_trajectory_mask`, uniformly over the decoder's distinct states: ``s = c − 1``
    for ``c`` one of the row's (or with ``per_block``, the block's) distinct commit steps, each equally likely
    (``lead``: as in :func:`pseudo_trajectory_mask`).

    Returns ``(B,)`` int64, or ``(B, nb)`` with ``per_block``."""
    steps, K = _check_steps(commit_step, block_size)
    generator = V.check_generator(generator)
    B, C = steps.shape
    eff = _effective(steps)
    block, nb = _blocks(C, K, steps.device, lead)
    group = block.expand(B, C) if per_block else torch.zeros_like(eff)
    G = nb if per_block else 1
    # the first column of each distinct (group, step): a candidate state
    same = (group[:, :, None] == group[:, None, :]) & (eff[:, :, None] == eff[:, None, :])
    earlier = torch.ones(C, C, dtype=torch.bool, device=steps.device).tril(-1)
    distinct = ~(same & earlier).any(-1)  # (B, C)
    u = rand((B, C), generator=generator, device=steps.device, dtype=torch.float64)
    score = torch.where(distinct, u, -1.0)
    best = torch.full((B, G), -2.0, dtype=torch.float64, device=steps.device).scatter_reduce(
        1, group, score, "amax")
    chosen = distinct & (score == best.gather(1, group))
    out = torch.full((B, G), 0, dtype=torch.long, device=steps.device).scatter_reduce(
        1, group, torch.where(chosen, eff - 1, torch.iinfo(torch.int64).min), "amax")
    return out if per_block else out[:, 0]


def random_block_mask(completion_mask: torch.Tensor, ratio: float | torch.Tensor, *, block_size: int,
                      generator: torch.Generator | None = None,
                      later_blocks: Literal["clean", "masked"] = "clean",
                      lead: torch.Tensor | None = None) -> DistillMask:
    """dParallel's mask: per row one active block drawn uniformly among the blocks with a completion position,
    each of its completion positions masked with probability ``ratio`` (a float in ``[0, 1]`` or ``(B,)``).

    Args:
        completion_mask: ``(B, C)`` bool, the positions that may be scored (``True`` everywhere for a full
            completion).
        ratio: the mask ratio (:func:`mask_ratio_curriculum`).
        block_size: ``K``.  generator: the draws.  later_blocks, lead: as in :func:`pseudo_trajectory_mask`.
    """
    if not isinstance(completion_mask, torch.Tensor) or completion_mask.dim() != 2 or \
            completion_mask.dtype != torch.bool:
        raise ValueError("completion_mask: expected a (B, C) bool tensor")
    K = V.check_positive_int("block_size", block_size)
    if later_blocks not in ("clean", "masked"):
        raise ValueError(f"later_blocks: expected 'clean' or 'masked', got {later_blocks!r}")
    generator = V.check_generator(generator)
    B, C = completion_mask.shape
    device = completion_mask.device
    r = torch.as_tensor(ratio, dtype=torch.float64, device=device)
    if r.dim() > 1 or (r.dim() == 1 and r.shape[0] != B):
        raise ValueError(f"ratio: expected a float or ({B},), got shape {tuple(r.shape)}")
    V.fail_if(((r < 0) | (r > 1)).any(), lambda: f"ratio: expected values in [0, 1], got {r.tolist()}")
    block, nb = _blocks(C, K, device, lead)
    block = block.expand(B, C)
    has = torch.zeros((B, nb), dtype=torch.bool, device=device).scatter_reduce(
        1, block.expand(B, C), completion_mask, "amax")
    u = rand((B, nb), generator=generator, device=device, dtype=torch.float64)
    pick = torch.where(has, u, -1.0).argmax(-1, keepdim=True)  # (B, 1)
    active = ((block == pick) if later_blocks == "clean" else (block >= pick)) & completion_mask
    draws = rand((B, C), generator=generator, device=device, dtype=torch.float64)
    masked = active & (draws < (r[:, None] if r.dim() else r))
    return DistillMask(masked=masked, active=active)


def view_times(masked: torch.Tensor, *, block_size: int | None, t_min: float = 1e-3) -> torch.Tensor:
    """The time of a view for a time-conditioned model: the masked fraction of each block ``(B, nb)`` (of the row,
    ``(B,)``, for ``block_size=None``), clamped to ``[t_min, 1 − t_min]``. A mask kernel with α_t = 1 − t masks a
    fraction ``t`` in expectation."""
    m = masked.to(torch.float32)
    if block_size is None:
        return m.mean(-1).clamp(t_min, 1.0 - t_min)
    K = V.check_positive_int("block_size", block_size)
    B, L = m.shape
    nb = -(-L // K)
    sums = torch.nn.functional.pad(m, (0, nb * K - L)).unflatten(-1, (nb, K)).sum(-1)
    sizes = torch.full((nb,), float(K), device=m.device)
    sizes[-1] = L - (nb - 1) * K
    return (sums / sizes).clamp(t_min, 1.0 - t_min)


def mask_ratio_curriculum(step: int, total_steps: int, *, start: float = 0.2, end: float = 0.8) -> float:
    """A linear ramp of the mask ratio from ``start`` at step 0 to ``end`` at ``total_steps`` (held after):
    d3LLM's curriculum (easy views with few masked tokens first, then the many-token steps of parallel decoding)."""
    V.check_positive_int("total_steps", total_steps)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}")
    for name, v in (("start", start), ("end", end)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ValueError(f"{name}: expected a ratio in [0, 1], got {v!r}")
    frac = min(step / total_steps, 1.0)
    return float(start + (end - start) * frac)


def block_size_curriculum(step: int, total_steps: int, *, sizes: Sequence[int] = (4, 8, 16, 32)) -> int:
    """A staircase over ``sizes``: equal shares of ``total_steps`` per size, in order (the last held after):
    d3LLM's block-size curriculum, for a model that takes any block size (a plain, bidirectional model decoding
    block by block; a block model's size is fixed by its adaptation)."""
    V.check_positive_int("total_steps", total_steps)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}")
    if not sizes:
        raise ValueError("sizes: expected at least one block size")
    values = [V.check_positive_int("sizes", s) for s in sizes]
    return values[min(step * len(values) // total_steps, len(values) - 1)]
