"""The hot paths on a CUDA device against float64 on the CPU (skipped without a GPU).

    python -m pytest tests/test_cuda.py -q          # on a machine with a GPU
    python -m pytest -m cuda                        # the same, by marker

Covered: the fast x0-head losses (``gidd_loss``, ``mdlm_loss``) in float32 and bf16 on uniform, mask and hybrid
kernels (values and gradients); ``x0_head_loss`` for every objective and weighting; the reference losses of the
other heads (``sedd_loss``, ``m2s_loss``, ``ctmc_loss``, ``bregman_rate_loss``); a batch of more than 2³¹ logits
(64-bit indexing); ``fused_linear_diffusion_loss`` forward and backward (bf16 and float32), its float32
accumulation of ∂W from bf16 operands and its default block size;
``diffusion_loss`` through a tiny adapted Hugging Face model, CUDA against CPU; the x0 conversions
(``ReverseRate.from_x0``, ``from_x0_logits``, ``convert_x0_to``); one Bayesian posterior step's distribution and the
sampler end to end (Bayesian and Euler); the LM-vocabulary draw straight from bf16 logits
(``bayesian_step_from_logits``) against the float64 posterior; ``nll_bound`` against a float64 CPU recomputation of
the same draws; ``score_choices`` / ``fair_pmi_scores`` against a float64 CPU model; the lm-eval harness's three
request types on the device (the rolling bound's generator on the device: #16); the compiled backend against eager;
block decoding through the exact KV cache (merged commits or not) against the uncached block forward (#24).
TF32 is switched off so float32 matmuls are float32.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import warnings

import pytest
import torch

import unifusion as uf
from unifusion.eval import fair_pmi_scores, nll_bound, prior_kl, score_choices
from unifusion.losses import fast, fused_linear_diffusion_loss, native
from unifusion.samplers._step import bayesian_step, bayesian_step_from_logits

sys.path.insert(0, os.path.dirname(__file__))
from _hf_tiny import tiny_model  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"
TIMES = (0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99)


def _kernel(name: str, S: int) -> uf.Kernel:
    if name == "uniform":
        return uf.UniformKernel(S)
    if name == "mask":
        return uf.MaskKernel(S, S - 1)
    if name == "hybrid":
        return uf.HybridKernel(S, 3, p_uniform=0.3, gamma=1.5)  # mask id inside the vocabulary
    raise ValueError(name)


@pytest.fixture(autouse=True)
def _no_tf32():
    """float32 matmuls in float32 (TF32 would make the float32 comparisons meaningless)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.fixture(params=["eager", "compiled"])
def backend(request):
    previous = uf.backend.get_backend()
    uf.backend.set_backend(request.param)
    yield request.param
    uf.backend.set_backend(previous)


def _batch(kernel: uf.Kernel, n: int, seed: int = 0):
    """CPU inputs: float64 logits, clean ids (never the mask), float32-representable float64 times, x_t."""
    S = kernel.num_states
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randint(0, S, (n,), generator=g)
    if kernel.mask_id is not None:
        x0 = torch.where(x0 == kernel.mask_id, (x0 + 1) % S, x0)
    t = torch.tensor(TIMES, dtype=torch.float32)[torch.arange(n) % len(TIMES)].double()
    x_t = kernel.sample(x0, t, generator=g)
    x_t[:3] = x0[:3]  # some clean positions for sure
    logits = torch.randn(n, S, generator=g, dtype=torch.float64) * 3
    scale = torch.rand(n, generator=g, dtype=torch.float64) + 0.5  # a different incoming gradient per position
    return logits, x0, x_t, t, scale


def _reference(loss: str, logits64: torch.Tensor, x0, x_t, t, kernel, scale):
    L = logits64.detach().clone().requires_grad_()
    fn = native.reference_mdlm_loss if loss == "mdlm" else native.reference_gidd_loss
    ref = fn(L, x0, x_t, t, kernel)
    (g,) = torch.autograd.grad((ref * scale).sum(), L)
    return ref.detach(), g


def _on_device(loss: str, logits: torch.Tensor, x0, x_t, t, kernel, scale):
    L = logits.detach().to(DEV).requires_grad_()
    fn = fast.mdlm_loss if loss == "mdlm" else fast.gidd_loss
    out = fn(L, x0.to(DEV), x_t.to(DEV), t.float().to(DEV), kernel)
    (out * scale.to(DEV, out.dtype)).sum().backward()
    assert out.device.type == "cuda" and L.grad is not None and L.grad.dtype == logits.dtype
    assert torch.isfinite(out).all() and torch.isfinite(L.grad.float()).all()
    return out.detach().cpu().double(), L.grad.cpu().double()


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-300))


LOSS_CASES = [("gidd", "uniform", 512), ("gidd", "mask", 512), ("gidd", "hybrid", 512), ("mdlm", "mask", 512),
              ("gidd", "uniform", 50_257), ("gidd", "mask", 50_257)]


