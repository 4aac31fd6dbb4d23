"""fused_linear_diffusion_loss against materialised logits + the native reference loss.

Every test runs eagerly; the compiled backend runs the float32 test on the "hybrid" kernel (uniform noise, a mask
column inside the logits: the "hybrid-mid" configuration every compiled test shares, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

import unifusion as uf
from unifusion import backend
from unifusion.losses import fused_linear, native
from unifusion.losses.fused_linear import fused_linear_diffusion_loss

S, D = 40, 8
KERNELS = {
    "uniform": uf.UniformKernel(S, uf.schedules.CosineSchedule()),
    "mask": uf.MaskKernel(S, 3),
    "hybrid": uf.HybridKernel(S, 3, 0.3, 1.2),
}


def _inputs(kernel, n=50, dtype=torch.float64, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    W = (torch.randn(S, D, generator=g, dtype=torch.float64) * 0.7).to(dtype).requires_grad_()
    b = torch.randn(S, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    x0 = torch.randint(0, S, (n,), generator=g)
    if kernel.mask_id is not None:
        x0 = torch.where(x0 == kernel.mask_id, (x0 + 1) % S, x0)
    t = torch.rand(n, generator=g, dtype=torch.float64) * 0.98 + 0.01
    x_t = kernel.sample(x0, t, generator=g)
    scale = torch.rand(n, generator=g, dtype=torch.float64)
    scale[::4] = 0.0  # padding
    return h, W, b, x0, x_t, t, scale


@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("weighting", ["elbo", "dynamic"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_equals_materialised_logits_and_reference(name, weighting, softcap):
    kernel = KERNELS[name]
    h, W, b, x0, x_t, t, scale = _inputs(kernel, bias=True)
    z = (h @ W.T + b) * 1.3
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    ref = native.reference_gidd_loss(z, x0, x_t, t, kernel, weighting)
    g_ref = torch.autograd.grad((ref * scale).sum(), (h, W, b))
    out = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, weighting=weighting, lm_head_bias=b,
                                      logit_scale=1.3, final_logit_softcap=softcap, chunk_size=7)
    g = torch.autograd.grad((out * scale).sum(), (h, W, b))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-300)
    for a, e in zip(g, g_ref):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)
    assert torch.all(g[0][::4] == 0)


# compiled: not one-row blocks (Dynamo would compile the size-1 case apart)
@pytest.mark.parametrize("chunk_size, backend_name", [(1, "eager"), (13, "eager"), (None, "eager"), (13, "compiled"),
                                                      (None, "compiled")])
def test_bias_less_head_any_chunk_size_float32(chunk_size, backend_name):
    """float32 against the float64 reference; eagerly the per-position weights make backward correct every position
    whose incoming gradient is not the common one (recomputed blocks). Compiled: one common incoming gradient (the
    in-place forward pass of the configuration the suite shares; no rows recomputed)."""
    backend.set_backend(backend_name)
    kernel = KERNELS["hybrid"]
    h, W, _, x0, x_t, t, scale = _inputs(kernel, dtype=torch.float32)
    if backend_name == "compiled":
        scale = torch.ones_like(scale)
    ref = native.reference_gidd_loss(h.double() @ W.double().T, x0, x_t, t, kernel)
    out = fused_linear_diffusion_loss(h, W, x0, x_t, t.float(), kernel, chunk_size=chunk_size)
    gh, gw = torch.autograd.grad((out * scale.float()).sum(), (h, W))
    hd, Wd = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    gh_ref, gw_ref = torch.autograd.grad((native.reference_gidd_loss(hd @ Wd.T, x0, x_t, t.float().double(), kernel)
                                          * scale).sum(), (hd, Wd))
    assert out.dtype == torch.float32 and gh.dtype == torch.float32 and gw.dtype == torch.float32
    assert backend.get_backend() == backend_name  # no compiler failure
    torch.testing.assert_close(out.double(), ref, rtol=5e-5, atol=1e-6)
    torch.testing.assert_close(gh.double(), gh_ref, rtol=1e-4, atol=1e-5 * float(gh_ref.abs().max()))
    torch.testing.assert_close(gw.double(), gw_ref, rtol=1e-4, atol=1e-5 * float(gw_ref.abs().max()))


def test_bf16_is_finite_and_close():
    kernel = KERNELS["uniform"]
    h, W, _, x0, x_t, t, _ = _inputs(kernel, dtype=torch.bfloat16)
    out = fused_linear_diffusion_loss(h.reshape(5, 10, D), W, x0.reshape(5, 10), x_t.reshape(5, 10),
                                      t.float().reshape(5, 10), kernel)
    out.sum().backward()
    assert out.shape == (5, 10) and out.dtype == torch.float32
    assert W.grad.dtype == torch.bfloat16 and torch.isfinite(W.grad.float()).all()
    assert torch.isfinite(h.grad.float()).all()
    ref = native.reference_gidd_loss(h.detach().float() @ W.detach().float().T, x0, x_t, t.float(), kernel)
    torch.testing.assert_close(out.reshape(-1), ref, rtol=2e-2, atol=1e-2)


def test_bad_arguments_raise_named_errors():
    kernel = KERNELS["mask"]
    h, W, _, x0, x_t, t, _ = _inputs(kernel, n=6)
    with pytest.raises(ValueError, match="lm_head_weight"):
        fused_linear_diffusion_loss(h, W[:-1], x0, x_t, t, kernel)
    with pytest.raises(ValueError, match="hidden"):
        fused_linear_diffusion_loss(h[:, :-1], W, x0, x_t, t, kernel)
    with pytest.raises(TypeError, match="hidden"):
        fused_linear_diffusion_loss(h.float(), W, x0, x_t, t, kernel)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, chunk_size=0)
    with pytest.raises(ValueError, match="final_logit_softcap"):
        fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, final_logit_softcap=-1.0)
    with pytest.raises(ValueError, match="x0_logits|shape"):
        fused_linear_diffusion_loss(h[:3], W, x0, x_t, t, kernel)
    gen = uf.GeneratorKernel(torch.full((S, S), 1.0 / S) - torch.eye(S))
    with pytest.raises(TypeError, match="kernel"):
        fused_linear_diffusion_loss(h, W, x0, x_t, t, gen)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reduced_loss_equals_weighted_per_position_loss(reduction):
    """reduction='sum'/'mean' with position weights: the value and all three gradients equal those of the
    per-position loss reduced by hand (gradients computed in forward, scaled in backward by a non-unit scalar)."""
    kernel = KERNELS["hybrid"]
    h, W, b, x0, x_t, t, scale = _inputs(kernel, bias=True)
    kw = dict(lm_head_bias=b, logit_scale=1.3, final_logit_softcap=4.0, chunk_size=7)
    per = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, **kw)
    ref = (per * scale).sum() / (scale.sum() if reduction == "mean" else 1.0)
    g_ref = torch.autograd.grad(3.0 * ref, (h, W, b))
    out = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, reduction=reduction, position_weight=scale, **kw)
    assert out.shape == ()
    g = torch.autograd.grad(3.0 * out, (h, W, b))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)
    for a, e in zip(g, g_ref):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-13)


def test_reduction_arguments_are_checked():
    kernel = KERNELS["mask"]
    h, W, _, x0, x_t, t, scale = _inputs(kernel)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, reduction="max")
    for reduction in ("none", "sum"):
        with pytest.raises(ValueError, match="position_weight"):
            fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, reduction=reduction, position_weight=scale[:-1])


def _reference_grads(kernel, h, W, b, x0, x_t, t, upstream):
    """Gradients of Σ_n g_n L_n through materialised logits and the native loss (float64)."""
    hd, Wd = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    bd = None if b is None else b.detach().double().requires_grad_()
    z = hd @ Wd.T + (0.0 if bd is None else bd)
    ref = native.reference_gidd_loss(z, x0, x_t, t.double(), kernel)
    leaves = (hd, Wd) if bd is None else (hd, Wd, bd)
    return ref.detach(), torch.autograd.grad((ref * upstream.double()).sum(), leaves)


def _assert_equals_reference(kernel, h, W, b, x0, x_t, t, upstream, chunk_size):
    """The fused per-position loss and the gradients of Σ_n g_n L_n equal the float64 reference."""
    ref, g_ref = _reference_grads(kernel, h, W, b, x0, x_t, t, upstream)
    out = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, lm_head_bias=b, chunk_size=chunk_size)
    g = torch.autograd.grad((out * upstream).sum(), (h, W, b))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-300)
    for a, e in zip(g, g_ref):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


def _upstream(kind, n, x_t, kernel, seed=1):
    """Incoming per-position gradients of the usual reductions and of arbitrary ones."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(n, generator=g) > 0.2).double()
    if kind == "sum":
        return torch.ones(n, dtype=torch.float64)
    if kind == "masked_mean":  # (loss * mask).sum() / mask.sum()
        return mask / mask.sum()
    if kind == "per_sequence":  # two sequences normalised by their own lengths: two values
        return torch.where(torch.arange(n) < n // 3, 1.0 / (n // 3), 1.0 / (n - n // 3)).double()
    if kind == "mostly_zero":  # the common value is 0
        out = torch.zeros(n, dtype=torch.float64)
        out[:5] = torch.rand(5, generator=g, dtype=torch.float64)
        return out
    return torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.5  # "random": all different, some negative


@pytest.mark.parametrize("kind", ["sum", "masked_mean", "per_sequence", "mostly_zero", "random"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_per_position_gradients_exact_for_any_incoming_gradient(name, kind):
    """Gradients computed in the forward pass, then scaled by the common incoming value and corrected where it
    differs: equal to the float64 reference for the usual reductions and for arbitrary per-position gradients."""
    kernel = KERNELS[name]
    h, W, b, x0, x_t, t, _ = _inputs(kernel, bias=True)
    upstream = _upstream(kind, h.shape[0], x_t, kernel)
    _assert_equals_reference(kernel, h, W, b, x0, x_t, t, upstream, chunk_size=9)


def _count_recomputed_rows(monkeypatch):
    rows = []
    real = fused_linear._recompute

    def counting(ctx, grads, hidden, weight, bias, stats, index, grad_scale, with_h):
        rows.append(int(index.numel()))
        return real(ctx, grads, hidden, weight, bias, stats, index, grad_scale, with_h)

    monkeypatch.setattr(fused_linear, "_recompute", counting)
    return rows


def test_usual_reductions_recompute_nothing(monkeypatch):
    """Sum, mean, a global token count and the padding mask as position_weight: backward only scales the gradients
    computed in the forward pass (no logits recomputed); other positions are recomputed, and only those."""
    recomputed = _count_recomputed_rows(monkeypatch)
    kernel = KERNELS["uniform"]
    h, W, _, x0, x_t, t, _ = _inputs(kernel)
    mask = torch.ones(h.shape[0], dtype=torch.float64)
    mask[-7:] = 0.0  # right padding
    for reduce in (lambda out: out.sum(), lambda out: out.mean(), lambda out: out.sum() / 1234.0):
        torch.autograd.grad(reduce(fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel)), (h, W))
    out = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, position_weight=mask)
    assert torch.all(out[-7:] == 0)
    torch.autograd.grad(out.sum() / mask.sum(), (h, W))
    assert recomputed == []
    # the same mask applied by hand: the 7 padded positions get their correction, nothing else
    out = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel)
    torch.autograd.grad((out * mask).sum() / mask.sum(), (h, W))
    assert recomputed == [7]
    # mask kernel: unmasked positions have no gradient and never need a correction
    mk = KERNELS["mask"]
    h, W, _, x0, x_t, t, _ = _inputs(mk)
    out = fused_linear_diffusion_loss(h, W, x0, x_t, t, mk)
    torch.autograd.grad((out * (x_t != mk.mask_id)).sum(), (h, W))
    assert recomputed == [7]


