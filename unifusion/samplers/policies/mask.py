"""Decoding policies for absorbing (mask) noise: which masked positions of a block to commit at each step.

At every step the model gives x_θ(· | x_t) per position; the sampler applies temperature, top-k and top-p, draws one
candidate z_j ~ x_θ,j at every position j of the block, and the policy picks the set C of undecided positions to
commit (x_j ← z_j, final for the rest of the run). A policy is a confidence c_j and a rule:

=====================  ==============================================  ===================================
policy                 confidence c_j                                  commits
=====================  ==============================================  ===================================
:class:`RandomOrder`   U[0, 1) (a uniformly random order)              the n most confident
:class:`LowConfidence` x_θ,j(z_j), the drawn token's probability        the n most confident
:class:`TopKMargin`    p_(1) − p_(2), top-two margin of x_θ,j           the n most confident
:class:`TopKEntropy`   −H(x_θ,j) = Σ_v p_v log p_v                      the n most confident
:class:`ConfidenceThreshold`  x_θ,j(z_j)                                every c_j ≥ τ, and the n most confident
=====================  ==============================================  ===================================

n is the sampler's per-step count (``PolicyStep.num_commit``), the policy's transfer schedule
(:mod:`.schedules`): by default, with ``num_steps`` N per block and r undecided positions left at step i,
n = ⌈r / (N − i)⌉ — the even split of LLaDA's ``get_num_transfer_tokens`` (remainder first: 10 over 4 steps gives
3, 3, 2, 2), recomputed from the live count; ``schedule=TimeGrid(eps)`` gives Dream's. Ties in confidence go to
the lower position. Confidences are read from the same x_θ (after temperature/top-k/top-p) the candidates come from.

Example::

    sampler = uf.samplers.PolicySampler(model, uf.MaskKernel(V, mask_id), LowConfidence(), num_steps=16,
                                        block_size=32)
    tokens = sampler.sample(4, 128, prompt=prompt)
"""

from __future__ import annotations

import math

import torch

from .protocol import BlockStep, MaskPolicy, PolicyStep, RowRandomness, select_top

__all__ = ["ConfidenceThreshold", "LowConfidence", "RandomOrder", "TopKEntropy", "TopKMargin", "mask_step",
           "mask_step_with_probs"]


class RandomOrder(MaskPolicy):
    """Commit ``num_commit`` undecided positions chosen uniformly at random: LLaDA's ``remasking='random'``, the
    ancestral (MDLM) order. At one token per step with an exact x_θ this samples the model's joint exactly.

    Randomness: one ``(B, K)`` uniform draw per step, after the candidates (LLaDA: ``torch.rand`` over the sequence).
    """

    def confidence(self, step: PolicyStep) -> torch.Tensor:
        B, K = step.tokens.shape
        return step.randomness.rand((K,), step.tokens.device)


class LowConfidence(MaskPolicy):
    """LLaDA's low-confidence remasking (``generate.py``, ``remasking='low_confidence'``): commit the ``num_commit``
    undecided positions whose drawn token is most probable, c_j = x_θ,j(z_j).

    Differences from LLaDA: LLaDA draws z by Gumbel-max at the temperature but reads the confidence from the softmax
    of the raw logits (temperature 1); here both use the same x_θ after temperature/top-k/top-p (Dream's
    ``maskgit_plus``). LLaDA divides its ``steps`` over the blocks; here ``num_steps`` counts steps per block.
    Greedy, both give LLaDA's tokens; :class:`~.reference.LLaDAOrder` also gives its sampled ones.
    """

    def confidence(self, step: PolicyStep) -> torch.Tensor:
        return step.probs.gather(-1, step.tokens.unsqueeze(-1)).squeeze(-1)


class TopKMargin(MaskPolicy):
    """Dream's ``alg='topk_margin'``: c_j = p_(1) − p_(2), the gap between the two largest probabilities of x_θ,j
    (after temperature/top-k/top-p, as Dream). The token committed is the drawn candidate z_j.

    Dream commits ⌊r (1 − s/t)⌋ tokens on a grid t = linspace(1, ε, N + 1) (0 on some steps, all at the last):
    ``TopKMargin(schedule=TimeGrid(eps))``; by default ⌈r / steps left⌉ per row. Dream's own draws and conventions
    (the mask token in its softmax, its tie order, ``alg_temp``): :class:`~.reference.DreamOrder`.
    """

    def confidence(self, step: PolicyStep) -> torch.Tensor:
        top = step.probs.topk(2, dim=-1).values  # (B, K, 2); V ≥ 2 for any mask kernel
        return top[..., 0] - top[..., 1]


