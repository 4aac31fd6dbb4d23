"""How unifusion's fused hot paths run: eager first, compiled once it pays, never a stall (machinery + switch).

The fast x0-head losses (:mod:`unifusion.losses.fast`, :func:`~unifusion.losses.fused_linear_diffusion_loss`) and
the samplers' per-step vocabulary pass are pure tensor functions. Compiled, Inductor fuses each into a few
cache-resident loops per row; eagerly the same functions run op by op. Both give the same values to float rounding.
Compiling costs seconds to a minute per configuration (dtype, device, kernel family) on a CPU.

Backends (:func:`set_backend`, or the environment variable ``UNIFUSION_BACKEND``):

* ``"auto"`` (default): a configuration runs eagerly until it has been used :data:`AUTO_MIN_CALLS` times with at least
  :data:`AUTO_MIN_WORK` logits per call — work that a compiled copy repays. It is then compiled **in a background
  thread** on a small copy of a real call's arguments, while the caller goes on eagerly; later calls use the compiled
  copy once it is ready. Small or one-off work (a tutorial, a test) never compiles, and a training loop never waits.
  :func:`wait_for_compilation` blocks until pending compilations are done (benchmarks, before timing).
* ``"compiled"``: compile on the first call of each configuration, in the caller's thread (the first call waits).
* ``"eager"``: never compile (no compiler needed).

If compiling fails (no C++ compiler, no Triton, an unsupported device), the call is served eagerly, one
``RuntimeWarning`` says so, and the process stays eager. Running out of device memory is not a compiler failure:
``torch.OutOfMemoryError`` (also when Dynamo/Inductor wrap it) propagates from the call as it would eagerly, and
the backend stays as it is; a background warm-up that runs out of memory leaves its configuration eager and tries
again after :data:`AUTO_MIN_CALLS` further uses. Inside a caller's own ``torch.compile`` region the
functions are traced inline. :func:`compile_stats` reports how many configurations compiled, how many are still
compiling and how long that took; :func:`blocking_seconds` how long callers waited for it (``"compiled"`` only).
"""

from __future__ import annotations

import os
import threading
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["set_backend", "get_backend", "wait_for_compilation", "compile_stats", "blocking_seconds"]

BACKENDS = ("auto", "compiled", "eager")
_state = {"backend": os.environ.get("UNIFUSION_BACKEND", "auto")}
if _state["backend"] not in BACKENDS:
    raise ValueError(f"UNIFUSION_BACKEND: expected one of {BACKENDS}, got {_state['backend']!r}")

AUTO_MIN_CALLS = 2
"""``"auto"``: calls of one configuration (each with at least :data:`AUTO_MIN_WORK` logits) before it compiles."""
AUTO_MIN_WORK = 1 << 20
"""``"auto"``: logits (elements) per call below which a call does not count towards compiling (~1M: a few ms)."""

_cache: dict[tuple, Callable] = {}
_lock = threading.Lock()
# what a failed compilation raises (Dynamo/Inductor wrap backend failures; a missing compiler or Triton shows up as
# one of these); the eager rerun tells a compiler failure from bad inputs, which raise there too
_COMPILER_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, OSError, ImportError, NotImplementedError)


@dataclass
class _Auto:
    """One configuration: how often it ran under ``"auto"``, and its compilation — in a background thread
    (``"auto"``) or in the caller's thread on its first call (``"compiled"``, ``blocking``)."""

    calls: int = 0
    thread: threading.Thread | None = None
    ready: Callable | None = None  # the compiled copy, once its warm-up call (or first call) has run
    seconds: float = 0.0  # how long compiling took, once done
    started: float | None = None  # time.perf_counter() when the background compilation started
    blocking: bool = False  # compiled in the caller's thread (backend "compiled"): the caller waited