def test_position_weight_per_position_equals_weighting_by_hand():
    kernel = KERNELS["hybrid"]
    h, W, b, x0, x_t, t, scale = _inputs(kernel, bias=True)
    kw = dict(lm_head_bias=b, logit_scale=1.3, final_logit_softcap=4.0, chunk_size=7)
    per = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, **kw)
    g_ref = torch.autograd.grad((per * scale).sum() * 0.3, (h, W, b))
    out = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, position_weight=scale, **kw)
    g = torch.autograd.grad(out.sum() * 0.3, (h, W, b))
    torch.testing.assert_close(out, per * scale, rtol=1e-12, atol=0)
    for a, e in zip(g, g_ref):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_retain_graph_backward_twice(reduction):
    """With retain_graph=True the saved gradients are not scaled in place: a second backward (another incoming
    gradient) is exact too."""
    kernel = KERNELS["uniform"]
    h, W, _, x0, x_t, t, _ = _inputs(kernel)
    n = h.shape[0]
    out = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, reduction=reduction)
    for upstream in (torch.full((n,), 0.5, dtype=torch.float64), _upstream("random", n, x_t, kernel),
                     _upstream("masked_mean", n, x_t, kernel), _upstream("random", n, x_t, kernel, seed=2)):
        if reduction == "sum":
            upstream = torch.full((n,), float(upstream[0]), dtype=torch.float64)
            first = torch.autograd.grad(out * upstream[0], (h, W), retain_graph=True)
        else:
            first = torch.autograd.grad((out * upstream).sum(), (h, W), retain_graph=True)
        _, expected = _reference_grads(kernel, h, W, None, x0, x_t, t, upstream)
        for a, e in zip(first, expected):
            torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


