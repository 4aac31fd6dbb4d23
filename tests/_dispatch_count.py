"""Count what a piece of code asks of the device: host syncs and launched ops, on the CPU.

A GPU is rarely lent to this project, so the properties that decide speed on one are proved here by counting:

* **host syncs** — operations that make the host wait for the device:

  - reads back to the host: ``.item()``/``int()``/``float()``/``bool()`` of a tensor
    (``aten._local_scalar_dense``), ``nonzero``, ``equal``, ops whose output shape depends on values
    (``masked_select``, boolean-mask indexing, ``unique``, ``repeat_interleave`` without ``output_size``,
    ``bincount``), ``histc`` without a range (``min == max``: it reads the data's range first), the error check of
    the ``torch.linalg`` functions without ``_ex`` (``aten._linalg_check_errors`` reads their ``info``), blocking
    copies from another device to the CPU (``.cpu()``, ``.to("cpu")``, ``cpu_tensor.copy_(device_tensor)``), and
    ``.tolist()`` / ``.numpy()`` (which on the CPU read memory without dispatching, so they are counted by patching);
  - **blocking host→device copies**: ``cpu_tensor.to(device)`` / ``device_tensor.copy_(cpu_tensor)`` without
    ``non_blocking=True``, and ``torch.tensor`` / ``torch.as_tensor`` / ``torch.asarray`` / ``Tensor.new_tensor``
    of Python or NumPy data on a device (these build a host tensor and copy it below the dispatcher, so they are
    counted by patching). From pageable memory CUDA copies with ``cudaMemcpy`` and then synchronises the stream
    (``memcpy_and_sync``; pytorch/pytorch#120996): the host waits for every queued kernel, and
    ``torch.cuda.set_sync_debug_mode`` flags it. A ``non_blocking=True`` copy is not counted (torch's debug mode
    does not flag it either; from pageable memory the driver stages it, and may still block).

  On CPU-only runs a tensor on the ``meta`` device stands in for one on a GPU. Where everything runs on the CPU, a
  host→device copy is a no-op that dispatches nothing; what can still be seen is **host data sent to a named
  device**: ``host_data`` counts ``torch.tensor``-like calls on Python/NumPy data with an explicit ``device=`` (and
  every ``Tensor.new_tensor`` of such data, which targets its tensor's device), copies to the GPU on a GPU run. Calls
  from PyTorch itself are left out (compiled code wraps float arguments as CPU scalars with ``device="cpu"``).

* **launches** — every non-view ATen op that reaches the dispatcher (a kernel launch on a GPU in eager mode).

**What a CPU run cannot see.** Syncs inside a single ATen kernel never reach the dispatcher again. On CUDA these
include ``torch.multinomial`` in older torch (its input checks read the probabilities' range and row sums with
``.item()`` when drawing without replacement or one sample per row; torch 2.14 makes them ``_assert_async``, and
unifusion supports torch ≥ 2.4) and ``torch.linalg.matrix_exp`` (it reads the matrices' norms on the host to pick the
Taylor degree and the number of squarings: ``nonzero``, ``unique_consecutive`` and a copy to the CPU inside the
kernel). unifusion's hot paths draw categories by inverse CDF instead of ``torch.multinomial``; the one remaining
``matrix_exp`` is :class:`unifusion.GeneratorKernel`'s (a dense reference kernel for small state spaces).
The ``cuda``-marked tests of ``tests/test_syncs.py`` run the hot loops on a GPU under
``torch.cuda.set_sync_debug_mode("error")``.

**Compiled code.** While a (non-infra) dispatch mode is active, Dynamo does not run compiled code: a
``torch.compile``d function falls back to eager and every op is counted. ``DispatchCounter(compiled=True)`` declares
``ignore_compile_internals``: compiled code then runs compiled (generated kernels bypass the dispatcher: their
launches are not counted), and only what its runtime and the graph breaks dispatch is seen — the syncs a compiled
run really makes. Compile before counting (a compilation inside the counted region runs with the counter off).

Example::

    with DispatchCounter() as c:
        loss = uf.losses.gidd_loss(...)
    assert c.syncs == 0, c.sync_ops
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
import torch.utils._device
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
    aten._linalg_check_errors,  # reads the info of torch.linalg.solve, cholesky, inv, ... (the ``_ex`` forms skip it)
)


def _packet_name(func: Any) -> str:
    return str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)


def _sync_label(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The name under which ``func(*args, **kwargs)`` is counted as a host sync, or ``None`` if it is not one."""
    packet = getattr(func, "overloadpacket", None)
    name = _packet_name(func)
    if packet in _SYNC_PACKETS:
        return name
    if packet is aten.repeat_interleave:  # a tensor of repeats: the output length is their sum
        sync = func is not aten.repeat_interleave.self_int and kwargs.get("output_size") is None
        return name if sync else None
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        sync = any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
        return name if sync else None
    if packet is aten.histc:  # min == max (the default 0, 0): the range is read from the data first
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return name if lo == hi else None
    if packet is aten._to_copy:  # .cpu() of a device tensor, .to(device) of a host tensor
        device = kwargs.get("device")
        if device is None or kwargs.get("non_blocking", False):
            return None
        return _copy_label(args[0], torch.device(device))
    if packet is aten.copy_:  # cpu_tensor.copy_(device_tensor), device_tensor.copy_(cpu_tensor)
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if non_blocking or not (isinstance(args[0], torch.Tensor) and isinstance(args[1], torch.Tensor)):
            return None
        return _copy_label(args[1], args[0].device)
    return None


