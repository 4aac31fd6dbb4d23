"""Forward corruption kernels (paper §2, Definitions 2.1–2.2; GIDD's hybrid; App. C.5 for q_{t|s}).

A kernel is a continuous-time Markov chain on ``num_states`` token states. Every kernel exposes

* ``marginal(x0, t)``      q_{t|0}(·|x0) ``(..., S)``; for a distribution x_θ, q_t(·|x_θ) = Σ_z x_θ(z) q_{t|0}(·|z),
* ``rate_into(x_t, t)``    forward rates R_t(i, x_t) from every source i into x_t ``(..., S)`` (0 at i = x_t),
* ``transition_into(x_t, s, t)``  q_{t|s}(x_t | a) for every a ``(..., S)`` (s = 0 gives q_{t|0}(x_t | ·)),
* ``posterior(x0_probs, x_t, s, t)``  p(z_s = · | z_t = x_t, x_θ) ∝ q_{t|s}(x_t|·) q_s(·|x_θ) ``(..., S)``,
* ``sample(x0, t, generator=None)`` and ``sample_prior(shape, generator=None)``.

Structured kernels (:class:`UniformKernel`, :class:`MaskKernel`, :class:`HybridKernel`) are interpolating kernels
q_{t|0}(j|i) = α_t δ_ij + m_t(j) with a noise-mass vector m_t = β_t π_t. Their forward generator is rank one plus
diagonal, R_t(i, j) = v_t(j) for i ≠ j with v_t = m_t' − (α_t'/α_t) m_t, and q_{t|s}(b|a) = (α_t/α_s) δ_ab + w(b) with
w = m_t − (α_t/α_s) m_s. Everything is O(S) per position: no S×S matrix is ever built for them.
:class:`GeneratorKernel` handles any CTMC in generator form with a dense ``(S, S)`` matrix (small S only).

Shapes: token ids are int64 ``(...)``; rows over states are ``(..., S)`` (last dim). Times follow the package's one
rule (``docs/concepts.md``, "Times"): a float or 0-d tensor is one time for every token; a 1-D tensor of length B is
one time per row of tokens ``(B, ...)`` (also when B equals the sequence length); ``(B, 1)`` is the same; a tensor
with as many dims as the tokens broadcasts with them as usual. A 1-D ``t`` of another length is a ``ValueError``.
Computation is float64 when any floating input is float64, otherwise float32 (bf16 inputs are upcast).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import _validation as V
from ._device import categorical, rand, randint
from ._math import safe_log
from .schedules import LinearSchedule, Schedule

__all__ = ["Kernel", "InterpolatingKernel", "UniformKernel", "MaskKernel", "HybridKernel", "GeneratorKernel",
           "check_kernel", "MAX_TIME"]

MAX_TIME = 1.0 - 1e-6
"""The largest time the package's own time draws reach (training times, stratified evaluation times): every kernel
stays finite there, and float32 keeps it below 1."""


def check_kernel(kernel: object, name: str = "kernel") -> Kernel:
    """``kernel`` if it is a unifusion :class:`Kernel`, else a ``TypeError`` naming the argument ``name``."""
    if not isinstance(kernel, Kernel):
        raise TypeError(f"{name}: expected a unifusion Kernel, got {type(kernel).__name__}")
    return kernel


def _broadcast(name_a: str, a: torch.Size, name_b: str, b: torch.Size) -> tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        raise ValueError(f"{name_a}: shape {tuple(a)} does not broadcast with {name_b}'s {tuple(b)}") from None


def _check_schedule(schedule: object) -> Schedule:
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule: expected a unifusion Schedule, got {type(schedule).__name__}")
    return schedule


class Kernel:
    """Base class of forward corruption kernels on ``num_states`` states.

    Two layers of methods:

    * the **checked API** (:meth:`marginal`, :meth:`rate_into`, :meth:`transition_into`, :meth:`posterior`,
      :meth:`sample`, :meth:`prior`, :meth:`sample_prior`) validates its inputs, applies the package's time rule,
      chooses the computation dtype and broadcasts;
    * the **kernel protocol** — :meth:`propagate`, :meth:`log_propagate`, :meth:`marginal_of_ids`,
      :meth:`log_marginal_of_ids`, :meth:`transition_column`, :meth:`rate_column`, :meth:`noise_distribution`,
      :meth:`posterior_from_probs` — is what losses, rates and samplers call once they have checked their own inputs:
      no checks, no host syncs, tensors already on one device in the computation dtype, times already shaped to
      broadcast with the ids. A new kernel implements :meth:`propagate`, :meth:`transition_column`,
      :meth:`rate_column`, :meth:`noise_distribution` and ``_sample``.
    """

    num_states: int
    mask_id: int | None = None

    # ------------------------------------------------------------------ public API
    @property
    def clean_state_mask(self) -> torch.Tensor:
        """Bool ``(S,)`` on the CPU: states a clean token x0 may take (every state but the mask state)."""
        return self.clean_state_mask_on(torch.device("cpu"))

    def clean_state_mask_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`clean_state_mask` built on ``device`` (no host-to-device copy)."""
        keep = torch.ones(self.num_states, dtype=torch.bool, device=device)
        if self.mask_id is not None:
            keep[self.mask_id] = False  # a fill on the device
        return keep

    def marginal(self, x0: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
        """q_{t|0}(·|x0) for token ids ``x0`` ``(...)``, or q_t(·|x_θ) = Σ_z x_θ(z) q_{t|0}(·|z) for a distribution
        ``x0`` ``(..., S)``. Returns ``(..., S)``."""
        with V.batched_checks():
            if isinstance(x0, torch.Tensor) and x0.dtype.is_floating_point:
                p = V.check_distribution("x0", x0, self.num_states)
                dtype = V.compute_dtype(p, t if isinstance(t, torch.Tensor) else None)
                t_ = V.check_time("t", t, device=p.device, dtype=dtype, shape=p.shape[:-1])
                ids = None
            else:
                ids = V.check_token_ids("x0", x0, self.num_states)
                dtype = V.compute_dtype(t if isinstance(t, torch.Tensor) else None)
                t_ = V.check_time("t", t, device=ids.device, dtype=dtype, shape=ids.shape)
        if ids is None:
            return self.propagate(p.to(dtype), t_)
        return self.propagate(self._one_hot(ids, dtype), t_)

    def rate_into(self, x_t: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
        """Forward rates R_t(i, x_t) from every source state i into ``x_t`` ``(...)``; returns ``(..., S)`` with 0 at
        i = x_t. SEDD's Q_t(x_t, i) is the same number (Q_t = R_t^T)."""
        with V.batched_checks():
            ids = V.check_token_ids("x_t", x_t, self.num_states)
            dtype = V.compute_dtype(t if isinstance(t, torch.Tensor) else None)
            t_ = V.check_time("t", t, device=ids.device, dtype=dtype, shape=ids.shape)
        return self.rate_column(ids, t_)

    def transition_into(self, x_t: torch.Tensor, s: torch.Tensor | float, t: torch.Tensor | float) -> torch.Tensor:
        """q_{t|s}(x_t | a) for every state a, ``(..., S)``, for 0 ≤ s < t < 1 (s = 0 gives q_{t|0}(x_t|·))."""
        with V.batched_checks():
            ids = V.check_token_ids("x_t", x_t, self.num_states)
            dtype = V.compute_dtype(*(v for v in (s, t) if isinstance(v, torch.Tensor)))
            t_ = V.check_time("t", t, device=ids.device, dtype=dtype, shape=ids.shape)
            s_ = V.check_time("s", s, device=ids.device, dtype=dtype, open_interval=False, shape=ids.shape)
            self._check_order(s_, t_)
        return self.transition_column(ids, s_, t_)

    def posterior(self, x0_probs: torch.Tensor, x_t: torch.Tensor, s: torch.Tensor | float,
                  t: torch.Tensor | float) -> torch.Tensor:
        """One step of Algorithm 2: p(z_s = a | z_t = x_t, x_θ) = q_{t|s}(x_t|a) q_s(a|x_θ) / q_t(x_t|x_θ).

        ``x0_probs`` ``(..., S)`` is the model's clean-token distribution (for kernels with a mask state its mask
        entry should be 0), ``x_t`` ``(...)``, 0 ≤ s < t < 1. Returns ``(..., S)`` summing to one.
        """
        with V.batched_checks():
            p = V.check_distribution("x0_probs", x0_probs, self.num_states)
            ids = V.check_token_ids("x_t", x_t, self.num_states)
            shape = _broadcast("x_t", ids.shape, "x0_probs", p.shape[:-1])
            dtype = V.compute_dtype(p, *(v for v in (s, t) if isinstance(v, torch.Tensor)))
            t_ = V.check_time("t", t, device=ids.device, dtype=dtype, shape=shape)
            s_ = V.check_time("s", s, device=ids.device, dtype=dtype, open_interval=False, shape=shape)
            self._check_order(s_, t_)
        return self.posterior_from_probs(p.to(dtype), ids, s_, t_)

    def sample(self, x0: torch.Tensor, t: torch.Tensor | float,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Draw x_t ~ q_{t|0}(·|x0) for token ids ``x0`` ``(...)``; returns int64 ``(...)``."""
        generator = V.check_generator(generator)
        with V.batched_checks():
            ids = V.check_token_ids("x0", x0, self.num_states)
            dtype = V.compute_dtype(t if isinstance(t, torch.Tensor) else None)
            t_ = V.check_time("t", t, device=ids.device, dtype=dtype, shape=ids.shape)
        return self._sample(ids, t_, generator)

    def prior(self, t: torch.Tensor | float | None = None, *, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> torch.Tensor:
        """The noise distribution π_t that Algorithm 2 starts from: ``(S,)`` for a float or 0-d ``t``, ``(*t.shape,
        S)`` for a tensor ``t`` (so a ``(B,)`` t gives one row per time, ``(B, 1)`` gives ``(B, 1, S)``); ``t=None``
        is the terminal prior p_prior (uniform for the uniform kernel, e_mask for mask and GIDD's hybrid).
        A float ``t`` is computed in ``dtype``; a tensor ``t`` in ``dtype`` too (and moved to ``device`` if given)."""
        if t is None:
            return self.noise_distribution(None, dtype, torch.device(device if device is not None else "cpu"))
        t_ = V.check_time("t", t, device=torch.device(device) if device is not None else None, dtype=dtype)
        return self.noise_distribution(t_, t_.dtype, t_.device)

    def sample_prior(self, shape: Sequence[int] | torch.Size, *, t: torch.Tensor | float | None = None,
                     generator: torch.Generator | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
        """Draw int64 tokens of ``shape`` from :meth:`prior`, independently per position (at time ``t`` when given).

        ``t`` follows the package's time rule against ``shape``: a float or 0-d tensor is one time for every
        position; a 1-D tensor is one time per row (length ``shape[0]``, also when it equals ``shape[-1]``);
        a tensor with as many dims as ``shape`` broadcasts with it (``(B, 1)``, ``(B, L)``).
        """
        generator = V.check_generator(generator)
        dev = torch.device(device) if device is not None else (
            generator.device if generator is not None else torch.device("cpu"))
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float, torch.Tensor))):
            raise TypeError(f"t: expected None, a float or a float tensor, got {type(t).__name__}")
        shape = tuple(shape)
        n = int(math.prod(shape))
        if t is None or not isinstance(t, torch.Tensor) or t.dim() == 0:  # one distribution for every position
            pi = self.prior(t, dtype=torch.float32, device=dev)  # (S,)
            return categorical(pi, n, generator).reshape(shape)
        t_ = V.check_time("t", t, device=dev, dtype=V.compute_dtype(t), shape=shape)
        pi = torch.broadcast_to(self.noise_distribution(t_, t_.dtype, dev), (*shape, self.num_states))  # (*shape, S)
        return categorical(pi, 1, generator).reshape(shape)

    # ------------------------------------------------------------------ helpers shared by subclasses
    def _one_hot(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(*ids.shape, self.num_states, dtype=dtype, device=ids.device)
        return out.scatter_(-1, ids.unsqueeze(-1), 1.0)

    @staticmethod
    def _check_order(s: torch.Tensor, t: torch.Tensor) -> None:
        if V.validation_enabled() and s.numel() and t.numel():
            V.fail_if((s >= t).any(), lambda: "s: expected s < t elementwise (the posterior steps backwards in time)")

    # ------------------------------------------------------------------ the kernel protocol (unchecked)
    def propagate(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """Σ_z p(z) q_{t|0}(·|z) ``(..., S)`` for a non-negative (not necessarily normalised) ``p`` ``(..., S)``;
        ``t`` broadcasts with ``p.shape[:-1]``."""
        raise NotImplementedError  # abstractmethod

    def log_propagate(self, log_p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """log q_t(·|x_θ) ``(..., S)`` from normalised log-probabilities ``log_p`` ``(..., S)`` (log-space where the
        kernel allows it)."""
        return safe_log(self.propagate(log_p.exp(), t))

    def marginal_of_ids(self, ids: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """q_{t|0}(·|ids) ``(..., S)`` in ``dtype`` for clean ids ``(...)``."""
        return self.propagate(self._one_hot(ids, dtype), t)

    def log_marginal_of_ids(self, ids: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """log q_{t|0}(·|ids) ``(..., S)`` (−inf where the marginal is 0)."""
        return safe_log(self.marginal_of_ids(ids, t, dtype))

    def transition_column(self, ids: torch.Tensor, s: torch.Tensor,
                          t: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """q_{t|s}(ids | a) for every state a, ``(..., S)`` (s = 0: q_{t|0}(ids | ·))."""
        raise NotImplementedError  # abstractmethod

    def rate_column(self, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """Forward rates R_t(i, ids) from every source i, ``(..., S)``, 0 at i = ids."""
        raise NotImplementedError  # abstractmethod

    def noise_distribution(self, t: torch.Tensor | None, dtype: torch.dtype,
                           device: torch.device) -> torch.Tensor:  # pragma: no cover - abstract
        """π_t ``(*t.shape, S)`` (``(S,)`` for ``t=None``: the terminal prior)."""
        raise NotImplementedError  # abstractmethod

    def posterior_from_probs(self, p: torch.Tensor, ids: torch.Tensor, s: torch.Tensor,
                             t: torch.Tensor) -> torch.Tensor:
        """p(z_s = · | z_t = ids, x_θ = p) ``(..., S)``: q_{t|s}(ids|·) q_s(·|p), normalised."""
        numer = self.transition_column(ids, s, t) * self.propagate(p, s)
        return numer / numer.sum(-1, keepdim=True).clamp_min(torch.finfo(numer.dtype).tiny)

    def _sample(self, ids: torch.Tensor, t: torch.Tensor,
                generator: torch.Generator | None) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError  # abstractmethod


class InterpolatingKernel(Kernel):
    """q_{t|0}(j|i) = α_t δ_ij + m_t(j) with m_t = a_t e_mask + (b_t / |U|) 1_U (Definition 2.2 (2), GIDD).

    ``U`` is the set of states that receive uniform noise (all states, or all but the mask). Subclasses implement
    :meth:`coefficients` (α_t, a_t, b_t) and :meth:`rate_coefficients` (v_mask, v_unif): the forward rate into the
    mask state and into each state of ``U``. The structure methods below (:meth:`noise_at`, :meth:`noise_vector`,
    :meth:`is_mask`, :meth:`in_uniform_support`, :meth:`transition_noise_at`) are part of the unchecked kernel
    protocol: the O(S)-per-position losses and samplers are written in terms of them.
    """

    uniform_over_all: bool = True

    # -- structure
    @property
    def num_uniform_states(self) -> int:
        """|U|: the number of states that receive uniform noise (all states, or all but the mask state)."""
        if self.uniform_over_all or self.mask_id is None:
            return self.num_states
        return self.num_states - 1

    @property
    def has_uniform_noise(self) -> bool:
        """Whether some noise mass goes to clean states (u = b_t/|U| > 0 for t in (0, 1)); ``False`` for the mask
        kernel and a hybrid kernel with ``p_uniform = 0``."""
        return True

    def coefficients(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(α_t, a_t, b_t), each shaped like ``t``: q_{t|0}(j|i) = α_t δ_ij + a_t δ_{j,mask} + b_t 1_U(j)/|U|."""
        raise NotImplementedError  # abstractmethod

    def rate_coefficients(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(v_mask, v_unif), shaped like ``t``: the forward rate into the mask state and into each state of U."""
        raise NotImplementedError  # abstractmethod

    def in_uniform_support(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool like ``ids``: whether each id is in U (receives uniform noise)."""
        if self.uniform_over_all or self.mask_id is None:
            return torch.ones_like(ids, dtype=torch.bool)
        return ids != self.mask_id

    def is_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool like ``ids``: whether each id is the mask state (all ``False`` without one)."""
        if self.mask_id is None:
            return torch.zeros_like(ids, dtype=torch.bool)
        return ids == self.mask_id

    def noise_vector(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """m_t ``(..., S)`` from the mask mass a_t and uniform mass b_t (both ``(...)``)."""
        S = self.num_states
        support = torch.ones(S, dtype=a.dtype, device=a.device)
        if self.mask_id is not None and not self.uniform_over_all:
            support[self.mask_id] = 0.0
        m = (b / self.num_uniform_states).unsqueeze(-1) * support
        if self.mask_id is not None:  # e_mask by indexing (one_hot would read its input back to check the range)
            e_mask = torch.zeros(S, dtype=a.dtype, device=a.device)
            e_mask[self.mask_id] = 1.0
            m = m + a.unsqueeze(-1) * e_mask
        return m

    def noise_at(self, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """m_t(ids) elementwise, from the mask mass ``a`` and uniform mass ``b`` of :meth:`coefficients`."""
        out = torch.where(self.in_uniform_support(ids), b / self.num_uniform_states, torch.zeros_like(b))
        return out + torch.where(self.is_mask(ids), a, torch.zeros_like(a))

    # -- the kernel protocol
    def propagate(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        alpha, a, b = self.coefficients(t)
        shape = torch.broadcast_shapes(p.shape[:-1], alpha.shape)
        alpha, a, b = (torch.broadcast_to(x, shape) for x in (alpha, a, b))
        return alpha.unsqueeze(-1) * p + self.noise_vector(a, b) * p.sum(-1, keepdim=True)

    def log_propagate(self, log_p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        alpha, a, b = self.coefficients(t)
        shape = torch.broadcast_shapes(log_p.shape[:-1], alpha.shape)
        alpha, a, b = (torch.broadcast_to(x, shape) for x in (alpha, a, b))
        log_m = safe_log(self.noise_vector(a, b))
        return torch.logaddexp(torch.log(alpha).unsqueeze(-1) + log_p, log_m)

    def transition_column(self, ids: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        alpha_t, a_t, b_t = self.coefficients(t)
        alpha_s, a_s, b_s = self.coefficients(s)
        shape = torch.broadcast_shapes(ids.shape, alpha_t.shape, alpha_s.shape)
        ids = ids.expand(shape)
        ratio = torch.broadcast_to(alpha_t / alpha_s, shape)
        w = torch.broadcast_to(self.transition_noise_at(ids, (alpha_t, a_t, b_t), (alpha_s, a_s, b_s)), shape)
        out = torch.zeros(*shape, self.num_states, dtype=ratio.dtype, device=ids.device) + w.unsqueeze(-1)
        return out.scatter_add_(-1, ids.unsqueeze(-1), ratio.unsqueeze(-1))

    def transition_noise_at(self, ids: torch.Tensor, coef_t: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                            coef_s: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """w(ids) = m_t(ids) − (α_t/α_s) m_s(ids) ≥ 0, the noise part of q_{t|s}(ids|a) = (α_t/α_s) δ_{a,ids} +
        w(ids); ``coef_t``, ``coef_s`` are :meth:`coefficients` at t and s."""
        alpha_t, a_t, b_t = coef_t
        alpha_s, a_s, b_s = coef_s
        return self.noise_at(ids, a_t, b_t) - (alpha_t / alpha_s) * self.noise_at(ids, a_s, b_s)

    def rate_column(self, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        v_mask, v_unif = self.rate_coefficients(t)
        shape = torch.broadcast_shapes(ids.shape, v_mask.shape)
        ids = ids.expand(shape)
        v = torch.where(self.is_mask(ids), v_mask, torch.where(self.in_uniform_support(ids), v_unif,
                                                                     torch.zeros_like(v_unif)))
        out = v.unsqueeze(-1).expand(*shape, self.num_states).clone()
        return out.scatter_(-1, ids.unsqueeze(-1), 0.0)

    def noise_distribution(self, t: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # t=None: the t → 1 limit in float64 (GIDD's c_1 = 0 makes the hybrid prior all-mask)
        _, a, b = self.coefficients(torch.ones((), dtype=torch.float64, device=device) if t is None else t)
        m = self.noise_vector(a, b)
        pi = m / m.sum(-1, keepdim=True)
        return pi.to(dtype) if t is None else pi

    def _sample(self, ids: torch.Tensor, t: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        alpha, a, b = self.coefficients(t)
        shape = torch.broadcast_shapes(ids.shape, alpha.shape)
        ids = ids.expand(shape)
        u = rand(shape, generator=generator, device=ids.device, dtype=alpha.dtype)
        alpha, a = torch.broadcast_to(alpha, shape), torch.broadcast_to(a, shape)
        keep = u < alpha
        to_mask = (u >= alpha) & (u < alpha + a)
        n_unif = self.num_uniform_states
        noise = randint(n_unif, shape, generator=generator, device=ids.device)
        if not self.uniform_over_all and self.mask_id is not None:
            noise = noise + (noise >= self.mask_id).long()  # skip the mask id
        out = torch.where(keep, ids, noise)
        if self.mask_id is not None:
            out = torch.where(to_mask, torch.full_like(out, self.mask_id), out)
        return out


class UniformKernel(InterpolatingKernel):
    """Uniform noise: q_{t|0}(j|i) = α_t δ_ij + (1 − α_t)/S (the paper's kernel with α_t = 1 − t).

    Forward rates R_t(i, j) = (−α_t'/α_t)/S for i ≠ j; q_{t|s}(b|a) = (α_t/α_s) δ_ab + (1 − α_t/α_s)/S.

    Example::

        kernel = uf.UniformKernel(50257)
        x_t = kernel.sample(x0, t, generator=g)            # (B, L)
    """

    def __init__(self, num_states: int, schedule: Schedule | None = None) -> None:
        self.num_states = V.check_positive_int("num_states", num_states)
        self.schedule = _check_schedule(schedule if schedule is not None else LinearSchedule())
        self.mask_id = None

    def __repr__(self) -> str:
        return f"UniformKernel(num_states={self.num_states}, schedule={self.schedule!r})"

    def coefficients(self, t):
        return self.schedule.alpha(t), torch.zeros_like(t), self.schedule.one_minus_alpha(t)

    def rate_coefficients(self, t):
        v = self.schedule.hazard(t) / self.num_states
        return torch.zeros_like(v), v

    def transition_noise_at(self, ids, coef_t, coef_s):
        # (1 − α_t/α_s)/S = (β_t − β_s)/(α_s S): no cancellation for close s, t
        beta_t, beta_s = coef_t[2], coef_s[2]
        return (beta_t - beta_s) / (coef_s[0] * self.num_states) + torch.zeros_like(ids, dtype=beta_t.dtype)


class MaskKernel(InterpolatingKernel):
    """Absorbing kernel: q_{t|0}(j|i) = α_t δ_ij + (1 − α_t) δ_{j,mask} (π = e_mask).

    The mask state ``mask_id`` is one of the ``num_states`` ids; clean tokens never take it (an x0 head's mask entry is
    ignored: MDLM's SUBS convention). Only the mask state has non-zero reverse rates.
    """

    mask_id: int
    uniform_over_all = False

    def __init__(self, num_states: int, mask_id: int, schedule: Schedule | None = None) -> None:
        self.num_states = V.check_positive_int("num_states", num_states)
        self.mask_id = V.check_token_id("mask_id", mask_id, num_states)
        if num_states < 2:
            raise ValueError(f"num_states: a mask kernel needs at least 2 states, got {num_states}")
        self.schedule = _check_schedule(schedule if schedule is not None else LinearSchedule())

    def __repr__(self) -> str:
        return f"MaskKernel(num_states={self.num_states}, mask_id={self.mask_id}, schedule={self.schedule!r})"

    @property
    def num_uniform_states(self) -> int:
        return max(self.num_states - 1, 1)

    @property
    def has_uniform_noise(self) -> bool:
        return False

    def coefficients(self, t):
        return self.schedule.alpha(t), self.schedule.one_minus_alpha(t), torch.zeros_like(t)

    def rate_coefficients(self, t):
        v = self.schedule.hazard(t)
        return v, torch.zeros_like(v)

    def transition_noise_at(self, ids, coef_t, coef_s):
        beta_t, beta_s = coef_t[1], coef_s[1]
        w = (beta_t - beta_s) / coef_s[0]
        return torch.where(ids == self.mask_id, w, torch.zeros_like(w))


class HybridKernel(InterpolatingKernel):
    """GIDD's mask/uniform mixture, exactly as GIDD defines it (linear base schedule):

    c_t = B (t(1−t))^{γ/2}, B = 2^γ p_u / (1 − p_u), α_t = (1 − t)/(1 + c_t),
    β_t π_t = (t e_mask + c_t u)/(1 + c_t) with u uniform over the non-mask states.

    Forward rates (from the rank-one generator): into the mask state 1/((1−t)(1+c_t)); into a non-mask state
    c_t (γ(1−2t) + 2t) / (2t(1−t)(1+c_t)(S−1)). Both are ≥ 0 for γ ∈ (0, 2]. ``p_uniform = 0`` is the mask kernel;
    the uniform share of the noise peaks at t = 1/2 and the terminal prior is all-mask.
    """

    uniform_over_all = False

    def __init__(self, num_states: int, mask_id: int, p_uniform: float, gamma: float = 1.0) -> None:
        self.num_states = V.check_positive_int("num_states", num_states)
        if num_states < 2:
            raise ValueError(f"num_states: a hybrid kernel needs at least 2 states, got {num_states}")
        V.check_token_id("mask_id", mask_id, num_states)
        for name, val in (("p_uniform", p_uniform), ("gamma", gamma)):
            if isinstance(val, bool) or not isinstance(val, (int, float)):
                raise TypeError(f"{name}: expected a float, got {type(val).__name__}")
        if not 0.0 <= p_uniform < 1.0:
            raise ValueError(f"p_uniform: expected a value in [0, 1), got {p_uniform}")
        if not 0.0 < gamma <= 2.0:
            raise ValueError(f"gamma: expected a value in (0, 2] (forward rates turn negative above 2), got {gamma}")
        self.mask_id = mask_id
        self.p_uniform = float(p_uniform)
        self.gamma = float(gamma)
        self.B = 2.0**self.gamma * self.p_uniform / (1.0 - self.p_uniform)

    def __repr__(self) -> str:
        return (f"HybridKernel(num_states={self.num_states}, mask_id={self.mask_id}, "
                f"p_uniform={self.p_uniform}, gamma={self.gamma})")

    @property
    def has_uniform_noise(self) -> bool:
        return self.B > 0.0

    def _c(self, t: torch.Tensor) -> torch.Tensor:
        return self.B * (t * (1.0 - t)).clamp_min(0.0) ** (self.gamma / 2.0)

    def coefficients(self, t):
        c = self._c(t)
        return (1.0 - t) / (1.0 + c), t / (1.0 + c), c / (1.0 + c)

    def rate_coefficients(self, t):
        c = self._c(t)
        v_mask = 1.0 / ((1.0 - t) * (1.0 + c))
        v_unif = c * (self.gamma * (1.0 - 2.0 * t) + 2.0 * t) / (
            2.0 * t * (1.0 - t) * (1.0 + c) * (self.num_states - 1))
        return v_mask, v_unif


class GeneratorKernel(Kernel):
    """Any CTMC in generator form (Definition 2.2 (1)): R_t = β^rate_t R̄, P_{s,t} = exp((σ(t) − σ(s)) R̄).

    ``generator`` is a dense ``(S, S)`` matrix R̄ with non-negative off-diagonal entries and rows summing to 0.
    Without a schedule the chain is homogeneous (σ(t) = t, β^rate ≡ 1); with a :class:`Schedule` σ(t) = −log α_t and
    β^rate_t = −α_t'/α_t (so the uniform generator 11ᵀ/S − I with a schedule reproduces :class:`UniformKernel`).
    ``mask_id`` optionally names a state that clean data never takes. ``prior`` (``(S,)``) defaults to the
    stationary distribution of R̄. Builds ``(..., S, S)`` matrix exponentials: meant for small S and for testing.
    """

    def __init__(self, generator: torch.Tensor, *, schedule: Schedule | None = None,
                 mask_id: int | None = None, prior: torch.Tensor | None = None) -> None:
        R = V.check_tensor("generator", generator)
        if not R.dtype.is_floating_point:
            raise TypeError(f"generator: expected a floating-point matrix, got dtype {R.dtype}")
        if R.dim() != 2 or R.shape[0] != R.shape[1] or R.shape[0] < 1:
            raise ValueError(f"generator: expected a square (S, S) matrix, got shape {tuple(R.shape)}")
        R64 = R.detach().to(torch.float64)
        off = R64 - torch.diag(torch.diagonal(R64))
        if bool((off < -1e-12).any()):
            raise ValueError("generator: expected non-negative off-diagonal rates, got a negative entry")
        if float(R64.sum(-1).abs().max()) > 1e-8 * max(1.0, float(R64.abs().max())):
            raise ValueError("generator: expected rows summing to 0 (a CTMC generator)")
        self.num_states = R.shape[0]
        self.generator = R64
        self.schedule = _check_schedule(schedule) if schedule is not None else None
        if mask_id is not None:
            if isinstance(mask_id, bool) or not isinstance(mask_id, int) or not 0 <= mask_id < self.num_states:
                raise ValueError(f"mask_id: expected None or an id in [0, {self.num_states}), got {mask_id}")
        self.mask_id = mask_id
        if prior is None:
            prior = self._stationary()
        else:
            prior = V.check_distribution("prior", prior, self.num_states).detach().to(torch.float64)
        self._prior_vec = prior

    def _on(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``self.generator`` (``name="generator"``) or the prior vector (``"prior"``) on ``device`` in ``dtype``,
        copied once and reused (a host-to-GPU copy per sampler step would make the host wait each time); copied again
        when the float64 original is replaced or changed in place (its ``_version``)."""
        source = self.generator if name == "generator" else self._prior_vec
        copies: dict[tuple[str, torch.device, torch.dtype], tuple[torch.Tensor, int, torch.Tensor]] = \
            self.__dict__.setdefault("_copies", {})
        key = (name, device, dtype)
        cached = copies.get(key)
        if cached is None or cached[0] is not source or cached[1] != source._version:
            cached = (source, source._version, source.to(device=device, dtype=dtype))
            copies[key] = cached
        return cached[2]

    def __repr__(self) -> str:
        return f"GeneratorKernel(num_states={self.num_states}, schedule={self.schedule!r}, mask_id={self.mask_id})"

    def _stationary(self) -> torch.Tensor:
        S = self.num_states
        A = torch.cat([self.generator.T, torch.ones(1, S, dtype=torch.float64)], 0)
        rhs = torch.zeros(S + 1, 1, dtype=torch.float64)
        rhs[-1] = 1.0
        pi = torch.linalg.lstsq(A, rhs).solution.squeeze(-1).clamp_min(0.0)
        return pi / pi.sum()

    def integrated_rate(self, t: torch.Tensor) -> torch.Tensor:
        """σ(t): ``t`` for the homogeneous chain, −log α_t with a schedule (P_{0,t} = exp(σ(t) R̄))."""
        return t if self.schedule is None else -self.schedule.log_alpha(t)

    def _beta_rate(self, t: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(t) if self.schedule is None else self.schedule.hazard(t)

    def transition_matrix(self, sigma: torch.Tensor) -> torch.Tensor:
        # the matrix exponential runs in float64 (float32's loses ~1e-5 relative); the result follows sigma's dtype
        R = self._on("generator", sigma.device, torch.float64)
        return torch.linalg.matrix_exp(sigma.to(torch.float64)[..., None, None] * R).to(sigma.dtype)

    def propagate(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        P = self.transition_matrix(self.integrated_rate(t))  # (..., S, S)
        return (p.unsqueeze(-2) @ P).squeeze(-2)

    def transition_column(self, ids: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        P = self.transition_matrix(self.integrated_rate(t) - self.integrated_rate(s))  # (..., S, S) = P_{s,t}
        shape = torch.broadcast_shapes(ids.shape, P.shape[:-2])
        P = P.expand(*shape, self.num_states, self.num_states)
        idx = ids.expand(shape)[..., None, None].expand(*shape, self.num_states, 1)
        return P.gather(-1, idx).squeeze(-1)

    def rate_column(self, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        R = self._on("generator", ids.device, t.dtype)
        col = R.T[ids]  # (..., S): R(i, ids) over sources i
        col = col.scatter(-1, ids.unsqueeze(-1), 0.0)
        return self._beta_rate(t).unsqueeze(-1) * col

    def noise_distribution(self, t, dtype, device):
        pi = self._on("prior", device, dtype)
        return pi if t is None else pi.expand(*t.shape, self.num_states)

    def _sample(self, ids, t, generator):
        q = self.propagate(self._one_hot(ids, t.dtype), t)
        return categorical(q.clamp_min(0.0), 1, generator).reshape(q.shape[:-1])
