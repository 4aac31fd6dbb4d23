"""RL objectives on log-likelihood estimates (any estimator of :func:`~unifusion.rl.sequence_logprob`).

All functions are pure: they take log-prob estimates (per token ``(B, L)`` or per sequence ``(B,)``) and advantages,
and return per-token or per-sample values whose ``.sum()`` is the loss (the normaliser is applied, so a data-parallel
loop passes its global counts and sums). Nothing here calls ``torch.distributed``. Math in float32 at least.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["group_advantages", "grpo_loss", "wd1_loss", "spg_loss", "dpo_loss"]


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check_same(name: str, value: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if value is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name}: expected shape {shape}, got {got}")


def _check_detached(name: str, value: torch.Tensor | None) -> None:
    """A fixed policy's estimates must not carry a gradient: the ratio's or the KL's gradient would flow into them
    (and, for ``old_logps = logps``, cancel: the ratio would be 1 with gradient 0)."""
    if value is not None and value.requires_grad:
        raise ValueError(f"{name}: carries a gradient (requires_grad=True); compute it under torch.no_grad() or pass "
                         f"{name}.detach() (the policy it scores is held fixed)")


def _check_coefficient(name: str, value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:  # NaN fails >= 0
        raise ValueError(f"{name}: expected {what} >= 0, got {value!r}")
    return float(value)


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-4
                     ) -> torch.Tensor:
    """GRPO's group-relative advantages ``(B,)`` of rewards ``(B,)`` in consecutive groups of ``group_size``
    completions of one prompt: ``A_i = (r_i − mean_g r) / (std_g r + eps)`` with ``scale=True`` (GRPO, the unbiased
    std), ``A_i = r_i − mean_g r`` with ``scale=False`` (Dr.GRPO, GDPO). A NaN or infinite reward is a
    ``ValueError`` (one host read)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected a positive int, got {group_size!r}")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or rewards.shape[0] % group_size:
        got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards: expected a (B,) tensor with B a multiple of group_size={group_size}, got {got}")
    if not bool(torch.isfinite(rewards).all()):  # one host read
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()[:8]
        raise ValueError(f"rewards: expected finite values, got NaN or inf at rows {bad} (a NaN would make its whole "
                         "group's advantages NaN); give such completions a finite reward")
    r = _f32(rewards).view(-1, group_size)
    A = r - r.mean(-1, keepdim=True)
    if scale:
        std = r.std(-1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        A = A / (std + eps)
    return A.reshape(-1)


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, completion_mask: torch.Tensor,
              *, ref_logps: torch.Tensor | None = None, kl_coef: float = 0.0, epsilon: float = 0.2,
              epsilon_high: float | None = None, level: Literal["token", "sequence"] = "token",
              normalization: Literal["grpo", "dr_grpo", "dapo"] = "grpo", max_length: int | None = None,
              num_tokens: float | torch.Tensor | None = None, num_sequences: int | None = None) -> torch.Tensor:
    """The clipped GRPO surrogate, per token ``(B, L)`` (its ``.sum()`` is the loss).

    With ``ρ`` the importance ratio and ``A_i`` the advantage of completion i (``|o_i|`` tokens):

        ℓ_{i,t} = −min(ρ_{i,t} A_i, clip(ρ_{i,t}, 1 − ε, 1 + ε_high) A_i) + β k3_{i,t}   (β = ``kl_coef``),
        k3_{i,t} = exp(r_{i,t} − x_{i,t}) − (r_{i,t} − x_{i,t}) − 1   (x = ``logps``, r = ``ref_logps``),

    ``level="token"``: ``ρ_{i,t} = exp(x_{i,t} − x^{old}_{i,t})`` on the per-token estimates (d1, coupled-GRPO);
    ``level="sequence"``: one ratio per completion, ``ρ_i = exp((Σ_t x_{i,t} − Σ_t x^{old}_{i,t}) / |o_i|)`` (GSPO's
    length-normalised ratio, GDPO), shared by its tokens. Normalisation of ``Σ ℓ``:
    ``"grpo"``: ``(1/G) Σ_i (1/|o_i|) Σ_t`` (G = ``num_sequences``, default B); ``"dapo"``: ``(1/Σ_i |o_i|) Σ_{i,t}``
    (``num_tokens`` for a global count); ``"dr_grpo"``: ``(1/(G · max_length)) Σ_{i,t}`` (``max_length`` required).
    The clip is PPO's: the gradient of ℓ is 0 where ρ left ``[1 − ε, 1 + ε_high]`` on the advantage's side.

    Args:
        logps: ``(B, L)`` per-token estimates of the current policy (with grad).
        old_logps: ``(B, L)`` of the policy that sampled, without a gradient (computed under ``torch.no_grad()``;
            ``logps.detach()`` on policy): one that requires grad is a ``ValueError``.
        advantages: ``(B,)``.
        completion_mask: ``(B, L)`` bool, the completion tokens.
        ref_logps: ``(B, L)`` of the reference policy, for ``kl_coef > 0`` (without a gradient, like ``old_logps``).
        kl_coef: the k3 KL coefficient β ≥ 0 (TRL's ``GRPOConfig.beta``).
        epsilon: the clip range's lower side ε ≥ 0.
        epsilon_high: its upper side ≥ 0 (defaults to ``epsilon``; DAPO raises it).
        level: ``"token"`` or ``"sequence"`` ratios (above).
        normalization: ``"grpo"``, ``"dr_grpo"`` or ``"dapo"`` (above).
        max_length: Dr.GRPO's constant length, the completion budget (``max_new_tokens``): required with
            ``normalization="dr_grpo"`` (L, the width of prompt plus completion, is not it).
        num_tokens: DAPO's token count (default this batch's; pass the global one under data parallelism).
        num_sequences: G, GRPO's and Dr.GRPO's sequence count (default B).

    Returns:
        ``(B, L)`` float32 (float64 for float64 inputs), 0 outside the completion.
    """
    if not isinstance(logps, torch.Tensor) or logps.dim() != 2:
        raise ValueError(f"logps: expected per-token estimates (B, L), got "
                         f"{tuple(logps.shape) if isinstance(logps, torch.Tensor) else type(logps).__name__}")
    B, L = logps.shape
    _check_same("old_logps", old_logps, (B, L))
    _check_same("advantages", advantages, (B,))
    _check_same("completion_mask", completion_mask, (B, L))
    _check_same("ref_logps", ref_logps, (B, L))
    if level not in ("token", "sequence"):
        raise ValueError(f"level: expected 'token' or 'sequence', got {level!r}")
    if normalization not in ("grpo", "dr_grpo", "dapo"):
        raise ValueError(f"normalization: expected 'grpo', 'dr_grpo' or 'dapo', got {normalization!r}")
    _check_detached("old_logps", old_logps)
    _check_detached("ref_logps", ref_logps)
    kl_coef = _check_coefficient("kl_coef", kl_coef, "the KL coefficient, a float")
    if kl_coef and ref_logps is None:
        raise ValueError(f"ref_logps: needed for the KL term (kl_coef={kl_coef})")
    epsilon = _check_coefficient("epsilon", epsilon, "a float")
    eps_hi = epsilon if epsilon_high is None else _check_coefficient("epsilon_high", epsilon_high, "a float")
    if normalization == "dr_grpo":
        if max_length is None:
            raise ValueError("max_length: normalization='dr_grpo' divides by the completion budget (max_new_tokens); "
                             "pass max_length, got None")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length: expected a positive int, got {max_length!r}")
    m = completion_mask.to(torch.bool)
    x, x_old = _f32(logps), _f32(old_logps)
    A = _f32(advantages)[:, None]  # (B, 1)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    n = m.sum(-1).clamp_min(1).to(x.dtype)  # |o_i|
    if level == "token":
        log_rho = torch.where(m, x - x_old, zero)
    else:
        log_rho = (torch.where(m, x - x_old, zero).sum(-1) / n)[:, None].expand(B, L)
    rho = torch.exp(log_rho)
    surrogate = torch.minimum(rho * A, torch.clamp(rho, 1.0 - epsilon, 1.0 + eps_hi) * A)
    loss = -surrogate
    if kl_coef:
        assert ref_logps is not None
        d = _f32(ref_logps) - x
        loss = loss + kl_coef * (torch.exp(d) - d - 1.0)
    loss = torch.where(m, loss, zero)
    G = B if num_sequences is None else num_sequences
    if normalization == "grpo":
        return loss / (n[:, None] * G)
    if normalization == "dapo":
        total = m.sum().clamp_min(1).to(x.dtype) if num_tokens is None else num_tokens
        return loss / total
    assert max_length is not None
    return loss / (G * max_length)


