"""Reverse rates R̂_t(x_t, i) and the parameterizations that induce them (paper §2, Theorem 3.3).

A :class:`ReverseRate` stores one off-diagonal reverse-rate row per position: ``rates[..., i] = R̂_t(x_t, i)`` for
every target ``i`` (``(..., S)``, state dim last) with the entry ``i == x_t`` equal to 0; the diagonal is implied by
the row sum, R̂_t(x_t, x_t) = −λ. The constructors implement the five faces of Theorem 3.3:

=====================  ===============================================================
true conditional       R̂_t(j, i | x0) = R_t(i, j) q_{t|0}(i|x0) / q_{t|0}(j|x0)
x0 prediction          R̂_t(j, i | x_θ) = R_t(i, j) q_t(i|x_θ) / q_t(j|x_θ)          (MDLM / GIDD)
concrete score         R̂_t(j, i) = R_t(i, j) s_θ(j, t)_i                              (SEDD)
posterior mean         R̂_t(j, i) = R_t(i, j) (B_{j,t} μ_θ)_i                          (M2S)
exit rate / jump       R̂_t(j, i) = λ_θ(j, t) r_θ(i | j, t)                            (Neural CTMC)
=====================  ===============================================================

with (B_{j,t} μ)_i = Σ_z μ(z) q_{t|0}(i|z) / q_{t|0}(j|z). A rate whose denominator vanishes is 0 (paper §2).
"""

from __future__ import annotations

import torch

from . import _validation as V
from ._math import log_softmax, safe_log
from .kernels import Kernel, check_kernel

__all__ = ["ReverseRate", "b_operator", "prepare_rows", "x0_log_probs"]


def _check_row(name: str, row: object, x_t: torch.Tensor, num_states: int) -> torch.Tensor:
    row = V.check_tensor(name, row)
    if not row.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {row.dtype}")
    if row.dim() == 0 or row.shape[-1] != num_states:
        raise ValueError(f"{name}: expected shape (..., {num_states}) (num_states last), got {tuple(row.shape)}")
    try:
        torch.broadcast_shapes(row.shape[:-1], x_t.shape)
    except RuntimeError:
        raise ValueError(
            f"{name}: leading shape {tuple(row.shape[:-1])} does not broadcast with x_t's shape {tuple(x_t.shape)}"
        ) from None
    V.check_finite(name, row)
    return row


