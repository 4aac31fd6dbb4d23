"""The sync/launch counter used by the GPU-readiness tests catches what it claims to, and nothing else."""

import numpy as np
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
    assert c.sync_ops == {"copy to host": 1}, (name, c.ops)


@pytest.mark.parametrize("name, fn", [
    ("to(device)", lambda m, c: c.to("meta")),
    ("to(device=, dtype=)", lambda m, c: c.to(device="meta", dtype=torch.float64)),
    ("non_blocking=False", lambda m, c: c.to("meta", non_blocking=False)),
    ("copy_ into a device tensor", lambda m, c: m.copy_(c)),
    ("as_tensor of a CPU tensor", lambda m, c: torch.as_tensor(c, device="meta")),
    ("from_numpy().to(device)", lambda m, c: torch.from_numpy(np.ones(8)).to("meta")),
])
def test_blocking_host_to_device_copies_count(name, fn):
    """From pageable memory CUDA copies host data with cudaMemcpy and synchronises the stream (memcpy_and_sync)."""
    meta, cpu = torch.empty(8, device="meta"), torch.ones(8)
    with DispatchCounter() as c:
        _attempt(lambda: fn(meta, cpu))
    assert c.sync_ops == {"copy to device": 1}, (name, c.sync_ops)


@pytest.mark.parametrize("name, fn", [
    ("tensor(list)", lambda: torch.tensor([1, 2], device="meta")),
    ("tensor(float)", lambda: torch.tensor(0.5, device="meta")),
    ("as_tensor(list)", lambda: torch.as_tensor([1, 2], device="meta")),
    ("asarray(list)", lambda: torch.asarray([1, 2], device="meta")),
    ("new_tensor(list)", lambda: torch.empty(2, device="meta").new_tensor([1, 2])),
    ("tensor(numpy)", lambda: torch.tensor(np.ones(2), device="meta")),
    ("default device", lambda: _with_default_device("meta", lambda: torch.tensor([1.0]))),
])
def test_host_data_built_on_a_device_counts(name, fn):
    """torch.tensor(data, device=cuda) builds a CPU tensor and copies it below the dispatcher: counted by patching."""
    with DispatchCounter() as c:
        out = fn()
    assert out.device.type == "meta"
    assert c.syncs == 1, (name, c.sync_ops)  # once, also where the factory dispatches the copy itself (NumPy data)
    assert not c.host_data


def _with_default_device(device, fn):
    with torch.device(device):
        return fn()


def test_host_data_sent_to_a_named_cpu_device_is_recorded_not_counted():
    """On an all-CPU run the same calls copy nothing; host_data records them (GPU copies on a GPU run)."""
    x = torch.zeros(3)
    with DispatchCounter() as c:
        torch.tensor([1.0], device=x.device)
        torch.as_tensor([1.0], device="cpu")
        x.new_tensor([2.0])  # targets x's device
        torch.tensor([1.0])  # no device named: a host tensor, stays one
        torch.as_tensor(x, device="cpu")  # a tensor: no host data
    assert c.syncs == 0, c.sync_ops
    assert c.host_data == {"tensor": 1, "as_tensor": 1, "new_tensor": 1}, c.host_data


def test_factories_are_restored_and_work_inside():
    originals = (torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor, torch.Tensor.numpy)
    with DispatchCounter():
        t = torch.tensor([1, 2], dtype=torch.float64)
        assert t.dtype == torch.float64 and t.tolist() == [1.0, 2.0]
        assert torch.asarray([3]).item() == 3
    assert (torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor, torch.Tensor.numpy) == originals


@pytest.mark.parametrize("name, fn", [
    ("full", lambda m: torch.full((2,), 0.5, device="meta")),
    ("scalar setitem", lambda m: m.__setitem__(0, 0.5)),
    ("slice fill", lambda m: m[2:].fill_(1.0)),
    ("CPU 0-d operand", lambda m: m * torch.tensor(2.0)),  # a CPU scalar is read on the host as an argument
    ("arange", lambda m: torch.arange(3, device="meta")),
    ("linspace", lambda m: torch.linspace(0, 1, 5, device="meta")),
    ("index_fill with a device index", lambda m: m.index_fill(0, torch.full((1,), 2, device="meta"), 1.0)),
])
def test_building_on_the_device_does_not_count(name, fn):
    meta = torch.empty(8, device="meta")
    with DispatchCounter() as c:
        fn(meta)
    assert c.syncs == 0 and not c.host_data, (name, c.sync_ops, c.host_data)


def test_linalg_error_checks_count_and_the_ex_forms_do_not():
    A, b = torch.eye(3) * 2, torch.ones(3, 1)
    _, c = count_syncs(torch.linalg.solve, A, b)
    assert c.sync_ops == {"_linalg_check_errors": 1}, c.sync_ops
    _, c = count_syncs(torch.linalg.solve_ex, A, b)
    assert c.syncs == 0, c.sync_ops


def test_compiled_code_falls_back_to_eager_unless_compiled_is_set():
    @torch.compile(dynamic=False)
    def f(x):
        return (x.sin() * 2).cos().sum(-1)

    x = torch.randn(4, 8)
    f(x)  # compile outside the counted region
    with DispatchCounter() as eager:
        f(x)
    assert {"sin", "mul", "cos", "sum"} <= set(eager.ops), eager.ops  # Dynamo skips frames under a dispatch mode
    with DispatchCounter(compiled=True) as compiled:
        out = f(x)
    assert not {"sin", "mul", "cos"} & set(compiled.ops), compiled.ops  # one generated kernel, no ATen ops
    torch.testing.assert_close(out, x.sin().mul(2).cos().sum(-1))


@pytest.mark.parametrize("name, fn", [
    ("CPU to CPU", lambda m, c: c.to("cpu", dtype=torch.float64)),
    ("CPU tensor .cpu()", lambda m, c: c.cpu()),
    ("host to device, non_blocking", lambda m, c: c.to("meta", non_blocking=True)),
    ("non_blocking", lambda m, c: m.to("cpu", non_blocking=True)),
    ("non_blocking copy_", lambda m, c: c.copy_(m, non_blocking=True)),
    ("non_blocking copy_ to the device", lambda m, c: m.copy_(c, non_blocking=True)),
    ("device to device", lambda m, c: m.clone()),
    ("device to device copy_", lambda m, c: m.copy_(torch.empty(8, device="meta"))),
])
def test_other_copies_do_not_count(name, fn):
    meta, cpu = torch.empty(8, device="meta"), torch.empty(8)
    with DispatchCounter() as c:
        _attempt(lambda: fn(meta, cpu))
    assert c.syncs == 0, (name, c.sync_ops)
