"""Functional training helpers for Algorithm 1 (paper App. C.5); the user owns the loop.

One x0 head trains with any of the five objectives: the head's logits are converted exactly (Theorem 3.5) into the
coordinates each loss expects. Nothing here calls ``torch.distributed``: :func:`diffusion_loss` returns per-token
losses together with the token count, so a multi-GPU loop can divide by its *global* token count::

    out = uf.diffusion_loss(model, x0, kernel, step=step, attention_mask=pad_mask, generator=g)
    n = out.num_tokens.clone(); dist.all_reduce(n)                     # global token count
    (out.loss.sum() * world_size / n).backward()                       # DDP averages gradients over ranks
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from . import _validation as V
from ._device import rand
from .conversions import log_heads_from_x0_logits
from .denoiser import X0Model, denoiser_of, prompt_conditioning
from .hf.ar import blocks
from .hf.ar.attention import anneal_schedule, check_bidirectional_prob
from .kernels import MAX_TIME, Kernel, MaskKernel, check_kernel
from .losses import X0_HEAD_OBJECTIVES, check_objective, native, x0_head_loss
from .schedules import LinearSchedule, Schedule

__all__ = ["sample_times", "diffusion_loss", "DiffusionLossOutput", "OBJECTIVES", "complement_time"]

OBJECTIVES = X0_HEAD_OBJECTIVES  # every objective trains an x0 head


def sample_times(batch_size: int, *, t_min: float = 1e-3, low_discrepancy: bool = True,
                 generator: torch.Generator | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """Diffusion times t ∈ [t_min, 1) for a batch, ``(batch_size,)`` (Algorithm 1 uses t_min = 1e-3).

    With ``low_discrepancy=True`` the times are stratified: t_i = t_min + (1 − t_min)·((u + i)/n mod 1) with one shared
    u ~ U(0, 1), which lowers the variance of the loss estimate. For a stratification over the *global* batch of a
    multi-process run, seed ``generator`` identically on every rank and pass ``rank`` and ``world_size``. Times are
    capped at 1 − 1e-6 so every kernel stays finite.
    """
    V.check_positive_int("batch_size", batch_size)
    generator = V.check_generator(generator)
    if isinstance(t_min, bool) or not isinstance(t_min, (int, float)) or not 0.0 < t_min < 1.0:
        raise ValueError(f"t_min: expected a float in (0, 1), got {t_min!r}")
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(
            f"rank, world_size: expected 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
    dev = torch.device(device) if device is not None else (generator.device if generator is not None else None)
    if low_discrepancy:
        n = batch_size * world_size
        u = rand((), generator=generator, device=dev, dtype=torch.float64)
        i = torch.arange(rank * batch_size, (rank + 1) * batch_size, device=dev, dtype=torch.float64)
        frac = torch.remainder(u + i / n, 1.0)
    else:
        if world_size > 1:
            # consume the same stream as the other ranks, keep this rank's slice
            frac = rand((batch_size * world_size,), generator=generator, device=dev, dtype=torch.float64)
            frac = frac[rank * batch_size:(rank + 1) * batch_size]
        else:
            frac = rand((batch_size,), generator=generator, device=dev, dtype=torch.float64)
    t = t_min + (1.0 - t_min) * frac
    return t.clamp(max=MAX_TIME).to(dtype)


@dataclass
class DiffusionLossOutput:
    """What :func:`diffusion_loss` returns.

    Attributes:
        loss: per-token losses ``(B, L)``, 0 at padding (float32, float64 for float64 logits).
        mask: ``(B, L)`` float, 1 on tokens that count.
        num_tokens: scalar tensor, ``mask.sum()`` — all-reduce it for a global normaliser.
        t: times ``(B,)`` (``(B, nb)``, one per block, for a block model); x_t: corrupted tokens ``(B, L)``;
            bidirectional_prob: γ used for the attention mask (a 0-d tensor when ``step`` or ``bidirectional_prob``
            was given as one).
    """

    loss: torch.Tensor
    mask: torch.Tensor
    num_tokens: torch.Tensor
    t: torch.Tensor
    x_t: torch.Tensor
    bidirectional_prob: float | torch.Tensor

    def mean(self) -> torch.Tensor:
        """Single-process token mean, ``loss.sum() / num_tokens`` (clamped to avoid 0/0)."""
        return self.loss.sum() / self.num_tokens.clamp_min(1)


def _reference_loss(objective: str, logits: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                    kernel: Kernel, weighting: str, max_weight: float) -> torch.Tensor:
    """The objective's own published loss on the converted x0 head (slow, straightforward; for tests and demos)."""
    if objective == "gidd":
        return native.reference_gidd_loss(logits, x0, x_t, t, kernel, weighting=weighting, max_weight=max_weight)
    if objective == "mdlm":
        return native.reference_mdlm_loss(logits, x0, x_t, t, kernel)
    if objective == "sedd":
        return native.sedd_loss(log_heads_from_x0_logits("sedd", logits, kernel, x_t, t), x0, x_t, t, kernel)
    if objective == "m2s":
        return native.m2s_loss(log_heads_from_x0_logits("m2s", logits, kernel, x_t, t), x0, x_t, t, kernel)
    log_exit, log_rates = log_heads_from_x0_logits("ctmc", logits, kernel, x_t, t)
    # finite stand-ins keep the loss and its gradient finite: a row without rates gets a negligible exit rate e^{-80},
    # an impossible jump the logit −10⁴
    log_exit = torch.where(torch.isneginf(log_exit), torch.full_like(log_exit, -80.0), log_exit)
    jump = torch.where(torch.isneginf(log_rates), torch.full_like(log_rates, -1e4), log_rates)
    return native.ctmc_loss(log_exit, jump, x0, x_t, t, kernel)


