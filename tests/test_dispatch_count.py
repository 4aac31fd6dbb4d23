"""The sync/launch counter used by the GPU-readiness tests catches what it claims to, and nothing else."""

import pytest
import torch
from _dispatch_count import DispatchCounter, count_syncs


@pytest.mark.parametrize("name, fn", [
    ("item", lambda x: x.sum().item()),
    ("bool", lambda x: bool((x > 0).any())),
    ("int", lambda x: int(x.argmax())),
    ("float", lambda x: float(x.max())),
    ("nonzero", lambda x: torch.nonzero(x > 0)),
    ("bool-mask index", lambda x: x[x > 0]),
    ("masked_select", lambda x: torch.masked_select(x, x > 0)),
    ("unique", lambda x: torch.unique(x)),
    ("tolist", lambda x: x.tolist()),
    ("numpy", lambda x: x.numpy()),
    ("repeat_interleave", lambda x: torch.repeat_interleave(torch.tensor([1, 2]))),
    ("equal", lambda x: torch.equal(x, x)),
    ("bincount", lambda x: torch.bincount((x > 0).long())),
    ("histc without a range", lambda x: torch.histc(x, bins=4)),
])
def test_counts_each_kind_of_sync(name, fn):
    x = torch.randn(8)
    _, c = count_syncs(fn, x)
    assert c.syncs >= 1, (name, c.ops)


def test_pure_device_work_counts_no_sync_and_counts_launches():
    x = torch.randn(4, 8)
    with DispatchCounter() as c:
        y = torch.softmax(x, -1) * 2
        y = y.view(-1)[:5]  # views are not launches
        idx = torch.tensor([0, 1])
        z = y[idx] + torch.where(x > 0, x, 0).sum()  # integer indexing and where: no sync
        torch.repeat_interleave(x, 2, dim=0)
    assert c.syncs == 0, c.sync_ops
    assert c.launches >= 5
    assert c.launches < sum(c.ops.values())  # views were dispatched but not counted as launches
    assert z.shape == (2,)


def test_patches_are_undone():
    original = torch.Tensor.tolist
    with DispatchCounter():
        pass
    assert torch.Tensor.tolist is original


def test_histc_with_a_range_and_bincount_free_ops_do_not_count():
    x = torch.randn(8)
    _, c = count_syncs(lambda: torch.histc(x, bins=4, min=-3.0, max=3.0))
    assert c.syncs == 0, c.sync_ops
    _, c = count_syncs(lambda: torch.zeros(5).scatter_add_(0, (x > 0).long(), torch.ones(8)))  # bincount, fixed size
    assert c.syncs == 0, c.sync_ops


def _attempt(fn):
    """Run ``fn``; a copy out of the meta device has no data to copy and raises after the counter has seen it."""
    try:
        fn()
    except (NotImplementedError, RuntimeError):
        pass


@pytest.mark.parametrize("name, fn", [
    ("cpu()", lambda m, c: m.cpu()),
    ('to("cpu")', lambda m, c: m.to("cpu")),
    ("to(device=cpu, dtype=)", lambda m, c: m.to(device="cpu", dtype=torch.float64)),
    ("copy_ into a CPU tensor", lambda m, c: c.copy_(m)),
])
def test_device_to_host_copies_count(name, fn):
    """A tensor on the meta device stands in for one on a GPU: copying it to the CPU is a device→host read."""
    meta, cpu = torch.empty(8, device="meta"), torch.empty(8)
    with DispatchCounter() as c:
        _attempt(lambda: fn(meta, cpu))
    assert c.syncs == 1, (name, c.ops)


@pytest.mark.parametrize("name, fn", [
    ("CPU to CPU", lambda m, c: c.to("cpu", dtype=torch.float64)),
    ("CPU tensor .cpu()", lambda m, c: c.cpu()),
    ("host to device", lambda m, c: c.to("meta")),
    ("non_blocking", lambda m, c: m.to("cpu", non_blocking=True)),
    ("non_blocking copy_", lambda m, c: c.copy_(m, non_blocking=True)),
    ("device to device", lambda m, c: m.clone()),
])
def test_other_copies_do_not_count(name, fn):
    meta, cpu = torch.empty(8, device="meta"), torch.empty(8)
    with DispatchCounter() as c:
        _attempt(lambda: fn(meta, cpu))
    assert c.syncs == 0, (name, c.sync_ops)
