"""The cross-entropy-cost x0-head losses (unifusion.losses.fast) against the float64 references in losses.native.

The eager backend runs every test; the compiled one runs the float32 accuracy test on the configurations that all
compiled tests share (tests/conftest.py: "hybrid-mid" and "mask-last"), so the suite compiles each once."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import unifusion as uf
from unifusion import backend
from unifusion.conversions import convert_x0_to
from unifusion.losses import _x0_driver, _x0_math, fast, native

S = 40


def _kernels():
    g = torch.Generator().manual_seed(1)
    p_u, gamma = (float(v) for v in torch.rand(2, generator=g))
    return {
        "uniform-linear": uf.UniformKernel(S),
        "uniform-cosine": uf.UniformKernel(S, uf.schedules.CosineSchedule()),
        "uniform-loglinear": uf.UniformKernel(S, uf.schedules.LogLinearSchedule()),
        "mask-linear": uf.MaskKernel(S, 5),
        "mask-cosine": uf.MaskKernel(S, S - 1, uf.schedules.CosineSchedule()),
        "hybrid-random": uf.HybridKernel(S, 0, 0.05 + 0.9 * p_u, 0.1 + 1.9 * gamma),
        "hybrid-p0": uf.HybridKernel(S, 7, 0.0),
        "hybrid-mid": uf.HybridKernel(S, S // 2, 0.3),
    }


KERNELS = _kernels()
# the compiled configurations of tests/conftest.py: uniform noise with a mask column inside the logits, and the mask
# kernel with its mask state last (float32 logits)
COMPILED = ("hybrid-mid", "mask-cosine")


def _cases(names):
    """(kernel name, backend) pairs: every kernel eagerly, the shared configurations compiled too."""
    return [(name, "eager") for name in names] + [(name, "compiled") for name in names if name in COMPILED]


TIMES = torch.tensor([1e-6, 1e-4, 0.01, 0.2, 0.5, 0.8, 0.99, 1 - 1e-4, 1 - 1e-6], dtype=torch.float64)


def _batch(kernel, n=72, dtype=torch.float64, seed=0, times=None):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randint(0, S, (n,), generator=g)
    if kernel.mask_id is not None:
        x0 = torch.where(x0 == kernel.mask_id, (x0 + 1) % S, x0)
    t = times[torch.arange(n) % len(times)] if times is not None else torch.rand(n, generator=g, dtype=torch.float64)
    t = t.to(torch.float32).to(torch.float64) if dtype != torch.float64 else t  # representable in float32
    x_t = kernel.sample(x0, t, generator=g)
    x_t[:4] = x0[:4]  # some clean positions for sure
    logits = torch.randn(n, S, generator=g, dtype=torch.float64) * 3
    return logits.to(dtype), x0, x_t, t


def _ref_and_grad(logits, x0, x_t, t, kernel, weighting, scale):
    L = logits.detach().to(torch.float64).requires_grad_()
    ref = native.reference_gidd_loss(L, x0, x_t, t, kernel, weighting)
    (g,) = torch.autograd.grad((ref * scale).sum(), L)
    return ref.detach(), g


@pytest.mark.parametrize("weighting", ["elbo", "clip", "dynamic"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_float64_equals_reference_values_and_grads(name, weighting):
    kernel = KERNELS[name]
    logits, x0, x_t, t = _batch(kernel, times=TIMES)
    scale = torch.rand(len(x0), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    scale[::5] = 0.0  # padding positions
    ref, g_ref = _ref_and_grad(logits, x0, x_t, t, kernel, weighting, scale)
    L = logits.clone().requires_grad_()
    out = fast.gidd_loss(L, x0, x_t, t, kernel, weighting)
    (out * scale).sum().backward()
    assert out.dtype == torch.float64 and out.shape == x0.shape
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-300)
    torch.testing.assert_close(L.grad, g_ref, rtol=1e-9, atol=1e-12 * float(g_ref.abs().max()))
    assert torch.all(L.grad[::5] == 0)  # padded positions get no gradient


@pytest.mark.parametrize("name, backend_name", _cases(KERNELS))
def test_float32_is_as_accurate_as_a_float32_cross_entropy(name, backend_name):
    """float32 logits and times: loss within 4e-6 relative of the float64 truth and gradient within 1e-5 (of its
    max), or no worse than the float32 reference where float32 schedule values themselves are off (cosine, t → 1).
    Compiled: no compiler failure (served eagerly with a RuntimeWarning, which fails here)."""
    kernel = KERNELS[name]
    logits, x0, x_t, t = _batch(kernel, dtype=torch.float32, times=TIMES, n=90)
    scale = torch.ones(len(x0), dtype=torch.float64)
    ref, g_ref = _ref_and_grad(logits, x0, x_t, t, kernel, "elbo", scale)
    L = logits.clone().requires_grad_()
    ref32 = native.reference_gidd_loss(L, x0, x_t, t.float(), kernel)
    (g_ref32,) = torch.autograd.grad(ref32.sum(), L)
    with backend.using(backend_name), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = fast.gidd_loss(L, x0, x_t, t.float(), kernel)
        out.sum().backward()
        assert backend.get_backend() == backend_name  # no compiler failure
    assert out.dtype == torch.float32 and L.grad.dtype == torch.float32

    def rel(x):
        return (x.detach().double() - ref).abs() / ref.abs().clamp_min(1e-30)

    assert torch.all(rel(out) <= torch.clamp(2 * rel(ref32), min=4e-6))
    grad_err = float((L.grad.double() - g_ref).abs().max()) / float(g_ref.abs().max())
    ref_err = float((g_ref32.double() - g_ref).abs().max()) / float(g_ref.abs().max())
    assert grad_err <= max(1e-5, 2 * ref_err)


@pytest.mark.parametrize("name", ["uniform-linear", "mask-linear", "hybrid-random"])
def test_bf16_logits_are_finite_and_match_float32_math(name):
    kernel = KERNELS[name]
    logits, x0, x_t, t = _batch(kernel, dtype=torch.bfloat16)
    L = logits.clone().requires_grad_()
    out = fast.gidd_loss(L, x0, x_t, t.float(), kernel)
    out.sum().backward()
    assert out.dtype == torch.float32 and L.grad.dtype == torch.bfloat16
    assert torch.isfinite(out).all() and torch.isfinite(L.grad).all()
    ref, g_ref = _ref_and_grad(logits, x0, x_t, t.float().double(), kernel, "elbo", torch.ones(len(x0)))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(L.grad.double(), g_ref, rtol=1e-2, atol=1e-2 * float(g_ref.abs().max()))


@pytest.mark.parametrize("name", ["uniform-cosine", "mask-linear", "hybrid-random"])
def test_gradcheck_float64(name):
    kernel = KERNELS[name]
    logits, x0, x_t, t = _batch(kernel, n=6)
    L = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda z: fast.x0_head_loss(z, x0, x_t, t, kernel), (L,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["uniform-linear", "mask-cosine", "hybrid-random"])
def test_eager_passes_take_their_own_blocks(name, dtype, monkeypatch):
    """The eager backend runs each element pass on its own blocks (an accelerator sizes them from the pass's byte
    budget) and the per-row math once over all rows: with 7, 3 and 5 rows per block for the max, noise and gradient
    passes, values and gradients are those of one block per pass, bit for bit (one thread: same reduction order)."""
    kernel = KERNELS[name]
    logits, x0, x_t, t = _batch(kernel, n=101, dtype=dtype)
    scale = torch.rand(len(x0), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    backend.set_backend("eager")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    results = []
    try:
        for rows_per_block in ({"max": 7, "noise": 3, "grad": 5}, None):
            if rows_per_block is not None:
                monkeypatch.setattr(_x0_driver, "eager_block_rows", lambda device, S, ld, dt, p, r=rows_per_block: r[p])
            else:
                monkeypatch.undo()
            L = logits.clone().requires_grad_()
            out = fast.gidd_loss(L, x0, x_t, t.to(torch.float32) if dtype != torch.float64 else t, kernel)
            (out * scale).sum().backward()
            results.append((out.detach(), L.grad))
    finally:
        torch.set_num_threads(previous)
    assert torch.isfinite(results[0][1]).all()
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("backend_name", ["eager", "auto"])
def test_loss_under_inference_mode_and_no_grad(backend_name, mode, monkeypatch):
    """Under ``inference_mode`` the loss and its buffers are inference tensors, written by the eager blocks in the
    caller's thread (34 blocks of 3 rows per pass here); the same values as with autograd on. ``"auto"`` runs such
    small calls eagerly."""
    kernel = KERNELS["hybrid-random"]
    logits, x0, x_t, t = _batch(kernel, n=101)
    backend.set_backend(backend_name)
    monkeypatch.setattr(_x0_driver, "EAGER_BLOCK_ELEMENTS", 3 * S)
    blocks = []
    each = _x0_driver.BlockedPasses.each
    monkeypatch.setattr(_x0_driver.BlockedPasses, "each",
                        lambda self, name, job: (blocks.append(name), each(self, name, job))[1])
    expected = fast.gidd_loss(logits, x0, x_t, t, kernel)
    with getattr(torch, mode)():
        out = fast.gidd_loss(logits, x0, x_t, t, kernel)
    assert blocks == ["max", "noise"] * 2  # the eager passes ran, twice
    assert out.is_inference() == (mode == "inference_mode")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_x_minus_log1p_is_accurate_in_both_precisions():
    """x − log1p(x) against an exact float64 series/direct evaluation over 1e-30 … 1e30 (float64 cancels below 1e-4,
    so the truth there is the series x²/2 − x³/3 + x⁴/4 − …); float32 with log x computed by the function or passed
    in as the loss passes it (hi + lo), alone or with x / (1 + x) sharing its division."""
    x = torch.logspace(-30, 30, 6001, dtype=torch.float64)
    k = torch.arange(2, 40, dtype=torch.float64)

    def truth_of(x):
        series = ((-1.0) ** k * x.clamp(max=1e-2).unsqueeze(-1) ** k / k).sum(-1)
        return torch.where(x < 1e-2, series, x - torch.log1p(x))

    def rel(got, truth):
        ok = truth > 1e-36  # float32 underflows below ~1e-38
        return float(((got.double() - truth).abs() / truth)[ok].max())

    assert rel(_x0_math.x_minus_log1p(x), truth_of(x)) <= 5e-14
    x32 = x.float()
    truth = truth_of(x32.double())  # of the float32 input
    log_x = torch.log(x32.double())
    log_x_hi = log_x.float()
    log_x_lo = (log_x - log_x_hi.double()).float()
    assert rel(_x0_math.x_minus_log1p(x32[x32 < 1e6]), truth[x32 < 1e6]) <= 1e-6
    for with_ratio in (False, True):
        f, ratio = _x0_math.x_minus_log1p_and_ratio(x32, log_x_hi + log_x_lo, with_ratio)
        assert f.dtype == torch.float32 and rel(f, truth) <= 5e-7
        if with_ratio:
            assert rel(ratio, x32.double() / (1 + x32.double())) <= 4e-7
        else:
            assert ratio is None


def test_batched_shapes_and_scalar_time():
    kernel = KERNELS["hybrid-random"]
    logits, x0, x_t, _ = _batch(kernel, n=24)
    out = fast.gidd_loss(logits.reshape(4, 6, S), x0.reshape(4, 6), x_t.reshape(4, 6), 0.3, kernel)
    ref = native.reference_gidd_loss(logits.reshape(4, 6, S), x0.reshape(4, 6), x_t.reshape(4, 6), 0.3, kernel)
    assert out.shape == (4, 6)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=0)


def test_no_grad_forward_equals_grad_forward():
    kernel = KERNELS["uniform-linear"]
    logits, x0, x_t, t = _batch(kernel)
    with torch.no_grad():
        a = fast.gidd_loss(logits.requires_grad_(), x0, x_t, t, kernel)
    b = fast.gidd_loss(logits.detach(), x0, x_t, t, kernel)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["uniform-linear", "hybrid-random", "mask-cosine"])
def test_x0_head_objectives_equal_native_losses_of_converted_heads(name):
    """Theorem 3.5: SEDD/M2S/CTMC losses of the converted x0 head are the x0 head's D_t."""
    kernel = KERNELS[name]
    logits, x0, x_t, t = _batch(kernel, n=30)
    probs = uf.rates.x0_log_probs(kernel, logits).exp()
    expected = native.reference_gidd_loss(logits, x0, x_t, t, kernel)
    score = convert_x0_to("sedd", probs, kernel, x_t, t)
    sedd = native.sedd_loss(torch.log(score), x0, x_t, t, kernel)
    mu = convert_x0_to("m2s", probs, kernel, x_t, t, strict=False)
    m2s = native.m2s_loss(torch.log(mu), x0, x_t, t, kernel)
    lam, jump = convert_x0_to("ctmc", probs, kernel, x_t, t)
    ctmc = native.ctmc_loss(torch.log(lam), torch.log(jump), x0, x_t, t, kernel)
    for objective, other in (("sedd", sedd), ("m2s", m2s), ("ctmc", ctmc), ("gidd", expected)):
        out = fast.x0_head_loss(logits, x0, x_t, t, kernel, objective=objective)
        torch.testing.assert_close(out, other, rtol=1e-8, atol=1e-12)


