"""Distillation losses on logits: dParallel's certainty forcing and a CDLM-style KL to a teacher.

**Certainty forcing** (dParallel, ``czg1225/dParallel`` ``LLaDA/llada_train.py`` ``compute_loss``; d3LLM uses the
same term). For one masked view with logits ``z_n`` at positions n, targets ``y_n`` (the teacher's tokens), the
masked set ``M`` and the *certain* set ``C = {n ∈ M : argmax z_n = y_n}`` (masked positions the student already
predicts correctly):

    L_CF = (1/|M|) Σ_{n∈M} CE(z_n, y_n)  +  λ · (1/|C|) Σ_{n∈C} H(softmax(z_n / T)),

with H(p) = −Σ_v p_v log p_v, temperature T (0.5) and weight λ (2.0). The entropy term pushes the student to commit
what it already gets right with confidence — what lets a threshold policy commit several tokens per forward; it has
zero gradient at unmasked and wrongly predicted positions (the argmax test is not differentiated). An empty ``M``
(or ``C``) makes its term 0 (with a zero gradient), as dParallel's ``0.0 * logits.sum()``. dParallel trains on a
complementary pair (:meth:`~unifusion.distill.DistillMask.complement`): the loss of the pair is the sum of two calls.

**Reductions.** The library's losses return per-position values so a distributed loop can normalise by a global
count; the two means here have two counts, so :func:`certainty_forcing_terms` returns both per-position terms and
both counts (:class:`CertaintyForcingTerms`), and :func:`certainty_forcing_loss` is their combination above (the
scalar dParallel trains on). ``mask_id`` (optional) removes the mask token's column from the student's distribution
(the SUBS convention of the library's mask-kernel losses); dParallel keeps it (the default ``None``).

**KL to a teacher** (CDLM's distillation term): on the positions a teacher committed, the student matches the
teacher's distribution, KL(softmax(z^T / T) ‖ softmax(z^S / T)) (``direction="forward"``; ``"reverse"`` swaps the
arguments, SDTT's choice), averaged over the positions. CDLM's consistency term is the same call with the logits of
the completed block's view as the teacher (detached): the student's prediction at an intermediate state matches its
prediction once the block is complete.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from .. import _validation as V

__all__ = ["CertaintyForcingTerms", "certainty_forcing_terms", "certainty_forcing_loss", "teacher_kl_loss",
           "check_certainty_options"]


def check_certainty_options(temperature: object, entropy_weight: object) -> tuple[float, float]:
    """``temperature`` > 0 and ``entropy_weight`` >= 0 as floats (``ValueError`` naming the argument otherwise)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 or \
            not math.isfinite(temperature):
        raise ValueError(f"temperature: expected a finite float > 0, got {temperature!r}")
    if isinstance(entropy_weight, bool) or not isinstance(entropy_weight, (int, float)) or \
            not entropy_weight >= 0 or not math.isfinite(entropy_weight):
        raise ValueError(f"entropy_weight: expected a finite float >= 0, got {entropy_weight!r}")
    return float(temperature), float(entropy_weight)


@dataclass(frozen=True)
class CertaintyForcingTerms:
    """Per-position terms of the certainty-forcing loss (module docstring).

    Attributes:
        cross_entropy: ``(...)`` CE(z_n, y_n) on masked positions, 0 elsewhere.
        entropy: ``(...)`` H(softmax(z_n / T)) on certain positions, 0 elsewhere.
        masked: ``(...)`` bool, M.  certain: ``(...)`` bool, C.
        entropy_weight: λ.
    """

    cross_entropy: torch.Tensor
    entropy: torch.Tensor
    masked: torch.Tensor
    certain: torch.Tensor
    entropy_weight: float

    @property
    def num_masked(self) -> torch.Tensor:
        """|M| (0-d int64; all-reduce it for a global mean)."""
        return self.masked.sum()

    @property
    def num_certain(self) -> torch.Tensor:
        """|C| (0-d int64)."""
        return self.certain.sum()

    def loss(self) -> torch.Tensor:
        """(1/|M|) Σ CE + λ (1/|C|) Σ H; an empty set's term is 0."""
        ce = self.cross_entropy.sum() / self.num_masked.clamp_min(1)
        h = self.entropy.sum() / self.num_certain.clamp_min(1)
        return ce + self.entropy_weight * h


