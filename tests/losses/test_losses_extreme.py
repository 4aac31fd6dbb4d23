"""Every loss stays finite and exact for a confidently wrong (or right) model, value and gradient.

Grid: logit gaps 0 (N(0, 2²) logits), 20, 60, 80, 85, 87 (float32's e^{−gap} leaves the normal range at 87.3), 90,
200, 10³ and 10⁴ nats; times 1e-6, 1/2 and 1 − 1e-6, and (float64 and low-precision sweeps) three more per cell drawn
log-uniformly in the distance to the nearer end of [1e-6, 1 − 1e-6] (seeded); uniform, mask (mask id last, first and in
the middle), hybrid (p_u = 0.1; p_u = 0.3 with γ = 2 and the mask first; GIDD's default p_u = e^{−20} with the mask in
the middle) kernels and two :class:`GeneratorKernel` chains (a dense random generator; the absorbing "mask" generator,
whose x_t can be impossible under x0); ELBO, clipped and dynamic weights (ELBO only for generator kernels); clean,
masked and uniform-noise positions; logits peaked on a wrong token, on x0 and on x_t.

The chain of trust:
(A) the float64 reference (``reference_gidd_loss``) equals a closed form evaluated in 60+ digits (mpmath; α_t, the
    noise masses and the forward rates from the schedule formulas, the generator kernels' transition matrices from
    mpmath's matrix exponential, the dynamic weight from the issue's formula: nothing read from the library), values
    ≤ 1e-12 relative and gradients ≤ 1e-12 norm-wise.
(B) the fast loss, the fused loss, MDLM's fast and reference losses and the x0-head SEDD/M2S/CTMC objectives in float64
    equal the reference: ≤ 1e-10, no absolute allowance.
(C) float32 and bf16 logits (computed in float32) through every path — fast, fused, reference, MDLM's fast and
    reference losses, the x0-head SEDD/M2S/CTMC objectives, ``diffusion_loss`` (x0 head, and the converted-head
    references in float64) — and the native SEDD, M2S and Neural-CTMC losses fed their own heads (vs their own
    60-digit closed forms) equal the float64 values of the same rounded inputs: ≤ 1e-6.
(D) the same at S = 262,144 for every fast kernel and weighting (fast and fused losses); (E) the compiled backend
    (fast, fused and MDLM losses, on the compiled configurations the suite shares); (F) rows whose non-maximal
    logits are all equal (a padded vocabulary), where the rounding of l − max does not average out.

How errors are measured: values relatively, |L − L_ref| ≤ rtol |L_ref|; gradients **norm-wise per row**,
max_z |g_z − g_ref,z| ≤ rtol · max_z |g_ref,z| (a per-entry relative error of an entry 10⁻³⁰ of its row's largest one
is meaningless: float32 keeps each entry to a few ulp of the terms it is made of, and the entries of a softmax gradient
span the row's whole range). rtol = 1e-6 for float32 and bf16 logits, 1e-10 for float64 ones. Measured (fast and fused
float32 paths, the worst row of the sweep (C) with its random times): values 3.3e-7, gradients 5.9e-7 (a row whose
entries nearly cancel: e_z ≈ c at a few tokens); bf16 logits 2.0e-7 and 4.2e-8 beyond their rounding below; at
S = 262,144 2.5e-7 and 2.6e-7; the float64 reference on the same float32 logits ~6e-8.

Allowances, each forced by a number format, none by the algorithm:
* **bf16 gradients are returned in bf16**: each entry is first allowed its own rounding, 2^{−8} |g_ref,z| (half a bf16
  ulp), and 2^{−134} below 2^{−126} (half of bf16's subnormal spacing).
* **Subnormal per-token terms.** The (N, S) passes are float32: a per-token quantity below float32's smallest normal
  2^{−126} is subnormal, known only to the absolute spacing 2^{−149} — P_y = e^{l_y − max} beyond 87.3 nats, and
  the per-token terms of the loss (u (x_y − log1p x_y) ≈ u x_y²/2, or α P_y/s under the mask kernel) and of the
  gradient built from them. A sum of S such terms is known to S · 2^{−149}, times the factor that multiplies it: so
  values get S · 2^{−149} · max(1, |w| m) (w the row's weight, m = u, the uniform noise mass of a state, or α under
  the mask kernel) and gradients S · 2^{−149} · max(1, 4|w|) (a gradient entry's per-row factors, A/s and
  (A c + H p_xt)/s, are at most 4|w|). They bind only for results near or below 2^{−126}: the largest use on this grid
  is 0.042 of the value allowance (a loss of 2.7e-38, off by 4.0e-44 = 1.5e-6 of itself: its per-token terms are
  ~1e-42) and 0.013 of the gradient one. Generator kernels (computed in float64 inside) take w = m = 1.
Nothing else: a confidently right model's loss (e.g. 1e-17 at gap 20 and t = 1e-6, where a float32 cross-entropy
returns 0) is exact to 1e-6, because 1 − p(x0) is summed from the other tokens rather than taken from p(x0) ≈ 1, and
so is the gradient at the most likely token; the rounding of l − max, which a float32 softmax (and ``F.cross_entropy``)
carries as a relative error of up to 2^{−24} |l − max| in e^{l − max} (6e-6 at 104 nats), is compensated for float32
logits (``_x0_math.exp_minus_max``), and every per-row quantity is float64. For bf16 logits l − max is exact in
float32 unless one of the two lies within 2^{−16} |l − max| of zero (a logit within ~1e-3 of 0, tens of nats below the
maximum); (F) measures that case, the one place where a bf16 row is held to 2^{−24} |l − max| instead of 1e-6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mpmath
import pytest
import torch

import unifusion as uf
from unifusion.losses import native
from unifusion.losses.fast import prepare_x0_rows

DT = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: these are many small ops, which OpenMP barriers slow down on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

GAPS = (0.0, 20.0, 60.0, 80.0, 85.0, 87.0, 90.0, 200.0, 1e3, 1e4)
TIMES = tuple(float(torch.tensor(t, dtype=torch.float32)) for t in (1e-6, 0.5, 1 - 1e-6))  # float32-exact
WEIGHTINGS = ("elbo", "clip", "dynamic")
RTOL32, RTOL64 = 1e-6, 1e-10
TINY32 = 2.0**-126  # float32's smallest normal number
SUB32 = 2.0**-149  # float32's subnormal spacing


def random_times(n: int, generator: torch.Generator) -> list[float]:
    """``n`` times in [1e-6, 1 − 1e-6], log-uniform in the distance to the nearer end (t or 1 − t = 10^U with
    U ~ U(−6, log10(1/2)), either end with probability 1/2), rounded to float32."""
    u = torch.rand(n, generator=generator, dtype=DT) * (math.log10(0.5) + 6.0) - 6.0
    near_one = torch.rand(n, generator=generator) < 0.5
    t = torch.where(near_one, 1.0 - 10.0**u, 10.0**u).clamp(1e-6, 1 - 1e-6)
    return [float(v) for v in t.to(torch.float32)]


# ---------------------------------------------------------------------------------------------------- kernels
@dataclass(frozen=True)
class Spec:
    """A kernel as (kind, mask position, p_u, γ), so the closed forms below need nothing from the library; generator
    kernels carry their matrix's seed (``"generator"``: dense random rates; ``"generator_mask"``: every clean state
    jumps to the mask at rate 1, MDLM's chain in generator form)."""

    kind: str  # "uniform" | "mask" | "hybrid" | "generator" | "generator_mask"
    mask: str | None = None  # "last" | "first" | "middle"
    p: float = 0.0
    gamma: float = 1.0

    def mask_id(self, S: int) -> int | None:
        return {None: None, "last": S - 1, "first": 0, "middle": S // 2}[self.mask]

    def generator(self, S: int) -> torch.Tensor:
        """R̄ ``(S, S)`` float64 (rows: from; rows sum to 0)."""
        if self.kind == "generator":
            R = 0.2 + torch.rand(S, S, generator=torch.Generator().manual_seed(3), dtype=DT)
        else:
            R = torch.zeros(S, S, dtype=DT)
            R[:, self.mask_id(S)] = 1.0
        R.fill_diagonal_(0.0)
        return R - torch.diag(R.sum(-1))

    def kernel(self, S: int) -> uf.Kernel:
        if self.kind == "uniform":
            return uf.UniformKernel(S)
        if self.kind.startswith("generator"):
            return uf.GeneratorKernel(self.generator(S), mask_id=self.mask_id(S))
        m = self.mask_id(S)
        assert m is not None
        if self.kind == "mask":
            return uf.MaskKernel(S, m)
        return uf.HybridKernel(S, m, self.p, gamma=self.gamma)

    @property
    def weightings(self) -> tuple[str, ...]:
        return ("elbo",) if self.kind.startswith("generator") else WEIGHTINGS


SPECS = {
    "uniform": Spec("uniform"),
    "mask": Spec("mask", "last"),
    "mask_first": Spec("mask", "first"),
    "mask_middle": Spec("mask", "middle"),
    "hybrid": Spec("hybrid", "last", 0.1),
    "hybrid_g2": Spec("hybrid", "first", 0.3, 2.0),
    "gidd_default": Spec("hybrid", "middle", math.exp(-20)),  # GIDD's p_uniform: 0.0 clips to e^{−20}
    "generator": Spec("generator"),
    "generator_mask": Spec("generator_mask", "last"),
}
FAST_SPECS = [name for name, spec in SPECS.items() if not spec.kind.startswith("generator")]


def sweep_states(name: str) -> int:
    """S of the (B) and (C) sweeps: 40; 12 for the generator kernels (a matrix exponential per row)."""
    return 40 if name in FAST_SPECS else 12


# ---------------------------------------------------------------------------------------------------- the grid
@dataclass
class Grid:
    logits: torch.Tensor  # (N, S) float64
    x0: torch.Tensor
    x_t: torch.Tensor
    t: torch.Tensor  # (N,) float64
    labels: list[str]


def grid(spec: Spec, S: int, gaps=GAPS, times=TIMES, seed: int = 0, per_style: int = 1, keep=None,
         num_random_times: int = 0) -> Grid:
    """Every (gap, time, position kind, logit style) as one row: kinds clean / mask / noise (those the kernel has),
    styles peaked on a wrong token, on x0, on x_t (only the rows ``keep(gap, t, kind, style)`` accepts); plus
    ``num_random_times`` rows per (gap, kind, style) at times from :func:`random_times`."""
    g = torch.Generator().manual_seed(seed)
    mask_id = spec.mask_id(S)
    clean = [i for i in range(S) if i != mask_id]
    kinds = ["clean"] + (["mask"] if mask_id is not None else []) + (["noise"] if spec.kind != "mask" else [])
    x0s, xts, peaks, ts, gs, labels = [], [], [], [], [], []
    drawn = iter(random_times(len(gaps) * len(kinds) * 3 * num_random_times, g))
    slots = list(times) + [None] * num_random_times
    for gap in gaps:
        for slot in slots:
            for kind in kinds:
                for style in ("wrong", "x0", "xt"):
                    for _ in range(per_style):
                        t = next(drawn) if slot is None else slot
                        a, b, c = (clean[int(i)] for i in torch.randperm(len(clean), generator=g)[:3])
                        if keep is not None and not keep(gap, t, kind, style):
                            continue
                        x_t = a if kind == "clean" else (mask_id if kind == "mask" else b)
                        x0s.append(a), xts.append(x_t), ts.append(t), gs.append(gap)
                        peaks.append({"wrong": c, "x0": a, "xt": x_t}[style])
                        labels.append(f"gap={gap:g} t={t:.7g} {kind} peak-{style}")
    N = len(x0s)
    logits = 2.0 * torch.randn(N, S, generator=g, dtype=DT)
    logits[torch.arange(N), torch.tensor(peaks)] += torch.tensor(gs, dtype=DT)
    return Grid(logits, torch.tensor(x0s), torch.tensor(xts), torch.tensor(ts, dtype=DT), labels)


def reference(kernel, logits64, x0, x_t, t, weighting):
    """Float64 reference value ``(N,)`` and gradient ``(N, S)``."""
    l = logits64.clone().requires_grad_()
    loss = native.reference_gidd_loss(l, x0, x_t, t, kernel, weighting=weighting, max_weight=2.0)
    loss.sum().backward()
    return loss.detach(), l.grad


@dataclass
class Tol:
    """Per-row tolerances ``(N,)``: relative ``rtol``; absolute allowances of values and gradients (module
    docstring)."""

    rtol: torch.Tensor
    value_floor: torch.Tensor
    grad_floor: torch.Tensor


def float64_tol(n: int, rtol: float = RTOL64) -> Tol:
    zero = torch.zeros(n, dtype=DT)
    return Tol(torch.full((n,), rtol, dtype=DT), zero, zero)


def float32_tol(kernel, x0, x_t, t, weighting, ref_grad: torch.Tensor) -> Tol:
    """rtol 1e-6 and the subnormal allowances of the module docstring: values S · 2^{−149} · max(1, |w| m), with m the
    mass that multiplies the per-token terms (u, the uniform noise mass of a state, or α under the mask kernel),
    gradients S · 2^{−149} · max(1, 4 |w|) (the per-row factors of a gradient entry, A/s and (A c + H p_xt)/s, are
    at most 4 |w| in size); generator kernels (computed in float64 inside) take w = m = 1."""
    S, N = ref_grad.shape[-1], ref_grad.shape[0]
    w = mass = torch.ones(N, dtype=DT)
    if isinstance(kernel, uf.kernels.InterpolatingKernel):
        rows = prepare_x0_rows(kernel, None, x0, x_t, t, DT, torch.device("cpu"), weighting, 2.0)[0].tensors
        w, mass = rows.w_active.abs(), torch.where(rows.u > 0, rows.u, rows.alpha)
    unit = S * SUB32
    return Tol(torch.full((N,), RTOL32, dtype=DT), unit * (w * mass).clamp_min(1.0), unit * (4 * w).clamp_min(1.0))


def check(what: str, labels: list[str], loss, grad, ref_loss, ref_grad, tol: Tol, *, bf16_grad: bool = False):
    """Values: |L − L_ref| ≤ rtol |L_ref| + value_floor. Gradients, norm-wise per row: max_z |g_z − g_ref,z| ≤
    rtol max_z |g_ref,z| + grad_floor (bf16: each entry's own rounding first, module docstring)."""
    if not bool(torch.isfinite(loss).all()):
        pytest.fail(f"{what}: loss not finite at {labels[int((~torch.isfinite(loss)).nonzero()[0])]}")
    assert bool(torch.isfinite(grad).all()), f"{what}: gradient not finite"
    err = (loss.to(DT) - ref_loss).abs()
    bad = err > tol.rtol * ref_loss.abs() + tol.value_floor
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        pytest.fail(f"{what}: value at {labels[i]}: {float(loss[i]):.10e} vs {float(ref_loss[i]):.10e} "
                    f"(rel {float(err[i] / ref_loss[i].abs()):.2e}, rtol {float(tol.rtol[i]):.2e})")
    g_err = (grad.to(DT) - ref_grad).abs()
    if bf16_grad:
        g_err = (g_err - 2.0**-8 * ref_grad.abs() - 2.0**-134).clamp_min(0.0)
    g_err = g_err.amax(-1)
    scale = ref_grad.abs().amax(-1)
    bad = g_err > tol.rtol * scale + tol.grad_floor
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        pytest.fail(f"{what}: gradient at {labels[i]}: max error {float(g_err[i]):.3e} vs max entry "
                    f"{float(scale[i]):.3e} (rtol {float(tol.rtol[i]):.2e}, floor {float(tol.grad_floor[i]):.2e})")


# ---------------------------------------------------------------------------------------------------- (A) 50 digits
def mp_process(spec: Spec, S: int, t: float):
    """α_t, the noise masses m_t(y) and the forward rates into y, R_t(·, y) = m_t'(y) − (α_t'/α_t) m_t(y), from the
    schedule formulas in mpmath (rates by high-precision numerical differentiation)."""
    mask_id = spec.mask_id(S)

    def alpha_m(T):
        if spec.kind == "uniform":
            return 1 - T, [T / S] * S
        if spec.kind == "mask":
            return 1 - T, [T if y == mask_id else mpmath.mpf(0) for y in range(S)]
        B = mpmath.mpf(2) ** spec.gamma * spec.p / (1 - mpmath.mpf(spec.p))
        c = B * (T * (1 - T)) ** (mpmath.mpf(spec.gamma) / 2)
        return (1 - T) / (1 + c), [T / (1 + c) if y == mask_id else c / ((1 + c) * (S - 1)) for y in range(S)]

    T = mpmath.mpf(t)
    alpha, m = alpha_m(T)
    dlog_alpha = mpmath.diff(lambda s: mpmath.log(alpha_m(s)[0]), T)
    rates = [mpmath.diff(lambda s, y=y: alpha_m(s)[1][y], T) - dlog_alpha * m[y] for y in range(S)]
    return alpha, m, rates


def mp_dynamic_weight(spec: Spec, S: int, x0: int, x_t: int, t: float):
    """GIDD's dynamic weight as issue #13 states it (current GIDD code): 2 at the mask, 1 at a uniform-noise token,
    (B/S) · exp((γ/2) · sigmoid(−t)) at a clean token (uniform kernel: B = γ = 1; mask kernel: B = 0)."""
    if x_t == spec.mask_id(S):
        return mpmath.mpf(2)
    if x_t != x0:
        return mpmath.mpf(1)
    B, gamma = {"uniform": (1, 1), "mask": (0, 1)}.get(spec.kind, (None, None))
    if spec.kind == "hybrid":
        B, gamma = mpmath.mpf(2) ** spec.gamma * spec.p / (1 - mpmath.mpf(spec.p)), spec.gamma
    return mpmath.mpf(B) / S * mpmath.exp(mpmath.mpf(gamma) / 2 / (1 + mpmath.exp(mpmath.mpf(t))))


def mp_loss_and_grad(spec: Spec, S: int, logits_row, x0: int, x_t: int, t: float, process) -> dict:
    """w [Σ_y f(q0_y, qθ_y) + ρ − log ρ − 1] and its gradient in the logits, per weighting, in mpmath:
    ∂/∂l_z = p_z (G_z − Σ_y p_y G_y), G_y = w α (1 − q0_y/qθ_y) − [y = x_t] w α (ρ − 1)/qθ(x_t)."""
    mask_id = spec.mask_id(S)
    states = [y for y in range(S) if y != mask_id]
    z = {y: mpmath.mpf(float(logits_row[y])) for y in states}
    spread = float(max(z.values()) - min(z.values()))
    mpmath.mp.dps = 60 + min(int(0.9 * spread), 400)  # the loss of a confident model is ~e^{−2·gap}
    alpha, m, rates = process
    lse = mpmath.log(mpmath.fsum(mpmath.exp(v) for v in z.values()))
    p = [mpmath.exp(z[y] - lse) if y in z else mpmath.mpf(0) for y in range(S)]
    q0 = [alpha * (y == x0) + m[y] for y in range(S)]
    qt = [alpha * p[y] + m[y] for y in range(S)]
    f = mpmath.fsum((q0[y] * mpmath.log(q0[y] / qt[y]) if q0[y] > 0 else 0) - q0[y] + qt[y] for y in range(S))
    rho = q0[x_t] / qt[x_t]
    bracket = f + rho - mpmath.log(rho) - 1
    G = [alpha * (1 - q0[y] / qt[y]) - (alpha * (rho - 1) / qt[x_t] if y == x_t else 0) for y in range(S)]
    pG = mpmath.fsum(p[y] * G[y] for y in states)
    grad = [p[y] * (G[y] - pG) if y in z else mpmath.mpf(0) for y in range(S)]
    w_elbo = rates[x_t] / q0[x_t]
    out = {}
    for weighting, w in (("elbo", w_elbo), ("clip", min(w_elbo, 2)),
                         ("dynamic", min(mp_dynamic_weight(spec, S, x0, x_t, t), 2))):
        out[weighting] = (float(w * bracket), [float(w * gy) for gy in grad])
    return out


def mp_generator(spec: Spec, S: int, t: float):
    """A generator kernel's transition matrix P = exp(t R̄) (rows: from; no schedule, so σ(t) = t and R_t = R̄) in
    mpmath (60 digits) and R̄ itself."""
    mpmath.mp.dps = 60
    R = spec.generator(S)
    Rm = mpmath.matrix([[mpmath.mpf(float(R[i, j])) for j in range(S)] for i in range(S)])
    return mpmath.expm(mpmath.mpf(t) * Rm), Rm


def mp_generator_loss_and_grad(spec: Spec, S: int, logits_row, x0: int, x_t: int, process) -> dict:
    """D_t = Σ_{y≠x_t} R(y, x_t) f(r_y, s_y), r_y = q0(y)/q0(x_t), s_y = qθ(y)/qθ(x_t), q0 = P[x0, ·],
    qθ = Σ_w p_w P[w, ·], f(r, s) = r log(r/s) − r + s (Theorem 3.3; r = 0 where x_t is impossible under x0: the
    model's exit rate), and ∂/∂l_z = p_z Σ_y (∂D/∂qθ(y)) (P[z, y] − qθ(y)), in mpmath."""
    P, R = process
    mask_id = spec.mask_id(S)
    states = [y for y in range(S) if y != mask_id]
    z = {y: mpmath.mpf(float(logits_row[y])) for y in states}
    mpmath.mp.dps = 60 + min(int(0.9 * float(max(z.values()) - min(z.values()))), 400)
    lse = mpmath.log(mpmath.fsum(mpmath.exp(v) for v in z.values()))
    p = [mpmath.exp(z[y] - lse) if y in z else mpmath.mpf(0) for y in range(S)]
    q0 = [P[x0, y] for y in range(S)]
    qt = [mpmath.fsum(p[w] * P[w, y] for w in range(S)) for y in range(S)]
    loss, d_qt = mpmath.mpf(0), [mpmath.mpf(0)] * S  # ∂D/∂qθ(y)
    for y in range(S):
        if y == x_t or R[y, x_t] == 0:
            continue
        r = q0[y] / q0[x_t] if q0[x_t] > 0 else mpmath.mpf(0)
        s = qt[y] / qt[x_t]
        loss += R[y, x_t] * ((r * mpmath.log(r / s) if r > 0 else 0) - r + s)
        d_s = R[y, x_t] * (1 - r / s)
        d_qt[y] += d_s / qt[x_t]
        d_qt[x_t] -= d_s * s / qt[x_t]
    grad = [p[w] * mpmath.fsum(d_qt[y] * (P[w, y] - qt[y]) for y in range(S)) if w in z else mpmath.mpf(0)
            for w in range(S)]
    return {"elbo": (float(loss), [float(g) for g in grad])}


@pytest.mark.parametrize("name", list(SPECS))
def test_reference_equals_50_digit_closed_form(name):
    """(A): fixed times and one log-uniform random time per cell."""
    spec, S = SPECS[name], (12 if name in FAST_SPECS else 6)
    kernel = spec.kernel(S)
    G = grid(spec, S, gaps=(0.0, 20.0, 60.0, 87.0, 200.0, 1e4), num_random_times=1)
    if name in FAST_SPECS:
        processes = {t: mp_process(spec, S, t) for t in set(G.t.tolist())}
        exact = [mp_loss_and_grad(spec, S, G.logits[i], int(G.x0[i]), int(G.x_t[i]), float(G.t[i]),
                                  processes[float(G.t[i])]) for i in range(len(G.x0))]
    else:
        processes = {t: mp_generator(spec, S, t) for t in set(G.t.tolist())}
        exact = [mp_generator_loss_and_grad(spec, S, G.logits[i], int(G.x0[i]), int(G.x_t[i]),
                                            processes[float(G.t[i])]) for i in range(len(G.x0))]
    for weighting in spec.weightings:
        loss, grad = reference(kernel, G.logits, G.x0, G.x_t, G.t, weighting)
        ex_loss = torch.tensor([e[weighting][0] for e in exact], dtype=DT)
        ex_grad = torch.tensor([e[weighting][1] for e in exact], dtype=DT)
        check(f"reference {name} {weighting}", G.labels, loss, grad, ex_loss, ex_grad, float64_tol(len(G.x0), 1e-12))


# ---------------------------------------------------------------------------------------------------- (B) float64
def fused(logits, x0, x_t, t, kernel, weighting):
    """``fused_linear_diffusion_loss`` with hidden states I (N × N) and output matrix W = logitsᵀ: h Wᵀ = the logits,
    exactly, and ∂/∂W = (∂/∂logits)ᵀ."""
    eye = torch.eye(logits.shape[0], dtype=logits.dtype)
    return uf.losses.fused_linear_diffusion_loss(eye, logits.T, x0, x_t, t, kernel, weighting=weighting,
                                                 max_weight=2.0)


def x0_paths(kernel, weighting):
    """Every x0-head loss path taking logits ``(N, S)``: name → fn(logits, x0, x_t, t) → per-position loss."""
    out = {"gidd": lambda l, x0, x_t, t: uf.losses.gidd_loss(l, x0, x_t, t, kernel, weighting, 2.0),
           "fused": lambda l, x0, x_t, t: fused(l, x0, x_t, t, kernel, weighting),
           "reference": lambda l, x0, x_t, t: uf.losses.reference_gidd_loss(l, x0, x_t, t, kernel, weighting, 2.0)}
    if isinstance(kernel, uf.GeneratorKernel):  # the fast API falls back to the reference; no fused loss
        del out["fused"]
    if weighting == "elbo":
        for objective in ("sedd", "m2s", "ctmc"):
            out[objective] = (lambda obj: lambda l, x0, x_t, t: uf.losses.x0_head_loss(
                l, x0, x_t, t, kernel, objective=obj))(objective)
        if isinstance(kernel, uf.MaskKernel):
            out["mdlm"] = lambda l, x0, x_t, t: uf.losses.mdlm_loss(l, x0, x_t, t, kernel)
            out["reference_mdlm"] = lambda l, x0, x_t, t: uf.losses.reference_mdlm_loss(l, x0, x_t, t, kernel)
    return out


def run_path(fn, logits, dtype, G):
    l = logits.detach().to(dtype).clone().requires_grad_()
    loss = fn(l, G.x0, G.x_t, G.t.to(torch.float32) if dtype != DT else G.t)
    loss.sum().backward()
    return loss.detach(), l.grad


NUM_RANDOM_TIMES = 3  # per (gap, kind, style) cell of the (B) and (C) sweeps


@pytest.mark.parametrize("name", list(SPECS))
def test_float64_paths_equal_reference(name):
    spec, S = SPECS[name], sweep_states(name)
    kernel = spec.kernel(S)
    G = grid(spec, S, num_random_times=NUM_RANDOM_TIMES)
    for weighting in spec.weightings:
        ref_loss, ref_grad = reference(kernel, G.logits, G.x0, G.x_t, G.t, weighting)
        for path, fn in x0_paths(kernel, weighting).items():
            if path == "reference":
                continue
            loss, grad = run_path(fn, G.logits, DT, G)
            assert loss.dtype == DT
            check(f"{path} float64 {name} {weighting}", G.labels, loss, grad, ref_loss, ref_grad,
                  float64_tol(len(G.x0), 1e-10))


# ---------------------------------------------------------------------------------------------------- (C) float32/bf16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(SPECS))
def test_low_precision_logits_equal_float64_reference(dtype, name):
    spec, S = SPECS[name], sweep_states(name)
    kernel = spec.kernel(S)
    G = grid(spec, S, num_random_times=NUM_RANDOM_TIMES)
    logits = G.logits.to(dtype).to(DT)  # the reference sees exactly the low-precision logits
    t32 = G.t.to(torch.float32).to(DT)
    for weighting in spec.weightings:
        ref_loss, ref_grad = reference(kernel, logits, G.x0, G.x_t, t32, weighting)
        tol = float32_tol(kernel, G.x0, G.x_t, t32, weighting, ref_grad)
        for path, fn in x0_paths(kernel, weighting).items():
            loss, grad = run_path(fn, logits, dtype, G)
            assert loss.dtype == torch.float32 and grad.dtype == dtype
            check(f"{path} {dtype} {name} {weighting}", G.labels, loss, grad, ref_loss, ref_grad, tol,
                  bf16_grad=dtype == torch.bfloat16)


# ---------------------------------------------------------------------------------------------------- own heads
def own_heads(spec: Spec, S: int, gaps=(0.0, 20.0, 87.0, 200.0, 1e4), seed: int = 1):
    """Rows of extreme SEDD / M2S / CTMC heads: log scores with the x0 entry at −gap ("low") or a wrong entry at
    +min(gap, 60) ("high": R e^60 is still a float32); posterior-mean logits peaked by gap on a wrong token / x0 /
    x_t; log exit rates −gap / 0 / +min(gap, 60) with jump logits peaked by gap on a wrong token / x0."""
    G = grid(spec, S, gaps=gaps, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    N = len(G.x0)
    gap = torch.tensor([float(lab.split()[0][4:]) for lab in G.labels], dtype=DT)
    style = torch.arange(N) % 3
    wrong = (G.x0 + 1 + torch.randint(0, S - 2, (N,), generator=g)) % S
    mask_id = spec.mask_id(S)
    if mask_id is not None:  # a clean wrong token ≠ x0
        wrong = torch.where(wrong == mask_id, (wrong + 1) % S, wrong)
        wrong = torch.where(wrong == G.x0, (wrong + 1) % S, wrong)
        wrong = torch.where(wrong == mask_id, (wrong + 1) % S, wrong)
    rows = torch.arange(N)
    log_score = 2.0 * torch.randn(N, S, generator=g, dtype=DT)
    high = torch.clamp(gap, max=60.0)
    log_score[rows, torch.where(style == 0, G.x0, wrong)] += torch.where(style == 0, -gap, high)
    log_exit = torch.where(style == 0, -gap, torch.where(style == 1, torch.zeros_like(gap), high))
    jump = 2.0 * torch.randn(N, S, generator=g, dtype=DT)
    jump[rows, torch.where(style == 2, G.x0, wrong)] += gap
    return G, {"sedd": (log_score,), "m2s": (G.logits,), "ctmc": (log_exit, jump)}


def mp_own_loss_and_grad(objective: str, spec: Spec, S: int, heads, x0: int, x_t: int, process):
    """The native loss of the objective's own head and its gradient in each head tensor, in mpmath (App. A):
    SEDD Σ_{y≠x_t} R [s − r log s + r (log r − 1)]; M2S the same with s = B_{x_t,t} μ; CTMC KL_Poi(λ̂ ‖ λ) +
    λ̂ KL_Cat(r̂ ‖ r_θ); R = R_t(·, x_t), r_y = q_{t|0}(y|x0)/q_{t|0}(x_t|x0)."""
    mask_id = spec.mask_id(S)
    alpha, m, rates = process
    mpmath.mp.dps = 60 + min(int(0.9 * max(float(h.abs().max()) for h in heads)), 400)
    q0 = [alpha * (y == x0) + m[y] for y in range(S)]
    r = [q0[y] / q0[x_t] for y in range(S)]
    R = [rates[x_t] if y != x_t else mpmath.mpf(0) for y in range(S)]

    def h(s, r_):
        return s - (r_ * mpmath.log(s) - r_ * (mpmath.log(r_) - 1) if r_ > 0 else 0)

    zero = [mpmath.mpf(0)] * S
    if objective == "sedd":
        s = [mpmath.exp(mpmath.mpf(float(v))) for v in heads[0]]
        loss = mpmath.fsum(R[y] * h(s[y], r[y]) for y in range(S) if R[y] > 0)
        return float(loss), ([float(R[y] * (s[y] - r[y])) for y in range(S)],)
    if objective == "m2s":
        states = [z for z in range(S) if z != mask_id]
        z_ = {z: mpmath.mpf(float(heads[0][z])) for z in states}
        lse = mpmath.log(mpmath.fsum(mpmath.exp(v) for v in z_.values()))
        mu = {z: mpmath.exp(v - lse) for z, v in z_.items()}
        if not any(v > 0 for v in R):
            return 0.0, ([0.0] * S,)
        col = {z: alpha * (z == x_t) + m[x_t] for z in states}  # q_{t|0}(x_t | z)
        s = [mpmath.fsum(mu[z] * (alpha * (y == z) + m[y]) / col[z] for z in states) for y in range(S)]
        loss = mpmath.fsum(R[y] * h(s[y], r[y]) for y in range(S) if R[y] > 0)
        dmu = {z: mpmath.fsum(R[y] * (1 - r[y] / s[y]) * (alpha * (y == z) + m[y]) / col[z]
                              for y in range(S) if R[y] > 0) for z in states}
        mean = mpmath.fsum(mu[z] * dmu[z] for z in states)
        return float(loss), ([float(mu[z] * (dmu[z] - mean)) if z in mu else 0.0 for z in range(S)],)
    lam_hat = mpmath.fsum(R[y] * r[y] for y in range(S))
    lam = mpmath.exp(mpmath.mpf(float(heads[0])))
    targets = [y for y in range(S) if y != x_t]
    jl = {y: mpmath.mpf(float(heads[1][y])) for y in targets}
    lse = mpmath.log(mpmath.fsum(mpmath.exp(v) for v in jl.values()))
    r_theta = {y: mpmath.exp(v - lse) for y, v in jl.items()}
    loss = lam
    if lam_hat > 0:
        r_hat = {y: R[y] * r[y] / lam_hat for y in targets}
        kl = mpmath.fsum(r_hat[y] * mpmath.log(r_hat[y] / r_theta[y]) for y in targets if r_hat[y] > 0)
        loss = lam_hat * mpmath.log(lam_hat / lam) - lam_hat + lam + lam_hat * kl
        g_jump = [float(lam_hat * (r_theta[y] - r_hat[y])) if y != x_t else 0.0 for y in range(S)]
    else:
        g_jump = list(map(float, zero))
    return float(loss), ([float(lam - lam_hat)], g_jump)


NATIVE = {"sedd": native.sedd_loss, "m2s": native.m2s_loss, "ctmc": native.ctmc_loss}


@pytest.mark.parametrize("objective", ["sedd", "m2s", "ctmc"])
def test_native_losses_of_their_own_heads_equal_50_digit_closed_forms(objective):
    """The published SEDD / M2S / Neural-CTMC losses fed their own extreme heads (not converted from an x0 head):
    float64 ≤ 1e-10 of the 60-digit value and gradient (of each head tensor, norm-wise per row); float32 and bf16 heads
    (the losses compute in float64) ≤ 1e-6 of the float64 loss of the same rounded heads, with the allowances of the
    module docstring (bf16 gradients' own rounding; results below 2^{−126}). One more: CTMC's gradient in log λ is
    λ − λ̂, and λ̂ (the true exit rate, a sum of float64 rates) is only known to its rounding, so that entry gets 8 ulp
    of λ + λ̂ (used where λ ≈ λ̂: a gradient of 8.6e-7 from λ = 1 carries 3e-16)."""
    S = 8
    for name in ("uniform", "mask", "mask_middle", "hybrid_g2", "gidd_default"):
        spec = SPECS[name]
        kernel = spec.kernel(S)
        G, heads = own_heads(spec, S)
        heads = heads[objective]
        processes = {t: mp_process(spec, S, t) for t in TIMES}
        exact = [mp_own_loss_and_grad(objective, spec, S, [h[i] for h in heads], int(G.x0[i]), int(G.x_t[i]),
                                      processes[float(G.t[i])]) for i in range(len(G.x0))]
        ex_loss = torch.tensor([e[0] for e in exact], dtype=DT)
        ex_grads = [torch.tensor([e[1][k] for e in exact], dtype=DT).reshape(heads[k].shape) for k in range(len(heads))]
        for dtype in (DT, torch.float32, torch.bfloat16):
            hs = [h.detach().to(dtype).clone().requires_grad_() for h in heads]
            if dtype == DT:
                ref_loss, ref_grads = ex_loss, ex_grads
            else:  # the float64 loss (just checked against 50 digits) of the same rounded heads
                hs64 = [h.detach().to(DT).requires_grad_() for h in hs]
                ref_loss = NATIVE[objective](*hs64, G.x0, G.x_t, G.t, kernel)
                ref_loss.sum().backward()
                ref_loss, ref_grads = ref_loss.detach(), [h.grad for h in hs64]
            loss = NATIVE[objective](*hs, G.x0, G.x_t, G.t, kernel)
            loss.sum().backward()
            for k, h in enumerate(hs):
                grad, ref_grad = h.grad, ref_grads[k]
                if grad.dim() == 1:  # CTMC's log λ
                    grad, ref_grad = grad[:, None], ref_grad[:, None]
                tol_k = (float64_tol(len(G.x0)) if dtype == DT
                         else float32_tol(kernel, G.x0, G.x_t, G.t, "elbo", ref_grad))
                if k == 0 and objective == "ctmc":
                    lam_hat = uf.ReverseRate.true_conditional(kernel, G.x0, G.x_t, G.t).exit_rate
                    floor = 8 * torch.finfo(DT).eps * (heads[0].exp() + lam_hat)
                    tol_k = Tol(tol_k.rtol, tol_k.value_floor, torch.maximum(tol_k.grad_floor, floor))
                check(f"native {objective} {name} {dtype} head {k}", G.labels, loss.detach(), grad, ref_loss,
                      ref_grad, tol_k, bf16_grad=dtype == torch.bfloat16)


# ---------------------------------------------------------------------------------------------------- diffusion_loss
DL_GAPS = (0.0, 20.0, 60.0, 87.0, 200.0, 1e4)


def fake_model(spec: Spec, S: int, dtype: torch.dtype, seed: int = 0):
    """A model returning fixed extreme logits ``(3, L, S)``: for each gap, two positions peaked on a wrong token, two
    on x0 and two on whatever x_t the corruption drew (added at call time). Returns (leaf logits, model, x0, t)."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.tensor([i for i in range(S) if i != spec.mask_id(S)])
    B, L = len(TIMES), 6 * len(DL_GAPS)
    x0 = clean[torch.randint(0, len(clean), (B, L), generator=g)]
    wrong = clean[torch.randint(0, len(clean), (B, L), generator=g)]
    gap = torch.tensor(DL_GAPS, dtype=DT).repeat_interleave(6).expand(B, L)
    style = (torch.arange(L) % 3).expand(B, L)
    base = 2.0 * torch.randn(B, L, S, generator=g, dtype=DT)
    peak = torch.nn.functional.one_hot(torch.where(style == 0, wrong, x0), S)
    base = (base + torch.where(style < 2, gap, 0.0)[..., None] * peak).to(dtype).requires_grad_()
    at_xt = torch.where(style == 2, gap, 0.0).to(dtype)[..., None]

    def model(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return base + at_xt * torch.nn.functional.one_hot(x_t, S).to(dtype)

    return base, model, x0, torch.tensor(TIMES, dtype=torch.float32)


@pytest.mark.parametrize("name", ["uniform", "mask_middle", "hybrid_g2", "gidd_default"])
def test_diffusion_loss_with_extreme_logits(name):
    """``diffusion_loss`` (x0 head: every objective and weighting, float32 and bf16 logits) equals the float64
    reference on the logits the model returned and the x_t it drew, with the tolerances of (C), validation on."""
    spec, S = SPECS[name], 40
    kernel = spec.kernel(S)
    runs = [("gidd", w) for w in WEIGHTINGS] + [(o, "elbo") for o in ("sedd", "m2s", "ctmc")]
    if spec.kind == "mask":
        runs.append(("mdlm", "elbo"))
    for dtype in (torch.float32, torch.bfloat16):
        for objective, weighting in runs:
            base, model, x0, t = fake_model(spec, S, dtype)
            out = uf.diffusion_loss(model, x0, kernel, objective=objective, weighting=weighting, t=t,
                                    generator=torch.Generator().manual_seed(1))
            out.loss.sum().backward()
            logits = model(out.x_t, t).detach().to(DT).reshape(-1, S)
            x0_, x_t_ = x0.reshape(-1), out.x_t.reshape(-1)
            t_ = t.to(DT)[:, None].expand_as(x0).reshape(-1)
            ref_loss, ref_grad = reference(kernel, logits, x0_, x_t_, t_, weighting)
            labels = [f"seq t={float(t[i // x0.shape[1]]):.7g} gap={DL_GAPS[(i % x0.shape[1]) // 6]:g} "
                      f"style={('wrong', 'x0', 'xt')[i % 3]}" for i in range(len(x0_))]
            check(f"diffusion_loss {objective} {weighting} {dtype} {name}", labels, out.loss.reshape(-1),
                  base.grad.reshape(-1, S), ref_loss, ref_grad,
                  float32_tol(kernel, x0_, x_t_, t_, weighting, ref_grad), bf16_grad=dtype == torch.bfloat16)


@pytest.mark.parametrize("name", ["uniform", "mask", "hybrid_g2", "gidd_default"])
def test_diffusion_loss_converted_head_references_with_extreme_logits(name):
    """``diffusion_loss(reference=True)``: the x0 head converted into each objective's own head (Theorem 3.5, in
    log space) and scored by the published loss — finite, and equal to D_t (the float64 GIDD ELBO) for every
    objective (Corollary 3.4). The converted SEDD score and CTMC rates are float64 numbers: each log entry carries
    ~1 ulp, and near the optimum (a confidently right model) the loss is quadratic in that error, so these two get
    |ΔL| ≤ 1e-10 L + √(2 L M) + M with M = (16 ε₆₄)² (λ̂ + λ_θ) (the true and the model's exit rates), gradients
    ε₆₄ (λ̂ + λ_θ); used up to c = 8 of the 16 and 0.25 of the 1. CTMC's converted head gives a row without jumps
    (an unmasked token under the mask kernel) an exit rate e^{−80} (``unifusion.training``), so its loss is e^{−80}
    where D_t is 0. The M2S, GIDD and MDLM references match without an allowance."""
    spec, S = SPECS[name], 40
    kernel = spec.kernel(S)
    eps = torch.finfo(DT).eps
    objectives = ["gidd", "sedd", "m2s", "ctmc"] + (["mdlm"] if spec.kind == "mask" else [])
    for objective in objectives:
        base, model, x0, t = fake_model(spec, S, DT)
        out = uf.diffusion_loss(model, x0, kernel, objective=objective, t=t, reference=True,
                                generator=torch.Generator().manual_seed(1))
        out.loss.sum().backward()
        logits = model(out.x_t, t).detach().reshape(-1, S)
        x0_, x_t_ = x0.reshape(-1), out.x_t.reshape(-1)
        t_ = t.to(DT)[:, None].expand_as(x0).reshape(-1)
        ref_loss, ref_grad = reference(kernel, logits, x0_, x_t_, t_, "elbo")
        tol = float64_tol(len(x0_), 1e-10)
        if objective in ("sedd", "ctmc"):
            lam = (uf.ReverseRate.true_conditional(kernel, x0_, x_t_, t_).exit_rate
                   + uf.ReverseRate.from_x0_logits(kernel, logits, x_t_, t_).exit_rate)
            M = (16 * eps) ** 2 * lam
            tol.value_floor = torch.sqrt(2 * ref_loss.abs() * M) + M + (math.exp(-80) if objective == "ctmc" else 0)
            tol.grad_floor = eps * lam
        labels = [f"seq t={float(t[i // x0.shape[1]]):.7g} gap={DL_GAPS[(i % x0.shape[1]) // 6]:g}"
                  for i in range(len(x0_))]
        check(f"diffusion_loss(reference=True) {objective} {name}", labels, out.loss.reshape(-1),
              base.grad.reshape(-1, S), ref_loss, ref_grad, tol)


# ---------------------------------------------------------------------------------------------------- (D) S = 262,144
LARGE_ROWS = {(1e4, TIMES[0], "wrong"): ("mask", "noise"), (20.0, TIMES[2], "x0"): ("clean",),
              (87.0, TIMES[2], "x0"): ("mask", "noise"), (60.0, TIMES[1], "xt"): ("noise", "clean"),
              (0.0, TIMES[1], "wrong"): ("mask", "noise")}
LARGE_SPECS = ("uniform", "mask", "hybrid", "gidd_default")


@pytest.mark.parametrize("name", LARGE_SPECS)
def test_large_vocabulary(name):
    """S = 262,144, a few rows (confidently wrong by 10⁴ at t = 1e-6, confidently right by 20 and 87 nats near t = 1,
    peaked on x_t by 60 and random at t = 1/2): fast and fused losses with float32 logits and every weighting, bf16
    logits with one weighting per kernel (in turn), MDLM's loss on the mask kernel, against the float64 reference."""
    spec, S = SPECS[name], 262_144
    kernel = spec.kernel(S)
    G = grid(spec, S, gaps=(0.0, 20.0, 60.0, 87.0, 1e4),
             keep=lambda gap, t, kind, style: kind in LARGE_ROWS.get((gap, t, style), ()))
    bf16_weighting = WEIGHTINGS[LARGE_SPECS.index(name) % len(WEIGHTINGS)]
    for dtype, weighting in [(torch.float32, w) for w in WEIGHTINGS] + [(torch.bfloat16, bf16_weighting)]:
        logits = G.logits.to(dtype).to(DT)
        ref_loss, ref_grad = reference(kernel, logits, G.x0, G.x_t, G.t, weighting)
        paths = {"gidd": lambda l, x0, x_t, t, w=weighting: uf.losses.gidd_loss(l, x0, x_t, t, kernel, w, 2.0),
                 "fused": lambda l, x0, x_t, t, w=weighting: fused(l, x0, x_t, t, kernel, w)}
        if weighting == "elbo" and spec.kind == "mask":
            paths["mdlm"] = lambda l, x0, x_t, t: uf.losses.mdlm_loss(l, x0, x_t, t, kernel)
        for path, fn in paths.items():
            loss, grad = run_path(fn, logits, dtype, G)
            check(f"S=262144 {path} {dtype} {name} {weighting}", G.labels, loss, grad, ref_loss, ref_grad,
                  float32_tol(kernel, G.x0, G.x_t, G.t, weighting, ref_grad),
                  bf16_grad=dtype == torch.bfloat16)


# ---------------------------------------------------------------------------------------------------- (E) compiled
def test_compiled_backend():
    """The compiled (Inductor) kernels on the configurations every compiled test shares (tests/conftest.py): uniform
    noise with a mask column inside the logits (GIDD's default hybrid, mask in the middle) and the mask kernel (mask
    last, sliced off), float32 logits; the fast loss (its forward keeps statistics, its backward is the gradient
    pass), the fused loss (its forward computes loss and gradient in one call, in place) and MDLM's; every weighting
    (the weights are per-row inputs of the same compiled code) against the float64 reference."""
    with uf.backend.using("compiled"):
        for name in ("gidd_default", "mask"):
            spec, S, dtype = SPECS[name], 1000, torch.float32
            kernel = spec.kernel(S)
            G = grid(spec, S, gaps=(0.0, 20.0, 87.0, 90.0, 1e4))
            logits = G.logits.to(dtype).to(DT)
            for weighting in WEIGHTINGS:
                ref_loss, ref_grad = reference(kernel, logits, G.x0, G.x_t, G.t, weighting)
                paths = {p: fn for p, fn in x0_paths(kernel, weighting).items() if p in ("gidd", "fused", "mdlm")}
                for path, fn in paths.items():
                    loss, grad = run_path(fn, logits, dtype, G)
                    check(f"compiled {path} {dtype} {name} {weighting}", G.labels, loss, grad, ref_loss, ref_grad,
                          float32_tol(kernel, G.x0, G.x_t, G.t, weighting, ref_grad))
        assert uf.backend.get_backend() == "compiled"  # no compiler failure served a call eagerly


# ---------------------------------------------------------------------------------------------------- (F) equal logits
def test_equal_logits_do_not_average_the_rounding_out():
    """Rows whose logits are all equal but for the maximum (a padded vocabulary; a model that has learnt nothing but
    one token): every P_y = e^{c − M} carries the same rounding of c − M, so a float32 softmax is off by 2^{−24}|c − M|
    in every sum (the random grid averages such errors out). float32 logits (the rounding compensated): 1e-6 as
    everywhere (the uncompensated kernel measured 2.1e-6 here). bf16 logits are not compensated: c − M is exact in
    float32 unless c or M is within 2^{−16}|c − M| of zero, the rows with c = ±1.0078125 · 2^{−13}/2^{−14} (a logit
    of 6e-5 next to a maximum of 40) are such a case, measured 2.1e-6 (values) off, within 2^{−24}|c − M| + 1e-6 (the
    bound the rounding gives, asserted for them); every other bf16 row is held to 1e-6."""
    S = 1000
    rows = [(40.0, 1.5), (40.0, 2.0**-14 * 1.0078125), (20.0, -7.3), (30.0, -1e-5), (24.0, 2.0**-13 * 1.0078125),
            (2.0**-13 * 1.0078125, -45.0), (3.0, -19.0)]
    for name in ("uniform", "mask", "hybrid", "gidd_default"):
        spec = SPECS[name]
        kernel = spec.kernel(S)
        mask_id = spec.mask_id(S)
        kinds = ["clean"] + (["mask"] if mask_id is not None else []) + (["noise"] if spec.kind != "mask" else [])
        for kind in kinds:
            logits = torch.tensor([[c] * S for _, c in rows], dtype=DT)
            logits[:, 3] = torch.tensor([m for m, _ in rows], dtype=DT)
            N = len(rows)
            x0 = torch.full((N,), 3)
            x_t = x0 if kind == "clean" else torch.full((N,), mask_id if kind == "mask" else 5)
            t = torch.full((N,), 0.5, dtype=DT)
            G = Grid(logits, x0, x_t, t, [f"{kind} max={m:g} others={c:g}" for m, c in rows])
            for dtype in (torch.float32, torch.bfloat16):
                rounded = logits.to(dtype).to(DT)
                ref_loss, ref_grad = reference(kernel, rounded, x0, x_t, t, "elbo")
                tol = float32_tol(kernel, x0, x_t, t, "elbo", ref_grad)
                if dtype == torch.bfloat16:  # c − M inexact in float32: |c| or |M| below 2^{−16} |c − M|
                    c, m = rounded[:, 0], rounded[:, 3]
                    d = (c - m).abs()
                    inexact = (torch.minimum(c.abs(), m.abs()) < 2.0**-16 * d) & (c != 0) & (m != 0)
                    tol.rtol = torch.where(inexact, RTOL32 + 2.0**-24 * d.clamp(max=104.0), tol.rtol)
                for path in ("gidd", "fused"):
                    loss, grad = run_path(x0_paths(kernel, "elbo")[path], rounded, dtype, G)
                    check(f"equal logits {path} {dtype} {name}", G.labels, loss, grad, ref_loss, ref_grad, tol,
                          bf16_grad=dtype == torch.bfloat16)


# ---------------------------------------------------------------------------------------------------- validation
def test_validation_does_not_blame_finite_logits():
    """With validation on, finite logits are never reported as "contains NaN": a loss spike (−log p = 86.9 at
    t = 1/2 under the mask kernel, the issue's example) is a number for gidd_loss, mdlm_loss and diffusion_loss, and so
    is every row of the extreme grid."""
    kernel = uf.MaskKernel(50, 49)
    logits = torch.zeros(1, 50)
    logits[0, 1] = 86.9
    expected = 2 * (86.9 + math.log1p(48 * math.exp(-86.9)))  # w = 1/(1 − t) = 2 on a mask, x_θ over 49 states
    with uf.validation.validation(True):
        for fn in (uf.losses.gidd_loss, uf.losses.mdlm_loss):
            loss = fn(logits, torch.tensor([0]), torch.tensor([49]), 0.5, kernel)
            assert math.isfinite(float(loss)) and float(loss) == pytest.approx(expected, rel=1e-6)
        out = uf.diffusion_loss(lambda x_t, t: logits.expand(1, 1, 50), torch.tensor([[0]]), kernel, objective="mdlm",
                                t=torch.tensor([0.5]), generator=torch.Generator().manual_seed(0))
        assert float(out.loss) in (0.0, pytest.approx(expected, rel=1e-6))  # x_t masked or not
        spec = SPECS["mask_middle"]
        K = spec.kernel(40)
        G = grid(spec, 40)
        for weighting in WEIGHTINGS:
            assert bool(torch.isfinite(uf.losses.gidd_loss(G.logits.float(), G.x0, G.x_t, G.t, K, weighting)).all())
        assert bool(torch.isfinite(uf.losses.mdlm_loss(G.logits.float(), G.x0, G.x_t, G.t, K)).all())
        base, model, x0, t = fake_model(spec, 40, torch.float32)
        for objective in ("gidd", "mdlm"):
            out = uf.diffusion_loss(model, x0, K, objective=objective, t=t, generator=torch.Generator().manual_seed(1))
            assert bool(torch.isfinite(out.loss).all())
