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

What stays the same: the result up to float32 rounding (oneDNN sums in another order; a test pins ~1e-5 relative
and the same sampled tokens on a tiny model), autograd (a call that needs a gradient runs the layer's own forward),
and training inside the block (a weight updated in place since it was packed — its ``_version`` moved, or its
storage changed — is packed again at its next call, deterministically). What it costs: a packed copy of every
routed weight while the block is open (the linear weights twice in memory) and the reorder itself at entry (0.26 s
for SmolLM2-135M on the project machine) — open it around a decoding loop, not around each call.

Which layers: modules whose type is exactly ``torch.nn.Linear`` (subclasses such as LoRA or quantised layers keep
their own forward; so does a layer whose ``forward`` was already replaced on the instance, e.g. by accelerate's
offloading hooks), on the CPU, with a float32 weight — or bfloat16 where the CPU computes it natively
(:func:`unifusion.precision.native_bf16`). Calls whose input has another dtype or device run the layer's own
forward. ``enabled=None`` decides from the machine: oneDNN present with these two operators.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .precision import native_bf16

__all__ = ["packed_linears", "packing_available", "release_packed"]


def packing_available() -> bool:
    """Whether this torch build offers the oneDNN operators :func:`packed_linears` uses (on the CPU)."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise"))


class _Pack:
    """One layer's weight in oneDNN's packed layout and the weight state it was packed from (:func:`_weight_key`)."""

    __slots__ = ("packed", "key", "batch_hint")

    def __init__(self, weight: torch.Tensor, batch_hint: int) -> None:
        self.batch_hint = batch_hint
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.key = _weight_key(weight)

    def current(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed weight, packed again first when ``weight`` was updated in place or replaced since."""
        key = _weight_key(weight)
        if key != self.key:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.batch_hint)
            self.key = key
        return self.packed


_KEPT: weakref.WeakKeyDictionary[nn.Linear, _Pack] = weakref.WeakKeyDictionary()
"""The packs that ``packed_linears(..., keep=True)`` keeps between blocks, per layer (weakly: they go with the
layer; :func:`release_packed` drops them)."""


class _PackedForward:
    """The replacement ``forward`` of one ``nn.Linear``: ``y = x Wᵀ + b`` with ``W`` in oneDNN's packed layout.

    ``x`` ``(..., in)`` → ``(..., out)``; rows are flattened to ``(M, in)`` for the call.
    """

    def __init__(self, layer: nn.Linear, pack: _Pack) -> None:
        self.layer = layer
        self.pack = pack

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        weight = layer.weight
        if (x.dtype != weight.dtype or x.device != weight.device or x.numel() == 0
                or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):
            return nn.Linear.forward(layer, x)
        bias = None if layer.bias is None else layer.bias.detach()
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), self.pack.current(weight),
                                               bias, "none", [], "")
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
def packed_linears(module: nn.Module, *, enabled: bool | None = None, batch_hint: int = 16,
                   keep: bool = False) -> Iterator[int]:
    """Run the CPU ``nn.Linear`` layers of ``module`` through oneDNN with prepacked weights inside the block (module
    docstring); yields how many layers it routes (0 when disabled or none qualifies).

    Example::

        with uf.cpu_linears.packed_linears(model) as n:          # once around the decoding loop
            for prompt in prompts:
                out = model.generate(prompt, max_new_tokens=64)

    Args:
        module: any ``nn.Module`` (a :class:`~unifusion.hf.DiffusionLM`, an HF causal LM, ...).
        enabled: ``None`` — wherever :func:`packing_available`; ``True`` — the same, but a build without the
            operators is a ``RuntimeError``; ``False`` — a no-op.
        batch_hint: the row count oneDNN tunes the packed layout for (any count works; 16 covers a merged block step
            of blocks of 8).
        keep: keep each layer's packed weight after the block, for the next block to reuse while the weight is
            unchanged (its ``_version`` and storage; a weight updated or replaced since is packed again at its first
            call): the reorder is paid once, the packed copy stays in memory until :func:`release_packed` or the
            layer goes. What :meth:`unifusion.hf.DiffusionLM.generate` does on the CPU by default. Weights that are
            inference tensors (made under ``torch.inference_mode``, whose in-place updates there move no version
            counter) are packed again at every block instead.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected None or a bool, got {type(enabled).__name__}")
    if isinstance(batch_hint, bool) or not isinstance(batch_hint, int) or batch_hint < 1:
        raise ValueError(f"batch_hint: expected a positive int, got {batch_hint!r}")
    if not isinstance(keep, bool):
        raise TypeError(f"keep: expected a bool, got {type(keep).__name__}")
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
                    forward = _PackedForward(layer, _pack(layer, batch_hint, keep))
                    layer.forward = forward  # type: ignore[method-assign,assignment]
                    routed.append(layer)
        yield len(routed)
    finally:
        for layer in routed:
            installed: Any = layer.__dict__.get("forward")
            if isinstance(installed, _PackedForward):
                del layer.forward


def _pack(layer: nn.Linear, batch_hint: int, keep: bool) -> _Pack:
    """``layer``'s pack: the kept one when ``keep`` and it was made for ``batch_hint`` (packed again at its first call
    if the weight changed since), else a new one, kept when ``keep`` and the weight is not an inference tensor."""
    kept = _KEPT.get(layer) if keep else None
    if kept is not None and kept.batch_hint == batch_hint:
        return kept
    pack = _Pack(layer.weight, batch_hint)
    if keep and not layer.weight.is_inference():
        _KEPT[layer] = pack
    return pack


def release_packed(module: nn.Module) -> int:
    """Drop the packed weights that ``packed_linears(module, keep=True)`` (and so ``DiffusionLM.generate`` on the CPU)
    kept for the layers of ``module``; returns how many it dropped. Called by ``DiffusionLM.train()``: a model being
    trained changes its weights, and its next generate packs them again."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    dropped = 0
    for layer in module.modules():
        if isinstance(layer, nn.Linear) and _KEPT.pop(layer, None) is not None:
            dropped += 1
    return dropped
