"""Host syncs in the hot loops, counted on the CPU (a GPU would wait at each of them).

With default settings (validation on): one ``diffusion_loss`` step makes at most one host sync (all its value checks
read back together) and its backward none; the fused loss adds only the backward's one documented read of the incoming
gradient; a ``DiffusionLM`` forward makes one (none with validation off); the samplers validate once per
``sample()`` call, so their count does not grow with the number of steps (one generator or one per row);
``nll_bound`` likewise per time. The same holds under the ``"compiled"`` and ``"auto"`` backends (compiled code
running compiled).

Host-to-device copies (a blocking copy of pageable memory synchronises the stream on CUDA) cost nothing on an
all-CPU run, so they are counted with the ``meta`` device standing in for the GPU: samplers, losses, the fused loss's
forward, ``nll_bound`` and the kernels' draws copy no host data to the device at all (a dense
:class:`~unifusion.GeneratorKernel` copies its matrices once per device and dtype).

On a CUDA device (tests marked ``cuda``, skipped without one) the hot loops run under
``torch.cuda.set_sync_debug_mode``: with validation off, after a warm-up, a sampler run, a loss step (forward and
backward), ``nll_bound`` and ``score_choices`` raise at any synchronising CUDA operation, which also catches what the
CPU counter cannot see (syncs inside one ATen kernel); the documented syncs (the fused backward's read of the
incoming gradient, the per-call value checks, a result returned on the CPU) are counted exactly in "warn" mode.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from _dispatch_count import DispatchCounter, count_syncs
from _hf_tiny import tiny_model

import unifusion as uf
from unifusion import _compile
from unifusion import _validation as V
from unifusion._device import host_to_device
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
    with uf.validation.validation(False):
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


@pytest.mark.parametrize("kernel_name", ["uniform", "mask", "hybrid"])
@pytest.mark.parametrize("cls", [uf.BayesianSampler, uf.EulerSampler])
def test_per_row_generators_add_no_sync_per_step(model, kernel_name, cls):
    kernel = kernels(model)[kernel_name]
    counts = [count_syncs(cls(model, kernel, n).sample, 2, 8, generator=[torch.Generator().manual_seed(i)
                                                                          for i in range(2)])[1] for n in (2, 8)]
    assert counts[0].syncs == counts[1].syncs <= 1, [c.sync_ops for c in counts]


def test_cache_unchanged_keeps_its_one_documented_sync_per_step(model):
    kernel = kernels(model)["mask"]
    few, many = _sampler_syncs(lambda n: uf.BayesianSampler(model, kernel, n, cache_unchanged=True), (2, 8))
    assert many.syncs - few.syncs == 6  # one per extra step


def test_nll_bound_does_not_sync_per_time(model):
    kernel = uf.UniformKernel(model.num_states)
    counts = [count_syncs(uf.eval.nll_bound, model, _x0(model), kernel, num_times=k, batch_size=2)[1]
              for k in (2, 8)]  # one time per model call
    assert counts[0].syncs == counts[1].syncs <= 1, [c.sync_ops for c in counts]
    assert not counts[1].host_data


@pytest.mark.parametrize("scores", ["score_choices", "fair_pmi_scores"])
def test_choice_scores_check_once_per_call(model, scores):
    """The ids of every choice are checked in one read; the model calls, the corruption draws and the per-choice
    scores read nothing (the result comes back to the host once: a no-op here, one copy on a GPU)."""
    kernel = kernels(model)["mask"]
    fn = getattr(uf.eval, scores)
    extra = ([3],) if scores == "fair_pmi_scores" else ()
    counts = [count_syncs(fn, model, kernel, [5, 6], [[8, 9], [10]] * n, *extra, num_times=4, batch_size=3)[1]
              for n in (1, 4)]  # 4 and 16 rows per answer length: 2 and 6 model calls
    assert counts[0].syncs == counts[1].syncs <= 1, [c.sync_ops for c in counts]
    assert not counts[0].host_data and not counts[1].host_data


# ------------------------------------------------------------------------------------------- compiled and "auto"
@pytest.fixture
def backend(monkeypatch):
    """Switch unifusion's backend for one test (restored after)."""
    def use(name):
        uf.backend.set_backend(name)

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
    """The default backend: small calls run eagerly (the eager counts); calls at or above its threshold run the
    compiled copy (compiled on its first call, in the caller's thread), which adds no sync."""
    backend("auto")
    kernel = kernels(model)["mask"]
    assert not uf.backend.runs_compiled(2 * 8 * model.num_states)  # too little work: all of this runs eagerly
    c, b = _loss_and_backward(model, kernel, False)
    assert c.syncs <= 1 and b.syncs == 0, (c.sync_ops, b.sync_ops)
    few, many = _sampler_syncs(lambda n: uf.BayesianSampler(model, kernel, n), (2, 8))
    assert few.syncs == many.syncs <= 1, (few.sync_ops, many.sync_ops)

    monkeypatch.setattr(_compile, "AUTO_MIN_LOGITS", 1)  # everything that follows runs compiled
    kernel = uf.UniformKernel(big_model.num_states)
    uf.BayesianSampler(big_model, kernel, 2).sample(2, 8, generator=torch.Generator().manual_seed(0))  # compiles
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
    monkeypatch.setattr(V, "check_model_device", lambda *args: None)
    monkeypatch.setattr(_setup, "check_devices", lambda *args: None)
    for module in (bayesian, euler):
        monkeypatch.setattr(module, "check_head_shape", lambda name, head, *args, **kwargs: head)
    with uf.validation.validation(False):
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
    # the fused loss's forward (its backward reads g: documented)
    if isinstance(kernel, uf.kernels.InterpolatingKernel):
        calls["fused_linear_diffusion_loss"] = lambda: uf.losses.fused_linear_diffusion_loss(
            torch.randn(16, 8, device="meta"), torch.randn(META_STATES, 8, device="meta"), x0.reshape(-1),
            x0.reshape(-1), torch.full((16,), 0.5, device="meta"), kernel)
    for name, call in calls.items():
        call()  # a dense kernel copies its matrices to a new device once
        _, c = count_syncs(call)
        assert c.syncs == 0 and not c.host_data, (name, c.sync_ops, c.host_data)


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: sliding windows in its attention mask
def test_diffusion_lm_loop_copies_no_host_data_to_the_device(meta_device, family):
    """A Hugging Face model adapted by adapt_ar_model, on the meta device: its forward (padding mask, annealed
    attention), diffusion_loss (plain and fused, with backward) and both samplers copy no host data to the device."""
    lm = uf.adapt_ar_model(tiny_model(family)).to("meta")
    S = lm.num_states
    kernel = uf.MaskKernel(S, lm.mask_token_id)
    x, t = torch.zeros((2, 8), dtype=torch.long, device="meta"), torch.full((2,), 0.5, device="meta")
    mask = torch.ones((2, 8), dtype=torch.long, device="meta")
    calls = {
        "forward": lambda: lm(x, t, attention_mask=mask),
        "forward, annealed": lambda: lm(x, t, bidirectional_prob=0.5),
        "diffusion_loss + backward": lambda: uf.diffusion_loss(lm, x, kernel, attention_mask=mask).mean().backward(),
        "diffusion_loss, fused": lambda: uf.diffusion_loss(lm, x, kernel, fused=True, attention_mask=mask),
        "BayesianSampler": lambda: uf.BayesianSampler(lm, kernel, 3).sample(2, 8, device="meta"),
        "EulerSampler": lambda: uf.EulerSampler(lm, kernel, 3).sample(2, 8, device="meta"),
    }
    for name, call in calls.items():
        call()
        _, c = count_syncs(call)
        assert c.syncs == 0 and not c.host_data, (name, c.sync_ops, c.host_data)


