"""Host syncs in the hot loops, counted on the CPU (a GPU would wait at each of them).

With default settings (validation on): one ``diffusion_loss`` step makes at most one host sync (all its value checks
read back together) and its backward none; the fused loss adds only the backward's one documented read of the incoming
gradient; a ``DiffusionLM`` forward makes one (none with validation off); the samplers validate once per
``sample()`` call, so their count does not grow with the number of steps; ``nll_bound`` likewise per time. The same
holds under the ``"compiled"`` and ``"auto"`` backends (compiled code running compiled).

Host-to-device copies (a blocking copy of pageable memory synchronises the stream on CUDA) cost nothing on an
all-CPU run, so they are counted with the ``meta`` device standing in for the GPU: samplers, losses, the fused loss's
forward, ``nll_bound`` and the kernels' draws copy no host data to the device at all (a dense
:class:`~unifusion.GeneratorKernel` copies its matrices once per device and dtype).
"""

from __future__ import annotations

import pytest
import torch
from _dispatch_count import DispatchCounter, count_syncs
from _hf_tiny import tiny_model

import unifusion as uf
from unifusion import _compile
from unifusion import _validation as V
from unifusion.samplers import _setup, bayesian, euler


@pytest.fixture(scope="module")
def model():
    return uf.adapt_ar_model(tiny_model("llama"))


def kernels(model):
    S, m = model.num_states, model.mask_token_id
    return {"uniform": uf.UniformKernel(S), "mask": uf.MaskKernel(S, m), "hybrid": uf.HybridKernel(S, m, 0.1)}