class TopKEntropy(MaskPolicy):
    """Dream's ``alg='entropy'``: c_j = −H(x_θ,j) = Σ_v p_v log p_v, lowest entropy first (x_θ after
    temperature/top-k/top-p). Exact here (0 log 0 = 0); Dream adds 1e-10 inside the log. Schedule as
    :class:`TopKMargin`.
    """

    def confidence(self, step: PolicyStep) -> torch.Tensor:
        return torch.special.xlogy(step.probs, step.probs).sum(-1)


class ConfidenceThreshold(MaskPolicy):
    """Fast-dLLM's threshold parallel decoding (``llada/generate.py``, ``get_transfer_index`` with ``threshold``):
    commit every undecided position whose drawn token has probability c_j = x_θ,j(z_j) ≥ ``threshold``, and always
    the most confident one, so every step makes progress.

    Adaptive: the number of steps per block is not fixed. With ``num_steps=None`` the sampler asks for at least one
    position per step (Fast-dLLM); with ``num_steps`` N it asks for at least ⌈r / steps left⌉, so a block never takes
    more than N steps. ``threshold=0`` commits a whole block in one forward; a threshold no position reaches commits
    one position per forward.

    Differences from Fast-dLLM: the confidence is read from x_θ after temperature/top-k/top-p (Fast-dLLM: the
    softmax of the raw logits, in float64); ties go to the lower position.

    Args:
        threshold: τ in [0, 1].
    """

    fixed_count = False

    def __init__(self, threshold: float) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise TypeError(f"threshold: expected a float in [0, 1], got {type(threshold).__name__}")
        if not (math.isfinite(threshold) and 0.0 <= threshold <= 1.0):
            raise ValueError(f"threshold: expected a probability in [0, 1], got {threshold}")
        self.threshold = float(threshold)

    def __repr__(self) -> str:
        return f"ConfidenceThreshold(threshold={self.threshold})"

    def confidence(self, step: PolicyStep) -> torch.Tensor:
        return step.probs.gather(-1, step.tokens.unsqueeze(-1)).squeeze(-1)

    def select(self, step: PolicyStep) -> torch.Tensor:
        c = self.confidence(step)
        return select_top(c, step.undecided, step.num_commit) | (step.undecided & (c >= self.threshold))


def mask_step(policy: MaskPolicy, logits: torch.Tensor, undecided: torch.Tensor, num_commit: torch.Tensor,
              randomness: RowRandomness, *, mask_id: int | None, temperature: float = 1.0, top_k: int | None = None,
              top_p: float | None = None, do_sample: bool = True, hidden: torch.Tensor | None = None,
              where: BlockStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of a mask policy on a block (:meth:`MaskPolicy.decide <.protocol.MaskPolicy.decide>`): by default
    x_θ = softmax(logits / T) with the mask state at 0, then top-k and top-p; one candidate per position (drawn from
    x_θ, or its argmax with ``do_sample=False``: greedy decoding, the policy still ranks positions by x_θ); the
    policy's commit set.

    Args:
        logits: the model's x0 logits at the block's positions ``(B, K, V)`` (any floating dtype).
        undecided: ``(B, K)`` bool, the masked positions of the block.
        num_commit: ``(B,)`` int64, the step's count (:class:`PolicyStep`).
        randomness: the default draw consumes one ``(B, K, 2)`` uniform draw for the candidates (two-level inverse
            CDF, :func:`unifusion.samplers._draws.sample_weights`), then whatever the policy draws.
        hidden: ``(B, K, d)`` the hidden states the logits came from, for a policy that reads them
            (:attr:`PolicyStep.hidden`).
        where: the step's place in its block (:class:`~.protocol.BlockStep`; default: step 0 of 1, no columns).

    Returns:
        ``(tokens (B, K) int64, commit (B, K) bool)``: the candidates and the positions to set to them.
    """
    tokens, commit, _ = mask_step_with_probs(policy, logits, undecided, num_commit, randomness, mask_id=mask_id,
                                             temperature=temperature, top_k=top_k, top_p=top_p, do_sample=do_sample,
                                             hidden=hidden, where=where)
    return tokens, commit


def mask_step_with_probs(policy: MaskPolicy, logits: torch.Tensor, undecided: torch.Tensor, num_commit: torch.Tensor,
                         randomness: RowRandomness, *, mask_id: int | None, temperature: float = 1.0,
                         top_k: int | None = None, top_p: float | None = None, do_sample: bool = True,
                         hidden: torch.Tensor | None = None, where: BlockStep | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`mask_step` (the same draws, the same tokens) that also returns each candidate's probability
    x_θ,j(z_j) ``(B, K)`` float32 under the distribution it was drawn from (after temperature, top-k and top-p; for
    ``do_sample=False`` the argmax's probability): what a rollout trace records for the committed positions."""
    tokens, commit, p = policy.decide(logits, undecided, num_commit, randomness, where or BlockStep(),
                                      mask_id=mask_id, temperature=temperature, top_k=top_k, top_p=top_p,
                                      do_sample=do_sample, hidden=hidden)
    return tokens, commit & undecided, p
