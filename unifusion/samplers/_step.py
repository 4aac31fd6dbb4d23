"""The Bayesian posterior step of Algorithm 2 (paper App. C.5) as pure functions (private).

**Posterior step for interpolating kernels.** With q_{t|0}(j|i) = α_t δ_ij + m_t(j), the per-position posterior

    p̂_{s|t}(a | b) = q_{t|s}(b|a) q_s(a|x_θ) / q_t(b|x_θ),   q_{t|s}(b|a) = r δ_ab + w(b),  r = α_t/α_s,

is a two-part mixture: its numerator is r q_s(b|x_θ) e_b + w(b) q_s(·|x_θ) with total q_t(b|x_θ). So z_s = b ("stay")
with probability r q_s(b|x_θ) / (r q_s(b|x_θ) + w(b)), else z_s ~ q_s(·|x_θ) = α_s x_θ + m_s, itself a mixture of a
draw from x_θ (probability α_s), the mask state (a_s) and a uniform noise token (b_s). Only x_θ(b) and one draw from
x_θ per position touch the vocabulary: the step costs one softmax and one block-wise inverse-CDF draw
(:mod:`unifusion.samplers._draws`), O(V) per position with no (B, L, V) temporary besides a reused workspace.
Nothing here reads a value back to the host.
"""

from __future__ import annotations

import torch

from ..kernels import InterpolatingKernel, Kernel
from ._draws import BLOCK_SIZE, Generators, draw_from_logits, draw_rows, sample_weights