def complement_time(schedule: Schedule, t: torch.Tensor) -> torch.Tensor:
    """The time t' whose mask probability is the keep probability at ``t``: 1 − α_{t'} = α_t (any shape, dtype kept).

    The complement Mᶜ of a mask M drawn at time t (each token masked with probability 1 − α_t) is a mask drawn at t'.
    Exact for the linear schedule (t' = 1 − t); otherwise found by bisection on the monotone 1 − α (float64, 60
    halvings, no host sync). Capped at ``MAX_TIME`` like every sampled time (a schedule with α_1 > 0 cannot reach the
    keep probability of the smallest times exactly).
    """
    if isinstance(schedule, LinearSchedule):
        return (1.0 - t).clamp(1e-6, MAX_TIME)
    target = schedule.alpha(t.to(torch.float64))
    lo, hi = torch.zeros_like(target), torch.full_like(target, MAX_TIME)
    for _ in range(60):
        mid = (lo + hi) / 2
        below = schedule.one_minus_alpha(mid) < target
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return ((lo + hi) / 2).clamp(1e-6, MAX_TIME).to(t.dtype)


def _block_size(model: X0Model, length: int) -> int | None:
    """The block size K of a block model when it splits ``length`` tokens into several blocks, else ``None``."""
    inner = denoiser_of(model)
    K = None if inner is None else inner.block_size
    return None if K is None or K >= length else int(K)


