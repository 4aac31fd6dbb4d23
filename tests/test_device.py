"""unifusion._device: the sync-free categorical draw (against the exact distribution) and host-to-device copies."""

from __future__ import annotations

import math

import pytest
import torch
from _dispatch_count import count_syncs

import unifusion as uf
from unifusion._device import categorical, host_to_device


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    """Pearson's χ² of draw counts against ``n · probs`` below its mean + 6 σ; states of probability 0 never drawn."""
    expected = n * probs.double()
    keep = expected > 0
    assert bool((counts[~keep] == 0).all()), (counts, probs)
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, dof)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_categorical_draws_each_row_from_its_normalised_weights(dtype):
    """Unnormalised rows with zeros (first, inside, last), a one-hot row and a wide row; 40,000 draws per row."""
    g = torch.Generator().manual_seed(0)
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0, 6.0, 0.0],
                            [0.0, 0.0, 0.0, 0.0, 0.0, 2.5],
                            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                            [5e-3, 0.0, 2.0, 0.0, 0.0, 0.0]], dtype=dtype)
    n = 40_000
    draws = categorical(weights, n, g)
    assert draws.shape == (4, n) and draws.dtype == torch.int64
    for row, w in zip(draws, weights):
        _chi2_ok(torch.bincount(row, minlength=6).double(), w.double() / w.double().sum(), n)


def test_categorical_broadcasts_leading_dims_and_is_reproducible():
    g = torch.Generator().manual_seed(1)
    weights = torch.rand(2, 3, 50, generator=g)
    a = categorical(weights, 4, torch.Generator().manual_seed(5))
    b = categorical(weights, 4, torch.Generator().manual_seed(5))
    c = categorical(weights, 4, torch.Generator().manual_seed(6))
    assert a.shape == (2, 3, 4) and torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.min()) >= 0 and int(a.max()) < 50


def test_categorical_at_a_large_vocabulary_matches_the_distribution_by_block():
    """S = 50,257 (GPT-2's vocabulary): the mass of each block of 1,000 states, drawn 200,000 times."""
    g = torch.Generator().manual_seed(2)
    S, n = 50_257, 200_000
    weights = torch.softmax(torch.randn(S, generator=g, dtype=torch.float64) * 2, -1).float()
    draws = categorical(weights, n, torch.Generator().manual_seed(3))
    blocks = torch.arange(S) // 1000
    counts = torch.zeros(int(blocks[-1]) + 1, dtype=torch.float64).index_add_(0, blocks[draws], torch.ones(n).double())
    mass = torch.zeros_like(counts).index_add_(0, blocks, weights.double())
    _chi2_ok(counts, mass / mass.sum(), n)


def test_categorical_reads_nothing_back_and_copies_nothing_to_the_device():
    weights = torch.rand(3, 7)
    _, c = count_syncs(categorical, weights, 5, torch.Generator().manual_seed(0))
    assert c.syncs == 0 and not c.host_data, (c.sync_ops, c.host_data)
    _, c = count_syncs(categorical, torch.empty(3, 7, device="meta"), 5, None)  # meta: a GPU stand-in
    assert c.syncs == 0 and not c.host_data, (c.sync_ops, c.host_data)
    _, c = count_syncs(torch.multinomial, weights, 1)  # what it replaces: its checks run inside one kernel
    assert c.ops["multinomial"] == 1


def test_sample_prior_draws_the_prior_at_a_float_time():
    """The draw every sampler starts from: GIDD's hybrid at t = 0.6 (mask and uniform noise), 60,000 positions."""
    kernel = uf.HybridKernel(7, 2, p_uniform=0.4)
    n = 60_000
    draws = kernel.sample_prior((3, n // 3), t=0.6, generator=torch.Generator().manual_seed(4))
    assert draws.shape == (3, n // 3)
    _chi2_ok(torch.bincount(draws.flatten(), minlength=7).double(), kernel.prior(0.6, dtype=torch.float64), n)


def test_host_to_device():
    """Already there: the tensor itself. To CUDA: a pinned, non-blocking copy (tests/test_cuda.py runs it under
    ``set_sync_debug_mode("error")``). Elsewhere (here the meta device): a plain copy, which the counter counts."""
    host = torch.arange(6)
    assert host_to_device(host, torch.device("cpu")) is host
    out, c = count_syncs(host_to_device, host, torch.device("meta"))
    assert out.device.type == "meta" and out.shape == host.shape and out.dtype == host.dtype
    assert c.sync_ops == {"copy to device": 1}, c.sync_ops
