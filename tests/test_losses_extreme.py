"""Every x0-head loss stays finite and exact for a confidently wrong (or right) model.

Grid: logit gaps of 0 (N(0, 2²) logits), 87 (where float32 exp(−gap) underflows), 10³ and 10⁴ nats; times
1e-6, 1/2 and 1 − 1e-6; uniform, mask and hybrid kernels; ELBO, clipped and dynamic weights; clean, masked and
uniform-noise positions; logits peaked on a wrong token, on x0 and on x_t.

The chain of trust:
(A) the float64 reference (``reference_gidd_loss``) equals a 50-digit closed form (mpmath, independent of the library's
    arithmetic) to 1e-12 relative;
(B) the fast loss in float64 equals the reference: values ≤ 1e-10 relative, gradients ≤ 1e-10 of the row's scale;
(C) float32 and bf16 logits (computed in float32) through the fast loss, MDLM's loss, every x0-head objective, the
    fused linear loss and the reference itself equal the float64 reference on the same logits: values ≤ 1e-6
    relative; gradients ≤ 1e-6 of the row's scale (bf16 gradients are returned in bf16, so they carry its rounding,
    2⁻⁸ relative, on top);
(D) the same at S = 262,144; (E) the compiled backend on a representative subset.

Two floors, both the resolution of the compute dtype, which no softmax-based loss beats:
* a value may also be within 4 ulp (of the compute dtype) of w α, the row's weight times α_t. When the model is
  confidently right, p(x0) rounds to 1 and 1 − p(x0) to 0 in any softmax (a float32 cross-entropy then returns
  exactly 0): the fast loss returns 0 for a true loss of, e.g., 3e-29 next to w α = 10⁶.
* a row's gradient scale is max(‖∂L/∂logits‖∞, w α), where w α is the size of the terms whose difference is the
  gradient: like a cross-entropy's p − onehot, a saturated softmax leaves a true gradient far below float32's
  resolution of those terms (e.g. 1e-27 next to terms of 10⁶ at t = 1e-6).
"""

from __future__ import annotations

import math

import mpmath
import pytest
import torch

import unifusion as uf
from unifusion.losses import native
from unifusion.losses.fast import _prepare_rows

DT = torch.float64
GAPS = (0.0, 87.0, 1e3, 1e4)
TIMES = tuple(float(torch.tensor(t, dtype=torch.float32)) for t in (1e-6, 0.5, 1 - 1e-6))  # float32-exact
WEIGHTINGS = ("elbo", "clip", "dynamic")
EPS64, EPS32 = torch.finfo(DT).eps, torch.finfo(torch.float32).eps


def kernels(S: int) -> dict[str, uf.Kernel]:
    return {"uniform": uf.UniformKernel(S), "mask": uf.MaskKernel(S, S - 1),
            "hybrid": uf.HybridKernel(S, S - 1, 0.1), "hybrid_g2": uf.HybridKernel(S, 0, 0.3, gamma=2.0)}


def batch(kernel: uf.Kernel, gap: float, t: float, seed: int = 0, rows_per_style: int = 2):
    """Logits ``(N, S)`` float64, x0 and x_t ``(N,)``: each position kind × each logit style (wrong / x0 / x_t)."""
    S = kernel.num_states
    g = torch.Generator().manual_seed(seed)
    clean = [i for i in range(S) if i != kernel.mask_id]
    kinds = ["clean"] + (["mask"] if kernel.mask_id is not None else []) + (
        ["noise"] if not isinstance(kernel, uf.MaskKernel) else [])
    x0s, xts, peaks = [], [], []
    for kind in kinds:
        for style in ("wrong", "x0", "xt"):
            for _ in range(rows_per_style):
                a, b, c = (clean[int(i)] for i in torch.randperm(len(clean), generator=g)[:3])
                x_t = a if kind == "clean" else (kernel.mask_id if kind == "mask" else b)
                peak = {"wrong": c, "x0": a, "xt": x_t}[style]
                x0s.append(a), xts.append(x_t), peaks.append(peak)
    N = len(x0s)
    logits = 2.0 * torch.randn(N, S, generator=g, dtype=DT)
    logits[torch.arange(N), torch.tensor(peaks)] += gap
    return logits, torch.tensor(x0s), torch.tensor(xts)


def weight_scale(kernel, x0, x_t, t, weighting) -> torch.Tensor:
    """w α per row ``(N,)`` (0 where the loss is 0 by construction)."""
    rows, _ = _prepare_rows(kernel, None, x0, x_t, t, DT, torch.device("cpu"), weighting, 2.0)
    return rows.A.abs()


def row_scale(kernel, logits, x0, x_t, t, weighting, grad_ref):
    return torch.maximum(grad_ref.abs().amax(-1), weight_scale(kernel, x0, x_t, t, weighting))


def reference(logits64, x0, x_t, t, kernel, weighting):
    l = logits64.clone().requires_grad_()
    loss = native.gidd_loss(l, x0, x_t, t, kernel, weighting=weighting, max_weight=2.0)
    loss.sum().backward()
    return loss.detach(), l.grad


