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
