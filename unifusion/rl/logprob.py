"""``sequence_logprob``: log p_θ(completion | prompt) of any unifusion model, by the estimator an RL method needs.

Every pass runs through the model's own ``forward`` with its fused output head and loss
(:func:`unifusion.losses.fused_linear_diffusion_loss`), so no ``(B, L, V)`` logits are held — a 262k vocabulary
fits — and DDP / FSDP hooks fire. The masks, times and weights of the mask-kernel estimators are
:func:`~unifusion.rl.estimators.plan_masks`'s; ``"elbo"`` draws corruptions from the kernel, like
:func:`unifusion.eval.nll_bound`, whose conditional bound it estimates (``E[elbo] = −nll_bound(..., prompt_mask=,
per_token=False)``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import _validation as V
from ..block_partition import (
    aligning_shifts,
    block_origin_of,
    expand_block_times,
    generated_start,
    num_blocks,
    origin_columns,
    shift_left,
    shift_right,
)
from ..denoiser import Denoiser, X0Model, denoiser_of, prompt_conditioning
from ..eval.likelihood import prior_kl
from ..kernels import MAX_TIME, Kernel, MaskKernel, check_kernel
from ..schedules import LinearSchedule
from .estimators import ESTIMATORS, MaskPlan, TracePlan, combine_logps, plan_masks, plan_trace, row_generators

__all__ = ["SequenceLogProb", "check_estimator", "sequence_logprob"]

_DEFAULTS: dict[str, dict[str, Any]] = {
    "elbo": {"t_min": 0.0},
    "elbo_discrete": {},
    "coupled": {"t_range": (0.0, 1.0), "fully_masked": False},
    "quadrature": {"masks": "exact_count", "draws": 1},
    "mean_field": {"prompt_mask_prob": 0.15},
    "eubo": {"eubo_beta": 1.5},
    "trace": {"temperature": 1.0},
}
"""Each estimator's options (``sequence_logprob``'s ``**options``) and their defaults; ``"trace"`` also takes
``trace`` (required)."""

_OPTIONS = {name: set(defaults) | ({"trace"} if name == "trace" else set()) for name, defaults in _DEFAULTS.items()}


@dataclass
class SequenceLogProb:
    """What :func:`sequence_logprob` returns.

    Attributes:
        sequence: ``(B,)`` the estimate of ``log p_θ(completion | prompt)`` in nats, ``per_token.sum(-1)``.
        per_token: ``(B, L)`` each completion token's share (0 outside ``completion_mask``); float32 (float64 for a
            float64 model).
        num_forwards: model passes over the batch the estimate cost.
    """

    sequence: torch.Tensor
    per_token: torch.Tensor
    num_forwards: int


def _resolve(model: X0Model) -> Denoiser:
    """The :class:`~unifusion.denoiser.Denoiser` inside ``model``'s wrappers (any kind): what the checks, the
    defaults and the estimators read of the model (its states, mask token, kernel, block size, clean stream and prompt
    rule). A ``TypeError`` naming ``model`` for anything else."""
    inner = denoiser_of(model)
    if inner is None:
        raise TypeError(f"model: expected a unifusion model (a Denoiser: DiffusionLM, DiffusionGemmaLM, ...) whose "
                        f"forward computes the fused loss, got {type(V.unwrap_model(model)).__name__}")
    return inner


def _multi_block(inner: Denoiser, length: int) -> int | None:
    """The model's block size when a row of ``length`` columns spans more than one block, else ``None``."""
    K = inner.block_size
    return None if K is None or K >= length else int(K)


@dataclass(frozen=True)
class _Batch:
    """A checked batch (:func:`_check_batch`): clean tokens, scored tokens, real tokens and the attention mask as
    given (on the tokens' device)."""

    x0: torch.Tensor
    completion: torch.Tensor
    valid: torch.Tensor
    attention_mask: torch.Tensor | None


