"""The RL objectives: zero advantages give zero gradient, on-policy GRPO is REINFORCE in every normalisation, the clip
stops the gradient exactly where the ratio leaves its range on the advantage's side."""

from __future__ import annotations

import pytest
import torch

from unifusion.rl import dpo_loss, group_advantages, grpo_loss, spg_loss, wd1_loss

B, L = 6, 7


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = (-3 * torch.rand(B, L, generator=g, dtype=torch.float64)).requires_grad_()
    mask = torch.rand(B, L, generator=g) < 0.7
    mask[:, 0] = True
    A = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, mask, A


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    A = group_advantages(r, 3)
    assert torch.allclose(A.view(2, 3).mean(-1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(group_advantages(r, 3, scale=False), torch.tensor([1 / 3, -2 / 3, 1 / 3, 2 / 3, -1 / 3,
                                                                                -1 / 3]))
    assert torch.equal(group_advantages(torch.ones(4), 2), torch.zeros(4))  # equal rewards: no signal
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.ones(5), 2)


@pytest.mark.parametrize("normalization", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_grpo_is_reinforce(normalization, level):
    logp, mask, A = _batch()
    loss = grpo_loss(logp, logp.detach(), A, mask, level=level, normalization=normalization).sum()
    (grad,) = torch.autograd.grad(loss, logp)
    n = mask.sum(-1).double()
    norm = {"grpo": n * B, "dr_grpo": torch.full((B,), float(B * L), dtype=torch.float64),
            "dapo": torch.full((B,), float(mask.sum()), dtype=torch.float64)}[normalization]
    # −A_i ∇x_{i,t} / norm_i on both levels (sequence: ∇ρ_i = Σ_t ∇x_{i,t} / |o_i|, shared by |o_i| tokens)
    reinforce = -(A / norm)[:, None] * mask
    assert torch.allclose(grad, reinforce.double())


def test_zero_advantages_give_zero_gradient():
    logp, mask, _ = _batch()
    zero = torch.zeros(B, dtype=torch.float64)
    for loss in (grpo_loss(logp, logp.detach() - 0.1, zero, mask).sum(),
                 wd1_loss(logp.sum(-1), zero).sum() + spg_loss(logp.sum(-1), logp.sum(-1), zero).sum()):
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.equal(grad, torch.zeros_like(grad))


def test_clipping_stops_the_gradient_on_the_advantages_side():
    logp, mask, A = _batch(1)
    g = torch.Generator().manual_seed(3)
    old = (logp.detach() - 0.5 * torch.randn(B, L, generator=g, dtype=torch.float64))
    eps = 0.2
    loss = grpo_loss(logp, old, A, mask, epsilon=eps).sum()
    (grad,) = torch.autograd.grad(loss, logp)
    rho = torch.exp(logp.detach() - old)
    clipped = ((A[:, None] > 0) & (rho > 1 + eps)) | ((A[:, None] < 0) & (rho < 1 - eps))
    assert (clipped & mask).any() and (~clipped & mask).any()
    assert torch.equal(grad[clipped], torch.zeros_like(grad[clipped]))
    free = ~clipped & mask
    want = -(A[:, None] * rho / (mask.sum(-1, keepdim=True) * B)).expand(B, L)
    assert torch.allclose(grad[free], want[free])


def test_k3_kl_is_zero_at_the_reference_and_positive_elsewhere():
    logp, mask, _ = _batch()
    zero = torch.zeros(B, dtype=torch.float64)
    at_ref = grpo_loss(logp, logp.detach(), zero, mask, ref_logp=logp.detach(), beta=0.1)
    assert torch.allclose(at_ref, torch.zeros_like(at_ref))
    away = grpo_loss(logp, logp.detach(), zero, mask, ref_logp=logp.detach() - 0.3, beta=0.1)
    assert (away[mask] > 0).all() and (away[~mask] == 0).all()
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, logp.detach(), zero, mask, beta=0.1)


def test_wd1_weights_are_softmaxes_of_the_advantage():
    logp, _, A = _batch()
    seq = logp.sum(-1)
    got = wd1_loss(seq, A)
    want = (torch.softmax(-A, 0) - torch.softmax(A, 0)) * seq
    assert torch.allclose(got, want)
    grouped = wd1_loss(seq, A, group_size=3)
    assert torch.allclose(grouped[:3], (torch.softmax(-A[:3], 0) - torch.softmax(A[:3], 0)) * seq[:3])


def test_spg_takes_the_lower_bound_for_positive_and_the_upper_for_negative_advantages():
    lower, upper = torch.tensor([-5.0, -5.0, -5.0]), torch.tensor([-4.0, -4.0, -4.0])
    A = torch.tensor([1.0, -1.0, -2.0])
    assert torch.allclose(spg_loss(lower, upper, A), torch.tensor([5.0, -4.0, -8.0]))
    assert torch.allclose(spg_loss(lower, upper, A, mix_weight=0.5), torch.tensor([5.0, -4.5, -9.0]))


def test_spg_with_the_elbo_for_both_signs_is_on_policy_grpo_for_equal_lengths():
    """docs/guides/rl.md's identity: a block model has no EUBO, so SPG's ω = 0 (the ELBO for both signs); with one
    inner update and completions of one length N, SPG's ``Σ_i −A_i ELBO_i / (B N)`` and on-policy GRPO (ratio 1,
    ``"grpo"`` normalisation) have the same gradient; with ragged lengths GRPO's ``1/|o_i|`` makes them differ."""
    logp, _, A = _batch()
    full = torch.ones(B, L, dtype=torch.bool)
    (g_grpo,) = torch.autograd.grad(grpo_loss(logp, logp.detach(), A, full).sum(), logp)
    elbo = logp.sum(-1)
    (g_spg,) = torch.autograd.grad(spg_loss(elbo, elbo, A).sum() / (B * L), logp)
    assert torch.allclose(g_grpo, g_spg, rtol=0, atol=1e-15)
    _, ragged, _ = _batch(1)
    (g_grpo,) = torch.autograd.grad(grpo_loss(logp, logp.detach(), A, ragged).sum(), logp)
    elbo = (logp * ragged).sum(-1)
    (g_spg,) = torch.autograd.grad(spg_loss(elbo, elbo, A).sum() / (B * L), logp)
    assert not torch.allclose(g_grpo, g_spg)


def test_dpo_prefers_the_chosen_completion():
    c, r = torch.tensor([-3.0], requires_grad=True), torch.tensor([-3.0], requires_grad=True)
    loss = dpo_loss(c, r, torch.tensor([-3.0]), torch.tensor([-3.0]), beta=0.5)
    assert torch.allclose(loss, torch.log(torch.tensor([2.0])))
    loss.sum().backward()
    assert c.grad is not None and r.grad is not None and c.grad < 0 < r.grad


def test_a_grpo_step_in_a_user_loop_moves_the_policy():
    """The guide's GRPO step (docs/guides/rl.md) on a tiny model: shared-seed scoring, k3 KL, two updates."""
    import copy

    import unifusion as uf

    from ._exact import adapted

    policy = adapted()
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-2)
    G = 4
    prompt = torch.randint(4, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    completions = torch.randint(4, 128, (G, 4), generator=torch.Generator().manual_seed(1))  # stand-in rollouts
    ids = torch.cat([prompt.repeat(G, 1), completions], 1)
    completion_mask = torch.zeros_like(ids, dtype=torch.bool)
    completion_mask[:, prompt.shape[1]:] = True
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), G)

    def score(model):
        return uf.rl.sequence_logprob(model, ids, completion_mask, estimator="coupled",
                                      generator=torch.Generator().manual_seed(1234))

    with torch.no_grad():
        old = score(policy).per_token
        ref = score(reference).per_token
    before = [p.detach().clone() for p in policy.parameters()]
    for _ in range(2):
        new = score(policy).per_token
        loss = grpo_loss(new, old, advantages, completion_mask, ref_logp=ref, beta=0.04).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    with torch.no_grad():  # the same seed scores the old policy again: identical, so the first ratio was exactly 1
        assert torch.equal(score(reference).per_token, ref)
