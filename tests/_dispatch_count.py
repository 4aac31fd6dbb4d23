"""Count what a piece of code asks of the device: host syncs and launched ops, on the CPU.

A GPU is rarely lent to this project, so the properties that decide speed on one are proved here by counting:

* **host syncs** — operations that make the host wait for the device: ``.item()``/``int()``/``float()``/``bool()`` of
  a tensor (``aten._local_scalar_dense``), ``nonzero``, ``equal``, ops whose output shape depends on values
  (``masked_select``, boolean-mask indexing, ``unique``, ``repeat_interleave`` without ``output_size``, ``bincount``),
  ``histc`` without a range (``min == max``: it reads the data's range first), blocking copies from another device
  to the CPU (``.cpu()``, ``.to("cpu")``, ``cpu_tensor.copy_(device_tensor)``; on CPU-only runs a tensor on the
  ``meta`` device stands in for one on a GPU), and ``.tolist()`` / ``.numpy()`` (which on the CPU read memory without
  dispatching, so they are counted by patching);
* **launches** — every non-view ATen op that reaches the dispatcher (a kernel launch on a GPU in eager mode).

Code inside a ``torch.compile``d function runs generated kernels that bypass the dispatcher: its launches are not
counted (its syncs are, when they fall back to eager ops).

Example::

    with DispatchCounter() as c:
        loss = uf.losses.gidd_loss(...)
    assert c.syncs == 0, c.sync_ops
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops that always read a value back to the host, or whose output shape depends on tensor values
_SYNC_PACKETS = (
    aten._local_scalar_dense,
    aten.nonzero,
    aten.is_nonzero,
    aten.equal,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.argwhere,
    aten.bincount,  # output length max(x) + 1: read back from the device
)


def _packet_name(func: Any) -> str:
    return str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)


def _is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    packet = getattr(func, "overloadpacket", None)
    if packet in _SYNC_PACKETS:
        return True
    if packet is aten.repeat_interleave:  # a tensor of repeats: the output length is their sum
        return func is not aten.repeat_interleave.self_int and kwargs.get("output_size") is None
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    if packet is aten.histc:  # min == max (the default 0, 0): the range is read from the data first
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return bool(lo == hi)
    if packet is aten._to_copy:  # .cpu() / .to("cpu") of a tensor on another device, unless non_blocking
        device = kwargs.get("device")
        return (device is not None and torch.device(device).type == "cpu" and _off_cpu(args[0])
                and not kwargs.get("non_blocking", False))
    if packet is aten.copy_:  # cpu_tensor.copy_(device_tensor), unless non_blocking
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return (isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu" and _off_cpu(args[1])
                and not non_blocking)
    return False


def _off_cpu(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


class DispatchCounter(TorchDispatchMode):
    """Counts host syncs and launched (non-view) ops while active.

    Attributes:
        syncs: number of operations that force a device→host sync.
        sync_ops: ``Counter`` of their names (``"tolist"`` / ``"numpy"`` for the patched methods).
        launches: number of non-view ATen ops dispatched.
        ops: ``Counter`` of every dispatched op name (views included).
    """

    def __init__(self) -> None:
        super().__init__()
        self.sync_ops: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.launches = 0
        self._patched: dict[str, Any] = {}

    @property
    def syncs(self) -> int:
        return sum(self.sync_ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = _packet_name(func)
        self.ops[name] += 1
        if not getattr(func, "is_view", False) and name not in ("detach", "alias", "lift_fresh"):
            self.launches += 1
        if _is_sync(func, args, kwargs):
            self.sync_ops[name] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> DispatchCounter:
        counter = self
        for method in ("tolist", "numpy"):
            original = getattr(torch.Tensor, method)
            self._patched[method] = original

            def patched(tensor: torch.Tensor, *a: Any, _original: Any = original, _name: str = method,
                        **k: Any) -> Any:
                counter.sync_ops[_name] += 1
                return _original(tensor, *a, **k)

            setattr(torch.Tensor, method, patched)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for method, original in self._patched.items():
                setattr(torch.Tensor, method, original)
            self._patched.clear()


def count_syncs(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, DispatchCounter]:
    """``(fn(*args, **kwargs), counter)`` with the call counted."""
    with DispatchCounter() as counter:
        out = fn(*args, **kwargs)
    return out, counter
