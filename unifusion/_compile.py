"""The machinery behind :mod:`unifusion.backend` (private): the setting, the policy, the compiled copies.

One ``torch.compile``d copy of a hot-path function per configuration (a key of static facts: device type, dtypes,
flags), compiled on the first call that chooses it, synchronously in the caller's thread. Whether a call chooses it
is :meth:`Compiler.chooses_compiled`: a function of the setting and of the number of logits the call processes,
nothing else (no timing, no call counting), so every process that makes the same calls makes the same choices.

Everything that changes while a process runs — the setting, the compiled copies, which configurations compiled and
which failed, the seconds spent — is held by one :class:`Compiler` object, :data:`COMPILER`, the process's; the
module's functions (:func:`run`, :func:`compiled`, :func:`chooses_compiled`) act on it. Nothing else here changes
after import. A test (or a tool that wants a clean slate) replaces :data:`COMPILER` by a fresh ``Compiler()``.
"""

from __future__ import annotations

import logging
import os
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

BACKENDS = ("auto", "compiled", "eager")

AUTO_MIN_LOGITS = 1 << 24
"""``"auto"``: calls that process at least this many logits (2²⁴ ≈ 16.8M, 64 MiB of float32) run compiled, smaller
ones eagerly. At this size an eager call of the fast loss takes about half a second on two CPU cores and a compiled
one a tenth of that, while compiling a configuration takes 20-60 s: a loop that repeats the call (training) repays it
within about a hundred steps. The README's usage block (128 positions × 1,000 states) and test-sized calls are far
below; one training step of a 135M model on 8 × 256 tokens at V = 49,152 (10⁸ logits) is far above."""

logger = logging.getLogger("unifusion")


def check_backend(backend: object, name: str = "backend") -> str:
    """``backend`` if it is one of :data:`BACKENDS`, else a ``ValueError`` naming ``name``."""
    if backend not in BACKENDS:
        raise ValueError(f"{name}: expected one of {BACKENDS}, got {backend!r}")
    return str(backend)


# Inductor options of every compiled hot path. With dynamic shapes one compiled kernel serves every size, but its C++
# loops are made serial when the sizes of the first call (or of whichever process first filled Inductor's on-disk
# cache with the same graph, a unit test say) were small; chunk size 1 keeps them parallel over rows at any size.
BASE_OPTIONS: dict[str, Any] = {"cpp.min_chunk_size": 1}

# what a failed compilation raises (Dynamo/Inductor wrap backend failures; a missing compiler or Triton shows up as
# one of these); the eager rerun tells a compiler failure from bad inputs, which raise there too
COMPILER_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, OSError, ImportError, NotImplementedError)