class Plain(torch.nn.Module):
    """A callable x0 model that is not a DiffusionLM."""

    def __init__(self, S: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(S, S)

    def forward(self, x_t, t):
        return self.emb(x_t)


def _x0(model):
    return torch.randint(0, model.num_states - 1, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kernel_name", ["uniform", "mask", "hybrid"])
@pytest.mark.parametrize("fused", [False, True])
def test_diffusion_loss_step(model, kernel_name, fused):
    c, b = _loss_and_backward(model, kernels(model)[kernel_name], fused)
    assert c.syncs <= 1, c.sync_ops
    assert not c.host_data, c.host_data
    assert b.syncs <= (1 if fused else 0), b.sync_ops
    assert not b.host_data, b.host_data  # the fused backward's common value is filled on the device


def test_diffusion_loss_with_a_plain_model_and_given_times(model):
    kernel = uf.UniformKernel(model.num_states)
    _, c = count_syncs(uf.diffusion_loss, Plain(model.num_states), _x0(model), kernel, t=torch.full((2, 1), 0.3))
    assert c.syncs <= 1, c.sync_ops


def test_model_forward(model):
    x_t, t = _x0(model), torch.rand(2)
    _, c = count_syncs(model, x_t, t, attention_mask=torch.ones(2, 8))
    assert c.syncs == 1, c.sync_ops
    with uf.validation(False):
        _, c = count_syncs(model, x_t, t)
    assert c.syncs == 0, c.sync_ops


def _sampler_syncs(make, steps):
    return [count_syncs(make(n).sample, 2, 8, generator=torch.Generator().manual_seed(0))[1] for n in steps]


@pytest.mark.parametrize("kernel_name", ["uniform", "mask", "hybrid"])
@pytest.mark.parametrize("options", [{}, {"top_k": 5}, {"top_p": 0.9, "temperature": 0.7}])
def test_bayesian_sampler_validates_once_per_call(model, kernel_name, options):
    kernel = kernels(model)[kernel_name]
    few, many = _sampler_syncs(lambda n: uf.BayesianSampler(model, kernel, n, **options), (2, 8))
    assert few.syncs == many.syncs <= 1, (few.sync_ops, many.sync_ops)
    assert not few.host_data and not many.host_data, (few.host_data, many.host_data)


def test_bayesian_sampler_with_a_prompt(model):
    kernel = kernels(model)["mask"]
    prompt = torch.full((8,), -1)
    prompt[:3] = torch.tensor([1, 2, 3])
    counts = [count_syncs(uf.BayesianSampler(model, kernel, n).sample, 2, 8, prompt=prompt)[1] for n in (2, 8)]
    assert counts[0].syncs == counts[1].syncs <= 2, [c.sync_ops for c in counts]  # prompt checks + first output


@pytest.mark.parametrize("kernel_name", ["uniform", "mask", "hybrid"])
@pytest.mark.parametrize("parameterization", ["x0", "sedd", "m2s", "ctmc"])
def test_euler_sampler_validates_once_per_call(model, kernel_name, parameterization):
    kernel = kernels(model)[kernel_name]
    head = model if parameterization == "x0" else uf.samplers.x0_model_as(model, kernel, parameterization)
    few, many = _sampler_syncs(lambda n: uf.EulerSampler(head, kernel, n, parameterization=parameterization), (2, 8))
    assert few.syncs == many.syncs <= 1, (few.sync_ops, many.sync_ops)
    assert not few.host_data and not many.host_data, (few.host_data, many.host_data)  # e.g. x0_log_probs' index


def test_cache_unchanged_keeps_its_one_documented_sync_per_step(model):
    kernel = kernels(model)["mask"]
    few, many = _sampler_syncs(lambda n: uf.BayesianSampler(model, kernel, n, cache_unchanged=True), (2, 8))
    assert many.syncs - few.syncs == 6  # one per extra step


def test_nll_bound_does_not_sync_per_time(model):
    kernel = uf.UniformKernel(model.num_states)
    counts = [count_syncs(uf.eval.nll_bound, model, _x0(model), kernel, num_times=k)[1] for k in (2, 8)]
    assert counts[0].syncs == counts[1].syncs <= 2, [c.sync_ops for c in counts]


# ------------------------------------------------------------------------------------------- compiled and "auto"
@pytest.fixture
def backend(monkeypatch):
    """Switch unifusion's backend for one test (restored after)."""
    def use(name):
        monkeypatch.setattr(_compile, "_state", {"backend": name})

    return use


@pytest.fixture(scope="module")
def big_model():
    """A tiny model with a vocabulary large enough for the samplers' compiled draw (COMPILE_MIN_STATES)."""
    from unifusion.samplers._draws import COMPILE_MIN_STATES

    return uf.adapt_ar_model(tiny_model("llama", vocab_size=2 * COMPILE_MIN_STATES))


def _loss_and_backward(model, kernel, fused):
    """Counters of one ``diffusion_loss`` call and of its backward."""
    out, c = count_syncs(uf.diffusion_loss, model, _x0(model), kernel, generator=torch.Generator().manual_seed(1),
                         fused=fused, attention_mask=torch.ones(2, 8, dtype=torch.long))
    with DispatchCounter() as b:
        out.mean().backward()
    return c, b


def _compiled_count(fn, *args, **kwargs):
    """``fn`` counted with compiled code running compiled (DispatchCounter(compiled=True))."""
    with DispatchCounter(compiled=True) as c:
        out = fn(*args, **kwargs)
    return out, c


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_loss_step(model, backend, fused):
    """The compiled fast loss: the same syncs as eager (compile first: a compilation is not a hot loop)."""
    backend("compiled")
    kernel = kernels(model)["mask"]
    x0, mask = _x0(model), torch.ones(2, 8, dtype=torch.long)

    def step():
        out = uf.diffusion_loss(model, x0, kernel, generator=torch.Generator().manual_seed(1), fused=fused,
                                attention_mask=mask)
        out.mean().backward()
        return out

    step()  # compiles
    with DispatchCounter(compiled=True) as c:
        out = uf.diffusion_loss(model, x0, kernel, generator=torch.Generator().manual_seed(1), fused=fused,
                                attention_mask=mask)
    with DispatchCounter(compiled=True) as b:
        out.mean().backward()
    with DispatchCounter() as eager:  # Dynamo does not run compiled code under a plain dispatch mode
        step()
    assert "exp" not in c.ops and "exp" in eager.ops, c.ops  # the loss ran compiled (its exp inside a kernel)
    assert c.syncs <= 1 and not c.host_data, (c.sync_ops, c.host_data)
    assert b.syncs <= (1 if fused else 0) and not b.host_data, (b.sync_ops, b.host_data)


def test_compiled_sampler(big_model, backend):
    """BayesianSampler's compiled draw from the logits (vocabulary ≥ COMPILE_MIN_STATES): syncs per call only."""
    backend("compiled")
    kernel = uf.UniformKernel(big_model.num_states)
    uf.BayesianSampler(big_model, kernel, 2).sample(2, 8, generator=torch.Generator().manual_seed(0))  # compiles
    counts = [_compiled_count(uf.BayesianSampler(big_model, kernel, n).sample, 2, 8,
                              generator=torch.Generator().manual_seed(0))[1] for n in (2, 6)]
    assert "amax" not in counts[1].ops, counts[1].ops  # the block masses ran compiled
    assert counts[0].syncs == counts[1].syncs <= 1, [c.sync_ops for c in counts]
    assert not counts[0].host_data and not counts[1].host_data


def test_auto_backend(model, big_model, backend, monkeypatch):
    """The default backend: eager while a configuration is small or new (the eager counts), compiled in the
    background once it repeats with enough work, and the compiled copy, once swapped in, adds no sync."""
    backend("auto")
    monkeypatch.setattr(_compile, "_auto", {})
    kernel = kernels(model)["mask"]
    c, b = _loss_and_backward(model, kernel, False)
    assert c.syncs <= 1 and b.syncs == 0, (c.sync_ops, b.sync_ops)
    few, many = _sampler_syncs(lambda n: uf.BayesianSampler(model, kernel, n), (2, 8))
    assert few.syncs == many.syncs <= 1, (few.sync_ops, many.sync_ops)
    assert _compile.compile_stats()["compiled"] == 0  # too little work to compile: all of that ran eagerly

    monkeypatch.setattr(_compile, "AUTO_MIN_WORK", 1)  # compile what follows on its second use
    kernel = uf.UniformKernel(big_model.num_states)
    for _ in range(2):
        uf.BayesianSampler(big_model, kernel, 2).sample(2, 8, generator=torch.Generator().manual_seed(0))
    assert _compile.wait_for_compilation(timeout=600)
    assert _compile.compile_stats()["compiled"] >= 1
    counts = [_compiled_count(uf.BayesianSampler(big_model, kernel, n).sample, 2, 8,
                              generator=torch.Generator().manual_seed(0))[1] for n in (2, 6)]
    assert "amax" not in counts[1].ops, counts[1].ops  # the compiled copy was used
    assert counts[0].syncs == counts[1].syncs <= 1, [c.sync_ops for c in counts]


# ------------------------------------------------------------- host-to-device copies, the meta device as the GPU
META_STATES = 40
META_EMBEDDING = torch.randn(META_STATES, META_STATES, device="meta", requires_grad=True)


def meta_model(x_t, t):
    """An x0 model on the meta device: logits ``(B, L, S)`` (shapes only)."""
    return META_EMBEDDING[x_t]


def meta_kernels():
    S = META_STATES
    return {"uniform": uf.UniformKernel(S), "mask": uf.MaskKernel(S, S - 1), "hybrid": uf.HybridKernel(S, S - 1, 0.1),
            "generator": uf.GeneratorKernel(torch.ones(S, S) / S - torch.eye(S))}


@pytest.fixture
def meta_device(monkeypatch):
    """The meta device stands in for a GPU: a copy of host data to it is counted like one to CUDA. The library refuses
    meta tensors at its entry points (they hold no data: nothing to sample, score or check), so these refusals are
    lifted here; validation is off (it reads values, which meta tensors do not have)."""
    monkeypatch.setattr(V, "check_not_meta", lambda name, value: None)
    monkeypatch.setattr(_setup, "check_devices", lambda *args: None)
    for module in (bayesian, euler):
        monkeypatch.setattr(module, "check_head_shape", lambda name, head, *args, **kwargs: head)
    with uf.validation(False):
        yield


def _samplers(kernel):
    S = kernel.num_states
    prompt = torch.full((8,), -1, device="meta")
    prompt[:2] = 3  # a fill on the device
    return {
        "bayesian": lambda n: (uf.BayesianSampler(meta_model, kernel, n), {}),
        "bayesian, top-k and prompt": lambda n: (uf.BayesianSampler(meta_model, kernel, n, top_k=S // 2),
                                                 {"prompt": prompt}),
        **{f"euler {p}": lambda n, p=p: (uf.EulerSampler(
            meta_model if p == "x0" else uf.samplers.x0_model_as(meta_model, kernel, p), kernel, n,
            parameterization=p), {}) for p in euler.PARAMETERIZATIONS},
    }


@pytest.mark.parametrize("kernel_name", ["uniform", "mask", "hybrid", "generator"])
def test_samplers_copy_no_host_data_to_the_device(meta_device, kernel_name):
    """No step and no set-up copies host data to the device: the time grid, the prior, the mask index of x0_log_probs,
    the dense kernel's matrices (after their first use) are all made or kept there."""
    kernel = meta_kernels()[kernel_name]
    for name, make in _samplers(kernel).items():
        sampler, kwargs = make(2)
        sampler.sample(2, 8, device="meta", **kwargs)  # a dense kernel copies its matrices to a new device once
        for n in (2, 6):
            sampler, kwargs = make(n)
            out, c = count_syncs(sampler.sample, 2, 8, device="meta", **kwargs)
            assert out.device.type == "meta" and out.shape == (2, 8)
            assert c.syncs == 0 and not c.host_data, (name, n, c.sync_ops, c.host_data)


@pytest.mark.parametrize("kernel_name", ["uniform", "mask", "hybrid", "generator"])
def test_losses_bounds_and_draws_copy_no_host_data_to_the_device(meta_device, kernel_name):
    kernel = meta_kernels()[kernel_name]
    x0 = torch.zeros((2, 8), dtype=torch.long, device="meta")
    t_rows = torch.full((2, 1), 0.5, device="meta")
    calls = {
        "diffusion_loss": lambda: uf.diffusion_loss(meta_model, x0, kernel),
        "diffusion_loss, backward": lambda: uf.diffusion_loss(meta_model, x0, kernel).mean().backward(),
        "diffusion_loss, float t": lambda: uf.diffusion_loss(meta_model, x0, kernel, t=0.3),
        "nll_bound": lambda: uf.eval.nll_bound(meta_model, x0, kernel, num_times=3),
        "sample": lambda: kernel.sample(x0, t_rows),
        "sample_prior": lambda: kernel.sample_prior((2, 8), t=0.5, device="meta"),
        "sample_prior, t per row": lambda: kernel.sample_prior((2, 8), t=t_rows, device="meta"),
        "prior": lambda: kernel.prior(None, device="meta"),
        "x0_log_probs": lambda: uf.rates.x0_log_probs(kernel, META_EMBEDDING),
    }
    if isinstance(kernel, uf.InterpolatingKernel):  # the fused loss's forward (its backward reads g: documented)
        calls["fused_linear_diffusion_loss"] = lambda: uf.losses.fused_linear_diffusion_loss(
            torch.randn(16, 8, device="meta"), torch.randn(META_STATES, 8, device="meta"), x0.reshape(-1),
            x0.reshape(-1), torch.full((16,), 0.5, device="meta"), kernel)
    for name, call in calls.items():
        call()  # a dense kernel copies its matrices to a new device once
        _, c = count_syncs(call)
        assert c.syncs == 0 and not c.host_data, (name, c.sync_ops, c.host_data)