def check(loss, grad, ref_loss, ref_grad, scale, rtol, grad_rtol, what, floor):
    """``floor`` ``(N,)``: 4 ulp of the compute dtype times w α (see the module docstring)."""
    assert bool(torch.isfinite(loss).all()) and bool(torch.isfinite(grad).all()), f"{what}: not finite"
    err = (loss.to(DT) - ref_loss).abs()
    assert bool((err <= rtol * ref_loss.abs() + floor).all()), \
        f"{what}: value rel err {float((err / ref_loss.abs().clamp_min(1e-300)).max()):.2e}"
    g_err = (grad.to(DT) - ref_grad).abs().amax(-1)
    assert bool((g_err <= grad_rtol * scale).all()), f"{what}: grad err / scale {float((g_err / scale).max()):.2e}"


# ---------------------------------------------------------------------------------------------------- (A) reference
def _mp_loss(kernel, logits_row, x0: int, x_t: int, t: float, weighting: str) -> float:
    """w [KL(q0 ‖ qθ) + ρ − log ρ − 1] in 50 digits from the exact logits; α, m, v read from the kernel in float64
    (their own accuracy is tested in tests/test_kernels.py and tests/test_peer_parity.py)."""
    mpmath.mp.dps = 150  # the loss of a confidently right model is ~1e-70 here
    S = kernel.num_states
    tt = torch.tensor(t, dtype=DT)
    alpha, a, b = (float(v) for v in kernel._coefficients(tt))
    m = kernel._noise_vector(torch.tensor(a, dtype=DT), torch.tensor(b, dtype=DT)).tolist()
    v = float(kernel.rate_into(torch.tensor(x_t), tt)[(x_t + 1) % S])
    states = [y for y in range(S) if y != kernel.mask_id]
    z = [mpmath.mpf(float(logits_row[y])) for y in states]
    lse = mpmath.log(mpmath.fsum(mpmath.exp(zi) for zi in z))
    p = {y: mpmath.exp(zi - lse) for y, zi in zip(states, z)}
    q0 = [alpha * (y == x0) + mpmath.mpf(m[y]) for y in range(S)]
    qt = [alpha * p.get(y, 0) + mpmath.mpf(m[y]) for y in range(S)]
    # KL as Σ_y f(q0_y, qθ_y), f(r, c) = r log(r/c) − r + c: termwise ≥ 0, exact without Σ q0 = Σ qθ = 1 (α and m
    # are float64 numbers, whose sum is 1 only to rounding)
    kl = mpmath.fsum((q0[y] * mpmath.log(q0[y] / qt[y]) if q0[y] > 0 else 0) - q0[y] + qt[y] for y in range(S))
    rho = q0[x_t] / qt[x_t]
    w = v / q0[x_t]
    if weighting == "clip":
        w = min(w, 2.0)
    elif weighting == "dynamic":
        w = float(native._dynamic_weight(kernel, torch.tensor(x0), torch.tensor(x_t), tt).clamp(0.0, 2.0))
    return float(w * (kl + rho - mpmath.log(rho) - 1))


@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid", "hybrid_g2"])
@pytest.mark.parametrize("gap", GAPS)
def test_reference_equals_50_digit_closed_form(name, gap):
    kernel = kernels(12)[name]
    for t in TIMES:
        logits, x0, x_t = batch(kernel, gap, t, rows_per_style=1)
        for weighting in WEIGHTINGS:
            loss = native.gidd_loss(logits, x0, x_t, t, kernel, weighting=weighting, max_weight=2.0)
            exact = torch.tensor([_mp_loss(kernel, logits[i], int(x0[i]), int(x_t[i]), t, weighting)
                                  for i in range(len(x0))], dtype=DT)
            floor = 4 * EPS64 * weight_scale(kernel, x0, x_t, t, weighting)
            assert bool(((loss - exact).abs() <= 1e-12 * exact.abs() + floor).all()), (t, weighting, loss, exact)


# ---------------------------------------------------------------------------------------------------- (B) float64
@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid", "hybrid_g2"])
@pytest.mark.parametrize("gap", GAPS)
def test_fast_loss_float64_equals_reference(name, gap):
    kernel = kernels(40)[name]
    for t in TIMES:
        logits, x0, x_t = batch(kernel, gap, t)
        for weighting in WEIGHTINGS:
            ref_loss, ref_grad = reference(logits, x0, x_t, t, kernel, weighting)
            l = logits.clone().requires_grad_()
            loss = uf.losses.gidd_loss(l, x0, x_t, t, kernel, weighting=weighting, max_weight=2.0)
            loss.sum().backward()
            scale = row_scale(kernel, logits, x0, x_t, t, weighting, ref_grad)
            check(loss, l.grad, ref_loss, ref_grad, scale, 1e-10, 1e-10, f"{name} gap={gap} t={t} {weighting}",
                  4 * EPS64 * weight_scale(kernel, x0, x_t, t, weighting))