# ------------------------------------------------------------------------------------------------- fast losses
@pytest.mark.parametrize("loss,name,S", LOSS_CASES)
def test_fast_loss_float32_matches_float64_cpu(loss, name, S, backend):
    kernel = _kernel(name, S)
    logits64, x0, x_t, t, scale = _batch(kernel, n=256 if S < 10_000 else 48)
    logits32 = logits64.float()
    ref, g_ref = _reference(loss, logits32.double(), x0, x_t, t, kernel, scale)
    out, grad = _on_device(loss, logits32, x0, x_t, t, kernel, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    torch.testing.assert_close(grad, g_ref, rtol=1e-5, atol=1e-5 * float(g_ref.abs().max()))


@pytest.mark.parametrize("loss,name,S", LOSS_CASES)
def test_fast_loss_bf16_matches_float64_of_the_rounded_logits(loss, name, S, backend):
    """bf16 logits: the loss is computed in float32 from the bf16 values, so it matches the float64 loss of the
    bf16-rounded logits to float32 accuracy; the gradient comes back in bf16 (rounded to 2⁻⁸ relative)."""
    kernel = _kernel(name, S)
    logits64, x0, x_t, t, scale = _batch(kernel, n=256 if S < 10_000 else 48, seed=1)
    logits16 = logits64.to(torch.bfloat16)
    ref, g_ref = _reference(loss, logits16.double(), x0, x_t, t, kernel, scale)
    out, grad = _on_device(loss, logits16, x0, x_t, t, kernel, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    torch.testing.assert_close(grad, g_ref, rtol=1e-2, atol=1e-2 * float(g_ref.abs().max()))
    assert _rel_err(grad, g_ref) < 5e-3


@pytest.mark.parametrize("weighting", ["elbo", "clip", "dynamic"])
@pytest.mark.parametrize("objective", ["gidd", "mdlm", "sedd", "m2s", "ctmc"])
@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid"])
def test_x0_head_loss_every_objective_and_weighting(name, objective, weighting, backend):
    """x0_head_loss on the device against the float64 reference: every objective of an x0 head is D_t (ELBO), and
    the clip/dynamic weights replace w alike for every objective, so the reference is native.reference_gidd_loss with
    the same weighting."""
    if objective == "mdlm" and name != "mask":
        pytest.skip("objective='mdlm' needs the mask kernel")
    kernel = _kernel(name, 1000)
    logits64, x0, x_t, t, scale = _batch(kernel, n=128, seed=7)
    logits32 = logits64.float()
    L = logits32.double().requires_grad_()
    ref = native.reference_gidd_loss(L, x0, x_t, t, kernel, weighting, 1.5)
    (g_ref,) = torch.autograd.grad((ref * scale).sum(), L)
    Ld = logits32.to(DEV).requires_grad_()
    out = uf.losses.x0_head_loss(Ld, x0.to(DEV), x_t.to(DEV), t.float().to(DEV), kernel, objective=objective,
                                 weighting=weighting, max_weight=1.5)
    (out * scale.to(DEV, out.dtype)).sum().backward()
    assert out.device.type == "cuda" and Ld.grad is not None
    ref = ref.detach()
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    torch.testing.assert_close(Ld.grad.cpu().double(), g_ref, rtol=1e-5, atol=1e-5 * float(g_ref.abs().max()))


@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid"])
def test_reference_losses_of_the_other_heads_on_cuda(name):
    """sedd_loss, m2s_loss, ctmc_loss and bregman_rate_loss (O(S) per position, plain tensor ops) in float32 on the
    device against float64 on the CPU, fed the heads an x0 prediction converts into (Theorem 3.5): each equals the
    x0 head's GIDD loss there (Corollary 3.4), which is checked too."""
    S, n = 400, 96
    kernel = _kernel(name, S)
    logits64, x0, x_t, t, _ = _batch(kernel, n=n, seed=8)
    if kernel.mask_id is not None:
        logits64[:, kernel.mask_id] = -torch.inf
    p64 = torch.softmax(logits64, -1)
    gidd_ref = native.reference_gidd_loss(logits64, x0, x_t, t, kernel)

    def losses(p: torch.Tensor, ids0: torch.Tensor, ids_t: torch.Tensor, tt: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {"sedd": native.sedd_loss(torch.log(uf.convert_x0_to("sedd", p, kernel, ids_t, tt)), ids0, ids_t, tt,
                                        kernel),
               "bregman": uf.losses.bregman_rate_loss(uf.ReverseRate.from_x0(kernel, torch.nn.functional.one_hot(
                   ids0, S).to(p.dtype), ids_t, tt), uf.ReverseRate.from_x0(kernel, p, ids_t, tt))}
        exit_rate, jump = uf.convert_x0_to("ctmc", p, kernel, ids_t, tt)
        out["ctmc"] = native.ctmc_loss(torch.log(exit_rate), torch.log(jump), ids0, ids_t, tt, kernel)
        if name == "uniform":  # M2S needs every x_t reachable from every clean state
            mu = uf.convert_x0_to("m2s", p, kernel, ids_t, tt)
            out["m2s"] = native.m2s_loss(torch.log(mu), ids0, ids_t, tt, kernel)
        return out

    ref = losses(p64, x0, x_t, t)
    dev = losses(p64.float().to(DEV), x0.to(DEV), x_t.to(DEV), t.float().to(DEV))
    for key, value in dev.items():
        assert value.device.type == "cuda", key
        r = ref[key]
        torch.testing.assert_close(r, gidd_ref, rtol=1e-8, atol=1e-10 * float(gidd_ref.abs().max()), msg=key)
        torch.testing.assert_close(value.cpu().double(), r, rtol=2e-4, atol=1e-5 * float(r.abs().max()), msg=key)


@pytest.mark.parametrize("name", ["uniform", "mask"])
def test_more_than_2_to_the_31_logits(name):
    """A bf16 batch of 8,200 × 262,144 = 2.15·10⁹ logits (> 2³¹ − 1), compiled: Inductor's Triton kernels index it
    with 64-bit integers (they use 32 bits only behind a guard that every size fits). The rows past the 2³¹-th
    logit — where 32-bit offsets would wrap — agree with the same rows computed on their own. About 17 GiB."""
    previous = uf.backend.get_backend()
    uf.backend.set_backend("compiled")
    try:
        V, N = 262_144, 8_200
        assert N * V > 2**31
        kernel = _kernel(name, V)
        g = torch.Generator(DEV).manual_seed(0)
        x0 = torch.randint(0, V - 1, (N,), device=DEV, generator=g)
        t = torch.rand(N, device=DEV, generator=g) * 0.98 + 0.01
        x_t = kernel.sample(x0, t, generator=g)
        logits = torch.randn(N, V, device=DEV, generator=g).to(torch.bfloat16).requires_grad_()
        with uf.validation.validation(False):
            loss = uf.losses.gidd_loss(logits, x0, x_t, t, kernel)
            loss.sum().backward()
        tail = slice(N - 16, N)  # starts at row 8184: logit 8184 · 2^18 > 2^31
        assert (N - 16) * V > 2**31
        part = logits.detach()[tail].clone().requires_grad_()
        with uf.validation.validation(False):
            loss_part = uf.losses.gidd_loss(part, x0[tail], x_t[tail], t[tail], kernel)
            loss_part.sum().backward()
        torch.testing.assert_close(loss[tail].detach(), loss_part.detach(), rtol=1e-5,
                                   atol=1e-6 * float(loss_part.abs().max()))
        torch.testing.assert_close(logits.grad[tail].float(), part.grad.float(), rtol=1e-2, atol=1e-6)
        assert torch.isfinite(loss).all() and torch.isfinite(logits.grad[-1].float()).all()
    finally:
        uf.backend.set_backend(previous)
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------- fused output head
def _head_inputs(kernel: uf.Kernel, N: int, d: int, seed: int = 0):
    S = kernel.num_states
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=g, dtype=torch.float64)
    W = torch.randn(S, d, generator=g, dtype=torch.float64) * (2.0 / d**0.5)
    _, x0, x_t, t, scale = _batch(kernel, n=N, seed=seed)
    return h, W, x0, x_t, t, scale


def _head_reference(h, W, x0, x_t, t, kernel, scale):
    hd, Wd = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    ref = native.reference_gidd_loss(hd @ Wd.T, x0, x_t, t, kernel)
    gh, gw = torch.autograd.grad((ref * scale).sum(), (hd, Wd))
    return ref.detach(), gh, gw


@pytest.mark.parametrize("chunk_size", [None, 40])
@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid"])
def test_fused_linear_bf16_matches_float64_materialised(name, chunk_size, backend):
    kernel = _kernel(name, 3000)
    h, W, x0, x_t, t, scale = _head_inputs(kernel, N=96, d=64)
    h16, W16 = h.to(torch.bfloat16), W.to(torch.bfloat16)
    ref, gh_ref, gw_ref = _head_reference(h16, W16, x0, x_t, t, kernel, scale)
    hh, WW = h16.to(DEV).requires_grad_(), W16.to(DEV).requires_grad_()
    out = fused_linear_diffusion_loss(hh.reshape(4, 24, -1), WW, x0.to(DEV).reshape(4, 24),
                                      x_t.to(DEV).reshape(4, 24), t.float().to(DEV).reshape(4, 24), kernel,
                                      chunk_size=chunk_size)
    assert out.shape == (4, 24) and out.dtype == torch.float32
    (out.reshape(-1) * scale.to(DEV, torch.float32)).sum().backward()
    assert hh.grad.dtype == torch.bfloat16 and WW.grad.dtype == torch.bfloat16
    # bf16 logits blocks: ~2⁻⁸ relative per logit, so a loose but meaningful tolerance
    torch.testing.assert_close(out.reshape(-1).cpu().double(), ref, rtol=2e-2, atol=1e-2)
    assert _rel_err(hh.grad.cpu(), gh_ref) < 2e-2
    assert _rel_err(WW.grad.cpu(), gw_ref) < 2e-2


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("name", ["uniform", "mask"])
def test_fused_linear_float32_matches_float64_materialised(name, reduction, backend):
    kernel = _kernel(name, 3000)
    h, W, x0, x_t, t, scale = _head_inputs(kernel, N=96, d=64, seed=2)
    omega = scale.clone()
    omega[::7] = 0.0  # padded positions
    h32, W32 = h.float(), W.float()
    w_ref = omega / omega.sum() if reduction == "mean" else omega
    ref, gh_ref, gw_ref = _head_reference(h32, W32, x0, x_t, t, kernel, w_ref)
    hh, WW = h32.to(DEV).requires_grad_(), W32.to(DEV).requires_grad_()
    out = fused_linear_diffusion_loss(hh, WW, x0.to(DEV), x_t.to(DEV), t.float().to(DEV), kernel,
                                      reduction=reduction, position_weight=omega.float().to(DEV), chunk_size=32)
    out.backward()
    torch.testing.assert_close(out.cpu().double(), (ref * w_ref).sum(), rtol=1e-5, atol=0.0)
    torch.testing.assert_close(hh.grad.cpu().double(), gh_ref, rtol=1e-4, atol=1e-5 * float(gh_ref.abs().max()))
    torch.testing.assert_close(WW.grad.cpu().double(), gw_ref, rtol=1e-4, atol=1e-5 * float(gw_ref.abs().max()))
    assert float(hh.grad[::7].abs().max()) == 0.0  # no gradient at padding


def test_fused_weight_gradient_uses_bf16_tensor_core_gemms_on_cuda():
    """On CUDA the probe finds a float32-output GEMM on bf16 operands, and ∂W accumulated that way over blocks matches
    the float64 accumulation of the same bf16 blocks."""
    from unifusion.losses import fused_linear

    assert fused_linear.fp32_accumulation_mode(torch.device(DEV), torch.bfloat16) in ("addmm", "mm")
    assert fused_linear.fp32_accumulation_mode(torch.device(DEV), torch.float16) in ("addmm", "mm")
    g = torch.Generator().manual_seed(0)
    acc = torch.zeros(3000, 256, device=DEV)
    ref = torch.zeros(3000, 256, dtype=torch.float64)
    mode = fused_linear.fp32_accumulation_mode(torch.device(DEV), torch.bfloat16)
    for _ in range(6):
        gb = torch.randn(512, 3000, generator=g).to(torch.bfloat16)
        hb = torch.randn(512, 256, generator=g).to(torch.bfloat16)
        fused_linear._accumulate(mode, acc, gb.to(DEV).T, hb.to(DEV))
        ref += gb.double().T @ hb.double()
    torch.testing.assert_close(acc.cpu().double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_fused_default_block_at_a_large_vocabulary(backend):
    """V = 262,144, bf16, the default block size (2,048 rows on CUDA: one block here), against float64 materialised
    logits of the same bf16 inputs."""
    from unifusion.losses import fused_linear

    V, N, d = 262_144, 64, 128
    assert fused_linear.default_chunk_size(N, V, torch.device(DEV)) == N
    kernel = _kernel("uniform", V)
    h, W, x0, x_t, t, scale = _head_inputs(kernel, N=N, d=d, seed=5)
    h16, W16 = h.to(torch.bfloat16), (W * 0.3).to(torch.bfloat16)
    ref, gh_ref, gw_ref = _head_reference(h16, W16, x0, x_t, t, kernel, scale)
    hh, WW = h16.to(DEV).requires_grad_(), W16.to(DEV).requires_grad_()
    out = fused_linear_diffusion_loss(hh, WW, x0.to(DEV), x_t.to(DEV), t.float().to(DEV), kernel)
    (out * scale.to(DEV, torch.float32)).sum().backward()
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2, atol=1e-2)
    assert _rel_err(hh.grad.cpu(), gh_ref) < 2e-2
    assert _rel_err(WW.grad.cpu(), gw_ref) < 2e-2


# ------------------------------------------------------------------------------------- diffusion_loss, model
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kernel_kind", ["uniform", "mask"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_diffusion_loss_on_cuda_matches_cpu(family, kernel_kind, fused, backend):
    cpu_model = uf.adapt_ar_model(tiny_model(family), add_mask_token=kernel_kind == "mask")
    gpu_model = copy.deepcopy(cpu_model).to(DEV)
    S = cpu_model.num_states
    kernel = uf.UniformKernel(S) if kernel_kind == "uniform" else uf.MaskKernel(S, cpu_model.mask_token_id)
    x0 = torch.randint(3, 120, (3, 16), generator=torch.Generator().manual_seed(0))
    pad = torch.ones_like(x0)
    pad[2, 11:] = 0
    out = uf.diffusion_loss(gpu_model, x0.to(DEV), kernel, attention_mask=pad.to(DEV), fused=fused,
                            generator=torch.Generator(DEV).manual_seed(0))
    assert out.loss.device.type == "cuda" and out.loss.shape == x0.shape
    out.loss.sum().backward()
    # CPU: the same corrupted tokens and times through the CPU copy, scored by the float64 reference loss
    x_t, t = out.x_t.cpu(), out.t.cpu()
    mask = out.mask.cpu().double()
    torch.testing.assert_close(mask, pad.double())
    logits = cpu_model(x_t, t, attention_mask=pad)
    ref = native.reference_gidd_loss(logits.double(), x0, x_t, t.double()[:, None].expand_as(x0), kernel) * mask
    ref.sum().backward()
    ref = ref.detach()
    torch.testing.assert_close(out.loss.detach().cpu().double(), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))
    for (name, p_cpu), p_gpu in zip(cpu_model.named_parameters(), gpu_model.parameters()):
        if p_cpu.grad is None:
            assert p_gpu.grad is None or float(p_gpu.grad.abs().max()) == 0.0, name
            continue
        g_ref = p_cpu.grad.double()
        torch.testing.assert_close(p_gpu.grad.cpu().double(), g_ref, rtol=1e-3,
                                   atol=1e-4 * float(g_ref.abs().max()) + 1e-8, msg=name)


# ------------------------------------------------------------------------------------------------ conversions
@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid"])
def test_x0_conversions_on_cuda_match_float64_cpu(name):
    S, n = 300, 64
    kernel = _kernel(name, S)
    logits64, _, x_t, t, _ = _batch(kernel, n=n, seed=3)
    if kernel.mask_id is not None:
        logits64[:, kernel.mask_id] = -torch.inf
    p32 = torch.softmax(logits64, -1).float()
    p64 = p32.double()
    p64 = p64 / p64.sum(-1, keepdim=True)  # the float32 distribution in float64 (renormalised: ~1e-8 relative)
    td, xd = t.float().to(DEV), x_t.to(DEV)

    def close(dev_value: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
        assert dev_value.device.type == "cuda"
        torch.testing.assert_close(dev_value.cpu().double(), ref, rtol=rtol,
                                   atol=1e-6 * float(ref.abs().max()) + 1e-30)

    rate = uf.ReverseRate.from_x0(kernel, p32.to(DEV), xd, td)
    ref = uf.ReverseRate.from_x0(kernel, p64, x_t, t)
    close(rate.rates, ref.rates)
    close(rate.exit_rate, ref.exit_rate)
    close(rate.jump_probs, ref.jump_probs)
    lrate = uf.ReverseRate.from_x0_logits(kernel, logits64.float().to(DEV), xd, td)
    close(lrate.rates, uf.ReverseRate.from_x0_logits(kernel, logits64.float().double(), x_t, t).rates)
    close(uf.convert_x0_to("rate", p32.to(DEV), kernel, xd, td).rates, ref.rates)
    close(uf.convert_x0_to("sedd", p32.to(DEV), kernel, xd, td), uf.convert_x0_to("sedd", p64, kernel, x_t, t))
    close(uf.convert_x0_to("m2s", p32.to(DEV), kernel, xd, td, strict=False),
          uf.convert_x0_to("m2s", p64, kernel, x_t, t, strict=False))
    exit_rate, jump = uf.convert_x0_to("ctmc", p32.to(DEV), kernel, xd, td)
    exit_ref, jump_ref = uf.convert_x0_to("ctmc", p64, kernel, x_t, t)
    close(exit_rate, exit_ref)
    close(jump, jump_ref)


# ---------------------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid"])
def test_bayesian_step_on_cuda_draws_from_the_float64_posterior(name):
    S, n = 6, 200_000
    kernel = _kernel(name, S)
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(S, generator=g, dtype=torch.float64), -1)
    if kernel.mask_id is not None:
        p[kernel.mask_id] = 0.0
        p = p / p.sum()
    gd = torch.Generator(DEV).manual_seed(0)
    t, s = torch.tensor(0.7, device=DEV), torch.tensor(0.4, device=DEV)
    for b in range(S):
        x_t = torch.full((n, 1), b, device=DEV)
        out = bayesian_step(p.float().to(DEV).expand(n, 1, S).clone(), x_t, kernel, t, s, gd)
        assert out.device.type == "cuda" and out.dtype == torch.int64
        freq = torch.bincount(out.flatten(), minlength=S).cpu().double() / n
        ref = kernel.posterior(p, torch.tensor(b), 0.4, torch.tensor(0.7, dtype=torch.float64))
        assert float((freq - ref).abs().sum()) / 2 < 0.01, (b, freq, ref)
        assert bool((freq[ref == 0] == 0).all())  # impossible states never drawn


@pytest.mark.parametrize("vocab", [128, 4096])  # 4096: the draw straight from the logits (≥ COMPILE_MIN_STATES)
@pytest.mark.parametrize("kernel_kind", ["uniform", "mask"])
def test_sampler_on_cuda_gives_valid_reproducible_ids(kernel_kind, vocab, backend):
    model = uf.adapt_ar_model(tiny_model("llama", vocab_size=vocab), add_mask_token=kernel_kind == "mask").to(DEV)
    S = model.num_states
    kernel = uf.UniformKernel(S) if kernel_kind == "uniform" else uf.MaskKernel(S, model.mask_token_id)
    sampler = uf.BayesianSampler(model, kernel, num_steps=6)
    runs = [sampler.sample(2, 24, generator=torch.Generator(DEV).manual_seed(5)) for _ in range(2)]
    ids = runs[0]
    assert ids.shape == (2, 24) and ids.dtype == torch.int64 and ids.device.type == "cuda"
    assert int(ids.min()) >= 0 and int(ids.max()) < S
    if kernel.mask_id is not None:
        assert not bool((ids == kernel.mask_id).any())  # the last step lands on clean tokens
    assert torch.equal(runs[0], runs[1])  # same generator state, same tokens
    prompt = torch.full((24,), -1, device=DEV)
    prompt[:5] = torch.arange(10, 15, device=DEV)
    out = sampler.sample(2, 24, prompt=prompt, generator=torch.Generator(DEV).manual_seed(6))
    assert torch.equal(out[:, :5], prompt[:5].expand(2, 5))


@pytest.mark.parametrize("kernel_kind", ["uniform", "mask"])
@pytest.mark.parametrize("parameterization", ["x0", "sedd"])
def test_euler_sampler_on_cuda_gives_valid_reproducible_ids(kernel_kind, parameterization):
    model = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=kernel_kind == "mask").to(DEV)
    S = model.num_states
    kernel = uf.UniformKernel(S) if kernel_kind == "uniform" else uf.MaskKernel(S, model.mask_token_id)
    head = model if parameterization == "x0" else uf.samplers.x0_model_as(model, kernel, parameterization)
    sampler = uf.EulerSampler(head, kernel, num_steps=6, parameterization=parameterization)
    runs = [sampler.sample(2, 24, generator=torch.Generator(DEV).manual_seed(5)) for _ in range(2)]
    ids = runs[0]
    assert ids.shape == (2, 24) and ids.dtype == torch.int64 and ids.device.type == DEV
    assert int(ids.min()) >= 0 and int(ids.max()) < S
    if kernel.mask_id is not None:
        assert not bool((ids == kernel.mask_id).any())  # the final step lands on clean tokens
    assert torch.equal(runs[0], runs[1])
    prompt = torch.full((24,), -1, device=DEV)
    prompt[:5] = torch.arange(10, 15, device=DEV)
    out = sampler.sample(2, 24, prompt=prompt, generator=torch.Generator(DEV).manual_seed(6))
    assert torch.equal(out[:, :5], prompt[:5].expand(2, 5))


