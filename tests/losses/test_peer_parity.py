"""unifusion against the published implementations: GIDD, SEDD, MDLM and DUO.

``tests/data/peers/reference_values.json`` holds small explicit cases whose outputs were computed by each peer's own
code (float64), next to 50-digit closed forms of the losses (``exact``) — provenance, layout and every convention in
``tests/data/peers/README.md``. Each output is mapped onto unifusion's public API (the README's table) and must agree
to ≤ 1e-10 relative with the exact value (float64), and with the peer's own number to max(1e-10, 2 × the peer's own
float64 deviation from the exact value), which matters only near t → 1 where the peers lose digits themselves.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mpmath
import pytest
import torch

import unifusion as uf
from unifusion.samplers._step import posterior_mixture
from unifusion.samplers.euler import clean_distribution_from_head, euler_step_probs, reverse_rate_from_head

DATA = json.loads((Path(__file__).parents[1] / "data" / "peers" / "reference_values.json").read_text())
CASES = {c["id"]: c for c in DATA["cases"]}
DT = torch.float64
TOL = 1e-10


def _ids(family: str) -> list[str]:
    return [i for i, c in CASES.items() if c["family"] == family]


def schedule_of(spec: dict, *, duo_as_published: bool = False) -> uf.schedules.Schedule | None:
    """The unifusion schedule a case's ``unifusion.schedule`` block names (``None``: built into the kernel)."""
    name = spec["name"]
    if name.startswith("built into"):
        return None
    if name == "LogLinearSchedule":
        return uf.schedules.LogLinearSchedule(eps=spec["eps"])
    if name.startswith("geometric"):
        return uf.schedules.GeometricSchedule(sigma_min=spec["sigma_min"], sigma_max=spec["sigma_max"])
    if name.startswith("mdlm_cosine"):
        return uf.schedules.MDLMCosineSchedule(eps=spec["eps"])
    if name.startswith("duo_cosine"):
        return uf.schedules.DUOCosineSchedule(eps=spec["eps"], chain_factor=not duo_as_published)
    raise AssertionError(name)


def kernel_of(case: dict, *, duo_as_published: bool = False) -> uf.Kernel:
    k = case["unifusion"]["kernel"]
    schedule = schedule_of(case["unifusion"]["schedule"], duo_as_published=duo_as_published)
    if k["kind"] == "HybridKernel":
        return uf.HybridKernel(k["num_states"], k["mask_id"], k["p_uniform"], k["gamma"])
    if k["kind"] == "MaskKernel":
        return uf.MaskKernel(k["num_states"], k["mask_id"], schedule)
    assert k["kind"] == "UniformKernel"
    return uf.UniformKernel(k["num_states"], schedule)


