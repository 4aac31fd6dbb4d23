"""Attention over the network positions: *patterns* say which key each query may see, *strategies* say how the
wrapped Hugging Face model is told.

**The annealed pattern** (paper §3.2, App. C.5). At update ``k`` the mask over the ``n = L + 1`` network positions
``[BOS, x_t]`` is

    γ_k = min(1, k / K_ann),    A_ij = 1{j ≤ i} ∨ B_ij,    B_ij ~ Bernoulli(γ_k),

drawn independently for every sequence of the batch and shared by all heads and layers (:func:`anneal_schedule`,
:func:`annealed_attention_mask`). Padded keys are blocked and padded queries see only themselves, so no row is empty.

**γ as a number or as a tensor.** A Python ``γ`` lets a call pick its path by value: ``γ = 0`` is the model's own
causal attention and ``γ = 1`` needs no mask, and no random numbers are drawn at either end. A 0-d tensor ``γ`` (a
tensor ``step`` in :func:`anneal_schedule`) is never read on the host: every call draws ``B_ij`` and builds the
mask, which is exactly causal at ``γ = 0`` (``U < 0`` never holds for ``U ~ U[0, 1)``) and exactly full at ``γ = 1``.
That is the form for a training step under ``torch.compile``: a Python ``γ`` is a constant of the traced graph, so
every new value would recompile it, while a tensor is an input of one graph for the whole annealing run.
Sliding-window layers additionally keep ``|i − j| < w`` (symmetrised when bidirectional; with causal attention this
is exactly the pretrained window).

**Patterns** (:class:`AttentionPattern`) belong to one call: they say whether they are the plain causal pattern or
the full one (then no mask is needed), build their dense ``(B, 1, n, n)`` boolean mask (random entries drawn once and
shared by every layer type), narrow it to a sliding window, and give flex attention a ``mask_mod``.
:class:`AnnealedPattern` is the paper's; a new layout (say block-causal over a two-stream sequence) is a new
subclass, and the strategies below take it unchanged.

**Strategies** (:class:`AttentionStrategy`), one per attention path (:data:`AttentionPath`):

* ``"causal"`` (:class:`CausalAttention`): the pattern is the model's own causal (and windowed) mask: nothing passed.
* ``"non_causal"`` (:class:`NonCausalAttention`): the pattern is full, the family honours transformers'
  ``is_causal=False`` keyword and no sliding window bites: the keyword and no mask (SDPA runs ``attn_mask=None,
  is_causal=False``, flash kernels stay eligible, nothing quadratic in ``n`` is allocated outside the kernel).
* ``"mask"`` (:class:`DenseMaskAttention`): the dense mask, boolean for SDPA, additive (0 / ``finfo.min``) for eager
  attention, which adds the mask to the scores.
* ``"block_mask"`` (:class:`BlockMaskAttention`): flex attention's ``BlockMask`` of the pattern's ``mask_mod`` (the
  same pattern, the same draws, the same outputs).

Flash attention takes no mask: it runs the causal and the mask-free bidirectional paths, and a call that needs a mask
is a ``ValueError`` naming ``attn_implementation`` and the fix. :func:`select_strategy` makes the decision.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, overload

import torch

from ... import _validation as V
from ..._device import rand
from .families import Family, WindowStyle

__all__ = [
    "AnnealedPattern",
    "AttentionPath",
    "AttentionPattern",
    "AttentionStrategy",
    "BlockMaskAttention",
    "CausalAttention",
    "DenseMaskAttention",
    "MaskMod",
    "NonCausalAttention",
    "anneal_schedule",
    "annealed_attention_mask",
    "attn_implementation",
    "check_bidirectional_prob",
    "dense_mask_mod",
    "draws_bernoulli",
    "mask_style",
    "select_strategy",
]

AttentionPath = Literal["causal", "non_causal", "mask", "block_mask"]
"""How a call attends (see the module docstring)."""

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""flex attention's ``mask_mod(b, h, q_idx, kv_idx) → bool``: True = query ``q_idx`` of row ``b`` may attend key
``kv_idx``."""