def check_estimator(model: X0Model, estimator: str, *, kernel: Kernel | None = None, traces: bool = True) -> Kernel:
    """Whether ``model`` takes ``estimator`` (the checks :func:`sequence_logprob` runs before it reads a batch, for a
    trainer or a script to run before its first rollout); returns the kernel the estimator scores under.

    * ``model``: a unifusion model (a :class:`~unifusion.denoiser.Denoiser` inside its wrappers, of any kind);
    * ``estimator``: one of :data:`~unifusion.rl.estimators.ESTIMATORS`; the mask estimators (all but ``"elbo"``)
      need a :class:`~unifusion.MaskKernel`; a block model (``block_size`` set) and a model that encodes the prompt
      (``conditions_on_prompt``) take ``"elbo"`` (a block model also ``"trace"``);
    * ``traces=False``: the caller has no decoder traces to give, so ``"trace"`` is refused.

    Args:
        model: the policy (possibly inside DDP / FSDP / compile wrappers).
        estimator: the estimator's name.
        kernel: the forward kernel; default the model's (``model.kernel``) or a mask kernel on its mask token.
        traces: whether ``trace=`` commit steps will be passed.

    Raises:
        TypeError: ``model`` is not a unifusion model.
        ValueError: naming ``estimator`` (or ``kernel``) when the model or kernel cannot take it.
    """
    return _check_estimator(_resolve(model), estimator, kernel, traces)


