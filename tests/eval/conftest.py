"""Fixtures of the evaluation tests: the tiny tokenizer and judge, and what the harness tests run under (requested
with ``pytestmark = pytest.mark.usefixtures(...)``)."""

import pytest
import torch
from _harness_setup import DATA, ROOT
from _hf_tiny import tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny test tokenizer (tests/data/tiny_tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DATA / "tiny_tokenizer")


@pytest.fixture(scope="module")
def judge():
    """A tiny random Llama as the GenPPL judge."""
    return tiny_model("llama", seed=11)


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
