"""unifusion.distill on every released kind (tiny random configs): recording, replay, the distillation loss through
the kind's own hidden states and head (shifted heads included), an optimizer step, LoRA, the learned commit rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _hf_tiny import tiny_native
from transformers import PreTrainedTokenizerFast

from unifusion.distill import (
    CommitHead,
    LearnedCommit,
    add_lora,
    certainty_forcing_loss,
    collect_commit_data,
    complementary_pair_loss,
    distillation_loss,
    draw_trajectory_steps,
    pseudo_trajectory_mask,
    record_trajectories,
    replay,
    train_commit_head,
    view_loss,
)
from unifusion.samplers.policies import LowConfidence

TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "tiny_tokenizer"
KINDS = ["llada", "dream", "lladamoe", "sdar", "fast_dllm", "llada2"]
MOE = {"lladamoe", "llada2"}  # transformers' grouped expert matmul takes no float64
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
K = 4  # the decoder's block on the bidirectional kinds (the block kinds' fixtures have blocks of 4)


@pytest.fixture(scope="module")
def tokenizer():
    return PreTrainedTokenizerFast.from_pretrained(TOKENIZER)


def _kind(kind, tokenizer, seed=0):
    model = tiny_native(kind, tokenizer, seed=seed).eval()
    return model if kind in MOE else model.double()


def _record(model, **kw):
    """Greedy LowConfidence trajectories, one token per forward; the block kinds through their exact KV cache."""
    block = {} if model.block_size is not None else {"block_size": K}
    return record_trajectories(model, PROMPTS, max_new_tokens=2 * K, policy=LowConfidence(), progress=False,
                               eos_token_id=None, **block, **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_a_released_kind_records_replays_and_distils(kind, tokenizer):
    model = _kind(kind, tokenizer)
    traj = _record(model, use_cache=model.block_size is not None)
    assert traj.block_size == K and (traj.commit_step >= 0).all()
    if model.block_size is not None:  # the uncached block decoder records the same tokens
        assert torch.equal(_record(model, use_cache=False).completion_ids, traj.completion_ids)
    out = model.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=2 * K, policy=LowConfidence(), do_sample=False,
                         eos_token_id=None, return_trace=True, **({} if model.block_size else {"block_size": K}))
    assert torch.equal(out.sequences[0, len(PROMPTS[1]):], traj.completion_ids[1])
    assert torch.equal(replay(model, traj), traj.completion_ids)
    assert not torch.equal(replay(_kind(kind, tokenizer, seed=1), traj), traj.completion_ids)

    # a view's loss scores each position with the logits the kind's forward gives it (diffusion_loss's call: the
    # shifted kinds read token i at the column before it, the block kinds run the clean stream), each row as it runs
    # alone, unpadded: the released block kinds' blocks from its first token, as their decoders cut them
    x0, am = traj.sequences, traj.attention_mask
    # a state per block: every block masked, so a block kind's clean stream differs from its one-stream forward
    lead = traj.block_leads
    assert lead.tolist() == ([3, 1, 2] if model.block_origin == "sequence_start" else [0, 0, 0])
    states = draw_trajectory_steps(traj.commit_step, block_size=K, per_block=True, lead=lead,
                                   generator=torch.Generator().manual_seed(1))
    view = pseudo_trajectory_mask(traj.commit_step, states, block_size=K, lead=lead)
    masked = torch.cat([torch.zeros_like(traj.prompt_mask), view.masked], 1)
    mask_id = model.mask_token_id
    with torch.no_grad():
        logits = torch.zeros(*x0.shape, model.num_states, dtype=model.dtype)
        for r in range(len(traj)):
            real = am[r]
            x_r, m_r = x0[r, real][None], masked[r, real][None]
            extra = model.block_conditioning(x_r) if model.block_size is not None else {}
            logits[r, real] = model(torch.where(m_r, mask_id, x_r), **extra)[0]
        want = certainty_forcing_loss(logits, x0, masked, mask_id=mask_id)
        for fused in (True, False):
            torch.testing.assert_close(view_loss(model, x0, masked, attention_mask=am, fused=fused), want)

    # the fused head equals the materialised logits, loss and gradients (float64; float32 on the MoE kinds)
    params = [p for p in model.parameters() if p.requires_grad]
    tol = dict(rtol=1e-10, atol=1e-12) if model.dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    fused = complementary_pair_loss(model, x0, view, attention_mask=am)
    g_fused = torch.autograd.grad(fused, params, allow_unused=True)
    plain = complementary_pair_loss(model, x0, view, attention_mask=am, fused=False)
    g_plain = torch.autograd.grad(plain, params, allow_unused=True)
    torch.testing.assert_close(fused, plain, **tol)
    assert sum(g is not None for g in g_fused) == sum(g is not None for g in g_plain) > 0
    for a, b in zip(g_fused, g_plain):
        if a is not None:
            torch.testing.assert_close(a, b, **tol)

    # one optimizer step changes the weights and lowers the loss of the view it took
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # (a small step on the MoE kinds: a larger one can move a token to other top-k experts, a jump in the loss)
    opt = torch.optim.SGD(params, lr=1e-4 if kind in MOE else 0.05)
    loss = distillation_loss(model, traj, generator=torch.Generator().manual_seed(0))
    loss.backward()
    opt.step()
    opt.zero_grad()
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        assert distillation_loss(model, traj, generator=torch.Generator().manual_seed(0)) < loss.detach()


@pytest.mark.parametrize("kind", ["llada", "sdar"])
def test_lora_distillation_of_a_released_kind_changes_only_the_adapters(kind, tokenizer):
    pytest.importorskip("peft")
    student = add_lora(tiny_native(kind, tokenizer).eval(), r=4, init_lora_weights=False)
    traj = _record(student)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    trainable = [n for n, p in student.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)  # "all-linear" leaves the output head alone
    opt = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.5)
    for seed in range(2):
        distillation_loss(student, traj, generator=torch.Generator().manual_seed(seed)).backward()
        opt.step()
        opt.zero_grad()
    changed = {n for n, p in student.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and changed <= set(trainable)
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)


@pytest.mark.parametrize("kind", ["dream", "fast_dllm"])
def test_the_learned_commit_rule_on_a_shifted_kind(kind, tokenizer):
    """Collected from the kind's decoding paths (hidden states of the shifted head), trained, and decoding with it:
    the block kind's cached and uncached paths give the same tokens."""
    model = tiny_native(kind, tokenizer).eval()
    prompts = torch.randint(4, 120, (4, 4), generator=torch.Generator().manual_seed(0))
    block = {} if model.block_size is not None else {"block_size": K}
    data = collect_commit_data(model, prompts, max_new_tokens=2 * K, eos_token_id=None, **block)
    assert len(data) > 0 and data.hidden.shape[-1] == model.config.hidden_size
    torch.manual_seed(0)
    head = CommitHead(model.config.hidden_size, width=8)
    train_commit_head(head, data, steps=20, lr=3e-3, generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=2 * K, policy=LearnedCommit(head, threshold=0.5), do_sample=False, eos_token_id=None,
              **block)
    uncached = model.generate(prompts, use_cache=False, **kw)
    assert uncached.shape == (4, 4 + 2 * K)
    if model.block_size is not None:
        assert torch.equal(model.generate(prompts, use_cache=True, **kw), uncached)


def test_a_model_without_a_mask_token_or_a_head_fn_is_refused(tokenizer):
    model = tiny_native("sdar", tokenizer).eval()
    traj = _record(model)
    model.mask_token_id = None
    with pytest.raises(ValueError, match="model: .*no mask token"):
        distillation_loss(model, traj)
    model = tiny_native("llada", tokenizer).eval()

    class NoHeadFn(type(model)):  # a kind whose forward gives logits only: the loss cannot run inside its call
        def forward(self, x_t, t=None, *, attention_mask=None):
            return super().forward(x_t, t, attention_mask=attention_mask)

    model.__class__ = NoHeadFn
    with pytest.raises(TypeError, match="model: .*head_fn"):
        view_loss(model, traj.sequences, traj.sequences > 100)
    with pytest.raises(TypeError, match="model"):
        distillation_loss(model.hf_model, traj)