# ------------------------------------------------------------------------- on a GPU: torch's sync debug mode
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU = "cuda"
SYNC_WARNING = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def sync_debug(mode):
    """``torch.cuda.set_sync_debug_mode(mode)`` for a block (process-wide; restored after). ``"error"`` raises a
    ``RuntimeError`` at every synchronising CUDA operation (a read back to the host, a blocking copy of pageable
    memory, a stream synchronisation), ``"warn"`` warns. Work queued before the block is waited for first."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()  # device-wide: not flagged, and not the block's
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def cuda_syncs(fn):
    """``(fn(), n)`` with n the synchronising CUDA operations ``fn`` ran (``"warn"`` mode, every warning recorded;
    the autograd engine replays the warnings of its device threads in the caller)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sync_debug("warn"):
            out = fn()
    return out, sum(SYNC_WARNING in str(w.message) for w in caught)


def warm_up(fn):
    """Run ``fn`` with validation on and off, twice: compilations (whose autotuning synchronises), cuBLAS handles
    and the caching allocators are set up before anything is counted."""
    for enabled in (True, False, True, False):
        with uf.validation.validation(enabled):
            fn()


@pytest.fixture
def gpu_backend():
    """Run one test on ``"eager"`` or ``"compiled"`` (restored after)."""
    previous = uf.backend.get_backend()
    yield uf.backend.set_backend
    uf.backend.set_backend(previous)


