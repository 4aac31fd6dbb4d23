"""Native samplers: τ-leaping (Euler) steps on the reverse rates a parameterization induces (paper §2, Theorem 3.3).

A model returns its head in one of four parameterizations, turned into a :class:`~unifusion.ReverseRate` row
R̂_t(x_t, ·) by the matching constructor:

================  ====================================================  =====================================
parameterization  model output                                          constructor
================  ====================================================  =====================================
``"x0"``          x0 logits ``(B, L, S)`` (mask entry ignored)          ``ReverseRate.from_x0_logits``
``"sedd"``        log concrete score log s_θ ``(B, L, S)``              ``ReverseRate.from_score(exp(·))``
``"m2s"``         logits of the posterior mean μ ``(B, L, S)``          ``ReverseRate.from_posterior_mean``
``"ctmc"``        ``(log λ (B, L), jump logits (B, L, S))``             ``ReverseRate.from_exit_jump``
================  ====================================================  =====================================

(entries at x_t of the score and jump logits are ignored; μ and the jump distribution are softmaxes with the mask
state, resp. x_t, excluded.)

**Euler step** from t to s = t − Δt, per position: jump to i ≠ x_t with probability Δt R̂_t(x_t, i), stay with
1 − Δt λ. When Δt λ > 1 the jump probabilities are divided by Δt λ and the stay probability is 0 (clamped and
renormalised), which happens near t = 1 for kernels whose rates blow up there.

**Final step.** With t_n = (1 − ε)(1 − n/N), the sampler takes N − 1 Euler steps t_0 → … → t_{N−1} and then one
denoising step t_{N−1} → 0 (N model calls in all): it recovers the clean-token distribution p_0 that the head implies
at x_t and draws from the exact posterior p(x_0 = a | x_t) ∝ q_{t|0}(x_t | a) p_0(a) (Algorithm 2's last step). For
``"x0"`` p_0 = x_θ (MDLM/GIDD's final step); for ``"sedd"`` p_0 = (q_t − m_t Σq_t)/α_t with q_t ∝ s_θ, i.e. the
forward marginal inverted (SEDD's Tweedie denoiser, ``staggered_score × transition``); for ``"ctmc"`` the score is
read off the rates, s(i) = λ r(i)/R_t(i, x_t), then as SEDD; for ``"m2s"`` p_0 ∝ μ/q_{t|0}(x_t|·) on the states that
reach x_t. ``final_step="argmax"`` takes the most likely token of that posterior instead of a draw. The step is the
kernel's posterior from t to s = 0, so it is the clean-token posterior above exactly when α_0 = 1; with a schedule
whose α_0 < 1 (:class:`~unifusion.GeometricSchedule`: α_0 = e^{−σ_min}) it draws the time-0 state of the forward
process, which keeps that residual noise (SEDD's own denoiser removes it by going to σ = 0; see "Coming from a peer").

Example::

    sedd_model = uf.samplers.x0_model_as(model, kernel, "sedd")       # any x0 model as a SEDD head
    sampler = uf.EulerSampler(sedd_model, kernel, 128, parameterization="sedd")
    tokens = sampler.sample(8, 256, generator=g)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _validation as V
from .._math import safe_log
from ..conversions import convert_x0_to
from ..denoiser import ConvertedHead
from ..kernels import GeneratorKernel, InterpolatingKernel, Kernel, check_kernel
from ..rates import ReverseRate, x0_log_probs
from ._draws import BLOCK_SIZE, Generators, sample_weights, x0_weights
from ._setup import (
    ModelFn,
    apply_prompt,
    check_eps,
    check_head_shape,
    check_model,
    check_sampling_options,
    start_run,
)
from ._step import bayesian_step, posterior_mixture, uniforms

__all__ = ["EulerSampler", "PARAMETERIZATIONS", "ConvertedModel", "x0_model_as", "reverse_rate_from_head",
           "euler_step_probs", "clean_distribution_from_head"]

PARAMETERIZATIONS = ("x0", "sedd", "m2s", "ctmc")

Callback = Callable[[int, float, torch.Tensor], object]


def _check_parameterization(parameterization: object) -> str:
    if not isinstance(parameterization, str) or parameterization not in PARAMETERIZATIONS:
        raise ValueError(f"parameterization: expected one of {PARAMETERIZATIONS}, got {parameterization!r}")
    return parameterization


def _masked_softmax(logits: torch.Tensor, exclude: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim with ``exclude`` (ids ``(...)``) removed; all-(−inf) rows give all zeros."""
    if exclude is not None:
        logits = logits.scatter(-1, exclude.unsqueeze(-1), float("-inf"))
    lse = torch.logsumexp(logits, -1, keepdim=True)
    finite = torch.isfinite(lse)
    return torch.where(finite, torch.exp(logits - torch.where(finite, lse, torch.zeros_like(lse))),
                       torch.zeros_like(logits))


