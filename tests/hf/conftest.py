"""Fixtures shared by the tests of unifusion.hf."""

import pytest


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """transformers' warnings about tiny random configs are noise here."""
    import transformers

    transformers.logging.set_verbosity_error()


@pytest.fixture
def static_flex():
    """Inductor's CPU flex template fails on dynamic sizes (hf/ar/blocks.py's docstring): every shape static here, and
    dynamo's caches cleared before and after, so that no other test's flex compilation sees this one's shapes.

    The setting goes through dynamo's own ``config.patch``, which restores the value it found: pytest's
    ``monkeypatch.setattr`` on dynamo's config module *deletes* the attribute on undo with pytest ≥ 9.2 (the module's
    ``__getattr__`` hides that it exists), after which every ``torch.compile`` in the process fails."""
    import torch._dynamo

    torch._dynamo.reset()
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield
    torch._dynamo.reset()
