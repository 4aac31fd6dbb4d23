"""The record a decoding run returns (:meth:`~unifusion.samplers.PolicySampler.sample` with ``return_dict=True``, and
:func:`~unifusion.samplers.generate` with ``return_dict_in_generate=True``): the sequences, the model calls each row
took, and, where asked, the trace of when and from which distribution each generated token was committed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PolicyOutput"]


@dataclass
class PolicyOutput:
    """What :meth:`PolicySampler.sample` returns with ``return_dict=True``.

    Attributes:
        sequences: ``(B, L)`` int64, prompt included.
        num_forwards: ``(B,)`` int64, the model calls each row took part in: every denoising step, plus a
            :class:`BlockDenoiser`'s own calls (prefill, commit passes; its state's ``extra_forwards``).
        tokens_per_forward: ``(B,)`` float32, generated tokens (up to and including the first EOS) / num_forwards
            (0 for a row with nothing to generate).
        commit_step: with ``return_trace=True`` (else ``None``): ``(B, L)`` int64, the step at which each generated
            position was committed — the 0-based index of the row's model call whose logits it was drawn from, in
            the counting of ``num_forwards`` (a :class:`BlockDenoiser`'s prefill is call 0 and a separate commit
            pass takes an index too), so ``commit_step < num_forwards``; positions committed together share a step
            and a later block's steps are larger. ``-1`` at prompt positions and at positions the model did not
            commit: the fill after a row's EOS (or ``stopping`` column), whose tokens were replaced.
        commit_logprob: with ``return_trace=True``: ``(B, L)`` float32, ``log x_θ,j(z_j)`` of each committed token
            under the distribution it was drawn from (softmax(logits / T), mask state excluded, after top-k and
            top-p; with ``do_sample=False`` the argmax's probability under it); ``0`` where ``commit_step`` is
            ``-1``. ``commit_logprob.sum(-1)`` is the log-probability of the row's rollout under the decoder's own
            order (what :func:`unifusion.rl.sequence_logprob` with ``estimator="trace"`` replays).
        commit_logits: with ``return_logits=True``: ``(B, L, S)`` float32, the raw logits of the model call that
            committed each position (``0`` where ``commit_step`` is ``-1``).
        scores: from :func:`unifusion.samplers.generate` with ``output_scores=True`` (transformers' name and layout):
            one ``(B, S)`` float32 tensor per generated column, the log of the distribution its token was committed
            from (after temperature, the mask state, top-k and top-p: ``-inf`` outside it); 0 where nothing was
            committed (the fill after EOS). A diffusion model commits tokens in its own order, so entry ``j`` is the
            distribution at generated column ``j`` at the step that decided it, not the ``j``-th step's.
        logits: with ``output_logits=True``: the same columns' raw logits from that model call.
    """

    sequences: torch.Tensor
    num_forwards: torch.Tensor
    tokens_per_forward: torch.Tensor
    commit_step: torch.Tensor | None = None
    commit_logprob: torch.Tensor | None = None
    commit_logits: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None

    @property
    def commit_prob(self) -> torch.Tensor | None:
        """``exp(commit_logprob)`` ``(B, L)``: the probability each token was committed with (1 where
        ``commit_step`` is ``-1``), or ``None`` without a trace."""
        return None if self.commit_logprob is None else self.commit_logprob.exp()
