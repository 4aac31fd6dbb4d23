"""Distillation through a model: a view's loss, the complementary pair, and LoRA students."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import unifusion as uf
from unifusion.distill import (
    add_lora,
    certainty_forcing_loss,
    complementary_pair_loss,
    distillation_loss,
    pseudo_trajectory_mask,
    record_trajectories,
    view_loss,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hf_tiny import tiny_model  # noqa: E402

MASK, K = 3, 4


def _model(dtype=torch.float64, seed=0):
    return uf.adapt_ar_model(tiny_model("llama", seed=seed), mask_token_id=MASK, block_size=K).eval().to(dtype)


@pytest.fixture(scope="module")
def traj():
    return record_trajectories(_model(), [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]], max_new_tokens=8,
                               progress=False, eos_token_id=None)


def test_a_views_loss_is_certainty_forcing_of_the_models_block_logits(traj):
    model = _model()
    x0, am = traj.sequences, traj.attention_mask
    view = pseudo_trajectory_mask(traj.commit_step, torch.tensor([0, 3, 6]), block_size=K)
    masked = torch.cat([torch.zeros_like(traj.prompt_mask), view.masked], 1)
    logits = model(torch.where(masked, MASK, x0), clean=x0, attention_mask=am)
    want = certainty_forcing_loss(logits, x0, masked, mask_id=MASK)
    for fused in (True, False):
        torch.testing.assert_close(view_loss(model, x0, masked, attention_mask=am, fused=fused), want)


def test_a_state_per_block_gives_each_block_the_logits_of_its_view_alone(traj):
    """``per_block``: every block at its own state in one forward scores each block exactly as the view with that
    block alone at its state (the others clean) — the block model's blocks never see a later or a masked earlier
    block."""
    model = _model()
    x0, am = traj.sequences, traj.attention_mask
    states = torch.tensor([[0, 4], [1, 5], [-1, 6]])  # (B, 2 blocks of K): states inside each block's steps
    view = pseudo_trajectory_mask(traj.commit_step, states, block_size=K)
    pad = torch.zeros_like(traj.prompt_mask)
    masked = torch.cat([pad, view.masked], 1)
    assert view.masked[:, :K].any() and view.masked[:, K:].any()
    with torch.no_grad():
        logits = model(torch.where(masked, MASK, x0), clean=x0, attention_mask=am)
        P = pad.shape[1]
        for b in range(2):
            cols = torch.zeros_like(view.masked)
            cols[:, b * K:(b + 1) * K] = True
            alone = torch.cat([pad, view.masked & cols], 1)
            want = model(torch.where(alone, MASK, x0), clean=x0, attention_mask=am)
            block = slice(P + b * K, P + (b + 1) * K)
            torch.testing.assert_close(logits[:, block], want[:, block], rtol=1e-12, atol=1e-12)


def test_pair_is_two_views_and_fused_equals_logits_in_float64(traj):
    model = _model()
    x0, am = traj.sequences, traj.attention_mask
    view = pseudo_trajectory_mask(traj.commit_step, torch.tensor([1, 2, 7]), block_size=K)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = complementary_pair_loss(model, x0, view, attention_mask=am)
    g_fused = torch.autograd.grad(fused, params)
    plain = complementary_pair_loss(model, x0, view, attention_mask=am, fused=False)
    g_plain = torch.autograd.grad(plain, params)
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_fused, g_plain):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    pad = torch.zeros_like(traj.prompt_mask)
    two = sum(view_loss(model, x0, torch.cat([pad, v.masked], 1), attention_mask=am)
              for v in (view, view.complement()))
    torch.testing.assert_close(fused, two)


def test_lora_distillation_changes_only_the_adapters(traj):
    pytest.importorskip("peft")
    student = add_lora(_model(torch.float32), r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    trainable = [n for n, p in student.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    opt = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.5)
    for seed in range(2):
        loss = distillation_loss(student, traj, generator=torch.Generator().manual_seed(seed))
        loss.backward()
        opt.step()
        opt.zero_grad()
    changed = {n for n, p in student.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and changed <= set(trainable)
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)


def test_distillation_loss_mask_kinds_and_errors(traj):
    model = _model(torch.float32)
    g = torch.Generator().manual_seed(0)
    for kw in (dict(masks="trajectory"), dict(masks="trajectory", per_block=True),
               dict(masks="random", ratio=0.5), dict(masks="trajectory", later_blocks="masked")):
        loss = distillation_loss(model, traj, generator=g, **kw)
        assert loss.dim() == 0 and torch.isfinite(loss) and loss > 0
    with pytest.raises(ValueError, match="masks"):
        distillation_loss(model, traj, masks="other")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="per_block"):
        distillation_loss(model, traj, masks="random", per_block=True)
    plain = uf.adapt_ar_model(tiny_model("llama", seed=0), mask_token_id=MASK)  # no blocks
    with pytest.raises(ValueError, match="per_block.*block model"):
        distillation_loss(plain, traj, per_block=True)
    with pytest.raises(TypeError, match="model"):
        view_loss(torch.nn.Linear(2, 2), traj.sequences, traj.sequences > 0)  # type: ignore[arg-type]


def test_a_wrapped_model_is_called_so_its_hooks_fire(traj):
    """The loss runs inside the module's call (``forward(..., head_fn=)``): a forward hook of the module sees the one
    call of a step, and a ``torch.compile`` wrapper gives the same loss and gradients as the module (DDP and FSDP2:
    tests/test_distributed.py)."""
    model = _model(torch.float32).train()
    calls = []
    handle = model.register_forward_hook(lambda module, args, out: calls.append(out))
    want = distillation_loss(model, traj, per_block=True, generator=torch.Generator().manual_seed(0))
    handle.remove()
    assert len(calls) == 1 and calls[0] is want  # head_fn's value is what the call returns
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend="eager")  # dynamo's tracing, no code generation
    got = distillation_loss(compiled, traj, per_block=True, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got, want.detach())
    got.backward()
    for a, b in zip(want_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(b, a)
    with pytest.raises(TypeError, match="model: add LoRA to the student before wrapping it"):
        add_lora(compiled)