# ---------------------------------------------------------------------------------------------------- (C) float32/bf16
def _losses(kernel, weighting):
    """Every x0-head loss path that takes logits ``(N, S)``: name → fn(logits, x0, x_t, t) → per-position loss."""
    out = {"gidd": lambda l, x0, x_t, t: uf.losses.gidd_loss(l, x0, x_t, t, kernel, weighting, 2.0),
           "fused": lambda l, x0, x_t, t: uf.losses.fused_linear_diffusion_loss(
               l, torch.eye(kernel.num_states, dtype=l.dtype), x0, x_t, t, kernel, weighting=weighting,
               max_weight=2.0),  # h @ I = the logits, exactly
           "reference": lambda l, x0, x_t, t: uf.losses.reference_gidd_loss(l, x0, x_t, t, kernel, weighting, 2.0)}
    if weighting == "elbo":
        for objective in ("sedd", "m2s", "ctmc"):
            out[objective] = (lambda obj: lambda l, x0, x_t, t: uf.losses.x0_head_loss(
                l, x0, x_t, t, kernel, objective=obj))(objective)
        if isinstance(kernel, uf.MaskKernel):
            out["mdlm"] = lambda l, x0, x_t, t: uf.losses.mdlm_loss(l, x0, x_t, t, kernel)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid", "hybrid_g2"])
@pytest.mark.parametrize("gap", GAPS)
def test_low_precision_logits_equal_float64_reference(dtype, name, gap):
    kernel = kernels(40)[name]
    for t in TIMES:
        logits, x0, x_t = batch(kernel, gap, t)
        logits = logits.to(dtype).to(DT)  # the reference sees exactly the low-precision logits
        for weighting in WEIGHTINGS:
            ref_loss, ref_grad = reference(logits, x0, x_t, t, kernel, weighting)
            scale = row_scale(kernel, logits, x0, x_t, t, weighting, ref_grad)
            floor = 4 * EPS32 * weight_scale(kernel, x0, x_t, t, weighting)
            for path, fn in _losses(kernel, weighting).items():
                l = logits.to(dtype).requires_grad_()
                loss = fn(l, x0, x_t, t)
                loss.sum().backward()
                assert loss.dtype == torch.float32 and l.grad.dtype == dtype
                grad_tol = 1e-6 if dtype == torch.float32 else 2.0**-8
                check(loss, l.grad, ref_loss, ref_grad, scale, 1e-6, grad_tol,
                      f"{path} {dtype} {name} gap={gap} t={t} {weighting}", floor)


# ---------------------------------------------------------------------------------------------------- (D) S = 262,144
@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid"])
def test_large_vocabulary(name):
    kernel = kernels(262_144)[name]
    for t in (TIMES[0], TIMES[2]):
        logits, x0, x_t = batch(kernel, 1e4, t, rows_per_style=1)
        logits = logits.float().double()
        ref_loss, ref_grad = reference(logits, x0, x_t, t, kernel, "elbo")
        scale = row_scale(kernel, logits, x0, x_t, t, "elbo", ref_grad)
        l = logits.float().requires_grad_()
        loss = uf.losses.gidd_loss(l, x0, x_t, t, kernel)
        loss.sum().backward()
        check(loss, l.grad, ref_loss, ref_grad, scale, 1e-6, 1e-6, f"S=262144 {name} t={t}",
              4 * EPS32 * weight_scale(kernel, x0, x_t, t, "elbo"))


# ---------------------------------------------------------------------------------------------------- (E) compiled
@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid"])
def test_compiled_backend(name):
    kernel = kernels(1000)[name]
    previous = uf.get_backend()
    uf.set_backend("compiled")
    try:
        for gap in (87.0, 1e4):
            for t in TIMES:
                logits, x0, x_t = batch(kernel, gap, t)
                logits = logits.float().double()
                ref_loss, ref_grad = reference(logits, x0, x_t, t, kernel, "elbo")
                scale = row_scale(kernel, logits, x0, x_t, t, "elbo", ref_grad)
                l = logits.float().requires_grad_()
                loss = uf.losses.gidd_loss(l, x0, x_t, t, kernel)
                loss.sum().backward()
                check(loss, l.grad, ref_loss, ref_grad, scale, 1e-6, 1e-6, f"compiled {name} gap={gap} t={t}",
                      4 * EPS32 * weight_scale(kernel, x0, x_t, t, "elbo"))
    finally:
        uf.set_backend(previous)


def test_validation_does_not_blame_finite_logits():
    """A loss spike (−log p = 86.9 at t = 1/2 under the mask kernel, the issue's example) is a number, not NaN."""
    kernel = uf.MaskKernel(50, 49)
    logits = torch.zeros(1, 50)
    logits[0, 1] = 86.9
    loss = uf.losses.gidd_loss(logits, torch.tensor([0]), torch.tensor([49]), 0.5, kernel)
    assert math.isfinite(float(loss)) and float(loss) == pytest.approx(2 * (86.9 + math.log1p(49 * math.exp(-86.9))),
                                                                        rel=1e-6)
