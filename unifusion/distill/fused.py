"""The certainty-forcing loss through the output head, without materialising the ``(N, V)`` logits.

For hidden states h ``(N, d)``, the head W ``(V, d)`` (bias b, logit scale κ, soft-cap c as in
:func:`unifusion.losses.fused_linear_diffusion_loss`) and logits z_n = c · tanh(κ (h_n Wᵀ + b) / c) (or
κ (h_n Wᵀ + b)), the loss is :func:`unifusion.distill.certainty_forcing_loss` of the logits:

    L = (1/|M|) Σ_{n∈M} (lse(z_n) − z_{n,y_n})  +  λ (1/|C|) Σ_{n∈C} H_n,   H_n = lse(u_n) − Σ_v q_{n,v} u_{n,v},

with u_n = z_n / T, q_n = softmax(u_n), C = {n ∈ M : argmax z_n = y_n}. Only the masked rows enter (they are
gathered first: one host read of their number); they are processed in blocks of ``chunk_size`` rows, each block's
``(chunk, V)`` logits living only inside the block. The forward pass computes the losses and keeps per-row
statistics (lse(z), lse(u), H, the certain flag); the backward pass recomputes each block's logits and applies

    ∂L/∂z_n = (1/|M|) (softmax(z_n) − e_{y_n})  −  λ [n ∈ C] / (|C| T) · q_n ⊙ (log q_n + H_n),

then ∂/∂h = G W and ∂/∂W = Gᵀ h (three matmuls per block, one in the forward pass: four in all, where materialised
logits take three). The argmax test is not differentiated: the entropy term's gradient is zero at unmasked and
wrongly predicted rows, as in the logits form. Float32 arithmetic for lower-precision inputs, float64 for float64.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from .. import _validation as V
from .losses import check_certainty_options

__all__ = ["fused_certainty_forcing_loss", "default_rows_per_block"]

_BLOCK_LOGITS = 1 << 23  # logits per block (32 MiB of float32; about three such buffers live per block)


def default_rows_per_block(num_states: int) -> int:
    """Rows per block: 2²³ logits per block (at least 16 rows): 170 rows at V = 49,152, 32 at 262,144."""
    return max(16, _BLOCK_LOGITS // max(1, num_states))


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: float,
            softcap: float | None, mask_id: int | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block's logits ``(n, V)`` in ``dtype`` and, when soft-capping, tanh(z/c) for the chain rule."""
    z = (h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)).to(dtype)
    if scale != 1.0:
        z = z * scale
    th = None
    if softcap is not None:
        th = torch.tanh(z / softcap)
        z = th * softcap
    if mask_id is not None:
        z[:, mask_id] = -math.inf
    return z, th


class _FusedCertaintyForcing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                T: float, lam: float, scale: float, softcap: float | None, mask_id: int | None,
                chunk: int) -> torch.Tensor:
        n = hidden.shape[0]
        dtype = V.compute_dtype(hidden)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        lse_u, H, ce = torch.empty_like(lse), torch.empty_like(lse), torch.empty_like(lse)
        certain = torch.empty(n, dtype=torch.bool, device=hidden.device)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            z, _ = _logits(hidden[lo:hi], weight, bias, scale, softcap, mask_id, dtype)
            yb = y[lo:hi, None]
            lse[lo:hi] = torch.logsumexp(z, -1)
            ce[lo:hi] = lse[lo:hi] - z.gather(-1, yb)[:, 0]
            certain[lo:hi] = z.argmax(-1) == y[lo:hi]
            u = z.div_(T)
            lse_u[lo:hi] = torch.logsumexp(u, -1)
            logq = u.sub_(lse_u[lo:hi, None])
            q = logq.exp()
            H[lo:hi] = -torch.linalg.vecdot(q, logq.nan_to_num_(neginf=0.0))
            del z, u, logq, q
        num_c = certain.sum()
        loss = ce.sum() / max(n, 1) + lam * torch.where(certain, H, 0.0).sum() / num_c.clamp_min(1)
        ctx.save_for_backward(hidden, weight, bias, y, lse, lse_u, H, certain, num_c)
        ctx.options = (T, lam, scale, softcap, mask_id, chunk)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, bias, y, lse, lse_u, H, certain, num_c = ctx.saved_tensors
        T, lam, scale, softcap, mask_id, chunk = ctx.options
        needs = ctx.needs_input_grad
        n = hidden.shape[0]
        dtype = lse.dtype
        g = grad.to(dtype)
        a = g / max(n, 1)  # the cross-entropy's coefficient
        c = g * lam / (num_c.clamp_min(1).to(dtype) * T)  # the entropy's, per certain row
        acc = dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        dh = torch.empty_like(hidden) if needs[0] else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs[1] else None
        db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if bias is not None and needs[2] else None
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            h = hidden[lo:hi]
            z, th = _logits(h, weight, bias, scale, softcap, mask_id, dtype)
            logq = (z / T).sub_(lse_u[lo:hi, None])
            q = logq.exp()
            # entropy: −c q (log q + H), only on certain rows (log q = −inf only where q = 0)
            G = q.mul_(logq.nan_to_num_(neginf=0.0).add_(H[lo:hi, None])).mul_(
                torch.where(certain[lo:hi], -c, 0.0)[:, None])
            del logq
            G.add_(z.sub_(lse[lo:hi, None]).exp_().mul_(a))  # + a softmax(z)
            G.scatter_add_(-1, y[lo:hi, None], (-a).expand(hi - lo, 1).to(dtype))  # − a e_y
            del z
            if th is not None:
                G.mul_(1.0 - th.square())
            if scale != 1.0:
                G.mul_(scale)
            Gw = G.to(weight.dtype) if G.dtype != weight.dtype else G
            if dh is not None:
                dh[lo:hi] = (Gw @ weight).to(dh.dtype)
            if dw is not None:
                dw.addmm_(G.T.to(acc), h.to(acc))
            if db is not None:
                db.add_(G.sum(0).to(acc))
        return (dh, None if dw is None else dw.to(weight.dtype),
                None if db is None or bias is None else db.to(bias.dtype), *(None,) * 7)