def test_mdlm_equals_native_mdlm():
    kernel = KERNELS["mask-linear"]
    logits, x0, x_t, t = _batch(kernel)
    torch.testing.assert_close(fast.mdlm_loss(logits, x0, x_t, t, kernel),
                               native.reference_mdlm_loss(logits, x0, x_t, t, kernel), rtol=1e-10, atol=1e-300)
    with pytest.raises(TypeError, match="kernel"):
        fast.x0_head_loss(logits, x0, x_t, t, KERNELS["uniform-linear"], objective="mdlm")


def test_generator_kernel_falls_back_to_reference():
    n = 6
    gen = torch.full((n, n), 1.0 / n, dtype=torch.float64) - torch.eye(n, dtype=torch.float64)
    kernel = uf.GeneratorKernel(gen, schedule=uf.schedules.LinearSchedule())
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, n, generator=g, dtype=torch.float64)
    x0 = torch.randint(0, n, (10,), generator=g)
    x_t = kernel.sample(x0, 0.4, generator=g)
    torch.testing.assert_close(fast.gidd_loss(logits, x0, x_t, 0.4, kernel),
                               native.reference_gidd_loss(logits, x0, x_t, 0.4, kernel))
    with pytest.raises(ValueError, match="weighting"):
        fast.gidd_loss(logits, x0, x_t, 0.4, kernel, weighting="clip")


