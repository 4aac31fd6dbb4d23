"""The validation switch: whether value checks that synchronise with the device run.

Cheap checks (types, shapes, dtypes) always run. Checks that read tensor *values* (ranges, NaN, sums) force a
host-device synchronisation on accelerators; they run by default and can be switched off for hot loops::

    from unifusion.validation import set_validation, validation

    set_validation(False)             # for the whole process
    with validation(False):           # or for a block
        loss = uf.losses.gidd_loss(...)

This mirrors ``torch.distributions.Distribution.set_default_validate_args``. The switch is process-wide state kept
here; the package's checks read it through :func:`validation_enabled`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["set_validation", "validation", "validation_enabled"]

_enabled = True


def set_validation(enabled: bool) -> None:
    """Turn value checks that need a device sync on (default) or off, for the whole process."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    _enabled = enabled


def validation_enabled() -> bool:
    """Whether value checks (which synchronise with the device) currently run."""
    return _enabled


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
