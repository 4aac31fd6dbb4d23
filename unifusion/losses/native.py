"""The five published losses in their own coordinates (paper App. A), per position, no reduction.

Each function returns ``(...)`` and equals ``bregman_rate_loss(ReverseRate.true_conditional(kernel, x0, x_t, t),
<the rates its head induces>)`` (Theorem 3.3 / Corollary 3.4). These are the straightforward vectorised
O(S)-per-position implementations; they are also the float64 references the fast paths are tested against.

Conventions: heads are ``(..., S)`` with the state dim last and leading shape equal to ``x_t``'s; logits are
normalised inside; the x0/μ heads ignore a kernel's mask entry (probability 0, MDLM's SUBS); the score's and the jump
head's ``x_t`` entries are ignored. Math runs in float32 (float64 when the head is float64).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from .. import _validation as V
from .. import rates
from .._math import bregman_from_log_ratio, bregman_from_logs, expm1_minus_x, log_softmax, safe_log, softplus
from ..kernels import (
    GeneratorKernel,
    HybridKernel,
    InterpolatingKernel,
    Kernel,
    MaskKernel,
    UniformKernel,
    check_kernel,
)
from ..rates import ReverseRate, b_operator
from .bregman import bregman_rate_loss

__all__ = ["sedd_loss", "reference_mdlm_loss", "reference_gidd_loss", "gidd_loss_weight", "m2s_loss", "ctmc_loss",
           "dynamic_weight", "check_weighting", "GIDD_WEIGHTINGS"]

GIDD_WEIGHTINGS = ("elbo", "clip", "dynamic")


def check_weighting(weighting: object, max_weight: object) -> None:
    """``weighting`` one of :data:`GIDD_WEIGHTINGS` and ``max_weight`` a positive number (the GIDD weights' clip), else
    a ``ValueError`` naming the argument."""
    if weighting not in GIDD_WEIGHTINGS:
        raise ValueError(f"weighting: expected one of {GIDD_WEIGHTINGS}, got {weighting!r}")
    if isinstance(max_weight, bool) or not isinstance(max_weight, (int, float)) or not max_weight > 0:
        raise ValueError(f"max_weight: expected a positive float, got {max_weight!r}")


# (kernel, heads by name, x0, x_t, t broadcast to x_t's shape, compute dtype)
_Prepared = tuple[Kernel, dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]


def _prepare(kernel: object, heads: dict[str, torch.Tensor], x0: torch.Tensor, x_t: torch.Tensor,
             t: torch.Tensor | float) -> _Prepared:
    with V.batched_checks():  # every value check of the call read back in one host sync
        return _prepare_checked(kernel, heads, x0, x_t, t)


def _prepare_checked(kernel: object, heads: dict[str, torch.Tensor], x0: torch.Tensor, x_t: torch.Tensor,
                     t: torch.Tensor | float) -> _Prepared:
    kernel = check_kernel(kernel)
    S = kernel.num_states
    x0 = V.check_token_ids("x0", x0, S)
    x_t = V.check_token_ids("x_t", x_t, S)
    try:
        shape = torch.broadcast_shapes(x0.shape, x_t.shape)
    except RuntimeError:
        raise ValueError(f"x0: shape {tuple(x0.shape)} does not broadcast with x_t's {tuple(x_t.shape)}") from None
    out = {}
    for name, h in heads.items():
        if name.startswith("log_exit"):
            h = V.check_tensor(name, h)
            if not h.dtype.is_floating_point:
                raise TypeError(f"{name}: expected a floating-point tensor, got dtype {h.dtype}")
            if tuple(h.shape) != tuple(shape):
                raise ValueError(f"{name}: expected shape {tuple(shape)} (that of x_t), got {tuple(h.shape)}")
            V.check_finite(name, h)
        else:
            h = V.check_head(name, h, S)
            if tuple(h.shape[:-1]) != tuple(shape):
                raise ValueError(
                    f"{name}: expected shape {(*shape, S)} (x_t's shape + num_states), got {tuple(h.shape)}")
        out[name] = h
    dtype = V.compute_dtype(*out.values())
    t_ = V.check_time("t", t, device=x_t.device, dtype=dtype, shape=shape)
    try:
        t_ = torch.broadcast_to(t_, shape)
    except RuntimeError:
        raise ValueError(f"t: shape {tuple(t_.shape)} does not broadcast to x_t's shape {tuple(shape)}") from None
    out = {k: v.to(dtype) for k, v in out.items()}
    return kernel, out, x0.expand(shape), x_t.expand(shape), t_, dtype


def _input_precision(loss_fn):
    """Evaluate the reference loss in float64 and return the compute dtype of its heads (float32 unless a head is
    float64), so the references are accurate to float32 rounding whatever the inputs: their time-dependent constants
    (α_t, rates, weights) lose ~1e-6 relative in float32 near t → 0 or 1, and small-S GeneratorKernel losses (matrix
    exponentials) ~1e-4. These are the slow, straightforward paths; the fast ones (:mod:`unifusion.losses.fast`)
    compute only their per-row constants in float64."""
    import functools
    import inspect

    signature = inspect.signature(loss_fn)

    @functools.wraps(loss_fn)
    def wrapper(*args, **kwargs):
        # the heads set the dtype, not t (a float64 t with float32 heads still computes in float64, returns float32)
        bound = signature.bind_partial(*args, **kwargs).arguments
        heads = [a for name, a in bound.items()
                 if name != "t" and isinstance(a, torch.Tensor) and a.dtype.is_floating_point]
        want = V.compute_dtype(*heads)
        if want != torch.float64 and not any(h.device.type == "mps" for h in heads):
            up = (lambda a: a.double() if isinstance(a, torch.Tensor) and a.dtype.is_floating_point else a)
            return loss_fn(*map(up, args), **{k: up(v) for k, v in kwargs.items()}).to(want)
        return loss_fn(*args, **kwargs)

    return wrapper


def _gather(row: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return row.gather(-1, idx.unsqueeze(-1)).squeeze(-1)


def _x0_log_probs_at(kernel: Kernel, logits: torch.Tensor, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log x_θ ``(..., S)``, δ = 1 − x_θ(x0) ``(...)``) from logits, exact for a confident model.

    δ is summed from the other entries, and where δ < 1/2 the entry at ``x0`` is log1p(−δ). The log-softmax
    (:func:`~unifusion.rates.x0_log_probs`) gives l_x0 − logsumexp(l), whose absolute error of one ulp is all of
    log x_θ(x0) ≈ −δ once δ is below it (float64: δ < 1e-16, logit gaps of ~40 nats), and the losses of such rows are
    O(δ) and need δ to full relative precision.
    """
    log_x = rates.x0_log_probs(kernel, logits, exact_gradient=True)
    idx = x0.unsqueeze(-1)
    delta = log_x.scatter(-1, idx, float("-inf")).exp().sum(-1)
    near = delta < 0.5
    at_x0 = torch.where(near, torch.log1p(-torch.where(near, delta, torch.zeros_like(delta))), _gather(log_x, x0))
    return log_x.scatter(-1, idx, at_x0.unsqueeze(-1)), delta


def _log_ratio_to_xt(log_q: torch.Tensor, x_t: torch.Tensor) -> torch.Tensor:
    """log q(y) − log q(x_t) ``(..., S)``; −inf everywhere on rows with q(x_t) = 0."""
    log_den = log_q.gather(-1, x_t.unsqueeze(-1))
    ok = ~torch.isneginf(log_den)
    out = log_q - torch.where(ok, log_den, torch.zeros_like(log_den))
    return torch.where(ok, out, torch.full_like(out, float("-inf")))


def _weighted_sum(weight: torch.Tensor, terms: torch.Tensor, x_t: torch.Tensor) -> torch.Tensor:
    """Σ_{y≠x_t} weight_y terms_y, skipping zero weights (so 0 · ∞ never appears)."""
    prod = torch.where(weight > 0, weight * terms, torch.zeros_like(terms))
    return prod.scatter(-1, x_t.unsqueeze(-1), 0.0).sum(-1)


class _Interp:
    """log-space pieces of an interpolating kernel q(y) = α p(y) + m(y), relative to the noise mass m.

    Near t → 1 both q_t(·|x0) and q_t(·|x_θ) approach m and their logs agree to many digits; ratios such as
    log q_{t|0}(y|x0) − log q_t(y|x_θ) are therefore built from log(q/m) = softplus(log α + log p − log m), which is
    small and accurate there, instead of subtracting two nearly equal logs.
    """

    def __init__(self, kernel: InterpolatingKernel, t: torch.Tensor, shape: torch.Size) -> None:
        alpha, a, b = kernel.coefficients(t)
        alpha, a, b = (torch.broadcast_to(v, shape) for v in (alpha, a, b))
        self.log_alpha = torch.log(alpha)
        self.m = kernel.noise_vector(a, b)                      # (..., S)
        self.has_m = self.m > 0
        self.log_m = torch.log(torch.where(self.has_m, self.m, torch.ones_like(self.m)))  # 0 where m = 0 (unused)

    def log_q_over_m(self, log_p: torch.Tensor) -> torch.Tensor:
        """log(q/m) = log(1 + α p/m) where m > 0 (0 elsewhere, unused)."""
        z = self.log_alpha.unsqueeze(-1) + log_p - self.log_m
        return torch.where(self.has_m, softplus(torch.where(self.has_m, z, torch.zeros_like(z))),
                           torch.zeros_like(z))

    def log_q(self, log_p: torch.Tensor, log_q_over_m: torch.Tensor) -> torch.Tensor:
        """log q from log(q/m) where m > 0, else log α + log p."""
        return torch.where(self.has_m, self.log_m + log_q_over_m, self.log_alpha.unsqueeze(-1) + log_p)


def _one_hot_log(ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """log δ(·, ids): 0 at ids, −inf elsewhere, ``(..., S)``."""
    out = torch.full_like(like, float("-inf"))
    return out.scatter(-1, ids.unsqueeze(-1), 0.0)


def _interp_log_r(ip: _Interp, x0: torch.Tensor, x_t: torch.Tensor) -> torch.Tensor:
    """log r_y = log q_{t|0}(y|x0) − log q_{t|0}(x_t|x0) ``(..., S)`` via log(q/m) (−inf rows where q(x_t|x0) = 0)."""
    log_d = _one_hot_log(x0, ip.m)
    lqm = ip.log_q_over_m(log_d)
    log_q0 = ip.log_q(log_d, lqm)
    log_q0_xt = _gather(log_q0, x_t).unsqueeze(-1)
    both = ip.has_m & _gather(ip.has_m, x_t).unsqueeze(-1)
    # both m > 0: log(m_y/m_xt) + log(q/m)_y − log(q/m)_xt, with the m-ratio exactly 0 when m_y == m_xt
    log_m_ratio = torch.where(ip.m == _gather(ip.m, x_t).unsqueeze(-1), torch.zeros_like(ip.m),
                              ip.log_m - _gather(ip.log_m, x_t).unsqueeze(-1))
    accurate = log_m_ratio + lqm - _gather(lqm, x_t).unsqueeze(-1)
    ok = ~torch.isneginf(log_q0_xt)
    direct = log_q0 - torch.where(ok, log_q0_xt, torch.zeros_like(log_q0_xt))
    out = torch.where(both, accurate, direct)
    return torch.where(ok, out, torch.full_like(out, float("-inf")))


# ---------------------------------------------------------------------------------------------------- SEDD
@_input_precision
def sedd_loss(log_score: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor | float,
              kernel: Kernel) -> torch.Tensor:
    """SEDD's score entropy (App. A, eq. loss-sedd), per position ``(...)``:

    Σ_{y≠x_t} Q_t(x_t, y) [s_y − r_y log s_y + K(r_y)],  r_y = q_{t|0}(y|x0)/q_{t|0}(x_t|x0),  K(a) = a(log a − 1),

    with Q_t = R_tᵀ (so Q_t(x_t, y) = R_t(y, x_t)) and s = exp(log_score) ``(..., S)``.
    """
    kernel, h, x0, x_t, t, dtype = _prepare(kernel, {"log_score": log_score}, x0, x_t, t)
    Q = kernel.rate_column(x_t, t)
    if isinstance(kernel, InterpolatingKernel):
        log_r = _interp_log_r(_Interp(kernel, t, x_t.shape), x0, x_t)
    else:
        log_r = _log_ratio_to_xt(kernel.log_marginal_of_ids(x0, t, dtype), x_t)
    # entries with no rate (Q = 0: the x_t entry, every entry of an unmasked token under the mask kernel) get the
    # harmless (r, s) = (1, 1): their term is dropped anyway, and an overflowing s there would poison the gradient
    used = Q > 0
    log_s = h["log_score"].masked_fill(~used, 0.0)
    log_r = log_r.masked_fill(~used, 0.0)
    # s − r log s + r log r − r  ==  f(r, s)
    return _weighted_sum(Q, bregman_from_logs(log_r, log_s), x_t)


# ---------------------------------------------------------------------------------------------------- MDLM
@_input_precision
def reference_mdlm_loss(x0_logits: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor | float,
                        kernel: MaskKernel) -> torch.Tensor:
    """MDLM (App. A, eq. loss-mdlm), per position ``(...)``: (−α_t'/(1 − α_t)) · (−log x_θ(x0)) at masked positions,
    0 elsewhere. Mask kernel only. The float64 reference of :func:`unifusion.losses.mdlm_loss`."""
    if not isinstance(kernel, MaskKernel):
        raise TypeError(f"kernel: reference_mdlm_loss needs a MaskKernel, got {type(kernel).__name__}")
    _, h, x0, x_t, t, dtype = _prepare(kernel, {"x0_logits": x0_logits}, x0, x_t, t)
    log_x, _ = _x0_log_probs_at(kernel, h["x0_logits"], x0)
    weight = -kernel.schedule.alpha_prime(t) / kernel.schedule.one_minus_alpha(t)
    nll = -_gather(log_x, x0)
    masked = x_t.eq(kernel.mask_id)
    return torch.where(masked, weight * nll, torch.zeros_like(nll))


# ---------------------------------------------------------------------------------------------------- GIDD
def dynamic_weight(kernel: Kernel, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """GIDD's "dynamic" loss weights, unclipped ``(...)``, as GIDD's current code computes them
    (github.com/dvruette/gidd, ``GiddLoss`` at commit f67acc9, 2025-06-09):

        2 at the mask,   1 at a uniform-noise token (x_t ≠ x0),   (B / S) · exp((γ/2) · sigmoid(−t)) at x_t = x0,

    with B = 2^γ p_u / (1 − p_u) and S the number of states (the mask included). sigmoid(−t) is the logistic
    function of −t (GIDD's code names it a log-SNR): the clean weight varies by a factor e^{(γ/2)(0.5 − 0.27)} over
    t ∈ (0, 1) and B/S sets its size. We follow the current revision because it is the one GIDD's published training
    configurations run; its first public revision (685336d) used B_v1 · ((1 − α)/α)^{γ/2} with its own schedule and
    B_v1 ≈ B/S, so both give clean tokens a weight O(1/S), not O(1).

    Kernels: :class:`HybridKernel` uses its (B, γ). GIDD's ``p_uniform = 0`` means p_u = e^{−20} there (its
    ``clip_noise``); ``HybridKernel(p_uniform=0)`` is the pure mask process and gives clean tokens weight 0 — pass
    ``p_uniform=math.exp(-20)`` to match GIDD's default bit for bit. :class:`MaskKernel` is the hybrid at p_u = 0
    (clean weight 0; its clean tokens carry no loss anyway). :class:`UniformKernel` (GIDD has no uniform-only
    process) is unifusion's extension with B = γ = 1: (1/S) · exp(sigmoid(−t)/2) at clean tokens, 1 elsewhere —
    the same 1/S scaling, so clean tokens weigh about 1/S of a noisy one.
    """
    if isinstance(kernel, HybridKernel):
        B, gamma = kernel.B, kernel.gamma
    elif isinstance(kernel, MaskKernel):
        B, gamma = 0.0, 1.0
    elif isinstance(kernel, UniformKernel):
        B, gamma = 1.0, 1.0
    else:
        raise TypeError(
            f"kernel: weighting='dynamic' is defined for interpolating kernels, got {type(kernel).__name__}")
    clean = (B / kernel.num_states) * torch.exp(gamma / 2.0 * torch.sigmoid(-t))
    noisy = torch.where(x_t == kernel.mask_id, 2.0, 1.0) if kernel.mask_id is not None else torch.ones_like(t)
    return torch.where(x_t == x0, clean, noisy.to(t.dtype))


def gidd_loss_weight(x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor | float, kernel: Kernel,
                     weighting: Literal["elbo", "clip", "dynamic"] = "elbo", max_weight: float = 2.0) -> torch.Tensor:
    """The per-position weight λ that :func:`reference_gidd_loss` (and every x0-head loss) multiplies its bracket with,
    ``(...)`` float64 (x0, x_t int64 ``(...)``, t broadcasting to them):

    * ``"elbo"``: w_t(x_t, x0) = R_t(·, x_t) / q_{t|0}(x_t | x0), the forward rate into x_t (the same from every
      source) over the marginal (GIDD's ELBO weight; 0 where x_t is impossible under x0, whose loss is the model's
      exit rate instead);
    * ``"clip"``: that clipped to [0, ``max_weight``] (GIDD's ``loss_weighting: clip``, max 2);
    * ``"dynamic"``: GIDD's dynamic weight (current code, github.com/dvruette/gidd ``GiddLoss`` at f67acc9) clipped
      to [0, ``max_weight``]: 2 at the mask, 1 at a uniform-noise token, (B/S)·exp((γ/2)·sigmoid(−t)) at a clean
      token (B = 2^γ p_u/(1 − p_u), S counts the mask; see :func:`dynamic_weight` for the uniform and mask kernels).
      ``max_weight=math.inf`` gives the raw (unclipped) weight.

    Interpolating kernels only (uniform, mask, hybrid). Computed in float64 whatever ``t``'s dtype.

    Example::

        w = uf.losses.gidd_loss_weight(x0, x_t, t, uf.HybridKernel(S, S - 1, 0.1), "dynamic")   # (B, L)
    """
    check_weighting(weighting, max_weight)
    kernel = check_kernel(kernel)
    if not isinstance(kernel, InterpolatingKernel):
        raise TypeError(f"kernel: the GIDD weights are defined for interpolating kernels (uniform, mask, hybrid), "
                        f"got {type(kernel).__name__}")
    with V.batched_checks():
        x0 = V.check_token_ids("x0", x0, kernel.num_states)
        x_t = V.check_token_ids("x_t", x_t, kernel.num_states)
        try:
            shape = tuple(torch.broadcast_shapes(x0.shape, x_t.shape))
        except RuntimeError:
            raise ValueError(f"x0: shape {tuple(x0.shape)} does not broadcast with x_t's {tuple(x_t.shape)}") from None
        t_ = V.check_time("t", t, device=x_t.device, dtype=torch.float64, shape=shape)
    try:
        t_ = torch.broadcast_to(t_.to(torch.float64), shape)
    except RuntimeError:
        raise ValueError(f"t: shape {tuple(t_.shape)} does not broadcast to x_t's shape {shape}") from None
    x0, x_t = x0.expand(shape), x_t.expand(shape)
    if weighting == "dynamic":
        return dynamic_weight(kernel, x0, x_t, t_).clamp(0.0, max_weight)
    alpha, a, b = kernel.coefficients(t_)
    v_mask, v_unif = kernel.rate_coefficients(t_)
    v = torch.where(kernel.is_mask(x_t), v_mask,
                    torch.where(kernel.in_uniform_support(x_t), v_unif, torch.zeros_like(v_unif)))
    q0_xt = torch.where(x_t == x0, alpha, torch.zeros_like(alpha)) + kernel.noise_at(x_t, a, b)
    w = torch.where(q0_xt > 0, v / torch.where(q0_xt > 0, q0_xt, torch.ones_like(q0_xt)), torch.zeros_like(v))
    return w.clamp(0.0, max_weight) if weighting == "clip" else w


@_input_precision
def reference_gidd_loss(x0_logits: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor | float,
                        kernel: Kernel, weighting: Literal["elbo", "clip", "dynamic"] = "elbo",
                        max_weight: float = 2.0) -> torch.Tensor:
    """GIDD's loss (App. A, eq. loss-gidd), per position ``(...)``:

    w_t(x_t, x0) [KL(q_t(·|x0) ‖ q_t(·|x_θ)) + ρ − log ρ − 1],   ρ = q_t(x_t|x0)/q_t(x_t|x_θ),
    w_t(x_t, x0) = (β_t π_t'(x_t) − (α_t'/α_t) π_t(x_t)) / q_t(x_t|x0) = R_t(·, x_t) / q_{t|0}(x_t|x0).

    ``weighting="elbo"`` uses w exactly (then the loss equals D_t); ``"clip"`` clips w to [0, ``max_weight``];
    ``"dynamic"`` uses GIDD's dynamic weights (1 on uniform-noise tokens, 2 on masks, (B/S)·exp((γ/2)·sigmoid(−t))
    on clean tokens; GIDD's current code, see :func:`dynamic_weight`) clipped to [0, ``max_weight``]. For a
    :class:`GeneratorKernel` (rates not rank one) the ELBO form is evaluated as D_t directly, with log(r/s) formed
    without cancellation for a confident model (see :func:`_generator_d_t`).

    Finite for every finite logit (gaps of 10⁴ nats included) and t in (0, 1), value and gradient. The float64
    reference of :func:`unifusion.losses.gidd_loss`.
    """
    check_weighting(weighting, max_weight)
    kernel, h, x0, x_t, t, dtype = _prepare(kernel, {"x0_logits": x0_logits}, x0, x_t, t)
    log_x, delta = _x0_log_probs_at(kernel, h["x0_logits"], x0)
    if not isinstance(kernel, InterpolatingKernel):
        if weighting != "elbo":
            raise ValueError(f"weighting: only 'elbo' is defined for {type(kernel).__name__}, got {weighting!r}")
        if isinstance(kernel, GeneratorKernel):
            return _generator_d_t(kernel, log_x, x0, x_t, t)
        true = ReverseRate.true_conditional(kernel, x0, x_t, t)  # any other kernel: D_t from log-space rates
        model = ReverseRate.from_log_marginal(kernel, x_t, t, safe_log(kernel.propagate(log_x.exp(), t)))
        return bregman_rate_loss(true, model)

    ip = _Interp(kernel, t, x_t.shape)
    log_d = _one_hot_log(x0, log_x)
    lqm_0, lqm_theta = ip.log_q_over_m(log_d), ip.log_q_over_m(log_x)
    log_q0, log_q_theta = ip.log_q(log_d, lqm_0), ip.log_q(log_x, lqm_theta)
    # ℓ_y = log q0(y) − log qθ(y): a difference of two small log(q/m) where m > 0 (no cancellation near t → 1)
    l = torch.where(ip.has_m, lqm_0 - lqm_theta, log_d - log_x)
    # at x0: ℓ = log1p(α δ / qθ(x0)) with δ = 1 − x_θ(x0) summed from the other entries (the difference above loses
    # its relative precision when the model is confidently right: ℓ ≈ α δ / qθ is then far below the two logs)
    has_delta = delta > 0
    z_x0 = (ip.log_alpha + torch.log(torch.where(has_delta, delta, torch.ones_like(delta)))
            - _gather(log_q_theta, x0))
    l_x0 = torch.where(has_delta & ~kernel.is_mask(x0),
                       softplus(torch.where(has_delta, z_x0, torch.zeros_like(z_x0))), _gather(l, x0))
    l = l.scatter(-1, x0.unsqueeze(-1), l_x0.unsqueeze(-1))
    # Σ_y f(q0, qθ) = KL since both sum to 1; r = q0 passed in log space, so a confidently wrong model (qθ(x0)
    # underflowing, ℓ = 10⁴) still gives q0 (ℓ − 1) + qθ instead of 0 · ∞
    kl = bregman_from_log_ratio(log_q_theta, l, log_r=log_q0).sum(-1)
    v_mask, v_unif = kernel.rate_coefficients(t)
    v = torch.where(kernel.is_mask(x_t), v_mask,
                    torch.where(kernel.in_uniform_support(x_t), v_unif, torch.zeros_like(v_unif)))
    log_q0_xt = _gather(log_q0, x_t)
    log_rho = _gather(l, x_t)
    possible = ~torch.isneginf(log_q0_xt)
    # ρ − 1 − log ρ only where it is used (v > 0): at a clean token of the mask kernel ρ = 1/p_θ(x0) may be e^{10⁴}
    term = kl + expm1_minus_x(torch.where(possible & (v > 0), log_rho, torch.zeros_like(log_rho)))
    w = torch.exp(safe_log(v) - torch.where(possible, log_q0_xt, torch.zeros_like(log_q0_xt)))
    if weighting == "clip":
        w = w.clamp(0.0, max_weight)
    elif weighting == "dynamic":
        w = dynamic_weight(kernel, x0, x_t, t).clamp(0.0, max_weight)
    loss = torch.where(v > 0, w * term, torch.zeros_like(term))
    # x_t impossible under x0: the true rates are 0 by convention, D_t is the model's exit rate
    exit_used = (v > 0) & ~possible
    neg_log_q_xt = torch.where(exit_used, -_gather(log_q_theta, x_t), torch.zeros_like(v))
    exit_theta = torch.where(exit_used, v * torch.expm1(neg_log_q_xt), torch.zeros_like(v))
    return torch.where(possible, loss, exit_theta)


def _generator_d_t(kernel: GeneratorKernel, log_x: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor,
                   t: torch.Tensor) -> torch.Tensor:
    """D_t of an x0 head on any kernel given by its transition matrices P = P_{0,t} (rows: from), ``(...)``:

        D_t = Σ_{y≠x_t} R_t(y, x_t) f(r_y, s_y),  r_y = q0(y)/q0(x_t),  s_y = qθ(y)/qθ(x_t),
        q0 = P[x0, ·],  qθ = Σ_w x_θ(w) P[w, ·],

    with ℓ_y = log(r_y/s_y) formed without cancelling: for a confidently right model qθ ≈ q0, f ≈ s ℓ²/2 is far
    below q0 and qθ, and ℓ from two logs would be all rounding. With K[w, y] = P[w, y]/P[x0, y] (q0(y) > 0),
    ρ_y = qθ(y)/q0(y) = Σ_w x_θ(w) K[w, y] and ρ_{x_t} − ρ_y = Σ_{w≠x0} x_θ(w) (K[w, x_t] − K[w, y]) (the x0 term is
    1 − 1 = 0), so ℓ_y = log(ρ_{x_t}/ρ_y) = log1p((ρ_{x_t} − ρ_y)/ρ_y). Rows whose x_t is impossible under x0
    (q0(x_t) = 0: the true rates are 0, D_t is the model's exit rate) and states with q0(y) = 0 (f(0, s) = s) take the
    log-space rates of :class:`~unifusion.rates.ReverseRate`. O(S²) per position: meant for small S, as
    :class:`~unifusion.kernels.GeneratorKernel` itself.
    """
    P = kernel.transition_matrix(kernel.integrated_rate(t))  # (..., S, S), float64
    R_in = kernel.rate_column(x_t, t)  # R_t(y, x_t) over sources y, 0 at y = x_t
    S = P.shape[-1]
    p = log_x.exp()
    q0 = P.gather(-2, x0[..., None, None].expand(*x0.shape, 1, S)).squeeze(-2)  # P[x0, ·]
    # log qθ(y) = logsumexp_w (log x_θ(w) + log P[w, y]): finite where x_θ(w) underflows (a model wrong by 10⁴ nats)
    terms = log_x.unsqueeze(-1) + safe_log(P)
    none = torch.isneginf(terms).all(-2, keepdim=True)  # qθ(y) = 0: no NaN gradient from logsumexp
    log_q_theta = torch.logsumexp(torch.where(none, torch.zeros_like(terms), terms), -2)
    log_q_theta = torch.where(none.squeeze(-2), torch.full_like(log_q_theta, -math.inf), log_q_theta)
    has_q0 = q0 > 0
    log_q0 = safe_log(q0)
    K = P / torch.where(has_q0, q0, torch.ones_like(q0)).unsqueeze(-2)  # (..., w, y); unused columns where q0 = 0
    log_rho = torch.where(has_q0, log_q_theta - torch.where(has_q0, log_q0, torch.zeros_like(log_q0)),
                          torch.zeros_like(log_q0))
    rho = log_rho.exp()
    K_xt = K.gather(-1, x_t[..., None, None].expand(*x_t.shape, S, 1))  # (..., w, 1): K[w, x_t]
    p_off = p.scatter(-1, x0.unsqueeze(-1), 0.0)
    rho_diff = (p_off.unsqueeze(-1) * (K_xt - K)).sum(-2)  # ρ_{x_t} − ρ_y
    # log1p of the relative difference where it is below 1/2 in size; the logs elsewhere (log1p(−1 + ε) would lose ε,
    # and ρ may underflow)
    rel = rho_diff / torch.where(rho > 0, rho, torch.ones_like(rho))
    near = (rho > 0) & (rel.abs() < 0.5)
    l = torch.where(near, torch.log1p(torch.where(near, rel, torch.zeros_like(rel))),
                    _gather(log_rho, x_t).unsqueeze(-1) - log_rho)
    log_q0_xt, log_q_theta_xt = _gather(log_q0, x_t), _gather(log_q_theta, x_t)
    possible = ~torch.isneginf(log_q0_xt) & ~torch.isneginf(log_q_theta_xt)
    log_r = log_q0 - torch.where(possible, log_q0_xt, torch.zeros_like(log_q0_xt)).unsqueeze(-1)
    log_s = log_q_theta - torch.where(possible, log_q_theta_xt, torch.zeros_like(log_q_theta_xt)).unsqueeze(-1)
    l = torch.where(has_q0, l, torch.full_like(l, -math.inf))  # r_y = 0: f(0, s) = s
    used = (R_in > 0) & possible.unsqueeze(-1)
    f = bregman_from_log_ratio(torch.where(used, log_s, torch.zeros_like(log_s)),
                               torch.where(used, l, torch.zeros_like(l)),
                               log_r=torch.where(used, log_r, torch.zeros_like(log_r)))
    d_t = torch.where(used, R_in * f, torch.zeros_like(f)).sum(-1)
    # x_t impossible under x0, or under the model: the generic log-space rates
    true = ReverseRate.true_conditional(kernel, x0, x_t, t)
    model = ReverseRate.from_log_marginal(kernel, x_t, t, log_q_theta)
    generic = bregman_rate_loss(true, model)
    return torch.where(possible, d_t, generic)


# ---------------------------------------------------------------------------------------------------- M2S
@_input_precision
def m2s_loss(mu_logits: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor | float,
             kernel: Kernel) -> torch.Tensor:
    """M2S (App. A, eq. loss-m2s), per position ``(...)``:

    Σ_{y≠x_t} R_t(y, x_t) h(s_y, r_y),  s = B_{x_t,t} μ,  r_y = q_{t|0}(y|x0)/q_{t|0}(x_t|x0),
    h(s, r) = s − r log s + r log r − r,  μ = softmax(mu_logits) over clean states.
    """
    kernel, h, x0, x_t, t, dtype = _prepare(kernel, {"mu_logits": mu_logits}, x0, x_t, t)
    log_mu = rates.x0_log_probs(kernel, h["mu_logits"], exact_gradient=True)
    R = kernel.rate_column(x_t, t)
    if isinstance(kernel, InterpolatingKernel):
        return _m2s_interp(kernel, log_mu, x0, x_t, t, R)
    mu = log_mu.exp()
    s = b_operator(kernel, mu, x_t, t, R)
    log_r = _log_ratio_to_xt(kernel.log_marginal_of_ids(x0, t, dtype), x_t).scatter(-1, x_t.unsqueeze(-1), 0.0)
    log_s = safe_log(s).scatter(-1, x_t.unsqueeze(-1), 0.0)
    return _weighted_sum(R, bregman_from_logs(log_r, log_s), x_t)


def _m2s_interp(kernel: InterpolatingKernel, log_mu: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor,
                t: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """M2S on an interpolating kernel, through d = s − r. With b = x_t, ε = α/m(b), A_y = m(y)/m(b) and
    δ_z = 1 − μ(z) summed from the other entries, for y ≠ b

        s_y = (B μ)_y = A_y (1 + ε δ_b)/(1 + ε) + ε μ(y),
        b = x0:  r_y = A_y/(1 + ε),                d_y = A_y ε δ_b/(1 + ε) + ε μ(y)              (≥ 0),
        b ≠ x0:  r_y = A_y + ε [y = x0],            d_y = −A_y μ(b) ε/(1 + ε) + ε μ(y)  (y ≠ x0),
                                                    d_x0 = −A_x0 μ(b) ε/(1 + ε) − ε δ_x0            (≤ 0),

    and ℓ_y = log(r_y/s_y) = −log1p(d_y/r_y) (log r_y − log s_y where s_y < r_y/2). Near the optimum (μ close to
    the true posterior mean, e.g. a confidently right x0 head converted) the loss is O(d²) and a difference of the
    logs of s and r would lose all of it. Rows with R(·, x_t) ≡ 0 contribute 0.
    """
    ip = _Interp(kernel, t, x_t.shape)
    m_b = _gather(ip.m, x_t)
    has_mb = m_b > 0
    safe_mb = torch.where(has_mb, m_b, torch.ones_like(m_b))
    eps = torch.exp(ip.log_alpha) / safe_mb
    A = ip.m / safe_mb.unsqueeze(-1)
    mu = log_mu.exp()
    delta_b = mu.scatter(-1, x_t.unsqueeze(-1), 0.0).sum(-1)
    delta_x0 = mu.scatter(-1, x0.unsqueeze(-1), 0.0).sum(-1)
    mu_b = _gather(mu, x_t)
    k = (eps / (1.0 + eps)).unsqueeze(-1)
    eps_ = eps.unsqueeze(-1)
    at_x0 = torch.zeros_like(mu, dtype=torch.bool).scatter(-1, x0.unsqueeze(-1), True)
    same = (x_t == x0).unsqueeze(-1)
    r = torch.where(same, A / (1.0 + eps_), A + eps_ * at_x0)
    d = torch.where(same, A * k * delta_b.unsqueeze(-1) + eps_ * mu,
                    torch.where(at_x0, -A * mu_b.unsqueeze(-1) * k - (eps * delta_x0).unsqueeze(-1),
                                -A * mu_b.unsqueeze(-1) * k + eps_ * mu))
    log_A = safe_log(A)
    log_s = torch.logaddexp(log_A + (torch.log1p(eps * delta_b) - torch.log1p(eps)).unsqueeze(-1),
                            torch.log(eps_) + log_mu)
    log_r = safe_log(r)
    r_pos = r > 0
    near = r_pos & (d > -0.5 * r)  # s ≥ r/2: ℓ = −log1p(d/r) without cancellation
    ratio = torch.where(near, d / torch.where(r_pos, r, torch.ones_like(r)), torch.zeros_like(d))
    far = torch.where(r_pos & ~near, log_r, torch.zeros_like(log_r)) - torch.where(r_pos & ~near, log_s,
                                                                                    torch.zeros_like(log_s))
    l = torch.where(near, -torch.log1p(ratio), far)
    l = torch.where(r_pos, l, torch.full_like(l, float("-inf")))  # r = 0: f(0, s) = s
    # entries with no rate (R = 0: x_t itself, unmasked tokens under the mask kernel) get (r, s) = (1, 1), so nothing
    # overflowing there reaches the gradient; r is passed as log r (s may underflow where ℓ = log r/s is 10⁴)
    used = (R > 0) & has_mb.unsqueeze(-1)
    l = torch.where(used, l, 0.0)
    log_s = torch.where(used, log_s, 0.0)
    log_r = torch.where(used, log_r, 0.0)
    return _weighted_sum(R, bregman_from_log_ratio(log_s, l, log_r=log_r), x_t)


# ---------------------------------------------------------------------------------------------------- Neural CTMC
@_input_precision
def ctmc_loss(log_exit_rate: torch.Tensor, jump_logits: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor,
              t: torch.Tensor | float, kernel: Kernel) -> torch.Tensor:
    """Neural CTMC (App. A, eq. loss-nctmc-cond), per position ``(...)``:

    KL_Poi(λ̂ ‖ λ_θ) + λ̂ KL_Cat(r̂ ‖ r_θ),  λ_θ = exp(log_exit_rate) ``(...)``,
    r_θ = softmax(jump_logits) over targets i ≠ x_t ``(..., S)``, (λ̂, r̂) from the true conditional rates.
    """
    kernel, h, x0, x_t, t, dtype = _prepare(
        kernel, {"log_exit_rate": log_exit_rate, "jump_logits": jump_logits}, x0, x_t, t)
    true = ReverseRate.true_conditional(kernel, x0, x_t, t)
    log_true = true.log_rates
    assert log_true is not None  # true_conditional always keeps the log rates
    log_lam_hat = torch.logsumexp(log_true, dim=-1)
    log_lam = h["log_exit_rate"]
    poisson = bregman_from_logs(log_lam_hat, log_lam)
    log_r_theta = log_softmax(h["jump_logits"], x_t, exact_gradient=True)
    has_jump = ~torch.isneginf(log_lam_hat)
    log_r_hat = log_true - torch.where(has_jump, log_lam_hat, torch.zeros_like(log_lam_hat)).unsqueeze(-1)
    log_r_hat = torch.where(has_jump.unsqueeze(-1), log_r_hat, torch.full_like(log_r_hat, float("-inf")))
    # KL_Cat = Σ_i f(r̂_i, r_θ,i) (both sum to one); the x_t entry is (0, 0)
    cat = bregman_from_logs(log_r_hat, log_r_theta).sum(-1)
    lam_hat = torch.exp(log_lam_hat)
    return poisson + torch.where(has_jump, lam_hat * cat, torch.zeros_like(cat))
