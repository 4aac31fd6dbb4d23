"""The validation switch: whether value checks that synchronise with the device run.

Cheap checks (types, shapes, dtypes) always run. Checks that read tensor *values* (ranges, NaN, sums) force a
host-device synchronisation on accelerators; they run by default and can be switched off for hot loops::

    from unifusion.validation import set_validation, validation

    with validation(False):           # for a block (the previous state restored afterwards)
        loss = uf.losses.gidd_loss(...)
    set_validation(False)             # or from here on

This mirrors ``torch.distributions.Distribution.set_default_validate_args``. The state is one explicit object,
:data:`SWITCH` (a :class:`ValidationSwitch`); the functions here act on it and the package's checks read it through
:func:`validation_enabled`. It is the process's: a thread that calls :func:`set_validation` or enters
:func:`validation` changes it for every caller (the context manager restores what it found). It is the user's:
library code never sets it.

**Checks off for one context** (:func:`unchecked`): the library's own internal calls — a sampler calling the model
on tokens it made, an estimator on inputs it checked — turn the value checks off with a ``contextvars.ContextVar``,
which holds for the calling thread (or asyncio task) and what it calls, not for other threads: a thread that is
inside an estimator does not switch off another thread's checks.

Inside a region that ``torch.compile`` traces the value checks do not run whatever the switch says: reading a value
back is a host sync, which Dynamo can only handle with a graph break (and ``fullgraph=True`` refuses). Type, shape
and dtype checks still run while tracing. To validate the inputs of a compiled training step, run it once eagerly
(or check the batch before the compiled call).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = ["SWITCH", "ValidationSwitch", "set_validation", "unchecked", "validation", "validation_enabled"]

_UNCHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("unifusion_unchecked", default=False)
"""Whether the current context (thread, asyncio task) runs with value checks off (:func:`unchecked`)."""


def _checked(enabled: object) -> bool:
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    return enabled


class ValidationSwitch:
    """Whether value checks that synchronise with the device run (``enabled``, a bool; on by default)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = _checked(enabled)

    def set(self, enabled: bool) -> None:
        """Turn the value checks on or off (a ``TypeError`` for anything but a bool)."""
        self.enabled = _checked(enabled)

    def active(self) -> bool:
        """Whether value checks run now: the switch is on, the current context is not inside :func:`unchecked`, and
        the caller is not being traced by ``torch.compile`` (where a host sync would be a graph break)."""
        return self.enabled and not _UNCHECKED.get() and not torch.compiler.is_compiling()

    @contextlib.contextmanager
    def scoped(self, enabled: bool) -> Iterator[None]:
        """Context manager: the switch set to ``enabled`` for a block, the previous state restored afterwards (also
        when the block raises)."""
        previous = self.enabled
        self.set(enabled)
        try:
            yield
        finally:
            self.enabled = previous


SWITCH = ValidationSwitch()
"""The package's switch: every value check reads it (through :func:`validation_enabled`)."""


def set_validation(enabled: bool) -> None:
    """Turn value checks that need a device sync on (default) or off, for the whole process (:data:`SWITCH`)."""
    SWITCH.set(enabled)


def validation_enabled() -> bool:
    """Whether value checks (which synchronise with the device) currently run: the switch is on, the current context
    is not inside :func:`unchecked`, and the caller is not being traced by ``torch.compile`` (where a host sync would
    be a graph break)."""
    return SWITCH.active()


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Value checks off inside the block, for the current context only (this thread or asyncio task and the calls it
    makes; a ``contextvars.ContextVar``): other threads keep the switch's setting, and the previous state comes back
    on exit (also when the block raises). The library's internal calls on inputs it has checked or made use it; the
    process-wide :data:`SWITCH` is left alone. While ``torch.compile`` traces, no value check runs anyway: the block
    then sets nothing (Dynamo cannot trace a ``ContextVar.set``)."""
    if torch.compiler.is_compiling():
        yield
        return
    token = _UNCHECKED.set(True)
    try:
        yield
    finally:
        _UNCHECKED.reset(token)


def validation(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Context manager that sets the validation switch (:data:`SWITCH`) for a block and restores it afterwards::

        with unifusion.validation.validation(False):
            ...
    """
    return SWITCH.scoped(enabled)