def _copy_label(src: Any, dst: torch.device) -> str | None:
    """``"copy to host"`` / ``"copy to device"`` for a copy of ``src`` to ``dst`` between the host and a device."""
    if not isinstance(src, torch.Tensor) or (src.device.type == "cpu") == (dst.type == "cpu"):
        return None
    return "copy to host" if dst.type == "cpu" else "copy to device"


def _called_by_torch() -> bool:
    """Whether the patched factory was called from PyTorch itself: compiled code wraps float arguments as CPU scalars
    with ``torch.as_tensor(x, device="cpu")``, which stay on the host on a GPU run too (kernels take CPU scalars)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__  # this module, and Dynamo's disable wrapper
                                 or frame.f_globals.get("__name__") == "torch._dynamo.eval_frame"):
        frame = frame.f_back
    return frame is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] == "torch"


# tensor factories that take Python/NumPy data: on a device they build a host tensor and copy it below the dispatcher
_HOST_DATA_FACTORIES = (("torch", "tensor"), ("torch", "as_tensor"), ("torch", "asarray"), ("Tensor", "new_tensor"))


class DispatchCounter(TorchDispatchMode):
    """Counts host syncs and launched (non-view) ops while active (module docstring: what counts).

    Args:
        compiled: let ``torch.compile``d code run compiled (``ignore_compile_internals``) instead of falling back to
            eager; only what its runtime dispatches is then seen.

    Attributes:
        syncs: number of operations that force a host sync (reads back, blocking host↔device copies).
        sync_ops: ``Counter`` of their names (``"tolist"`` / ``"numpy"`` for the patched methods, ``"copy to host"``
            / ``"copy to device"`` for blocking copies, ``"tensor(host data)"`` etc. for host data built on a
            device).
        host_data: ``Counter`` of ``torch.tensor``-like calls on Python/NumPy data that name a device (on the CPU
            included; ``Tensor.new_tensor`` always): host→device copies once that device is a GPU.
        launches: number of non-view ATen ops dispatched.
        ops: ``Counter`` of every dispatched op name (views included).
    """

    def __init__(self, *, compiled: bool = False) -> None:
        super().__init__()
        self.compiled = compiled
        self.sync_ops: Counter[str] = Counter()
        self.host_data: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.launches = 0
        self._patched: list[tuple[Any, str, Any]] = []

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]  # per instance, not per class
        return self.compiled

    @property
    def syncs(self) -> int:
        return sum(self.sync_ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = _packet_name(func)
        self.ops[name] += 1
        if not getattr(func, "is_view", False) and name not in ("detach", "alias", "lift_fresh"):
            self.launches += 1
        label = _sync_label(func, args, kwargs)
        if label is not None:
            self.sync_ops[label] += 1
        return func(*args, **kwargs)

    def _patch(self, owner: Any, attr: str, replacement: Any) -> None:
        self._patched.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, replacement)

    def __enter__(self) -> DispatchCounter:
        # ``with torch.device(...)`` matches factories against a set cached on first use: fill it with the
        # originals before they are patched (it would otherwise keep the patched ones for the whole process)
        getattr(torch.utils._device, "_device_constructors", lambda: None)()
        for method in ("tolist", "numpy"):
            self._patch(torch.Tensor, method, self._counting_read(getattr(torch.Tensor, method), method))
        for owner_name, attr in _HOST_DATA_FACTORIES:
            owner = torch if owner_name == "torch" else torch.Tensor
            self._patch(owner, attr, self._counting_factory(getattr(owner, attr), attr, owner_name == "Tensor"))
        super().__enter__()
        return self

    # The patched functions are never traced by Dynamo: compiled code calls ``torch.tensor`` at run time (to wrap
    # float arguments of dynamic-shape graphs), and tracing the wrapper would specialise on each float and recompile.
    def _counting_read(self, original: Any, name: str) -> Any:
        @torch.compiler.disable
        def read(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            self.sync_ops[name] += 1
            return original(tensor, *a, **k)

        return read

    def _counting_factory(self, original: Any, name: str, method: bool) -> Any:
        @torch.compiler.disable
        def build(*a: Any, **k: Any) -> Any:
            copies = self.sync_ops["copy to device"]
            out = original(*a, **k)
            data = a[1] if method else (a[0] if a else k.get("data", k.get("obj")))
            # tensor data (and NumPy data, for some factories) dispatch their copy: counted there already
            dispatched = isinstance(data, torch.Tensor) or self.sync_ops["copy to device"] > copies
            if isinstance(out, torch.Tensor) and not dispatched:
                if out.device.type != "cpu":
                    self.sync_ops[f"{name}(host data)"] += 1
                elif (method or k.get("device") is not None) and not _called_by_torch():
                    self.host_data[name] += 1
            return out

        return build

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for owner, attr, original in reversed(self._patched):
                setattr(owner, attr, original)
            self._patched.clear()


def count_syncs(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, DispatchCounter]:
    """``(fn(*args, **kwargs), counter)`` with the call counted."""
    with DispatchCounter() as counter:
        out = fn(*args, **kwargs)
    return out, counter