def test_bad_arguments_raise_named_errors():
    kernel = KERNELS["uniform-linear"]
    logits, x0, x_t, t = _batch(kernel, n=8)
    with pytest.raises(ValueError, match="weighting"):
        fast.gidd_loss(logits, x0, x_t, t, kernel, weighting="nope")
    with pytest.raises(ValueError, match="objective"):
        fast.x0_head_loss(logits, x0, x_t, t, kernel, objective="nope")
    with pytest.raises(ValueError, match="max_weight"):
        fast.gidd_loss(logits, x0, x_t, t, kernel, weighting="clip", max_weight=-1.0)
    with pytest.raises(ValueError, match="x0_logits"):
        fast.gidd_loss(logits[:, :-1], x0, x_t, t, kernel)
    with pytest.raises(ValueError, match="x0_logits"):
        fast.gidd_loss(logits[:4], x0, x_t, t, kernel)
    with pytest.raises(TypeError, match="x0_logits"):
        fast.gidd_loss(logits.long(), x0, x_t, t, kernel)
    with pytest.raises(ValueError, match="t"):
        fast.gidd_loss(logits, x0, x_t, 1.5, kernel)
    with pytest.raises(ValueError, match="x0_logits"):
        bad = logits.clone()
        bad[2, 3] = float("nan")
        fast.gidd_loss(bad, x0, x_t, t, kernel)


