"""Pure pieces shared by the samplers (private): argument checks, prompts, x_θ post-processing, categorical draws and
the Bayesian posterior step of Algorithm 2 (paper App. C.5).

Everything here is a function on tensors; the sampler classes are thin loops over them. Nothing in this module reads
a tensor value back to the host.

**Posterior step for interpolating kernels.** With q_{t|0}(j|i) = α_t δ_ij + m_t(j), the per-position posterior

    p̂_{s|t}(a | b) = q_{t|s}(b|a) q_s(a|x_θ) / q_t(b|x_θ),   q_{t|s}(b|a) = r δ_ab + w(b),  r = α_t/α_s,

is a two-part mixture: its numerator is r q_s(b|x_θ) e_b + w(b) q_s(·|x_θ) with total q_t(b|x_θ). So z_s = b ("stay")
with probability r q_s(b|x_θ) / (r q_s(b|x_θ) + w(b)), else z_s ~ q_s(·|x_θ) = α_s x_θ + m_s, itself a mixture of a
draw from x_θ (probability α_s), the mask state (a_s) and a uniform noise token (b_s). Only x_θ(b) and one draw from
x_θ per position touch the vocabulary: the step costs one softmax and one block-wise inverse-CDF draw, O(V) per
position with no (B, L, V) temporary besides a reused workspace.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .. import _compile
from .. import _validation as V
from ..kernels import InterpolatingKernel, Kernel

PROMPT_FILL = -1
"""Fill value of a prompt tensor: positions holding ``PROMPT_FILL`` are generated, every other position is kept."""

BLOCK_SIZE = 256
"""Vocabulary block size of the two-level inverse-CDF draw (about √V for LM vocabularies)."""

_COMPUTE_DTYPES = (torch.float32, torch.float64)

ModelFn = Callable[[torch.Tensor, torch.Tensor], Any]


# ----------------------------------------------------------------------------------------------------------------
# argument checks (cheap; raise ValueError/TypeError naming the argument)


def check_kernel(kernel: object) -> Kernel:
    if not isinstance(kernel, Kernel):
        raise TypeError(f"kernel: expected a unifusion Kernel, got {type(kernel).__name__}")
    return kernel


def check_model(model: object) -> ModelFn:
    if not callable(model):
        raise TypeError(f"model: expected a callable (x_t (B, L), t (B,)) -> head, got {type(model).__name__}")
    return model  # type: ignore[return-value]


def check_positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps: expected a float in (0, 1), got {type(eps).__name__}")
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps: expected a float in the open interval (0, 1), got {eps}")
    return float(eps)


def check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected torch.float32 or torch.float64, got {type(dtype).__name__}")
    if dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"dtype: expected torch.float32 or torch.float64 (the posterior arithmetic), got {dtype}")
    return dtype


def check_sampling_options(temperature: object, top_k: object, top_p: object) -> tuple[float, int | None, float | None]:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature: expected a float > 0, got {type(temperature).__name__}")
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise ValueError(f"temperature: expected a finite float > 0, got {temperature}")
    if top_k is not None:
        top_k = check_positive_int("top_k", top_k)
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
            raise TypeError(f"top_p: expected None or a float in (0, 1], got {type(top_p).__name__}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p: expected None or a float in (0, 1], got {top_p}")
        top_p = float(top_p)
    return float(temperature), top_k, top_p


# ----------------------------------------------------------------------------------------------------------------
# devices, time grid, prompts


def resolve_device(model: object, prompt: object, generator: torch.Generator | None,
                   device: torch.device | str | None) -> torch.device:
    """``device`` if given, else the prompt's, the generator's, the model's parameters', else CPU."""
    if device is not None:
        return torch.device(device)
    if isinstance(prompt, torch.Tensor):
        return prompt.device
    if isinstance(prompt, (tuple, list)) and prompt and isinstance(prompt[0], torch.Tensor):
        return prompt[0].device
    if generator is not None:
        return generator.device
    parameters = getattr(model, "parameters", None)
    if callable(parameters):
        try:
            return next(iter(parameters())).device
        except (StopIteration, TypeError):
            pass
    return torch.device("cpu")


def time_grid(num_steps: int, eps: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """t_n = (1 − ε)(1 − n/N) for n = 0..N, ``(N + 1,)`` (Algorithm 2; t_N = 0 exactly)."""
    n = torch.arange(num_steps + 1, dtype=torch.float64)
    t = (1.0 - eps) * (1.0 - n / num_steps)
    t[-1] = 0.0
    return t.to(device=device, dtype=dtype)


def resolve_prompt(prompt: object, batch_size: int, seq_len: int, kernel: Kernel,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Normalise ``prompt`` to ``(ids (B, L) int64, keep (B, L) bool)`` or ``None``.

    Accepted forms: a tensor with :data:`PROMPT_FILL` (−1) at the positions to generate, or a pair ``(ids, keep_mask)``
    with ``keep_mask`` True where ``ids`` is kept. Leading shapes ``(L,)`` and ``(1, L)`` broadcast over the batch.
    Kept ids must be clean states (in ``[0, num_states)`` and not the mask state).
    """
    if prompt is None:
        return None
    if isinstance(prompt, torch.Tensor):
        ids = prompt
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"prompt: expected integer token ids with {PROMPT_FILL} at generated positions, "
                            f"got dtype {ids.dtype}")
        keep = ids != PROMPT_FILL
    elif isinstance(prompt, (tuple, list)) and len(prompt) == 2:
        ids, keep = prompt
        if not isinstance(ids, torch.Tensor) or not isinstance(keep, torch.Tensor):
            raise TypeError("prompt: expected a pair (ids, keep_mask) of tensors, got "
                            f"({type(ids).__name__}, {type(keep).__name__})")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"prompt: expected integer token ids in (ids, keep_mask), got dtype {ids.dtype}")
        if keep.dtype != torch.bool:
            raise TypeError(f"prompt: expected a bool keep_mask in (ids, keep_mask), got dtype {keep.dtype}")
        if keep.shape != ids.shape:
            raise ValueError(f"prompt: ids {tuple(ids.shape)} and keep_mask {tuple(keep.shape)} must have one shape")
    else:
        raise TypeError("prompt: expected a (B, L) tensor with -1 at generated positions or a pair (ids, keep_mask), "
                        f"got {type(prompt).__name__}")
    if ids.dim() == 1:
        ids, keep = ids[None], keep[None]
    if ids.dim() != 2 or ids.shape[1] != seq_len or ids.shape[0] not in (1, batch_size):
        raise ValueError(f"prompt: expected shape ({batch_size}, {seq_len}), (1, {seq_len}) or ({seq_len},) to "
                         f"match batch_size and seq_len, got {tuple(ids.shape)}")
    ids = ids.to(device=device, dtype=torch.long).expand(batch_size, seq_len)
    keep = keep.to(device).expand(batch_size, seq_len)
    if V.validation_enabled() and bool(keep.any()):
        kept = ids[keep]
        lo, hi = int(kept.min()), int(kept.max())
        if lo < 0 or hi >= kernel.num_states:
            raise ValueError(f"prompt: expected kept token ids in [0, {kernel.num_states}), got values in [{lo}, {hi}]"
                             f" (use {PROMPT_FILL} to mark positions to generate)")
        if kernel.mask_id is not None and bool((kept == kernel.mask_id).any()):
            raise ValueError(f"prompt: kept tokens must be clean, got the mask id {kernel.mask_id}; mark positions to "
                             f"generate with {PROMPT_FILL} (or keep_mask=False) instead")
    ids = torch.where(keep, ids, torch.zeros_like(ids))  # fill values never reach the model
    return ids, keep


