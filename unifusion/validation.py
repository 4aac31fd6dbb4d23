"""The validation switch: whether value checks that synchronise with the device run.

Cheap checks (types, shapes, dtypes) always run. Checks that read tensor *values* (ranges, NaN, sums) force a
host-device synchronisation on accelerators; they run by default and can be switched off for hot loops::

    from unifusion.validation import set_validation, validation

    with validation(False):           # for a block (the previous state restored afterwards)
        loss = uf.losses.gidd_loss(...)
    set_validation(False)             # or from here on

This mirrors ``torch.distributions.Distribution.set_default_validate_args``. The state is one explicit object,
:data:`SWITCH` (a :class:`ValidationSwitch`); the functions here act on it and the package's checks read it through
:func:`validation_enabled`. It is the process's: a thread or a library that calls :func:`set_validation` changes it
for every caller, so prefer the context manager, which restores what it found.

Inside a region that ``torch.compile`` traces the value checks do not run whatever the switch says: reading a value
back is a host sync, which Dynamo can only handle with a graph break (and ``fullgraph=True`` refuses). Type, shape
and dtype checks still run while tracing. To validate the inputs of a compiled training step, run it once eagerly
(or check the batch before the compiled call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["SWITCH", "ValidationSwitch", "set_validation", "validation", "validation_enabled"]


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
        """Whether value checks run now: the switch is on and the caller is not being traced by ``torch.compile``
        (where a host sync would be a graph break)."""
        return self.enabled and not torch.compiler.is_compiling()

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
    """Whether value checks (which synchronise with the device) currently run: the switch is on and the caller is not
    being traced by ``torch.compile`` (where a host sync would be a graph break)."""
    return SWITCH.active()


def validation(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Context manager that sets the validation switch (:data:`SWITCH`) for a block and restores it afterwards::

        with unifusion.validation.validation(False):
            ...
    """
    return SWITCH.scoped(enabled)