def prepare_rows(kernel: Kernel, x_t: torch.Tensor, t: torch.Tensor | float,
           *rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    with V.batched_checks():
        ids = V.check_token_ids("x_t", x_t, kernel.num_states)
        dtype = V.compute_dtype(*rows, t if isinstance(t, torch.Tensor) else None)
        # t is read against the positions the result has: x_t's shape broadcast with the rows' leading shape (a
        # (T, N, L, S) head over x_t (N, L) takes a (T, 1, 1) grid of times)
        shape = ids.shape
        leading = [row.shape[:-1] for row in rows if isinstance(row, torch.Tensor) and row.dim() >= 1]
        if leading:
            try:
                shape = torch.broadcast_shapes(ids.shape, *leading)
            except RuntimeError:  # the rows' own check names the mismatch
                pass
        t_ = V.check_time("t", t, device=ids.device, dtype=dtype, shape=shape)
    return ids, t_, dtype


def _zero_at(rows: torch.Tensor, x_t: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    shape = torch.broadcast_shapes(rows.shape[:-1], x_t.shape)
    rows = rows.expand(*shape, rows.shape[-1])
    return rows.scatter(-1, x_t.expand(shape).unsqueeze(-1), value)


class ReverseRate:
    """Off-diagonal reverse-rate rows ``rates (..., S)`` at current states ``x_t (...)``.

    ``rates[..., i]`` is R̂_t(x_t, i) ≥ 0 and ``rates[..., x_t] == 0``. When a constructor can compute the rates in
    log space it keeps ``log_rates`` too, which :func:`bregman_rate_loss` uses for accuracy.
    """

    def __init__(self, rates: torch.Tensor, x_t: torch.Tensor, *, log_rates: torch.Tensor | None = None) -> None:
        x_t = V.check_tensor("x_t", x_t)
        if x_t.dtype.is_floating_point or x_t.dtype == torch.bool:
            raise TypeError(f"x_t: expected integer token ids, got dtype {x_t.dtype}")
        rates = V.check_tensor("rates", rates)
        if rates.dim() == 0:
            raise ValueError("rates: expected shape (..., num_states), got a scalar")
        num_states = rates.shape[-1]
        x_t = V.check_token_ids("x_t", x_t, num_states)
        rates = _check_row("rates", rates, x_t, num_states)
        if V.validation_enabled() and rates.numel() and bool((rates < 0).any()):
            raise ValueError(f"rates: expected non-negative rates, got min {float(rates.min())}")
        self.rates = _zero_at(rates, x_t)
        self.x_t = x_t.expand(self.rates.shape[:-1])
        self.log_rates = None if log_rates is None else _zero_at(log_rates, x_t, float("-inf"))

    @property
    def num_states(self) -> int:
        return self.rates.shape[-1]

    @property
    def exit_rate(self) -> torch.Tensor:
        """λ = Σ_{i ≠ x_t} R̂_t(x_t, i), ``(...)``."""
        return self.rates.sum(-1)

    @property
    def jump_probs(self) -> torch.Tensor:
        """r(i) = R̂_t(x_t, i) / λ, ``(..., S)``, 0 at x_t (and all 0 for a zero row)."""
        lam = self.exit_rate.unsqueeze(-1)
        return torch.where(lam > 0, self.rates / torch.where(lam > 0, lam, torch.ones_like(lam)),
                           torch.zeros_like(self.rates))

    def __repr__(self) -> str:
        return f"ReverseRate(shape={tuple(self.rates.shape)}, dtype={self.rates.dtype})"

    # ------------------------------------------------------------------ constructors (Theorem 3.3)
    @classmethod
    def from_log_marginal(cls, kernel: Kernel, x_t: torch.Tensor, t: torch.Tensor,
                        log_q: torch.Tensor) -> ReverseRate:
        """R_t(i, x_t) q(i)/q(x_t) from log q ``(..., S)``; 0 where q(x_t) = 0."""
        shape = torch.broadcast_shapes(log_q.shape[:-1], x_t.shape)
        x_t = x_t.expand(shape)
        log_q = log_q.expand(*shape, log_q.shape[-1])
        log_den = log_q.gather(-1, x_t.unsqueeze(-1))
        reachable = ~torch.isneginf(log_den)
        log_R = safe_log(kernel.rate_column(x_t, t))
        log_rates = log_R + log_q - torch.where(reachable, log_den, torch.zeros_like(log_den))
        log_rates = torch.where(reachable, log_rates, torch.full_like(log_rates, float("-inf")))
        log_rates = _zero_at(log_rates, x_t, float("-inf"))
        return cls(torch.exp(log_rates), x_t, log_rates=log_rates)

    @classmethod
    def true_conditional(cls, kernel: Kernel, x0: torch.Tensor, x_t: torch.Tensor,
                         t: torch.Tensor | float) -> ReverseRate:
        """R̂_t(x_t, i | x0) = R_t(i, x_t) q_{t|0}(i|x0) / q_{t|0}(x_t|x0) for clean ids ``x0`` ``(...)``."""
        kernel = check_kernel(kernel)
        ids, t_, dtype = prepare_rows(kernel, x_t, t)
        x0 = V.check_token_ids("x0", x0, kernel.num_states)
        log_q0 = kernel.log_marginal_of_ids(x0, t_, dtype)
        return cls.from_log_marginal(kernel, ids, t_, log_q0)

    @classmethod
    def from_x0(cls, kernel: Kernel, x0_probs: torch.Tensor, x_t: torch.Tensor,
                t: torch.Tensor | float) -> ReverseRate:
        """R̂_t(x_t, i | x_θ) = R_t(i, x_t) q_t(i|x_θ) / q_t(x_t|x_θ) for a clean-token distribution ``(..., S)``."""
        kernel = check_kernel(kernel)
        p = V.check_distribution("x0_probs", x0_probs, kernel.num_states)
        ids, t_, dtype = prepare_rows(kernel, x_t, t, p)
        log_q = safe_log(kernel.propagate(p.to(dtype), t_))
        return cls.from_log_marginal(kernel, ids, t_, log_q)

    @classmethod
    def from_x0_logits(cls, kernel: Kernel, x0_logits: torch.Tensor, x_t: torch.Tensor,
                       t: torch.Tensor | float) -> ReverseRate:
        """As :meth:`from_x0` from unnormalised logits ``(..., S)`` (mask entry ignored), fully in log space."""
        kernel = check_kernel(kernel)
        logits = V.check_head("x0_logits", x0_logits, kernel.num_states)
        ids, t_, dtype = prepare_rows(kernel, x_t, t, logits)
        log_p = x0_log_probs(kernel, logits.to(dtype))
        log_q = kernel.log_propagate(log_p, t_)
        return cls.from_log_marginal(kernel, ids, t_, log_q)

    @classmethod
    def from_score(cls, kernel: Kernel, score: torch.Tensor, x_t: torch.Tensor,
                   t: torch.Tensor | float) -> ReverseRate:
        """SEDD: R̂_t(x_t, i) = R_t(i, x_t) s_i for a non-negative concrete score ``(..., S)`` (x_t entry ignored)."""
        kernel = check_kernel(kernel)
        ids, t_, dtype = prepare_rows(kernel, x_t, t, score)
        score = _check_row("score", score, ids, kernel.num_states).to(dtype)
        score = _zero_at(score, ids)
        if V.validation_enabled() and score.numel() and bool((score < 0).any()):
            raise ValueError(f"score: expected non-negative concrete scores, got min {float(score.min())}")
        rates = kernel.rate_column(ids, t_) * score
        return cls(rates, ids)

    @classmethod
    def from_posterior_mean(cls, kernel: Kernel, mu: torch.Tensor, x_t: torch.Tensor,
                            t: torch.Tensor | float) -> ReverseRate:
        """M2S: R̂_t(x_t, i) = R_t(i, x_t) (B_{x_t,t} μ)_i, (Bμ)_i = Σ_z μ(z) q_{t|0}(i|z)/q_{t|0}(x_t|z).

        ``mu`` ``(..., S)`` is a distribution over clean states. Rows whose forward rates into x_t all vanish are 0;
        a nonzero row at an x_t unreachable from some z with μ(z) > 0 raises ``ValueError`` (validation on).
        """
        kernel = check_kernel(kernel)
        mu = V.check_distribution("mu", mu, kernel.num_states)
        ids, t_, dtype = prepare_rows(kernel, x_t, t, mu)
        mu = mu.to(dtype)
        R = kernel.rate_column(ids, t_)
        score = b_operator(kernel, mu, ids, t_, R)
        return cls(R * score, ids)

    @classmethod
    def from_exit_jump(cls, exit_rate: torch.Tensor, jump_probs: torch.Tensor, x_t: torch.Tensor) -> ReverseRate:
        """Neural CTMC: R̂(x_t, i) = λ r(i) with λ ``(...)`` ≥ 0 and r ``(..., S)`` a distribution over i ≠ x_t."""
        exit_rate = V.check_tensor("exit_rate", exit_rate)
        jump_probs = V.check_tensor("jump_probs", jump_probs)
        if not (exit_rate.dtype.is_floating_point and jump_probs.dtype.is_floating_point):
            raise TypeError("exit_rate, jump_probs: expected floating-point tensors")
        if jump_probs.dim() == 0:
            raise ValueError("jump_probs: expected shape (..., num_states), got a scalar")
        ids = V.check_token_ids("x_t", x_t, jump_probs.shape[-1])
        jump_probs = _check_row("jump_probs", jump_probs, ids, jump_probs.shape[-1])
        if V.validation_enabled() and exit_rate.numel() and bool((exit_rate < 0).any()):
            raise ValueError(f"exit_rate: expected non-negative rates, got min {float(exit_rate.min())}")
        dtype = V.compute_dtype(exit_rate, jump_probs)
        return cls(exit_rate.to(dtype).unsqueeze(-1) * jump_probs.to(dtype), ids)


def x0_log_probs(kernel: Kernel, logits: torch.Tensor, *, exact_gradient: bool = False) -> torch.Tensor:
    """log x_θ from logits ``(..., S)``: log-softmax over clean states (a mask state gets −inf, MDLM's SUBS).

    ``exact_gradient=True`` makes the gradient exact at the most likely entry too (what the float64 reference losses
    use); the values do not change.
    """
    return log_softmax(logits, kernel.mask_id, exact_gradient=exact_gradient)


def b_operator(kernel: Kernel, mu: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                R: torch.Tensor) -> torch.Tensor:
    """(B_{x_t,t} μ)_i = Σ_z μ(z) q_{t|0}(i|z)/q_{t|0}(x_t|z) ``(..., S)``, 0 on rows with R(·, x_t) ≡ 0."""
    col = kernel.transition_column(x_t, torch.zeros_like(t), t)  # q_{t|0}(x_t | z), (..., S)
    active = (R > 0).any(-1, keepdim=True)
    reachable = col > 0
    if V.validation_enabled():
        bad = active & ((mu > 0) & ~reachable).any(-1, keepdim=True)
        if bool(bad.any()):
            raise ValueError(
                "mu: x_t is not reachable at time t from every clean state z with mu(z) > 0 "
                "(q_{t|0}(x_t|z) = 0), so the M2S operator B_{x_t,t} is undefined there (Theorem 3.5's condition)"
            )
    ratio = torch.where(reachable, mu / torch.where(reachable, col, torch.ones_like(col)), torch.zeros_like(mu))
    score = kernel.propagate(ratio, t)
    return torch.where(active, score, torch.zeros_like(score))