# ----------------------------------------------------------------------------------------------------------------
# pure functions


def reverse_rate_from_head(parameterization: str, head: Any, kernel: Kernel, x_t: torch.Tensor,
                           t: torch.Tensor | float) -> ReverseRate:
    """The reverse-rate rows R̂_t(x_t, ·) ``(B, L, S)`` a head induces (table in the module docstring).

    ``t`` follows the package's time rule against ``x_t`` (a float, 0-d, ``(B,)`` = one time per row, ``(B, 1)``,
    ``(B, L)``); the computation dtype is float64 when ``t`` or the head is float64.
    """
    parameterization = _check_parameterization(parameterization)
    t_dtype = t if isinstance(t, torch.Tensor) else None  # a float t does not raise the computation dtype
    if parameterization == "x0":
        return ReverseRate.from_x0_logits(kernel, head, x_t, t)
    if parameterization == "sedd":
        return ReverseRate.from_score(kernel, torch.exp(head), x_t, t)
    if parameterization == "m2s":
        dtype = V.compute_dtype(head, t_dtype)
        mu = torch.softmax(x0_log_probs(kernel, head.to(dtype)), -1)
        return ReverseRate.from_posterior_mean(kernel, mu, x_t, t)
    log_exit_rate, jump_logits = head
    dtype = V.compute_dtype(jump_logits, t_dtype)
    jump = _masked_softmax(jump_logits.to(dtype), x_t)
    return ReverseRate.from_exit_jump(torch.exp(log_exit_rate.to(dtype)), jump, x_t)


def euler_step_probs(rates: torch.Tensor, x_t: torch.Tensor, dt: torch.Tensor | float) -> torch.Tensor:
    """τ-leaping transition probabilities ``(..., S)`` from off-diagonal rates ``(..., S)`` (0 at x_t) over ``dt``.

    P(i) = Δt R̂(x_t, i) for i ≠ x_t and P(x_t) = 1 − Δt λ; if Δt λ > 1 the jumps are scaled by 1/(Δt λ), stay = 0.
    """
    jump = rates * dt
    exit_prob = jump.sum(-1, keepdim=True)
    over = exit_prob > 1.0
    jump = torch.where(over, jump / torch.where(over, exit_prob, torch.ones_like(exit_prob)), jump)
    stay = (1.0 - exit_prob).clamp_min(0.0)
    return jump.scatter(-1, x_t.unsqueeze(-1), stay)