@pytest.mark.parametrize("name", ["uniform", "mask"])
def test_bayesian_step_from_bf16_logits_at_lm_vocabulary_size_draws_the_float64_posterior(name, backend):
    """The LM path (S ≥ COMPILE_MIN_STATES: block masses, compiled under "compiled"): 100,000 draws per x_t (5 calls of
    20,000 rows: ~2 GB of bf16 logits each) at S = 50,257, T = 0.8, against kernel.posterior in float64 of
    softmax(rounded logits / T). The heavy states sit in different 256-state blocks (and the last, short one); the
    rest of the vocabulary is one bucket."""
    S, n, reps, T = 50_257, 20_000, 5, 0.8
    kernel = _kernel(name, S)
    g = torch.Generator().manual_seed(7)
    logits64 = torch.randn(S, generator=g, dtype=torch.float64) - 4.0  # a long tail with ~25 % of the mass
    heavy = torch.tensor([5, 255, 256, 20_000, 50_100, S - 2])  # block edges and the short last block
    logits64[heavy] = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0, 0.5], dtype=torch.float64)
    rounded = logits64.to(torch.bfloat16)
    p = torch.softmax(rounded.double() / T, -1)
    if kernel.mask_id is not None:
        p[kernel.mask_id] = 0.0
        p = p / p.sum()
    buckets = torch.unique(torch.cat([heavy, torch.tensor([0, 17, S - 1])]))  # + the x_t values and the mask id
    gd = torch.Generator(DEV).manual_seed(0)
    t, s = torch.tensor(0.7, device=DEV), torch.tensor(0.4, device=DEV)
    logits = rounded.to(DEV).expand(n, 1, S).contiguous()  # (n, 1, S) bf16, as a model returns them
    for b in (0, 17, int(heavy[0]), S - 1):  # S - 1 is the mask id of the mask kernel
        x_t = torch.full((n, 1), b, device=DEV)
        outs = [bayesian_step_from_logits(logits, x_t, kernel, t, s, gd, temperature=T) for _ in range(reps)]
        assert all(o.shape == (n, 1) and o.device.type == DEV and o.dtype == torch.int64 for o in outs)
        draws = torch.cat(outs).flatten().cpu()
        ref = kernel.posterior(p, torch.tensor(b), 0.4, torch.tensor(0.7, dtype=torch.float64))  # (S,)
        in_bucket = (draws[:, None] == buckets[None, :])
        freq = torch.cat([in_bucket.double().mean(0), 1 - in_bucket.any(1).double().mean(0, keepdim=True)])
        expected = torch.cat([ref[buckets], (1 - ref[buckets].sum()).reshape(1)])
        assert float((freq - expected).abs().sum()) / 2 < 0.01, (b, freq, expected)
        if kernel.mask_id is not None and b != kernel.mask_id:
            assert bool((draws == b).all())  # the mask kernel never leaves a clean token
        keep = expected > 0  # buckets the posterior can reach (others must stay empty)
        assert bool((freq[~keep] == 0).all()), (b, freq, expected)
        chi2 = float(((freq[keep] - expected[keep]) ** 2 / expected[keep]).sum() * n * reps)
        assert chi2 < 40.0, (b, chi2)  # ≤ 9 degrees of freedom: P(χ² > 40) < 1e-5