_auto: dict[tuple, _Auto] = {}
GLOBAL_STATE_LOCK = threading.Lock()
"""Held by a background compilation for its whole duration: Dynamo guards on global torch state read while tracing
(e.g. ``torch.get_num_threads()``), so code that changes such state temporarily (the eager loss's threaded blocks) takes
this lock without blocking and, when it is held, runs without changing it."""
_failed: list[BaseException] = []  # a background compilation's error, reported by the next call in the main thread


def set_backend(backend: Literal["auto", "compiled", "eager"]) -> None:
    """Run the fused hot paths (fast losses, sampler steps) ``"auto"`` (default), ``"compiled"`` or ``"eager"``.

    ``"auto"`` compiles a configuration in the background once it has been used enough to repay it (see the module
    docstring) and never makes a call wait for a compiler; ``"compiled"`` compiles on the first call (seconds to tens
    of seconds on a CPU, cached on disk by Inductor); ``"eager"`` needs no compiler. Same values either way, to float
    rounding.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    _state["backend"] = backend


def get_backend() -> str:
    """The backend chosen by :func:`set_backend` (``"auto"``, ``"compiled"`` or ``"eager"``)."""
    return _state["backend"]


def wait_for_compilation(timeout: float | None = None) -> bool:
    """Block until the background compilations started by ``"auto"`` have finished; ``True`` if none is left
    running (``timeout`` in seconds, ``None`` waits as long as it takes)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _lock:
        threads = [a.thread for a in _auto.values() if a.thread is not None]
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


def compile_stats() -> dict[str, Any]:
    """``{"compiled": n, "pending": n, "seconds": s}``: configurations compiled so far, those still compiling in the
    background, and the seconds spent compiling — including, for the pending ones, the seconds since they started.

    Under ``"auto"`` a configuration compiles in a background thread (its seconds: that thread's wall time); under
    ``"compiled"`` it compiles on its first call in the caller's thread (its seconds: that call's wall time, which
    also holds the one call itself; :func:`blocking_seconds` is that part alone).
    """
    now = time.perf_counter()
    with _lock:
        entries = list(_auto.values())
    pending = [a for a in entries if a.thread is not None and a.thread.is_alive()]
    done = [a for a in entries if a.ready is not None]
    return {"compiled": len(done), "pending": len(pending),
            "seconds": sum(a.seconds for a in done) + sum(now - a.started for a in pending if a.started is not None)}


def blocking_seconds() -> float:
    """Seconds callers have waited for compilation: the first calls of each configuration under ``"compiled"``
    (``"auto"`` never makes a caller wait). A training loop subtracts the growth of this across a step from the
    step's time to count training, not compiling (``unifusion demo`` does)."""
    with _lock:
        return sum(a.seconds for a in _auto.values() if a.blocking and a.ready is not None)


# Inductor options of every compiled hot path. With dynamic shapes one compiled kernel serves every size, but its C++
# loops are made serial when the sizes of the first call (or of whichever process first filled Inductor's on-disk
# cache with the same graph, a unit test say) were small; chunk size 1 keeps them parallel over rows at any size.
# This is also what lets "auto" compile on a two-row copy of a call's arguments.
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
                copy = types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                                fn.__closure__)
                out = torch.compile(copy, dynamic=True, options={**BASE_OPTIONS, **(options or {})})
                _cache[full_key] = out
    return out


