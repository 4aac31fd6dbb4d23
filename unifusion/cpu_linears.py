"""CPU inference through oneDNN with prepacked weights: :func:`packed_linears`.

A cached block-decoding step multiplies ``K + 1`` to ``2K + 1`` rows (9–17 for blocks of 8) by each weight matrix.
On the project's CPU (AMD EPYC; the same with torch's capability at ``AVX512`` or lowered to ``AVX2``) torch's
default float32 GEMM (MKL) takes 3.5× as long for 9 rows as for one — a 576 × 1536 layer of SmolLM2: 1 row 70 µs,
9 rows 250 µs — while oneDNN with the weight reordered once into its blocked layout takes 100 µs for the same 9 rows.
An AR step (one row) gains less: continuing 16 tokens by 48 with SmolLM2 in float32, HF's cached ``generate``
went from 2.85 s to about 2.3 s with its layers packed, the block decoder (blocks of 8, 2 tokens per forward) from
2.2 s to 1.8 s. Inside ``with packed_linears(model):`` every plain ``nn.Linear`` of ``model`` on the CPU runs
through ``torch.ops.mkldnn._linear_pointwise`` with its weight packed at entry
(``torch.ops.mkldnn._reorder_linear_weight``); on exit the layers are as before.

Two ways to use it:

* **Once around many calls** (the fastest for many short decodes, e.g. one prompt at a time):
  ``with packed_linears(model): ...`` packs every routed layer at entry; :meth:`unifusion.hf.DiffusionLM.generate`
  called inside packs nothing of its own (its layers are routed already). Inside the block a weight updated in place
  (its ``_version`` moved: an optimizer step, ``p.copy_``, ``load_state_dict``) or replaced (its storage changed) is
  packed again at its next call; a weight changed through ``.data`` (peft's ``merge_adapter``, an EMA swap with
  ``p.data.copy_``) moves neither, and the block keeps the old packed copy until :func:`repack_linears` is called —
  checking the contents at each call would cost about what the reorder does (hashing a 1536 × 576 weight took 73
  ms against 62 ms to reorder it on the project machine, loaded).
* **Per call, by itself**: :meth:`~unifusion.hf.DiffusionLM.generate` of a block model on the CPU in eval mode
  opens the block around each call (``packed_linears=False`` turns it off) with ``pack_after_rows =``
  :data:`GENERATE_PACK_AFTER_ROWS`: a layer runs its own forward until it has multiplied that many rows in the call
  and only then packs, so a short call (batch 1, a few forwards: a 10-token answer in 3 forwards multiplies ~60 rows)
  pays no reorder — 0.3 s quiet, 1.1–2.4 s on the loaded project machine, where the packed layout saved 0.01–0.13 s
  a call and the AR model's whole batch-1 decode of the answer took 2.9 s (``benchmarks/latency.py``) — while a long
  or wide call packs after its first forwards. Nothing stays on the model after the call, so weights changed in any
  way between calls need no care.

What stays the same: the result up to float32 rounding (oneDNN sums in another order; a test pins ~1e-5 relative
and the same sampled tokens on a tiny model), autograd (a call that needs a gradient runs the layer's own forward),
and training inside the block (a weight updated in place since it was packed — its ``_version`` moved, or its
storage changed — is packed again at its next call, deterministically). What it costs: a packed copy of every
packed weight while the block is open (the linear weights twice in memory) and the reorder itself (0.26 s for
SmolLM2-135M on the project machine, quiet) — open it around a decoding loop, not around each call.

Which layers: modules whose type is exactly ``torch.nn.Linear`` with a plain tensor as weight (not a tensor subclass
such as FSDP2's ``DTensor``) (subclasses such as LoRA or quantised layers keep
their own forward; so does a layer whose ``forward`` was already replaced on the instance, e.g. by accelerate's
offloading hooks), on the CPU, with a float32 weight — or bfloat16 where the CPU computes it natively
(:func:`unifusion.precision.native_bf16`). Calls whose input has another dtype or device run the layer's own
forward. ``enabled=None`` decides from the machine: oneDNN present with these two operators.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .precision import native_bf16

__all__ = ["GENERATE_PACK_AFTER_ROWS", "packed_linears", "packing_available", "repack_linears"]


def packing_available() -> bool:
    """Whether this torch build offers the oneDNN operators :func:`packed_linears` uses (on the CPU)."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise"))


