"""fused_linear_diffusion_loss against materialised logits + the native reference loss."""

from __future__ import annotations

import pytest
import torch

import unifusion as uf
from unifusion.losses import native
from unifusion.losses.fused_linear import fused_linear_diffusion_loss

S, D = 40, 8
KERNELS = {
    "uniform": uf.UniformKernel(S, uf.CosineSchedule()),
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


@pytest.mark.parametrize("backend", ["compiled", "eager"])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("weighting", ["elbo", "dynamic"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_equals_materialised_logits_and_reference(name, weighting, softcap, backend, monkeypatch):
    monkeypatch.setattr(uf._compile, "_state", {"backend": backend})
    kernel = KERNELS[name]
    h, W, b, x0, x_t, t, scale = _inputs(kernel, bias=True)
    z = (h @ W.T + b) * 1.3
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    ref = native.gidd_loss(z, x0, x_t, t, kernel, weighting)
    g_ref = torch.autograd.grad((ref * scale).sum(), (h, W, b))
    out = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, weighting=weighting, lm_head_bias=b,
                                      logit_scale=1.3, final_logit_softcap=softcap, chunk_size=7)
    g = torch.autograd.grad((out * scale).sum(), (h, W, b))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-300)
    for a, e in zip(g, g_ref):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)
    assert torch.all(g[0][::4] == 0)


@pytest.mark.parametrize("backend", ["compiled", "eager"])
@pytest.mark.parametrize("chunk_size", [1, 13, None])
def test_bias_less_head_any_chunk_size_float32(chunk_size, backend, monkeypatch):
    monkeypatch.setattr(uf._compile, "_state", {"backend": backend})
    kernel = KERNELS["hybrid"]
    h, W, _, x0, x_t, t, scale = _inputs(kernel, dtype=torch.float32)
    ref = native.gidd_loss(h.double() @ W.double().T, x0, x_t, t, kernel)
    out = fused_linear_diffusion_loss(h, W, x0, x_t, t.float(), kernel, chunk_size=chunk_size)
    gh, gw = torch.autograd.grad((out * scale.float()).sum(), (h, W))
    hd, Wd = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    gh_ref, gw_ref = torch.autograd.grad((native.gidd_loss(hd @ Wd.T, x0, x_t, t.float().double(), kernel)
                                          * scale).sum(), (hd, Wd))
    assert out.dtype == torch.float32 and gh.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=5e-5, atol=1e-6)
    torch.testing.assert_close(gh.double(), gh_ref, rtol=1e-4, atol=1e-5 * float(gh_ref.abs().max()))
    torch.testing.assert_close(gw.double(), gw_ref, rtol=1e-4, atol=1e-5 * float(gw_ref.abs().max()))


@pytest.mark.parametrize("backend", ["compiled", "eager"])
def test_bf16_is_finite_and_close(backend, monkeypatch):
    monkeypatch.setattr(uf._compile, "_state", {"backend": backend})
    kernel = KERNELS["uniform"]
    h, W, _, x0, x_t, t, _ = _inputs(kernel, dtype=torch.bfloat16)
    out = fused_linear_diffusion_loss(h.reshape(5, 10, D), W, x0.reshape(5, 10), x_t.reshape(5, 10),
                                      t.float().reshape(5, 10), kernel)
    out.sum().backward()
    assert out.shape == (5, 10) and out.dtype == torch.float32
    assert W.grad.dtype == torch.bfloat16 and torch.isfinite(W.grad.float()).all()
    assert torch.isfinite(h.grad.float()).all()
    ref = native.gidd_loss(h.detach().float() @ W.detach().float().T, x0, x_t, t.float(), kernel)
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


@pytest.mark.parametrize("backend", ["compiled", "eager"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reduced_loss_equals_weighted_per_position_loss(reduction, backend, monkeypatch):
    """reduction='sum'/'mean' with position weights: the value and all three gradients equal those of the
    per-position loss reduced by hand (gradients computed in forward, scaled in backward by a non-unit scalar)."""
    monkeypatch.setattr(uf._compile, "_state", {"backend": backend})
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
    with pytest.raises(ValueError, match="position_weight"):
        fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, position_weight=scale)
    with pytest.raises(ValueError, match="position_weight"):
        fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, reduction="sum", position_weight=scale[:-1])


def test_reduced_loss_backward_twice_raises_clearly():
    kernel = KERNELS["uniform"]
    h, W, _, x0, x_t, t, _ = _inputs(kernel)
    out = fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, reduction="mean")
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once"):
        out.backward()
