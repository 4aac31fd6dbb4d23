"""Rows of a ``"sequence_start"`` block model's batch whose first blocks hold different numbers of prompt tokens
(private to :func:`unifusion.samplers.generate`): how many each row holds, and decoding such a batch group by group.

A ``"sequence_start"`` kind (``Denoiser.block_origin``, :mod:`unifusion.block_partition`) counts a row's blocks from
its first real token, so a left-padded row whose real prompt has n tokens starts its first decoded block ``n mod K``
columns before the generated start. Rows with different ``n mod K`` cannot share block columns (the block decoders
run one set of columns per block for the whole batch): :func:`by_block_lead` decodes each group of rows with the
same count as one batch and puts the rows back in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..block_partition import block_origin_of
from ..denoiser import DecodableModel

__all__ = ["block_leads", "by_block_lead", "merge_rows"]


def block_leads(model: DecodableModel, attention_mask: torch.Tensor | None, B: int, P: int) -> list[int]:
    """Per row, the prompt tokens its first decoded block holds (``[]`` for a model without blocks): 0 for a
    ``"prompt_end"`` kind (blocks start at the generated start), the row's real prompt length mod K for a
    ``"sequence_start"`` one (blocks counted from its first real token, :mod:`unifusion.block_partition`). One host
    read for a padded batch."""
    K = model.block_size
    if K is None:
        return []
    if block_origin_of(model) == "prompt_end":
        return [0] * B
    if attention_mask is None:
        return [P % K] * B
    return (attention_mask.ne(0).sum(-1) % K).tolist()


def by_block_lead(generate: Callable[..., Any], model: DecodableModel, prompt_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None, leads: list[int], generator: Any,
                  options: dict[str, Any]) -> Any:
    """``generate`` (:func:`unifusion.samplers.generate`, passed in) of a left-padded batch whose rows' first blocks
    hold different numbers of prompt tokens ``leads`` (a ``"sequence_start"`` kind, prompts whose lengths differ mod
    K): one call per group of rows with the same count (rows of one group share their block columns), with
    ``options`` (``generate``'s resolved keywords), the results put back in row order. Each row equals the row alone
    with per-row generators; one generator is drawn from group after group."""
    B = prompt_ids.shape[0]
    parts = []
    for lead in sorted(set(leads)):
        rows = [b for b in range(B) if leads[b] == lead]
        gens = [generator[b] for b in rows] if isinstance(generator, (list, tuple)) else generator
        mask = None if attention_mask is None else attention_mask[rows]
        parts.append((rows, generate(model, prompt_ids[rows], attention_mask=mask, generator=gens, **options)))
    return merge_rows(parts, B)


def merge_rows(parts: list[tuple[list[int], Any]], B: int) -> Any:
    """The outputs of row groups (tensors or :class:`~unifusion.samplers.PolicyOutput` s) as one batch of ``B``
    rows, each group's rows at their indices."""
    def put(values: list[Any]) -> Any:
        first = values[0]
        if first is None:
            return None
        if isinstance(first, tuple):
            return tuple(put([v[i] for v in values]) for i in range(len(first)))
        out = first.new_zeros((B, *first.shape[1:]))
        for (rows, _), v in zip(parts, values):
            out[torch.tensor(rows, device=out.device)] = v
        return out

    outs = [out for _, out in parts]
    if isinstance(outs[0], torch.Tensor):
        return put(outs)
    return dataclasses.replace(outs[0], **{f.name: put([getattr(o, f.name) for o in outs])
                                           for f in dataclasses.fields(outs[0])})