def inputs_of(case: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    inp = case["inputs"]
    return torch.tensor(inp["x0"]), torch.tensor(inp["x_t"]), inp["t"]


def head_of(case: dict, key: str = "logits") -> torch.Tensor:
    return torch.tensor(case["inputs"][key], dtype=DT)


def assert_matches(got: torch.Tensor, case: dict, output: str, *, exact: object = None, scale: float = 1.0) -> None:
    """``got`` equals the exact value (≤ 1e-10 relative) and the peer's output (≤ max(1e-10, 2 × peer deviation))."""
    peer = torch.tensor(case["outputs"][output], dtype=DT)
    got = got.to(DT)
    if exact is None and output in case.get("exact", {}):
        exact = case["exact"][output]
    if exact is not None:
        torch.testing.assert_close(got, torch.as_tensor(exact, dtype=DT) * scale, rtol=TOL, atol=0.0)
    tol = max(TOL, 2.0 * case["peer_rel_dev_from_exact"].get(output, 0.0))
    torch.testing.assert_close(got, peer * scale, rtol=tol, atol=0.0)


def schedule_exact(case: dict, t: float) -> dict[str, float]:
    """σ, dσ/dt, 1 − α and α' of the case's schedule at ``t`` in 50 digits (independent of both codes)."""
    mpmath.mp.dps = 50
    spec, T = case["unifusion"]["schedule"], mpmath.mpf(t)
    pi = mpmath.pi
    if spec["name"] == "LogLinearSchedule":
        eps = mpmath.mpf(spec["eps"])
        alpha, dalpha = 1 - (1 - eps) * T, -(1 - eps)
    elif spec["name"].startswith("geometric"):
        lo, hi = mpmath.mpf(spec["sigma_min"]), mpmath.mpf(spec["sigma_max"])
        sigma = lo ** (1 - T) * hi**T
        alpha, dalpha = mpmath.exp(-sigma), -sigma * mpmath.log(hi / lo) * mpmath.exp(-sigma)
    elif spec["name"].startswith("mdlm_cosine"):
        eps = mpmath.mpf(spec["eps"])
        alpha, dalpha = eps + (1 - eps) * mpmath.cos(pi * T / 2), -(1 - eps) * pi / 2 * mpmath.sin(pi * T / 2)
    else:
        eps = mpmath.mpf(spec["eps"])
        tp = (1 - eps) * T
        alpha, dalpha = 1 - mpmath.sin(pi * tp / 2), -(1 - eps) * pi / 2 * mpmath.cos(pi * tp / 2)
    return {"sigma": float(-mpmath.log(alpha)), "dsigma": float(-dalpha / alpha), "one_minus_alpha": float(1 - alpha),
            "alpha": float(alpha), "alpha_prime": float(dalpha)}


def assert_schedule_output(got: torch.Tensor, exact: float, case: dict, output: str) -> None:
    """A schedule quantity vs its 50-digit value (≤ 1e-10) and vs the peer's float64 output, which may carry the
    rounding of 1 − α or −log α near α = 1: up to ~1e-16 absolute, so within max(1e-10, 4e-16 / |value|)."""
    torch.testing.assert_close(got.to(DT), torch.tensor(exact, dtype=DT), rtol=TOL, atol=0.0)
    peer = torch.tensor(case["outputs"][output], dtype=DT)
    torch.testing.assert_close(got.to(DT), peer, rtol=max(TOL, 4e-16 / abs(exact)), atol=0.0)


def x0_probs(case: dict, kernel: uf.Kernel) -> torch.Tensor:
    """x_θ = softmax over the non-mask states (GIDD sets the mask logit to −∞, MDLM lowers it by 10⁶)."""
    z = head_of(case).clone()
    if kernel.mask_id is not None:
        z[:, kernel.mask_id] = -math.inf
    return z.softmax(-1)


# ---------------------------------------------------------------------------------------------------- GIDD
@pytest.mark.parametrize("case_id", _ids("gidd_hybrid"))
@pytest.mark.parametrize("weighting, output", [("elbo", "elbo"), ("clip", "loss_clip"), ("dynamic", "loss_dynamic")])
def test_gidd_losses(case_id, weighting, output):
    case = CASES[case_id]
    K, (x0, x_t, t) = kernel_of(case), inputs_of(case)
    for loss_fn in (uf.losses.gidd_loss, uf.losses.reference_gidd_loss):
        loss = loss_fn(head_of(case), x0, x_t, t, K, weighting=weighting, max_weight=2.0)
        assert_matches(loss, case, output)
        if weighting == "dynamic":  # GIDD's training loss: the token mean over all positions, for both paths
            exact_mean = torch.tensor(case["exact"][output], dtype=DT).mean()
            assert_matches(loss.mean(), case, "loss_dynamic_tokenmean", exact=exact_mean)


@pytest.mark.parametrize("case_id", _ids("gidd_hybrid"))
def test_gidd_weights(case_id):
    case = CASES[case_id]
    K, (x0, x_t, t) = kernel_of(case), inputs_of(case)
    t_ = torch.tensor(t, dtype=DT)
    source = (x_t + 1) % K.num_states  # any source ≠ x_t: the rate into x_t is the same from all of them
    rate = K.rate_into(x_t, t_).gather(-1, source[:, None]).squeeze(-1)
    elbo_weight = rate / K.marginal(x0, t_).gather(-1, x_t[:, None]).squeeze(-1)
    assert_matches(elbo_weight, case, "elbo_weight")
    exact_clip = torch.tensor(case["exact"]["elbo_weight"], dtype=DT).clamp(0.0, 2.0)
    # the same weights from the public weight function (what gidd_loss multiplies its bracket with)
    assert_matches(uf.losses.gidd_loss_weight(x0, x_t, t, K, "elbo"), case, "elbo_weight")
    assert_matches(uf.losses.gidd_loss_weight(x0, x_t, t, K, "clip", max_weight=2.0), case, "clip_weight",
                   exact=exact_clip)
    assert_matches(uf.losses.gidd_loss_weight(x0, x_t, t, K, "dynamic", max_weight=2.0), case, "dynamic_weight")


@pytest.mark.parametrize("case_id", _ids("gidd_hybrid"))
def test_gidd_marginal_and_denoising_step(case_id):
    case = CASES[case_id]
    K, (x0, x_t, t) = kernel_of(case), inputs_of(case)
    t_, s_ = torch.tensor(t, dtype=DT), torch.tensor(case["inputs"]["s"], dtype=DT)
    marginal = K.marginal(x0, t_)
    assert_matches(marginal, case, "marginal_q_t_given_x0")
    assert_matches(K.posterior(x0_probs(case, K), x_t, s_, t_), case, "denoising_step_q_s_given_x_t")
    # α_t = q_{t|0}(y|y) − q_{t|0}(y|z) for clean y ≠ z, against GIDD's get_alpha_betapi and (1 − t)/(1 + c_t)
    k = case["unifusion"]["kernel"]
    y, z = [i for i in range(k["num_states"]) if i != k["mask_id"]][:2]
    q = K.marginal(torch.tensor([y, z]), t_)
    alpha = q[0, y] - q[1, y]
    mpmath.mp.dps = 50
    T, p, gamma = mpmath.mpf(t), mpmath.mpf(k["p_uniform"]), mpmath.mpf(k["gamma"])
    c = 2**gamma * p / (1 - p) * (T * (1 - T)) ** (gamma / 2)
    assert_matches(alpha, case, "alpha_t", exact=float((1 - T) / (1 + c)))


def test_gidd_dynamic_weight_table():
    """GIDD's clean-token dynamic weight over S ∈ {16, 50, 64}, p ∈ {e^−20, 0.1, 0.5}, γ ∈ {0.5, 1, 2}, five times."""
    table = DATA["tables"]["gidd_dynamic_weight_clean_head"]
    col = {name: i for i, name in enumerate(table["columns"])}
    for row in table["rows"]:
        S, p, gamma, t = row[col["S"]], row[col["p_uniform_used (unifusion's p_uniform)"]], row[col["gamma"]], row[
            col["t"]]
        K = uf.HybridKernel(S, S - 1, p, gamma)
        assert K.B == pytest.approx(row[col["B"]], rel=TOL)
        x = torch.tensor([3])
        raw = uf.losses.gidd_loss_weight(x, x, t, K, "dynamic", max_weight=math.inf)
        torch.testing.assert_close(raw, torch.tensor([row[col["clean_raw_exact"]]], dtype=DT), rtol=TOL, atol=0.0)
        torch.testing.assert_close(raw, torch.tensor([row[col["clean_raw"]]], dtype=DT), rtol=TOL, atol=0.0)
        clipped = uf.losses.gidd_loss_weight(x, x, t, K, "dynamic", max_weight=2.0)
        torch.testing.assert_close(clipped, torch.tensor([row[col["clean_clipped"]]], dtype=DT), rtol=TOL, atol=0.0)


# issue #13's examples of the clean-token dynamic weight (γ = 1, before the clip), as printed there (5 digits)
ISSUE_DYNAMIC_EXAMPLES = [(50, 0.1, 0.5, "5.3678e-03"), (1000, 0.5, 0.9, "2.3110e-03"), (50257, 0.1, 0.5, "5.3404e-06")]


@pytest.mark.parametrize("S, p, t, printed", ISSUE_DYNAMIC_EXAMPLES)
def test_gidd_dynamic_weight_issue_examples(S, p, t, printed):
    """The clean-token weight (B/S) exp((γ/2) sigmoid(−t)), B = 2^γ p/(1 − p), S counting the mask, raw (no clip):
    equal to its 50-digit closed form to 1e-10 (independent of the library) and, rounded to 5 digits, to the
    issue's printed value; after the clip to [0, 2] it is unchanged (all three are far below 2)."""
    mpmath.mp.dps = 50
    P, T = mpmath.mpf(p), mpmath.mpf(t)
    exact = float(2 * P / (1 - P) / S * mpmath.exp(mpmath.mpf(1) / 2 / (1 + mpmath.exp(T))))
    K = uf.HybridKernel(S, S - 1, p, 1.0)
    x = torch.tensor([3])
    raw = uf.losses.gidd_loss_weight(x, x, t, K, "dynamic", max_weight=math.inf)
    torch.testing.assert_close(raw, torch.tensor([exact], dtype=DT), rtol=TOL, atol=0.0)
    assert f"{float(raw):.4e}" == printed
    assert float(uf.losses.gidd_loss_weight(x, x, t, K, "dynamic", max_weight=2.0)) == float(raw)


def test_gidd_dynamic_weight_table_of_the_first_revision():
    """``gidd_dynamic_weight_clean_v1`` (GIDD's first public revision, context only: unifusion follows the current
    code) reproduced from its formula in the README, 50 digits: B_v1 = 1/(1 + ((1 − p)/p) S/2),
    c = B_v1 (t(1 − t))^{γ/2}, α = ((1 − t)^γ − c)/(t^γ + (1 − t)^γ + (S − 2) c), clean weight
    B_v1 ((1 − α)/α)^{γ/2} with the log-SNR log(α/(1 − α)) clipped to ±20, clipped at 1 by that revision's config;
    mask weight 2. B_v1 = B/(B + S) exactly with B = 2p/(1 − p) (the current B at γ = 1), so B_v1 ≈ B/S for B ≪ S
    (the README's "about S times smaller" than the current B): checked on every row. Null rows (v1 returns NaN) are
    skipped explicitly, after checking that they are exactly the rows where that α is negative."""
    table = DATA["tables"]["gidd_dynamic_weight_clean_v1"]
    col = {name: i for i, name in enumerate(table["columns"])}
    mpmath.mp.dps = 50
    checked = skipped = 0
    for row in table["rows"]:
        S, p, gamma, t = row[col["S"]], mpmath.mpf(row[col["p_uniform"]]), mpmath.mpf(row[col["gamma"]]), row[col["t"]]
        T = mpmath.mpf(t)
        B_v1 = 1 / (1 + (1 - p) / p * S / 2)
        B_current_gamma1 = 2 * p / (1 - p)
        assert float(B_v1) == pytest.approx(float(B_current_gamma1 / (B_current_gamma1 + S)), rel=1e-14)
        assert row[col["B_v1"]] == pytest.approx(float(B_v1), rel=TOL)
        c = B_v1 * (T * (1 - T)) ** (gamma / 2)
        alpha = ((1 - T) ** gamma - c) / (T**gamma + (1 - T) ** gamma + (S - 2) * c)
        assert row[col["alpha_t_v1"]] == pytest.approx(float(alpha), rel=TOL)
        if row[col["clean_raw"]] is None:  # null: NaN in v1 (a negative α: its log-SNR is NaN, and so is every weight)
            assert alpha < 0 and row[col["clean_clipped_at_1"]] is None and row[col["mask_raw"]] is None
            skipped += 1
            continue
        assert alpha > 0 and row[col["mask_raw"]] == 2
        log_snr = min(max(mpmath.log(alpha / (1 - alpha)), -20), 20)
        clean = B_v1 * mpmath.exp(-gamma / 2 * log_snr)
        assert row[col["clean_raw"]] == pytest.approx(float(clean), rel=TOL)
        assert row[col["clean_clipped_at_1"]] == pytest.approx(float(min(clean, 1)), rel=TOL)
        checked += 1
    assert checked > 0 and checked + skipped == len(table["rows"])


def test_gidd_p_uniform_zero_is_e_minus_20_not_the_mask_kernel():
    """GIDD's default ``p_uniform: 0.0`` clips to e^−20: clean tokens then carry a small ELBO term, which the pure
    mask process (p = 0) does not."""
    case = CASES["gidd/hybrid/S8-m7-p0-g1/t0.999"]
    assert case["unifusion"]["kernel"]["p_uniform"] == math.exp(-20)
    x0, x_t, t = inputs_of(case)
    clean = x_t == x0
    mask_process = uf.losses.gidd_loss(head_of(case), x0, x_t, t, uf.HybridKernel(8, 7, 0.0))
    assert torch.all(mask_process[clean] == 0)
    assert torch.all(torch.tensor(case["exact"]["elbo"], dtype=DT)[clean] > 0)


# ---------------------------------------------------------------------------------------------------- SEDD
@pytest.mark.parametrize("case_id", _ids("sedd_score_entropy"))
def test_sedd_score_entropy(case_id):
    case = CASES[case_id]
    K, (x0, x_t, t) = kernel_of(case), inputs_of(case)
    loss = uf.losses.sedd_loss(head_of(case, "log_score"), x0, x_t, t, K)
    assert_matches(loss, case, "score_entropy_times_dsigma")
    assert_matches(loss.sum(), case, "per_sequence_sum",
                   exact=torch.tensor(case["exact"]["score_entropy_times_dsigma"], dtype=DT).sum())
    t_, exact = torch.tensor(t, dtype=DT), schedule_exact(case, t)
    assert_schedule_output(-K.schedule.log_alpha(t_), exact["sigma"], case, "sigma")
    assert_schedule_output(K.schedule.hazard(t_), exact["dsigma"], case, "dsigma")


# ---------------------------------------------------------------------------------------------------- MDLM
@pytest.mark.parametrize("case_id", _ids("mdlm_subs"))
def test_mdlm_subs_loss(case_id):
    case = CASES[case_id]
    K, (x0, x_t, t) = kernel_of(case), inputs_of(case)
    for loss in (uf.losses.mdlm_loss(head_of(case), x0, x_t, t, K),
                 uf.losses.reference_mdlm_loss(head_of(case), x0, x_t, t, K),
                 uf.losses.gidd_loss(head_of(case), x0, x_t, t, K, weighting="elbo")):
        assert_matches(loss, case, "subs_loss")
    t_, s_ = torch.tensor(t, dtype=DT), torch.tensor(case["inputs"]["s"], dtype=DT)
    sched, exact = K.schedule, schedule_exact(case, t)
    assert_schedule_output(-sched.log_alpha(t_), exact["sigma"], case, "sigma")
    assert_schedule_output(sched.hazard(t_), exact["dsigma"], case, "dsigma")
    assert_schedule_output(sched.one_minus_alpha(t_), exact["one_minus_alpha"], case, "move_chance_t")
    assert_schedule_output(sched.one_minus_alpha(s_), schedule_exact(case, case["inputs"]["s"])["one_minus_alpha"],
                           case, "move_chance_s")


@pytest.mark.parametrize("case_id", _ids("mdlm_subs"))
def test_mdlm_ddpm_update(case_id):
    case = CASES[case_id]
    K, (_, x_t, t) = kernel_of(case), inputs_of(case)
    posterior = K.posterior(x0_probs(case, K), x_t, case["inputs"]["s"], t)
    masked = [i for i, q in enumerate(case["outputs"]["ddpm_update_q_xs_normalised"]) if q is not None]
    assert masked == (x_t == K.mask_id).nonzero().flatten().tolist()
    peer = torch.tensor([case["outputs"]["ddpm_update_q_xs_normalised"][i] for i in masked], dtype=DT)
    tol = max(TOL, 2.0 * case["peer_rel_dev_from_exact"]["ddpm_update_q_xs_normalised"])
    torch.testing.assert_close(posterior[masked], peer, rtol=tol, atol=0.0)
    # and the exact value: q(y) ∝ x_θ(y) (m_t − m_s) off the mask, q(mask) ∝ m_s (m = 1 − α), in 50 digits from the
    # same inputs (near t → 0 MDLM's own float64 carries 2.6e-10)
    m_t = mpmath.mpf(schedule_exact(case, t)["one_minus_alpha"])
    m_s = mpmath.mpf(schedule_exact(case, case["inputs"]["s"])["one_minus_alpha"])
    mpmath.mp.dps = 50
    exact = []
    for i in masked:
        z = [mpmath.mpf(v) for v in case["inputs"]["logits"][i]]
        z[K.mask_id] = mpmath.mpf("-inf")
        w = [mpmath.exp(v) for v in z]
        q = [w[y] * (m_t - m_s) / mpmath.fsum(w) for y in range(8)]
        q[K.mask_id] = m_s
        exact.append([float(v / mpmath.fsum(q)) for v in q])
    torch.testing.assert_close(posterior[masked], torch.tensor(exact, dtype=DT), rtol=TOL, atol=0.0)
    unmasked = [i for i in range(6) if i not in masked]  # MDLM copies them: the posterior is the one-hot of x_t
    torch.testing.assert_close(posterior[unmasked], torch.nn.functional.one_hot(x_t[unmasked], 8).to(DT))


# ---------------------------------------------------------------------------------------------------- DUO
@pytest.mark.parametrize("case_id", _ids("duo_udlm"))
def test_duo_udlm_elbo(case_id):
    case = CASES[case_id]
    x0, x_t, t = inputs_of(case)
    published = kernel_of(case, duo_as_published=True)
    loss = uf.losses.gidd_loss(head_of(case), x0, x_t, t, published, weighting="elbo")
    assert_matches(loss, case, "nll_per_token")
    t_, exact = torch.tensor(t, dtype=DT), schedule_exact(case, t)
    assert_matches(published.marginal(x0, t_), case, "forward_process_q_t_given_x0")
    assert_schedule_output(published.schedule.alpha(t_), exact["alpha"], case, "alpha_t")
    chain = 1.0 - published.schedule.eps if isinstance(published.schedule, uf.schedules.DUOCosineSchedule) else 1.0
    assert_schedule_output(published.schedule.alpha_prime(t_), exact["alpha_prime"] / chain, case, "dalpha_t")
    consistent = kernel_of(case)
    if isinstance(consistent.schedule, uf.schedules.DUOCosineSchedule):
        # DUO's cosine derivative lacks the chain factor (1 − ε): the true ELBO is DUO's number times (1 − ε)
        eps = consistent.schedule.eps
        true = uf.losses.gidd_loss(head_of(case), x0, x_t, t, consistent, weighting="elbo")
        assert_matches(true, case, "nll_per_token", scale=1.0 - eps)


# ---------------------------------------------------------------------------------------------------- sampler steps
# The reference data has no sampler values for SEDD and DUO (and only kernel.posterior for GIDD and MDLM), so each
# peer's sampler step is written out here in float64 from the formula its code evaluates (our own code, from the
# maths of the cited function; the peers' samplers draw with a Gumbel argmax of probs / Exp(1), which picks index i
# with probability max(probs_i, 0) / Σ max(probs, 0), so "the distribution" below is that normalisation), and
# checked against unifusion's public step at ≤ 1e-10, then against the samplers themselves by drawing.


def _normalise(probs: torch.Tensor) -> torch.Tensor:
    probs = probs.clamp_min(0.0)
    return probs / probs.sum(-1, keepdim=True)


def sedd_graph(K: uf.Kernel) -> str:
    return "absorb" if isinstance(K, uf.MaskKernel) else "uniform"


def sedd_euler_step(graph: str, score: torch.Tensor, x_t: torch.Tensor, dsigma: float, dt: float) -> torch.Tensor:
    """SEDD ``sampling.py`` EulerPredictor.update_fn with ``graph_lib.py`` Graph.reverse_rate / sample_rate: the
    reverse rate is dσ/dt · Q̄(x_t, y) · s_y off x_t (Q̄ = 1/S off the diagonal on the uniform graph; 1 from the mask
    to every other state on the absorbing one, the mask last), its diagonal minus the row sum, and the step draws
    from one_hot(x_t) + Δt · rate."""
    N, S = score.shape
    if graph == "uniform":
        Q = torch.full((N, S), 1.0 / S, dtype=DT)
    else:
        Q = torch.where((x_t == S - 1)[:, None], torch.ones(N, S, dtype=DT), torch.zeros(N, S, dtype=DT))
    rate = (dt * dsigma * Q * score).scatter(-1, x_t[:, None], 0.0)
    rate = rate.scatter(-1, x_t[:, None], -rate.sum(-1, keepdim=True))
    return _normalise(torch.nn.functional.one_hot(x_t, S).to(DT) + rate)


def sedd_analytic_step(graph: str, score: torch.Tensor, x_t: torch.Tensor, dsig: float) -> torch.Tensor:
    """SEDD ``sampling.py`` AnalyticPredictor.update_fn (and Denoiser.update_fn with Δσ = σ(t)): the staggered
    score e^{−Δσ Q̄} s times the transition e^{Δσ Q̄}(x_t, ·) (``graph_lib.py`` staggered_score, transp_transition);
    the denoiser drops the absorbing graph's mask entry. Evaluated in 50 digits: in float64 the staggered score
    e^{Δσ} s − (e^{Δσ} − 1)/S Σ s cancels (e^{Δσ} ≈ 4e8 at Δσ = 19.8: 1e-7 absolute)."""
    mpmath.mp.dps = 50
    N, S = score.shape
    d = mpmath.mpf(dsig)
    e, em = mpmath.exp(d), mpmath.exp(-d)
    out = torch.empty(N, S, dtype=DT)
    for i in range(N):
        sc = [mpmath.mpf(float(v)) for v in score[i]]
        b = int(x_t[i])
        if graph == "uniform":
            total = mpmath.fsum(sc)
            stag = [e * v - (e - 1) / S * total for v in sc]
            trans = [em * (a == b) + (1 - em) / S for a in range(S)]
        else:
            stag = [e * v for v in sc]
            stag[-1] = e * sc[-1] + (1 - e) * mpmath.fsum(sc)
            trans = [(1 - em if a != S - 1 else mpmath.mpf(1)) if b == S - 1 else em * (a == b) for a in range(S)]
        for a in range(S):
            out[i, a] = float(stag[a] * trans[a])
    return out


def mdlm_ddpm_step(x_theta: torch.Tensor, x_t: torch.Tensor, mask_id: int, m_t: float, m_s: float) -> torch.Tensor:
    """MDLM ``diffusion.py`` _ddpm_update / _ddpm_caching_update: at a masked position q(y) ∝ x_θ(y) (m_t − m_s)
    for y ≠ mask and q(mask) ∝ m_s (m = move chance = 1 − α; the caching update passes m = t, proportional to the
    log-linear schedule's (1 − ε) t, so the same distribution); unmasked positions are copied."""
    q = x_theta * (m_t - m_s)
    q[:, mask_id] = m_s
    copy = torch.nn.functional.one_hot(x_t, x_theta.shape[-1]).to(DT)
    return torch.where((x_t == mask_id)[:, None], _normalise(q), copy)


def gidd_step(x_theta: torch.Tensor, x_t: torch.Tensor, alpha_m_t, alpha_m_s) -> torch.Tensor:
    """GIDD ``gidd/sampling.py`` GiddSampler.DenoisingStep.forward: q_{t|s}(z_t | a) = (α_t/α_s) δ_{a, z_t} +
    βπ_t(z_t) − (α_t/α_s) βπ_s(z_t), q_s = α_s x_θ + βπ_s, and q_st = q_{t|s}(z_t | ·) q_s / q_t(z_t | x_θ)."""
    (alpha_t, m_t), (alpha_s, m_s) = alpha_m_t, alpha_m_s
    r = alpha_t / alpha_s
    one_hot = torch.nn.functional.one_hot(x_t, x_theta.shape[-1]).to(DT)
    q_ts = r * one_hot + (m_t - r * m_s)[x_t][:, None]
    q_s = alpha_s * x_theta + m_s
    q_zt = (alpha_t * x_theta + m_t).gather(-1, x_t[:, None])
    return q_ts * q_s / q_zt


def duo_step(x_theta: torch.Tensor, x_t: torch.Tensor, alpha_t: float, alpha_s: float) -> torch.Tensor:
    """DUO ``algo.py`` DUO_BASE._posterior_from_x0 (uniform state, V states), in its x̄ notation: numerator
    α_t V x_θ e_{x_t} + (α_t/α_s − α_t) e_{x_t} + (α_s − α_t) x_θ + (1 − α_t/α_s)(1 − α_s)/V, denominator
    α_t V x_θ(x_t) + 1 − α_t (``trainer_base.py`` _ancestral_update; α_s = 1 for the noise-removal step)."""
    V = x_theta.shape[-1]
    r = alpha_t / alpha_s
    one_hot = torch.nn.functional.one_hot(x_t, V).to(DT)
    num = alpha_t * V * x_theta * one_hot + (r - alpha_t) * one_hot + (alpha_s - alpha_t) * x_theta \
        + (1 - r) * (1 - alpha_s) / V
    return num / (alpha_t * V * x_theta.gather(-1, x_t[:, None]) + 1 - alpha_t)


def hybrid_alpha_m(k: dict, t: float) -> tuple[float, torch.Tensor]:
    """GIDD's α_t and noise vector βπ_t in 50 digits (README: c_t = B (t(1−t))^{γ/2}, α_t = (1−t)/(1+c_t), mask
    t/(1+c_t), every other state c_t/((1+c_t)(S−1)))."""
    mpmath.mp.dps = 50
    T, p, gamma, S = mpmath.mpf(t), mpmath.mpf(k["p_uniform"]), mpmath.mpf(k["gamma"]), k["num_states"]
    c = 2**gamma * p / (1 - p) * (T * (1 - T)) ** (gamma / 2)
    m = [float(T / (1 + c)) if y == k["mask_id"] else float(c / ((1 + c) * (S - 1))) for y in range(S)]
    return float((1 - T) / (1 + c)), torch.tensor(m, dtype=DT)


STEP_TIMES = [(0.999, 0.5), (0.9, 0.8), (0.5, 0.25), (0.02, 0.01), (0.001, 0.0)]


@pytest.mark.parametrize("case_id", _ids("sedd_score_entropy"))
def test_sedd_euler_step(case_id):
    """SEDD's Euler predictor = unifusion's τ-leaping step on the score's reverse rates (EulerSampler's step with
    ``parameterization="sedd"``), at Δt small, moderate and large enough that Δt λ > 1 (both renormalise)."""
    case = CASES[case_id]
    K, (_, x_t, t) = kernel_of(case), inputs_of(case)
    log_score = head_of(case, "log_score")
    dsigma = schedule_exact(case, t)["dsigma"]
    rate = reverse_rate_from_head("sedd", log_score, K, x_t, torch.tensor(t, dtype=DT))
    for dt in (1e-4, 0.05, 1.0):
        ours = euler_step_probs(rate.rates, x_t, dt)
        peer = sedd_euler_step(sedd_graph(K), log_score.exp(), x_t, dsigma, dt)
        torch.testing.assert_close(ours, peer, rtol=TOL, atol=1e-300)


@pytest.mark.parametrize("case_id", _ids("sedd_score_entropy"))
def test_sedd_analytic_and_denoiser_steps(case_id):
    """SEDD's analytic (Tweedie) predictor with a score converted from an x0 head (``convert_x0_to("sedd", ...)``)
    is unifusion's posterior step (BayesianSampler's); its denoiser is the clean distribution the score implies
    (``clean_distribution_from_head("sedd", ...)``, negative entries dropped as SEDD's sampler drops them) times
    q_{t|0}(x_t | ·) — EulerSampler's final step when α_0 = 1 (log-linear), but not under the geometric schedule,
    where unifusion's t = 0 still has α_0 = e^{−σ_min} and SEDD's denoiser goes to σ = 0."""
    case = CASES[case_id]
    K, (_, x_t, t) = kernel_of(case), inputs_of(case)
    graph, S = sedd_graph(K), K.num_states
    t_ = torch.tensor(t, dtype=DT)
    sigma_t = schedule_exact(case, t)["sigma"]
    # an x0 head (the case's log scores read as logits), converted to SEDD's score
    x_theta = head_of(case, "log_score")
    if K.mask_id is not None:
        x_theta[:, K.mask_id] = -math.inf
    x_theta = x_theta.softmax(-1)
    score = uf.convert_x0_to("sedd", x_theta, K, x_t, t_)
    for s in (t / 2, 0.0):
        dsig = sigma_t - (schedule_exact(case, s)["sigma"] if s > 0 else float(-K.schedule.log_alpha(0.0)))
        peer = _normalise(sedd_analytic_step(graph, score, x_t, dsig))
        # SEDD's step reads the score (a float64 number, rounded to ε₆₄) through e^{−Δσ Q̄}, which multiplies that
        # rounding by up to e^{Δσ} (3.8e8 at the geometric t = 0.999, where the score is 1 + O(α_t = 2e-9)); at s = 0
        # the absorbing graph's mask entry, s_mask + (1 − e^{Δσ}) Σ_clean s, is exactly 0 and left with that
        # rounding. unifusion's posterior reads x_θ instead: absolute max(1e-14, 8 ε₆₄ e^{Δσ}) on probabilities.
        atol = max(1e-14, 8 * torch.finfo(DT).eps * math.exp(dsig))
        torch.testing.assert_close(K.posterior(x_theta, x_t, s, t_), peer, rtol=TOL, atol=atol)
    # the denoiser on the case's own (unconverted) log scores; SEDD's network writes 0 at x_t (s_{x_t} = 1)
    log_score = head_of(case, "log_score")
    stag_trans = sedd_analytic_step(graph, log_score.scatter(-1, x_t[:, None], 0.0).exp(), x_t, sigma_t)
    if graph == "absorb":
        stag_trans[:, -1] = 0.0
    peer = _normalise(stag_trans)
    p0 = clean_distribution_from_head("sedd", log_score, K, x_t, t_, dtype=DT)
    column = K.marginal(torch.arange(S), t_)[:, x_t].T  # q_{t|0}(x_t | a), (6, S)
    torch.testing.assert_close(_normalise(p0 * column), peer, rtol=TOL, atol=1e-30)
    final = K.posterior(p0 / p0.sum(-1, keepdim=True), x_t, 0.0, t_)  # what EulerSampler's final step draws from
    # unifusion lands on t = 0 (σ = σ_min = 1e-4), SEDD on σ = 0
    if isinstance(K.schedule, uf.schedules.GeometricSchedule):
        assert float((final - peer).abs().max()) > 1e-6
    else:
        torch.testing.assert_close(final, peer, rtol=TOL, atol=1e-30)


@pytest.mark.parametrize("case_id", _ids("mdlm_subs"))
def test_mdlm_ddpm_step_at_other_times(case_id):
    """MDLM's DDPM update (and its caching variant) = ``kernel.posterior`` at MDLM's own kind of steps, including
    the last one to s = 0."""
    case = CASES[case_id]
    K, (_, x_t, _) = kernel_of(case), inputs_of(case)
    x_theta = x0_probs(case, K)
    for t, s in STEP_TIMES:
        m_t, m_s = (schedule_exact(case, v)["one_minus_alpha"] if v > 0 else 0.0 for v in (t, s))
        peer = mdlm_ddpm_step(x_theta, x_t, K.mask_id, m_t, m_s)
        torch.testing.assert_close(K.posterior(x_theta, x_t, s, t), peer, rtol=TOL, atol=1e-300)


@pytest.mark.parametrize("case_id", _ids("gidd_hybrid"))
def test_gidd_sampler_step_at_other_times(case_id):
    """GIDD's denoising step = ``kernel.posterior`` (and its mixture form, which BayesianSampler draws from), also at
    the ends of GIDD's time grid (t_eps = 1e-4: from 1 − 1e-4, and the last step between t_eps-spaced times)."""
    case = CASES[case_id]
    K, (_, x_t, _) = kernel_of(case), inputs_of(case)
    k = case["unifusion"]["kernel"]
    x_theta = x0_probs(case, K)
    for t, s in STEP_TIMES[:-1] + [(1 - 1e-4, 0.9), (2e-4, 1e-4)]:
        peer = gidd_step(x_theta, x_t, hybrid_alpha_m(k, t), hybrid_alpha_m(k, s))
        ours = K.posterior(x_theta, x_t, s, t)
        torch.testing.assert_close(ours, peer, rtol=TOL, atol=1e-300)
        mixture = posterior_mixture(K, x_theta, x_t, torch.tensor(t, dtype=DT), torch.tensor(s, dtype=DT))
        torch.testing.assert_close(mixture, peer, rtol=TOL, atol=1e-15)


@pytest.mark.parametrize("case_id", _ids("duo_udlm"))
def test_duo_ancestral_step(case_id):
    """DUO's ancestral step (``_posterior_from_x0``) = ``kernel.posterior`` on the uniform kernel, for both DUO
    schedules, including the noise-removal step (α_s = 1, unifusion's s = 0)."""
    case = CASES[case_id]
    K, (_, x_t, _) = kernel_of(case), inputs_of(case)
    x_theta = head_of(case).softmax(-1)
    for t, s in STEP_TIMES:
        alpha_t = schedule_exact(case, t)["alpha"]
        alpha_s = schedule_exact(case, s)["alpha"] if s > 0 else 1.0
        torch.testing.assert_close(K.posterior(x_theta, x_t, s, t), duo_step(x_theta, x_t, alpha_t, alpha_s),
                                   rtol=TOL, atol=1e-300)


# ---------------------------------------------------------------------------------------------------- the samplers draw
def _second_step(sampler_cls, K, head, n: int, seed: int, **kwargs):
    """Run ``sampler_cls`` with a model returning ``head`` ``(L, S)`` (the same at every step) on ``n`` sequences for
    two steps of three; returns the tokens the model saw at the second call, the tokens after the second step, and
    the step's times."""
    seen = []

    def model(x_t, t):
        seen.append(x_t.clone())
        return head.expand(x_t.shape[0], *head.shape).to(torch.float32)

    sampler = sampler_cls(model, K, 3, **kwargs)
    out = sampler.sample(n, head.shape[0], generator=torch.Generator().manual_seed(seed),
                         callback=lambda step, t, x: step == 2)
    eps = sampler.eps
    times = [(1 - eps) * (1 - i / 3) for i in range(3)]
    return seen[1], out, times[1], times[2]


def _assert_draws_follow(x_t, out, step_probs) -> None:
    """Counts of each (position, token) after the step against their expectation Σ_samples P(token | x_t), within
    5 standard deviations (+2)."""
    n, L = x_t.shape
    for pos in range(L):
        probs = step_probs(pos, x_t[:, pos])  # (n, S)
        expected = probs.sum(0)
        observed = torch.bincount(out[:, pos], minlength=probs.shape[-1]).to(DT)
        assert bool(((observed - expected).abs() <= 5 * expected.sqrt() + 2).all()), (pos, observed, expected)
        assert bool((observed[expected == 0] == 0).all())


def test_bayesian_sampler_draws_mdlm_gidd_and_duo_steps():
    """BayesianSampler (unifusion's ancestral sampler) draws each position from the peers' own step distribution:
    MDLM's DDPM update (mask kernel), GIDD's denoising step (hybrid kernel), DUO's ancestral step (uniform kernel,
    float64 as DUO samples). 20,000 draws per position detect a 10 % error in the step's time."""
    n = 20_000
    mdlm = CASES["mdlm/subs/loglinear/S8-m7/t0.5"]
    K = kernel_of(mdlm)
    head = head_of(mdlm)[[2, 3, 4]]
    x_t, out, t, s = _second_step(uf.BayesianSampler, K, head, n, 0)
    x_theta = x0_probs(mdlm, K)[[2, 3, 4]]
    m = [float(K.schedule.one_minus_alpha(v)) for v in (t, s)]
    _assert_draws_follow(x_t, out, lambda pos, b: mdlm_ddpm_step(x_theta[pos].expand(len(b), -1).clone(), b, 7, *m))

    gidd = CASES["gidd/hybrid/S8-m7-p0.1-g1/t0.5"]
    K, k = kernel_of(gidd), gidd["unifusion"]["kernel"]
    head = head_of(gidd)[[0, 2, 4]]
    x_t, out, t, s = _second_step(uf.BayesianSampler, K, head, n, 1)
    x_theta = x0_probs(gidd, K)[[0, 2, 4]]
    _assert_draws_follow(x_t, out, lambda pos, b: gidd_step(x_theta[pos].expand(len(b), -1), b,
                                                             hybrid_alpha_m(k, t), hybrid_alpha_m(k, s)))

    duo = CASES["duo/udlm/cosine/S8/t0.5"]
    K = kernel_of(duo)
    head = head_of(duo)[[0, 2, 4]]
    x_t, out, t, s = _second_step(uf.BayesianSampler, K, head, n, 2, dtype=DT)  # DUO samples in float64
    x_theta = head.softmax(-1)
    a_t, a_s = (schedule_exact(duo, v)["alpha"] for v in (t, s))
    _assert_draws_follow(x_t, out, lambda pos, b: duo_step(x_theta[pos].expand(len(b), -1), b, a_t, a_s))


def test_euler_sampler_draws_sedd_euler_steps():
    """EulerSampler(parameterization="sedd") draws each position from SEDD's Euler step on the model's score."""
    for case_id in ("sedd/uniform/loglinear/S8/t0.5", "sedd/absorb/loglinear/S8/t0.5"):
        case = CASES[case_id]
        K = kernel_of(case)
        head = head_of(case, "log_score")[[0, 2, 4]]
        x_t, out, t, s = _second_step(uf.EulerSampler, K, head, 20_000, 3, parameterization="sedd", dtype=DT)
        step = (lambda graph, score, dsigma, dt: lambda pos, b: sedd_euler_step(
            graph, score[pos].expand(len(b), -1), b, dsigma, dt))(
            sedd_graph(K), head.exp(), schedule_exact(case, t)["dsigma"], t - s)
        _assert_draws_follow(x_t, out, step)


# ---------------------------------------------------------------------------------------------------- also on the page
def test_mdlm_and_duo_padding_reduction():
    """MDLM's (and DUO's) training loss Σ ℓ · pad / Σ pad over all non-padding tokens, from unifusion's per-position
    losses and from ``diffusion_loss``'s own mask and token count."""
    case = CASES["mdlm/subs/loglinear/S8-m7/t0.5"]
    K, (x0, x_t, t) = kernel_of(case), inputs_of(case)
    pad = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0], dtype=DT)
    loss = uf.losses.mdlm_loss(head_of(case), x0, x_t, t, K)
    exact = torch.tensor(case["exact"]["subs_loss"], dtype=DT)
    torch.testing.assert_close((loss * pad).sum() / pad.sum(), (exact * pad).sum() / pad.sum(), rtol=TOL, atol=0.0)
    logits = head_of(case)[None]
    out = uf.diffusion_loss(lambda x, s: logits, x0[None], K, objective="mdlm", t=torch.tensor([t], dtype=DT),
                            attention_mask=pad[None].long(), generator=torch.Generator().manual_seed(0))
    ref = uf.losses.mdlm_loss(logits[0], x0, out.x_t[0], t, K)
    torch.testing.assert_close(out.loss.sum() / out.num_tokens, (ref * pad).sum() / pad.sum(), rtol=TOL, atol=0.0)


