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
from unifusion.losses import native

DATA = json.loads((Path(__file__).parent / "data" / "peers" / "reference_values.json").read_text())
CASES = {c["id"]: c for c in DATA["cases"]}
DT = torch.float64
TOL = 1e-10


def _ids(family: str) -> list[str]:
    return [i for i, c in CASES.items() if c["family"] == family]


def schedule_of(spec: dict, *, duo_as_published: bool = False) -> uf.Schedule | None:
    """The unifusion schedule a case's ``unifusion.schedule`` block names (``None``: built into the kernel)."""
    name = spec["name"]
    if name.startswith("built into"):
        return None
    if name == "LogLinearSchedule":
        return uf.LogLinearSchedule(eps=spec["eps"])
    if name.startswith("geometric"):
        return uf.GeometricSchedule(sigma_min=spec["sigma_min"], sigma_max=spec["sigma_max"])
    if name.startswith("mdlm_cosine"):
        return uf.MDLMCosineSchedule(eps=spec["eps"])
    if name.startswith("duo_cosine"):
        return uf.DUOCosineSchedule(eps=spec["eps"], chain_factor=not duo_as_published)
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
    if weighting == "dynamic":  # GIDD's training loss: the token mean over all positions
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
    assert_matches(elbo_weight.clamp(0.0, 2.0), case, "clip_weight", exact=torch.tensor(
        case["exact"]["elbo_weight"], dtype=DT).clamp(0.0, 2.0))
    assert_matches(native._dynamic_weight(K, x0, x_t, t_.expand(6)).clamp(0.0, 2.0), case, "dynamic_weight")


@pytest.mark.parametrize("case_id", _ids("gidd_hybrid"))
def test_gidd_marginal_and_denoising_step(case_id):
    case = CASES[case_id]
    K, (x0, x_t, t) = kernel_of(case), inputs_of(case)
    t_, s_ = torch.tensor(t, dtype=DT), torch.tensor(case["inputs"]["s"], dtype=DT)
    assert_matches(K.marginal(x0, t_), case, "marginal_q_t_given_x0")
    assert_matches(K.posterior(x0_probs(case, K), x_t, s_, t_), case, "denoising_step_q_s_given_x_t")


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
        raw = native._dynamic_weight(K, x, x, torch.tensor([t], dtype=DT))
        torch.testing.assert_close(raw, torch.tensor([row[col["clean_raw_exact"]]], dtype=DT), rtol=TOL, atol=0.0)
        torch.testing.assert_close(raw, torch.tensor([row[col["clean_raw"]]], dtype=DT), rtol=TOL, atol=0.0)
        clipped = raw.clamp(0.0, 2.0)
        torch.testing.assert_close(clipped, torch.tensor([row[col["clean_clipped"]]], dtype=DT), rtol=TOL, atol=0.0)


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
    chain = 1.0 - published.schedule.eps if isinstance(published.schedule, uf.DUOCosineSchedule) else 1.0
    assert_schedule_output(published.schedule.alpha_prime(t_), exact["alpha_prime"] / chain, case, "dalpha_t")
    consistent = kernel_of(case)
    if isinstance(consistent.schedule, uf.DUOCosineSchedule):
        # DUO's cosine derivative lacks the chain factor (1 − ε): the true ELBO is DUO's number times (1 − ε)
        eps = consistent.schedule.eps
        true = uf.losses.gidd_loss(head_of(case), x0, x_t, t, consistent, weighting="elbo")
        assert_matches(true, case, "nll_per_token", scale=1.0 - eps)
