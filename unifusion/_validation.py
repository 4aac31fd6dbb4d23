"""Input checking.

Cheap checks (types, shapes, dtypes) always run. Checks that read tensor *values* (ranges, NaN, sums) force a
host-device synchronisation on accelerators; they run by default and can be switched off for hot loops::

    uf.set_validation(False)          # globally
    with uf.validation(False):         # or for a block
        loss = uf.losses.gidd_loss(...)

This mirrors ``torch.distributions.Distribution.set_default_validate_args``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_VALIDATE = True

__all__ = ["set_validation", "validation", "validation_enabled"]


def set_validation(enabled: bool) -> None:
    """Turn value checks that need a device sync on (default) or off, for the whole process."""
    global _VALIDATE
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    _VALIDATE = enabled


def validation_enabled() -> bool:
    """Whether value checks (which synchronise with the device) currently run."""
    return _VALIDATE


@contextlib.contextmanager
def validation(enabled: bool) -> Iterator[None]:
    """Context manager that sets the validation switch for a block and restores it afterwards."""
    global _VALIDATE
    previous = _VALIDATE
    set_validation(enabled)
    try:
        yield
    finally:
        _VALIDATE = previous


# ----------------------------------------------------------------------------------------------------------
# helpers used across the package (private)


def check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def check_token_ids(name: str, value: object, num_states: int) -> torch.Tensor:
    """Integer tensor with values in [0, num_states)."""
    ids = check_tensor(name, value)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name}: expected integer token ids (int64), got dtype {ids.dtype}")
    if _VALIDATE and ids.numel() > 0:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_states:
            raise ValueError(
                f"{name}: expected token ids in [0, {num_states}), got values in [{lo}, {hi}]"
            )
    return ids.long()


def check_time(name: str, value: object, *, device: torch.device | None = None,
               dtype: torch.dtype | None = None, open_interval: bool = True) -> torch.Tensor:
    """Float tensor (or Python number) of times in (0, 1)."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected a float or a float tensor, got bool")
    if isinstance(value, (int, float)):
        t = torch.tensor(float(value), device=device, dtype=dtype or torch.get_default_dtype())
    elif isinstance(value, torch.Tensor):
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating-point tensor of times, got dtype {value.dtype}")
        t = value
        if device is not None and t.device != device:
            t = t.to(device)
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
    else:
        raise TypeError(f"{name}: expected a float or a float tensor, got {type(value).__name__}")
    if _VALIDATE and t.numel() > 0:
        lo, hi = float(t.detach().min()), float(t.detach().max())
        if open_interval and not (lo > 0.0 and hi < 1.0):
            raise ValueError(f"{name}: expected times in the open interval (0, 1), got values in [{lo}, {hi}]")
        if not open_interval and not (lo >= 0.0 and hi < 1.0):
            raise ValueError(f"{name}: expected times in [0, 1), got values in [{lo}, {hi}]")
    return t


def check_finite(name: str, value: torch.Tensor) -> None:
    if _VALIDATE and value.is_floating_point() and value.numel() > 0:
        if bool(torch.isnan(value.detach()).any()):
            raise ValueError(f"{name}: contains NaN")


def check_distribution(name: str, value: object, num_states: int, *, atol: float | None = None) -> torch.Tensor:
    """Float tensor (..., num_states), non-negative, rows summing to one."""
    p = check_tensor(name, value)
    if not p.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point distribution, got dtype {p.dtype}")
    if p.dim() == 0 or p.shape[-1] != num_states:
        raise ValueError(f"{name}: expected shape (..., {num_states}), got {tuple(p.shape)}")
    if _VALIDATE and p.numel() > 0:
        if bool(torch.isnan(p).any()):
            raise ValueError(f"{name}: contains NaN")
        if bool((p < 0).any()):
            raise ValueError(f"{name}: expected non-negative probabilities, got min {float(p.detach().min())}")
        if atol is None:
            atol = 1e-10 if p.dtype == torch.float64 else (1e-4 if p.dtype == torch.float32 else 2e-2)
        err = float((p.detach().sum(-1) - 1).abs().max())
        if err > atol:
            raise ValueError(f"{name}: expected rows summing to 1 along the last dim, worst row is off by {err:.3g}")
    return p


def check_head(name: str, value: object, num_states: int) -> torch.Tensor:
    """Float tensor (..., num_states) of logits / log-values; NaN checked when validation is on."""
    h = check_tensor(name, value)
    if not h.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {h.dtype}")
    if h.dim() == 0 or h.shape[-1] != num_states:
        raise ValueError(f"{name}: expected shape (..., {num_states}), got {tuple(h.shape)}")
    check_finite(name, h)
    return h


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any floating input is float64, else float32 (bf16/fp16 are computed in float32)."""
    for x in tensors:
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
            return torch.float64
    return torch.float32


def unwrap_model(model: Any) -> Any:
    """The module inside DDP / FSDP / DeepSpeed (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    inner = model
    for _ in range(4):
        nxt = getattr(inner, "module", None) or getattr(inner, "_orig_mod", None)
        if nxt is None:
            break
        inner = nxt
    return inner


def check_model_kernel(model: Any, kernel: Any, *, name: str = "kernel") -> None:
    """Raise ``ValueError`` when ``kernel`` does not fit the model: a different number of states, or — for a
    :class:`~unifusion.DiffusionLM`, which knows its mask token — a different mask id, or a mask/hybrid kernel on a
    model adapted without a mask token (its id ``kernel.mask_id`` is then an ordinary word).

    Models that do not know their mask token (plain callables) are checked for ``num_states`` when they expose it.
    A :class:`~unifusion.UniformKernel` on a model with a mask token is allowed (the mask token is then one more
    noise state: the AR → mask → uniform conversion path).
    """
    from .adapters import DiffusionLM  # local: adapters imports this module

    inner = unwrap_model(model)
    num_states = getattr(inner, "num_states", None)
    if isinstance(num_states, int) and num_states != kernel.num_states:
        raise ValueError(f"{name}: has {kernel.num_states} states but the model predicts {num_states}; build the "
                         f"kernel with num_states=model.num_states")
    if not isinstance(inner, DiffusionLM) or kernel.mask_id is None:
        return
    if inner.mask_token_id is None:
        raise ValueError(
            f"{name}: {type(kernel).__name__} absorbs into mask id {kernel.mask_id}, but the model has no mask token "
            f"(it was adapted with add_mask_token=False, so id {kernel.mask_id} is an ordinary word to it); adapt "
            "the model with a mask token (adapt_ar_model(..., add_mask_token=True)) or use a UniformKernel")
    if inner.mask_token_id != kernel.mask_id:
        raise ValueError(f"{name}: mask_id={kernel.mask_id} but the model's mask token is {inner.mask_token_id}; "
                         f"build the kernel with mask_id=model.mask_token_id")