def _gpu_model(vocab=128):
    return uf.adapt_ar_model(tiny_model("llama", vocab_size=vocab)).to(GPU)


def _gpu_kernel(model, name):
    S = model.num_states
    return uf.UniformKernel(S) if name == "uniform" else uf.MaskKernel(S, model.mask_token_id)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.parametrize("vocab", [128, 4096])  # 4096: the draw straight from the logits, compiled (≥ 2048 states)
@pytest.mark.parametrize("kernel_name", ["uniform", "mask"])
def test_samplers_never_sync_on_cuda(gpu_backend, backend, vocab, kernel_name):
    gpu_backend(backend)
    model = _gpu_model(vocab)
    kernel = _gpu_kernel(model, kernel_name)
    prompt = torch.full((16,), -1, device=GPU)
    prompt[:4] = torch.arange(10, 14, device=GPU)
    runs = {
        "bayesian": lambda n: uf.BayesianSampler(model, kernel, n),
        "bayesian, top-k/top-p": lambda n: uf.BayesianSampler(model, kernel, n, top_k=5, top_p=0.9, temperature=0.8),
        "euler x0": lambda n: uf.EulerSampler(model, kernel, n),
        "euler m2s": lambda n: uf.EulerSampler(uf.samplers.x0_model_as(model, kernel, "m2s"), kernel, n,
                                               parameterization="m2s"),
    }

    def run(make, n, **kwargs):
        return make(n).sample(2, 16, generator=torch.Generator(GPU).manual_seed(0), **kwargs)

    for make in runs.values():  # warm-up: compilation, cuBLAS handles, the caching allocators
        warm_up(lambda make=make: (run(make, 2), run(make, 2, prompt=prompt)))
    assert uf.backend.get_backend() == backend  # a failed compilation would have switched to eager
    for name, make in runs.items():
        with uf.validation.validation(False), sync_debug("error"):
            ids = run(make, 6)
            kept = run(make, 6, prompt=prompt)
        assert ids.shape == (2, 16) and torch.equal(kept[:, :4], prompt[:4].expand(2, 4)), name
        counts = [cuda_syncs(lambda n=n, make=make: run(make, n))[1] for n in (2, 6)]  # validation on: per call
        assert counts[0] == counts[1] <= 1, (name, counts)
        counts = [cuda_syncs(lambda n=n, make=make: run(make, n, prompt=prompt))[1] for n in (2, 6)]
        assert counts[0] == counts[1] <= 2, (name, counts)  # the prompt's checks and the first output's


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.parametrize("kernel_name", ["uniform", "mask"])
@pytest.mark.parametrize("fused", [False, True])
def test_diffusion_loss_step_never_syncs_on_cuda(gpu_backend, backend, kernel_name, fused):
    """Forward and backward with validation off: no sync, but the fused backward's one documented read of the
    incoming gradient (it picks the positions to recompute); validation on adds one read to the forward."""
    gpu_backend(backend)
    model = _gpu_model()
    kernel = _gpu_kernel(model, kernel_name)
    x0 = torch.randint(0, model.num_states - 1, (2, 16), generator=torch.Generator().manual_seed(0)).to(GPU)
    mask = torch.ones((2, 16), dtype=torch.long, device=GPU)
    mask[1, 12:] = 0  # right padding
    g = torch.Generator(GPU).manual_seed(1)

    def forward():
        return uf.diffusion_loss(model, x0, kernel, generator=g, fused=fused, attention_mask=mask)

    warm_up(lambda: forward().mean().backward())
    assert uf.backend.get_backend() == backend
    with uf.validation.validation(False):
        with sync_debug("error"):
            out = forward()
        if fused:
            _, n = cuda_syncs(lambda: out.mean().backward())
            assert n == 1, n
        else:
            with sync_debug("error"):
                out.mean().backward()
    out, n = cuda_syncs(forward)
    assert n <= 1, n
    _, n = cuda_syncs(lambda: out.mean().backward())
    assert n == (1 if fused else 0), n


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_fused_linear_loss_never_syncs_on_cuda_but_for_its_backward_read(gpu_backend, backend):
    gpu_backend(backend)
    S, N, d = 4096, 64, 32
    kernel = uf.HybridKernel(S, 3, p_uniform=0.2)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, d, generator=g).to(GPU).requires_grad_()
    W = (0.1 * torch.randn(S, d, generator=g)).to(GPU).requires_grad_()
    x0 = torch.randint(4, S, (N,), generator=g).to(GPU)
    t = torch.rand(N, generator=g).clamp(0.05, 0.95).to(GPU)
    x_t = kernel.sample(x0, t, generator=torch.Generator(GPU).manual_seed(1))
    scale = torch.rand(N, generator=g).to(GPU)  # per-position weights: positions to recompute in the backward

    def forward():
        return uf.losses.fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel)

    warm_up(lambda: (forward() * scale).sum().backward())
    with uf.validation.validation(False):
        with sync_debug("error"):
            out = forward() * scale
        _, n = cuda_syncs(lambda: out.sum().backward())
    assert n == 1, n  # the incoming gradient, read once