@dataclass
class SamplingRun:
    """What both samplers' :meth:`sample` set up before their step loop (see :func:`start_run`)."""

    B: int
    L: int
    device: torch.device
    kept: tuple[torch.Tensor, torch.Tensor] | None  # the resolved prompt (ids, keep mask) or None
    ts: torch.Tensor  # t_0 … t_N on the device, (N + 1,): indexing it never syncs
    t_host: list[float]  # the same times on the host (for callbacks and the prior)
    x: torch.Tensor  # z_{t_0}: a draw from the kernel's prior, prompt applied, (B, L)
    steps: Iterable[int]  # range(N), wrapped in a tqdm bar when asked


def start_run(sampler: Any, batch_size: object, seq_len: object, prompt: object, generator: torch.Generator | None,
              progress: bool, callback: object, device: torch.device | str | None) -> SamplingRun:
    """Check :meth:`sample`'s arguments, resolve device and prompt, build the time grid t_n = (1 − ε)(1 − n/N) and
    draw z_{t_0} from the prior. ``sampler`` has ``model``, ``kernel``, ``num_steps``, ``eps`` and ``dtype``."""
    B = check_positive_int("batch_size", batch_size)
    L = check_positive_int("seq_len", seq_len)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback: expected a callable (step, t, x_t) -> bool or None, got {type(callback).__name__}")
    kernel, N, eps = sampler.kernel, sampler.num_steps, sampler.eps
    dev = resolve_device(sampler.model, prompt, generator, device)
    kept = resolve_prompt(prompt, B, L, kernel, dev)
    ts = time_grid(N, eps, sampler.dtype, dev)
    t_host = [(1.0 - eps) * (1.0 - n / N) for n in range(N)] + [0.0]
    x = apply_prompt(kernel.sample_prior((B, L), t=t_host[0], generator=generator, device=dev), kept)
    steps: Iterable[int] = range(N)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="sampling", total=N)
    return SamplingRun(B, L, dev, kept, ts, t_host, x, steps)


