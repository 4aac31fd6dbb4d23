"""Fixtures of the harness tests (requested with ``pytestmark = pytest.mark.usefixtures(...)``)."""

import pytest
import torch
from _harness_setup import ROOT


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread: a 32-wide model gains nothing from threads, and on a busy 2-core machine OpenMP's barriers
    make every matmul wait for a descheduled worker (measured: 0.03 ms per linear with 1 thread, 16 ms with 2)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def harness_root(monkeypatch):
    """The repository root as the working directory: the task configs name their data files relative to it."""
    monkeypatch.chdir(ROOT)