# ----------------------------------------------------------------------------------------------------------
# schedule and mask (pure functions)


@overload
def anneal_schedule(step: int, anneal_steps: int) -> float: ...


@overload
def anneal_schedule(step: torch.Tensor, anneal_steps: int) -> torch.Tensor: ...


def anneal_schedule(step: int | torch.Tensor, anneal_steps: int) -> float | torch.Tensor:
    """Bidirectional probability ``γ_k = min(1, k / K_ann)`` at update ``k = step`` (App. C.5).

    Args:
        step: the update index ``k ≥ 0``: an int, or a 0-d integer or floating tensor. A tensor gives ``γ_k`` as a
            0-d tensor that is never read on the host (module docstring): pass it under ``torch.compile`` so that the
            annealing does not recompile the step.
        anneal_steps: the annealing horizon ``K_ann ≥ 0``; ``0`` means fully bidirectional from the start.

    Returns:
        ``γ_k`` in ``[0, 1]``, to pass as ``bidirectional_prob``: a float, or for a tensor ``step`` a 0-d float64
        tensor on its device (float32 on MPS), equal to the float of the same ``k``.
    """
    tensor = isinstance(step, torch.Tensor)
    for name, v in (("step", 0 if tensor else step), ("anneal_steps", anneal_steps)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {v}")
    if isinstance(step, torch.Tensor):
        if step.dim() != 0 or step.dtype == torch.bool or step.dtype.is_complex:
            raise TypeError(f"step: expected an int or a 0-d integer or floating tensor, got a tensor of shape "
                            f"{tuple(step.shape)} and dtype {step.dtype}")
        V.check_not_meta("step", step)
        if V.validation_enabled():
            V.fail_if(step < 0, lambda: f"step: expected a non-negative step, got {step.item()}")
        # float64 divides k / K_ann as Python does (correctly rounded), so γ equals the float of the same k
        dtype = torch.float32 if step.device.type == "mps" else torch.float64
        if anneal_steps == 0:
            return torch.ones((), dtype=dtype, device=step.device)
        return (step.to(dtype) / anneal_steps).clamp(max=1.0)
    if anneal_steps == 0:
        return 1.0
    return min(1.0, step / anneal_steps)


def check_bidirectional_prob(value: object, name: str = "bidirectional_prob") -> float | torch.Tensor:
    """``γ`` checked: a float (or int) in ``[0, 1]``, returned as a float, or a 0-d floating tensor, returned as it is.

    A tensor's range is a value check (:func:`unifusion.validation.validation_enabled`; queued by an enclosing
    ``batched_checks`` block, skipped while ``torch.compile`` traces).
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not value.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a float in [0, 1] or a 0-d floating tensor, got a tensor of shape "
                            f"{tuple(value.shape)} and dtype {value.dtype}")
        V.check_not_meta(name, value)
        if V.validation_enabled():
            V.fail_if(~((value >= 0.0) & (value <= 1.0)), lambda: (
                f"{name}: expected a value in [0, 1], got {value.item()}"))
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float in [0, 1], got {type(value).__name__}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}: expected a float in [0, 1], got {value}")
    return float(value)


def draws_bernoulli(gamma: float | torch.Tensor) -> bool:
    """Whether the annealed pattern of ``γ`` draws its Bernoulli entries: ``0 < γ < 1``, or any tensor ``γ`` (its value
    is not read; the draw is exact at both ends)."""
    return isinstance(gamma, torch.Tensor) or 0.0 < gamma < 1.0


def annealed_attention_mask(
    batch_size: int,
    length: int,
    gamma: float | torch.Tensor,
    *,
    key_valid: torch.Tensor | None = None,
    window: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean attention mask ``A`` of shape ``(B, 1, L, L)``, True = query ``i`` may attend key ``j``.

    ``A_ij = (1{j ≤ i} ∨ B_ij) ∧ valid_j ∨ 1{i = j}``, ``B_ij ~ Bernoulli(γ)`` drawn with ``generator``;
    with ``window = w`` additionally ``∧ |i − j| < w``.

    Args:
        batch_size: ``B``.
        length: ``L`` (the network's sequence length, BOS included).
        gamma: ``γ`` in ``[0, 1]``; 0 gives the causal mask, 1 the full one. A 0-d tensor ``γ`` always draws
            ``B_ij`` (no host read of its value; the same mask as the float at every ``γ``, the endpoints included,
            but the draw consumes random numbers at the endpoints too).
        key_valid: optional ``(B, L)`` bool, False for padded keys (blocked for every query but themselves).
        window: optional sliding-window size ``w``.
        generator: random generator for ``B_ij`` (on ``device``).
        device: device of the result.
    """
    i = torch.arange(length, device=device)
    causal = i[None, :] <= i[:, None]  # (L, L), j ≤ i
    if not isinstance(gamma, torch.Tensor) and gamma <= 0.0:
        A = causal.expand(batch_size, 1, length, length)
    elif not isinstance(gamma, torch.Tensor) and gamma >= 1.0:
        A = torch.ones((), dtype=torch.bool, device=device).expand(batch_size, 1, length, length)
    else:
        B_ij = rand((batch_size, 1, length, length), generator=generator, device=device) < gamma
        A = causal | B_ij
    if key_valid is not None:
        eye = i[None, :] == i[:, None]
        A = (A & key_valid[:, None, None, :]) | eye
    if window is not None:
        band = (i[None, :] - i[:, None]).abs() < window
        A = A & band
    return A


def dense_mask_mod(A: torch.Tensor) -> MaskMod:
    """A ``mask_mod`` that reads a boolean ``(B, 1, n, n)`` pattern: ``A[b, 0, q, kv]``, so flex attention sees exactly
    the pattern SDPA gets as a dense mask (the ``(B, n, n)`` bool copy it captures is the size of ``A``)."""
    pattern = A[:, 0].contiguous()  # (B, n, n); an expanded (stride-0) pattern trips Inductor's CPU template
    if pattern.device.type == "cpu" and not torch.compiler.is_compiling():
        # Inductor's CPU flex-attention template fails to build (C++ "cur_kvSplitSize5 was not declared") when this
        # captured tensor is traced with symbolic sizes, which automatic dynamic shapes pick on the recompile after
        # another mask (e.g. the causal one): keep it static there.
        torch._dynamo.mark_static(pattern)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return pattern[b, q_idx, kv_idx]

    return mask_mod


# ----------------------------------------------------------------------------------------------------------
# patterns


class AttentionPattern(ABC):
    """Which key each query may attend in one call over ``n`` network positions of ``B`` rows.

    Subclasses implement :meth:`allowed` (the dense pattern before any sliding window) and, where they can say so
    without building it, :attr:`is_causal` / :attr:`is_full` and :meth:`mask_reason`. The dense pattern is built once
    per instance, on first use, and shared by every layer type (random entries are drawn once). Override
    :meth:`window_band` when position ids are not the indices (a two-stream layout) and :meth:`mask_mod` to give flex
    attention an analytic form that needs no ``(B, n, n)`` tensor.

    Attributes:
        batch_size: ``B``.
        length: ``n``, the number of network positions.
        device: where the masks are built.
    """

    batch_size: int
    length: int
    device: torch.device

    def __init__(self, batch_size: int, length: int, device: torch.device | str = "cpu") -> None:
        self.batch_size = batch_size
        self.length = length
        self.device = torch.device(device)
        self._dense: torch.Tensor | None = None

    @property
    def is_causal(self) -> bool:
        """Whether the pattern is exactly ``j ≤ i`` on unpadded positions: the model's own causal mask."""
        return False

    @property
    def is_full(self) -> bool:
        """Whether every query may attend every key (no padding)."""
        return False

    def mask_reason(self) -> str | None:
        """Why the pattern needs a mask, in a few words for an error message (``None``: it may need none)."""
        return None

    @abstractmethod
    def allowed(self) -> torch.Tensor:
        """The dense pattern ``(B, 1, n, n)`` bool, True = query ``i`` may attend key ``j``, before any window.

        Called once per instance (through :meth:`dense_mask`); random entries are drawn here."""

    def window_band(self, window: int) -> torch.Tensor:
        """Which keys a sliding-window layer of size ``w`` keeps: ``|i − j| < w`` over the positions, ``(n, n)``."""
        i = torch.arange(self.length, device=self.device)
        return (i[None, :] - i[:, None]).abs() < window

    def dense_mask(self, window: int | None = None) -> torch.Tensor:
        """The pattern ``(B, 1, n, n)`` bool, narrowed to the sliding window ``w`` when given (the diagonal stays, so no
        row is empty)."""
        if self._dense is None:
            self._dense = self.allowed()
        if window is None:
            return self._dense
        return self._dense & self.window_band(window)

    def mask_mod(self, window: int | None = None) -> MaskMod:
        """flex attention's ``mask_mod`` of :meth:`dense_mask` (by default it reads that tensor)."""
        return dense_mask_mod(self.dense_mask(window))


class AnnealedPattern(AttentionPattern):
    """The annealed causal-to-bidirectional pattern of :func:`annealed_attention_mask` over ``n`` network positions.

    Args:
        batch_size: ``B``.
        length: ``n``.
        gamma: ``γ`` in ``[0, 1]``: a float, or a 0-d tensor (then the pattern is never causal or full as far as
            the strategies can tell without reading it: it always takes the mask path, built by the same draw).
        key_valid: ``(B, n)`` bool, False at padded keys; ``None`` without padding.
        generator: random generator of the Bernoulli entries (``0 < γ < 1``, or a tensor ``γ``), on ``device``.
        device: where the mask is built (the tokens' device).
    """

    def __init__(self, batch_size: int, length: int, gamma: float | torch.Tensor, *,
                 key_valid: torch.Tensor | None = None, generator: torch.Generator | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(batch_size, length, device)
        self.gamma = gamma
        self.key_valid = key_valid
        self.generator = generator

    @property
    def is_causal(self) -> bool:
        return self.key_valid is None and not isinstance(self.gamma, torch.Tensor) and self.gamma == 0.0

    @property
    def is_full(self) -> bool:
        return self.key_valid is None and not isinstance(self.gamma, torch.Tensor) and self.gamma == 1.0

    def mask_reason(self) -> str | None:
        if self.key_valid is not None:
            return "padding: attention_mask"
        if isinstance(self.gamma, torch.Tensor):
            return "annealing: bidirectional_prob given as a tensor"
        if 0.0 < self.gamma < 1.0:
            return f"annealing: 0 < bidirectional_prob={self.gamma} < 1"
        return None

    def allowed(self) -> torch.Tensor:
        g, device = self.generator, self.device
        if g is not None and draws_bernoulli(self.gamma) and g.device.type != device.type:
            raise ValueError(f"generator: is on {g.device} but x_t is on {device}; the annealed mask is drawn "
                             f"on x_t's device, so pass torch.Generator(device={str(device)!r})")
        return annealed_attention_mask(self.batch_size, self.length, self.gamma, key_valid=self.key_valid,
                                       generator=g, device=self.device)


# ----------------------------------------------------------------------------------------------------------
# strategies


class AttentionStrategy(ABC):
    """Turns a pattern into the keyword arguments the wrapped model's ``forward`` takes (``attention_mask=``,
    ``is_causal=``, or nothing)."""

    path: ClassVar[AttentionPath]

    @abstractmethod
    def kwargs(self, pattern: AttentionPattern) -> dict[str, Any]:
        """Keyword arguments for the wrapped model's ``forward`` that make it attend by ``pattern``."""


class CausalAttention(AttentionStrategy):
    """The model's own causal (and windowed) attention: no keyword from us."""

    path: ClassVar[AttentionPath] = "causal"

    def kwargs(self, pattern: AttentionPattern) -> dict[str, Any]:
        return {}


class NonCausalAttention(AttentionStrategy):
    """Full attention without a mask: transformers' ``is_causal=False`` keyword (every attention module non-causal)."""

    path: ClassVar[AttentionPath] = "non_causal"

    def kwargs(self, pattern: AttentionPattern) -> dict[str, Any]:
        return {"is_causal": False}


@dataclass(frozen=True)
class _MaskedAttention(AttentionStrategy):
    """A mask per layer type, placed where the family reads it.

    Attributes:
        window: the sliding window ``w`` of the model's windowed layers (``None``: none).
        window_layout: how the family feeds windowed layers (:attr:`Family.window`).
    """

    window: int | None
    window_layout: WindowStyle

    def place(self, masks: dict[str, Any]) -> dict[str, Any]:
        """``attention_mask=``: one mask, the windowed one for families that window every layer, or the dict keyed by
        layer type (``"full_attention"``, ``"sliding_attention"``)."""
        if self.window is None:
            return {"attention_mask": masks["full_attention"]}
        if self.window_layout == "all_layers":
            return {"attention_mask": masks["sliding_attention"]}
        return {"attention_mask": masks}


@dataclass(frozen=True)
class DenseMaskAttention(_MaskedAttention):
    """The dense ``(B, 1, n, n)`` mask: boolean (True = attend, SDPA), or additive in ``additive_dtype`` (0 = attend,
    ``finfo.min`` = blocked; eager attention adds the mask to the scores)."""

    path: ClassVar[AttentionPath] = "mask"
    additive_dtype: torch.dtype | None = None

    def kwargs(self, pattern: AttentionPattern) -> dict[str, Any]:
        masks = {"full_attention": pattern.dense_mask()}
        if self.window is not None:
            masks["sliding_attention"] = pattern.dense_mask(self.window)
        if self.additive_dtype is not None:
            blocked = torch.finfo(self.additive_dtype).min
            masks = {k: torch.zeros(m.shape, dtype=self.additive_dtype, device=m.device).masked_fill_(~m, blocked)
                     for k, m in masks.items()}
        return self.place(masks)


@dataclass(frozen=True)
class BlockMaskAttention(_MaskedAttention):
    """flex attention's ``BlockMask`` of the pattern's ``mask_mod``: blocks that are all True are marked full (no
    ``mask_mod`` evaluation inside them), all-False blocks are skipped. Built without compiling."""

    path: ClassVar[AttentionPath] = "block_mask"

    def kwargs(self, pattern: AttentionPattern) -> dict[str, Any]:
        from torch.nn.attention.flex_attention import create_block_mask

        n = pattern.length
        windows = {"full_attention": None} if self.window is None else {
            "full_attention": None, "sliding_attention": self.window}
        masks = {k: create_block_mask(pattern.mask_mod(w), pattern.batch_size, None, n, n, device=pattern.device)
                 for k, w in windows.items()}
        return self.place(masks)


# ----------------------------------------------------------------------------------------------------------
# the decision


def attn_implementation(config: Any) -> str:
    """The wrapped model's attention implementation (``config._attn_implementation``; ``"eager"`` when unset)."""
    return str(getattr(config, "_attn_implementation", None) or "eager")


def mask_style(family: Family, config: Any,
               reason: str | Callable[[], str] = "annealing, padding or a sliding window"
               ) -> Literal["additive", "bool", "block"]:
    """How a model takes a mask: ``"additive"`` (eager), ``"bool"`` (SDPA, or the family's own style), ``"block"``
    (flex attention: a ``BlockMask``); flash attention and other kernels cannot take one, a ``ValueError`` saying why
    the call needs it (``reason``, or a function that says it, called only for the error: formatting a value that
    ``torch.compile`` traces symbolically would make the graph depend on it) and how to switch."""
    impl = attn_implementation(config)
    if impl == "eager":
        return "additive"
    if impl == "sdpa":
        return family.mask_style
    if impl == "flex_attention":
        return "block"
    if callable(reason):
        reason = reason()
    raise ValueError(
        f"model: attn_implementation={impl!r} cannot take the attention mask this call needs ({reason}); with it "
        "only the causal call (bidirectional_prob=0, no padding) and the mask-free bidirectional call "
        "(bidirectional_prob=1, no padding, no sliding window shorter than the sequence) run. Load the model "
        "with attn_implementation='sdpa', 'eager' or 'flex_attention' (or switch it in place: "
        "model.base_model.set_attn_implementation('sdpa')) for annealing, padding and sliding windows")


def _maskless(family: Family, n: int, window: int | None, force_dense: bool) -> bool:
    """Whether full attention over ``n`` positions can run with no mask (``is_causal=False``): the family honours the
    keyword, the installed transformers has it, the dense mask is not forced and no sliding window bites (``w ≥ n``:
    then ``|i − j| ≤ n − 1 < w`` for every pair, so the window is vacuous)."""
    return (not force_dense and family.is_causal_kwarg and _has_is_causal_kwarg()
            and (window is None or window >= n))


def _mask_reason(family: Family, pattern: AttentionPattern, window: int | None, force_dense: bool) -> str:
    """Why a call needs a mask (for the flash-attention error)."""
    reason = pattern.mask_reason()
    if reason is not None:
        return reason
    n = pattern.length
    if window is not None and window < n:
        return f"a sliding window of {window} < {n} positions"
    if force_dense:
        return "dense_bidirectional_mask=True"
    if not _has_is_causal_kwarg():
        return "the installed transformers has no is_causal keyword"
    return f"the {family.model_type} family does not run bidirectionally without a mask"


def select_strategy(family: Family, config: Any, pattern: AttentionPattern, *, force_dense: bool = False,
                    dtype: torch.dtype = torch.float32) -> AttentionStrategy:
    """The strategy a model of ``family`` (with ``config``) attends by for ``pattern``.

    Args:
        family: the registry entry of the wrapped model.
        config: its ``PretrainedConfig`` (sliding window, attention implementation).
        pattern: the call's pattern.
        force_dense: pass the dense mask even where none is needed for a full pattern
            (``DiffusionLM.dense_bidirectional_mask``).
        dtype: the model's floating dtype (of an additive mask).

    Raises:
        ValueError: the model runs flash attention (or another kernel that takes no mask) and the pattern needs one.
    """
    window = family.sliding_window(config)
    if pattern.is_causal:
        return CausalAttention()
    if pattern.is_full and _maskless(family, pattern.length, window, force_dense):
        return NonCausalAttention()
    style = mask_style(family, config, lambda: _mask_reason(family, pattern, window, force_dense))
    if style == "block":
        return BlockMaskAttention(window, family.window)
    return DenseMaskAttention(window, family.window, additive_dtype=dtype if style == "additive" else None)


_IS_CAUSAL_KWARG: list[bool] = []
""":func:`_has_is_causal_kwarg`'s answer once known."""


@torch.compiler.assume_constant_result  # a traced step takes the answer as a constant: no guard on the cache's state
def _has_is_causal_kwarg() -> bool:
    """Whether the installed transformers takes ``is_causal`` as a model keyword (``TransformersKwargs``, 5.x):
    its ``merge_with_config_defaults`` then switches the mask builders and attention modules to non-causal."""
    if not _IS_CAUSAL_KWARG:
        try:
            from transformers.utils import generic
        except ImportError:  # pragma: no cover - transformers is a dependency
            _IS_CAUSAL_KWARG.append(False)
        else:
            kwargs = getattr(generic, "TransformersKwargs", None)
            _IS_CAUSAL_KWARG.append(kwargs is not None and "is_causal" in getattr(kwargs, "__annotations__", {})
                                    and hasattr(generic, "merge_with_config_defaults"))
    return _IS_CAUSAL_KWARG[0]