@cuda
@pytest.mark.cuda
def test_nll_bound_and_choice_scores_never_sync_on_cuda_but_for_their_result():
    model = _gpu_model()
    kernel = _gpu_kernel(model, "mask")
    x0 = torch.randint(0, model.num_states - 1, (2, 16), generator=torch.Generator().manual_seed(0)).to(GPU)

    def bound():
        return uf.eval.nll_bound(model, x0, kernel, num_times=6, batch_size=4,  # two times per model call
                                 generator=torch.Generator(GPU).manual_seed(0))

    def scores(device):
        return uf.eval.score_choices(model, kernel, [5, 6, 7], [[8, 9], [10], [11, 12, 13]], num_times=4,
                                     batch_size=3, generator=torch.Generator(device).manual_seed(0))

    warm_up(lambda: (bound(), scores(GPU), scores("cpu")))
    with uf.validation.validation(False):
        with sync_debug("error"):
            out = bound()
        assert out.device.type == GPU and out.shape == (2,)
        for device in (GPU, "cpu"):  # draws on the device, or on the host and sent pinned and non-blocking
            result, n = cuda_syncs(lambda device=device: scores(device))
            assert result.device.type == "cpu" and n == 1, (device, n)  # the scores, returned on the CPU
    _, n = cuda_syncs(bound)  # validation on: the ids, read once
    assert n <= 1, n
    _, n = cuda_syncs(lambda: scores(GPU))  # and the scores
    assert n <= 2, n


@cuda
@pytest.mark.cuda
def test_host_to_device_copies_without_a_sync_on_cuda():
    host = torch.arange(1000)
    with sync_debug("error"):
        out = host_to_device(host, torch.device("cuda", torch.cuda.current_device()))
        host.zero_()  # the caller may write its tensor at once: the copy reads a pinned copy of it
    assert torch.equal(out.cpu(), torch.arange(1000))
