"""Decoding policies that reproduce the released diffusion LMs' own samplers token for token, their random draws
included: ``model.generate(prompt, policy=...)`` gives the reference's tokens, with everything ``generate`` adds (the
prefix cache, EOS stopping, rollout traces, scores).

=====================================  ====================================================================
policy                                 reproduces (``generate`` arguments)
=====================================  ====================================================================
:class:`LLaDAOrder` ``(remasking)``    LLaDA's ``generate.py`` (also dllm's MDLM sampler): ``block_size=block_length,
                                       num_steps=steps // num_blocks``, ``do_sample=False`` for ``temperature=0``
                                       else ``temperature=T``; ``cfg_scale=w``; ``eos_token_id=None``
:class:`DreamOrder` ``(alg, alg_temp)``  Dream's ``diffusion_generate``: ``num_steps=steps``, ``eps`` in the policy,
                                       ``do_sample=False`` for ``temperature=0``, ``top_p``/``top_k``;
                                       ``eos_token_id=None``
:class:`SDAROrder` ``(strategy, τ)``   SDAR's ``block_diffusion_generate`` on prompts of whole blocks:
                                       ``num_steps=denoising_steps``, ``temperature``/``top_k``/``top_p`` (greedy is
                                       ``top_k=1``); ``eos_token_id=None``
:class:`FastDLLMv2Order` ``(τ, s)``    Fast-dLLM v2's threshold decoder in sub-blocks on prompts of > K tokens:
                                       ``do_sample=False``, ``eos_token_id=None``
=====================================  ====================================================================

Each draws from ``generator`` what the reference draws from the global generator, in its order and shapes, so a
generator seeded like ``torch.manual_seed`` before the reference gives its tokens (with one shared generator; a list
of per-row generators draws each row's share alone). The references' conventions are kept — their confidences read
from the softmax over the whole vocabulary, the mask token included — with one exception: a candidate is never the
mask token (the references can draw it, which leaves the position masked; here the mask state is left out of the
choice), so the tokens are the reference's whenever its draws never pick its mask token.

Draw shapes: LLaDA draws over the whole sequence, ``(B, L, V)`` float64 Gumbel uniforms per step at ``T > 0`` (its
memory cost too) and ``(B, L)`` random confidences; Dream and SDAR draw through ``torch.multinomial``, whose draw is
``argmax(p / q)`` with ``q ~ Exp(1)`` of the probabilities' shape (top ``n``: the ``n`` largest): Dream's over its
masked positions flattened across the batch, SDAR's over every position of the block. Dream's draws read their sizes
back to the host (one sync per step).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .protocol import BlockStep, MaskPolicy, RowRandomness, select_top
from .schedules import EvenSplit, TimeGrid, TransferSchedule

__all__ = ["DREAM_ALGORITHMS", "LLADA_REMASKING", "SDAR_STRATEGIES", "DreamOrder", "FastDLLMv2Order", "LLaDAOrder",
           "SDAROrder", "dream_probs", "sdar_probs"]

LLADA_REMASKING = ("low_confidence", "random")
"""LLaDA's ``remasking`` values."""

DREAM_ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")
"""Dream's ``alg`` values."""

SDAR_STRATEGIES = ("low_confidence_dynamic", "low_confidence_static", "sequential")
"""SDAR's ``remasking_strategy`` values (its ``"entropy_bounded"`` branch reads an undefined variable)."""


def _columns(where: BlockStep, who: str) -> tuple[torch.Tensor, int]:
    if where.columns is None or where.seq_len is None:
        raise ValueError(f"where: {who} draws over the whole sequence and needs the block's columns and the sequence "
                         "length (BlockStep(columns=..., seq_len=...)), as PolicySampler passes them")
    return where.columns.clamp_max(where.seq_len - 1), where.seq_len


def _without_mask(scores: torch.Tensor, mask_id: int | None, fill: float) -> torch.Tensor:
    """``scores`` ``(..., V)`` with the mask state's entry set to ``fill`` (never the candidate)."""
    if mask_id is None:
        return scores
    return scores.index_fill(-1, torch.tensor([mask_id], device=scores.device), fill)


