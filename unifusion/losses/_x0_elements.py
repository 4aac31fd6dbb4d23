"""The ``(n, S)`` element passes of the fast x0-head loss: what each pass computes over a block of rows of logits.

Three passes read the logits (the equations in :mod:`unifusion.losses.fast`): pass 1 the row maximum M and
s' = Σ_y e^{l_y − M} − 1 (:func:`sum_off_max`), pass 2 (uniform noise only) the sums over the clean states
(:func:`noise_sums`), pass 3 the gradient (:func:`grad_block`). Each is a pure function of one block, written with
out-of-place tensor ops that ``torch.compile`` fuses into a loop per row; :mod:`unifusion.losses._x0_passes` runs
them on all rows at once (compiled) or on blocks of rows (eager).
"""

from __future__ import annotations

import math

import torch

from ._x0_math import C_SCALE, exp_minus_max, x_minus_log1p_and_ratio

__all__ = ["column_ids", "compute_logits", "constants", "e_off_x0", "exp_off_max", "grad_block", "noise_sums",
           "sum_off_max"]


def constants(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d zero and one for torch.where: a Python number there becomes a new scalar tensor (an op) at every call; in
    the element dtype, and per-row where()s take them too (a 0-d tensor does not change the result's dtype)."""
    return torch.zeros((), dtype=dtype, device=device), torch.ones((), dtype=dtype, device=device)


def column_ids(S: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0 … S − 1 ``(S,)``: as floats where exact (below 2^24 states; Inductor's CPU loops compare those in one
    instruction, int64 ids in several), int64 beyond."""
    return torch.arange(S, device=device, dtype=dtype if S < 2**24 else torch.int64)


def compute_logits(logits: torch.Tensor, col: torch.Tensor, mask_id: int | None, dtype: torch.dtype,
                   ) -> torch.Tensor:
    """The logits ``(n, S)`` in the element dtype, −inf at the mask column (MDLM's SUBS: the mask entry of the head
    is ignored)."""
    l = logits.to(dtype)
    if mask_id is not None:
        l = torch.where(col == mask_id, -math.inf, l)
    return l


def exp_off_max(logits_dtype: torch.dtype, l: torch.Tensor, mx: torch.Tensor, dtype: torch.dtype,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(d, d_lo, P) of ``l`` ``(n, S)`` and its row maxima ``mx`` ``(n,)`` (in the element dtype): d = l − M (log P,
    exactly the value exponentiated; 0 at the maximum), P = e^{l − M}, and for float32 logits the rounding error
    d_lo of d with P compensated for it (:func:`~unifusion.losses._x0_math.exp_minus_max`; ``None`` otherwise)."""
    if logits_dtype == torch.float32 and dtype == torch.float32:
        return exp_minus_max(l, mx)
    d = l - mx.unsqueeze(-1)
    return d, None, torch.exp(d)


def sum_off_max(below: torch.Tensor, P: torch.Tensor, zero0: torch.Tensor, one0: torch.Tensor, rdt: torch.dtype,
                ) -> torch.Tensor:
    """s' = s − 1 = Σ_{P<1} P + (#{P = 1} − 1) ``(n,)`` in the rows' precision ``rdt``: 1 − p_j = s'/s to rounding
    even where p_j rounds to 1; and s = 1 + s' (a float32 Σ P would carry ~0.5 ulp of s per term it adds to a sum
    near 1: 2e-7 at 40 terms; Σ_{P<1} P is a sum of small terms, accurate relative to itself)."""
    return torch.where(below, P, zero0).sum(-1).to(rdt) + (torch.where(below, zero0, one0).sum(-1) - 1.0)


def noise_sums(d: torch.Tensor, d_lo: torch.Tensor | None, P: torch.Tensor, at_x0: torch.Tensor,
               k_e: torch.Tensor, log_k: tuple[torch.Tensor, torch.Tensor] | None, u_pos: torch.Tensor,
               zero0: torch.Tensor, one0: torch.Tensor, need_loss: bool, need_c: bool, dtype: torch.dtype,
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The uniform-noise sums over a block ``(n, S)``, each ``(n,)`` in the element dtype: Σ_{y≠x0} (x_y − log1p
    x_y) (if ``need_loss``), and (if ``need_c``) 2^100 Σ_{y≠x0} P_y e_y and T = Σ_{y≠x0} e_y (1 − P_y), with
    x = k P and e_y = x_y / (1 + x_y) off x0 (1 where u = 0). ``k_e`` is k ``(n,)`` in the element dtype, ``log_k``
    log k as element-dtype hi + lo (``None``: float64 elements, where log x_y is computed from x_y)."""
    X = torch.where(at_x0, zero0, P * k_e.unsqueeze(-1))
    f_sum = pce_sum = T = ratio = None
    if need_loss:
        log_X = None
        if log_k is not None:  # log x_y = d_y + log k, log k as hi + lo (its rows' precision)
            log_k_hi, log_k_lo = log_k
            lo = log_k_lo.unsqueeze(-1) if d_lo is None else d_lo + log_k_lo.unsqueeze(-1)
            log_X = (d + log_k_hi.unsqueeze(-1)) + lo
        f_X, ratio = x_minus_log1p_and_ratio(X, log_X, need_c)
        del log_X  # (eager: fewer (n, S) temporaries alive at once)
        f_sum = f_X.sum(-1)
        del f_X
    if need_c:
        ratio = X / (1.0 + X) if ratio is None else ratio
        del X
        E = torch.where(at_x0, zero0, torch.where(u_pos.unsqueeze(-1), ratio, one0))  # x0's term: pe_x0 per row
        del ratio
        # Σ p e ≈ k Σ P² where P is small: float32 products P E underflow from P ~ e^{−44} (k ~ 1) although A c'
        # (the gradient at x0) may be a normal number; scaled by 2^100 (exact) they stay normal to P E ~ 2^{−226}
        # (no overflow: Σ ≤ S 2^100), so every product that matters for a gradient above 2^{−126} is normal
        pce_sum = (P * C_SCALE * E).sum(-1)
        T = (E * (1.0 - P)).sum(-1)
    return f_sum, pce_sum, T


def grad_block(below: torch.Tensor, P: torch.Tensor, factors: torch.Tensor, u_pos: torch.Tensor,
               uniform_noise: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """∂L/∂logits ``(n, S)`` in ``out_dtype`` at every column as if it were neither x0 nor x_t: P (a e − b) below
    the maximum, g_j at it (``factors`` = (a, b, g_j, k) ``(4, n, 1)`` from
    :func:`unifusion.losses._x0_row_terms.row_terms`)."""
    a_e, b_e, g_j_e, k_e = factors
    e = e_off_x0(P, k_e.squeeze(-1) if uniform_noise else None, u_pos)
    return torch.where(below, P * (a_e * e - b_e), g_j_e).to(out_dtype)


def e_off_x0(P: torch.Tensor, k: torch.Tensor | None, u_pos: torch.Tensor) -> torch.Tensor | float:
    """e_z = 1 − q0_z/qθ_z for z ≠ x0 from P_z ``(n, m)``: x/(1 + x) with x = k P (1 where u = 0 or ``k`` is
    ``None``, the mask kernel)."""
    if k is None:
        return 1.0
    X = P * k.unsqueeze(-1)
    return torch.where(u_pos.unsqueeze(-1), X / (1.0 + X), torch.ones((), dtype=X.dtype, device=X.device))