class Compiler:
    """The compiled copies of the hot paths and what a process has learnt about them: the setting
    (:func:`unifusion.backend.set_backend`), one ``torch.compile``d copy per configuration, the configurations whose
    first call ran (:attr:`stats`: how many, how many seconds) and those whose compilation failed (:attr:`failed`).

    ``backend``: ``"auto"``, ``"compiled"`` or ``"eager"`` (the environment variable ``UNIFUSION_BACKEND``, read
    once, for the process's :data:`COMPILER`).
    """

    def __init__(self, backend: str = "auto") -> None:
        self.backend = check_backend(backend)
        self.stats: dict[str, Any] = {"compiled": 0, "seconds": 0.0}
        """Configurations compiled so far and the seconds their first calls took
        (:func:`unifusion.backend.compile_stats`)."""
        self.failed: dict[tuple, tuple[str, str]] = {}
        """Configurations whose compilation failed: full key → (what it was, the error). Each runs eagerly from then
        on; the others still compile (:func:`unifusion.backend.compile_failures`)."""
        self.copies: dict[tuple, Callable] = {}
        self.first_call_done: set[tuple] = set()

    def chooses_compiled(self, num_logits: int) -> bool:
        """Whether a call over ``num_logits`` logits runs compiled under the current setting: always under
        ``"compiled"``, never under ``"eager"``, from :data:`AUTO_MIN_LOGITS` up under ``"auto"``."""
        return self.backend == "compiled" or (self.backend == "auto" and num_logits >= AUTO_MIN_LOGITS)

    def compiled(self, fn: Callable, key: tuple, options: dict[str, Any] | None = None) -> Callable:
        """The ``torch.compile``d copy of ``fn`` for ``key`` (static configuration), with dynamic shapes and
        :data:`BASE_OPTIONS` updated by ``options``. Nothing compiles until the copy is first called. (The hot paths
        trace as one graph each, which tests/losses/test_losses_fast.py checks; ``fullgraph`` is not demanded here
        because Dynamo declines to run compiled code under a caller's ``TorchDispatchMode``, and then runs ``fn`` as
        it is.)

        Each copy gets its own code object, so Dynamo's per-code recompile limit is not shared between the
        configurations a process uses (dtypes, devices, kernel families).
        """
        full_key = (fn.__module__, fn.__qualname__) + key
        out = self.copies.get(full_key)
        if out is None:
            name = f"{fn.__name__}_{len(self.copies)}"
            copy = types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                                      fn.__closure__)
            out = torch.compile(copy, dynamic=True, options={**BASE_OPTIONS, **(options or {})})
            self.copies[full_key] = out
        return out

    def run(self, fn: Callable, key: tuple, compiled_call: Callable[[Callable], Any], eager_call: Callable[[], Any],
            *, num_logits: int, what: Callable[[], str], options: dict[str, Any] | None = None) -> Any:
        """``compiled_call(compiled copy of fn)`` when :meth:`chooses_compiled` says so, else ``eager_call()``.

        The first compiled call of a configuration compiles it in this thread and logs one record (logger
        ``"unifusion"``, level WARNING so that it shows without any logging set up) naming ``what()`` and the seconds
        it took. A compilation failure reruns the call eagerly, warns once (``RuntimeWarning``, with ``what()`` and
        the error) and remembers the failure for *this configuration* (:attr:`failed`), which runs eagerly from then
        on; the setting and every other configuration are left as they were. An out-of-memory error propagates and
        changes nothing (it is the batch, not the compiler). Callers trace ``fn`` inline themselves when
        ``torch.compiler.is_compiling()``.
        """
        if not self.chooses_compiled(num_logits):
            return eager_call()
        full_key = (fn.__module__, fn.__qualname__) + key
        if full_key in self.failed:  # this configuration failed to compile before: eager, already reported
            return eager_call()
        fn_c = self.compiled(fn, key, options)
        start = time.perf_counter()
        try:
            out = compiled_call(fn_c)
        except COMPILER_ERRORS as err:
            if is_oom(err):
                raise
            out = eager_call()  # bad inputs raise here too, and nothing is remembered
            description = what()
            self.failed[full_key] = (description, f"{type(err).__name__}: {err}")
            warnings.warn(f"unifusion: torch.compile failed for {description} ({type(err).__name__}: {err}); this "
                          "configuration runs eagerly from now on, others still compile (unifusion.backend."
                          "compile_failures() lists the failures; set_backend('eager') skips compiling)",
                          RuntimeWarning, stacklevel=4)
            return out
        if full_key not in self.first_call_done:
            seconds = time.perf_counter() - start
            self.first_call_done.add(full_key)
            self.stats["compiled"] += 1
            self.stats["seconds"] += seconds
            logger.warning("unifusion: compiled %s in %.1f s (once per configuration; backend %r, see "
                           "unifusion.backend)", what(), seconds, self.backend)
        return out


COMPILER = Compiler(check_backend(os.environ.get("UNIFUSION_BACKEND", "auto"), "UNIFUSION_BACKEND"))
"""The process's :class:`Compiler` (its backend from ``UNIFUSION_BACKEND``, read at import; an invalid value is a
``ValueError`` naming the variable)."""


def chooses_compiled(num_logits: int) -> bool:
    """:meth:`Compiler.chooses_compiled` of :data:`COMPILER`."""
    return COMPILER.chooses_compiled(num_logits)


def compiled(fn: Callable, key: tuple, options: dict[str, Any] | None = None) -> Callable:
    """:meth:`Compiler.compiled` of :data:`COMPILER`."""
    return COMPILER.compiled(fn, key, options)


def run(fn: Callable, key: tuple, compiled_call: Callable[[Callable], Any], eager_call: Callable[[], Any], *,
        num_logits: int, what: Callable[[], str], options: dict[str, Any] | None = None) -> Any:
    """:meth:`Compiler.run` of :data:`COMPILER`."""
    return COMPILER.run(fn, key, compiled_call, eager_call, num_logits=num_logits, what=what, options=options)


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is, or was raised from, a ``torch.OutOfMemoryError`` (a ``RuntimeError`` subclass, so
    :data:`COMPILER_ERRORS` would take it for a compiler failure; Dynamo/Inductor may wrap it in their own error)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, torch.OutOfMemoryError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False
