"""Test helper: the ``"auto"`` backend of :mod:`unifusion._compile` with fresh bookkeeping (one place, so that new
state in ``_compile`` is reset by every test that needs it)."""

from __future__ import annotations

import pytest

from unifusion import _compile


def fresh_auto_backend(monkeypatch: pytest.MonkeyPatch, *, min_work: int = 100, min_calls: int = 2,
                       clear_cache: bool = True) -> None:
    """Select ``"auto"`` with no configuration seen, none failed, a threshold of ``min_work`` elements and
    ``min_calls`` calls; with ``clear_cache`` also without compiled copies (a fake ``torch.compile`` then compiles
    every configuration anew)."""
    monkeypatch.setattr(_compile, "_state", {"backend": "auto"})
    monkeypatch.setattr(_compile, "_auto", {})
    monkeypatch.setattr(_compile, "_failed", [])
    if clear_cache:
        monkeypatch.setattr(_compile, "_cache", {})
    monkeypatch.setattr(_compile, "AUTO_MIN_WORK", min_work)
    monkeypatch.setattr(_compile, "AUTO_MIN_CALLS", min_calls)
