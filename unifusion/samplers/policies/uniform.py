"""Decoding for uniform noise: :class:`EntropyBound`, the sampler of transformers' DiffusionGemma
(``models/diffusion_gemma/generation_diffusion_gemma.py``: ``EntropyBoundSampler``,
``LinearTemperatureScheduleLogitsProcessor``, ``StableAndConfidentStoppingCriteria``), after the entropy-bounded
sampler of arXiv:2505.24857.

A block of K positions starts as uniform noise. Step i of at most N (the reference counts the steps left,
c = N − i = N … 1) runs the model on the block and

1. scales the logits by the temperature T_c = t_min + (t_max − t_min) · c / N (t_max at the first step; the last
   step has t_min + (t_max − t_min)/N);
2. draws z_j ~ softmax(logits_j / T_c) at every position (``torch.multinomial``), and takes the argmax a_j;
3. accepts the k lowest-entropy positions, H_(1) ≤ … ≤ H_(k), with Σ_{m<k} H_(m) = Σ_{m≤k} H_(m) − H_(k) ≤ bound
   (the sum minus its largest term: an upper bound on the positions' mutual information; at least one is accepted),
   keeps z_j there and renoises every other position uniformly;
4. stops the block early once it is *stable* (a = the argmax of each of the last ``stability_threshold`` steps) and
   *confident* (the mean entropy of the block < ``confidence_threshold``).

The block's tokens are the argmax a of its last step (the drawn canvas is only what the model sees). Nothing is
committed before the block stops: every step resamples the whole block.

Randomness, in the reference's order (so a shared generator, or the global one, reproduces it): at the start of each
block one ``randint(0, V, (B, K))`` (the canvas); per step one ``exponential_`` of shape ``(B·K, V)`` (inside
``torch.multinomial(probs.view(-1, V), 1)``, which is argmax(probs / q) with q ~ Exp(1)), then one
``randint(0, V, (B, K))`` (the renoising), all with the whole batch's shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...kernels import InterpolatingKernel, Kernel
from .._draws import x0_weights
from .protocol import DecodingPolicy, RowRandomness

__all__ = ["EntropyBound", "EntropyBoundStep", "categorical_entropy", "entropy_bound_step"]


def categorical_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H of softmax(logits) over the last dim, ``(...)``, in the arithmetic of
    ``torch.distributions.Categorical(logits=logits).entropy()`` (bit for bit, without its argument validation,
    which reads the logits back to the host): normalise by logsumexp, clamp at the dtype's lowest finite value,
    −Σ log p · p. Entries at −inf contribute 0."""
    log_p = logits - logits.logsumexp(dim=-1, keepdim=True)
    p = torch.softmax(log_p, dim=-1)
    return -(torch.clamp(log_p, min=torch.finfo(log_p.dtype).min) * p).sum(-1)


def _check_nonnegative(name: str, value: object, *, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float >= 0, got {type(value).__name__}")
    if math.isnan(value) or value < 0 or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name}: expected a {'' if allow_inf else 'finite '}float >= 0, got {value}")
    return float(value)


@dataclass(frozen=True)
class EntropyBoundStep:
    """What :func:`entropy_bound_step` returns, for the ``B`` running rows of the block.

    Attributes:
        canvas: the block's next x_t ``(B, K)``: accepted draws, uniform noise elsewhere (ineligible positions as
            they were).
        argmax: the argmax of the step's scaled logits ``(B, K)``: the block's tokens if it stops here.
        accepted: ``(B, K)`` bool.
        stop: ``(B,)`` bool, whether each row's block is stable and confident.
        history: the stopping criterion's state after this step ``(B, stability_threshold, K)``.
        logits: the logits divided by the step's temperature ``(B, K, V)`` (the reference's self-conditioning input
            for the next step).
    """

    canvas: torch.Tensor
    argmax: torch.Tensor
    accepted: torch.Tensor
    stop: torch.Tensor
    history: torch.Tensor
    logits: torch.Tensor