def _drawn_probability(probs: torch.Tensor, tokens: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """The probability ``(B, K)`` of ``tokens`` under ``probs`` ``(B, K, V)`` without the mask state (renormalised):
    the distribution the candidates are drawn from, which a rollout trace records."""
    p = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if mask_id is None:
        return p
    return p / (1 - probs[..., mask_id]).clamp_min(torch.finfo(probs.dtype).tiny)


def _flat_draw(randomness: RowRandomness, selected: torch.Tensor,
               make: Callable[[tuple[int, ...], torch.Generator | None], torch.Tensor],
               trailing: tuple[int, ...]) -> torch.Tensor:
    """``(B, K, *trailing)``: one draw over the ``selected`` ``(B, K)`` positions flattened row-major (``make((n,
    *trailing), generator)``; per-row generators: each row's share), ones elsewhere. One host sync (the counts)."""
    counts = selected.sum(-1).tolist()
    if randomness.per_row:
        generators = randomness.generator
        assert isinstance(generators, tuple)
        flat = torch.cat([make((c, *trailing), g) for c, g in zip(counts, generators)])
    else:
        flat = make((sum(counts), *trailing), randomness.generator)  # type: ignore[arg-type]
    out = torch.ones((*selected.shape, *trailing), dtype=flat.dtype, device=flat.device)
    out[selected] = flat
    return out


def _exponential(shape: tuple[int, ...], g: torch.Generator | None, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, device=device).exponential_(1, generator=g)


def _multinomial_at(randomness: RowRandomness, selected: torch.Tensor, probs: torch.Tensor,
                    mask_id: int | None) -> torch.Tensor:
    """One draw per ``selected`` position from ``probs`` ``(B, K, V)``, as ``torch.multinomial(probs[selected], 1)``
    draws it (``argmax(p / q)``, q ~ Exp(1) ``(n, V)``), the mask state left out of the argmax; ``(B, K)``."""
    q = _flat_draw(randomness, selected, lambda s, g: _exponential(s, g, probs.device), (probs.shape[-1],))
    return _without_mask(probs / q, mask_id, -1.0).argmax(-1)


def _top_columns(score: torch.Tensor, k: int, count: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``(B, K)`` bool at the block columns ``cols``: the first ``count[b]`` of ``torch.topk(score, k)`` over the
    ``(B, L)`` scores (the references' ``torch.topk``, its ties broken as theirs), ``k`` the largest count."""
    B, L = score.shape
    top = score.topk(k, -1).indices  # (B, k), best first
    keep = torch.arange(k, device=score.device) < count.unsqueeze(-1)
    chosen = torch.zeros((B, L + 1), dtype=torch.bool, device=score.device)
    chosen.scatter_(1, torch.where(keep, top, L), True)
    return chosen.gather(1, cols)


class LLaDAOrder(MaskPolicy):
    """LLaDA's ``generate.py`` (``remasking="low_confidence"`` or ``"random"``), its draws included.

    At each step: candidates x̂ = argmax of exp(z) / (−log u)^T with u ~ U[0, 1) in float64 drawn over the whole
    ``(B, L, V)`` sequence (Gumbel-max at the temperature; the argmax of z with ``do_sample=False``); confidence
    softmax(z)(x̂) at temperature 1 over the whole vocabulary (``"low_confidence"``) or U[0, 1) drawn over ``(B, L)``
    (``"random"``); the ``num_commit`` most confident masked positions commit (its even split, :class:`EvenSplit
    <unifusion.samplers.policies.schedules.EvenSplit>`). z are the model's logits (guided ones with
    ``generate(cfg_scale=w)``). LLaDA has no top-k/top-p: passing either is a ``ValueError``.

    The trace records log x_θ(x̂) with x_θ = softmax(z / T) without the mask state: the distribution x̂ is drawn from.

    dllm's ``MDLMSampler`` (LLaDA's and LLaDA-MoE's sampler there) is the same step with its own counts:
    ``LLaDAOrder(schedule=RoundedSplit())`` (:class:`~unifusion.samplers.policies.schedules.RoundedSplit`; equal to
    the default whenever the steps divide the block). It right-pads shorter prompts with EOS where ``generate``
    left-pads, so its sampled draws land on other columns unless the prompts have one length.

    Args:
        remasking: ``"low_confidence"`` (default) or ``"random"``.
        schedule: the per-step counts (default :class:`~unifusion.samplers.policies.schedules.EvenSplit`, LLaDA's).
    """

    def __init__(self, remasking: str = "low_confidence", *, schedule: TransferSchedule | None = None) -> None:
        super().__init__(schedule=schedule)
        if remasking not in LLADA_REMASKING:
            raise ValueError(f"remasking: expected one of {LLADA_REMASKING}, got {remasking!r}")
        self.remasking = remasking

    def __repr__(self) -> str:
        schedule = "" if self.schedule == EvenSplit() else f", schedule={self.schedule!r}"
        return f"LLaDAOrder(remasking={self.remasking!r}{schedule})"

    def decide(self, logits: torch.Tensor, undecided: torch.Tensor, num_commit: torch.Tensor,
               randomness: RowRandomness, where: BlockStep, *, mask_id: int | None, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, do_sample: bool = True,
               hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if top_k is not None or (top_p is not None and top_p < 1.0):
            raise ValueError(f"top_k, top_p: LLaDA's sampler truncates nothing, got top_k={top_k}, top_p={top_p}")
        cols, L = _columns(where, "LLaDAOrder")
        B, K, V = logits.shape
        dev = logits.device
        noisy = logits
        if do_sample:
            u = randomness.draw(lambda s, g: torch.rand(s, dtype=torch.float64, device=dev, generator=g), (L, V))
            u = u.gather(1, cols.unsqueeze(-1).expand(-1, -1, V))
            noisy = logits.to(torch.float64).exp() / (-torch.log(u)) ** temperature
        tokens = _without_mask(noisy, mask_id, -math.inf).argmax(-1)
        if self.remasking == "low_confidence":
            confidence = logits.softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        else:
            confidence = randomness.rand((L,), dev).gather(1, cols)
        commit = select_top(confidence, undecided, num_commit)
        x_theta = _without_mask(logits.float() / temperature, mask_id, -math.inf).log_softmax(-1)
        return tokens, commit, x_theta.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).exp()


def dream_probs(logits: torch.Tensor, temperature: float | None, top_p: float | None,
                 top_k: int | None) -> torch.Tensor:
    """Dream's ``sample_tokens`` distribution ``(..., V)`` float32: logits / T, then top-p (the smallest prefix of
    the sorted distribution whose mass exceeds p, the first token kept), then top-k, dropped entries at the dtype's
    minimum; softmax over the whole vocabulary."""
    z = logits.float()
    if temperature is not None:
        z = z / temperature
    low = torch.finfo(z.dtype).min
    if top_p is not None and top_p < 1:
        ordered, order = z.sort(-1, descending=True)
        drop = ordered.softmax(-1).cumsum(-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        z = z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), low)
    if top_k is not None:
        kth = z.topk(min(top_k, z.shape[-1]), -1).values[..., -1:]
        z = z.masked_fill(z < kth, low)
    return z.softmax(-1)


class DreamOrder(MaskPolicy):
    """Dream's ``diffusion_generate`` (``alg`` ``"origin"``, ``"maskgit_plus"``, ``"topk_margin"``, ``"entropy"``,
    with ``alg_temp``), its draws included, on its time grid t_k = linspace(1, ε, N + 1).

    At step i (s = t_{i+1}, t = t_i), x_θ = Dream's softmax over the whole vocabulary of logits / T after top-p then
    top-k (``do_sample=False``: T = 1, the argmax candidate):

    * ``"origin"``: each masked position commits with probability 1 − s/t (1 at the last step; U[0, 1) draws over
      the masked positions), its token drawn from x_θ;
    * the others: a candidate per masked position (``torch.multinomial`` over the masked positions, or the argmax)
      and a confidence — x_θ(x̂), the top-two margin, or Σ p log(p + 1e-10) — and the n_i = ⌊r (1 − s/t)⌋ most
      confident commit (all at the last step; :class:`TimeGrid <unifusion.samplers.policies.schedules.TimeGrid>`);
      with ``alg_temp`` the n_i are drawn without replacement from softmax(confidence / alg_temp) over the sequence.

    ``num_steps`` may exceed the generated length (early steps commit nothing, as Dream's).

    Args:
        alg: one of :data:`DREAM_ALGORITHMS` (default ``"maskgit_plus"``).
        alg_temp: ``None`` or 0 (the top n_i) or a temperature > 0 for drawing the positions.
        eps: the grid's last time ε (Dream's ``eps``).
    """

    def __init__(self, alg: str = "maskgit_plus", *, alg_temp: float | None = None, eps: float = 1e-3) -> None:
        super().__init__(schedule=TimeGrid(eps))
        if alg not in DREAM_ALGORITHMS:
            raise ValueError(f"alg: expected one of {DREAM_ALGORITHMS}, got {alg!r}")
        if alg_temp is not None and (isinstance(alg_temp, bool) or not isinstance(alg_temp, (int, float))
                                     or not (math.isfinite(alg_temp) and alg_temp >= 0)):
            raise ValueError(f"alg_temp: expected None or a finite float >= 0, got {alg_temp!r}")
        self.alg = alg
        self.alg_temp = float(alg_temp) if alg_temp else None
        self.eps = float(eps)

    def __repr__(self) -> str:
        return f"DreamOrder(alg={self.alg!r}, alg_temp={self.alg_temp}, eps={self.eps})"

    def decide(self, logits: torch.Tensor, undecided: torch.Tensor, num_commit: torch.Tensor,
               randomness: RowRandomness, where: BlockStep, *, mask_id: int | None, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, do_sample: bool = True,
               hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = dream_probs(logits, temperature if do_sample else None, top_p, top_k)  # (B, K, V)
        dev = logits.device
        if self.alg == "origin":
            last = where.index >= where.num_steps - 1
            t = torch.linspace(1, self.eps, where.num_steps + 1, device=dev)
            u = _flat_draw(randomness, undecided, lambda s, g: torch.rand(s, device=dev, generator=g), ())
            commit = undecided & (u < (1.0 if last else 1 - t[where.index + 1] / t[where.index]))
            chosen = commit
        else:
            chosen = undecided
        if do_sample:
            tokens = _multinomial_at(randomness, chosen, probs, mask_id)
        else:
            tokens = _without_mask(probs, mask_id, -1.0).argmax(-1)
        p = _drawn_probability(probs, tokens, mask_id)
        if self.alg == "origin":
            return tokens, commit, p
        if self.alg == "topk_margin":
            top = probs.topk(2, -1).values
            confidence = top[..., 0] - top[..., 1]
        elif self.alg == "entropy":
            confidence = (probs * torch.log(probs + 1e-10)).sum(-1)
        else:
            confidence = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return tokens, self._positions(confidence, undecided, num_commit, randomness, where), p

    def _positions(self, confidence: torch.Tensor, undecided: torch.Tensor, num_commit: torch.Tensor,
                   randomness: RowRandomness, where: BlockStep) -> torch.Tensor:
        """The ``num_commit`` positions of highest confidence, or (``alg_temp``) drawn without replacement from
        softmax(confidence / alg_temp): Dream's ``torch.topk`` / ``torch.multinomial`` over the sequence's ``(B, L)``
        confidences (−∞ where nothing is masked), so that ties (a confidence of 1 after top-p) break as Dream's do.
        Nothing is drawn on a step that commits nothing (one host sync: the count)."""
        cols, L = _columns(where, "DreamOrder")
        B, K = confidence.shape
        k = int(num_commit.max())
        if k <= 0:
            return torch.zeros_like(undecided)
        full = torch.full((B, L + 1), -torch.inf, device=confidence.device)
        full.scatter_(1, torch.where(undecided, cols, L), torch.where(undecided, confidence.float(), -torch.inf))
        score = full[:, :L]
        if self.alg_temp is not None:
            score = (score / self.alg_temp).softmax(-1) / randomness.exponential((L,), confidence.device)
        return _top_columns(score, k, num_commit, cols) & undecided


def sdar_probs(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """SDAR's candidate distribution ``(..., V)`` float32: ``softmax`` of ``logits`` / T after top-k (logits below
    the k-th largest → −∞; ``None`` or 0: off) and top-p (the smallest prefix of the sorted distribution whose mass
    exceeds p, the first token always kept; ``None`` or ≥ 1: off)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    if top_k:
        kth = torch.topk(z, top_k).values[..., -1:]
        z = z.masked_fill(z < kth, -torch.inf)
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(z, descending=True)
        beyond = torch.cumsum(torch.softmax(ordered, -1), -1) > top_p
        beyond[..., 1:] = beyond[..., :-1].clone()
        beyond[..., 0] = False
        z = z.masked_fill(torch.zeros_like(beyond).scatter(-1, order, beyond), -torch.inf)
    return torch.softmax(z, -1)


class SDAROrder(MaskPolicy):
    """SDAR's ``block_diffusion_generate`` (``remasking_strategy``), its draws included.

    At each step of a block of K positions: x_θ = softmax(logits / T after top-k, then top-p; −∞ outside) over the
    whole vocabulary; a candidate per position of the block, ``torch.multinomial`` over all ``B·K`` positions (greedy
    is ``top_k=1``: one token left); confidence x_θ(x̂). Step i transfers k_i of the block's even split of K over the
    steps (remainder first; fixed at the block's start, as SDAR's):

    * ``"sequential"``: the k_i first masked positions;
    * ``"low_confidence_static"``: the k_i most confident;
    * ``"low_confidence_dynamic"``: every masked position above ``threshold`` when at least k_i are, else the k_i
      most confident.

    SDAR's blocks start at column multiples of K, and so do ``generate``'s on SDAR (``block_origin=
    "sequence_start"``): its tokens are this policy's on any prompt length while SDAR's top-k stays inside the
    masked positions. Not reproduced: where it does not — a step that transfers more tokens than a row's block still
    has masked (a prompt-holding block, or a row whose block is done while another's is not, as happens with sampled
    dynamic remasking) picks unmasked columns too and re-writes their tokens, prompt tokens included; ``generate``
    never changes a committed token — and its ``stopping_criteria_idx`` (stop the whole batch after a block holding
    one of the ids; ``generate`` stops rows at EOS).

    Args:
        strategy: one of :data:`SDAR_STRATEGIES` (default ``"low_confidence_dynamic"``).
        threshold: SDAR's ``confidence_threshold`` (dynamic only; default 0.85).
    """

    def __init__(self, strategy: str = "low_confidence_dynamic", threshold: float = 0.85) -> None:
        super().__init__()
        if strategy not in SDAR_STRATEGIES:
            raise ValueError(f"strategy: expected one of {SDAR_STRATEGIES}, got {strategy!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise ValueError(f"threshold: expected a finite float, got {threshold!r}")
        self.strategy, self.threshold = strategy, float(threshold)

    def __repr__(self) -> str:
        return f"SDAROrder(strategy={self.strategy!r}, threshold={self.threshold})"

    def decide(self, logits: torch.Tensor, undecided: torch.Tensor, num_commit: torch.Tensor,
               randomness: RowRandomness, where: BlockStep, *, mask_id: int | None, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, do_sample: bool = True,
               hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, K, V = logits.shape
        probs = sdar_probs(logits, temperature, top_k, top_p)
        q = randomness.exponential((K, V), logits.device)  # SDAR's multinomial over the whole (B·K, V) block
        tokens = _without_mask(probs / q if do_sample else probs, mask_id, -1.0).argmax(-1)
        confidence = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        split = K // where.num_steps + int(where.index < K % where.num_steps)
        k = torch.full_like(num_commit, split)
        if self.strategy == "sequential":
            commit = undecided & (undecided.long().cumsum(-1) <= k.unsqueeze(-1))
        else:  # torch.topk over the block, as SDAR: ties (a confidence of 1 with top_k=1) break as theirs
            score = torch.where(undecided, confidence, -torch.inf)
            cols = torch.arange(K, device=logits.device).expand(B, K)
            commit = _top_columns(score, min(split, K), k, cols) & undecided
            if self.strategy == "low_confidence_dynamic":
                high = undecided & (confidence > self.threshold)
                commit = torch.where(high.sum(-1, keepdim=True) >= k.unsqueeze(-1), high, commit)
        return tokens, commit, _drawn_probability(probs, tokens, mask_id)


class FastDLLMv2Order(MaskPolicy):
    """Fast-dLLM v2's threshold decoder (``batch_sample`` of their ``generation_functions.py``, their model file's
    ``generate``), greedy, on prompts of whole blocks.

    A block of K positions starts with its first token by argmax alone (their AR step: the prediction of the previous
    block's last column, read from the pass that commits that block), then is decoded sub-block by sub-block
    (``small_block_size``
    positions each, left to right): each step reveals, in the row's first sub-block with masked positions, every
    masked position whose argmax has probability p > ``threshold`` (softmax over the whole vocabulary, float32) and
    the most confident masked one.

    Their blocks start at column multiples of K (a prompt's last block is decoded with the first new tokens), as
    ``generate``'s do on Fast-dLLM v2 (``block_origin="sequence_start"``), so their tokens are this policy's on
    prompts of more than K tokens, whole blocks or not (at K tokens or fewer their prefill, which needs more than K,
    is skipped and their first block is decoded without the prompt in its cache: not reproduced); ``generate`` returns
    ``P + max_new_tokens`` columns, their decoder one more (the next block's AR token). Their rows wait for each
    other at sub-block boundaries, which changes no row's tokens (a row's logits depend on that row only), only the
    forwards counted.

    Args:
        threshold: τ (their ``threshold``, default 0.9).
        small_block_size: positions per sub-block (their ``small_block_size``, default 8; it must divide the block).
    """

    fixed_count = False

    def __init__(self, threshold: float = 0.9, small_block_size: int = 8) -> None:
        super().__init__()
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise ValueError(f"threshold: expected a finite float, got {threshold!r}")
        if isinstance(small_block_size, bool) or not isinstance(small_block_size, int) or small_block_size < 1:
            raise ValueError(f"small_block_size: expected a positive int, got {small_block_size!r}")
        self.threshold, self.small_block_size = float(threshold), small_block_size

    def __repr__(self) -> str:
        return f"FastDLLMv2Order(threshold={self.threshold}, small_block_size={self.small_block_size})"

    def decide(self, logits: torch.Tensor, undecided: torch.Tensor, num_commit: torch.Tensor,
               randomness: RowRandomness, where: BlockStep, *, mask_id: int | None, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, do_sample: bool = True,
               hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if do_sample:
            raise ValueError("do_sample: Fast-dLLM v2's decoder is greedy; pass do_sample=False")
        B, K, V = logits.shape
        if K % self.small_block_size:
            raise ValueError(f"small_block_size: expected a divisor of the block size {K}, got "
                             f"{self.small_block_size}")
        cols, _ = _columns(where, "FastDLLMv2Order")
        probs = logits.float().softmax(-1)
        tokens = _without_mask(probs, mask_id, -1.0).argmax(-1)
        p = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        position = torch.arange(K, device=logits.device)
        # the AR step: a block whose first position is still masked, after a clean block their prefill cached
        ar = undecided[:, 0] & (cols[:, 0] > K)
        first_open = torch.where(undecided, position, K).amin(-1)  # (B,)
        sub = torch.div(first_open, self.small_block_size, rounding_mode="floor")
        current = undecided & (torch.div(position, self.small_block_size, rounding_mode="floor") == sub[:, None])
        score = torch.where(current, p, -torch.inf)
        best = torch.zeros_like(current).scatter_(1, score.argmax(-1, keepdim=True), True)
        commit = current & ((p > self.threshold) | best)
        commit = torch.where(ar[:, None], position == 0, commit)
        return tokens, commit, _drawn_probability(probs, tokens, mask_id)
