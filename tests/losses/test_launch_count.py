"""Launch counts and memory of the eager backend (what small calls run, and every call when compiling fails or is
switched off; on a GPU every op is a kernel launch): the fast loss's forward + backward over a batch is its per-row
math once plus a few ops per block of each element pass, not the whole function per block of rows.

Counted with the dispatch counter (tests/_dispatch_count.py) in two ways: on the ``meta`` device, which takes the
accelerators' block sizes and allocates and computes nothing, so the GPU shapes themselves (16,384 rows at
V = 49,152 and 262,144) are counted in a second; and on the CPU with real numbers, the CPU's block size swapped for
the accelerators' (``eager_block_rows`` of a non-CPU device) and, for comparison, the CPU's own. Memory: the bytes
of the tensors each op creates, alive until Python drops them (:class:`LiveBytes`), also on the meta device.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from _dispatch_count import DispatchCounter
from torch.utils._python_dispatch import TorchDispatchMode

import unifusion as uf
from unifusion import backend
from unifusion.losses import _x0_driver, fast
from unifusion.losses._x0_driver import X0Rows
from unifusion.losses._x0_math import RowTensors
from unifusion.losses.fast import prepare_x0_rows

GiB = 2**30
KERNELS = {"uniform": lambda V: uf.UniformKernel(V), "mask": lambda V: uf.MaskKernel(V, V - 1),
           # mask state in the middle column (masked in every pass rather than sliced off), with uniform noise
           "hybrid-mid": lambda V: uf.HybridKernel(V, V // 2, 0.3)}


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors created by the ops run under it (views and in-place results not counted) that
    are alive at once: each is counted from its creation until its last reference goes (``weakref.finalize``).
    On the meta device that is what a device allocator would hold, without the allocator's rounding and caching."""

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, tensor in zip(func._schema.returns, outs):
            if isinstance(tensor, torch.Tensor) and ret.alias_info is None:
                nbytes = tensor.numel() * tensor.element_size()
                self.current += nbytes
                weakref.finalize(tensor, self._free, nbytes)
        self.peak = max(self.peak, self.current)
        return out


def _batch(N: int, V: int, kernel_name: str):
    g = torch.Generator().manual_seed(0)
    kernel = KERNELS[kernel_name](V)
    x0 = torch.randint(0, V - 1, (N,), generator=g)
    if kernel_name == "hybrid-mid":
        x0 = torch.where(x0 == V // 2, 0, x0)
    t = torch.rand(N, generator=g).clamp(0.05, 0.95)
    return kernel, x0, kernel.sample(x0, t, generator=g), t


def _launches(N: int, V: int, kernel_name: str) -> int:
    kernel, x0, x_t, t = _batch(N, V, kernel_name)
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(1)).requires_grad_()
    with uf.validation.validation(False), DispatchCounter() as counter:
        uf.losses.gidd_loss(logits, x0, x_t, t, kernel).sum().backward()
    assert torch.isfinite(logits.grad).all()
    return counter.launches


def _meta(N: int, V: int, kernel_name: str, dtype: torch.dtype = torch.bfloat16):
    """Meta logits ``(N, V)`` that require grad and the per-row constants of a batch (prepared on the CPU, where the
    public function's checks read them, and moved over)."""
    kernel, x0, x_t, t = _batch(N, V, kernel_name)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    rows, _ = prepare_x0_rows(kernel, (N,), x0, x_t, t, compute, torch.device("cpu"), "elbo", 2.0)
    meta = X0Rows(RowTensors(*(v.to("meta") for v in rows.tensors)), rows.uniform_noise, rows.mask_id, rows.dtype,
                  rows.num_logits)
    return torch.empty(N, V, device="meta", dtype=dtype).requires_grad_(), meta