def _is_oom(err: BaseException) -> bool:
    """Whether ``err`` is, or was raised from, a ``torch.OutOfMemoryError`` (a ``RuntimeError`` subclass, so
    :data:`_COMPILER_ERRORS` would take it for a compiler failure; Dynamo/Inductor may wrap it in their own error)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, torch.OutOfMemoryError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _fail(err: BaseException) -> None:
    warnings.warn(f"unifusion: torch.compile failed ({type(err).__name__}: {err}); running eagerly from now on "
                  "(unifusion.set_backend('eager') skips compiling)", RuntimeWarning, stacklevel=4)
    _state["backend"] = "eager"


def ready(fn: Callable, key: tuple, *, work: int, warmup: Callable[[Callable], Any] | None,
          options: dict[str, Any] | None = None) -> Callable | None:
    """The compiled copy of ``fn`` for ``key`` if the caller should use it now, else ``None`` (run eagerly).

    ``"compiled"``: always the compiled copy (compiling on first use). ``"eager"``: never. ``"auto"``: counts this use
    (``work`` = logits it processes); once the configuration has :data:`AUTO_MIN_CALLS` uses of at least
    :data:`AUTO_MIN_WORK`, starts compiling it in a background thread by calling ``warmup(compiled_fn)`` (which must
    run the compiled function on small inputs of the same structure: dtypes, devices, flags, contiguity, and leading
    sizes capped at 2 so Dynamo specialises exactly as for the real call), and returns the compiled copy once that
    warm-up has finished.
    """
    if _failed:
        _fail(_failed.pop())
    backend = _state["backend"]
    if backend == "eager":
        return None
    if backend == "compiled":
        return compiled(fn, key, options)
    full_key = (fn.__module__, fn.__qualname__) + key
    with _lock:
        entry = _auto.setdefault(full_key, _Auto())
        if entry.ready is not None:
            return entry.ready
        if warmup is None or entry.thread is not None or work < AUTO_MIN_WORK:
            return None
        entry.calls += 1
        if entry.calls < AUTO_MIN_CALLS:
            return None
        entry.thread = threading.Thread(target=_compile_in_background, args=(entry, fn, key, options, warmup),
                                        name=f"unifusion-compile-{fn.__name__}", daemon=True)
        entry.started = time.perf_counter()
    entry.thread.start()
    return None


def _compile_in_background(entry: _Auto, fn: Callable, key: tuple, options: dict[str, Any] | None,
                           warmup: Callable[[Callable], Any]) -> None:
    start = time.perf_counter()
    if hasattr(os, "setpriority"):  # Linux: lower this thread's priority (and that of the compiler processes it
        try:                        # starts) so the caller's eager work keeps the CPU
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:
            pass
    try:
        compiled_fn = compiled(fn, key, options)
        with GLOBAL_STATE_LOCK, torch.no_grad():
            warmup(compiled_fn)
    except _COMPILER_ERRORS as err:  # reported by the next call (warnings from this thread may go unseen)
        if _is_oom(err):  # the device was full, not the compiler broken: stay eager for now, try again later
            with _lock:
                entry.thread, entry.calls = None, 0
            return
        _failed.append(err)
        return
    finally:
        entry.seconds = time.perf_counter() - start
    entry.ready = compiled_fn


def run(fn: Callable, key: tuple, compiled_call: Callable[[Callable], Any], eager_call: Callable[[], Any],
        options: dict[str, Any] | None = None, *, work: int = 0,
        warmup: Callable[[Callable], Any] | None = None) -> Any:
    """``compiled_call(compiled fn)`` when :func:`ready` says so, else ``eager_call()``. A compilation failure in
    the caller's thread reruns eagerly, warns once and switches the process to eager; an out-of-memory error
    propagates and changes nothing (it is the batch, not the compiler). (Callers trace ``fn`` inline themselves when
    ``torch.compiler.is_compiling()``.)"""
    fn_c = ready(fn, key, work=work, warmup=warmup, options=options)
    if fn_c is None:
        return eager_call()
    full_key = (fn.__module__, fn.__qualname__) + key
    entry = _auto.get(full_key)
    first = _state["backend"] == "compiled" and (entry is None or entry.ready is None)  # it compiles in this call
    start = time.perf_counter()
    try:
        out = compiled_call(fn_c)
    except _COMPILER_ERRORS as err:
        if _is_oom(err):
            raise
        out = eager_call()  # bad inputs raise here too, and the backend stays as it is
        _fail(err)
        return out
    if first:  # compile_stats counts it, blocking_seconds says the caller waited
        seconds = time.perf_counter() - start
        with _lock:
            entry = _auto.setdefault(full_key, _Auto())
            if entry.ready is None:
                entry.ready, entry.seconds, entry.blocking = fn_c, seconds, True
    return out
