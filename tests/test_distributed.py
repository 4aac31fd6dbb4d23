"""Multi-process readiness on CPU: DDP and FSDP2 gradients equal single-process gradients of the same global batch."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")


def _run(mode: str, *extra: str) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, mode, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"MAXDIFF (\S+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    return float(match.group(1))


def test_ddp_gradients_equal_single_process():
    assert _run("ddp") <= 1e-6


def test_fsdp2_gradients_equal_single_process_and_step_runs():
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "fully_shard"):  # documented: FSDP2 needs torch >= 2.6
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    assert _run("fsdp2") <= 1e-5


@pytest.mark.parametrize("mode, tol", [("ddp", 1e-6), ("fsdp2", 1e-5)])
def test_block_diffusion_gradients_equal_single_process(mode: str, tol: float):
    """Block size 4 on L = 12 (three blocks, padded rows): the block-causal loss under DDP / FSDP2."""
    import torch.distributed.fsdp as fsdp

    if mode == "fsdp2" and not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    assert _run(mode, "4") <= tol
