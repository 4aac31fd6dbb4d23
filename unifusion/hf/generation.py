"""Prompt continuation with an adapted model: what :meth:`unifusion.hf.DiffusionLM.generate` does.

The prompt is a fixed prefix of the sequence: it stays in ``z_t`` at every step and never changes, and
:class:`~unifusion.BayesianSampler` (Algorithm 2) generates the positions after it, bidirectionally (``γ = 1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import _validation as V
from .._kernel_config import default_kernel

__all__ = ["generate"]


def generate(model: Any, prompt_ids: torch.Tensor, *, max_new_tokens: int | None = None, seq_len: int | None = None,
             num_steps: int = 64, kernel: Any = None, temperature: float = 1.0, top_p: float | None = None,
             top_k: int | None = None, eps: float = 1e-3,
             generator: torch.Generator | Sequence[torch.Generator] | None = None,
             progress: bool = False) -> torch.Tensor:
    """Continue ``prompt_ids`` by ancestral sampling from ``model`` (a :class:`~unifusion.hf.DiffusionLM`).

    The arguments and the result are those of :meth:`DiffusionLM.generate <unifusion.hf.DiffusionLM.generate>`:
    ``(B, P)`` or ``(P,)`` prompt ids in, ``(B, P + max_new_tokens)`` int64 ids out, the prompt unchanged in the first
    ``P`` columns.
    """
    from ..samplers._setup import PROMPT_FILL, check_generators
    from ..samplers.bayesian import BayesianSampler

    if not isinstance(prompt_ids, torch.Tensor):
        raise TypeError(f"prompt_ids: expected a (B, P) int64 tensor of token ids, got {type(prompt_ids).__name__}")
    if prompt_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"prompt_ids: expected integer token ids, got dtype {prompt_ids.dtype}")
    device = model.device
    V.check_model_device(model, "prompt_ids", device)  # a meta model: "model: ..." (metadata only)
    V.check_not_meta("prompt_ids", prompt_ids)
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids[None]
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] == 0:
        raise ValueError(f"prompt_ids: expected shape (B, P) with B >= 1, got {tuple(prompt_ids.shape)}")
    B, P = prompt_ids.shape
    generator = check_generators(generator, B)  # None, one generator, or one per row
    for g in (generator,) if isinstance(generator, torch.Generator) else generator or ():
        if g.device.type != device.type:
            raise ValueError(f"generator: is on {g.device} but the model is on {device}; create it there, "
                             f"e.g. torch.Generator(device={str(device)!r})")
    for name, v in (("max_new_tokens", max_new_tokens), ("seq_len", seq_len)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if (max_new_tokens is None) == (seq_len is None):
        raise ValueError("max_new_tokens, seq_len: give exactly one (the number of new tokens, or the total "
                         f"length including the {P} prompt tokens)")
    L = P + max_new_tokens if max_new_tokens is not None else seq_len
    if L is None or L <= P:
        raise ValueError(f"{'max_new_tokens' if seq_len is None else 'seq_len'}: expected at least one new token "
                         f"after the {P} prompt tokens, got a total length of {L}")
    if kernel is None:
        kernel = default_kernel(model)[0]
    sampler = BayesianSampler(model, kernel, num_steps, eps=eps, temperature=temperature, top_p=top_p, top_k=top_k)
    prompt_ids = prompt_ids.to(device, torch.int64)
    num_states = model.num_states
    if V.validation_enabled() and prompt_ids.numel():  # one host sync, named for generate's argument
        bad = (prompt_ids < 0) | (prompt_ids >= num_states)
        if kernel.mask_id is not None:
            bad |= prompt_ids == kernel.mask_id
        V.fail_if(bad.any(), lambda: (
            f"prompt_ids: expected clean token ids in [0, {num_states})"
            + (f" other than the mask id {kernel.mask_id}" if kernel.mask_id is not None else "")
            + f", got values in [{int(prompt_ids.min())}, {int(prompt_ids.max())}]"))
    prompt = torch.full((B, L), PROMPT_FILL, dtype=torch.int64, device=device)  # generated positions
    prompt[:, :P] = prompt_ids
    return sampler.sample(B, L, prompt=prompt, generator=generator, progress=progress, device=device)