def _meta_launches(N: int, V: int, kernel_name: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """Ops of the fast loss's forward + backward on ``(N, V)`` logits on the meta device."""
    logits, rows = _meta(N, V, kernel_name, dtype)
    with uf.validation.validation(False), DispatchCounter() as counter:
        fast._X0HeadLossFunction.apply(logits, rows).sum().backward()
    assert logits.grad is not None and logits.grad.shape == (N, V) and logits.grad.dtype == dtype
    return counter.launches


def _blocks(N: int, V: int, dtype: torch.dtype, pass_name: str) -> int:
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return -(-N // _x0_driver.eager_block_rows(torch.device("meta"), V, dtype, compute, pass_name))


@pytest.fixture
def eager():
    """The eager backend (the meta batches below are far above "auto"'s threshold)."""
    backend.set_backend("eager")


@pytest.mark.parametrize("kernel_name", ["uniform", "mask"])
def test_accelerator_blocks_keep_launches_flat_in_the_number_of_rows(eager, monkeypatch, kernel_name):
    """With real numbers on the CPU and the accelerators' block sizes, 8 and 256 rows at V = 65,536 are one block per
    pass: the same ops (the per-row math runs once on whatever rows there are)."""
    sizes = _x0_driver.eager_block_rows
    monkeypatch.setattr(_x0_driver, "eager_block_rows", lambda device, *args: sizes(torch.device("meta"), *args))
    V = 1 << 16
    few, many = _launches(8, V, kernel_name), _launches(256, V, kernel_name)
    assert many == few
    assert many < 600


def test_cpu_blocks_grow_with_the_rows_which_is_why_accelerators_use_larger_ones(eager):
    """On the CPU (2^18-logit blocks: 4 rows at V = 65,536) every extra block costs the ops of the passes (107 for a
    uniform-noise kernel and float32 logits), not the per-row math again."""
    V = 1 << 16
    counts = {N: _launches(N, V, "uniform") for N in (8, 64, 128)}  # 2, 16, 32 blocks per pass
    per_block = (counts[128] - counts[64]) / 16
    assert counts[64] - counts[8] == 14 * per_block  # linear in the blocks
    assert 60 < per_block < 120
    assert counts[8] - 2 * per_block > 300  # the per-row math, once


def test_the_block_size_follows_the_device_and_the_pass():
    meta, cpu = torch.device("meta"), torch.device("cpu")
    V = 262_144
    for pass_name in ("max", "noise", "grad"):
        assert _x0_driver.eager_block_rows(cpu, V, torch.bfloat16, torch.float32, pass_name) == 1
        assert _x0_driver.eager_block_rows(cpu, 1000, torch.float32, torch.float32, pass_name) == (1 << 18) // 1000
    # an accelerator's passes take rows up to their byte budgets: at V = 262,144 and 16,384 rows of bf16 logits the
    # passes run 27, 26 and 25 blocks; float32 logits (compensated l − M) and float64 (8-byte elements) more
    assert [_blocks(16_384, V, torch.bfloat16, p) for p in ("max", "noise", "grad")] == [27, 26, 25]
    assert [_blocks(16_384, V, torch.float32, p) for p in ("max", "noise", "grad")] == [59, 30, 39]
    assert [_blocks(16_384, V, torch.float64, p) for p in ("max", "noise", "grad")] == [53, 52, 49]
    assert _x0_driver.eager_block_rows(meta, 1, torch.float32, torch.float32, "noise") > 16_384


@pytest.mark.parametrize("kernel_name", ["uniform", "mask"])
def test_gpu_shapes_cost_a_few_hundred_to_a_few_thousand_launches(eager, kernel_name):
    """At the GPU benchmark's shapes, with the block sizes an accelerator gets (bf16 logits). 8 to 512 rows at
    V = 262,144 are one block per pass: 505 ops uniform / 423 mask, nearly all of them the per-row math, which runs
    once; 16,384 × 49,152 costs 849 / 519; 16,384 × 262,144 2,654 / 1,027 (27 + 26 + 25 blocks of the three passes;
    the mask kernel has no noise pass). Before, every block of 2^27 logits ran the whole function: 490 / 420 ops per
    block, 3,454 / 2,928 and 15,754 / 13,328 launches; with the CPU's 2^18-logit blocks ~1.7M and ~8.5M."""
    V = 262_144
    one_block = _meta_launches(64, V, kernel_name)
    assert _meta_launches(8, V, kernel_name) == one_block == _meta_launches(512, V, kernel_name)
    assert one_block <= (510 if kernel_name == "uniform" else 430)
    assert _meta_launches(16_384, 49_152, kernel_name) <= (860 if kernel_name == "uniform" else 530)
    big = _meta_launches(16_384, V, kernel_name)
    assert big <= (2_700 if kernel_name == "uniform" else 1_050)
    passes = ("max", "noise", "grad") if kernel_name == "uniform" else ("max", "grad")
    extra_blocks = sum(_blocks(16_384, V, torch.bfloat16, p) - 1 for p in passes)
    assert big - one_block <= 40 * extra_blocks  # a block costs the ops of one pass (~14 to ~60), nothing per row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("kernel_name", ["uniform", "mask", "hybrid-mid"])
def test_each_pass_keeps_its_temporaries_within_its_budget(eager, monkeypatch, kernel_name, dtype):
    """The temporaries alive at once in each pass over one block stay within what :data:`EAGER_PASS_WIDTH` declares
    (so within :data:`EAGER_ACCELERATOR_PASS_BYTES` at any block), measured on the meta device."""
    N, V = 64, 1 << 16
    logits, rows = _meta(N, V, kernel_name, dtype)
    peaks: dict[str, float] = {}
    each = _x0_driver.BlockedPasses.each

    def measured(self, pass_name, job):
        start = tracker.current
        tracker.peak = start
        each(self, pass_name, job)
        rows = _x0_driver.eager_block_rows(self.logits.device, V, self.logits.dtype, self.dtype, pass_name)
        edges = _x0_driver.block_edges(N, rows)
        peaks[pass_name] = (tracker.peak - start) / ((edges[1] - edges[0]) * V)  # bytes per logit

    monkeypatch.setattr(_x0_driver.BlockedPasses, "each", measured)
    with uf.validation.validation(False), LiveBytes() as tracker:
        fast._X0HeadLossFunction.apply(logits, rows).sum().backward()
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    widths = {name: _x0_driver.EAGER_PASS_WIDTH[name][dtype == torch.float32] * compute.itemsize
              for name in ("max", "noise", "grad")}
    expected = {"max", "grad"} | ({"noise"} if kernel_name != "mask" else set())
    assert set(peaks) == expected
    assert peaks["max"] <= widths["max"] and peaks["grad"] <= widths["grad"]
    assert peaks.get("noise", 0.0) <= widths["noise"]
    assert peaks["max"] > 0.6 * widths["max"] and peaks["grad"] > 0.6 * widths["grad"]  # not far above


# peaks of the temporaries (GiB) at 16,384 × 262,144 with the earlier eager blocks (2^27 logits through the whole
# function, measured the same way): forward, backward beyond the gradient
BEFORE = {("uniform", torch.bfloat16): (8.88, 3.25), ("uniform", torch.float32): (9.38, 3.50),
          ("uniform", torch.float64): (12.38, 5.25), ("mask", torch.bfloat16): (2.13, 2.75),
          ("mask", torch.float32): (3.50, 3.50), ("mask", torch.float64): (3.13, 4.25)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("kernel_name", ["uniform", "mask"])
def test_the_largest_batch_holds_no_more_than_before(eager, kernel_name, dtype):
    """16,384 × 262,144 on the meta device: the forward's temporaries stay within the budget of its passes (8 GiB
    with the uniform-noise pass, 2 GiB for the max pass alone), the backward's beside the gradient within 3 GiB
    (+ the per-row vectors), and neither above the earlier blocks' peaks (:data:`BEFORE`)."""
    N, V = 16_384, 262_144
    logits, rows = _meta(N, V, kernel_name, dtype)
    with uf.validation.validation(False), LiveBytes() as forward:
        loss = fast._X0HeadLossFunction.apply(logits, rows).sum()
    with uf.validation.validation(False), LiveBytes() as backward:
        loss.backward()
    beyond_grad = backward.peak - N * V * dtype.itemsize
    budgets = _x0_driver.EAGER_ACCELERATOR_PASS_BYTES
    forward_budget = budgets["noise" if kernel_name == "uniform" else "max"]
    per_row = 64 * N * 8  # generous: a few dozen float64 (N,) vectors
    assert 0.6 * forward_budget < forward.peak <= forward_budget + per_row  # the budget used: few blocks
    assert 0.6 * budgets["grad"] < beyond_grad <= budgets["grad"] + per_row
    before_forward, before_backward = BEFORE[kernel_name, dtype]
    assert forward.peak <= before_forward * GiB and beyond_grad <= before_backward * GiB