def wd1_loss(logps: torch.Tensor, advantages: torch.Tensor, *, group_size: int | None = None) -> torch.Tensor:
    """wd1's ratio-free weighted likelihood, per sample ``(B,)`` (its ``.sum()`` is wd1's loss):

        ℓ_i = −w⁺_i log p_i + w⁻_i log p_i,   w⁺ = softmax(A),  w⁻ = softmax(−A),

    the softmaxes over the whole batch (wd1) or, with ``group_size``, over each group of one prompt's completions.
    ``logps (B,)``: sequence estimates of the current policy only (wd1 uses d1's mean field)."""
    _check_same("advantages", advantages, tuple(logps.shape))
    if logps.dim() != 1:
        raise ValueError(f"logps: expected sequence estimates (B,), got {tuple(logps.shape)}")
    A = _f32(advantages)
    if group_size is not None:
        if logps.shape[0] % group_size:
            raise ValueError(f"group_size: B = {logps.shape[0]} is not a multiple of {group_size}")
        A = A.view(-1, group_size)
    w_pos, w_neg = torch.softmax(A, -1).reshape(-1), torch.softmax(-A, -1).reshape(-1)
    return (w_neg - w_pos) * _f32(logps)


def spg_loss(lower: torch.Tensor, upper: torch.Tensor, advantages: torch.Tensor, *,
             mix_weight: float | None = None) -> torch.Tensor:
    """SPG's sandwiched policy gradient, per sample ``(B,)``: ``ℓ_i = −A_i L_i`` with

        L_i = lower_i (an ELBO) where A_i > 0,
        L_i = upper_i (the EUBO), or ω upper_i + (1 − ω) lower_i with ``mix_weight`` ω, where A_i ≤ 0,

    so maximising the reward pushes a lower bound up and an upper bound down. ``lower`` from ``estimator="elbo"`` /
    ``"elbo_discrete"``, ``upper`` from ``"eubo"`` (same generator: the same masks). SPG reduces with length weights
    on length-normalised estimates, ``Σ_i ℓ_i |o_i| / Σ_i |o_i|``; the caller chooses."""
    _check_same("upper", upper, tuple(lower.shape))
    _check_same("advantages", advantages, tuple(lower.shape))
    A = _f32(advantages)
    neg = _f32(upper)
    if mix_weight is not None:
        if not 0.0 <= mix_weight <= 1.0:
            raise ValueError(f"mix_weight: expected a float in [0, 1], got {mix_weight!r}")
        neg = mix_weight * neg + (1.0 - mix_weight) * _f32(lower)
    L = torch.where(A > 0, _f32(lower), neg)
    return -A * L


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             *, dpo_beta: float = 0.1) -> torch.Tensor:
    """DPO on sequence estimates, per pair ``(B,)``: ``−log σ(β[(x_w − r_w) − (x_l − r_l)])``, β = ``dpo_beta``
    (TRL's ``DPOConfig.beta``).

    VRPO (LLaDA 1.5): estimate all four with the **same generator seed** for policy and reference (the same masks and
    times: the differences ``x − r`` then carry no mask noise) and several samples (``num_samples``)."""
    for name, v in (("rejected", rejected), ("ref_chosen", ref_chosen), ("ref_rejected", ref_rejected)):
        _check_same(name, v, tuple(chosen.shape))
    beta = _check_coefficient("dpo_beta", dpo_beta, "DPO's β, a float")
    margin = (_f32(chosen) - _f32(ref_chosen)) - (_f32(rejected) - _f32(ref_rejected))
    return -F.logsigmoid(beta * margin)