def test_no_grad_and_frozen_head():
    """Without autograd only the losses are computed; with a frozen output head only ∂/∂hidden."""
    kernel = KERNELS["hybrid"]
    h, W, _, x0, x_t, t, scale = _inputs(kernel)
    out = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel)
    with torch.no_grad():
        plain = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel)
        total = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, reduction="sum", position_weight=scale)
    assert not plain.requires_grad and not total.requires_grad
    torch.testing.assert_close(plain, out.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(total, (out.detach() * scale).sum(), rtol=1e-12, atol=0)
    frozen = W.detach()
    gh = torch.autograd.grad((fused_linear_diffusion_loss(h, frozen, x0, x_t, t, kernel) * scale).sum(), h)[0]
    gh_ref = torch.autograd.grad((out * scale).sum(), h)[0]
    torch.testing.assert_close(gh, gh_ref, rtol=1e-10, atol=1e-13)


def test_inside_a_users_torch_compile_region():
    """A compiled training step: the fused loss recomputes blocks in backward (no host sync in the traced code) and
    gives the eager values and gradients. Traced with the ``aot_eager`` backend: what runs inside the user's graph is
    the traced loss (Inductor's code for it is tested through the library's own compiled configurations)."""
    kernel = KERNELS["uniform"]
    h, W, _, x0, x_t, t, scale = _inputs(kernel, dtype=torch.float32)
    t = t.float()

    def step(h, W):
        per_position = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, chunk_size=16)
        mean = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, chunk_size=16, reduction="mean",
                                           position_weight=scale.float())
        return (per_position * scale.float()).sum() + mean

    g_ref = torch.autograd.grad(step(h, W), (h, W))
    with uf.validation.validation(False):
        g = torch.autograd.grad(torch.compile(step, backend="aot_eager")(h, W), (h, W))
    for a, e in zip(g, g_ref):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", [uf.MaskKernel(S, S - 1), uf.HybridKernel(S, 0, 0.3, 1.2)],
                         ids=["mask-last", "hybrid-first"])
