"""The easy mistakes fail loudly, naming the argument (issue: first use without silent mistakes).

Kernel and model must agree on the mask token; generators are generators; meta tensors and device mismatches are
caught before any computation; callbacks are checked before the first step; empty batches name what was passed;
parameterizations must match what a DiffusionLM outputs; ``top_k`` fits the vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from _hf_tiny import tiny_model

import unifusion as uf


@pytest.fixture(scope="module")
def model():
    return uf.adapt_ar_model(tiny_model("llama"))  # mask token added: id V, S = V + 1


@pytest.fixture(scope="module")
def no_mask_model():
    return uf.adapt_ar_model(tiny_model("llama"), add_mask_token=False)


def _x0(model, B=2, L=6):
    return torch.randint(0, model.num_states - 1, (B, L), generator=torch.Generator().manual_seed(0))


def _tokenizer():
    from pathlib import Path

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(__file__).parent / "data" / "tiny_tokenizer")


# ---------------------------------------------------------------------------------------------------- mask agreement
def _wrong_mask_calls(model, kernel):
    x0 = _x0(model)
    return {
        "diffusion_loss": lambda: uf.diffusion_loss(model, x0, kernel),
        "BayesianSampler": lambda: uf.BayesianSampler(model, kernel, 2).sample(1, 4),
        "EulerSampler": lambda: uf.EulerSampler(model, kernel, 2).sample(1, 4),
        "nll_bound": lambda: uf.eval.nll_bound(model, x0, kernel, num_times=2),
        "score_choices": lambda: uf.eval.score_choices(model, kernel, x0[0, :3], [x0[0, 3:]]),
    }


def test_a_mask_kernel_with_another_mask_id_is_an_error_everywhere(model):
    kernel = uf.MaskKernel(model.num_states, 5)
    for _name, call in _wrong_mask_calls(model, kernel).items():
        with pytest.raises(ValueError, match=rf"mask_id=5 but the model's mask token is {model.mask_token_id}"):
            call()


def test_a_mask_kernel_on_a_model_without_a_mask_token_is_an_error_everywhere(no_mask_model):
    kernel = uf.MaskKernel(no_mask_model.num_states, 0)
    for _name, call in _wrong_mask_calls(no_mask_model, kernel).items():
        with pytest.raises(ValueError, match="add_mask_token=False"):
            call()


def test_the_frontier_checks_the_kernel(model, tmp_path):
    with pytest.raises(ValueError, match="mask token"):
        uf.eval.frontier(model, uf.HybridKernel(model.num_states, 3, 0.1), steps=(2,), seeds=(0,), num_samples=1,
                         seq_len=4, judge_model=model, judge_tokenizer=None, tokenizer=None, out_dir=tmp_path)


# ---------------------------------------------------------------------------------------------------- generators
def test_an_int_generator_is_a_type_error_with_a_hint(model):
    kernel = uf.UniformKernel(model.num_states)
    x0 = _x0(model)
    calls = {
        "Kernel.sample": lambda: kernel.sample(x0, 0.5, generator=0),
        "Kernel.sample_prior": lambda: kernel.sample_prior((2, 3), generator=0),
        "sample_times": lambda: uf.sample_times(4, generator=0),
        "diffusion_loss": lambda: uf.diffusion_loss(model, x0, kernel, generator=0),
        "nll_bound": lambda: uf.eval.nll_bound(model, x0, kernel, num_times=2, generator=0),
        "BayesianSampler.sample": lambda: uf.BayesianSampler(model, kernel, 2).sample(1, 4, generator=0),
        "EulerSampler.sample": lambda: uf.EulerSampler(model, kernel, 2).sample(1, 4, generator=0),
    }
    for _name, call in calls.items():
        with pytest.raises(TypeError, match=r"generator: expected a torch.Generator or None, got int; use "
                                            r"torch.Generator\(\).manual_seed\(0\)"):
            call()


# ---------------------------------------------------------------------------------------------------- devices
def test_meta_device_models_and_inputs(model):
    kernel = uf.UniformKernel(model.num_states)
    with torch.device("meta"):
        meta_model = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=False)
    x0 = _x0(meta_model)
    with pytest.raises(ValueError, match="model: its parameters are on the meta device"):
        uf.diffusion_loss(meta_model, x0, uf.UniformKernel(meta_model.num_states))
    with pytest.raises(ValueError, match="model: its parameters are on the meta device"):
        uf.BayesianSampler(meta_model, uf.UniformKernel(meta_model.num_states), 2).sample(1, 4)
    with pytest.raises(ValueError, match="x0: is on the meta device"):
        kernel.sample(torch.zeros(2, 3, dtype=torch.long, device="meta"), 0.5)
    with pytest.raises(ValueError, match="t: is on the meta device"):
        kernel.marginal(torch.zeros(2, 3, dtype=torch.long), torch.full((2,), 0.5, device="meta"))


def test_inputs_on_another_device_than_the_model(model):
    """The check reads device metadata only, so it is exercised on the CPU with a stand-in whose parameters report
    cuda:0."""
    from unifusion import _validation as V

    class OnCuda:
        def parameters(self):
            class Parameter:
                device = torch.device("cuda", 0)

            yield Parameter()

    x0 = _x0(model)
    with pytest.raises(ValueError, match=r"x0: is on cpu but the model's parameters are on cuda:0; move it with "
                                         r"\.to\('cuda:0'\)"):
        V.check_model_device(OnCuda(), "x0", x0)
    V.check_model_device(model, "x0", x0)  # the same device: fine
    V.check_model_device(lambda x_t, t: x_t, "x0", x0)  # a callable without parameters: nothing to compare


# ---------------------------------------------------------------------------------------------------- samplers
def test_callback_of_the_wrong_arity_fails_before_the_first_step(model):
    kernel = uf.UniformKernel(model.num_states)
    calls = []

    def two_args(step, t):
        calls.append(step)

    for sampler in (uf.BayesianSampler(model, kernel, 3), uf.EulerSampler(model, kernel, 3)):
        with pytest.raises(TypeError, match=r"callback: expected a callable taking \(step, t, x_t\)"):
            sampler.sample(1, 4, callback=two_args)
    assert calls == []
    uf.BayesianSampler(model, kernel, 2).sample(1, 4, callback=lambda *args: None)  # *args is fine
    uf.BayesianSampler(model, kernel, 2).sample(1, 4, callback=lambda step, t, x_t, extra=0: None)


def test_euler_sampler_parameterization_must_match_a_diffusion_lm(model):
    kernel = uf.UniformKernel(model.num_states)
    with pytest.raises(ValueError, match="a DiffusionLM outputs x0 logits.*x0_model_as"):
        uf.EulerSampler(model, kernel, 2, parameterization="sedd")
    sedd = uf.samplers.x0_model_as(model, kernel, "sedd")
    assert uf.EulerSampler(sedd, kernel, 2, parameterization="sedd").sample(1, 4).shape == (1, 4)


def test_top_k_larger_than_the_vocabulary(model):
    kernel = uf.UniformKernel(model.num_states)
    with pytest.raises(ValueError, match=f"top_k: expected at most num_states = {model.num_states}"):
        uf.BayesianSampler(model, kernel, 2, top_k=model.num_states + 1)
    with pytest.raises(ValueError, match="top_k"):
        uf.EulerSampler(model, kernel, 2, top_k=10**6)
    uf.BayesianSampler(model, kernel, 2, top_k=model.num_states)  # keeps every token: allowed


# ---------------------------------------------------------------------------------------------------- batches
def test_an_empty_batch_names_what_was_passed(model):
    kernel = uf.UniformKernel(model.num_states)
    with pytest.raises(ValueError, match=r"x0: expected a non-empty batch.*got \(0, 6\)"):
        uf.diffusion_loss(model, torch.zeros(0, 6, dtype=torch.long), kernel)
    with pytest.raises(ValueError, match=r"x_t: expected a non-empty batch"):
        model(torch.zeros(0, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="batch_size"):
        uf.BayesianSampler(model, kernel, 2).sample(0, 4)


def test_step_on_a_model_that_cannot_anneal_warns():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 10)

        def forward(self, x_t, t):
            return self.emb(x_t)

    with pytest.warns(UserWarning, match="cannot anneal"):
        uf.diffusion_loss(Plain(), torch.randint(0, 10, (2, 3)), uf.UniformKernel(10), step=5)


def test_step_and_bidirectional_prob_together_is_an_error_naming_both(model):
    """Both set γ: one would be silently ignored, so giving both is a ValueError naming both."""
    kernel = uf.UniformKernel(model.num_states)
    x0 = _x0(model)
    with pytest.raises(ValueError, match=r"step, bidirectional_prob: give one of them, got step=5 and "
                                         r"bidirectional_prob=0.5"):
        uf.diffusion_loss(model, x0, kernel, step=5, bidirectional_prob=0.5)
    # either alone is fine, and step anneals γ = step / anneal_steps
    assert uf.diffusion_loss(model, x0, kernel, step=5, anneal_steps=10).bidirectional_prob == 0.5
    assert uf.diffusion_loss(model, x0, kernel, bidirectional_prob=0.25).bidirectional_prob == 0.25
