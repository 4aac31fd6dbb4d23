"""Replaying a recorded trajectory: the tokens a model predicts when its decoder's order is followed step by step.

Pass k of the replay (:func:`unifusion.rl.plan_trace`) shows the model every position committed before the k-th
step of its block as the recorded token and the rest as the mask token, and reads the argmax (mask token excluded)
at the positions committed at that step. On a block model every block is at its own k-th state in one forward (a
block sees only the clean blocks before it: the recorded tokens), so a replay takes as many forwards as the most
steps one block took. For a greedy recording on the same model the replay is the recording, token for token:
decoding with the KV cache is exact (what ``tests/distill/test_trajectories.py`` checks), and a replay that differs
names a trajectory the model did not produce (another model, other weights, a sampled recording).

The fill after a row's EOS stays masked (:func:`~unifusion.distill.fill_steps`): the trace does not keep a token the
decoder committed there and replaced when the row stopped, so the replay is exact for rows where it committed none
(every row without EOS, ``eos_token_id=None``; a left-to-right order).
"""

from __future__ import annotations

import torch

from .. import _validation as V
from ..block_partition import aligning_shifts, block_origin_of, origin_columns, shift_left, shift_right
from ..denoiser import DenoiserModule
from ..rl.estimators import plan_trace
from .masks import fill_steps, view_times
from .trajectories import Trajectories

__all__ = ["replay"]


@torch.no_grad()
def replay(model: DenoiserModule, trajectories: Trajectories, *, batch_size: int = 16) -> torch.Tensor:
    """The model's argmax at each committed completion position under the recorded order ``(N, C)`` int64
    (the recorded token where nothing was committed: the fill after EOS).

    Args:
        model: a mask-kernel :class:`~unifusion.denoiser.DenoiserModule` (a :class:`~unifusion.hf.DiffusionLM`,
            block or plain, a released kind), the one the trajectories are compared with. It is called as
            :func:`~unifusion.diffusion_loss` calls it (``**model.block_conditioning(x0)`` over several blocks), so
            a shifted kind's logits at column i are its prediction of token i.
        trajectories: :class:`~unifusion.distill.Trajectories` (a block model's must have its block size).
        batch_size: rows per forward.
    """
    if not isinstance(trajectories, Trajectories):
        raise TypeError(f"trajectories: expected Trajectories, got {type(trajectories).__name__}")
    V.check_positive_int("batch_size", batch_size)
    mask_id = model.mask_token_id
    if mask_id is None:
        raise ValueError("model: replay masks the uncommitted positions; this model has no mask token")
    K = model.block_size
    if K is not None and K != trajectories.block_size:
        raise ValueError(f"trajectories: recorded with blocks of {trajectories.block_size}, the model's are {K}")
    if K is not None and trajectories.block_origin != block_origin_of(model):
        raise ValueError(f"trajectories: recorded with blocks from the {trajectories.block_origin}, the model's "
                         f"start at the {block_origin_of(model)} (Denoiser.block_origin)")
    device = model.device
    P = trajectories.prompt_length
    outputs = []
    for lo in range(0, len(trajectories), batch_size):
        part = trajectories.select(slice(lo, lo + batch_size)).to(device)
        x0 = part.sequences
        am = part.attention_mask
        B, L = x0.shape
        prompt = torch.full((B, P), -1, dtype=torch.long, device=device)
        step = torch.cat([prompt, fill_steps(part.commit_step)], 1)
        scored = torch.cat([prompt >= 0, part.commit_step >= 0], 1)
        origin = None if K is None else origin_columns(trajectories.block_origin, scored, am)
        plan = plan_trace(step, scored, block_size=K, origin=origin)
        shifts = torch.zeros(B, dtype=torch.long, device=device) if K is None or origin is None else \
            aligning_shifts(origin, K)
        width = L + int(shifts.max())  # one host read: the row behind (−o) mod K invisible pads
        x0_a, am_a = shift_right(x0, shifts, width, 0), shift_right(am, shifts, width, False)
        pred = x0.clone()
        for k in range(plan.num_passes):
            noised = shift_right(plan.noised[k], shifts, width, False)
            x_t = torch.where(noised, mask_id, x0_a)
            t = view_times(noised, block_size=K) if getattr(model, "time_conditioning", False) else None
            if K is None or K >= width:
                logits = model(x_t, None if t is None else (t if t.dim() == 1 else t[:, 0]), attention_mask=am_a)
            else:
                logits = model(x_t, t, attention_mask=am_a, **model.block_conditioning(x0_a))
            logits = shift_left(logits, shifts, L)
            logits[..., mask_id] = -torch.inf
            pred = torch.where(plan.scored[k], logits.argmax(-1), pred)
        outputs.append(pred[:, P:].cpu())
    return torch.cat(outputs)
