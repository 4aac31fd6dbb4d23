"""The RL objectives: zero advantages give zero gradient, on-policy GRPO is REINFORCE in every normalisation, the clip
stops the gradient exactly where the ratio leaves its range on the advantage's side."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from unifusion.rl import dpo_loss, group_advantages, grpo_loss, spg_loss, wd1_loss

B, L = 6, 7


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logps = (-3 * torch.rand(B, L, generator=g, dtype=torch.float64)).requires_grad_()
    mask = torch.rand(B, L, generator=g) < 0.7
    mask[:, 0] = True
    A = torch.randn(B, generator=g, dtype=torch.float64)
    return logps, mask, A


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
    logps, mask, A = _batch()
    budget = {"dr_grpo": 9}.get(normalization)  # Dr.GRPO's completion budget (max_new_tokens)
    loss = grpo_loss(logps, logps.detach(), A, mask, level=level, normalization=normalization, max_length=budget).sum()
    (grad,) = torch.autograd.grad(loss, logps)
    n = mask.sum(-1).double()
    norm = {"grpo": n * B, "dr_grpo": torch.full((B,), float(B * 9), dtype=torch.float64),
            "dapo": torch.full((B,), float(mask.sum()), dtype=torch.float64)}[normalization]
    # −A_i ∇x_{i,t} / norm_i on both levels (sequence: ∇ρ_i = Σ_t ∇x_{i,t} / |o_i|, shared by |o_i| tokens)
    reinforce = -(A / norm)[:, None] * mask
    assert torch.allclose(grad, reinforce.double())


def test_the_objectives_refuse_what_would_fail_silently():
    """A grad-carrying old or reference estimate (the ratio's gradient would vanish into it), NaN rewards (a whole
    group of NaN advantages), a negative clip side or coefficient, Dr.GRPO without its length budget."""
    logps, mask, A = _batch()
    with pytest.raises(ValueError, match="old_logps: carries a gradient"):
        grpo_loss(logps, logps, A, mask)
    with pytest.raises(ValueError, match="ref_logps: carries a gradient"):
        grpo_loss(logps, logps.detach(), A, mask, ref_logps=logps * 1.0, kl_coef=0.1)
    with pytest.raises(ValueError, match="rewards: expected finite values, got NaN or inf at rows \\[1\\]"):
        group_advantages(torch.tensor([1.0, float("nan"), 0.0, 1.0]), 2)
    for name, kwargs in (("epsilon_high", {"epsilon_high": -0.1}), ("epsilon", {"epsilon": -0.2}),
                         ("kl_coef", {"kl_coef": -0.04, "ref_logps": logps.detach()})):
        with pytest.raises(ValueError, match=f"{name}: expected"):
            grpo_loss(logps, logps.detach(), A, mask, **kwargs)
    with pytest.raises(ValueError, match="max_length: normalization='dr_grpo'"):
        grpo_loss(logps, logps.detach(), A, mask, normalization="dr_grpo")
    with pytest.raises(ValueError, match="dpo_beta: expected DPO's"):
        dpo_loss(logps[:, 0], logps[:, 1], logps[:, 2], logps[:, 3], dpo_beta=-0.1)
    # the gradient that a grad-carrying old_logps would have hidden: on policy, the ratio's gradient is REINFORCE's
    (grad,) = torch.autograd.grad(grpo_loss(logps, logps.detach(), A, mask).sum(), logps)
    assert grad.norm() > 0


def test_zero_advantages_give_zero_gradient():
    logps, mask, _ = _batch()
    zero = torch.zeros(B, dtype=torch.float64)
    for loss in (grpo_loss(logps, logps.detach() - 0.1, zero, mask).sum(),
                 wd1_loss(logps.sum(-1), zero).sum() + spg_loss(logps.sum(-1), logps.sum(-1), zero).sum()):
        (grad,) = torch.autograd.grad(loss, logps)
        assert torch.equal(grad, torch.zeros_like(grad))


def test_clipping_stops_the_gradient_on_the_advantages_side():
    logps, mask, A = _batch(1)
    g = torch.Generator().manual_seed(3)
    old = (logps.detach() - 0.5 * torch.randn(B, L, generator=g, dtype=torch.float64))
    eps = 0.2
    loss = grpo_loss(logps, old, A, mask, epsilon=eps).sum()
    (grad,) = torch.autograd.grad(loss, logps)
    rho = torch.exp(logps.detach() - old)
    clipped = ((A[:, None] > 0) & (rho > 1 + eps)) | ((A[:, None] < 0) & (rho < 1 - eps))
    assert (clipped & mask).any() and (~clipped & mask).any()
    assert torch.equal(grad[clipped], torch.zeros_like(grad[clipped]))
    free = ~clipped & mask
    want = -(A[:, None] * rho / (mask.sum(-1, keepdim=True) * B)).expand(B, L)
    assert torch.allclose(grad[free], want[free])


def test_k3_kl_is_zero_at_the_reference_and_positive_elsewhere():
    logps, mask, _ = _batch()
    zero = torch.zeros(B, dtype=torch.float64)
    at_ref = grpo_loss(logps, logps.detach(), zero, mask, ref_logps=logps.detach(), kl_coef=0.1)
    assert torch.allclose(at_ref, torch.zeros_like(at_ref))
    away = grpo_loss(logps, logps.detach(), zero, mask, ref_logps=logps.detach() - 0.3, kl_coef=0.1)
    assert (away[mask] > 0).all() and (away[~mask] == 0).all()
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, logps.detach(), zero, mask, kl_coef=0.1)


def test_wd1_weights_are_softmaxes_of_the_advantage():
    logps, _, A = _batch()
    seq = logps.sum(-1)
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
    logps, _, A = _batch()
    full = torch.ones(B, L, dtype=torch.bool)
    (g_grpo,) = torch.autograd.grad(grpo_loss(logps, logps.detach(), A, full).sum(), logps)
    elbo = logps.sum(-1)
    (g_spg,) = torch.autograd.grad(spg_loss(elbo, elbo, A).sum() / (B * L), logps)
    assert torch.allclose(g_grpo, g_spg, rtol=0, atol=1e-15)
    _, ragged, _ = _batch(1)
    (g_grpo,) = torch.autograd.grad(grpo_loss(logps, logps.detach(), A, ragged).sum(), logps)
    elbo = (logps * ragged).sum(-1)
    (g_spg,) = torch.autograd.grad(spg_loss(elbo, elbo, A).sum() / (B * L), logps)
    assert not torch.allclose(g_grpo, g_spg)


def test_dpo_prefers_the_chosen_completion():
    c, r = torch.tensor([-3.0], requires_grad=True), torch.tensor([-3.0], requires_grad=True)
    loss = dpo_loss(c, r, torch.tensor([-3.0]), torch.tensor([-3.0]), dpo_beta=0.5)
    assert torch.allclose(loss, torch.log(torch.tensor([2.0])))
    loss.sum().backward()
    assert c.grad is not None and r.grad is not None and c.grad < 0 < r.grad


def _guide_loop() -> str:
    """The own-loop GRPO block of docs/guides/rl.md, as written there."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "rl.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    (code,) = [b for b in blocks if "for _ in range(num_inner_updates)" in b]
    return code