# ------------------------------------------------------------------------------------------------ evaluation
def _tiny_pair(kind: str = "mask"):
    cpu_model = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=kind == "mask")
    gpu_model = copy.deepcopy(cpu_model).to(DEV)
    S = cpu_model.num_states
    kernel = uf.UniformKernel(S) if kind == "uniform" else uf.MaskKernel(S, cpu_model.mask_token_id)
    return cpu_model, gpu_model, kernel


@pytest.mark.parametrize("kind", ["uniform", "mask"])
def test_nll_bound_on_cuda_matches_a_float64_cpu_recomputation_of_its_draws(kind):
    cpu_model, gpu_model, kernel = _tiny_pair(kind)
    x0 = torch.randint(3, 120, (3, 12), generator=torch.Generator().manual_seed(0))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording(x_t, t, **kwargs):  # the draws the device made, kept for the CPU reference
        seen.append((x_t.cpu(), t.cpu()))
        return gpu_model(x_t, t, **kwargs)

    K = 6
    bound = nll_bound(recording, x0.to(DEV), kernel, num_times=K, generator=torch.Generator(DEV).manual_seed(1),
                      per_token=False, batch_size=3)  # one time per call: each recorded call is one time of x0
    assert bound.device.type == DEV and bound.dtype == torch.float64 and len(seen) == K
    model64 = copy.deepcopy(cpu_model).double()
    with torch.no_grad():
        total = sum(native.reference_gidd_loss(model64(x_t, t.double()), x0, x_t, t.double()[:, None].expand_as(x0),
                                               kernel).sum(-1) for x_t, t in seen)
    ref = total / K + prior_kl(kernel, x0).sum(-1)
    torch.testing.assert_close(bound.cpu(), ref, rtol=1e-4, atol=1e-6)
    again = nll_bound(gpu_model, x0.to(DEV), kernel, num_times=K, generator=torch.Generator(DEV).manual_seed(1),
                      per_token=False, batch_size=3)
    torch.testing.assert_close(again, bound, rtol=0, atol=0)  # the device stream is reproducible