def _check_estimator(inner: Denoiser, estimator: str, kernel: Kernel | None, traces: bool) -> Kernel:
    """:func:`check_estimator` on the resolved model."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: expected one of {ESTIMATORS}, got {estimator!r}")
    if kernel is None:
        kernel = inner.kernel
    if kernel is None:
        mask_id = inner.mask_token_id
        if mask_id is None:
            raise ValueError("kernel: the model has no mask token and no kernel of its own; pass kernel=")
        kernel = MaskKernel(inner.num_states, mask_id)
    kernel = check_kernel(kernel)
    prompted = bool(inner.conditions_on_prompt)
    block = inner.block_size
    if estimator == "trace":
        if not traces:
            raise ValueError("estimator: 'trace' replays each rollout's commit order (trace=, from generate(..., "
                             "return_trace=True)), which this caller does not keep; use 'elbo' or a mask estimator")
        if not isinstance(kernel, MaskKernel):
            raise ValueError(f"estimator: 'trace' replays a mask decoder's commits and needs a MaskKernel, got "
                             f"kernel={kernel!r}")
        if prompted:
            raise ValueError(f"estimator: {type(inner).__name__} encodes the prompt; 'trace' replays the "
                             "mask-kernel decoders of models that read the prompt from x_t (use estimator='elbo')")
    elif estimator != "elbo":
        if not isinstance(kernel, MaskKernel):
            raise ValueError(f"estimator: {estimator!r} masks tokens and needs a MaskKernel, got kernel={kernel!r}; "
                             "use estimator='elbo' under uniform or hybrid noise")
        if block is not None or prompted:
            raise ValueError(f"estimator: {type(inner).__name__} with {'blocks' if block else 'a prompt encoder'} "
                             f"supports estimator='elbo' (the block ELBO), got {estimator!r}")
    return kernel


def sequence_logprob(model: X0Model, input_ids: torch.Tensor, completion_mask: torch.Tensor, *,
                     estimator: str = "elbo", num_samples: int = 1,
                     generator: torch.Generator | Sequence[torch.Generator] | None = None,
                     kernel: Kernel | None = None, attention_mask: torch.Tensor | None = None, row_offset: int = 0,
                     compute_dtype: torch.dtype | None = None, **options: Any) -> SequenceLogProb:
    """Estimate ``log p_θ(y | c)`` of each row's completion y (``completion_mask``) given its prompt c.

    Estimators (K = ``num_samples``; n = completion tokens of a row; ELBO of the mask kernel in
    :mod:`unifusion.rl.estimators`):

    | estimator | estimate | bias | forwards |
    |---|---|---|---|
    | ``"elbo"`` | ``−(1/K) Σ_k Σ_i D_{t_k}^i − C_ELBO``, t_k stratified, x_t from ``kernel`` | unbiased (ELBO) | K |
    | ``"elbo_discrete"`` | LLaDA: l ~ U{1..n}, exactly l masked, weight n/l | unbiased (ELBO) | K |
    | ``"coupled"`` | DiffuCoder: pairs (M, Mᶜ), weights 1/t and 1/(1 − t) | unbiased (ELBO) | 2K (+1) |
    | ``"quadrature"`` | GDPO: Gauss–Legendre nodes in t, exact-count masks | quadrature error | K·draws |
    | ``"mean_field"`` | d1: completion fully masked, prompt masked w.p. 0.15 | not a bound | K |
    | ``"eubo"`` | SPG: ``(1/β) Σ_i log E[n/l · 1[i∈M] p_i^β]``, β = ``eubo_beta`` | upper bound | K |
    | ``"trace"`` | TraceRL: ``Σ_s Σ_{i∈G_s} log x_θ,i(y_i | c, y_{G_<s})`` in its order | exact (order) | steps |

    Options (``**options``): ``"elbo"``: ``t_min`` (0); ``"coupled"``: ``t_range`` ((0, 1); DiffuCoder (0.2, 0.8)),
    ``fully_masked`` (False; DiffuCoder True); ``"quadrature"``: ``masks`` ("exact_count" | "bernoulli"), ``draws``
    (1); ``"mean_field"``: ``prompt_mask_prob`` (0.15); ``"eubo"``: ``eubo_beta`` (1.5, SPG's β). See
    :func:`~unifusion.rl.estimators.plan_masks` for each formula.

    ``"trace"`` (TraceRL) replays the order a decoder committed the completion in: ``trace=`` (required) is its
    ``(B, L)`` commit steps (:attr:`unifusion.samplers.PolicyOutput.commit_step`, from ``generate(...,
    return_trace=True)``); each group G_s of positions committed at one step is scored given the prompt and the
    groups committed before it, the later ones masked (:func:`~unifusion.rl.estimators.plan_trace`). Deterministic
    (no ``generator``, ``num_samples=1``); one pass per step (a block model: per step of its longest block, every
    block at its own state, the blocks cut from each row's first completion column as the decoder cut them).
    ``temperature`` (1.0) scores ``softmax(logits / T)`` (mask state excluded) like a decoder sampling at T: with the
    decoder's temperature, the replay of a rollout equals ``commit_logprob.sum(-1)`` (up to float rounding) when
    the decoder used no top-k/top-p and the model its exact computation (the uncached or exact block cache path,
    not the approximate prefix cache). The model's time input is the fraction of the completion still masked when
    the group was committed. The trace decides what every pass sees from the row's first generated column on
    (:func:`~unifusion.rl.estimators.plan_trace`): unscored committed positions are clean before their step and
    masked after, positions without a step stay masked. So a row that stopped at EOS, scored up to its EOS (the
    fill after it has step −1 and stays out of ``completion_mask``), replays exactly as decoded unless the decoder
    had committed a position after the EOS before the row stopped (that token was replaced by the fill; the replay
    sees a mask there). Temperatures other than 1 hold the ``(B, L, V)`` logits of a pass.

    Models: any :class:`~unifusion.denoiser.Denoiser` (of any kind, a kind registered from outside the package
    included), read through its declarations only. Without blocks: ``"elbo"`` under any kernel, the others under a
    mask kernel. A block model (:attr:`~unifusion.denoiser.Denoiser.block_size` K, e.g. ``adapt_ar_model(...,
    block_size=K)``): the block ELBO ``Σ_b ELBO(block b | clean prefix)``, every block at its own stratified time in
    one block-causal forward given the clean stream the model declares
    (:meth:`~unifusion.denoiser.Denoiser.block_conditioning`) (``"elbo"`` and ``"trace"``). A model that encodes
    its prompt (:attr:`~unifusion.denoiser.Denoiser.conditions_on_prompt`, ``DiffusionGemmaLM``): the prompt goes
    to it by :func:`~unifusion.denoiser.prompt_conditioning`, ``"elbo"`` under its kernel (every row needs a prompt
    token).

    Randomness: per row (:mod:`unifusion.rl.estimators`): the same ``generator`` seed gives every policy the same
    masks and times for the same batch, and a row's draws do not depend on its neighbours; ``row_offset`` is the
    global index of row 0 on a data-parallel rank. Gradients flow when grad is enabled; pass the old/reference
    policies under ``torch.no_grad()``.

    Precision: the output head, its log-softmax and the 1/t-weighted sums are float32 whatever the backbone computes
    in (float64 for a float64 model). ``compute_dtype`` sets the backbone's. ``None`` (default): the weights' dtype —
    the passes run with autocast off, so under a caller's bf16 autocast a float32 model's estimate and its gradient
    are the float32 ones, bit for bit: bf16 rounds the weights and activations enough to move a token's log-prob by
    ~0.04 nats on average (SmolLM2-135M), which the 1/t weights carry into every ratio of nearby policies
    (docs/guides/rl.md, "bf16").
    ``torch.bfloat16`` / ``torch.float16``: the passes run under autocast to that dtype (faster where the device
    computes it natively, with that rounding). ``torch.float32``: as ``None``, and a ``ValueError`` when a weight is
    below float32. Wrappers that put their own autocast inside the model's ``forward`` (accelerate's mixed
    precision, as in the Trainer) decide for themselves; a bf16-weight model computes in bf16.

    Args:
        model: the policy (possibly inside DDP / FSDP / compile wrappers).
        input_ids: ``(B, L)`` clean tokens, prompt then completion (then padding).
        completion_mask: ``(B, L)`` bool, True on the scored tokens; the other real tokens are the prompt (kept clean,
            never scored). Every row needs one.
        estimator: one of :data:`~unifusion.rl.estimators.ESTIMATORS`.
        num_samples: K ≥ 1.
        generator: a ``torch.Generator``, a list of one per row, or ``None`` (global RNG).
        kernel: the forward kernel; default the model's (``model.kernel``) or a :class:`~unifusion.MaskKernel` on its
            mask token.
        attention_mask: optional ``(B, L)``, 1 = real token.
        row_offset: global index of row 0 (see above).
        compute_dtype: the backbone's arithmetic (see Precision above): ``None`` (the weights' dtype, autocast
            off), ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.

    Returns:
        :class:`SequenceLogProb` with ``sequence (B,)`` and ``per_token (B, L)``.

    Raises:
        ValueError: an unknown estimator or option, ``num_samples < 1``, a row whose ``completion_mask`` is empty or
            covers padding, an estimator that needs the mask kernel under another kernel, a prompt-less row for a
            prompt-conditioned model (DiffusionGemma), ``compute_dtype=torch.float32`` on a model with weights
            below float32.
    """
    inner = _resolve(model)
    kernel = _check_estimator(inner, estimator, kernel, traces=True)
    K = V.check_positive_int("num_samples", num_samples)
    settings = _estimator_options(estimator, K, options)
    batch = _check_batch(model, inner, kernel, input_ids, completion_mask, attention_mask)
    with _backbone_precision(model, compute_dtype, batch.x0.device):
        return _estimate(model, inner, batch, kernel, estimator, K, generator, row_offset, settings)


_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The ``compute_dtype`` values :func:`sequence_logprob` takes besides ``None``."""