def test_mask_in_the_first_or_last_column(kernel):
    """A mask state in an end column is sliced off the logits (gradients written in place into the chunk's
    logits buffer, the mask column zeroed); x0 and x_t holding the mask id included."""
    h, W, b, x0, x_t, t, scale = _inputs(kernel, bias=True)
    x0[5:9] = kernel.mask_id
    x_t[7:15] = kernel.mask_id
    _assert_equals_reference(kernel, h, W, b, x0, x_t, t, scale, chunk_size=11)


@pytest.mark.parametrize("mode", fused_linear.FP32_ACCUMULATION_MODES)
def test_weight_gradient_accumulates_in_fp32_from_bf16_operands_where_the_device_can(mode, monkeypatch):
    """Where ``addmm``/``mm(..., out_dtype=float32)`` exist (CUDA), ∂W is accumulated by a GEMM on the bf16 operands
    (tensor cores) into the float32 accumulator. On the CPU those kernels do not exist: the probe says so and the
    float32-operand path runs. Emulated here: the same calls with float32 arithmetic give the same ∂W and ∂h."""
    assert fused_linear.fp32_accumulation_mode(torch.device("cpu"), torch.bfloat16) is None
    assert not fused_linear.accumulates_in_fp32(torch.device("cpu"), torch.bfloat16)
    kernel = KERNELS["uniform"]

    def grads():
        h, W, _, x0, x_t, t, _ = _inputs(kernel, dtype=torch.bfloat16)
        fused_linear_diffusion_loss(h, W, x0, x_t, t.float(), kernel, chunk_size=16).sum().backward()
        return W.grad.clone(), h.grad.clone()

    W_ref, h_ref = grads()
    calls = []
    addmm, mm = torch.addmm, torch.mm

    def fake_addmm(input, a, b, *, out_dtype=None, out=None, **kwargs):
        if out_dtype is None:
            return addmm(input, a, b, out=out, **kwargs) if out is not None else addmm(input, a, b, **kwargs)
        calls.append(("addmm", a.dtype, b.dtype, out.dtype, out is input))
        return out.add_(a.float() @ b.float())  # what the CUDA kernel computes: fp32 accumulation of a bf16 GEMM

    def fake_mm(a, b, *, out_dtype=None, out=None):
        if out_dtype is None:
            return mm(a, b, out=out) if out is not None else mm(a, b)
        calls.append(("mm", a.dtype, b.dtype, out_dtype, False))
        return a.float() @ b.float()

    monkeypatch.setattr(fused_linear, "fp32_accumulation_mode", lambda device, dtype: mode)
    monkeypatch.setattr(torch, "addmm", fake_addmm)
    monkeypatch.setattr(torch, "mm", fake_mm)
    W_new, h_new = grads()
    assert calls == [(mode, torch.bfloat16, torch.bfloat16, torch.float32, mode == "addmm")] * 4  # 4 blocks of 16
    torch.testing.assert_close(W_new, W_ref, rtol=0, atol=0)
    torch.testing.assert_close(h_new, h_ref, rtol=0, atol=0)