@pytest.mark.parametrize("case_id", [i for i in _ids("sedd_score_entropy") if "/absorb/" in i])
def test_sedd_absorbing_graph_with_geometric_noise(case_id):
    """SEDD's absorbing graph with its geometric noise (σ_min = 1e-4, σ_max = 20): ``sedd_loss`` on
    ``MaskKernel(S, S − 1, GeometricSchedule())`` equals SEDD's absorbing score entropy × dσ in 50 digits:
    dσ [Σ_{y≠mask} s_y − r log s_{x0} + r (log r − 1)], r = 1/(e^σ − 1), at masked positions (0 elsewhere)."""
    case = CASES[case_id]
    _, (x0, x_t, t) = kernel_of(case), inputs_of(case)
    K = uf.MaskKernel(8, 7, uf.schedules.GeometricSchedule(1e-4, 20.0))
    log_score = head_of(case, "log_score")
    loss = uf.losses.sedd_loss(log_score, x0, x_t, t, K)
    mpmath.mp.dps = 50
    T = mpmath.mpf(t)
    sigma = mpmath.mpf("1e-4") ** (1 - T) * mpmath.mpf(20) ** T
    dsigma = sigma * mpmath.log(mpmath.mpf(20) / mpmath.mpf("1e-4"))
    r = 1 / mpmath.expm1(sigma)
    exact = []
    for i in range(6):
        if int(x_t[i]) != 7:
            exact.append(0.0)
            continue
        ls = [mpmath.mpf(float(v)) for v in log_score[i]]
        value = mpmath.fsum(mpmath.exp(v) for v in ls[:7]) - r * ls[int(x0[i])] + r * (mpmath.log(r) - 1)
        exact.append(float(dsigma * value))
    torch.testing.assert_close(loss, torch.tensor(exact, dtype=DT), rtol=TOL, atol=0.0)