def _check_view(logits: object, targets: object, masked: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    z = V.check_tensor("logits", logits)
    if z.dim() < 1 or not z.dtype.is_floating_point:
        raise ValueError(f"logits: expected a floating (..., V) tensor, got {tuple(z.shape)} {z.dtype}")
    y = V.check_tensor("targets", targets)
    if tuple(y.shape) != tuple(z.shape[:-1]) or not V.is_integer_dtype(y.dtype):
        raise ValueError(f"targets: expected integer ids of shape {tuple(z.shape[:-1])} (logits without the last "
                         f"dimension), got {tuple(y.shape)} {y.dtype}")
    m = V.check_tensor("masked", masked)
    if tuple(m.shape) != tuple(y.shape) or m.dtype != torch.bool:
        raise ValueError(f"masked: expected a bool tensor of shape {tuple(y.shape)} like targets, got "
                         f"{tuple(m.shape)} {m.dtype}")
    bad = m & ((y < 0) | (y >= z.shape[-1]))
    V.fail_if(bad.any(), lambda: f"targets: masked positions need ids in [0, {z.shape[-1]})")
    return z, y.long(), m


def certainty_forcing_terms(logits: torch.Tensor, targets: torch.Tensor, masked: torch.Tensor, *,
                            temperature: float = 0.5, entropy_weight: float = 2.0,
                            mask_id: int | None = None) -> CertaintyForcingTerms:
    """The per-position terms of dParallel's certainty forcing for one view (module docstring).

    Args:
        logits: ``(..., V)`` the student's logits on the view (any float dtype; computed in float32 at least).
        targets: ``(...)`` the teacher's tokens.  masked: ``(...)`` bool, the view's masked positions.
        temperature: T > 0 of the entropy.  entropy_weight: λ >= 0.
        mask_id: a column left out of the student's distribution (the mask token), or ``None``.
    """
    T, lam = check_certainty_options(temperature, entropy_weight)
    z, y, m = _check_view(logits, targets, masked)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if mask_id is not None:
        V.check_token_id("mask_id", mask_id, z.shape[-1])
        V.fail_if((m & (y == mask_id)).any(), lambda: f"targets: masked positions hold the mask id {mask_id}")
        z = z.index_fill(-1, torch.tensor([mask_id], device=z.device), -math.inf)
    logp = torch.log_softmax(z, -1)
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    ce = torch.where(m, -logp.gather(-1, y[..., None])[..., 0], zero)
    certain = m & (z.detach().argmax(-1) == y)
    logq = torch.log_softmax(z / T, -1)
    H = -(logq.exp() * torch.where(torch.isinf(logq), zero, logq)).sum(-1)
    return CertaintyForcingTerms(cross_entropy=ce, entropy=torch.where(certain, H, zero), masked=m,
                                 certain=certain, entropy_weight=lam)


def certainty_forcing_loss(logits: torch.Tensor, targets: torch.Tensor, masked: torch.Tensor, *,
                           temperature: float = 0.5, entropy_weight: float = 2.0,
                           mask_id: int | None = None) -> torch.Tensor:
    """dParallel's certainty-forcing loss of one view (0-d): mean cross-entropy over the masked positions plus
    ``entropy_weight`` × the mean entropy of softmax(logits / T) over the masked positions predicted correctly
    (:func:`certainty_forcing_terms` for the arguments and the per-position terms)."""
    return certainty_forcing_terms(logits, targets, masked, temperature=temperature, entropy_weight=entropy_weight,
                                   mask_id=mask_id).loss()


def teacher_kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, positions: torch.Tensor, *,
                    temperature: float = 1.0, direction: Literal["forward", "reverse"] = "forward",
                    reduction: Literal["mean", "none"] = "mean", mask_id: int | None = None) -> torch.Tensor:
    """CDLM's distillation term: KL(p_teacher ‖ p_student) of softmax(logits / T) at ``positions`` (the tokens
    the teacher committed), the teacher's logits detached.

    Args:
        student_logits: ``(..., V)``.  teacher_logits: ``(..., V)``.  positions: ``(...)`` bool.
        temperature: T > 0.  direction: ``"forward"`` KL(teacher ‖ student) or ``"reverse"`` KL(student ‖ teacher).
        reduction: ``"mean"`` over ``positions`` (0 when none) or ``"none"`` (per position, 0 elsewhere).
        mask_id: a column left out of both distributions, or ``None``.
    """
    T, _ = check_certainty_options(temperature, 0.0)
    zs = V.check_tensor("student_logits", student_logits)
    zt = V.check_tensor("teacher_logits", teacher_logits)
    if tuple(zt.shape) != tuple(zs.shape):
        raise ValueError(f"teacher_logits: expected the shape of student_logits {tuple(zs.shape)}, got "
                         f"{tuple(zt.shape)}")
    pos = V.check_tensor("positions", positions)
    if tuple(pos.shape) != tuple(zs.shape[:-1]) or pos.dtype != torch.bool:
        raise ValueError(f"positions: expected a bool tensor of shape {tuple(zs.shape[:-1])}, got "
                         f"{tuple(pos.shape)} {pos.dtype}")
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction: expected 'forward' or 'reverse', got {direction!r}")
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction: expected 'mean' or 'none', got {reduction!r}")
    dtype = torch.promote_types(zs.dtype, torch.float32)
    ls = torch.log_softmax(zs.to(dtype) / T, -1)
    lt = torch.log_softmax(zt.detach().to(dtype) / T, -1)
    if mask_id is not None:
        V.check_token_id("mask_id", mask_id, zs.shape[-1])
        keep = torch.ones(zs.shape[-1], dtype=torch.bool, device=zs.device)
        keep[mask_id] = False
        ls = torch.log_softmax(ls[..., keep], -1)
        lt = torch.log_softmax(lt[..., keep], -1)
    p, lp, lq = (lt.exp(), lt, ls) if direction == "forward" else (ls.exp(), ls, lt)
    zero = torch.zeros((), dtype=dtype, device=zs.device)
    kl = torch.where(pos, (p * (lp - lq)).sum(-1), zero)
    if reduction == "none":
        return kl
    return kl.sum() / pos.sum().clamp_min(1)