def test_backward_twice_with_retained_graph_accumulates():
    kernel = KERNELS["uniform-linear"]
    logits, x0, x_t, t = _batch(kernel, n=8)
    L = logits.clone().requires_grad_()
    out = fast.gidd_loss(L, x0, x_t, t, kernel).sum()
    out.backward(retain_graph=True)
    first = L.grad.clone()
    out.backward()
    torch.testing.assert_close(L.grad, 2 * first, rtol=0, atol=0)


def test_inside_a_users_torch_compile_region_in_one_graph():
    """A training step compiled by the user with ``fullgraph=True`` traces the loss inline, forward and backward (the
    autograd Function's backward too): no graph break (no host sync, no data-pointer test), and the values and
    gradients of eager (validation off: its value checks read the inputs back to the host)."""
    from torch._dynamo.utils import counters

    kernel = KERNELS["hybrid-random"]
    logits, x0, x_t, t = _batch(kernel, n=16, dtype=torch.float32)

    def step(z):
        return (fast.gidd_loss(z, x0, x_t, t.float(), kernel) * 0.5).sum()

    L1 = logits.clone().requires_grad_()
    step(L1).backward()
    L2 = logits.clone().requires_grad_()
    counters.clear()
    with uf.validation.validation(False):
        out = torch.compile(step, fullgraph=True)(L2)
        out.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(out, step(logits), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(L2.grad, L1.grad, rtol=1e-4, atol=1e-6)


def _fresh_copy(fn):
    """``fn`` with a code object of its own (Dynamo caches traces per code object)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_explained")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def test_each_compiled_pass_traces_as_one_graph(monkeypatch):
    """Every function the library hands to ``torch.compile`` is one graph in every configuration it meets — the loss
    alone (no autograd), loss + row statistics, the gradient from statistics, the fused linear loss's in-place pass
    and its recomputation of some rows; uniform noise or not, a mask column inside the logits, sliced off or none;
    the samplers' block masses: a graph break would hand N×S intermediates from one graph to the next. Checked on
    Dynamo's trace alone (``torch._dynamo.explain``: no Inductor), each configuration traced afresh."""
    from unifusion import _compile
    from unifusion.samplers import _draws

    explained: list[tuple] = []

    def explaining(fn, key, options=None):
        def call(*args):
            explanation = torch._dynamo.explain(_fresh_copy(fn))(*args)
            explained.append((fn.__name__, key, explanation.graph_count, explanation.graph_break_count,
                              [str(reason.reason) for reason in explanation.break_reasons]))
            return fn(*args)

        return call

    fresh = _compile.Compiler("compiled")  # no copies, no first calls, nothing failed
    monkeypatch.setattr(fresh, "compiled", explaining)
    monkeypatch.setattr(_compile, "COMPILER", fresh)
    backend.set_backend("compiled")
    for kernel in (uf.UniformKernel(S), uf.MaskKernel(S, S - 1), uf.MaskKernel(S, 5), uf.HybridKernel(S, S // 2, 0.3)):
        logits, x0, x_t, t = _batch(kernel, n=24, dtype=torch.float32)
        t = t.float()
        with torch.no_grad():
            fast.gidd_loss(logits, x0, x_t, t, kernel)
        L = logits.clone().requires_grad_()
        fast.gidd_loss(L, x0, x_t, t, kernel).sum().backward()
        h, W = torch.randn(24, 8, requires_grad=True), torch.randn(S, 8, requires_grad=True)
        out = uf.losses.fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, chunk_size=12)
        (out * torch.linspace(0.0, 1.0, 24)).sum().backward()  # other incoming gradients: rows recomputed
    _draws.draw_from_logits(torch.randn(2, 3, 4100), torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 3, 2),
                            mask_id=4099, temperature=0.7, dtype=torch.float32)
    names = {name for name, *_ in explained}
    assert names == {"fused_loss_and_grad", "block_log_mass"}, names
    assert len({key for _, key, *_ in explained}) >= 12  # the configurations above, each traced
    for name, key, graphs, breaks, reasons in explained:
        assert graphs == 1 and breaks == 0, (name, key, reasons)


def test_a_new_max_weight_does_not_recompile_every_call():
    """A Python float argument (``max_weight`` of the clipped weighting) in a compiled step: the first new value makes
    Dynamo trace it as a value (one recompilation), later ones reuse that graph. Dynamo's own counters, with the
    ``aot_eager`` backend (the guards are Dynamo's; Inductor would only make each graph slower to build)."""
    from torch._dynamo.utils import counters

    kernel = KERNELS["hybrid-mid"]
    logits, x0, x_t, t = _batch(kernel, n=16, dtype=torch.float32)
    t = t.float()

    def step(z, max_weight):
        return fast.x0_head_loss(z, x0, x_t, t, kernel, weighting="clip", max_weight=max_weight).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    counters.clear()
    with uf.validation.validation(False):
        for max_weight in (2.0, 3.0, 0.5, 1.25, 2.0):
            L = logits.clone().requires_grad_()
            out = compiled(L, max_weight)
            out.backward()
            L_ref = logits.clone().requires_grad_()
            step(L_ref, max_weight).backward()
            torch.testing.assert_close(out, step(logits, max_weight), rtol=1e-6, atol=0)
            torch.testing.assert_close(L.grad, L_ref.grad, rtol=1e-6, atol=1e-7)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


@pytest.mark.parametrize("mask_id", [0, 5, S - 1])
@pytest.mark.parametrize("p_uniform", [0.0, 0.4])
def test_mask_state_in_any_column_with_mask_ids_in_x0_and_x_t(mask_id, p_uniform):
    """The mask column is sliced off when it is the first or last (masked in every pass otherwise); x0 and x_t may
    hold the mask id themselves: values and gradients equal the float64 reference either way, and the mask column's
    gradient is 0."""
    kernel = uf.HybridKernel(S, mask_id, p_uniform) if p_uniform else uf.MaskKernel(S, mask_id)
    logits, x0, x_t, t = _batch(kernel, n=60, times=TIMES)
    x0[4:10] = mask_id
    x_t[8:16] = mask_id
    scale = torch.rand(len(x0), dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ref, g_ref = _ref_and_grad(logits, x0, x_t, t, kernel, "elbo", scale)
    L = logits.clone().requires_grad_()
    out = fast.gidd_loss(L, x0, x_t, t, kernel)
    (out * scale).sum().backward()
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-300)
    torch.testing.assert_close(L.grad, g_ref, rtol=1e-9, atol=1e-12 * float(g_ref.abs().max()))
    assert torch.all(L.grad[:, mask_id] == 0)
