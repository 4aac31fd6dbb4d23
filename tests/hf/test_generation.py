"""unifusion.hf.generation: DiffusionLM.generate — shapes, the prompt prefix, determinism, the default kernel, equality
with the sampler, argument checks — on tiny random models (tests/_hf_tiny.py)."""

from __future__ import annotations

import pytest
import torch
from _hf_tiny import VOCAB, tiny_model

import unifusion as uf
from unifusion.hf import adapt_ar_model

MASK_ID = 3


def _prompt(B: int = 2, P: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, VOCAB, (B, P), generator=torch.Generator().manual_seed(seed))



@pytest.mark.parametrize("recorded", [None, "uniform", "hybrid"])
def test_generate_defaults_to_the_recorded_kernel_else_mask_else_uniform(recorded, monkeypatch) -> None:
    """generate's default kernel: the recorded one; else the mask kernel on the mask token; else uniform (a model
    without a mask token) — the rule of unifusion.hf.default_kernel, which the CLI follows too."""
    from unifusion.hf import generation
    from unifusion.samplers import bayesian

    used: list[uf.Kernel] = []

    class Spy(bayesian.BayesianSampler):
        def __init__(self, model, kernel, *args, **kwargs):
            used.append(kernel)
            super().__init__(model, kernel, *args, **kwargs)

    monkeypatch.setattr(generation, "BayesianSampler", Spy)  # the name generate calls
    with_mask = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    S = with_mask.num_states
    kernels = {None: None, "uniform": uf.UniformKernel(S), "hybrid": uf.HybridKernel(S, MASK_ID, 0.3)}
    with_mask.kernel = kernels[recorded]
    with_mask.generate(_prompt(1, 2), max_new_tokens=2, num_steps=2)
    without_mask = adapt_ar_model(tiny_model("llama"), add_mask_token=False)
    without_mask.generate(_prompt(1, 2), max_new_tokens=2, num_steps=2)
    if recorded is None:
        assert type(used[0]) is uf.MaskKernel and used[0].mask_id == MASK_ID
    else:
        assert used[0] is with_mask.kernel
    assert type(used[1]) is uf.UniformKernel and used[1].num_states == without_mask.num_states

@pytest.mark.parametrize("mask", [True, False])
def test_generate_shapes_prefix_and_determinism(mask: bool) -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID if mask else None, add_mask_token=mask)
    prompt = _prompt(2, 3)
    out = model.generate(prompt, max_new_tokens=5, num_steps=4, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 8) and out.dtype == torch.int64
    assert torch.equal(out[:, :3], prompt)
    assert ((out >= 0) & (out < model.num_states)).all()
    if mask:
        assert not (out == MASK_ID).any()  # the last step lands on clean tokens
    again = model.generate(prompt, seq_len=8, num_steps=4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    other = model.generate(prompt, seq_len=8, num_steps=4, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(out, other)

def test_generate_equals_the_sampler_with_a_prefix_prompt() -> None:
    model = adapt_ar_model(tiny_model("qwen2"), mask_token_id=MASK_ID)
    prompt = _prompt(1, 4)
    out = model.generate(prompt[0], max_new_tokens=4, num_steps=3, temperature=0.8, top_p=0.9,
                         generator=torch.Generator().manual_seed(5))
    fixed = torch.full((1, 8), -1)
    fixed[:, :4] = prompt
    ref = uf.BayesianSampler(model, uf.MaskKernel(model.num_states, mask_id=MASK_ID), 3, temperature=0.8,
                             top_p=0.9).sample(1, 8, prompt=fixed, generator=torch.Generator().manual_seed(5))
    assert torch.equal(out, ref)
    uniform = uf.UniformKernel(model.num_states)
    a = model.generate(prompt, max_new_tokens=4, num_steps=3, kernel=uniform,
                       generator=torch.Generator().manual_seed(2))
    b = uf.BayesianSampler(model, uniform, 3).sample(1, 8, prompt=fixed, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b)

def test_generate_empty_prompt_is_unconditional() -> None:
    model = adapt_ar_model(tiny_model("llama"), add_mask_token=False)
    out = model.generate(torch.zeros(3, 0, dtype=torch.long), max_new_tokens=6, num_steps=2,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (3, 6)

def test_generate_validates_arguments() -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    p = _prompt(2, 3)
    with pytest.raises(TypeError, match="prompt_ids"):
        model.generate([1, 2, 3], max_new_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prompt_ids"):
        model.generate(p.float(), max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_ids"):
        model.generate(p[None], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens, seq_len"):
        model.generate(p)
    with pytest.raises(ValueError, match="max_new_tokens, seq_len"):
        model.generate(p, max_new_tokens=2, seq_len=5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(p, max_new_tokens=0)
    with pytest.raises(ValueError, match="seq_len"):
        model.generate(p, seq_len=3)
    with pytest.raises(TypeError, match="max_new_tokens"):
        model.generate(p, max_new_tokens=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seq_len"):
        model.generate(p, seq_len=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_steps"):
        model.generate(p, max_new_tokens=2, num_steps=0)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(p, max_new_tokens=2, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(p, max_new_tokens=2, top_p=1.5)
    with pytest.raises(ValueError, match="prompt"):
        model.generate(torch.full((1, 2), MASK_ID), max_new_tokens=2)  # a mask token cannot be kept