def _clean_from_marginal(kernel: Kernel, q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Invert the forward marginal: p_0 with q ∝ p_0 P_t, for non-negative ``q`` ``(..., S)`` (unnormalised ok)."""
    if isinstance(kernel, InterpolatingKernel):
        alpha, a, b = kernel.coefficients(t)
        m_t = kernel.noise_vector(a, b)  # (..., S); α_t + Σ m_t = 1 so Σ p_0 = Σ q
        p0 = (q - m_t * q.sum(-1, keepdim=True)) / alpha.unsqueeze(-1)
    elif isinstance(kernel, GeneratorKernel):
        # (S, S), or (..., S, S) for times per row / position
        P = kernel.transition_matrix(kernel.integrated_rate(t)).to(q.dtype)
        # p0 P = q for each position; solve_ex skips solve's check of ``info`` (a host read): P = exp(σ R̄) is
        # invertible for every σ
        p0 = torch.linalg.solve_ex(P, q.unsqueeze(-2), left=False)[0].squeeze(-2)
    else:  # pragma: no cover - only the two kernel families exist
        raise TypeError(f"kernel: cannot invert the marginal of {type(kernel).__name__}")
    p0 = p0.clamp_min(0.0)
    if kernel.mask_id is not None:
        p0[..., kernel.mask_id] = 0.0
    return p0


def clean_distribution_from_head(parameterization: str, head: Any, kernel: Kernel, x_t: torch.Tensor,
                                 t: torch.Tensor | float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unnormalised p_0 ``(B, L, S)`` that a head implies at x_t and time ``t`` (module docstring, final step).

    ``t`` follows the package's time rule against ``x_t`` (a float, 0-d, ``(B,)`` = one time per row, ``(B, 1)``,
    ``(B, L)``); the arithmetic runs in ``dtype``.
    """
    parameterization = _check_parameterization(parameterization)
    x_t = V.check_token_ids("x_t", x_t, kernel.num_states)
    t = V.check_time("t", t, device=x_t.device, dtype=dtype, shape=x_t.shape)
    if parameterization == "x0":
        return torch.exp(x0_log_probs(kernel, head.to(dtype)))
    if parameterization == "m2s":
        mu = torch.exp(x0_log_probs(kernel, head.to(dtype)))
        col = kernel.transition_column(x_t, torch.zeros_like(t), t)  # q_{t|0}(x_t | a), (B, L, S)
        reach = col > 0
        return torch.where(reach, mu / torch.where(reach, col, torch.ones_like(col)), torch.zeros_like(mu))
    if parameterization == "sedd":
        score = torch.exp(head.to(dtype))
    else:
        rate = reverse_rate_from_head("ctmc", head, kernel, x_t, t)
        R = kernel.rate_column(x_t, t).to(dtype)  # R_t(i, x_t)
        score = torch.where(R > 0, rate.rates.to(dtype) / torch.where(R > 0, R, torch.ones_like(R)),
                            torch.zeros_like(R))
    score = score.scatter(-1, x_t.unsqueeze(-1), 1.0)  # s(x_t) = q_t(x_t)/q_t(x_t)
    return _clean_from_marginal(kernel, score, t)


def final_step(p0: torch.Tensor, x_t: torch.Tensor, kernel: Kernel, t: torch.Tensor,
               generator: Generators, *, argmax: bool = False) -> torch.Tensor:
    """x_0 ~ p(x_0 | x_t) ∝ q_{t|0}(x_t|·) p_0 (or its argmax); rows where p_0 is all zero keep x_t."""
    total = p0.sum(-1)
    s = torch.zeros_like(t)
    if argmax:
        p = p0 / total.clamp_min(torch.finfo(p0.dtype).tiny).unsqueeze(-1)
        post = (posterior_mixture(kernel, p, x_t, t, s) if isinstance(kernel, InterpolatingKernel)
                else kernel.posterior_from_probs(p, x_t, s, t))
        x_0 = post.argmax(-1)
    else:
        x_0 = bayesian_step(p0, x_t, kernel, t, s, generator, block_size=BLOCK_SIZE)
    return torch.where(total > 0, x_0, x_t)


class ConvertedModel(ConvertedHead):
    """An x0 model that returns the head of another parameterization (what :func:`x0_model_as` builds).

    Calling it maps ``(x_t (B, L), t)`` to the head (see :func:`x0_model_as`). It carries what it converts with —
    ``model`` (the x0 model), ``kernel``, ``parameterization``, ``dtype`` — and the tag
    :data:`~unifusion._validation.HEAD_ATTRIBUTE` (``unifusion_parameterization``), so the samplers and evaluators
    refuse it where they would read its output as another head (or under another kernel). ``parameters()`` and
    ``num_states`` are the wrapped model's, so devices and state counts are checked as for that model.
    """

    def __init__(self, model: ModelFn, kernel: Kernel, parameterization: str, dtype: torch.dtype) -> None:
        self.model, self.kernel, self.parameterization, self.dtype = model, kernel, parameterization, dtype

    @property
    def unifusion_parameterization(self) -> str:
        """What calling this returns (:data:`unifusion._validation.HEAD_ATTRIBUTE`)."""
        return self.parameterization

    @property
    def num_states(self) -> int:
        return self.kernel.num_states

    def parameters(self, recurse: bool = True) -> Any:
        """The wrapped model's parameters (none for a plain callable)."""
        parameters = getattr(self.model, "parameters", None)
        return parameters() if callable(parameters) else iter(())

    def __repr__(self) -> str:
        return (f"x0_model_as({type(self.model).__name__}, {self.kernel!r}, {self.parameterization!r}, "
                f"dtype={self.dtype})")

    def __call__(self, x_t: torch.Tensor, t: torch.Tensor | float) -> Any:
        x_t = V.check_token_batch("x_t", x_t)
        V.check_model_device(self.model, "x_t", x_t)  # device metadata only: no sync
        kernel, dtype = self.kernel, self.dtype
        with V.batched_checks():
            t_row = V.check_sequence_times("t", t, x_t.shape, device=x_t.device)  # (B,), the caller's float dtype
        logits = self.model(x_t, t_row)
        if self.parameterization == "x0":
            return logits
        p = torch.exp(x0_log_probs(kernel, logits.to(dtype)))  # x_θ, 0 on the mask state
        t_ = t_row.to(dtype)[:, None]  # (B, 1) against x_t (B, L): one time per row
        if self.parameterization == "sedd":
            return safe_log(convert_x0_to("sedd", p, kernel, x_t, t_))
        if self.parameterization == "m2s":
            return safe_log(convert_x0_to("m2s", p, kernel, x_t, t_, strict=False))
        exit_rate, jump = convert_x0_to("ctmc", p, kernel, x_t, t_)
        return safe_log(exit_rate), safe_log(jump)


def x0_model_as(model: ModelFn, kernel: Kernel, parameterization: str, *,
                dtype: torch.dtype = torch.float32) -> ConvertedModel:
    """Wrap an x0 model so it returns the head of another parameterization, by :func:`unifusion.convert_x0_to`.

    The result maps ``(x_t (B, L), t)`` to ``"sedd"``: log score ``(B, L, S)``; ``"m2s"``: log μ ``(B, L, S)``
    (μ = e_{x_t} where x_t is unreachable from some clean state, ``strict=False``); ``"ctmc"``: ``(log λ (B, L),
    log r (B, L, S))``; ``"x0"``: the logits unchanged. ``t`` is one time per sequence by the package's time rule: a
    float, a 0-d tensor, ``(B,)`` or ``(B, 1)`` (a 1-D ``t`` is one time per row also when B == L); the wrapped model
    is called with ``t`` as ``(B,)``. Conversions run in ``dtype``. Their induced reverse rates equal the x0 head's
    (Theorem 3.5), so :class:`EulerSampler` gives the same samples for all four.

    The kernel must fit the model: for a :class:`~unifusion.DiffusionLM`, the same number of states and, for mask and
    hybrid kernels, its mask token (a ``ValueError`` naming both ids otherwise), checked here once. ``model`` must
    return x0 logits (wrapping a wrapper of another parameterization is a ``ValueError``). ``x_t`` must be on the
    model's device (a ``ValueError`` naming ``x_t`` otherwise).

    The result is a :class:`ConvertedModel` tagged with its parameterization: :class:`EulerSampler` takes it only
    with the same ``parameterization=`` and ``kernel``; :class:`~unifusion.BayesianSampler`, the evaluators and
    :func:`~unifusion.diffusion_loss`, which read x0 logits, refuse it unless ``parameterization="x0"``.
    """
    model = check_model(model)
    kernel = check_kernel(kernel)
    parameterization = _check_parameterization(parameterization)
    dtype = V.check_compute_dtype(dtype)
    V.check_model_kernel(model, kernel, who="x0_model_as")
    return ConvertedModel(model, kernel, parameterization, dtype)


# ----------------------------------------------------------------------------------------------------------------
# the sampler


class EulerSampler:
    """τ-leaping on the reverse rates of an x0, SEDD, M2S or Neural-CTMC head (module docstring for the details).

    Args:
        model: callable ``(x_t (B, L) int64, t (B,) float) → head`` in ``parameterization`` (see the table above).
        kernel: the forward kernel.
        num_steps: N ≥ 1 model calls: N − 1 Euler steps on t_n = (1 − ε)(1 − n/N), then the denoising step to 0.
        parameterization: ``"x0"``, ``"sedd"``, ``"m2s"`` or ``"ctmc"``.
        eps: ε in (0, 1).
        temperature: as :class:`BayesianSampler`, for ``parameterization="x0"`` only.
        top_k: as :class:`BayesianSampler` (x0 only).
        top_p: as :class:`BayesianSampler` (x0 only).
        dtype: ``torch.float32`` or ``torch.float64`` for the rate arithmetic.
        final_step: ``"sample"`` (default) draws the last step from the posterior; ``"argmax"`` takes its mode.

    Arguments, the prompt and the first model output are validated once per :meth:`sample` call; the steps run with
    validation off, so none synchronises with the device. A :class:`~unifusion.DiffusionLM` outputs x0 logits: other
    parameterizations need it wrapped by :func:`x0_model_as`. Randomness as :class:`BayesianSampler`: one generator,
    or one per row (row b then equals a batch of one sampled with ``generator[b]``).
    """

    def __init__(self, model: ModelFn, kernel: Kernel, num_steps: int, *, parameterization: str = "x0",
                 eps: float = 1e-3, temperature: float = 1.0, top_p: float | None = None, top_k: int | None = None,
                 dtype: torch.dtype = torch.float32, final_step: str = "sample") -> None:
        self.model = check_model(model)
        self.kernel = check_kernel(kernel)
        self.num_steps = V.check_positive_int("num_steps", num_steps)
        self.parameterization = _check_parameterization(parameterization)
        self.eps = check_eps(eps)
        self.temperature, self.top_k, self.top_p = check_sampling_options(temperature, top_k, top_p,
                                                                          self.kernel.num_states)
        if parameterization != "x0":
            for name, value, default in (("temperature", self.temperature, 1.0), ("top_k", self.top_k, None),
                                         ("top_p", self.top_p, None)):
                if value != default:
                    raise ValueError(f"{name}: only supported with parameterization='x0' (it acts on x0 logits), "
                                     f"got {name}={value} with parameterization={parameterization!r}")
        self.dtype = V.check_compute_dtype(dtype)
        if self.parameterization != "x0" and V.is_diffusion_lm(model):
            raise ValueError(f"parameterization: a DiffusionLM outputs x0 logits, got parameterization="
                             f"{self.parameterization!r}; use parameterization='x0', or sample its "
                             f"{self.parameterization} head with uf.samplers.x0_model_as(model, kernel, "
                             f"{self.parameterization!r})")
        V.check_model_kernel(model, self.kernel, parameterization=self.parameterization, who="EulerSampler",
                             argument=True)
        if final_step not in ("sample", "argmax"):
            raise ValueError(f"final_step: expected 'sample' or 'argmax', got {final_step!r}")
        self.final_step = final_step

    def __repr__(self) -> str:
        return (f"EulerSampler(kernel={self.kernel!r}, num_steps={self.num_steps}, "
                f"parameterization={self.parameterization!r}, eps={self.eps}, dtype={self.dtype})")

    def _check_head(self, head: Any, B: int, L: int) -> Any:
        S = self.kernel.num_states
        if self.parameterization == "ctmc":
            if not (isinstance(head, (tuple, list)) and len(head) == 2):
                raise TypeError("model: expected parameterization='ctmc' heads as a pair (log_exit_rate (B, L), "
                                f"jump_logits (B, L, num_states)), got {type(head).__name__}")
            log_exit, jump = head
            if not isinstance(log_exit, torch.Tensor) or tuple(log_exit.shape) != (B, L):
                shape = tuple(log_exit.shape) if isinstance(log_exit, torch.Tensor) else type(log_exit).__name__
                raise ValueError(f"model: expected log_exit_rate of shape ({B}, {L}), got {shape}")
            check_head_shape("model", jump, B, L, S, what="jump logits")
            return head
        what = {"x0": "x0 logits", "sedd": "log scores", "m2s": "posterior-mean logits"}[self.parameterization]
        return check_head_shape("model", head, B, L, S, what=what)

    def _x0_logits(self, head: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
        """Temperature / top-k / top-p applied to x0 logits, returned as log-weights (−inf where filtered)."""
        if self.temperature == 1.0 and self.top_k is None and self.top_p is None:
            return head
        w = x0_weights(head, workspace, mask_id=self.kernel.mask_id, temperature=self.temperature,
                       top_k=self.top_k, top_p=self.top_p)
        return safe_log(w)

    def sample(self, batch_size: int, seq_len: int, *, prompt: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
               | None = None, generator: torch.Generator | Sequence[torch.Generator] | None = None,
               progress: bool = False, callback: Callback | None = None,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Generate ``(batch_size, seq_len)`` int64 token ids; arguments as :meth:`BayesianSampler.sample` (per-row
        generators: each row draws its prior, a ``(1, L, 2)`` uniform per Euler step and the final step's draws)."""
        run = start_run(self, batch_size, seq_len, prompt, generator, progress, callback, device)
        B, L, dev, kept, ts, t_host, x = run.B, run.L, run.device, run.kept, run.ts, run.t_host, run.x
        generator = run.generator  # checked: None, one generator, or a tuple of B
        kernel, N, dtype = self.kernel, self.num_steps, self.dtype
        S = kernel.num_states
        workspace: torch.Tensor | None = None
        with torch.no_grad():
            for n in run.steps:
                t = ts[n]
                with V.unchecked():  # the sampler's own tokens and times: valid by construction
                    head = self.model(x, t.expand(B))
                head = self._check_head(head, B, L)
                if n == 0:  # the run's one value check of the model output (both parts of a CTMC head at once)
                    with V.batched_checks():
                        for h in head if isinstance(head, (tuple, list)) else (head,):
                            V.check_finite("model output", h)
                if self.parameterization == "x0":
                    if workspace is None:
                        workspace = torch.empty((B, L, S), dtype=dtype, device=dev)
                    head = self._x0_logits(head, workspace)
                if n < N - 1:
                    with V.unchecked():  # no per-step host syncs (the head was checked at the first step)
                        rate = reverse_rate_from_head(self.parameterization, head, kernel, x, t)
                    probs = euler_step_probs(rate.rates.to(dtype), x, t - ts[n + 1])
                    u = uniforms((B, L, 2), generator, dev, dtype)
                    x_new = sample_weights(probs, u, block_size=BLOCK_SIZE)[0]
                else:
                    with V.unchecked():
                        p0 = clean_distribution_from_head(self.parameterization, head, kernel, x, t, dtype)
                    x_new = final_step(p0, x, kernel, t, generator, argmax=self.final_step == "argmax")
                x = apply_prompt(x_new, kept)
                if callback is not None and callback(n + 1, t_host[n + 1], x) is True:
                    break
        return x
