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

:meth:`unifusion.hf.DiffusionLM.generate` does this by default for a block model on the CPU in eval mode, around
each call (``packed_linears=False`` turns it off): the reorder is paid by every call, and nothing stays on the model
after it. Packed copies kept between calls would go stale without
notice when a weight is changed through ``.data`` (peft's ``merge_adapter``, an EMA swap with ``p.data.copy_``),
which moves neither its version counter nor its storage, and a check of the contents costs about as much as the
reorder (hashing a 1536 × 576 weight took 73 ms against 62 ms to reorder it on the project machine, loaded).

What stays the same: the result up to float32 rounding (oneDNN sums in another order; a test pins ~1e-5 relative
and the same sampled tokens on a tiny model), autograd (a call that needs a gradient runs the layer's own forward),
and training inside the block (a weight updated in place since it was packed — its ``_version`` moved, or its
storage changed — is packed again at its next call, deterministically). What it costs: a packed copy of every
routed weight while the block is open (the linear weights twice in memory) and the reorder itself at entry (0.26 s
for SmolLM2-135M on the project machine) — open it around a decoding loop, not around each call.

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

__all__ = ["packed_linears", "packing_available"]


def packing_available() -> bool:
    """Whether this torch build offers the oneDNN operators :func:`packed_linears` uses (on the CPU)."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise"))


class _PackedForward:
    """The replacement ``forward`` of one ``nn.Linear``: ``y = x Wᵀ + b`` with ``W`` in oneDNN's packed layout.

    ``x`` ``(..., in)`` → ``(..., out)``; rows are flattened to ``(M, in)`` for the call.
    """

    def __init__(self, layer: nn.Linear, batch_hint: int) -> None:
        self.layer = layer
        self.batch_hint = batch_hint
        self.packed: torch.Tensor | None = None
        self.key: tuple[int, int] = (-1, -1)
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
        if _weight_key(weight) != self.key:
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


@contextmanager
def packed_linears(module: nn.Module, *, enabled: bool | None = None, batch_hint: int = 16) -> Iterator[int]:
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
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected None or a bool, got {type(enabled).__name__}")
    if isinstance(batch_hint, bool) or not isinstance(batch_hint, int) or batch_hint < 1:
        raise ValueError(f"batch_hint: expected a positive int, got {batch_hint!r}")
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
                    layer.forward = _PackedForward(layer, batch_hint)  # type: ignore[method-assign,assignment]
                    routed.append(layer)
        yield len(routed)
    finally:
        for layer in routed:
            forward: Any = layer.__dict__.get("forward")
            if isinstance(forward, _PackedForward):
                del layer.forward