def fused_certainty_forcing_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                                 masked: torch.Tensor, *, temperature: float = 0.5, entropy_weight: float = 2.0,
                                 lm_head_bias: torch.Tensor | None = None, logit_scale: float = 1.0,
                                 final_logit_softcap: float | None = None, mask_id: int | None = None,
                                 chunk_size: int | None = None) -> torch.Tensor:
    """:func:`unifusion.distill.certainty_forcing_loss` of ``logits = head(hidden)`` (0-d), never holding more than
    ``chunk_size`` rows of logits (module docstring).

    Args:
        hidden: ``(..., d)`` final hidden states.  lm_head_weight: ``(V, d)``.
        targets: ``(...)`` the teacher's tokens.  masked: ``(...)`` bool, the view's masked positions.
        temperature: T > 0 of the entropy.  entropy_weight: λ >= 0.
        mask_id: the mask token's column, left out of the distribution (or ``None``); as in
            :func:`~unifusion.distill.certainty_forcing_loss`.
        lm_head_bias: ``(V,)`` or ``None``.  logit_scale: κ.  final_logit_softcap: c or ``None``.
        chunk_size: rows per block (default :func:`default_rows_per_block`).

    Gradients reach ``hidden``, ``lm_head_weight`` and ``lm_head_bias``.
    """
    T, lam = check_certainty_options(temperature, entropy_weight)
    h = V.check_tensor("hidden", hidden)
    w = V.check_tensor("lm_head_weight", lm_head_weight)
    if not h.dtype.is_floating_point or h.dtype != w.dtype:
        raise TypeError(f"hidden: expected the floating dtype of lm_head_weight ({w.dtype}), got {h.dtype}")
    if w.dim() != 2 or h.dim() < 1 or h.shape[-1] != w.shape[1]:
        raise ValueError(f"hidden: expected (..., {w.shape[-1]}) for a head of shape (V, d) = {tuple(w.shape)}, "
                         f"got {tuple(h.shape)}")
    S = w.shape[0]
    y = V.check_tensor("targets", targets)
    if tuple(y.shape) != tuple(h.shape[:-1]) or not V.is_integer_dtype(y.dtype):
        raise ValueError(f"targets: expected integer ids of shape {tuple(h.shape[:-1])}, got {tuple(y.shape)} "
                         f"{y.dtype}")
    m = V.check_tensor("masked", masked)
    if tuple(m.shape) != tuple(y.shape) or m.dtype != torch.bool:
        raise ValueError(f"masked: expected a bool tensor of shape {tuple(y.shape)}, got {tuple(m.shape)} {m.dtype}")
    if lm_head_bias is not None:
        b = V.check_tensor("lm_head_bias", lm_head_bias)
        if tuple(b.shape) != (S,) or b.dtype != w.dtype:
            raise ValueError(f"lm_head_bias: expected ({S},) {w.dtype}, got {tuple(b.shape)} {b.dtype}")
    for name, val in (("logit_scale", logit_scale), ("final_logit_softcap", final_logit_softcap)):
        if val is None and name == "final_logit_softcap":
            continue
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not val > 0:
            raise ValueError(f"{name}: expected a positive float, got {val!r}")
    if mask_id is not None:
        V.check_token_id("mask_id", mask_id, S)
    chunk = default_rows_per_block(S) if chunk_size is None else V.check_positive_int("chunk_size", chunk_size)
    flat_m = m.reshape(-1)
    rows = flat_m.nonzero().squeeze(-1)  # the one host read: the number of masked rows
    flat_y = y.reshape(-1).long()[rows]
    bad = (flat_y < 0) | (flat_y >= S) | (flat_y == (-1 if mask_id is None else mask_id))
    V.fail_if(bad.any(), lambda: f"targets: masked positions need ids in [0, {S}) other than the mask id {mask_id}")
    h_rows = h.reshape(-1, h.shape[-1])[rows]
    softcap = None if final_logit_softcap is None else float(final_logit_softcap)
    return _FusedCertaintyForcing.apply(h_rows, w, lm_head_bias, flat_y, T, lam, float(logit_scale), softcap,
                                        mask_id, chunk)
