"""prompt_mask (supervised fine-tuning): prompt tokens clean at every time, scored 0, not counted; the conditional
bound of nll_bound."""

from __future__ import annotations

import pytest
import torch
from _hf_tiny import VOCAB, tiny_model

import unifusion as uf
from unifusion.eval.likelihood import nll_bound

MASK_ID = 3


@pytest.fixture(autouse=True)
def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()


def _model(block_size: int | None = None) -> uf.DiffusionLM:
    return uf.adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, block_size=block_size)


def _kernel(name: str) -> uf.Kernel:
    return uf.MaskKernel(VOCAB, MASK_ID) if name == "mask" else uf.UniformKernel(VOCAB)


def _x0(B: int, L: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, VOCAB, (B, L), generator=torch.Generator().manual_seed(seed))


PROMPT = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0, 0, 0],   # a prompt ending mid-block (block size 4)
                       [1, 1, 0, 0, 0, 0, 1, 1, 0, 0]],  # multi-turn: a second user turn inside the row
                      dtype=torch.bool)


@pytest.mark.parametrize("kernel_name", ["mask", "uniform"])
@pytest.mark.parametrize("block_size", [None, 4])
@pytest.mark.parametrize("fused", [False, True])
def test_prompt_is_clean_scores_zero_and_does_not_count(kernel_name: str, block_size: int | None,
                                                        fused: bool) -> None:
    model, kernel, x0 = _model(block_size), _kernel(kernel_name), _x0(2, 10)
    pad = torch.ones(2, 10, dtype=torch.long)
    pad[1, 8:] = 0  # right padding in row 1
    for t in (0.5, 1 - 1e-6):
        out = uf.diffusion_loss(model, x0, kernel, t=t, prompt_mask=PROMPT, attention_mask=pad, fused=fused,
                                generator=torch.Generator().manual_seed(0))
        assert torch.equal(out.x_t[PROMPT], x0[PROMPT])  # clean at any time
        assert torch.equal(out.loss[PROMPT], torch.zeros_like(out.loss[PROMPT]))  # exactly 0
        scored = ~PROMPT & pad.bool()
        assert out.num_tokens.item() == scored.sum().item() == 9
        assert torch.equal(out.mask, scored.to(out.mask.dtype))
        assert (out.loss[scored] > 0).any()
        assert (out.x_t[scored] != x0[scored]).any()  # the rest is noised


@pytest.mark.parametrize("block_size", [None, 4])
def test_fused_equals_unfused_with_a_prompt(block_size: int | None) -> None:
    model, kernel, x0 = _model(block_size), _kernel("mask"), _x0(2, 10)
    outs = []
    for fused in (False, True):
        model.zero_grad()
        out = uf.diffusion_loss(model, x0, kernel, prompt_mask=PROMPT, fused=fused,
                                generator=torch.Generator().manual_seed(1))
        out.mean().backward()
        outs.append((out.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_an_empty_prompt_mask_changes_nothing() -> None:
    model, kernel, x0 = _model(), _kernel("mask"), _x0(2, 10)
    a = uf.diffusion_loss(model, x0, kernel, generator=torch.Generator().manual_seed(0))
    b = uf.diffusion_loss(model, x0, kernel, generator=torch.Generator().manual_seed(0),
                          prompt_mask=torch.zeros(2, 10, dtype=torch.bool))
    assert torch.equal(a.loss, b.loss) and torch.equal(a.x_t, b.x_t)


def test_prompt_is_seen_by_the_predictions() -> None:
    """Changing the prompt changes the loss of the response (the prompt is visible, not padding)."""
    model, kernel, x0 = _model(), _kernel("mask"), _x0(2, 10)
    other = x0.clone()
    other[PROMPT] = (other[PROMPT] + 9) % (VOCAB - 4) + 4
    a = uf.diffusion_loss(model, x0, kernel, t=0.5, prompt_mask=PROMPT, generator=torch.Generator().manual_seed(0))
    b = uf.diffusion_loss(model, other, kernel, t=0.5, prompt_mask=PROMPT,
                          generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(a.loss, b.loss)


@pytest.mark.parametrize("block_size", [None, 4])
def test_nll_bound_is_conditional_on_the_prompt(block_size: int | None) -> None:
    model, kernel, x0 = _model(block_size), _kernel("mask"), _x0(2, 10)

    def bound(x, prompt):
        return nll_bound(model, x, kernel, num_times=8, prompt_mask=prompt, generator=torch.Generator().manual_seed(0),
                         per_token=False)

    full = bound(x0, None)
    cond = bound(x0, PROMPT)
    assert torch.isfinite(cond).all() and (cond < full).all()  # fewer tokens scored
    assert torch.equal(bound(x0, torch.zeros_like(PROMPT)), full)
    other = x0.clone()
    other[PROMPT] = (other[PROMPT] + 9) % (VOCAB - 4) + 4
    assert not torch.allclose(bound(other, PROMPT), cond)  # changes with the prompt
    # the response tokens only: per token is the conditional bound over the scored tokens
    per_tok = nll_bound(model, x0, kernel, num_times=8, prompt_mask=PROMPT, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(per_tok, cond / (~PROMPT).sum(-1))


@pytest.mark.parametrize("fn", ["loss", "bound"])
def test_bad_prompt_masks(fn: str) -> None:
    model, kernel, x0 = _model(), _kernel("mask"), _x0(2, 10)

    def call(prompt, **kwargs):
        if fn == "loss":
            return uf.diffusion_loss(model, x0, kernel, prompt_mask=prompt, **kwargs)
        return nll_bound(model, x0, kernel, num_times=2, prompt_mask=prompt, **kwargs)

    with pytest.raises(TypeError, match="prompt_mask"):
        call(PROMPT.long())
    with pytest.raises(TypeError, match="prompt_mask"):
        call([[True] * 10] * 2)
    with pytest.raises(ValueError, match="prompt_mask"):
        call(PROMPT[:, :9])
    whole = PROMPT.clone()
    whole[1] = True
    with pytest.raises(ValueError, match="prompt_mask.*rows \\[1\\]"):
        call(whole)
    # a row whose only non-prompt tokens are padding is covered too
    pad = torch.ones(2, 10, dtype=torch.long)
    pad[1, 8:] = 0
    partial = PROMPT.clone()
    partial[1, :8] = True
    with pytest.raises(ValueError, match="prompt_mask"):
        call(partial, attention_mask=pad)
