"""An upper bound on −log p_θ(x0) from the master objective (paper Proposition 3.2).

For a sequence x0 of L tokens and an x0 model whose per-position predictions induce reverse rates (Theorem 3.3),

    −log p_θ(x0) ≤ ∫_0^1 E_{x_t ~ q_{t|0}(·|x0)} [ Σ_i D_t^i(x_t, x0; θ) ] dt + C_ELBO,
    C_ELBO = Σ_i KL(q_{1|0}(·|x0^i) ‖ p_prior),

where D_t^i is Definition 3.1's rate divergence at position i; :func:`~unifusion.losses.x0_head_loss` (GIDD's form
with ``weighting="elbo"``) computes it exactly at the cost of a cross-entropy — the same values as the reference
:func:`~unifusion.losses.reference_gidd_loss` to float32 rounding (float64 logits: to float64 rounding), which
``nll_bound(..., reference=True)`` uses instead (the same times and corruptions for the same generator state and
``batch_size``).
C_ELBO is 0 when the chain forgets the data at t = 1 (α_1 = 0: the uniform and mask kernels with the linear schedule,
GIDD's hybrid); it is positive e.g. for ``LogLinearSchedule(eps > 0)``.

The time integral is estimated with K stratified times t_k = t_min + (1 − t_min)(k − u)/K, k = 1..K, one
u ~ U(0, 1) per sequence (independent across the batch), and one x_t ~ q_{t_k|0}(·|x0) per time:

    ∫ ≈ ((1 − t_min)/K) Σ_k Σ_i D_{t_k}^i(x_{t_k}, x0).

The estimate is unbiased for the integral over (t_min, 1); with the default ``t_min = 0`` it is unbiased for the
bound itself (the integrand is bounded near t = 0 for the kernels of this library).

Cost: K model evaluations of the batch. Several times go into one model call (``batch_size`` rows: the sequences
repeated once per time), because a forward of a few short sequences is dominated by per-call overhead and skinny
matrix products (SmolLM2-135M on 2 CPU cores: 57 ms per 17-token row at 2 rows per call, 30 ms at 16 or more).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _validation as V
from .._device import host_to_device
from .._validation import check_token_ids
from ..denoiser import Denoiser, X0Model, denoiser_of, prompt_conditioning
from ..kernels import MAX_TIME, InterpolatingKernel, Kernel, check_kernel
from ..losses.fast import x0_head_loss
from ..losses.native import reference_gidd_loss
from ._shared import logits_of

__all__ = ["nll_bound", "prior_kl"]

LOGITS_PER_CALL = 1 << 26
"""Default budget of one model call of :func:`nll_bound`: logits (rows × L × S) it may produce (256 MiB in float32)."""


def _block_model(model: X0Model, length: int) -> Denoiser | None:
    """The block model inside ``model`` when it splits ``length`` tokens into several blocks, else ``None``."""
    inner = denoiser_of(model)
    K = None if inner is None else inner.block_size
    return inner if K is not None and K < length else None


def prior_kl(kernel: Kernel, x0: torch.Tensor) -> torch.Tensor:
    """C_ELBO per position: KL(q_{1|0}(·|x0) ‖ p_prior), float64 ``(...)`` for ids ``x0 (...)``.

    Interpolating kernels are evaluated at t = 1 exactly; other kernels at t = 1 − 10⁻⁷. ``+inf`` where the prior
    misses a state that q_{1|0} reaches (Proposition 3.2's assumption (1) fails).
    """
    kernel = check_kernel(kernel)
    ids = check_token_ids("x0", x0, kernel.num_states)
    T = 1.0 if isinstance(kernel, InterpolatingKernel) else 1.0 - 1e-7
    t = torch.full((), T, dtype=torch.float64, device=ids.device)  # filled there: no host-to-device copy
    q = kernel.marginal_of_ids(ids, t, torch.float64)  # (..., S)
    prior = kernel.prior(None, dtype=torch.float64, device=ids.device)  # (S,)
    pos = q > 0
    ratio = torch.where(pos, q, torch.ones_like(q)) / prior
    terms = torch.where(pos, q * torch.log(ratio), torch.zeros_like(q))
    return terms.sum(-1)


@torch.no_grad()
def nll_bound(model: X0Model, x0: torch.Tensor, kernel: Kernel, *, num_times: int = 128,
              generator: torch.Generator | None = None, attention_mask: torch.Tensor | None = None,
              t_min: float = 0.0, per_token: bool = True, reference: bool = False,
              batch_size: int | None = None, prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Proposition 3.2's upper bound on −log p_θ(x0), per sequence, float64 ``(B,)``.

    For a block model (``adapt_ar_model(..., block_size=K)``, K < L) it is the block bound
    Σ_b ∫ D_t(block b | clean prefix) dt + C_ELBO ≥ −Σ_b log p_θ(x_b | x_<b) (one forward of the block-causal layout of
    :mod:`unifusion.hf.ar.blocks` per time; every block at the same time, which estimates the same sum of integrals).

    bound = ∫_0^1 E[Σ_i D_t^i] dt + C_ELBO, estimated with ``num_times`` stratified times (module docstring).

    Args:
        model: x0 predictor ``model(x_t (B, L), t (B,)) -> logits (B, L, S)``; called with ``attention_mask=`` when
            one is given (a :class:`~unifusion.DiffusionLM` accepts it).
        x0: clean token ids ``(B, L)``.
        kernel: the forward kernel the model was trained with.
        num_times: K ≥ 1 stratified times (K evaluations of the B sequences, several per model call).
        generator: randomness for u and x_t (on x0's device).
        attention_mask: optional ``(B, L)``, 1 = real token; padding is excluded from the sums and the token count.
        t_min: lower end of the time integral, in [0, 1).
        per_token: divide by the number of (real) tokens (nats per token; exponentiate for a perplexity bound).
            ``False`` returns the bound on the sequence's −log p_θ(x0).
        reference: evaluate D_t with the straightforward reference loss
            :func:`~unifusion.losses.reference_gidd_loss` instead of the fast
            :func:`~unifusion.losses.x0_head_loss` (slower; the same values to float32 rounding, float64 rounding
            for float64 logits, and the same draws for the same generator state and ``batch_size``). For checking
            the fast path.
        prompt_mask: optional ``(B, L)`` bool, True on prompt tokens: the *conditional* bound on
            −log p_θ(x0[¬prompt] | x0[prompt]). Prompt tokens are clean in x_t at every time, contribute no D_t and
            no C_ELBO, and are not counted by ``per_token``. Each row needs a real token outside the prompt. The
            model is conditioned on it by :func:`unifusion.denoiser.prompt_conditioning` (as in
            :func:`~unifusion.diffusion_loss`): ``nll_bound(dgemma, x0, kernel, prompt_mask=pm)`` runs as it is.
        batch_size: rows per model call, each row one sequence at one time: ``max(1, batch_size // B)`` times go
            into a call (at least one: a batch is never split). Default: as many as keep a call's logits within
            :data:`LOGITS_PER_CALL` elements (one time per call with ``reference=True``). The draws depend on it
            (the same generator state, another order).

    Returns:
        float64 ``(B,)``.
    """
    kernel = check_kernel(kernel)
    num_times = V.check_positive_int("num_times", num_times)
    if isinstance(t_min, bool) or not isinstance(t_min, (int, float)) or not 0.0 <= t_min < 1.0:
        raise ValueError(f"t_min: expected a float in [0, 1), got {t_min!r}")
    if not isinstance(reference, bool):
        raise TypeError(f"reference: expected a bool, got {type(reference).__name__}")
    if batch_size is not None:
        batch_size = V.check_positive_int("batch_size", batch_size)
    x0 = V.check_token_batch("x0", x0)
    V.check_model_kernel(model, kernel)
    generator = V.check_generator(generator)
    V.check_model_device(model, "x0", x0)
    x_0 = check_token_ids("x0", x0, kernel.num_states)
    B, L = x_0.shape
    if attention_mask is None:
        valid = torch.ones_like(x_0, dtype=torch.bool)
    else:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != x_0.shape:
            raise ValueError(f"attention_mask: expected a tensor of shape {tuple(x_0.shape)} like x0")
        attention_mask = host_to_device(attention_mask, x_0.device)  # once, not once per model call
        valid = attention_mask.to(torch.bool)
    prompt: torch.Tensor | None = None
    if prompt_mask is not None:
        valid = V.check_prompt_mask(prompt_mask, valid)  # the conditional bound: prompt clean, unscored
        prompt = host_to_device(prompt_mask, x_0.device).to(torch.bool)
    prompt_conditioning(model, x_0, prompt)  # a model that needs a prompt and has none: refused before any call
    block_model = _block_model(model, L)

    k = torch.arange(1, num_times + 1, dtype=torch.float64, device=x_0.device)  # (K,)
    u = torch.rand(B, generator=generator, dtype=torch.float64, device=x_0.device)  # (B,)
    times = (t_min + (1.0 - t_min) * (k[:, None] - u[None, :]) / num_times).clamp(1e-12, MAX_TIME)  # (K, B)
    if batch_size is not None:
        rows = batch_size
    else:  # the reference loss holds ~100 float32 copies of its logits: one time per call
        rows = B if reference else LOGITS_PER_CALL // max(1, L * kernel.num_states)
    per_call = max(1, min(num_times, rows // B))  # times per model call
    loss = reference_gidd_loss if reference else x0_head_loss
    total = torch.zeros(B, dtype=torch.float64, device=x_0.device)
    for first in range(0, num_times, per_call):  # ids were checked above and the times are made here: no host syncs
        t = times[first:first + per_call].reshape(-1)  # (n B,): row r is sequence r mod B
        n = t.shape[0] // B
        x_0n, valid_n = x_0.repeat(n, 1), valid.repeat(n, 1)  # (n B, L)
        extra: dict[str, Any] = {} if attention_mask is None else {"attention_mask": attention_mask.repeat(n, 1)}
        if block_model is not None:
            extra.update(block_model.block_conditioning(x_0n))
        extra.update(prompt_conditioning(model, x_0n, None if prompt is None else prompt.repeat(n, 1)))
        with V.unchecked():
            x_t = kernel.sample(x_0n, t[:, None], generator=generator)  # (n B, L)
            x_t = torch.where(valid_n, x_t, x_0n)
            logits = logits_of(model(x_t, t.float(), **extra))  # (n B, L, S)
            D_t = loss(logits, x_0n, x_t, t[:, None], kernel)  # (n B, L), = D_t exactly: one time per row
        del logits
        D_t = torch.where(valid_n, D_t.double(), torch.zeros((), dtype=torch.float64, device=x_0.device))
        total += D_t.sum(-1).view(n, B).sum(0)
    integral = total * (1.0 - t_min) / num_times
    with V.unchecked():  # x_0 was checked above
        c_elbo = torch.where(valid, prior_kl(kernel, x_0), torch.zeros((), dtype=torch.float64)).sum(-1)
    bound = integral + c_elbo
    if per_token:
        bound = bound / valid.sum(-1).clamp_min(1)
    return bound