def test_score_choices_and_fair_pmi_on_cuda_match_a_float64_cpu_model():
    cpu_model, gpu_model, kernel = _tiny_pair("mask")
    model64 = copy.deepcopy(cpu_model).double()
    context, choices, null = [5, 9, 14, 3], [[20, 21], [30], [40, 41, 42]], [7, 8]
    for fn, extra in ((score_choices, {}), (fair_pmi_scores, {"null_context_ids": null})):
        args = (kernel, context, choices) + tuple(extra.values())
        # a CPU generator: the corruption is drawn on the CPU and the rows moved to the model, so the draws are equal
        dev = fn(gpu_model, *args, num_times=8, generator=torch.Generator().manual_seed(3), batch_size=5)
        ref = fn(model64, *args, num_times=8, generator=torch.Generator().manual_seed(3), batch_size=5)
        assert dev.dtype == torch.float64 and dev.shape == (3,)
        torch.testing.assert_close(dev, ref, rtol=1e-4, atol=1e-5)
        # a generator on the device works too (draws there), reproducibly
        a, b = (fn(gpu_model, *args, num_times=8, generator=torch.Generator(DEV).manual_seed(3)) for _ in range(2))
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_the_harness_runs_its_three_request_types_on_cuda():
    """#16: loglikelihood_rolling on a GPU handed nll_bound a CPU generator ("Expected a 'cuda' device type for
    generator"). All three request types on the device, against the CPU harness and the library calls."""
    pytest.importorskip("lm_eval")  # the [eval] extra
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from unifusion.eval.harness import UnifusionLM, request_seed

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(__file__), "data", "tiny_tokenizer"))
    cpu_model = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=3), tokenizer=tokenizer)
    gpu_model = copy.deepcopy(cpu_model).to(DEV)
    kernel = uf.MaskKernel(cpu_model.num_states, cpu_model.mask_token_id)

    def request(*args, doc_id=None):
        return SimpleNamespace(args=args, doc_id=doc_id, task_name="t")

    # seeding=task: the rolling bound streams one generator seeded with `seed` (the default seeds each text apart)
    options = dict(tokenizer=tokenizer, num_times=4, nll_times=4, num_steps=3, seed=5, max_length=6, seeding="task")
    lm_gpu, lm_cpu = UnifusionLM(model=gpu_model, **options), UnifusionLM(model=cpu_model, **options)
    mc = [request("the cat sat on the", " mat", doc_id=0), request("the cat sat on the", " dog", doc_id=0)]
    got, want = lm_gpu.loglikelihood(mc), lm_cpu.loglikelihood(mc)  # CPU draws on both: the same corruption
    assert [g for _, g in got] == [w for _, w in want]
    assert [v for v, _ in got] == pytest.approx([v for v, _ in want], rel=1e-4)
    text = "the cat sat on the mat . the big dog ran to the river ."
    (rolling,) = lm_gpu.loglikelihood_rolling([request(text)])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    g = torch.Generator(DEV).manual_seed(5)
    expected = sum(-float(nll_bound(gpu_model, torch.tensor([ids[lo: lo + 6]], device=DEV), kernel, num_times=4,
                                    generator=g, per_token=False)) for lo in range(0, len(ids), 6))
    assert math.isfinite(rolling) and rolling == pytest.approx(expected, rel=1e-10)
    gen = [request("the animal is cat .", {"until": ["."], "max_gen_toks": 4})]
    modes = [m.training for m in gpu_model.modules()]
    first, second = lm_gpu.generate_until(gen), lm_gpu.generate_until(gen)
    assert first == second and isinstance(first[0], str)  # seeded on the device: reproducible
    job = lm_gpu._generation_job(gen[0])  # argmax decoding (the task sets no do_sample): top_k = 1
    prompt = torch.tensor([job.prompt], device=DEV)  # the context cut to max_length
    seed = request_seed(5, "generate_until", gen[0].args[0], job.settings(), 0)  # every request its own generator
    with torch.no_grad():
        gpu_model.eval()
        ids = gpu_model.generate(prompt, max_new_tokens=4, num_steps=3, kernel=kernel, temperature=job.temperature,
                                 top_k=job.top_k, top_p=job.top_p,
                                 generator=torch.Generator(DEV).manual_seed(seed))[0, prompt.shape[1]:].tolist()
    for module, training in zip(gpu_model.modules(), modes):
        module.training = training
    ids = ids[: ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
    ids = [i for i in ids if i != gpu_model.mask_token_id]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert first == [text[: text.index(".")] if "." in text else text]  # DiffusionLM.generate, cut at the stop


# ----------------------------------------------------------------------------------------- compiled vs eager
def test_compiled_backend_matches_eager_on_cuda():
    """The compiled backend really compiles on the device (no fallback warning) and agrees with eager."""
    previous = uf.backend.get_backend()
    kernel = _kernel("hybrid", 4096)
    logits64, x0, x_t, t, scale = _batch(kernel, n=128, seed=4)
    h, W, *_ = _head_inputs(kernel, N=128, d=48, seed=4)
    results = {}
    try:
        for backend in ("eager", "compiled"):
            uf.backend.set_backend(backend)
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # "torch.compile failed ...; running eagerly"
                L = logits64.float().to(DEV).requires_grad_()
                loss = fast.gidd_loss(L, x0.to(DEV), x_t.to(DEV), t.float().to(DEV), kernel)
                (loss * scale.float().to(DEV)).sum().backward()
                hh, WW = h.float().to(DEV).requires_grad_(), W.float().to(DEV).requires_grad_()
                fused = fused_linear_diffusion_loss(hh, WW, x0.to(DEV), x_t.to(DEV), t.float().to(DEV), kernel,
                                                    chunk_size=48)
                (fused * scale.float().to(DEV)).sum().backward()
            assert uf.backend.get_backend() == backend  # a failed compilation would have switched to eager
            results[backend] = [x.detach().cpu() for x in (loss, L.grad, fused, hh.grad, WW.grad)]
    finally:
        uf.backend.set_backend(previous)
    for a, b in zip(results["compiled"], results["eager"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


@pytest.mark.parametrize("merge_commits", [False, True])
def test_block_decoding_on_cuda_cached_equals_uncached(merge_commits):
    """A tiny block model on the device (float32, TF32 off): generate through the exact KV cache (merged commits or
    not) gives the tokens and forward counts of the uncached block-causal forward, rows with their own generators,
    a left-padded batch and a prompt length K does not divide (#24)."""
    from unifusion.samplers.policies import LowConfidence

    torch.manual_seed(0)
    model = uf.adapt_ar_model(tiny_model("llama"), mask_token_id=3, block_size=4).to(DEV).eval()
    prompt = torch.randint(4, 100, (3, 6), device=DEV)
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0  # row 0: a 3-token prompt, left-padded
    outs = []
    for use_cache in (True, False):
        gens = [torch.Generator(device=DEV).manual_seed(r) for r in range(3)]
        outs.append(model.generate(prompt, attention_mask=mask, max_new_tokens=10, policy=LowConfidence(),
                                   num_steps=2, eos_token_id=None, use_cache=use_cache, generator=gens,
                                   merge_commits=merge_commits and use_cache, return_dict=True))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(outs[0].num_forwards, outs[1].num_forwards)
    assert outs[0].sequences.device.type == "cuda" and int(outs[0].sequences[:, 6:].min()) >= 0
