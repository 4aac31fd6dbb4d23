"""The validation switch: whether value checks that synchronise with the device run.

Cheap checks (types, shapes, dtypes) always run. Checks that read tensor *values* (ranges, NaN, sums) force a
host-device synchronisation on accelerators; they run by default and can be switched off for hot loops::

    from unifusion.validation import set_validation, validation

    set_validation(False)             # for the whole process
    with validation(False):           # or for a block
        loss = uf.losses.gidd_loss(...)

This mirrors ``torch.distributions.Distribution.set_default_validate_args``. The switch is process-wide state kept
here; the package's checks read it through :func:`validation_enabled`.

Inside a region that ``torch.compile`` traces the value checks do not run whatever the switch says: reading a value
back is a host sync, which Dynamo can only handle with a graph break (and ``fullgraph=True`` refuses). Type, shape
and dtype checks still run while tracing. To validate the inputs of a compiled training step, run it once eagerly
(or check the batch before the compiled call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["set_validation", "validation", "validation_enabled"]

_enabled = True


def set_validation(enabled: bool) -> None:
    """Turn value checks that need a device sync on (default) or off, for the whole process."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    _enabled = enabled


def validation_enabled() -> bool:
    """Whether value checks (which synchronise with the device) currently run: the switch is on and the caller is not
    being traced by ``torch.compile`` (where a host sync would be a graph break)."""
    return _enabled and not torch.compiler.is_compiling()


@contextlib.contextmanager
def validation(enabled: bool) -> Iterator[None]:
    """Context manager that sets the validation switch for a block and restores it afterwards."""
    global _enabled
    previous = _enabled
    set_validation(enabled)
    try:
        yield
    finally:
        _enabled = previous