def test_fp32_accumulation_of_bf16_products_matches_float64():
    """The accumulation itself: Σ_blocks g_bᵀ h_b of bf16 blocks into float32, against float64 of the same bf16
    values (the products of bf16 numbers are exact in float32; only the sums round)."""
    g = torch.Generator().manual_seed(0)
    acc = torch.zeros(300, 64)
    ref = torch.zeros(300, 64, dtype=torch.float64)
    for _ in range(8):
        gb = torch.randn(128, 300, generator=g).to(torch.bfloat16)
        hb = torch.randn(128, 64, generator=g).to(torch.bfloat16)
        fused_linear._accumulate(fused_linear.fp32_accumulation_mode(gb.device, gb.dtype), acc, gb.T, hb)
        ref += gb.double().T @ hb.double()
    assert acc.dtype == torch.float32
    torch.testing.assert_close(acc.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("addmm_fails", ["raises", "wrong", "no"])
def test_probe_picks_the_first_mode_that_computes_the_right_numbers(addmm_fails, monkeypatch):
    """The probe tries ``addmm`` then ``mm`` and keeps the first that runs and gives 0.5 + aᵀa exactly; a missing
    kernel, a dtype check (older CUDA builds want ``self`` in the operands' dtype) or wrong numbers fall through.
    The CPU and full-precision operands are never probed; answers are cached per device and dtype."""
    tried = []

    def fake(mode, acc, a, b):
        tried.append(mode)
        if mode == "addmm" and addmm_fails == "raises":
            raise RuntimeError("self and mat2 must have the same dtype")
        acc.add_(a.float() @ b.float() + (1.0 if mode == "addmm" and addmm_fails == "wrong" else 0.0))

    monkeypatch.setattr(fused_linear, "_accumulate", fake)
    expected = "addmm" if addmm_fails == "no" else "mm"
    assert fused_linear._probe_fp32_accumulation(torch.device("cpu"), torch.bfloat16) == expected
    assert tried == list(fused_linear.FP32_ACCUMULATION_MODES[: 1 if expected == "addmm" else 2])
    monkeypatch.setattr(fused_linear, "_FP32_ACCUMULATION", {})
    tried.clear()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert fused_linear.fp32_accumulation_mode(torch.device("cpu"), dtype) is None
    assert fused_linear.fp32_accumulation_mode(torch.device("meta"), torch.float32) is None
    assert tried == []  # nothing probed
    assert set(fused_linear._FP32_ACCUMULATION.values()) == {None}


def test_default_block_size_comes_from_a_memory_budget():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fused_linear.default_chunk_size(1 << 20, 262_144, cpu) == 128  # 128 MiB of float32 logits, as in 0.1
    assert fused_linear.default_chunk_size(1 << 20, 262_144, cuda) == 2048  # tensor-core-sized GEMMs
    assert fused_linear.default_chunk_size(1 << 20, 49_152, cuda) == (1 << 31) // (4 * 49_152)
    assert fused_linear.default_chunk_size(100, 49_152, cuda) == 100  # never more rows than there are
    assert fused_linear.default_chunk_size(1 << 20, 1 << 30, cpu) == 16  # never skinnier than 16 rows


def test_compiled_calls_never_get_aliasing_inputs(monkeypatch):
    """Regression: the gradient is written over each block of logits, a view of the pass's logits buffer. Given that
    block and its gradient as two aliasing arguments, the compiled loss got an AOTAutograd "synthetic base", and
    Inductor's on-disk cache handed a later process the graph of another view/base relation: a first process whose
    blocks were the whole buffer and a second one whose first block was part of it crashed with
    ``AssertionError: expected size 200==83``. So a block written in place is passed once: no tensor argument of a
    compiled call shares memory with the logits. Checked on every call the fused loss makes (in-place forward, and
    the recomputed rows in backward), with loss passes on blocks of 7 rows inside its blocks of 13."""
    from torch.utils._pytree import tree_leaves

    from unifusion import _compile
    from unifusion.losses import _x0_driver

    calls: list[list[torch.Tensor]] = []

    def recording(fn, key, options=None):
        def call(*args):
            calls.append([a for a in tree_leaves(args) if isinstance(a, torch.Tensor)])
            return fn(*args)

        return call

    fresh = _compile.Compiler("compiled")  # no copies, no first calls, nothing failed
    monkeypatch.setattr(fresh, "compiled", recording)
    monkeypatch.setattr(_compile, "COMPILER", fresh)
    monkeypatch.setattr(_x0_driver, "COMPILED_CPU_BLOCK_ELEMENTS", 7 * S)
    backend.set_backend("compiled")
    for kernel in (KERNELS["hybrid"], uf.MaskKernel(S, S - 1)):
        h, W, _, x0, x_t, t, scale = _inputs(kernel, dtype=torch.float32)
        out = fused_linear_diffusion_loss(h, W, x0, x_t, t.float(), kernel, chunk_size=13)
        torch.autograd.grad((out * scale.float()).sum(), (h, W))  # other incoming gradients: rows recomputed
    assert len(calls) > 8 and any(tensors[0].shape[0] <= 7 for tensors in calls)  # blocks inside blocks
    for tensors in calls:
        logits = tensors[0]
        assert logits.dim() == 2
        others = [x for x in tensors[1:] if x.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()]
        assert not others, [tuple(x.shape) for x in others]