def apply_prompt(x: torch.Tensor, prompt: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    if prompt is None:
        return x
    return torch.where(prompt[1], prompt[0], x)


# ----------------------------------------------------------------------------------------------------------------
# model calls


def check_head_shape(name: str, head: object, batch_size: int, seq_len: int, num_states: int,
                     what: str = "x0 logits") -> torch.Tensor:
    """The model's ``(B, L, S)`` floating output; a clear error otherwise (shape read on the host, no sync)."""
    if not isinstance(head, torch.Tensor):
        raise TypeError(f"{name}: expected the model to return a (B, L, num_states) tensor of {what}, "
                        f"got {type(head).__name__}")
    if not head.dtype.is_floating_point:
        raise TypeError(f"{name}: expected floating-point {what}, got dtype {head.dtype}")
    if tuple(head.shape) != (batch_size, seq_len, num_states):
        raise ValueError(f"{name}: expected the model to return {what} of shape (B, L, num_states) = "
                         f"({batch_size}, {seq_len}, {num_states}), got {tuple(head.shape)}")
    return head


# ----------------------------------------------------------------------------------------------------------------
# x_θ post-processing: temperature, mask state, top-k, top-p


def _softmax_into(logits: torch.Tensor, out: torch.Tensor) -> None:
    if logits.dtype == out.dtype:
        torch._softmax(logits, -1, False, out=out)  # fused, writes the reused workspace
    else:
        out.copy_(logits)
        torch._softmax(out, -1, False, out=out)


def x0_weights(logits: torch.Tensor, out: torch.Tensor, *, mask_id: int | None, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Unnormalised x_θ ``(B, L, S)`` into the workspace ``out``: softmax(logits / T), the mask state set to 0
    (MDLM's SUBS: clean tokens never take it), then top-k, then top-p (nucleus) filtering.

    Rows are left unnormalised (after filtering they sum to ≤ 1); the draws normalise by the row total. Ties at the
    k-th value, and at the nucleus boundary, are kept.
    """
    if temperature != 1.0:
        torch.div(logits, temperature, out=out)
        _softmax_into(out, out)
    else:
        _softmax_into(logits, out)
    if mask_id is not None:
        out[..., mask_id] = 0.0
    if top_k is not None and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # (B, L, 1)
        out.masked_fill_(out < kth, 0.0)
    if top_p is not None and top_p < 1.0:
        sorted_w, _ = torch.sort(out, dim=-1, descending=True)
        before = sorted_w.cumsum(-1) - sorted_w  # mass strictly before each token, (B, L, S)
        total = before[..., -1:] + sorted_w[..., -1:]
        count = (before < top_p * total).sum(-1, keepdim=True).clamp_min(1)  # smallest nucleus reaching top_p
        threshold = sorted_w.gather(-1, count - 1)
        out.masked_fill_(out < threshold, 0.0)
    return out


# ----------------------------------------------------------------------------------------------------------------
# categorical draws


def _search(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Smallest index i with cdf[i] > u · cdf[-1] (inverse CDF; zero-weight entries are never chosen)."""
    total = cdf[..., -1:]
    v = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, v, right=True).clamp_max(cdf.shape[-1] - 1)


def sample_weights(weights: torch.Tensor, u: torch.Tensor, *, block_size: int = BLOCK_SIZE
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one index per row of non-negative ``weights`` ``(..., S)`` ∝ the weights, by two-level inverse CDF.

    ``u`` ``(..., 2)`` holds two independent uniforms per row: the first picks a block of ``block_size`` states ∝ its
    mass, the second a state inside it. Exact in exact arithmetic; in floating point no cumulative sum runs over more
    than ``max(S / block_size, block_size)`` terms. Rows with zero total return an arbitrary index.

    Returns ``(index (...) int64, row total (...))``.
    """
    S = weights.shape[-1]
    num_blocks = S // block_size
    tail = S - num_blocks * block_size
    parts = []
    if num_blocks:
        parts.append(weights[..., : num_blocks * block_size].unflatten(-1, (num_blocks, block_size)).sum(-1))
    if tail:
        parts.append(weights[..., num_blocks * block_size:].sum(-1, keepdim=True))
    block_mass = parts[0] if len(parts) == 1 else torch.cat(parts, -1)  # (..., nb)
    block_cdf = block_mass.cumsum(-1)
    block = _search(block_cdf, u[..., :1])  # (..., 1)
    return _draw_in_block(block, block_size, S, lambda idx: weights.gather(-1, idx), u[..., 1:2]), block_cdf[..., -1]


def _draw_in_block(block: torch.Tensor, block_size: int, S: int, weight_of: Callable[[torch.Tensor], torch.Tensor],
                   u: torch.Tensor) -> torch.Tensor:
    """Second level of the two-level draw: a state of the chosen ``block`` ``(..., 1)`` ∝ ``weight_of(ids)`` (ids
    ``(..., width)``, clamped into range; states past S weigh 0), by inverse CDF with ``u`` ``(..., 1)``. ``(...)``."""
    idx = block * block_size + torch.arange(min(block_size, S), device=block.device)  # (..., width)
    local = weight_of(idx.clamp_max(S - 1))
    local = torch.where(idx < S, local, torch.zeros_like(local))
    return idx.gather(-1, _search(local.cumsum(-1), u)).squeeze(-1)


# ----------------------------------------------------------------------------------------------------------------
# draws straight from the logits (no (B, L, S) workspace): the default when no top-k / top-p filter is set

COMPILE_MIN_STATES = 2048
"""Vocabularies from this size up run :func:`block_log_mass` through ``torch.compile`` (see
:func:`unifusion.set_backend`); below it the pass is cheap next to any model and the one-off compilation is not."""


def block_log_mass(logits: torch.Tensor, mask_id: int | None, temperature: float, block_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """log Σ_{y in block} exp(l_y / T) per vocabulary block of ``block_size`` states, ``(..., ceil(S / block))``.

    The mask state (MDLM's SUBS) counts as −inf; the last block may be shorter. Computed as m + log Σ exp(l − m)
    with m the row max, so a block far below the max underflows to −inf: its mass relative to the row's is
    < e^−87 (float32) or e^−708 (float64), below the precision of any draw. Compiled, this is a max and one pass of
    exp over the logits, and nothing of size S is written.
    """
    S = logits.shape[-1]
    l = logits.to(dtype)
    if temperature != 1.0:
        l = l / temperature
    if mask_id is not None:
        l = torch.where(torch.arange(S, device=logits.device) == mask_id, -math.inf, l)
    m = l.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    num_full = S // block_size
    parts = []
    if num_full > 0:
        parts.append(torch.exp(l[..., : num_full * block_size] - m).unflatten(-1, (num_full, block_size)).sum(-1))
    if S - num_full * block_size > 0:
        parts.append(torch.exp(l[..., num_full * block_size:] - m).sum(-1, keepdim=True))
    mass = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
    return torch.log(mass) + m


def draw_from_logits(logits: torch.Tensor, x_t: torch.Tensor, u: torch.Tensor, *, mask_id: int | None,
                     temperature: float, dtype: torch.dtype, block_size: int = BLOCK_SIZE
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw z ~ x_θ = softmax(logits / T) (mask state excluded) per position and x_θ(x_t), without a softmax
    over the whole vocabulary: block masses from :func:`block_log_mass`, then the same two-level inverse CDF as
    :func:`sample_weights` (``u`` ``(..., 2)``: block, then state), exponentiating only the chosen block.

    Returns ``(z (B, L) int64, x_θ(x_t) (B, L) in dtype)``.
    """
    S = logits.shape[-1]
    key = (logits.device.type, logits.dtype, dtype, mask_id is None, temperature == 1.0, block_size)
    if S >= COMPILE_MIN_STATES and not torch.compiler.is_compiling():
        log_mass = _compile.run(block_log_mass, key, lambda fn: fn(logits, mask_id, temperature, block_size, dtype),
                                lambda: block_log_mass(logits, mask_id, temperature, block_size, dtype))
    else:
        log_mass = block_log_mass(logits, mask_id, temperature, block_size, dtype)
    log_total = torch.logsumexp(log_mass, -1, keepdim=True)  # (B, L, 1)

    def x_theta(ids: torch.Tensor) -> torch.Tensor:  # x_θ at ``ids``, 0 at the mask state
        p = torch.exp(logits.gather(-1, ids).to(dtype) / temperature - log_total)
        return p if mask_id is None else torch.where(ids == mask_id, torch.zeros_like(p), p)

    block = _search(torch.exp(log_mass - log_total).cumsum(-1), u[..., :1])  # (B, L, 1)
    z = _draw_in_block(block, block_size, S, x_theta, u[..., 1:2])
    return z, x_theta(x_t.unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------------------------------------------
# the Bayesian posterior step (Algorithm 2)


def kernel_coefficients(kernel: Kernel, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(α_t, a_t, b_t) of an interpolating kernel (q_{t|0}(j|i) = α_t δ_ij + a_t e_mask + b_t u_U), else ``None``."""
    if isinstance(kernel, InterpolatingKernel):
        return kernel._coefficients(t)
    return None


def stay_probability(kernel: InterpolatingKernel, p_b: torch.Tensor, x_t: torch.Tensor,
                     coef_t: tuple[torch.Tensor, ...], coef_s: tuple[torch.Tensor, ...],
                     t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """P(z_s = x_t) of the mixture form of p̂_{s|t}: r q_s(b|x_θ) / (r q_s(b|x_θ) + w(b)), b = x_t, ``(B, L)``.

    ``p_b`` is x_θ(b) ``(B, L)``. Where both weights vanish (x_t impossible under x_θ and unreachable by noise, e.g.
    a clean token x_θ gives probability 0 under the mask kernel) the token stays: it is the only reachable state.
    """
    alpha_t, alpha_s = coef_t[0], coef_s[0]
    r = alpha_t / alpha_s
    q_s_b = alpha_s * p_b + kernel._noise_at(x_t, coef_s[1], coef_s[2])  # q_s(b | x_θ)
    w_b = kernel._w(x_t, s, t, coef_t, coef_s).clamp_min(0.0)  # noise part of q_{t|s}(b | ·)
    stay = r * q_s_b
    z = stay + w_b
    return torch.where(z > 0, stay / torch.where(z > 0, z, torch.ones_like(z)), torch.ones_like(z))


def noise_tokens(kernel: InterpolatingKernel, shape: torch.Size | tuple[int, ...], generator: torch.Generator | None,
                 device: torch.device) -> torch.Tensor:
    """Uniform draws over the kernel's uniform-noise support U (all states, or all but the mask), int64."""
    n = kernel._unif_count()
    z = torch.randint(0, n, tuple(shape), generator=generator, device=device)
    if not kernel._uniform_over_all and kernel.mask_id is not None:
        z = z + (z >= kernel.mask_id).long()
    return z


def bayesian_step(weights: torch.Tensor, x_t: torch.Tensor, kernel: Kernel, t: torch.Tensor, s: torch.Tensor,
                  generator: torch.Generator | None, *, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """One step of Algorithm 2: z_s ~ p̂_{s|t}(· | z_t = x_t) per position, for 0 ≤ s < t < 1.

    Args:
        weights: unnormalised x_θ ``(B, L, S)`` (see :func:`x0_weights`; mask state 0). For interpolating kernels it is
            read only; for other kernels it is normalised in place.
        x_t: current tokens ``(B, L)``.
        kernel: the forward kernel.
        t, s: 0-d times (tensors on the device, the computation dtype).
        generator: randomness (consumes one ``rand(B, L, 4)``, then one ``randint(B, L)`` for interpolating kernels).

    Returns:
        z_s ``(B, L)`` int64.
    """
    B, L, S = weights.shape
    u = torch.rand((B, L, 4), generator=generator, device=weights.device, dtype=weights.dtype)
    if not isinstance(kernel, InterpolatingKernel):  # dense fallback, O(S) per position through the kernel's hooks
        total = weights.sum(-1, keepdim=True)
        weights.div_(total.clamp_min(torch.finfo(weights.dtype).tiny))
        post = kernel._posterior(weights, x_t, s, t)
        return sample_weights(post, u[..., 2:], block_size=block_size)[0]

    noise = noise_tokens(kernel, (B, L), generator, weights.device)
    draw, total = sample_weights(weights, u[..., 2:], block_size=block_size)  # z ~ x_θ, and Σ weights
    p_b = weights.gather(-1, x_t.unsqueeze(-1)).squeeze(-1) / total.clamp_min(torch.finfo(total.dtype).tiny)
    return mix_step(kernel, draw, p_b, x_t, noise, u, t, s)


def bayesian_step_from_logits(logits: torch.Tensor, x_t: torch.Tensor, kernel: InterpolatingKernel,
                              t: torch.Tensor, s: torch.Tensor, generator: torch.Generator | None, *,
                              temperature: float = 1.0, dtype: torch.dtype = torch.float32,
                              block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """:func:`bayesian_step` with x_θ = softmax(logits / T) taken straight from the model's logits ``(B, L, S)``
    (:func:`draw_from_logits`; no workspace). Same randomness as :func:`bayesian_step`, same distribution."""
    B, L, _ = logits.shape
    u = torch.rand((B, L, 4), generator=generator, device=logits.device, dtype=dtype)
    noise = noise_tokens(kernel, (B, L), generator, logits.device)
    draw, p_b = draw_from_logits(logits, x_t, u[..., 2:], mask_id=kernel.mask_id, temperature=temperature,
                                 dtype=dtype, block_size=block_size)
    return mix_step(kernel, draw, p_b, x_t, noise, u, t, s)


def mix_step(kernel: InterpolatingKernel, draw: torch.Tensor, p_b: torch.Tensor, x_t: torch.Tensor,
             noise: torch.Tensor, u: torch.Tensor, t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The mixture form of p̂_{s|t} given one draw from x_θ and x_θ(x_t): stay at x_t with the stay probability,
    else take the x_θ draw (probability α_s), the mask state (a_s) or the uniform ``noise`` token (b_s)."""
    coef_t, coef_s = kernel._coefficients(t), kernel._coefficients(s)
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
    coef_t, coef_s = kernel._coefficients(t), kernel._coefficients(s)
    p_b = x0_probs.gather(-1, x_t.unsqueeze(-1)).squeeze(-1)
    stay = stay_probability(kernel, p_b, x_t, coef_t, coef_s, t, s).unsqueeze(-1)
    alpha_s, a_s, b_s = coef_s
    q_s = alpha_s * x0_probs + kernel._noise_vector(a_s, b_s) * x0_probs.sum(-1, keepdim=True)
    e_b = torch.zeros_like(q_s).scatter_(-1, x_t.unsqueeze(-1), 1.0)
    return stay * e_b + (1.0 - stay) * q_s