def diffusion_loss(model: X0Model, x0: torch.Tensor, kernel: Kernel, *,
                   # the objective
                   objective: Literal["gidd", "mdlm", "sedd", "m2s", "ctmc"] = "gidd",
                   weighting: Literal["elbo", "clip", "dynamic"] = "elbo", max_weight: float = 2.0,
                   head: Literal["x0", "mu"] = "x0", reference: bool = False,
                   # the noise: times and corruption
                   t: torch.Tensor | None = None, t_min: float = 1e-3,
                   block_times: Literal["block", "sequence"] = "block", complementary: bool = False,
                   generator: torch.Generator | None = None,
                   # the model's forward
                   step: int | torch.Tensor | None = None, anneal_steps: int = 10_000,
                   bidirectional_prob: float | torch.Tensor | None = None, fused: bool = False,
                   # the masks
                   attention_mask: torch.Tensor | None = None, prompt_mask: torch.Tensor | None = None,
                   document_ids: torch.Tensor | None = None) -> DiffusionLossOutput:
    """One training step's loss for Algorithm 1: corrupt ``x0``, run the model, score the chosen objective.

    Keyword arguments, by what they configure: **the objective** (``objective``, ``weighting``, ``max_weight``,
    ``head``, ``reference``), **the noise** — times and corruption (``t``, ``t_min``, ``block_times``,
    ``complementary``, ``generator``), **the model's forward** (``step``, ``anneal_steps``, ``bidirectional_prob``,
    ``fused``) and **the masks** — which tokens exist, are given, belong together (``attention_mask``,
    ``prompt_mask``, ``document_ids``).

    Args:
        model: a :class:`~unifusion.DiffusionLM` (possibly inside DDP/FSDP/DeepSpeed/compile wrappers) or any callable
            ``(x_t (B, L), t (B,)) → logits (B, L, S)``.
        x0: clean tokens ``(B, L)`` int64, never the kernel's mask id at a real position; ``L + 1`` (bos) at most
            the model's ``max_position_embeddings``.
        kernel: the forward kernel (switching kernels mid-training is just passing another one).
        objective: ``"gidd"``, ``"mdlm"`` (mask kernel), ``"sedd"``, ``"m2s"`` or ``"ctmc"``; the x0 head is converted
            exactly into each loss's coordinates, so with ELBO weights all five give the same value (Corollary 3.4).
        weighting: GIDD weighting ``"elbo"``, ``"clip"`` or ``"dynamic"`` (objective ``"gidd"`` only).
        max_weight: upper clip of the GIDD weights.
        head: ``"x0"`` (default) or ``"mu"`` — use the network output directly as M2S's μ (objective ``"m2s"`` only;
            the paper's Fig. 2 comparison).
        reference: convert the head into each objective's own coordinates and evaluate the published loss there
            (:mod:`unifusion.losses.native`; slow, the same values).
        t: optional fixed times, one per sequence: a float, ``(B,)`` or ``(B, 1)``; otherwise :func:`sample_times`
            (low-discrepancy, t ∈ [t_min, 1)).
        t_min: smallest sampled time.
        block_times: block models (:attr:`DiffusionLM.block_size` ``< L``, :mod:`unifusion.hf.ar.blocks`) only:
            ``"block"`` (default) draws one time per block (``sample_times`` over the ``B·nb`` blocks, ``t`` is then
            ``(B, nb)``), ``"sequence"`` one per sequence shared by its blocks. A given ``t`` may be ``(B, nb)``.
        complementary: complementary masking (Fast-dLLM v2, LLaDA 2.0 SFT), :class:`~unifusion.MaskKernel` and
            ``weighting="elbo"`` only. Each row is trained twice in one forward batch of ``2B`` rows: rows ``[0, B)``
            with the mask M drawn at its time t, rows ``[B, 2B)`` with the complement Mᶜ (every scored token that M
            kept is masked and vice versa) at the complementary time t' (1 − α_{t'} = α_t, :func:`complement_time`;
            t' = 1 − t for the linear schedule), so every scored token is scored in exactly one half of its pair.
            A block model complements each block's mask and time. The second half's losses carry the importance
            weight α'_t / α'_{t'} (1 for the linear schedule), so each half — and their average — is an unbiased
            estimate of the ELBO. The output then has ``2B`` rows: ``loss``, ``mask``, ``x_t`` ``(2B, L)``, ``t``
            ``(2B,)`` (``(2B, nb)``), and ``num_tokens`` counts every scored token twice (once per half), so
            ``out.mean()`` is the per-token ELBO estimate of the pair average. ``x0``, ``attention_mask`` and
            ``prompt_mask`` keep their ``B`` rows (they are repeated inside).
        generator: randomness for times, corruption and the annealed mask. ``torch.compile`` cannot trace a
            ``torch.Generator``: a compiled step passes ``None`` and seeds the global generator
            (``torch.manual_seed``).
        step: training step k for attention annealing γ_k = min(1, k/anneal_steps) (DiffusionLM only);
            ``None`` means fully bidirectional unless ``bidirectional_prob`` is given. An int, or a 0-d tensor
            (``torch.tensor(k)``): then γ_k is a tensor that is never read on the host, so a step compiled with
            ``torch.compile`` keeps one graph while γ moves (a Python int is a constant of the graph: each new value
            would recompile). A tensor γ always draws the Bernoulli mask, at γ = 0 and 1 too (exactly causal / full
            there, but other random draws than a Python γ, which skips the draw at the ends).
        anneal_steps: the annealing horizon K_ann.
        bidirectional_prob: set γ directly instead of annealing it by ``step`` (a float, or a 0-d floating tensor,
            as a tensor ``step`` gives); giving both ``step`` and ``bidirectional_prob`` is a ``ValueError`` (one of
            them would be silently ignored).
        fused: with a :class:`~unifusion.DiffusionLM`, compute the loss from the hidden states chunk by chunk
            (:func:`~unifusion.losses.fused_linear_diffusion_loss`) so the ``(B, L, V)`` logits never exist —
            for large vocabularies. It runs inside the model's ``forward``, so wrappers' hooks still fire.
        attention_mask: optional ``(B, L)`` padding mask (1 = token); padded tokens stay clean and do not count.
            A block model takes right padding only (its blocks are cut at column multiples of ``block_size``; a
            left-padded row is a ``ValueError``).
        prompt_mask: optional ``(B, L)`` bool, True on prompt tokens (supervised fine-tuning): they stay clean in
            ``x_t`` at every time, are seen by every prediction that may see them, score exactly 0 and do not count
            in ``num_tokens``. At least one real (non-padding) token of every row must be outside the prompt. The
            model is conditioned on it by :func:`unifusion.denoiser.prompt_conditioning` (the rule ``nll_bound``
            and the harness follow too; DiffusionGemma needs no ``conditioned_on`` wrapper).
        document_ids: ``(B, L)`` integer document id of each token, for right-padded packed rows
            (``ChatCollator(..., packing=True)``'s ``conversation_ids``). No token attends to another
            document, each document has its own BOS and position ids restart per document
            (:meth:`DiffusionLM.forward`), so a packed row's per-token losses are those of its documents trained
            alone with the same times and masks, for documents that start at block boundaries. Block models on rows
            of several blocks only (else a ``ValueError``). A document that starts inside a block has its first
            token predicted at the previous document's last position (the shift), so that token must not be
            scored: a prompt token (``prompt_mask``), else a ``ValueError`` (chat templates start with one).

    **Block models** (``adapt_ar_model(..., block_size=K)`` with ``K < L``) are trained block-causally in one forward
    (:mod:`unifusion.hf.ar.blocks`): the prediction of a token of block b sees the clean tokens of blocks < b and the
    noisy tokens of block b, the loss is Σ_b D_t(block b | clean prefix); ``step`` anneals the attention inside each
    block from causal to bidirectional. With ``K ≥ L`` the model is the plain one (the same code path and draws).

    The x0-head objectives run through :func:`~unifusion.losses.x0_head_loss` (analytic gradient, chunked, at the
    cost of a cross-entropy); ``head="mu"`` uses the M2S reference loss.

    Memory: the model's logits go to the loss as they are — bf16 stays bf16 (the loss computes in float32 inside) and
    a :class:`~unifusion.DiffusionLM` returns them contiguous (its head runs on the ``L`` positions needed) — so the
    peak is that of ``model(x_t, t)`` plus the loss on its logits (at most 1.1× that of the model call). A model
    callable of your own should return contiguous logits too: the loss reads rows ``(B·L, S)`` and copies a strided
    view (e.g. ``out.logits[:, :-1]``) whole.

    Returns:
        :class:`DiffusionLossOutput` with per-token ``loss (B, L)`` and the token count for normalising.
    """
    check_objective(objective, kernel)
    if head not in ("x0", "mu"):
        raise ValueError(f"head: expected 'x0' or 'mu', got {head!r}")
    if head == "mu" and objective != "m2s":
        raise ValueError(f"head: 'mu' is M2S's parameterization and needs objective='m2s', got objective={objective!r}")
    if weighting != "elbo" and objective != "gidd":
        raise ValueError(f"weighting: only objective='gidd' supports {weighting!r}; the others are ELBO-weighted")
    if step is not None and bidirectional_prob is not None:
        raise ValueError(f"step, bidirectional_prob: give one of them, got step={step!r} and bidirectional_prob="
                         f"{bidirectional_prob!r} (step anneals γ = min(1, step/anneal_steps); bidirectional_prob "
                         "sets γ directly)")
    kernel = check_kernel(kernel)
    if not isinstance(complementary, bool):
        raise TypeError(f"complementary: expected a bool, got {type(complementary).__name__}")
    if complementary and not isinstance(kernel, MaskKernel):
        raise ValueError(f"complementary: expected a MaskKernel (the complement of a mask is a mask only for the "
                         f"absorbing kernel), got {type(kernel).__name__}")
    if complementary and weighting != "elbo":
        raise ValueError(f"complementary: the pair is an unbiased ELBO estimate with weighting='elbo' only, got "
                         f"weighting={weighting!r}")
    generator = V.check_generator(generator)
    if generator is not None and torch.compiler.is_compiling():
        raise ValueError("generator: torch.compile cannot trace a torch.Generator; in a compiled step pass "
                         "generator=None and seed the global generator instead (torch.manual_seed)")
    V.check_model_kernel(model, kernel)
    x0 = V.check_token_batch("x0", x0)
    B, L = x0.shape
    V.check_model_device(model, "x0", x0)
    V.check_model_length(model, L, "x0")
    # every value check of the step in one host sync, then kernel, model and loss run unchecked
    with V.batched_checks():
        x0 = V.check_token_ids("x0", x0, kernel.num_states)
        if attention_mask is not None:
            attention_mask = V.check_tensor("attention_mask", attention_mask)
            if tuple(attention_mask.shape) != (B, L):
                raise ValueError(f"attention_mask: expected shape {(B, L)} like x0, got {tuple(attention_mask.shape)}")
            if V.is_diffusion_lm(model):  # the model runs unchecked below: its padding rule is checked here, batched
                V.check_padding("attention_mask", attention_mask.to(device=x0.device, dtype=torch.bool))
        block = _block_size(model, L)  # K < L for a block model, else None (the plain path)
        if block_times not in ("block", "sequence"):
            raise ValueError(f"block_times: expected 'block' or 'sequence', got {block_times!r}")
        if t is not None:
            if block is None:
                t = V.check_sequence_times("t", t, (B, L), device=x0.device, who="diffusion_loss")
            else:
                t = blocks.block_times(t, B, blocks.num_blocks(L, block), x0.device)
        valid = torch.ones_like(x0, dtype=torch.bool) if attention_mask is None else attention_mask.to(torch.bool)
        if kernel.mask_id is not None and V.validation_enabled():  # x_t would hold a mask the kernel did not put there
            mask_id = kernel.mask_id
            V.fail_if(((x0 == mask_id) & valid).any(), lambda: (
                f"x0: expected clean tokens, got the kernel's mask id {mask_id} at a real (non-padding) position; "
                "clean data never holds the mask state (was the mask token used as padding or as a text token?)"))
        if block is not None and attention_mask is not None and V.validation_enabled():
            V.fail_if((~valid[:, 0] & valid[:, -1]).any(), lambda: (
                f"attention_mask: a block model cuts blocks at column multiples of block_size = {block}, so a "
                "left-padded row would train on other blocks than the same text right-padded; right-pad the batch "
                "(tokenizer padding_side='right')"))
        if prompt_mask is not None:
            scored = V.check_prompt_mask(prompt_mask, valid)
        if document_ids is not None:
            if not V.is_diffusion_lm(model):
                raise TypeError(f"document_ids: needs a DiffusionLM (its attention mask and position ids), got "
                                f"{type(V.unwrap_model(model)).__name__}")
            if not isinstance(document_ids, torch.Tensor) or document_ids.dtype.is_floating_point \
                    or tuple(document_ids.shape) != (B, L):
                found = (f"shape {tuple(document_ids.shape)}, dtype {document_ids.dtype}"
                         if isinstance(document_ids, torch.Tensor) else type(document_ids).__name__)
                raise ValueError(f"document_ids: expected an integer tensor of shape {(B, L)} like x0, got {found}")
            document_ids = document_ids.to(x0.device, torch.long)
            if block is None:
                raise ValueError(f"document_ids: packed documents need a block model whose rows span several blocks "
                                 f"(adapt_ar_model(..., block_size=K) with K < L = {L}); a fully bidirectional "
                                 "model shares one BOS between the documents of a row")
            if V.validation_enabled():
                starts = torch.zeros_like(valid)
                starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
                starts[:, ::block] = False  # a document starting at a block boundary gets its own BOS
                counted = scored if prompt_mask is not None else valid
                K_ = block
                V.fail_if((starts & counted).any(), lambda: (
                    f"document_ids: a document starts inside a block (block_size = {K_}) with a scored first token, "
                    "whose prediction is read at the previous document's last position (the shifted AR head); start "
                    "documents at block boundaries, or make that token a prompt token (prompt_mask), as a chat "
                    "template's first token is"))
        gamma: float | torch.Tensor = 1.0
        if bidirectional_prob is not None:
            gamma = check_bidirectional_prob(
                bidirectional_prob if isinstance(bidirectional_prob, torch.Tensor) else float(bidirectional_prob))
        elif step is not None:
            gamma = anneal_schedule(step, anneal_steps)
    if t is None and block is not None:
        nb = blocks.num_blocks(L, block)
        if block_times == "block":
            t = sample_times(B * nb, t_min=t_min, generator=generator, device=x0.device).view(B, nb)
        else:
            t = sample_times(B, t_min=t_min, generator=generator, device=x0.device)[:, None].expand(B, nb)
    if t is None:
        t = sample_times(B, t_min=t_min, generator=generator, device=x0.device)
    t_tokens = t if block is None else blocks.expand_block_times(t, L, block)  # (B,) or (B, L)
    with V.unchecked():
        x_t = kernel.sample(x0, t_tokens, generator=generator)  # one time per row, or per position (blocks)
    x_t = torch.where(valid, x_t, x0)
    if prompt_mask is not None:  # prompt tokens stay clean at every time, score 0 and do not count
        x_t = torch.where(scored, x_t, x0)
        valid = scored
    half_weight: torch.Tensor | None = None  # importance weight of the complementary half, (B,) or (B, L)
    if complementary:
        # rows [0, B): mask M at time t; rows [B, 2B): its complement at t' (1 − α_{t'} = α_t), one batch
        mask_kernel = cast(MaskKernel, kernel)
        schedule, mask_id = mask_kernel.schedule, mask_kernel.mask_id
        t_c = complement_time(schedule, t)
        half_weight = schedule.alpha_prime(t.to(torch.float64)) / schedule.alpha_prime(t_c.to(torch.float64))
        if block is not None:
            half_weight = blocks.expand_block_times(half_weight, L, block)
        x_c = torch.where(valid & (x_t == mask_id), x0, torch.full_like(x0, mask_id))
        x_c = torch.where(valid, x_c, x0)
        x0, x_t, t = x0.repeat(2, 1), torch.cat([x_t, x_c]), torch.cat([t, t_c])
        valid = valid.repeat(2, 1)
        attention_mask = None if attention_mask is None else attention_mask.repeat(2, 1)
        prompt_mask = None if prompt_mask is None else prompt_mask.repeat(2, 1)
        document_ids = None if document_ids is None else document_ids.repeat(2, 1)
        t_tokens = t if block is None else blocks.expand_block_times(t, L, block)
        B = 2 * B
    inner = denoiser_of(model)
    block_kwargs: dict[str, Any] = {} if block is None or inner is None else inner.block_conditioning(x0)
    if document_ids is not None:
        block_kwargs["document_ids"] = document_ids
    conditioning = prompt_conditioning(model, x0, prompt_mask)  # the one prompt rule (e.g. DiffusionGemma's encoder)

    if not isinstance(fused, bool):
        raise TypeError(f"fused: expected a bool, got {type(fused).__name__}")
    if fused and not V.is_diffusion_lm(model):
        raise TypeError(
            f"fused: needs a DiffusionLM (hidden states + output head), got {type(V.unwrap_model(model)).__name__}")
    if fused and head == "mu":
        raise ValueError("fused: head='mu' is not an x0 head; use fused=False")
    if step is not None and bidirectional_prob is None and not V.is_diffusion_lm(model):
        warnings.warn(f"step: the model ({type(V.unwrap_model(model)).__name__}) is not a DiffusionLM and cannot "
                      "anneal its attention; step is ignored", stacklevel=2)
    if fused:
        # padded positions weighted 0: exactly 0 loss, and no gradient work for them in the fused backward
        with V.unchecked():
            loss = model(x_t, t, bidirectional_prob=gamma, attention_mask=attention_mask, generator=generator,
                         kernel=kernel, objective=objective, weighting=weighting, max_weight=max_weight,
                         position_weight=None if attention_mask is None and prompt_mask is None else valid,
                         **block_kwargs, **{**conditioning, "x0": x0})
        loss = _weight_second_half(loss, half_weight)
        mask = valid.to(loss.dtype)
        return DiffusionLossOutput(loss=loss, mask=mask, num_tokens=mask.sum(), t=t, x_t=x_t,
                                   bidirectional_prob=gamma)
    with V.unchecked():
        if V.is_diffusion_lm(model):
            logits = model(x_t, t, bidirectional_prob=gamma, attention_mask=attention_mask, generator=generator,
                           **block_kwargs, **conditioning)
        else:
            logits = model(x_t, t)
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (B, L, kernel.num_states):
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"model: expected logits of shape {(B, L, kernel.num_states)} (num_states = kernel's), got {got}")

    # bf16 logits go to the loss as they are: it computes in float32 internally (no (B, L, V) float32 copy)
    dtype = V.compute_dtype(logits)
    t_pos = t.to(dtype)[:, None].expand(B, L) if block is None else t_tokens.to(dtype)
    with V.unchecked():  # inputs were validated above; skip the syncing re-checks inside
        if head == "mu":
            loss = native.m2s_loss(logits, x0, x_t, t_pos, kernel)
        elif reference:
            loss = _reference_loss(objective, logits, x0, x_t, t_pos, kernel, weighting, max_weight)
        else:
            loss = x0_head_loss(logits, x0, x_t, t_pos, kernel, objective=objective, weighting=weighting,
                                max_weight=max_weight)
    loss = _weight_second_half(loss, half_weight)
    mask = valid.to(loss.dtype)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return DiffusionLossOutput(loss=loss, mask=mask, num_tokens=mask.sum(), t=t, x_t=x_t,
                               bidirectional_prob=gamma)


def _weight_second_half(loss: torch.Tensor, half_weight: torch.Tensor | None) -> torch.Tensor:
    """``loss`` ``(2B, L)`` with rows ``[B, 2B)`` times the complementary half's weight (``(B,)`` or ``(B, L)``)."""
    if half_weight is None:
        return loss
    w = half_weight if half_weight.dim() == 2 else half_weight[:, None]
    B = loss.shape[0] // 2
    return torch.cat([loss[:B], loss[B:] * w.to(loss.dtype)])
