"""Fixtures shared by the tests of unifusion.hf."""

import pytest


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """transformers' warnings about tiny random configs are noise here."""
    import transformers

    transformers.logging.set_verbosity_error()


@pytest.fixture
def static_flex(monkeypatch: pytest.MonkeyPatch):
    """Inductor's CPU flex template fails on dynamic sizes (hf/blocks.py's docstring): every shape static here, and
    dynamo's caches cleared before and after, so that no other test's flex compilation sees this one's shapes."""
    import torch._dynamo

    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_shapes", False)
    yield
    torch._dynamo.reset()
