"""How unifusion's fused hot paths run: ``torch.compile``-fused (default) or eagerly (private machinery + switch).

The fast x0-head losses (:mod:`unifusion.losses.fast`, :func:`~unifusion.losses.fused_linear_diffusion_loss`) and
the samplers' per-step vocabulary pass are pure tensor functions. Compiled, Inductor fuses each into a few
cache-resident loops per row; eagerly the same functions run op by op (block by block where that bounds memory).
Both give the same values to float rounding.

:func:`set_backend` picks one for the process; the environment variable ``UNIFUSION_BACKEND`` sets the initial
value. If compiling fails (no C++ compiler, no Triton, an unsupported device), the call is rerun eagerly, one
``RuntimeWarning`` says so, and the process stays eager. Inside a caller's own ``torch.compile`` region the
functions are traced inline.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch

__all__ = ["set_backend", "get_backend"]

BACKENDS = ("compiled", "eager")
_state = {"backend": os.environ.get("UNIFUSION_BACKEND", "compiled")}
if _state["backend"] not in BACKENDS:
    raise ValueError(f"UNIFUSION_BACKEND: expected one of {BACKENDS}, got {_state['backend']!r}")
_cache: dict[tuple, Callable] = {}
_lock = threading.Lock()
# what a failed compilation raises (Dynamo/Inductor wrap backend failures; a missing compiler or Triton shows up as
# one of these); the eager rerun tells a compiler failure from bad inputs, which raise there too
_COMPILER_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, OSError, ImportError, NotImplementedError)


def set_backend(backend: Literal["compiled", "eager"]) -> None:
    """Run the fused hot paths (fast losses, sampler steps) ``"compiled"`` (default) or ``"eager"``.

    ``"compiled"`` costs a one-off compilation per dtype, device and kernel family (seconds to tens of seconds on a
    CPU, cached on disk by Inductor) and then runs the losses at or below the cost of a cross-entropy.
    ``"eager"`` needs no compiler. Same values either way, to float rounding.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    _state["backend"] = backend


def get_backend() -> str:
    """The backend chosen by :func:`set_backend` (``"compiled"`` or ``"eager"``)."""
    return _state["backend"]


# Inductor options of every compiled hot path. With dynamic shapes one compiled kernel serves every size, but its C++
# loops are made serial when the sizes of the first call (or of whichever process first filled Inductor's on-disk
# cache with the same graph, a unit test say) were small; chunk size 1 keeps them parallel over rows at any size.
BASE_OPTIONS: dict[str, Any] = {"cpp.min_chunk_size": 1}


def compiled(fn: Callable, key: tuple, options: dict[str, Any] | None = None) -> Callable:
    """One ``torch.compile``d copy of ``fn`` per ``key`` (static configuration), with dynamic shapes and
    ``BASE_OPTIONS`` updated by ``options``.

    Each copy gets its own code object, so Dynamo's per-code recompile limit is not shared between the
    configurations a process uses (dtypes, devices, kernel families).
    """
    full_key = (fn.__module__, fn.__qualname__) + key
    out = _cache.get(full_key)
    if out is None:
        with _lock:
            out = _cache.get(full_key)
            if out is None:
                name = f"{fn.__name__}_{len(_cache)}"
                copy = type(fn)(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                                fn.__closure__)
                out = torch.compile(copy, dynamic=True, options={**BASE_OPTIONS, **(options or {})})
                _cache[full_key] = out
    return out


def run(fn: Callable, key: tuple, compiled_call: Callable[[Callable], Any], eager_call: Callable[[], Any],
        options: dict[str, Any] | None = None) -> Any:
    """``compiled_call(compiled fn)`` on the compiled backend, ``eager_call()`` on the eager one. A compilation
    failure reruns eagerly, warns once and switches the process to eager. (Callers trace ``fn`` inline themselves
    when ``torch.compiler.is_compiling()``.)
    """
    if _state["backend"] != "compiled":
        return eager_call()
    try:
        return compiled_call(compiled(fn, key, options))
    except _COMPILER_ERRORS as err:
        out = eager_call()  # bad inputs raise here too, and the backend stays as it is
        warnings.warn(f"unifusion: torch.compile failed ({type(err).__name__}: {err}); running eagerly from now on "
                      "(unifusion.set_backend('eager') skips compiling)", RuntimeWarning, stacklevel=3)
        _state["backend"] = "eager"
        return out
