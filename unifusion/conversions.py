"""Exact conversions of an x0 prediction into the other parameterizations (paper Theorem 3.5).

For a clean-token prediction x_θ(·|j, t) at the current state j = x_t, with q_t(k|x_θ) = Σ_z x_θ(z) q_{t|0}(k|z):

* SEDD score        s_i = q_t(i|x_θ) / q_t(j|x_θ)
* M2S mean          μ(z) = x_θ(z) q_{t|0}(j|z) / q_t(j|x_θ)     (then (B_{j,t} μ)_i = s_i)
* Neural CTMC       λ = Σ_{k≠j} R̂_t(j, k|x_θ),  r(i) = R̂_t(j, i|x_θ) / λ

Feeding each output to the matching :class:`~unifusion.ReverseRate` constructor reproduces
``ReverseRate.from_x0`` exactly. :func:`convert_x0_to` works on probabilities; :func:`log_heads_from_x0_logits`
computes the same heads in log space from x0 logits (what the losses train on).
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from . import _validation as V
from .kernels import Kernel, check_kernel
from .rates import ReverseRate, prepare_rows, x0_log_probs

__all__ = ["convert_x0_to", "log_heads_from_x0_logits", "CONVERSION_TARGETS"]

CONVERSION_TARGETS = ("rate", "sedd", "m2s", "ctmc")


@overload
def convert_x0_to(target: Literal["rate"], x0_probs: torch.Tensor, kernel: Kernel, x_t: torch.Tensor,
                  t: torch.Tensor | float, *, strict: bool = ...) -> ReverseRate: ...
@overload
def convert_x0_to(target: Literal["sedd", "m2s"], x0_probs: torch.Tensor, kernel: Kernel, x_t: torch.Tensor,
                  t: torch.Tensor | float, *, strict: bool = ...) -> torch.Tensor: ...
@overload
def convert_x0_to(target: Literal["ctmc"], x0_probs: torch.Tensor, kernel: Kernel, x_t: torch.Tensor,
                  t: torch.Tensor | float, *, strict: bool = ...) -> tuple[torch.Tensor, torch.Tensor]: ...


def convert_x0_to(target: str, x0_probs: torch.Tensor, kernel: Kernel, x_t: torch.Tensor,
                  t: torch.Tensor | float, *, strict: bool = True):
    """Convert an x0 prediction ``x0_probs (..., S)`` at states ``x_t (...)`` and times ``t`` (Theorem 3.5).

    Args:
        target: ``"rate"`` → :class:`ReverseRate`; ``"sedd"`` → concrete score ``(..., S)`` (1 at x_t);
            ``"m2s"`` → posterior mean μ ``(..., S)``; ``"ctmc"`` → ``(exit_rate (...), jump_probs (..., S))``.
        x0_probs: clean-token distribution x_θ (rows sum to 1; a mask state should carry 0).
        kernel: the forward kernel.
        x_t: current states, int64 ``(...)``.
        t: times in (0, 1), broadcastable to ``(...)``.
        strict: for ``"m2s"``, raise ``ValueError`` where x_t is unreachable at time t from some clean state
            (e.g. an unmasked token under the mask kernel), where B_{x_t,t} and hence M2S is undefined. With
            ``strict=False`` such rows are returned as μ = e_{x_t}; their induced rates are 0 either way.

    Example::

        score = uf.convert_x0_to("sedd", x0_probs, kernel, x_t, t)
        rate = uf.ReverseRate.from_score(kernel, score, x_t, t)   # == ReverseRate.from_x0(kernel, x0_probs, x_t, t)
    """
    if not isinstance(target, str) or target not in CONVERSION_TARGETS:
        raise ValueError(f"target: expected one of {CONVERSION_TARGETS}, got {target!r}")
    kernel = check_kernel(kernel)
    p = V.check_distribution("x0_probs", x0_probs, kernel.num_states)
    ids, t_, dtype = prepare_rows(kernel, x_t, t, p)
    p = p.to(dtype)
    if target == "rate":
        return ReverseRate.from_x0(kernel, p, ids, t_)
    if target == "ctmc":
        rate = ReverseRate.from_x0(kernel, p, ids, t_)
        return rate.exit_rate, rate.jump_probs

    q = kernel.propagate(p, t_)  # q_t(·|x_θ), (..., S)
    shape = torch.broadcast_shapes(q.shape[:-1], ids.shape)
    ids = ids.expand(shape)
    q = q.expand(*shape, kernel.num_states)
    q_xt = q.gather(-1, ids.unsqueeze(-1))
    positive = q_xt > 0
    if V.validation_enabled() and not bool(positive.all()):
        raise ValueError("x0_probs: q_t(x_t | x_θ) = 0 at some position; Theorem 3.5 needs it positive")
    safe_q_xt = torch.where(positive, q_xt, torch.ones_like(q_xt))
    if target == "sedd":
        return torch.where(positive, q / safe_q_xt, torch.zeros_like(q))

    # m2s
    col = kernel.transition_column(ids, torch.zeros_like(t_), t_)  # q_{t|0}(x_t | z)
    clean = kernel.clean_state_mask_on(col.device)  # built on the device: no host-to-device copy per call
    unreachable = ((col <= 0) & clean).any(-1, keepdim=True)
    if strict and V.validation_enabled() and bool(unreachable.any()):
        raise ValueError(
            "x_t: some state is unreachable at time t from a clean state (q_{t|0}(x_t|z) = 0, e.g. an unmasked "
            "token under the mask kernel); M2S's mean μ and operator B are undefined there (Theorem 3.5). "
            "Pass strict=False to get μ = e_{x_t} on such rows (their induced reverse rates are 0)."
        )
    mu = p.expand_as(col) * col / safe_q_xt
    e_xt = torch.zeros_like(mu).scatter_(-1, ids.unsqueeze(-1), 1.0)
    return torch.where(unreachable, e_xt, mu)


@overload
def log_heads_from_x0_logits(target: Literal["sedd", "m2s"], logits: torch.Tensor, kernel: Kernel,
                             x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor: ...
@overload
def log_heads_from_x0_logits(target: Literal["ctmc"], logits: torch.Tensor, kernel: Kernel, x_t: torch.Tensor,
                             t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def log_heads_from_x0_logits(target: str, logits: torch.Tensor, kernel: Kernel, x_t: torch.Tensor,
                             t: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Theorem 3.5 in log space: the head ``target`` that x0 logits ``(..., S)`` induce at states ``x_t (...)`` and
    times ``t`` (broadcasting to ``x_t``), with log x_θ = :func:`~unifusion.rates.x0_log_probs` and
    log q_t(·|x_θ) = ``kernel.log_propagate(log x_θ, t)``:

    * ``"sedd"``: log s_i = log q_t(i|x_θ) − log q_t(x_t|x_θ), ``(..., S)``;
    * ``"m2s"``: log μ(z) = log x_θ(z) + log q_{t|0}(x_t|z) − log q_t(x_t|x_θ), ``(..., S)``;
    * ``"ctmc"``: ``(log λ (...), log R̂_t(x_t, ·) (..., S))``, the log rates serving as jump logits (−inf at x_t).
      A row without rates (an unmasked token under the mask kernel) has log λ = −inf, with a zero gradient.

    Nothing is checked (callers pass validated tensors of one dtype, as to the kernel protocol); autograd flows
    through every finite entry. :func:`convert_x0_to` is the checked conversion of probabilities.
    """
    log_x = x0_log_probs(kernel, logits)
    log_q = kernel.log_propagate(log_x, t)  # log q_t(·|x_θ)
    log_q_xt = log_q.gather(-1, x_t.unsqueeze(-1))
    if target == "sedd":
        return log_q - log_q_xt
    if target == "m2s":
        log_col = torch.log(kernel.transition_column(x_t, torch.zeros_like(t), t).clamp_min(0))
        return log_x + log_col - log_q_xt
    if target == "ctmc":
        log_R = torch.log(kernel.rate_column(x_t, t))
        log_rates = (log_R + log_q - log_q_xt).scatter(-1, x_t.unsqueeze(-1), float("-inf"))
        zero_row = torch.isneginf(log_rates).all(-1, keepdim=True)  # logsumexp of −inf only: a NaN gradient
        log_exit = torch.logsumexp(torch.where(zero_row, torch.zeros_like(log_rates), log_rates), dim=-1)
        log_exit = torch.where(zero_row.squeeze(-1), torch.full_like(log_exit, float("-inf")), log_exit)
        return log_exit, log_rates
    raise ValueError(f"target: expected 'sedd', 'm2s' or 'ctmc', got {target!r}")