@pytest.mark.parametrize("block_size", [None, 4], ids=["bidirectional", "block"])
def test_the_guides_grpo_loop_runs_and_scores_the_rollouts_as_sampled(block_size):
    """docs/guides/rl.md's own-loop GRPO step, run as written on a tiny model (the policy line builds it) with a
    5-token prompt (not a multiple of the block size): it moves the policy; the old policy's scores are the ones
    of the same rows left-padded to a block boundary (the blocks the decoder sampled from, whatever the alignment)."""
    import unifusion as uf

    from ._exact import tiny_model

    tok = PreTrainedTokenizerFast.from_pretrained(Path(__file__).resolve().parents[1] / "data" / "tiny_tokenizer")
    code = _guide_loop()
    assert "uf.adapt_ar_model(hf_model, tokenizer=tok)" in code
    code = code.replace("uf.adapt_ar_model(hf_model, tokenizer=tok)", "make_policy()")

    def make_policy():
        return uf.adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=block_size, tokenizer=tok)

    torch.manual_seed(0)
    scope = {"make_policy": make_policy, "tok": tok, "step": 7, "num_inner_updates": 2,
             "prompt": torch.randint(4, 100, (1, 5), generator=torch.Generator().manual_seed(0)),
             "reward": lambda completions: completions.float().mean(-1)}
    code = code.replace("max_new_tokens=128", "max_new_tokens=8")
    exec(compile(code.replace("lr=1e-6", "lr=1e-2"), "rl.md", "exec"), scope)
    policy, reference, loss = scope["policy"], scope["reference"], scope["loss"]
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(reference.parameters(), policy.parameters()))
    ids, completion, attention = scope["ids"], scope["completion_mask"], scope["attention_mask"]
    pad = 3 if block_size else 0  # 5 + 3 = 8: the completion starts on a block boundary
    with torch.no_grad():
        again = uf.rl.sequence_logprob(
            reference, torch.cat([torch.zeros(ids.shape[0], pad, dtype=torch.long), ids], 1),
            torch.cat([torch.zeros(ids.shape[0], pad, dtype=torch.bool), completion], 1),
            estimator=scope["estimator"], generator=torch.Generator().manual_seed(7),
            attention_mask=torch.cat([torch.zeros(ids.shape[0], pad, dtype=torch.long), attention], 1))
    if block_size:
        torch.testing.assert_close(again.per_token[:, pad:], scope["ref"], rtol=0, atol=1e-5)