class _PackedForward:
    """The replacement ``forward`` of one ``nn.Linear``: ``y = x Wᵀ + b`` with ``W`` in oneDNN's packed layout.

    ``x`` ``(..., in)`` → ``(..., out)``; rows are flattened to ``(M, in)`` for the call. Until the layer has
    multiplied ``pack_after_rows`` rows it runs its own forward and holds no packed copy (counted from shapes: no
    device sync).
    """

    def __init__(self, layer: nn.Linear, batch_hint: int, pack_after_rows: int = 0) -> None:
        self.layer = layer
        self.batch_hint = batch_hint
        self.packed: torch.Tensor | None = None
        self.key: tuple[int, int] = (-1, -1)
        self.pack_after_rows = pack_after_rows
        self.rows = 0
        if pack_after_rows == 0:
            self.repack()

    def repack(self) -> None:
        weight = self.layer.weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.batch_hint)
        self.key = _weight_key(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        weight = layer.weight
        if (x.dtype != weight.dtype or x.device != weight.device or x.numel() == 0
                or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):
            return nn.Linear.forward(layer, x)
        if self.packed is None and self.rows < self.pack_after_rows:
            self.rows += x.numel() // x.shape[-1]
            return nn.Linear.forward(layer, x)
        if self.packed is None or _weight_key(weight) != self.key:
            self.repack()
        bias = None if layer.bias is None else layer.bias.detach()
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), self.packed, bias,
                                               "none", [], "")
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _weight_key(weight: torch.Tensor) -> tuple[int, int]:
    """What changes when a weight is updated in place or replaced: its version counter (none on inference-mode
    tensors, which cannot be updated in place outside inference mode) and its storage."""
    return (-1 if weight.is_inference() else weight._version), weight.data_ptr()


def _eligible(layer: nn.Module) -> bool:
    if type(layer) is not nn.Linear or "forward" in layer.__dict__:
        return False
    weight = layer.weight
    if type(weight) not in (nn.Parameter, torch.Tensor) or weight.device.type != "cpu":
        return False  # a tensor subclass (FSDP2's DTensor, a quantised weight) keeps its own matmul
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and native_bf16("cpu"))


GENERATE_PACK_AFTER_ROWS = 128
"""The ``pack_after_rows`` :meth:`unifusion.hf.DiffusionLM.generate` packs with on its own (module docstring): about
where the reorder of a weight (0.26 s for SmolLM2-135M's, ~1.7 ms for a 576 × 1536 layer) equals what the packed
layout saves on the rows multiplied by it (~17 µs a row at 9 rows: 250 µs → 100 µs), on the project's CPU."""


@contextmanager
def packed_linears(module: nn.Module, *, enabled: bool | None = None, batch_hint: int = 16,
                   pack_after_rows: int = 0) -> Iterator[int]:
    """Run the CPU ``nn.Linear`` layers of ``module`` through oneDNN with prepacked weights inside the block (module
    docstring); yields how many layers it routes (0 when disabled or none qualifies).

    Example::

        with uf.cpu_linears.packed_linears(model) as n:          # once around a loop of calls: generate
            for prompt in prompts:                                 # then packs nothing itself
                out = model.generate(prompt, max_new_tokens=64)

    Args:
        module: any ``nn.Module`` (a :class:`~unifusion.hf.DiffusionLM`, an HF causal LM, ...).
        enabled: ``None`` — wherever :func:`packing_available`; ``True`` — the same, but a build without the
            operators is a ``RuntimeError``; ``False`` — a no-op.
        batch_hint: the row count oneDNN tunes the packed layout for (any count works; 16 covers a merged block step
            of blocks of 8).
        pack_after_rows: ``0`` (default) — every layer packed at entry; ``n > 0`` — a layer runs its own forward
            until it has multiplied ``n`` rows inside the block, and packs at its first call after that (a short use
            never pays the reorder; a long one pays it once, after spending at most about what it costs).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected None or a bool, got {type(enabled).__name__}")
    if isinstance(batch_hint, bool) or not isinstance(batch_hint, int) or batch_hint < 1:
        raise ValueError(f"batch_hint: expected a positive int, got {batch_hint!r}")
    if isinstance(pack_after_rows, bool) or not isinstance(pack_after_rows, int) or pack_after_rows < 0:
        raise ValueError(f"pack_after_rows: expected a non-negative int, got {pack_after_rows!r}")
    available = packing_available()
    if enabled and not available:
        raise RuntimeError("packed_linears(enabled=True): this torch build has no oneDNN linear operators "
                           "(torch.backends.mkldnn.is_available() or torch.ops.mkldnn._linear_pointwise missing)")
    routed: list[nn.Module] = []
    try:
        if enabled is not False and available:
            for layer in module.modules():
                if _eligible(layer):
                    assert isinstance(layer, nn.Linear)
                    layer.forward = _PackedForward(  # type: ignore[method-assign,assignment]
                        layer, batch_hint, pack_after_rows)
                    routed.append(layer)
        yield len(routed)
    finally:
        for layer in routed:
            forward: Any = layer.__dict__.get("forward")
            if isinstance(forward, _PackedForward):
                del layer.forward


def repack_linears(module: nn.Module) -> int:
    """Pack again, now, every layer of ``module`` that an open :func:`packed_linears` block routes and has packed:
    for a weight changed through ``.data`` inside the block (peft's ``merge_adapter``, an EMA swap with
    ``p.data.copy_``), which the block cannot see. Returns how many layers were packed again."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    count = 0
    for layer in module.modules():
        forward: Any = layer.__dict__.get("forward")
        if isinstance(forward, _PackedForward) and forward.packed is not None:
            forward.repack()
            count += 1
    return count
