"""Fixtures shared by the tests of unifusion.hf."""

import pytest


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """transformers' warnings about tiny random configs are noise here."""
    import transformers

    transformers.logging.set_verbosity_error()
