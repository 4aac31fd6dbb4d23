"""Multi-process readiness on CPU: DDP and FSDP2 gradients equal single-process gradients of the same global batch."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")


def _has_fsdp2() -> bool:
    import torch.distributed.fsdp as fsdp

    return hasattr(fsdp, "fully_shard")  # documented: FSDP2 needs torch >= 2.6


@pytest.fixture(scope="module")
def max_differences() -> dict[str, float]:
    """One ``torchrun`` launch computes every case (DDP and FSDP2, plain and blocks of 4): ``{case: max |Δ grad|}``
    (a launch costs two interpreters importing torch and the process group; the cases share them)."""
    cases = ["ddp", "ddp:4", "distill-ddp:4"] + (["fsdp2", "fsdp2:4", "distill-fsdp2:4"] if _has_fsdp2() else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, *cases]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {case: float(value) for case, value in re.findall(r"^MAXDIFF (\S+) (\S+)$", proc.stdout, re.M)}
    assert sorted(found) == sorted(cases), proc.stdout[-2000:]
    return found


def test_ddp_gradients_equal_single_process(max_differences):
    assert max_differences["ddp"] <= 1e-6


def test_fsdp2_gradients_equal_single_process_and_step_runs(max_differences):
    if not _has_fsdp2():
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    assert max_differences["fsdp2"] <= 1e-5


@pytest.mark.parametrize("mode, tol", [("ddp", 1e-6), ("fsdp2", 1e-5)])
def test_block_diffusion_gradients_equal_single_process(max_differences, mode: str, tol: float):
    """Block size 4 on L = 12 (three blocks, padded rows): the block-causal loss under DDP / FSDP2."""
    if mode == "fsdp2" and not _has_fsdp2():
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    assert max_differences[f"{mode}:4"] <= tol


@pytest.mark.parametrize("mode, tol", [("ddp", 1e-6), ("fsdp2", 1e-5)])
def test_distillation_gradients_under_ddp_and_fsdp2_equal_the_ranks_mean(max_differences, mode: str, tol: float):
    """``distillation_loss`` on the wrapped model (blocks of 4, a state per block): the loss runs inside the
    wrapper's call (``forward(..., head_fn=)``), so DDP all-reduces and FSDP2 gathers the weights; the gradients
    equal those of the mean of the ranks' losses on one process."""
    if mode == "fsdp2" and not _has_fsdp2():
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    assert max_differences[f"distill-{mode}:4"] <= tol


@pytest.mark.ci_only  # DeepSpeed's import and engine set-up: the costliest launch of this file
def test_distillation_through_a_deepspeed_zero_engine_equals_the_ranks_mean():
    """``distillation_loss`` on a DeepSpeed engine, ZeRO-2 and ZeRO-3 with every parameter partitioned: one SGD step
    gives the weights of the same step on the mean of the ranks' losses on one process (the loss runs inside the
    engine's call, where ZeRO-3 gathers what the fused head reads)."""
    pytest.importorskip("deepspeed")
    cases = ["distill-zero2:4", "distill-zero3:4"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, *cases]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {case: float(value) for case, value in re.findall(r"^MAXDIFF (\S+) (\S+)$", proc.stdout, re.M)}
    assert sorted(found) == sorted(cases), proc.stdout[-2000:]
    assert max(found.values()) <= 1e-6, found