def kernel_coefficients(kernel: Kernel, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(α_t, a_t, b_t) of an interpolating kernel (q_{t|0}(j|i) = α_t δ_ij + a_t e_mask + b_t u_U), else ``None``."""
    if isinstance(kernel, InterpolatingKernel):
        return kernel.coefficients(t)
    return None


def stay_probability(kernel: InterpolatingKernel, p_b: torch.Tensor, x_t: torch.Tensor,
                     coef_t: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     coef_s: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """P(z_s = x_t) of the mixture form of p̂_{s|t}: r q_s(b|x_θ) / (r q_s(b|x_θ) + w(b)), b = x_t, ``(B, L)``.

    ``p_b`` is x_θ(b) ``(B, L)``. Where both weights vanish (x_t impossible under x_θ and unreachable by noise, e.g.
    a clean token x_θ gives probability 0 under the mask kernel) the token stays: it is the only reachable state.
    """
    alpha_t, alpha_s = coef_t[0], coef_s[0]
    r = alpha_t / alpha_s
    q_s_b = alpha_s * p_b + kernel.noise_at(x_t, coef_s[1], coef_s[2])  # q_s(b | x_θ)
    w_b = kernel.transition_noise_at(x_t, coef_t, coef_s).clamp_min(0.0)  # noise part of q_{t|s}(b | ·)
    stay = r * q_s_b
    z = stay + w_b
    return torch.where(z > 0, stay / torch.where(z > 0, z, torch.ones_like(z)), torch.ones_like(z))


def noise_tokens(kernel: InterpolatingKernel, shape: torch.Size | tuple[int, ...], generator: Generators,
                 device: torch.device) -> torch.Tensor:
    """Uniform draws over the kernel's uniform-noise support U (all states, or all but the mask), int64 (one
    generator, or one per row: :func:`~unifusion.samplers._draws.draw_rows`)."""
    n = kernel.num_uniform_states
    z = draw_rows(lambda size, g: torch.randint(0, n, size, generator=g, device=device), tuple(shape), generator)
    if not kernel.uniform_over_all and kernel.mask_id is not None:
        z = z + (z >= kernel.mask_id).long()
    return z


def uniforms(shape: tuple[int, ...], generator: Generators, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """U(0, 1) draws of ``shape`` ``(B, ...)`` (one generator, or one per row: :func:`draw_rows`)."""
    return draw_rows(lambda size, g: torch.rand(size, generator=g, device=device, dtype=dtype), shape, generator)


def bayesian_step(weights: torch.Tensor, x_t: torch.Tensor, kernel: Kernel, t: torch.Tensor, s: torch.Tensor,
                  generator: Generators, *, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """One step of Algorithm 2: z_s ~ p̂_{s|t}(· | z_t = x_t) per position, for 0 ≤ s < t < 1.

    Args:
        weights: unnormalised x_θ ``(B, L, S)`` (see :func:`x0_weights`; mask state 0). For interpolating kernels it is
            read only; for other kernels it is normalised in place.
        x_t: current tokens ``(B, L)``.
        kernel: the forward kernel.
        t, s: 0-d times (tensors on the device, the computation dtype).
        generator: randomness (consumes one ``rand(B, L, 4)``, then one ``randint(B, L)`` for interpolating kernels),
            or a sequence of B generators, one per row (each consumes ``rand(1, L, 4)``, then ``randint(1, L)``).

    Returns:
        z_s ``(B, L)`` int64.
    """
    B, L, S = weights.shape
    u = uniforms((B, L, 4), generator, weights.device, weights.dtype)
    if not isinstance(kernel, InterpolatingKernel):  # dense fallback, O(S) per position through the kernel's hooks
        total = weights.sum(-1, keepdim=True)
        weights.div_(total.clamp_min(torch.finfo(weights.dtype).tiny))
        post = kernel.posterior_from_probs(weights, x_t, s, t)
        return sample_weights(post, u[..., 2:], block_size=block_size)[0]

    noise = noise_tokens(kernel, (B, L), generator, weights.device)
    draw, total = sample_weights(weights, u[..., 2:], block_size=block_size)  # z ~ x_θ, and Σ weights
    p_b = weights.gather(-1, x_t.unsqueeze(-1)).squeeze(-1) / total.clamp_min(torch.finfo(total.dtype).tiny)
    return mix_step(kernel, draw, p_b, x_t, noise, u, t, s)


def bayesian_step_from_logits(logits: torch.Tensor, x_t: torch.Tensor, kernel: InterpolatingKernel,
                              t: torch.Tensor, s: torch.Tensor, generator: Generators, *,
                              temperature: float = 1.0, dtype: torch.dtype = torch.float32,
                              block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """:func:`bayesian_step` with x_θ = softmax(logits / T) taken straight from the model's logits ``(B, L, S)``
    (:func:`draw_from_logits`; no workspace). Same randomness as :func:`bayesian_step`, same distribution."""
    B, L, _ = logits.shape
    u = uniforms((B, L, 4), generator, logits.device, dtype)
    noise = noise_tokens(kernel, (B, L), generator, logits.device)
    draw, p_b = draw_from_logits(logits, x_t, u[..., 2:], mask_id=kernel.mask_id, temperature=temperature,
                                 dtype=dtype, block_size=block_size)
    return mix_step(kernel, draw, p_b, x_t, noise, u, t, s)


def mix_step(kernel: InterpolatingKernel, draw: torch.Tensor, p_b: torch.Tensor, x_t: torch.Tensor,
             noise: torch.Tensor, u: torch.Tensor, t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The mixture form of p̂_{s|t} given one draw from x_θ and x_θ(x_t): stay at x_t with the stay probability,
    else take the x_θ draw (probability α_s), the mask state (a_s) or the uniform ``noise`` token (b_s)."""
    coef_t, coef_s = kernel.coefficients(t), kernel.coefficients(s)
    stay = stay_probability(kernel, p_b, x_t, coef_t, coef_s, t, s)
    alpha_s, a_s, b_s = coef_s
    norm = alpha_s + a_s + b_s  # = 1 for the built-in kernels
    branch = u[..., 1] * norm
    moved = torch.where(branch < alpha_s, draw, noise)  # from x_θ with prob α_s, else noise
    if kernel.mask_id is not None:
        to_mask = (branch >= alpha_s) & (branch < alpha_s + a_s)
        moved = torch.where(to_mask, torch.full_like(moved, kernel.mask_id), moved)
    return torch.where(u[..., 0] < stay, x_t, moved)


def posterior_mixture(kernel: InterpolatingKernel, x0_probs: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                      s: torch.Tensor) -> torch.Tensor:
    """The distribution :func:`bayesian_step` draws from, written densely ``(B, L, S)``: stay · e_{x_t} + (1 − stay)
    · q_s(·|x_θ). Equal to ``kernel.posterior(x0_probs, x_t, s, t)``; used by tests and for argmax final steps."""
    coef_t, coef_s = kernel.coefficients(t), kernel.coefficients(s)
    p_b = x0_probs.gather(-1, x_t.unsqueeze(-1)).squeeze(-1)
    stay = stay_probability(kernel, p_b, x_t, coef_t, coef_s, t, s).unsqueeze(-1)
    alpha_s, a_s, b_s = coef_s
    q_s = alpha_s * x0_probs + kernel.noise_vector(a_s, b_s) * x0_probs.sum(-1, keepdim=True)
    e_b = torch.zeros_like(q_s).scatter_(-1, x_t.unsqueeze(-1), 1.0)
    return stay * e_b + (1.0 - stay) * q_s
