"""Parity with the RL anchors' own code on fixed inputs: tests/data/rl_peers/reference_values.json holds their
outputs (their functions run unmodified on given logits; their random masks recorded), see the README there.
Here unifusion's plans (:func:`~unifusion.rl.estimators.plan_from_masks`), combination and objectives reproduce them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from unifusion.rl import grpo_loss, spg_loss, wd1_loss
from unifusion.rl.estimators import combine_logps, plan_from_masks

DATA = json.loads((Path(__file__).resolve().parents[1] / "data" / "rl_peers" / "reference_values.json").read_text())
INP = DATA["inputs"]
MASK, B, P, C = INP["mask_id"], INP["batch"], INP["prompt_length"], INP["completion_length"]
X0 = torch.tensor(INP["x0"])
L = P + C
COMPLETION = torch.zeros(B, L, dtype=torch.bool)
COMPLETION[:, P:] = torch.tensor(INP["completion_mask"]).bool()


def _log_probs(logits: list) -> torch.Tensor:
    """log p(x0_i | pass) of logits ``(..., B, L, V)`` (the mask id has no mass in them)."""
    z = torch.tensor(logits, dtype=torch.float64)
    return torch.log_softmax(z, -1).gather(-1, X0.expand(z.shape[:-1])[..., None])[..., 0]


def _on_completion(per_token: torch.Tensor) -> torch.Tensor:
    return per_token[:, P:][COMPLETION[:, P:]]


def _pad(values: list) -> torch.Tensor:
    """Their completion-only ``(B, C)`` values as ``(B, L)`` (0 on the prompt)."""
    out = torch.zeros(B, L, dtype=torch.float64)
    out[:, P:] = torch.tensor(values, dtype=torch.float64)
    return out


def test_d1_mean_field_log_probs_and_grpo_loss():
    case = DATA["d1"]
    plan = plan_from_masks("mean_field", COMPLETION, torch.tensor(case["noised"])[None])
    # every completion token scored once with weight 1 (their mean field), their corruption kept as it is
    assert torch.equal(plan.scored[0], COMPLETION) and torch.equal(plan.coef, torch.ones(1, B, dtype=torch.float64))
    assert torch.equal(plan.noised[0], torch.tensor(case["noised"]) | COMPLETION)
    per_token = combine_logps(plan, _log_probs(case["logits"])[None])
    theirs = _pad(case["per_token_logps"])
    assert torch.allclose(_on_completion(per_token), _on_completion(theirs), atol=1e-5)
    loss = grpo_loss(theirs, _pad(case["old_per_token_logps"]), torch.tensor(case["advantages"]), COMPLETION,
                     ref_logps=_pad(case["ref_per_token_logps"]), kl_coef=case["beta"], epsilon=case["epsilon"],
                     normalization="dapo").sum()
    assert abs(float(loss) - case["loss"]) < 1e-6


def test_diffucoder_coupled_log_probs():
    case = DATA["diffucoder"]
    full, first, second = (torch.tensor(n) for n in case["noised"])
    t = torch.full((1, B), case["mask_ratio"], dtype=torch.float64)
    plan = plan_from_masks("coupled", COMPLETION, first[None], t=t, fully_masked=True)
    # Mᶜ and the fully masked pass (DiffuCoder masks the padded column too; it is not scored on either side)
    assert torch.equal(plan.noised[1], second & COMPLETION) and torch.equal(plan.noised[2], full & COMPLETION)
    z = torch.tensor(case["logits"]).view(3, B, L, -1).tolist()  # their rows: [fully masked | M | Mᶜ]
    lp = _log_probs(z)
    per_token = combine_logps(plan, torch.stack([lp[1], lp[2], lp[0]]))
    assert torch.allclose(_on_completion(per_token), _on_completion(torch.tensor(case["per_token_logps"],
                                                                                 dtype=torch.float64)), atol=1e-5)


def test_wd1_loss():
    case = DATA["wd1"]
    plan = plan_from_masks("mean_field", COMPLETION, torch.tensor(case["noised"])[None])
    per_token = combine_logps(plan, _log_probs(case["logits"])[None])
    assert torch.allclose(_on_completion(per_token), _on_completion(_pad(case["per_token_logps"])), atol=1e-5)
    loss = wd1_loss(per_token.sum(-1), torch.tensor(case["advantages"], dtype=torch.float64)).sum()
    assert abs(float(loss) - case["loss"]) < 1e-5


@pytest.mark.parametrize("estimate", ["elbo", "eubo", "mix"])
def test_spg_elbo_eubo_and_loss(estimate):
    case = DATA["spg"]
    masks = torch.tensor(case["noised"])  # (num_t, B, L)
    lp = _log_probs(torch.tensor(case["logits"]).transpose(0, 1).tolist())  # their (B, num_t, L) → (num_t, B, L)
    n = COMPLETION.sum(-1).double()
    lower_plan = plan_from_masks("elbo_discrete", COMPLETION, masks)
    upper_plan = plan_from_masks("eubo", COMPLETION, masks, eubo_beta=case["eubo_beta"])
    lower = combine_logps(lower_plan, lp).sum(-1) / n  # SPG normalises by the completion length
    hit = upper_plan.scored.any(0).sum(-1)
    upper = combine_logps(upper_plan, lp).sum(-1) / hit  # ... and the EUBO by the tokens any pass masked
    A = torch.tensor(case["advantages"], dtype=torch.float64)
    mix = case["mix_weight"] if estimate == "mix" else None
    neg = {"elbo": lower, "eubo": upper, "mix": 0.5 * upper + 0.5 * lower}[estimate]
    want = torch.where(A > 0, lower, neg)
    assert torch.allclose(want, torch.tensor(case[estimate]["per_seq_logps"], dtype=torch.float64), atol=1e-5)
    per_sample = spg_loss(lower, upper if estimate != "elbo" else lower, A, mix_weight=mix)
    length = COMPLETION.sum(-1).double()
    loss = (per_sample * length).sum() / length.sum()  # SPG's length-weighted reduction
    assert abs(float(loss) - case[estimate]["loss"]) < 1e-5


def test_gdpo_quadrature():
    case = DATA["gdpo_nemo_rl"]
    completion = torch.tensor(case["completion_mask_full"])
    masks = torch.tensor(case["masked"])  # (nodes · draws, B, L)
    plan = plan_from_masks("quadrature", completion, masks, num_nodes=2, draws=case["mc_samples"])
    assert torch.allclose(plan.coef[:, 0], torch.tensor(case["coefficients"], dtype=torch.float64), atol=1e-12)
    per_token = combine_logps(plan, _log_probs(case["logits"]))
    assert torch.allclose(per_token, torch.tensor(case["elbo_per_position"], dtype=torch.float64), atol=1e-5)
