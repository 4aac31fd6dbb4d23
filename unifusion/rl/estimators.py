"""The masks, times and weights of every sequence log-likelihood estimator, and how their log-probs combine.

A masked diffusion LM gives no exact ``log p_θ(y | c)`` for a completion y of n tokens after a prompt c; what it gives
is ``log p_θ(y_i | x_t)`` for the masked positions of a corrupted copy x_t. Each estimator of the RL literature is a
plan of K corrupted copies (passes) with weights, and a way to combine their per-token log-probs:

* linear estimators (all but ``"eubo"``): ``per_token_i = Σ_k coef_k · 1[i ∈ S_k] · log p_θ(y_i | x^{(k)})``, with
  ``S_k`` the scored positions of pass k (:class:`MaskPlan`);
* ``"eubo"`` (SPG's upper bound, β = ``eubo_beta``): ``per_token_i = (1/β) log((1/K) Σ_k coef_k 1[i ∈ S_k]
  p_θ(y_i | x^{(k)})^β)``,
  0 for a token no pass masked.

The mask kernel's ELBO (MDLM, LLaDA; the paper's Proposition 3.2 for the absorbing kernel with α_t = 1 − t) is

    log p_θ(y | c) ≥ ELBO = ∫_0^1 (1/t) E_{M ~ Bernoulli(t)^n} [Σ_{i∈M} log p_θ(y_i | y_¬M, c)] dt
                         = Σ_{M ≠ ∅} (l − 1)! (n − l)! / n! · Σ_{i∈M} log p_θ(y_i | y_¬M, c),   l = |M|,

and every estimator here except ``"mean_field"`` and ``"eubo"`` is unbiased for it (``"coupled"`` with the default
``t_range``, ``"quadrature"`` with Bernoulli masks and K ≥ n/2 nodes; :func:`plan_masks` lists each one's bias).

**Randomness is per row.** Row b draws from its own ``torch.Generator``: given one generator, one 62-bit seed is
drawn from it and row b gets the seed ``(seed + (row_offset + b) · φ) mod 2⁶³`` (φ = 0x9E3779B97F4A7C15); given a
list, row b uses the list's b-th generator. So a row's masks do not depend on its batch neighbours, and a data
parallel rank holding rows ``[r·B, (r + 1)·B)`` of a global batch gets the global batch's masks with
``row_offset = r·B`` and the same generator seed on every rank. The same seed gives the same masks and times to every
policy that scores the same batch (old, reference and current policy: VRPO's shared masks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from .. import _validation as V

__all__ = ["ESTIMATORS", "MaskPlan", "TracePlan", "plan_masks", "plan_from_masks", "plan_trace", "combine_logps",
           "row_generators", "gauss_legendre"]

ESTIMATORS = ("elbo", "elbo_discrete", "coupled", "quadrature", "mean_field", "eubo", "trace")
"""The estimator names of :func:`~unifusion.rl.sequence_logprob`."""

_PLANNED = ("elbo_discrete", "coupled", "quadrature", "mean_field", "eubo")
"""The estimators whose masks :func:`plan_masks` draws."""

TIME_EPS = 1e-3
"""The replayed times are clamped to [ε, 1 − ε], as the decoder clamps the times it gives the model."""

_GOLDEN = 0x9E3779B97F4A7C15
_MAX_TIME = 1.0 - 1e-6


@dataclass(frozen=True)
class MaskPlan:
    """K corrupted copies of a batch and the weights of their log-probs.

    Attributes:
        noised: ``(K, B, L)`` bool, True where pass k puts the mask token (scored completion tokens, and for
            ``"mean_field"`` the prompt tokens it corrupts).
        scored: ``(K, B, L)`` bool, the completion tokens whose ``log p_θ(y_i | x^{(k)})`` pass k contributes
            (a subset of ``noised``).
        coef: ``(K, B)`` float64, the weight ``coef_k`` of pass k's log-probs (module docstring).
        t: ``(K, B)`` float64, the time of pass k (the model's time input; the masked fraction for exact counts).
        estimator: the estimator that made the plan (decides how :func:`combine_logps` combines).
        eubo_beta: β of ``"eubo"`` (1 otherwise).
    """

    noised: torch.Tensor
    scored: torch.Tensor
    coef: torch.Tensor
    t: torch.Tensor
    estimator: str
    eubo_beta: float = 1.0

    @property
    def num_passes(self) -> int:
        """K, the forwards the plan costs."""
        return int(self.noised.shape[0])


def row_generators(generator: torch.Generator | Sequence[torch.Generator] | None, batch_size: int,
                   device: torch.device, *, row_offset: int = 0) -> tuple[torch.Generator, ...]:
    """One ``torch.Generator`` on ``device`` per row (module docstring: seeds from one draw of ``generator`` and the
    global row index ``row_offset + b``; a list is returned as given; ``None`` draws the seed from the global RNG).
    One host read of the drawn seed."""
    if isinstance(generator, (list, tuple)):
        gens = V.check_generators(generator, batch_size)
        assert isinstance(gens, tuple)
        return gens
    generator = V.check_generator(generator)
    if isinstance(row_offset, bool) or not isinstance(row_offset, int) or row_offset < 0:
        raise ValueError(f"row_offset: expected an int >= 0 (the global index of this batch's first row), got "
                         f"{row_offset!r}")
    gdev = generator.device if generator is not None else torch.device("cpu")
    seed = int(torch.randint(0, 1 << 62, (1,), generator=generator, device=gdev).item())
    out = []
    for b in range(batch_size):
        g = torch.Generator(device=device)
        g.manual_seed((seed + (row_offset + b) * _GOLDEN) % (1 << 63))
        out.append(g)
    return tuple(out)


def gauss_legendre(num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Gauss–Legendre nodes and weights on ``(0, 1)`` (weights sum to 1): exact for polynomials of degree
    ``≤ 2·num_nodes − 1``."""
    x, w = np.polynomial.legendre.leggauss(num_nodes)
    return 0.5 * (x + 1.0), 0.5 * w


def _uniforms(gens: tuple[torch.Generator, ...], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``(B, *shape)`` float64 uniforms, row b from ``gens[b]``."""
    return torch.stack([torch.rand(shape, generator=g, device=device, dtype=torch.float64) for g in gens])


def _exact_count(r: torch.Tensor, completion: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The ``count`` completion positions with the smallest uniforms ``r``: a uniformly random subset of that size.
    ``r`` ``(K, B, L)``, ``completion`` ``(B, L)``, ``count`` ``(K, B)`` → ``(K, B, L)`` bool."""
    key = r.masked_fill(~completion, float("inf"))
    rank = key.argsort(-1).argsort(-1)
    return (rank < count[..., None]) & completion


def plan_masks(estimator: str, completion_mask: torch.Tensor, *, num_samples: int = 1,
               generator: torch.Generator | Sequence[torch.Generator] | None = None, row_offset: int = 0,
               prompt_mask: torch.Tensor | None = None, prompt_mask_prob: float = 0.15,
               t_range: tuple[float, float] = (0.0, 1.0), fully_masked: bool = False,
               masks: Literal["exact_count", "bernoulli"] = "exact_count", draws: int = 1,
               eubo_beta: float = 1.5) -> MaskPlan:
    """The passes of a mask-kernel estimator for a batch (no model involved: every policy gets the same plan from
    the same generator seed).

    With ``n_b`` completion tokens in row b, ``K = num_samples`` and one ``u_b ~ U(0, 1)`` per row:

    * ``"elbo_discrete"`` (LLaDA's ``get_log_likelihood``): ``l_k = ⌊n (k − 1 + u)/K⌋ + 1`` (stratified,
      marginally U{1..n}), exactly ``l_k`` completion tokens masked uniformly at random, ``coef_k = n / (K l_k)``.
      Unbiased for the ELBO. K forwards.
    * ``"coupled"`` (DiffuCoder's coupled-GRPO): ``t_k = a + (b − a)(k − 1 + u)/K`` over ``t_range = (a, b)``, one
      uniform ``r_i`` per token, the pair ``M = {r_i < t_k}`` (``coef = 1/(2K t_k)``) and ``Mᶜ`` = the rest
      (``coef = 1/(2K (1 − t_k))``): every completion token is scored once per pair. Unbiased for ``t_range = (0, 1)``;
      DiffuCoder's recipe is ``t_range=(0.2, 0.8), fully_masked=True``, which adds a pass with the whole completion
      masked and returns ``½ log p(y_i | all masked) + ½ (1_M log p/t + 1_{Mᶜ} log p/(1 − t))`` (biased).
      2K (+1) forwards.
    * ``"quadrature"`` (GDPO's semi-deterministic Monte Carlo): K Gauss–Legendre nodes t_j with weights w_j on
      (0, 1), ``draws`` masks per node, ``coef = w_j / (draws · t_j)``. ``masks="exact_count"`` (GDPO): exactly
      ``l_j = min(n, max(1, round(n t_j)))`` tokens masked — biased: the weight 1/t_j is kept while the masked
      fraction is l_j/n, so for a model whose token log-probs did not depend on the context the expectation is
      ``ρ · ELBO`` with ``ρ = Σ_j w_j l_j / (n t_j)`` (the stated error; it shrinks like 1/n);
      ``masks="bernoulli"``: each token masked with probability t_j — the integrand ``(1/t) E[Σ_{i∈M} log p]`` is then
      a polynomial of degree n − 1 in t, so the expectation equals the ELBO exactly once ``K ≥ n/2``. K·draws
      forwards.
    * ``"mean_field"`` (d1 / diffu-GRPO): the completion fully masked, each real prompt token masked with probability
      ``prompt_mask_prob`` (fresh per pass), ``coef = 1/K``: ``Σ_i log p(y_i | c̃, all masked)`` — no bound, the
      one-step factorised likelihood. K forwards.
    * ``"eubo"`` (SPG): ``"elbo_discrete"``'s masks with ``coef_k = n / l_k``, combined as
      ``(1/β) log((1/K) Σ_k coef_k 1[i ∈ M_k] p_i^β)`` per token, β = ``eubo_beta`` (:func:`combine_logps`).
      K forwards.

    Args:
        estimator: one of the five above (``"elbo"`` draws from the kernel inside
            :func:`~unifusion.rl.sequence_logprob`).
        completion_mask: ``(B, L)`` bool, the scored tokens; every row needs one.
        num_samples: K ≥ 1.
        generator: one ``torch.Generator`` or one per row (module docstring); ``None``: the global RNG.
        row_offset: the global index of row 0 (data-parallel ranks).
        prompt_mask: ``(B, L)`` bool, the real prompt tokens (``"mean_field"`` corrupts them); default ``~completion``.
        prompt_mask_prob: ``"mean_field"``'s prompt corruption probability.
        t_range: ``"coupled"``'s time range (a, b).
        fully_masked: ``"coupled"``: add DiffuCoder's fully masked pass.
        masks: ``"quadrature"``'s masks, ``"exact_count"`` or ``"bernoulli"``.
        draws: ``"quadrature"``'s masks per node.
        eubo_beta: ``"eubo"``'s β (SPG's; the bound needs β ≥ 1).

    Returns:
        :class:`MaskPlan` with K passes (``2K`` or ``2K + 1`` for ``"coupled"``, ``K·draws`` for ``"quadrature"``).
    """
    if estimator not in _PLANNED:
        raise ValueError(f"estimator: plan_masks makes the masks of {_PLANNED}, got {estimator!r}")
    K = V.check_positive_int("num_samples", num_samples)
    completion = _check_completion(completion_mask)
    B, L = completion.shape
    device = completion.device
    gens = row_generators(generator, B, device, row_offset=row_offset)
    n = completion.sum(-1).to(torch.float64)  # (B,)
    u = _uniforms(gens, (1,), device)[:, 0]  # (B,)
    k = torch.arange(K, device=device, dtype=torch.float64)[:, None]  # (K, 1)
    frac = (k + u[None, :]) / K  # (K, B) stratified in [0, 1)

    if estimator in ("elbo_discrete", "eubo"):
        r = _uniforms(gens, (K, L), device).transpose(0, 1)  # (K, B, L)
        count = torch.minimum(torch.floor(n * frac) + 1, n)  # (K, B) in 1..n, stratified
        return plan_from_masks(estimator, completion, _exact_count(r, completion, count.long()), eubo_beta=eubo_beta)

    if estimator == "coupled":
        a, b = _check_t_range(t_range)
        t = a + (b - a) * frac  # (K, B)
        r = _uniforms(gens, (K, L), device).transpose(0, 1)  # (K, B, L)
        return plan_from_masks(estimator, completion, r < t[..., None], t=t, fully_masked=fully_masked)

    if estimator == "quadrature":
        D = V.check_positive_int("draws", draws)
        if masks not in ("exact_count", "bernoulli"):
            raise ValueError(f"masks: expected 'exact_count' (GDPO) or 'bernoulli', got {masks!r}")
        nodes, _ = gauss_legendre(K)
        t = torch.tensor(np.repeat(nodes, D), dtype=torch.float64, device=device)[:, None].expand(K * D, B)
        r = _uniforms(gens, (K * D, L), device).transpose(0, 1)  # (K·D, B, L)
        if masks == "exact_count":
            count = torch.minimum(torch.round(n * t).clamp_min(1), n)  # GDPO's rule
            chosen = _exact_count(r, completion, count.long())
        else:
            chosen = r < t[..., None]
        return plan_from_masks(estimator, completion, chosen, num_nodes=K, draws=D)

    # mean_field
    p = prompt_mask_prob
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"prompt_mask_prob: expected a float in [0, 1], got {p!r}")
    prompt = ~completion if prompt_mask is None else prompt_mask.to(device=device, dtype=torch.bool) & ~completion
    r = _uniforms(gens, (K, L), device).transpose(0, 1)  # (K, B, L)
    return plan_from_masks(estimator, completion, completion[None] | (prompt[None] & (r < p)))


def plan_from_masks(estimator: str, completion_mask: torch.Tensor, masks: torch.Tensor, *,
                    t: torch.Tensor | None = None, fully_masked: bool = False, num_nodes: int | None = None,
                    draws: int = 1, eubo_beta: float = 1.5) -> MaskPlan:
    """The plan of given masks ``(K, B, L)`` bool with the estimator's weights (:func:`plan_masks` draws the masks
    and calls this; given masks reproduce another code's draws exactly).

    * ``"elbo_discrete"``: ``coef_k = n / (K l_k)``, ``l_k = |M_k ∩ completion|`` (≥ 1 per pass); ``"eubo"``:
      ``coef_k = n / l_k``, ``t_k = l_k / n``.
    * ``"coupled"``: ``masks`` are the first sets M_k; ``t`` ``(K, B)`` their times; the passes are M_k
      (``coef = 1/(2K t_k)``), ``completion ∖ M_k`` (``coef = 1/(2K (1 − t_k))``) and with ``fully_masked`` the
      whole completion (``coef = ½``).
    * ``"quadrature"``: ``num_nodes · draws`` masks, node-major (node j's draws together); node j's time and weight
      from :func:`gauss_legendre`, ``coef = w_j / (draws · t_j)``.
    * ``"mean_field"``: ``masks`` are the corrupted positions (the completion and any prompt tokens);
      ``coef = 1/K``, every completion token scored.
    """
    completion = _check_completion(completion_mask)
    if not isinstance(masks, torch.Tensor) or masks.dim() != 3 or tuple(masks.shape[1:]) != tuple(completion.shape):
        got = tuple(masks.shape) if isinstance(masks, torch.Tensor) else type(masks).__name__
        raise ValueError(f"masks: expected (K, B, L) bool with (B, L) = {tuple(completion.shape)}, got {got}")
    masks = masks.to(device=completion.device, dtype=torch.bool)
    K, B, L = masks.shape
    device = completion.device
    n = completion.sum(-1).to(torch.float64)  # (B,)
    if estimator in ("elbo_discrete", "eubo"):
        scored = masks & completion
        count = scored.sum(-1).to(torch.float64)  # (K, B)
        V.fail_if((count == 0).any(), lambda: "masks: a pass masks no completion token (l = 0)")
        coef = n / count if estimator == "eubo" else n / (K * count)
        return MaskPlan(scored, scored, coef, count / n, estimator,
                        eubo_beta=_check_eubo_beta(eubo_beta) if estimator == "eubo" else 1.0)
    if estimator == "coupled":
        if not isinstance(fully_masked, bool):
            raise TypeError(f"fully_masked: expected a bool, got {type(fully_masked).__name__}")
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (K, B):
            raise ValueError(f"t: the coupled plan needs the times of its masks, shape {(K, B)}")
        t = t.to(device=device, dtype=torch.float64)
        m1 = masks & completion
        m2 = completion & ~masks
        noised, coefs, times = [m1, m2], [1.0 / (2 * K * t), 1.0 / (2 * K * (1.0 - t))], [t, 1.0 - t]
        if fully_masked:
            noised.append(completion[None])
            coefs.append(torch.full((1, B), 0.5, dtype=torch.float64, device=device))
            times.append(torch.ones(1, B, dtype=torch.float64, device=device))
        nz = torch.cat(noised)
        return MaskPlan(nz, nz, torch.cat(coefs), torch.cat(times), estimator)
    if estimator == "quadrature":
        D = V.check_positive_int("draws", draws)
        J = K // D if num_nodes is None else V.check_positive_int("num_nodes", num_nodes)
        if J * D != K:
            raise ValueError(f"masks: expected num_nodes · draws = {J} · {D} passes, got {K}")
        nodes, weights = gauss_legendre(J)
        tq = torch.tensor(np.repeat(nodes, D), dtype=torch.float64, device=device)[:, None].expand(K, B)
        w = torch.tensor(np.repeat(weights, D), dtype=torch.float64, device=device)[:, None]
        scored = masks & completion
        return MaskPlan(scored, scored, (w / (D * tq)).expand(K, B).clone(), tq.clone(), estimator)
    if estimator == "mean_field":
        scored = completion[None].expand(K, B, L)
        coef = torch.full((K, B), 1.0 / K, dtype=torch.float64, device=device)
        return MaskPlan(masks | scored, scored, coef, torch.ones(K, B, dtype=torch.float64, device=device),
                        estimator)
    raise ValueError(f"estimator: plan_from_masks makes the plans of {_PLANNED}, got {estimator!r}")


@dataclass(frozen=True)
class TracePlan:
    """The passes that replay a decoder's commit order (:func:`plan_trace`).

    Attributes:
        noised: ``(K, B, L)`` bool, the positions pass k masks: the group it scores (per block), every group committed
            after it, and the generated positions the decoder never committed (step −1 after the first one).
        scored: ``(K, B, L)`` bool, the completion positions of the group each row (each block) contributes in pass k:
            the k-th distinct commit step.
        t: ``(B, L)`` float64, the time the decoder gave the model when it committed each position: the fraction of
            the row's generated positions still masked then, ``(#{j : step_j ≥ step_i} + #{never committed}) /
            #generated``, clamped to ``[TIME_EPS, 1 − TIME_EPS]`` (0.5 before the generated region).
    """

    noised: torch.Tensor
    scored: torch.Tensor
    t: torch.Tensor

    @property
    def num_passes(self) -> int:
        """K, the forwards the replay costs: the most distinct steps of one block (of one row without blocks) up to
        the last scored one."""
        return int(self.noised.shape[0])


def plan_trace(trace: torch.Tensor, completion_mask: torch.Tensor, *, block_size: int | None = None,
               origin: torch.Tensor | None = None) -> TracePlan:
    """The replay of a decoder's order (TraceRL): the positions committed at one step form a group G_s, scored given
    the prompt and the groups committed before it, every later group masked:

        log p_θ(y | c; order) = Σ_s Σ_{i ∈ G_s ∩ completion} log x_θ,i(y_i | c, y_{G_<s}, mask elsewhere).

    The generated region of a row starts at its first column with a step or in the completion (the decoder's first
    generated column); there the trace decides what each pass sees — committed positions (step ≥ 0) are clean
    before their step and masked from it on, whether scored or not, and positions without a step (the fill after
    an EOS, which the decoder saw masked until the row stopped) stay masked. Columns before it are the prompt.

    Without blocks (a fully bidirectional model) pass k scores every row's k-th group (its steps in ascending
    order). With ``block_size`` K the region is cut into blocks of K positions counted from ``origin`` (the
    decoder's blocks: by default from the region's first column; from the row's first real token for a
    ``"sequence_start"`` kind, :mod:`unifusion.block_partition`); a block model's prediction for a block sees only the
    clean blocks before it, so pass k scores the k-th group of *every* block at once, each block at its own state: as
    many passes as the most steps one block took.

    Args:
        trace: ``(B, L)`` integer commit steps (:attr:`unifusion.samplers.PolicyOutput.commit_step`): positions with
            equal steps were committed together, smaller steps earlier, ``-1`` where nothing was committed; every
            completion position needs a step ``≥ 0``.
        completion_mask: ``(B, L)`` bool, the scored tokens.
        block_size: the decoder's block size for a block model, ``None`` otherwise.
        origin: ``(B,)`` int64, the column each row's blocks are counted from (at most the region's first column;
            :func:`unifusion.block_partition.origin_columns`), ``None``: the region's first column.

    Returns:
        :class:`TracePlan`. One host read (the number of passes).
    """
    completion = _check_completion(completion_mask)
    B, L = completion.shape
    if not isinstance(trace, torch.Tensor) or not V.is_integer_dtype(trace.dtype) or tuple(trace.shape) != (B, L):
        got = (f"{tuple(trace.shape)} {trace.dtype}" if isinstance(trace, torch.Tensor) else type(trace).__name__)
        raise ValueError(f"trace: expected a ({B}, {L}) integer tensor of commit steps like input_ids "
                         f"(PolicyOutput.commit_step), got {got}")
    K = None if block_size is None else V.check_positive_int("block_size", block_size)
    step = trace.to(device=completion.device, dtype=torch.long)
    missing = completion & (step < 0)
    V.fail_if(missing.any(), lambda: (
        f"trace: completion positions without a commit step (-1) in rows "
        f"{missing.any(-1).nonzero().flatten().tolist()[:8]}; every scored token needs the step it was committed "
        "at (leave uncommitted positions, e.g. the fill after EOS, out of completion_mask)"))
    col = torch.arange(L, device=step.device)
    start = torch.where(completion | (step >= 0), col, L).amin(-1, keepdim=True)  # (B, 1) the generated region
    region = col >= start
    committed = region & (step >= 0)
    never = region & (step < 0)
    if origin is not None and (not isinstance(origin, torch.Tensor) or tuple(origin.shape) != (B,)):
        raise ValueError(f"origin: expected a ({B},) int64 tensor of columns, got "
                         f"{tuple(origin.shape) if isinstance(origin, torch.Tensor) else type(origin).__name__}")
    o = start if origin is None else origin.to(step.device, torch.long)[:, None]  # (B, 1) where blocks are counted
    if origin is not None:
        V.fail_if((o > start).any(), lambda: "origin: expected columns at most each row's generated start")
    block = torch.zeros_like(step) if K is None else (col - o).div(K, rounding_mode="floor")
    # the rank of each committed position's step among the distinct steps of its (row, block): its pass
    same = committed[:, :, None] & committed[:, None, :] & (block[:, :, None] == block[:, None, :])  # (B, L, L)
    earlier_equal = same & (step[:, :, None] == step[:, None, :]) & (col[:, None] > col[None, :])
    first = committed & ~earlier_equal.any(-1)  # (B, L): the first position of each distinct step
    rank = (same & first[:, None, :] & (step[:, None, :] < step[:, :, None])).sum(-1)  # (B, L)
    rank = torch.where(committed, rank, -1)
    num_passes = int(torch.where(completion, rank, -1).max().item()) + 1
    k = torch.arange(num_passes, device=step.device)[:, None, None]
    noised = never[None] | (committed[None] & (rank[None] >= k))
    scored = completion[None] & (rank[None] == k)
    n = region.sum(-1, keepdim=True).to(torch.float64)  # (B, 1)
    later = (committed[:, None, :] & (step[:, None, :] >= step[:, :, None])).sum(-1).to(torch.float64)  # (B, L)
    masked = (later + never.sum(-1, keepdim=True)) / n.clamp_min(1.0)
    t = torch.where(committed, masked.clamp(TIME_EPS, 1.0 - TIME_EPS), 0.5)
    return TracePlan(noised=noised, scored=scored, t=t)


def combine_logps(plan: MaskPlan, logps: torch.Tensor) -> torch.Tensor:
    """Per-token estimates ``(B, L)`` from the passes' log-probs ``logps (K, B, L)`` = ``log p_θ(y_i | x^{(k)})``
    (any value where not scored): the linear sum ``Σ_k coef_k 1[i ∈ S_k] log p`` or, for ``"eubo"``,
    ``(1/β) log((1/K) Σ_k coef_k 1[i ∈ S_k] exp(β log p))`` in log space (0 where no pass scored token i).
    Float32 at least (float64 for float64 input); 0 outside the completion."""
    dtype = torch.promote_types(logps.dtype, torch.float32)
    lp = logps.to(dtype)
    S = plan.scored
    if tuple(lp.shape) != tuple(S.shape):
        raise ValueError(f"logps: expected shape {tuple(S.shape)} (passes, B, L) like the plan, got "
                         f"{tuple(lp.shape)}")
    coef = plan.coef.to(dtype)[..., None]  # (K, B, 1)
    if plan.estimator != "eubo":
        return torch.where(S, coef * lp, torch.zeros((), dtype=dtype, device=lp.device)).sum(0)
    beta, K = plan.eubo_beta, S.shape[0]
    a = torch.where(S, torch.log(coef) + beta * lp, torch.full((), -math.inf, dtype=dtype, device=lp.device))
    lse = torch.logsumexp(a, 0) - math.log(K)  # (B, L)
    hit = S.any(0)
    return torch.where(hit, torch.where(hit, lse, torch.zeros_like(lse)) / beta, torch.zeros_like(lse))


def _check_completion(completion_mask: object) -> torch.Tensor:
    if not isinstance(completion_mask, torch.Tensor):
        raise TypeError(f"completion_mask: expected a (B, L) bool tensor, got {type(completion_mask).__name__}")
    if completion_mask.dim() != 2:
        raise ValueError(f"completion_mask: expected shape (B, L), got {tuple(completion_mask.shape)}")
    if completion_mask.dtype != torch.bool:
        raise TypeError(f"completion_mask: expected dtype torch.bool (True = scored token), got "
                        f"{completion_mask.dtype}")
    empty = ~completion_mask.any(-1)
    V.fail_if(empty.any(), lambda: (
        f"completion_mask: covers no token in rows {empty.nonzero().flatten().tolist()[:8]}; every row needs a "
        "completion token to score"))
    return completion_mask


def _check_t_range(t_range: object) -> tuple[float, float]:
    if not (isinstance(t_range, (tuple, list)) and len(t_range) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in t_range)
            and 0.0 <= t_range[0] < t_range[1] <= 1.0):
        raise ValueError(f"t_range: expected (a, b) with 0 <= a < b <= 1, got {t_range!r}")
    return float(t_range[0]), float(t_range[1])


def _check_eubo_beta(eubo_beta: object) -> float:
    if isinstance(eubo_beta, bool) or not isinstance(eubo_beta, (int, float)) or not eubo_beta > 0:
        raise ValueError(f"eubo_beta: expected a float > 0 (SPG's β; the bound needs β >= 1), got {eubo_beta!r}")
    return float(eubo_beta)
