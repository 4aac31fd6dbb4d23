"""Test-session defaults.

Most tests run the fused hot paths eagerly (``UNIFUSION_BACKEND=eager``, inherited by subprocesses): compiling every
configuration the suite touches (dtypes, kernel families, subprocess launchers under torchrun) would add many
minutes on a machine with an empty Inductor cache. The compiled path is tested on a few small configurations that
every compiled test shares (one compiled copy per configuration per process, see :data:`COMPILED_CONFIGS`); a test
that asks for ``"compiled"`` should use one of them. ``"auto"``, the library's default, is tested in
tests/test_compile.py. ``UNIFUSION_BACKEND=compiled python -m pytest`` runs the whole suite compiled.

The suite runs in parallel (pytest-xdist, ``-n auto --dist loadfile`` in pyproject's ``addopts``: one worker per CPU
core, each test file on one worker, so a module's fixtures are built once). Each worker gets an equal share of the
cores as its torch threads (:func:`_share_the_cores`): two workers of two threads on two cores would stall each other
in OpenMP barriers. ``-n 0`` runs in one process (for ``--pdb`` or a single file).

Every test gets the backend setting back as it found it (:func:`_restore_backend`), so a test may call
``unifusion.backend.set_backend`` freely.
"""

import os

import pytest

os.environ.setdefault("UNIFUSION_BACKEND", "eager")


def _share_the_cores() -> None:
    """Under pytest-xdist, give this worker ``cores // workers`` torch threads (at least one)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // workers))


_share_the_cores()

COMPILED_CONFIGS = {
    "hybrid-mid": "uniform noise and a mask column inside the logits (HybridKernel, mask id S // 2), float32 logits",
    "mask-last": "mask kernel with the mask state last (sliced off the logits), float32 logits",
}
"""The configurations of the fast x0-head loss that compiled tests use: for each, the loss pass (loss + row
statistics), the gradient pass from statistics and the fused linear loss's in-place pass (loss + gradient +
statistics). Float32 times and per-position weights, at least two rows (Dynamo specialises sizes 0 and 1)."""


@pytest.fixture(autouse=True)
def _restore_backend():
    from unifusion import backend

    previous = backend.get_backend()
    yield
    backend.set_backend(previous)
