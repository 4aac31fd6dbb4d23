"""Which floating dtype to compute in on this hardware: ``"auto"`` is bf16 where the device computes it natively,
float32 elsewhere.

bf16 halves memory and, on hardware with bf16 arithmetic, time. Without it, the cost reverses: a CPU that lacks
AVX512-BF16 and AMX emulates bf16 matrix products (oneDNN and ATen convert every operand), so multi-row bf16 matmuls
and their backward run several times slower than float32 — measured on a 2-core AVX2 EPYC: 256 × 576 @ 576 × 1536 in
bf16 ≈ 24× the float32 time; the demo's bf16 training made 2 updates in 300 s where float32 makes ~100. Single-row
products (an AR model's one-token decoding steps) are far less affected. Every place in unifusion that picks a dtype
for the user — ``unifusion demo``, ``unifusion sample``, the examples and the benchmarks — asks :func:`auto_dtype`,
so a newcomer on either kind of machine gets the fast one.

The rule, per device type:

* ``cuda``: bf16 when ``torch.cuda.is_bf16_supported()`` (compute capability ≥ 8.0: A100, H100, ...), else float32;
* ``cpu``: bf16 when torch dispatches its vectorised kernels at ``AVX512`` (or a higher capability) **and** oneDNN
  reports native bf16 (AVX512-BF16 or AMX; ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``), else float32. Both
  queries honour the environment variables that emulate an older CPU (``ATEN_CPU_CAPABILITY=avx2``,
  ``ONEDNN_MAX_CPU_ISA=AVX2``), so an AVX512 machine started with them chooses like an AVX2 one;
* anything else (``mps``, ``xpu``, ...): float32, the dtype every backend computes exactly.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPE_CHOICES", "auto_dtype", "cpu_capability", "describe_device", "describe_dtype_choice", "native_bf16",
           "resolve_dtype"]

#: The names a ``--dtype`` option accepts: ``"auto"`` (:func:`auto_dtype`) or an explicit floating dtype.
DTYPE_CHOICES = ("auto", "float32", "bfloat16")

# Capabilities below AVX512 on x86, as torch.backends.cpu.get_cpu_capability() spells them.
_NO_NATIVE_BF16_CAPABILITIES = frozenset({"DEFAULT", "NO AVX", "AVX2"})


def cpu_capability() -> str:
    """The vectorised instruction set torch's CPU kernels dispatch to: ``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``, ...
    (``torch.backends.cpu.get_cpu_capability()``; ``ATEN_CPU_CAPABILITY`` lowers it)."""
    return str(torch.backends.cpu.get_cpu_capability())


def _onednn_bf16() -> bool:
    """oneDNN computes bf16 natively (AVX512-BF16 or AMX), within the ISA that ``ONEDNN_MAX_CPU_ISA`` allows."""
    query = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(query()) if query is not None else False


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether ``device`` computes bf16 arithmetic natively (the rule in the module docstring)."""
    device = _check_device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return cpu_capability() not in _NO_NATIVE_BF16_CAPABILITIES and _onednn_bf16()
    return False


def auto_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """``torch.bfloat16`` where :func:`native_bf16` holds for ``device``, else ``torch.float32``."""
    return torch.bfloat16 if native_bf16(device) else torch.float32


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """A ``--dtype`` value as a ``torch.dtype``: ``"auto"`` → :func:`auto_dtype` of ``device``; ``"float32"`` /
    ``"bfloat16"`` (or the ``torch.dtype`` itself) as named."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype: expected torch.float32 or torch.bfloat16, got {dtype}")
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype: expected one of {DTYPE_CHOICES} or a torch.dtype, got {type(dtype).__name__}")
    if dtype == "auto":
        return auto_dtype(device)
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype: expected one of {DTYPE_CHOICES}, got {dtype!r}")
    return getattr(torch, dtype)


def describe_device(device: torch.device | str = "cpu") -> str:
    """One line for logs: the device, its capability and whether bf16 is native, e.g.
    ``"cpu (AVX2, no native bf16)"`` or ``"cuda:0 (NVIDIA H100 80GB HBM3, native bf16)"``."""
    device = _check_device(device)
    bf16 = "native bf16" if native_bf16(device) else "no native bf16"
    if device.type == "cpu":
        return f"cpu ({cpu_capability()}, {bf16})"
    if device.type == "cuda" and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(device)}, {bf16})"
    return f"{device} ({bf16})"


def describe_dtype_choice(option: str | torch.dtype, device: torch.device | str = "cpu", *,
                          bf16_means: str = "") -> str:
    """The line a script prints when it resolves ``--dtype option`` on ``device`` (:func:`resolve_dtype`), e.g.
    ``"device cpu (AVX2, no native bf16) | --dtype auto → float32"``; ``bf16_means`` (say ``"bf16 autocast"``) is
    appended in parentheses when the choice is bf16."""
    dtype = resolve_dtype(option, device)
    shown = str(option).removeprefix("torch.")
    how = f" ({bf16_means})" if bf16_means and dtype == torch.bfloat16 else ""
    return f"device {describe_device(device)} | --dtype {shown} → {str(dtype).removeprefix('torch.')}{how}"


def _check_device(device: torch.device | str) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"device: expected a device such as 'cpu' or 'cuda:0', got {device!r}") from err
    raise TypeError(f"device: expected a torch.device or its name, got {type(device).__name__}")