class EntropyBound(DecodingPolicy):
    """DiffusionGemma's entropy-bound sampler for uniform noise (see the module docstring for the algorithm and the
    exact order of random draws); the defaults are its generation defaults.

    Args:
        bound: the entropy bound in nats, ≥ 0 (``inf`` accepts every position: one-step decoding).
        t_max: the first step's temperature (> 0).
        t_min: the temperature the schedule heads to, in [0, t_max] (equal to ``t_max``: a constant temperature; the
            reference requires t_max > t_min).
        stability_threshold: steps over which the argmax must not change before a block may stop (0: always stable).
        confidence_threshold: a block stops once its mean entropy falls below this (> 0); ``None`` never stops early
            (every block takes ``num_steps`` steps).
        reach_t_min: ``False`` (the reference's schedule): T_c = t_min + (t_max − t_min) · c / N for c = N … 1, so the
            last step has t_min + (t_max − t_min)/N; ``True``: T_c = t_min + (t_max − t_min) · (c − 1)/(N − 1), from
            t_max at the first step to t_min at the last (t_max when N = 1).

    Used with :class:`~unifusion.samplers.PolicySampler` and a :class:`~unifusion.UniformKernel`: ``num_steps`` is
    the reference's ``max_denoising_steps`` and ``block_size`` its ``canvas_length``; the sampler's ``temperature``
    multiplies the schedule (1 reproduces it), top-k/top-p (which the reference lacks) truncate x_θ before the
    draws, the entropies and the argmax. Differences from the reference: positions of a block that a prompt keeps
    (a prompt ending mid-block) are never accepted, renoised or counted in the entropy sum and mean; bad thresholds
    raise ``ValueError`` (the reference: ``AttributeError``).
    """

    family = "uniform"
    fixed_count = False

    def __init__(self, bound: float, *, t_max: float = 0.8, t_min: float = 0.4, stability_threshold: int = 1,
                 confidence_threshold: float | None = 0.005, reach_t_min: bool = False) -> None:
        self.bound = _check_nonnegative("bound", bound, allow_inf=True)
        self.t_max = _check_nonnegative("t_max", t_max)
        self.t_min = _check_nonnegative("t_min", t_min)
        if self.t_max <= 0.0:
            raise ValueError(f"t_max: expected a temperature > 0, got {t_max}")
        if self.t_min > self.t_max:
            raise ValueError(f"t_min: expected at most t_max = {t_max}, got {t_min}")
        if isinstance(stability_threshold, bool) or not isinstance(stability_threshold, int):
            raise TypeError(f"stability_threshold: expected an int >= 0, got {type(stability_threshold).__name__}")
        if stability_threshold < 0:
            raise ValueError(f"stability_threshold: expected an int >= 0, got {stability_threshold}")
        self.stability_threshold = stability_threshold
        if confidence_threshold is not None:
            confidence_threshold = _check_nonnegative("confidence_threshold", confidence_threshold)
            if confidence_threshold <= 0.0:
                raise ValueError(f"confidence_threshold: expected a float > 0 or None, got {confidence_threshold}")
        self.confidence_threshold = confidence_threshold
        if not isinstance(reach_t_min, bool):
            raise TypeError(f"reach_t_min: expected a bool, got {type(reach_t_min).__name__}")
        self.reach_t_min = reach_t_min

    def __repr__(self) -> str:
        return (f"EntropyBound(bound={self.bound}, t_max={self.t_max}, t_min={self.t_min}, "
                f"stability_threshold={self.stability_threshold}, confidence_threshold={self.confidence_threshold}"
                + (", reach_t_min=True)" if self.reach_t_min else ")"))

    def check_kernel(self, kernel: Kernel) -> None:
        if not isinstance(kernel, InterpolatingKernel) or kernel.mask_id is not None:
            hint = ("use a mask policy (LowConfidence, ConfidenceThreshold, ...) for a mask kernel"
                    if isinstance(kernel, InterpolatingKernel) and not kernel.has_uniform_noise
                    else "use BayesianSampler for this kernel")
            raise ValueError(f"policy: EntropyBound renoises positions uniformly and needs a uniform kernel "
                             f"(UniformKernel, no mask state), got {type(kernel).__name__} ({hint})")

    def temperatures(self, num_steps: int, device: torch.device) -> torch.Tensor:
        """The schedule T_c = t_min + (t_max − t_min) · c / N for c = N, N − 1, …, 1 (steps 0 … N − 1), ``(N,)``
        float32 on ``device``, with the reference's arithmetic (int32 c divided by N, then float32 operations), so the
        scaled logits match it bit for bit. Built on the device (no host data copied). With ``reach_t_min``:
        c − 1 over N − 1 instead (t_max, …, t_min)."""
        c = torch.arange(num_steps, 0, -1, dtype=torch.int32, device=device)
        if self.reach_t_min:
            c, num_steps = c - 1, max(num_steps - 1, 1)
            if c.numel() == 1:
                c = c + 1  # one step: t_max
        return self.t_min + ((self.t_max - self.t_min) * (c / num_steps))

    def temperature_at(self, step: int, num_steps: int, device: torch.device) -> torch.Tensor:
        """T at step ``step`` (0-based) of ``num_steps``, a 0-d float32 tensor on ``device`` (:meth:`temperatures`;
        dividing by a device tensor, not a host scalar, matters on CUDA: a host scalar divisor becomes a multiply by
        its reciprocal, one bit off the reference's division)."""
        return self.temperatures(num_steps, device)[step]

    def accept(self, entropy: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
        """The accepted positions ``(B, K)`` bool: the eligible positions of lowest entropy, in ascending order, while
        the sum of the entropies before each stays ≤ ``bound``; at least the lowest one (rows with an eligible
        position). Ineligible positions sort last and are never accepted. Ties: ``torch.sort``'s order, as the
        reference."""
        key = entropy.masked_fill(~eligible, torch.inf)
        sorted_h, order = torch.sort(key, dim=-1, descending=False)
        finite = torch.isfinite(sorted_h)
        sorted_h = torch.where(finite, sorted_h, torch.zeros_like(sorted_h))
        before = torch.cumsum(sorted_h, dim=-1) - sorted_h  # Σ of the lower entropies: the sum minus its largest term
        keep = (before <= self.bound) & finite
        return torch.zeros_like(keep).scatter(-1, order, keep)

    def initial_history(self, batch_size: int, block_size: int, device: torch.device) -> torch.Tensor:
        """The stopping criterion's state at the start of a block: ``(B, stability_threshold, K)`` filled with −1
        (no token id)."""
        return torch.full((batch_size, self.stability_threshold, block_size), -1, dtype=torch.long, device=device)

    def stop(self, history: torch.Tensor, argmax: torch.Tensor, entropy: torch.Tensor, eligible: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(stop (B,), history)``: stable (``argmax`` equals each of the last ``stability_threshold`` argmaxes at
        the eligible positions) and confident (mean eligible entropy < ``confidence_threshold``); ``history`` with
        ``argmax`` pushed in."""
        if self.confidence_threshold is None:
            stop = torch.zeros(argmax.shape[0], dtype=torch.bool, device=argmax.device)
        else:
            same = (history == argmax.unsqueeze(1)) | ~eligible.unsqueeze(1)
            stable = same.all(-1).all(-1)
            mean = torch.where(eligible, entropy, torch.zeros_like(entropy)).sum(-1) / eligible.sum(-1)
            stop = stable & (mean < self.confidence_threshold)
        if self.stability_threshold > 0:
            history = torch.cat([history[:, 1:], argmax.unsqueeze(1)], dim=1)
        return stop, history


def entropy_bound_step(policy: EntropyBound, logits: torch.Tensor, canvas: torch.Tensor, eligible: torch.Tensor,
                       history: torch.Tensor, randomness: RowRandomness, *, step: int, num_steps: int,
                       temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
                       ) -> EntropyBoundStep:
    """Step ``step`` (0-based, of ``num_steps``) of :class:`EntropyBound` on a block.

    Args:
        logits: the model's x0 logits at the block's positions ``(B, K, V)`` (half precision is upcast).
        canvas: the block's current tokens ``(B, K)``.
        eligible: ``(B, K)`` bool, the positions being generated (False at prompt positions and past the sequence).
        history: the stopping state (:meth:`EntropyBound.initial_history`, then the previous step's).
        randomness: consumes an Exp(1) draw ``(B, K, V)``, then ``randint(0, V, (B, K))``.
        temperature: multiplies the schedule's temperature.
    """
    B, K, V = logits.shape
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    T = policy.temperature_at(step, num_steps, logits.device)
    if temperature != 1.0:
        T = T * temperature
    scaled = logits / T
    if top_k is not None or top_p is not None:
        kept = x0_weights(scaled, torch.empty((B, K, V), dtype=torch.float32, device=logits.device), mask_id=None,
                          top_k=top_k, top_p=top_p)
        scaled = scaled.masked_fill(kept == 0, -torch.inf)
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    draw = (probs / randomness.exponential((K, V), logits.device)).argmax(-1)  # torch.multinomial's one draw
    argmax = scaled.argmax(-1)
    entropy = categorical_entropy(scaled)
    accepted = policy.accept(entropy, eligible)
    noise = randomness.randint(V, (K,), logits.device)
    new_canvas = torch.where(eligible, torch.where(accepted, draw, noise), canvas)
    stop, history = policy.stop(history, argmax, entropy, eligible)
    return EntropyBoundStep(canvas=new_canvas, argmax=argmax, accepted=accepted, stop=stop, history=history,
                            logits=scaled)
