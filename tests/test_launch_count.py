"""Launch counts of the eager fallback (taken for the whole process when compiling fails; on a GPU every op is a
kernel launch): the fast loss's forward + backward over a batch is a handful of blocks, not one block per row.

Counted with the dispatch counter (tests/_dispatch_count.py) in two ways: on the ``meta`` device, which takes the
accelerators' block size and allocates and computes nothing, so the GPU shapes themselves (16,384 rows at V = 49,152
and 262,144) are counted in a second; and on the CPU with real numbers, the CPU's block size swapped for the
accelerators' (``EAGER_ACCELERATOR_BLOCK_ELEMENTS``) and, for comparison, the CPU's own.
"""

from __future__ import annotations

import pytest
import torch
from _dispatch_count import DispatchCounter

import unifusion as uf
from unifusion.losses import _x0_kernel, fast


def _launches(N: int, V: int, kernel_name: str) -> int:
    g = torch.Generator().manual_seed(0)
    kernel = uf.UniformKernel(V) if kernel_name == "uniform" else uf.MaskKernel(V, V - 1)
    x0 = torch.randint(0, V - 1, (N,), generator=g)
    t = torch.rand(N, generator=g).clamp(0.05, 0.95)
    x_t = kernel.sample(x0, t, generator=g)
    logits = torch.randn(N, V, generator=g).requires_grad_()
    with uf.validation(False), DispatchCounter() as counter:
        uf.losses.gidd_loss(logits, x0, x_t, t, kernel).sum().backward()
    assert torch.isfinite(logits.grad).all()
    return counter.launches


def _meta_launches(N: int, V: int, kernel_name: str) -> int:
    """Ops of the fast loss's forward + backward on bf16 ``(N, V)`` logits on the meta device (the per-row constants
    are prepared on the CPU, where the public function's checks read them, and moved over)."""
    g = torch.Generator().manual_seed(0)
    kernel = uf.UniformKernel(V) if kernel_name == "uniform" else uf.MaskKernel(V, V - 1)
    x0 = torch.randint(0, V - 1, (N,), generator=g)
    t = torch.rand(N, generator=g).clamp(0.05, 0.95)
    x_t = kernel.sample(x0, t, generator=g)
    rows, _ = fast._prepare_rows(kernel, (N,), x0, x_t, t, torch.float32, torch.device("cpu"), "elbo", 2.0)
    meta = fast._Rows(**{k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in vars(rows).items()})
    logits = torch.empty(N, V, device="meta", dtype=torch.bfloat16).requires_grad_()
    with uf.validation(False), DispatchCounter() as counter:
        fast._X0HeadLossFunction.apply(logits, meta).sum().backward()
    assert logits.grad is not None and logits.grad.shape == (N, V) and logits.grad.dtype == torch.bfloat16
    return counter.launches


@pytest.fixture
def eager():
    """Eager backend on one thread: on the CPU the eager blocks are otherwise spread over Python threads, whose ops
    the (thread-local) dispatch counter does not see; on a GPU they run in the caller's thread."""
    previous, threads = uf.get_backend(), torch.get_num_threads()
    uf.set_backend("eager")
    torch.set_num_threads(1)
    yield
    uf.set_backend(previous)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel_name", ["uniform", "mask"])
def test_accelerator_blocks_keep_launches_flat_in_the_number_of_rows(eager, monkeypatch, kernel_name):
    V = 1 << 16
    monkeypatch.setattr(_x0_kernel, "EAGER_BLOCK_ELEMENTS", _x0_kernel.EAGER_ACCELERATOR_BLOCK_ELEMENTS)
    few, many = _launches(8, V, kernel_name), _launches(256, V, kernel_name)
    assert many == few  # one block either way: the count does not grow with the rows
    assert many < 1000


def test_cpu_blocks_grow_with_the_rows_which_is_why_accelerators_use_larger_ones(eager):
    V = 1 << 16  # 4 rows per CPU block (2^18 logits)
    few, many = _launches(8, V, "uniform"), _launches(64, V, "uniform")
    assert many > 4 * few  # 2 blocks vs 16: launches scale with blocks


def test_the_block_size_follows_the_device():
    assert _x0_kernel.eager_block_elements(torch.device("cpu")) == _x0_kernel.EAGER_BLOCK_ELEMENTS
    assert _x0_kernel.eager_block_elements(torch.device("meta")) == _x0_kernel.EAGER_ACCELERATOR_BLOCK_ELEMENTS
    # at V = 262,144 and 16,384 rows an accelerator runs 32 blocks: rows per block × V ≤ the budget
    rows_per_block = _x0_kernel.EAGER_ACCELERATOR_BLOCK_ELEMENTS // 262_144
    assert -(-16_384 // rows_per_block) == 32


@pytest.mark.parametrize("kernel_name", ["uniform", "mask"])
def test_gpu_shapes_cost_a_few_thousand_launches(eager, kernel_name):
    """At the GPU benchmark's shapes, with the block size an accelerator gets: 64 rows at V = 262,144 are one block
    (490 ops uniform / 417 mask, not 64 one-row blocks); up to 512 rows the count is the same; 16,384 × 49,152 is
    3,454; 16,384 × 262,144 is 32 blocks (15,754, the price of keeping one block's float32 temporaries at ~5 GiB).
    One block costs the same number of ops whatever its rows, so the count follows the blocks, not the rows."""
    assert _x0_kernel.eager_block_elements(torch.device("meta")) == _x0_kernel.EAGER_ACCELERATOR_BLOCK_ELEMENTS
    V = 262_144
    one_block = _meta_launches(64, V, kernel_name)
    assert one_block < 1000
    assert _meta_launches(8, V, kernel_name) == one_block == _meta_launches(512, V, kernel_name)
    assert _meta_launches(16_384, 49_152, kernel_name) <= 4_000  # 6 blocks
    big = _meta_launches(16_384, V, kernel_name)
    assert big <= 16_000  # 32 blocks
    assert big < 40 * one_block  # 256 times the rows of the 64-row batch: launches grow with the blocks only
    per_row_blocks = 16_384 * one_block  # what one-row blocks (2^18 logits at V = 262,144) would have cost
    assert big * 400 < per_row_blocks
