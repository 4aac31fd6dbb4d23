"""sequence_logprob's ``compute_dtype``: the backbone's arithmetic chosen by the estimator, not by the caller's
autocast (docs/guides/rl.md, "bf16")."""

from __future__ import annotations

import copy

import pytest
import torch

import unifusion as uf
from unifusion.rl import sequence_logprob

from ._exact import tiny_model

B, L, P = 3, 10, 3  # prompts of 3 tokens, completions of 7: blocks of 4 cut at column 3


def _model() -> uf.DiffusionLM:
    return uf.adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=4)


def _batch(model: uf.DiffusionLM) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(4, model.mask_token_id, (B, L), generator=torch.Generator().manual_seed(1))
    completion = torch.zeros(B, L, dtype=torch.bool)
    completion[:, P:] = True
    return ids, completion


def _estimate(model: uf.DiffusionLM, ids: torch.Tensor, completion: torch.Tensor, *, autocast: bool = False,
              **kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The per-token estimate (under bf16 autocast with ``autocast``) and the gradient of its weighted sum (a
    GRPO-like loss) w.r.t. every weight, backward outside autocast as PyTorch prescribes (and the Trainer does)."""
    model.zero_grad(set_to_none=True)
    gens = [torch.Generator().manual_seed(10 + b) for b in range(B)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = sequence_logprob(model, ids, completion, estimator="elbo", num_samples=2, generator=gens, **kwargs)
        loss = (out.per_token * torch.linspace(-1.0, 1.0, B)[:, None]).sum()
    loss.backward()
    return out.per_token.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("compute_dtype", [None, torch.float32])
def test_under_bf16_autocast_a_float32_model_gives_the_float32_estimate_bit_for_bit(checkpointing, compute_dtype):
    model = _model().train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    ids, completion = _batch(model)
    plain, plain_grads = _estimate(model, ids, completion)
    mixed, _ = _estimate(model, ids, completion, autocast=True, compute_dtype=torch.bfloat16)
    exact, exact_grads = _estimate(model, ids, completion, autocast=True, compute_dtype=compute_dtype)
    assert (mixed - plain).abs()[completion].mean() > 1e-4  # bf16 does reach the backbone when asked
    torch.testing.assert_close(exact, plain, rtol=0, atol=0)
    assert len(exact_grads) == len(plain_grads) > 0
    for got, want in zip(exact_grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("ambient", [False, True])
def test_the_backbone_computes_in_the_dtype_asked_whatever_the_callers_autocast(ambient):
    model = _model().eval()
    ids, completion = _batch(model)
    seen: list[torch.dtype] = []
    linear = model.hf_model.model.layers[0].mlp.down_proj
    linear.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    for compute_dtype in (None, torch.float32, torch.bfloat16, torch.float16):
        seen.clear()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=ambient):
            sequence_logprob(model, ids, completion, num_samples=2, compute_dtype=compute_dtype)
        assert seen and set(seen) == {compute_dtype or torch.float32}, (compute_dtype, set(seen))


def test_bad_compute_dtype_is_refused_by_name():
    model = _model().eval()
    ids, completion = _batch(model)
    with pytest.raises(TypeError, match="compute_dtype: expected None or a torch.dtype, got str"):
        sequence_logprob(model, ids, completion, compute_dtype="float32")
    with pytest.raises(ValueError, match="compute_dtype: expected None or one of .* got torch.float64"):
        sequence_logprob(model, ids, completion, compute_dtype=torch.float64)
    low = copy.deepcopy(model).to(torch.bfloat16)
    with pytest.raises(ValueError, match="compute_dtype: torch.float32 computes in float32 only with float32 "
                                         "weights, got a model with torch.bfloat16 weights"):
        sequence_logprob(low, ids, completion, compute_dtype=torch.float32)