def _backbone_precision(model: X0Model, compute_dtype: torch.dtype | None,
                        device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The context the estimator's passes run in for ``compute_dtype`` (:func:`sequence_logprob`, Precision):
    ``None`` → ``torch.autocast(device.type, enabled=False)`` (the weights' dtype); ``torch.float32`` → the same,
    after a ``ValueError`` naming ``compute_dtype`` when a floating weight of ``model`` is below float32;
    ``torch.bfloat16`` / ``torch.float16`` → ``torch.autocast(device.type, dtype=compute_dtype)``. Host metadata
    only (no device sync); gradient checkpointing recomputes under the same autocast state."""
    if compute_dtype is not None and not isinstance(compute_dtype, torch.dtype):
        raise TypeError(f"compute_dtype: expected None or a torch.dtype, got {type(compute_dtype).__name__}")
    if compute_dtype is not None and compute_dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype: expected None or one of {_COMPUTE_DTYPES}, got {compute_dtype}")
    if compute_dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(device.type, dtype=compute_dtype)
    if compute_dtype == torch.float32:
        parameters = getattr(V.unwrap_model(model), "parameters", None)
        low = sorted({str(p.dtype) for p in parameters() if p.is_floating_point() and p.element_size() < 4}) \
            if callable(parameters) else []
        if low:
            raise ValueError(f"compute_dtype: torch.float32 computes in float32 only with float32 weights, got a "
                             f"model with {', '.join(low)} weights (mixed precision by torch.autocast keeps float32 "
                             "weights); pass compute_dtype=None")
    return torch.autocast(device.type, enabled=False)

def _estimator_options(estimator: str, num_samples: int, options: dict[str, Any]) -> dict[str, Any]:
    """The estimator's options with its defaults (:data:`_DEFAULTS`) filled in; an unknown option is a
    ``TypeError``, a bad ``"elbo"`` / ``"trace"`` value a ``ValueError`` (the mask estimators' options are checked by
    :func:`~unifusion.rl.estimators.plan_masks`)."""
    unknown = set(options) - _OPTIONS[estimator]
    if unknown:
        raise TypeError(f"{sorted(unknown)[0]}: not an option of estimator={estimator!r}; its options are "
                        f"{sorted(_OPTIONS[estimator]) or 'none'}")
    settings = {**_DEFAULTS[estimator], **options}
    if estimator == "elbo":
        t_min = settings["t_min"]
        if isinstance(t_min, bool) or not isinstance(t_min, (int, float)) or not 0.0 <= t_min < 1.0:
            raise ValueError(f"t_min: expected a float in [0, 1), got {t_min!r}")
        settings["t_min"] = float(t_min)
    if estimator == "trace":
        if num_samples != 1:
            raise ValueError(f"num_samples: the 'trace' estimator is deterministic (one replay), expected 1, got "
                             f"{num_samples}")
        if "trace" not in settings:
            raise ValueError("trace: estimator='trace' needs trace= (B, L) commit steps (PolicyOutput.commit_step, "
                             "from generate(..., return_trace=True))")
        temperature = settings["temperature"]
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 \
                or not math.isfinite(temperature):
            raise ValueError(f"temperature: expected a finite float > 0, got {temperature!r}")
        settings["temperature"] = float(temperature)
    return settings


def _check_batch(model: X0Model, inner: Denoiser, kernel: Kernel, input_ids: torch.Tensor,
                 completion_mask: torch.Tensor, attention_mask: torch.Tensor | None) -> _Batch:
    """The batch checks (shapes, dtypes, ids, one run of real tokens per row, no mask token in the data, a prompt
    token for a model that encodes its prompt, the model's device): batched, one host read."""
    x0 = V.check_token_batch("input_ids", input_ids)
    B, L = x0.shape
    if not isinstance(completion_mask, torch.Tensor) or tuple(completion_mask.shape) != (B, L):
        got = tuple(completion_mask.shape) if isinstance(completion_mask, torch.Tensor) else \
            type(completion_mask).__name__
        raise ValueError(f"completion_mask: expected a ({B}, {L}) bool tensor like input_ids, got {got}")
    if completion_mask.dtype != torch.bool:
        raise TypeError(f"completion_mask: expected dtype torch.bool, got {completion_mask.dtype}")
    completion = completion_mask.to(x0.device)
    if attention_mask is not None:
        attention_mask = V.check_tensor("attention_mask", attention_mask).to(x0.device)
        if tuple(attention_mask.shape) != (B, L):
            raise ValueError(f"attention_mask: expected shape {(B, L)} like input_ids, got "
                             f"{tuple(attention_mask.shape)}")
        valid = attention_mask.to(torch.bool)
    else:
        valid = torch.ones_like(completion)
    with V.batched_checks():
        x0 = V.check_token_ids("input_ids", x0, kernel.num_states)
        empty = ~completion.any(-1)
        V.fail_if(empty.any(), lambda: (
            f"completion_mask: covers no token in rows {empty.nonzero().flatten().tolist()[:8]}; every row needs a "
            "completion token to score"))
        pad = (completion & ~valid).any()
        V.fail_if(pad, lambda: "completion_mask: marks padding (attention_mask == 0) as completion")
        runs = (valid[:, 1:] & ~valid[:, :-1]).sum(-1) + valid[:, 0].long()  # starts of runs of real tokens
        holes = runs > 1
        V.fail_if(holes.any(), lambda: (
            f"attention_mask: expected each row's real tokens in one run (padding on the left and/or right, no pads "
            f"between real tokens), got rows with holes {holes.nonzero().flatten().tolist()[:8]}; put the prompt "
            "and the completion side by side"))
        if isinstance(kernel, MaskKernel):
            masked = (x0 == kernel.mask_id) & valid
            V.fail_if(masked.any(), lambda: (
                f"input_ids: the mask token (id {kernel.mask_id}) at real positions of rows "
                f"{masked.any(-1).nonzero().flatten().tolist()[:8]}; the estimators score clean tokens (a mask token "
                "in the data would be scored as the mask state)"))
        if inner.conditions_on_prompt:
            bare = ~(valid & ~completion).any(-1)
            V.fail_if(bare.any(), lambda: (
                f"completion_mask: rows {bare.nonzero().flatten().tolist()[:8]} have no prompt token; "
                f"{type(inner).__name__} encodes the prompt and needs at least one (e.g. BOS)"))
    V.check_model_device(model, "input_ids", x0)
    return _Batch(x0, completion, valid, attention_mask)


def _estimate(model: X0Model, inner: Denoiser, batch: _Batch, kernel: Kernel, estimator: str, num_samples: int,
              generator: torch.Generator | Sequence[torch.Generator] | None, row_offset: int,
              settings: dict[str, Any]) -> SequenceLogProb:
    """The estimator's passes through ``model`` (called as given, so its wrappers' hooks fire) on a checked batch."""
    if estimator == "elbo":
        gens = row_generators(generator, batch.x0.shape[0], batch.x0.device, row_offset=row_offset)
        return _elbo(model, inner, batch, kernel, num_samples, gens, settings["t_min"])
    assert isinstance(kernel, MaskKernel)  # _check_estimator: the other estimators need one
    if estimator == "trace":
        return _replay(model, inner, batch, settings["trace"], kernel.mask_id, settings["temperature"])
    plan = plan_masks(estimator, batch.completion, num_samples=num_samples, generator=generator,
                      row_offset=row_offset, prompt_mask=batch.valid & ~batch.completion, **settings)
    return _score_plan(model, inner, batch, plan, kernel.mask_id)


def _score_plan(model: X0Model, inner: Denoiser, batch: _Batch, plan: MaskPlan, mask_id: int) -> SequenceLogProb:
    """Run the plan's passes through the fused MDLM loss: at a masked position it is ``−(1/t) log p_θ(y_i | x_t)``
    under a linear-schedule mask kernel, so position weights ``t · coef`` give ``−coef · log p`` (linear estimators:
    the weights are folded in, so a plain ``.sum().backward()`` is the fused loss's fast backward)."""
    x0, attention_mask = batch.x0, batch.attention_mask
    scorer = MaskKernel(inner.num_states, mask_id, LinearSchedule())
    linear = plan.estimator != "eubo"
    per_pass = []
    for k in range(plan.num_passes):
        x_t = torch.where(plan.noised[k], torch.full_like(x0, mask_id), x0)
        t = plan.t[k].clamp(1e-6, MAX_TIME)  # (B,) float64
        w = t * (plan.coef[k] if linear else 1.0)
        weight = torch.where(plan.scored[k], w[:, None], torch.zeros((), dtype=w.dtype, device=w.device)).float()
        with V.unchecked():
            loss = model(x_t, t.float(), x0=x0, kernel=scorer, objective="mdlm", position_weight=weight,
                         attention_mask=attention_mask)
        per_pass.append(-loss)
    stacked = torch.stack(per_pass)  # (K, B, L)
    if linear:
        per_token = stacked.sum(0)  # coef already applied
    else:
        per_token = combine_logps(plan, stacked)
    return SequenceLogProb(sequence=per_token.sum(-1), per_token=per_token, num_forwards=plan.num_passes)


def _aligned(x: torch.Tensor, shifts: torch.Tensor, width: int, fill: Any) -> torch.Tensor:
    """``x`` ``(B, L)`` with row b behind ``shifts[b]`` columns (a block model's partition from each row's generated
    start, :mod:`unifusion.block_partition`); ``x`` itself when nothing moves (:func:`shift_left` undoes it)."""
    return x if width == x.shape[1] else shift_right(x, shifts, width, fill)


def _first_real(x0: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(B, 1)`` each row's first real token: a valid id for the invisible alignment columns."""
    return x0.gather(1, generated_start(valid).clamp_max(x0.shape[1] - 1)[:, None])


def _replay(model: X0Model, inner: Denoiser, batch: _Batch, trace: object, mask_id: int,
            temperature: float) -> SequenceLogProb:
    """The ``"trace"`` estimator: the passes of :func:`~unifusion.rl.estimators.plan_trace`, each through the model's
    forward; a block model runs each row behind ``−o mod K`` invisible left pads so that its blocks are cut where
    the decoder's were (from the row's block origin o: its first generated column, or its first real token for a
    ``"sequence_start"`` kind), as ``generate(..., use_cache=False)`` does."""
    x0, completion, attention_mask = batch.x0, batch.completion, batch.attention_mask
    B, L = x0.shape
    K = inner.block_size
    valid = torch.ones((B, L), dtype=torch.bool, device=x0.device) if attention_mask is None else \
        attention_mask.to(torch.bool)
    origin = None
    if K is not None and isinstance(trace, torch.Tensor) and tuple(trace.shape) == (B, L):
        origin = origin_columns(block_origin_of(inner), completion | (trace.to(x0.device) >= 0), valid)
    plan: TracePlan = plan_trace(trace, completion, block_size=K, origin=origin)  # type: ignore[arg-type]
    shifts = torch.zeros(B, dtype=torch.long, device=x0.device)
    Lp = L
    if K is not None:
        assert origin is not None  # plan_trace checked the trace
        shifts = aligning_shifts(origin, int(K))
        Lp = L + int(shifts.max())  # one host read
    if Lp != L:
        x0 = _aligned(x0, shifts, Lp, _first_real(x0, valid))  # any valid id: no query sees the pads
        attention_mask = _aligned(valid, shifts, Lp, False)

        def move(x: torch.Tensor, fill: Any) -> torch.Tensor:
            return _aligned(x, shifts, Lp, fill)
        plan = TracePlan(noised=torch.stack([move(n, False) for n in plan.noised]),
                         scored=torch.stack([move(c, False) for c in plan.scored]), t=move(plan.t, 0.5))
    block = _multi_block(inner, Lp)
    nb = 1 if block is None else num_blocks(Lp, block)
    width = Lp if block is None else block
    extra: dict[str, Any] = {} if block is None else inner.block_conditioning(x0)
    scorer = MaskKernel(inner.num_states, mask_id, LinearSchedule())
    per_pass = []
    for k in range(plan.num_passes):
        scored = plan.scored[k]
        x_t = torch.where(plan.noised[k], torch.full_like(x0, mask_id), x0)
        # each block's time: its group's (all positions of a group share it); 0.5 where a block scores nothing
        t_pos = torch.where(scored, plan.t, 0.0)
        t_pos = torch.nn.functional.pad(t_pos, (0, nb * width - Lp)).unflatten(-1, (nb, width)).amax(-1)
        t_blk = torch.where(t_pos > 0, t_pos, 0.5)  # (B, nb)
        t_in = t_blk[:, 0].float() if block is None else t_blk.float()
        t_tok = t_blk.expand(B, Lp) if block is None else expand_block_times(t_blk, Lp, block)
        with V.unchecked():
            if temperature == 1.0:  # the fused loss: −(1/t) log x_θ(y_i) at masked positions, weight t
                weight = torch.where(scored, t_tok, 0.0).float()
                lp = -model(x_t, t_in, x0=x0, kernel=scorer, objective="mdlm", position_weight=weight,
                            attention_mask=attention_mask, **extra)
            else:
                logits = model(x_t, t_in, attention_mask=attention_mask, **extra)
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
                logits[..., mask_id] = -math.inf
                lp = torch.log_softmax(logits, -1).gather(-1, x0[..., None])[..., 0]
        per_pass.append(torch.where(scored, lp, torch.zeros((), dtype=lp.dtype, device=lp.device)))
    per_token = shift_left(torch.stack(per_pass).sum(0), shifts, L)
    return SequenceLogProb(sequence=per_token.sum(-1), per_token=per_token, num_forwards=plan.num_passes)


def _elbo(model: X0Model, inner: Denoiser, batch: _Batch, kernel: Kernel, K: int, gens: tuple[torch.Generator, ...],
          t_min: float) -> SequenceLogProb:
    """The kernel's ELBO with stratified times t_k = t_min + (1 − t_min)(k − u)/K and x_t ~ q_{t|0}.

    Every draw is the row's own, from its generator, over its completion span ``[s, e)`` (first to last completion
    column): one u per row (per block of the span for a block model, the blocks cut from the row's block origin o
    as the decoder cut them: o = s, or the row's first real token for a ``"sequence_start"`` kind), then per pass the
    corruption of the span. So a row's estimate depends on its tokens and seed only, not on its alignment, padding or
    batch. A block model runs each row behind ``(−o) mod K`` invisible left pads, which put the forward's block
    boundaries at o, o + K, … (:mod:`unifusion.block_partition`); the prompt columns of the block holding s stay
    clean in it."""
    x0, completion, valid, attention_mask = batch.x0, batch.completion, batch.valid, batch.attention_mask
    block = inner.block_size
    B, L = x0.shape
    device = x0.device
    span_start = generated_start(completion)
    span_end = L - generated_start(completion.flip(-1))
    origin = span_start if block is None else origin_columns(block_origin_of(inner), completion, valid)
    starts, ends, origins = span_start.tolist(), span_end.tolist(), origin.tolist()  # one host read
    leads = [0 if block is None else (s - o) % block for s, o in zip(starts, origins)]  # prompt columns before s
    sizes = [1 if block is None else num_blocks(r + e - s, block) for s, e, r in zip(starts, ends, leads)]
    k = torch.arange(1, K + 1, device=device, dtype=torch.float64)[:, None]
    times = [(t_min + (1.0 - t_min) * (k - torch.rand(n, generator=g, device=device, dtype=torch.float64)[None]) / K
              ).clamp(1e-12, MAX_TIME) for g, n in zip(gens, sizes)]  # per row (K, blocks of its span)
    shifts = torch.zeros(B, dtype=torch.long, device=device)
    moves = [0] * B
    width = L
    if block is not None:
        shifts = aligning_shifts(origin, block)
        moves = [(-o) % block for o in origins]
        width = L + max(moves)
        if width <= block:  # one block (no prompt before it): the plain forward
            block, sizes = None, [1] * B
            times = [t[:, :1] for t in times]
    x0_a = _aligned(x0, shifts, width, _first_real(x0, valid))
    completion_a = _aligned(completion, shifts, width, False)
    mask_a = attention_mask if width == L else _aligned(valid, shifts, width, False).long()
    extra: dict[str, Any] = {}
    if block is not None:
        extra.update(inner.block_conditioning(x0_a))
        nb = num_blocks(width, block)
        t_blocks = torch.full((K, B, nb), 0.5, dtype=torch.float64, device=device)  # prompt blocks: unscored
        for b, (s, n) in enumerate(zip(starts, sizes)):
            first = (s + moves[b]) // block  # the block holding s
            t_blocks[:, b, first:first + n] = times[b]
    extra.update(prompt_conditioning(model, x0_a, _aligned(valid & ~completion, shifts, width, False)))
    weight = completion_a.float() * ((1.0 - t_min) / K)
    total = torch.zeros(B, width, device=device)
    for j in range(K):
        x_t = x0_a.clone()
        with V.unchecked():
            for b, (s, e) in enumerate(zip(starts, ends)):
                t_span = times[b][j, :1][None] if block is None else \
                    expand_block_times(times[b][j][None], leads[b] + e - s, block)[:, leads[b]:]  # (1, e − s)
                o = s + moves[b]
                span = kernel.sample(x0[b:b + 1, s:e], t_span, generator=gens[b])[0]
                x_t[b, o:o + e - s] = torch.where(completion[b, s:e], span, x0[b, s:e])
        t_in = torch.stack([t[j, 0] for t in times]).float() if block is None else t_blocks[j].float()
        with V.unchecked():
            D = model(x_t, t_in, kernel=kernel, objective="gidd", position_weight=weight, attention_mask=mask_a,
                      **{**extra, "x0": x0_a})
        total = total - D
    with V.unchecked():
        c = prior_kl(kernel, x0)  # (B, L) float64, 0 for α_1 = 0
    per_token = shift_left(total, shifts, L) - torch.where(completion, c, torch.zeros_like(c)).to(total.dtype)
    return SequenceLogProb(sequence=per_token.sum(-1), per_token=per_token, num_forwards=K)
