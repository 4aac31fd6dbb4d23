"""The easy mistakes fail loudly, naming the argument (issue: first use without silent mistakes).

Kernel and model must agree on the mask token; generators are generators; meta tensors and device mismatches are
caught before any computation; callbacks are checked before the first step; empty batches name what was passed;
parameterizations must match what a DiffusionLM outputs; ``top_k`` fits the vocabulary.
"""

from __future__ import annotations

import re
from pathlib import Path

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


TASK = Path(__file__).parent / "data" / "tiny_task.json"
OUT = Path(__file__).parent / "data" / "never_written"  # every call fails its kernel check before writing


def _tokenizer():
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
        "fair_pmi_scores": lambda: uf.eval.fair_pmi_scores(model, kernel, x0[0, :3], [x0[0, 3:]], x0[0, :1]),
        "run_multiple_choice": lambda: uf.eval.run_multiple_choice(TASK, model, kernel, _tokenizer(), progress=False),
        "DiffusionLM.generate": lambda: model.generate(x0[:1, :3], max_new_tokens=2, num_steps=2, kernel=kernel),
        "x0_model_as": lambda: uf.samplers.x0_model_as(model, kernel, "sedd"),
        "EulerSampler(x0_model_as)": lambda: uf.EulerSampler(uf.samplers.x0_model_as(model, kernel, "ctmc"), kernel,
                                                              2, parameterization="ctmc").sample(1, 4),
        "frontier(euler)": lambda: uf.eval.frontier(model, kernel, steps=(2,), seeds=(0,), num_samples=1, seq_len=4,
                                                    judge_model=model, judge_tokenizer=None, tokenizer=None,
                                                    out_dir=OUT, sampler="euler", plot=False, progress=False),
    }


def test_a_mask_kernel_with_another_mask_id_is_an_error_everywhere(model):
    for kernel in (uf.MaskKernel(model.num_states, 5), uf.HybridKernel(model.num_states, 5, 0.1)):
        for name, call in _wrong_mask_calls(model, kernel).items():
            with pytest.raises(ValueError, match=rf"mask_id=5 but the model's mask token is {model.mask_token_id}"):
                call()
                pytest.fail(name)
    assert not OUT.exists()


def test_a_mask_kernel_on_a_model_without_a_mask_token_is_an_error_everywhere(no_mask_model):
    kernel = uf.MaskKernel(no_mask_model.num_states, 0)
    for name, call in _wrong_mask_calls(no_mask_model, kernel).items():
        with pytest.raises(ValueError, match="add_mask_token=False"):
            call()
            pytest.fail(name)


def test_a_kernel_with_another_number_of_states_is_an_error_everywhere(model):
    kernel = uf.UniformKernel(model.num_states + 3)
    for name, call in _wrong_mask_calls(model, kernel).items():
        with pytest.raises(ValueError, match=rf"kernel: has {model.num_states + 3} states but the model predicts "
                                             rf"{model.num_states}"):
            call()
            pytest.fail(name)


def test_the_matching_kernel_passes_the_same_calls(model):
    """The checks are not over-eager: the model's own mask token works for x0_model_as and the Euler sampler."""
    kernel = uf.MaskKernel(model.num_states, model.mask_token_id)
    sedd = uf.samplers.x0_model_as(model, kernel, "sedd")
    out = uf.EulerSampler(sedd, kernel, 2, parameterization="sedd").sample(1, 4, generator=torch.Generator())
    assert out.shape == (1, 4) and not (out == model.mask_token_id).any()


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
        "score_choices": lambda: uf.eval.score_choices(model, kernel, x0[0, :3], [x0[0, 3:]], generator=0),
        "fair_pmi_scores": lambda: uf.eval.fair_pmi_scores(model, kernel, x0[0, :3], [x0[0, 3:]], x0[0, :1],
                                                           generator=0),
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


class _OnCuda(torch.nn.Module):
    """A model whose parameters report cuda:0 (device metadata is all the checks read), so a model/input device
    mismatch is exercised through the public entry points on a CPU-only machine. Calling it is a test failure."""

    num_states = 10

    def parameters(self, recurse=True):
        class Parameter:
            device = torch.device("cuda", 0)

        yield Parameter()

    def forward(self, x_t, t=None, **_):
        raise AssertionError("the device check must fail before the model is called")


def test_a_model_input_device_mismatch_names_the_argument_at_every_entry_point():
    model, kernel = _OnCuda(), uf.UniformKernel(_OnCuda.num_states)
    x0 = torch.zeros(2, 3, dtype=torch.long)
    moved = r"is on cpu but the model's parameters are on cuda:0; move it with \.to\('cuda:0'\)"
    with pytest.raises(ValueError, match="x0: " + moved):
        uf.diffusion_loss(model, x0, kernel)
    with pytest.raises(ValueError, match="x0: " + moved):
        uf.eval.nll_bound(model, x0, kernel, num_times=2)
    for sampler in (uf.BayesianSampler(model, kernel, 2), uf.EulerSampler(model, kernel, 2)):
        with pytest.raises(ValueError, match="prompt: " + moved):
            sampler.sample(2, 3, prompt=torch.full((2, 3), -1))
        with pytest.raises(ValueError, match="generator: " + moved):
            sampler.sample(2, 3, generator=torch.Generator())
        with pytest.raises(ValueError, match="device: " + moved):
            sampler.sample(2, 3, device="cpu")


def test_meta_inputs_name_the_argument_at_every_entry_point(model):
    """Meta tensors have no values: each entry point says which argument is on the meta device (no deep torch error);
    the other side (the model, here on the CPU) is fine."""
    kernel = uf.UniformKernel(model.num_states)
    meta_x0 = _x0(model).to("meta")
    with pytest.raises(ValueError, match="x0: is on the meta device"):
        uf.diffusion_loss(model, meta_x0, kernel)
    with pytest.raises(ValueError, match="x0: is on the meta device"):
        uf.eval.nll_bound(model, meta_x0, kernel, num_times=2)
    for sampler in (uf.BayesianSampler(model, kernel, 2), uf.EulerSampler(model, kernel, 2)):
        with pytest.raises(ValueError, match="prompt: is on the meta device"):
            sampler.sample(1, 4, prompt=torch.full((1, 4), -1, device="meta"))
        with pytest.raises(ValueError, match="device: is on the meta device"):
            sampler.sample(1, 4, device="meta")
    meta_out = uf.EulerSampler(lambda x_t, t: torch.zeros(*x_t.shape, 7, device="meta"), uf.UniformKernel(7), 2)
    with pytest.raises(ValueError, match="model: returned x0 logits on the meta device"):
        meta_out.sample(1, 4)


def test_a_meta_model_is_an_error_at_every_entry_point():
    with torch.device("meta"):
        meta_model = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=False)
    kernel = uf.UniformKernel(meta_model.num_states)
    x0 = _x0(meta_model)
    message = "model: its parameters are on the meta device"
    with pytest.raises(ValueError, match=message):
        uf.eval.nll_bound(meta_model, x0, kernel, num_times=2)
    with pytest.raises(ValueError, match=message):
        uf.EulerSampler(meta_model, kernel, 2).sample(1, 4)
    with pytest.raises(ValueError, match=message):
        uf.BayesianSampler(meta_model, kernel, 2).sample(1, 4, prompt=torch.full((1, 4), -1))


def _loss_calls(S=7):
    """Every loss and rate constructor: name → (fn, argument), fn's only keyword (default: a real tensor) being the
    argument to put on the meta device."""
    kernel, mask = uf.UniformKernel(S), uf.MaskKernel(S, S - 1)
    g = torch.Generator().manual_seed(0)
    x0, x_t = torch.randint(0, S - 1, (2, 3), generator=g), torch.randint(0, S, (2, 3), generator=g)
    logits, log_exit = torch.randn(2, 3, S, generator=g), torch.randn(2, 3, generator=g)
    probs, times = logits.softmax(-1), torch.full((2,), 0.5)
    L_ = uf.losses
    return {
        "gidd_loss": (lambda x0_logits=logits: L_.gidd_loss(x0_logits, x0, x_t, 0.5, kernel), "x0_logits"),
        "x0_head_loss": (lambda x0_logits=logits: L_.x0_head_loss(x0_logits, x0, x_t, 0.5, kernel), "x0_logits"),
        "mdlm_loss": (lambda x0_logits=logits: L_.mdlm_loss(x0_logits, x0, x_t, 0.5, mask), "x0_logits"),
        "reference_gidd_loss": (lambda x0_logits=logits: L_.reference_gidd_loss(x0_logits, x0, x_t, 0.5, kernel),
                                "x0_logits"),
        "reference_mdlm_loss": (lambda x0_logits=logits: L_.reference_mdlm_loss(x0_logits, x0, x_t, 0.5, mask),
                                "x0_logits"),
        "sedd_loss": (lambda log_score=logits: L_.sedd_loss(log_score, x0, x_t, 0.5, kernel), "log_score"),
        "m2s_loss": (lambda mu_logits=logits: L_.m2s_loss(mu_logits, x0, x_t, 0.5, kernel), "mu_logits"),
        "ctmc_loss(log_exit_rate)": (lambda log_exit_rate=log_exit: L_.ctmc_loss(log_exit_rate, logits, x0, x_t, 0.5,
                                                                                 kernel), "log_exit_rate"),
        "ctmc_loss(jump_logits)": (lambda jump_logits=logits: L_.ctmc_loss(log_exit, jump_logits, x0, x_t, 0.5,
                                                                           kernel), "jump_logits"),
        "fused_linear_diffusion_loss": (lambda hidden=logits: L_.fused_linear_diffusion_loss(
            hidden, torch.eye(S), x0, x_t, 0.5, kernel), "hidden"),
        "ReverseRate.from_x0_logits": (lambda x0_logits=logits: uf.ReverseRate.from_x0_logits(kernel, x0_logits, x_t,
                                                                                               0.5), "x0_logits"),
        "ReverseRate.from_score": (lambda score=probs: uf.ReverseRate.from_score(kernel, score, x_t, 0.5), "score"),
        "ReverseRate.from_posterior_mean": (lambda mu=probs: uf.ReverseRate.from_posterior_mean(kernel, mu, x_t, 0.5),
                                            "mu"),
        "convert_x0_to": (lambda x0_probs=probs: uf.convert_x0_to("sedd", x0_probs, kernel, x_t, 0.5), "x0_probs"),
        "losses(x_t)": (lambda x_t=x_t: L_.gidd_loss(logits, x0, x_t, 0.5, kernel), "x_t"),
        "losses(t)": (lambda t=times: L_.gidd_loss(logits, x0, x_t, t, kernel), "t"),
    }


def test_meta_heads_and_inputs_in_every_loss_name_the_argument():
    for name, (call, argument) in _loss_calls().items():
        call()  # on real tensors: fine
        value = call.__defaults__[0]
        with pytest.raises(ValueError, match=rf"^{argument}: is on the meta device"):
            call(value.to("meta"))
            pytest.fail(name)


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
    for shape in ((0, 6), (2, 0)):
        with pytest.raises(ValueError, match=r"x0: expected a non-empty batch of token ids.*got "
                                             + re.escape(str(shape))):
            uf.eval.nll_bound(model, torch.zeros(shape, dtype=torch.long), kernel, num_times=2)


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


# ---------------------------------------------------------------------------------------------------- converted heads
class _TableModel:
    """A plain x0 model on S = 9 states (logits from a table of x_t), for the converted-head checks."""

    num_states = 9

    def __init__(self) -> None:
        self.table = torch.randn(9, 9, generator=torch.Generator().manual_seed(3))

    def __call__(self, x_t, t):
        return self.table[x_t]


def _x0_readers(model, kernel):
    """Every public function that reads a model's output as x0 logits: name → call."""
    x0 = torch.randint(0, 8, (2, 6), generator=torch.Generator().manual_seed(0))
    return {
        "BayesianSampler": lambda: uf.BayesianSampler(model, kernel, 2),
        "EulerSampler(parameterization='x0')": lambda: uf.EulerSampler(model, kernel, 2),
        "diffusion_loss": lambda: uf.diffusion_loss(model, x0, kernel),
        "nll_bound": lambda: uf.eval.nll_bound(model, x0, kernel, num_times=2),
        "score_choices": lambda: uf.eval.score_choices(model, kernel, x0[0, :3], [x0[0, 3:]]),
        "fair_pmi_scores": lambda: uf.eval.fair_pmi_scores(model, kernel, x0[0, :3], [x0[0, 3:]], x0[0, :1]),
        "frontier(bayesian)": lambda: uf.eval.frontier(model, kernel, steps=(2,), seeds=(0,), num_samples=1,
                                                       seq_len=4, judge_model=model, judge_tokenizer=None,
                                                       tokenizer=None, out_dir=OUT, plot=False, progress=False),
        "x0_model_as": lambda: uf.samplers.x0_model_as(model, kernel, "sedd"),
    }


@pytest.mark.parametrize("parameterization", ["sedd", "m2s", "ctmc"])
def test_a_converted_head_is_refused_where_x0_logits_are_read(parameterization):
    """``x0_model_as(m, k, "sedd")`` returns log scores: a sampler or evaluator reading them as x0 logits would run
    silently on the wrong numbers. Each refuses it, naming the head it got and the one it reads."""
    kernel = uf.MaskKernel(9, 8)
    converted = uf.samplers.x0_model_as(_TableModel(), kernel, parameterization)
    assert converted.unifusion_parameterization == parameterization and converted.kernel is kernel
    for name, call in _x0_readers(converted, kernel).items():
        if name.startswith("EulerSampler"):
            expected = (rf"parameterization: the model returns .* \(parameterization '{parameterization}', from "
                        rf"uf\.samplers\.x0_model_as\(model, kernel, '{parameterization}'\)\), got "
                        rf"parameterization='x0'; pass parameterization='{parameterization}'")
        else:
            expected = (rf"model: returns .* \(parameterization '{parameterization}', from uf\.samplers\.x0_model_as"
                        r".*\), but .* reads the model's output as x0 logits")
        with pytest.raises(ValueError, match=expected):
            call()
            pytest.fail(name)
    # the matching use: EulerSampler with the same parameterization and kernel; the frontier with its Euler sampler
    out = uf.EulerSampler(converted, kernel, 3, parameterization=parameterization).sample(
        2, 5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 5) and not (out == 8).any()
    with pytest.raises(ValueError, match=rf"got parameterization='x0'; pass parameterization='{parameterization}'"):
        uf.eval.frontier(converted, kernel, steps=(2,), seeds=(0,), num_samples=1, seq_len=4,
                         judge_model=converted, judge_tokenizer=None, tokenizer=None, out_dir=OUT, sampler="euler")


def test_an_x0_wrapper_and_a_diffusion_lm_pass_where_x0_logits_are_read(model):
    kernel = uf.MaskKernel(9, 8)
    as_x0 = uf.samplers.x0_model_as(_TableModel(), kernel, "x0")
    assert uf.BayesianSampler(as_x0, kernel, 2).sample(1, 4).shape == (1, 4)
    uf.eval.nll_bound(as_x0, torch.zeros(1, 4, dtype=torch.long), kernel, num_times=2)
    with pytest.raises(ValueError, match="a DiffusionLM outputs x0 logits"):
        uf.EulerSampler(model, uf.UniformKernel(model.num_states), 2, parameterization="m2s")
    # an "x0" wrapper converts nothing: the model inside it is checked (its mask token), not the wrapper's kernel
    as_x0_lm = uf.samplers.x0_model_as(model, uf.MaskKernel(model.num_states, model.mask_token_id), "x0")
    uf.BayesianSampler(as_x0_lm, uf.UniformKernel(model.num_states), 2)
    with pytest.raises(ValueError, match=rf"mask_id=5 but the model's mask token is {model.mask_token_id}"):
        uf.BayesianSampler(as_x0_lm, uf.MaskKernel(model.num_states, 5), 2)


def test_a_converted_head_under_another_kernel_is_an_error_naming_both():
    """The conversions depend on the kernel: a SEDD head converted under the mask kernel is not a SEDD head of the
    uniform kernel (same number of states, so nothing else would catch it)."""
    mask, uniform = uf.MaskKernel(9, 8), uf.UniformKernel(9)
    converted = uf.samplers.x0_model_as(_TableModel(), mask, "sedd")
    with pytest.raises(ValueError, match=r"kernel: the model was converted by x0_model_as with MaskKernel\("
                                         r"num_states=9, mask_id=8, .*\), got UniformKernel\(num_states=9"):
        uf.EulerSampler(converted, uniform, 2, parameterization="sedd")
    # an equal kernel built anew is the same process: fine
    uf.EulerSampler(converted, uf.MaskKernel(9, 8), 2, parameterization="sedd")
    with pytest.raises(ValueError, match="converted by x0_model_as"):
        uf.EulerSampler(converted, uf.MaskKernel(9, 8, uf.schedules.CosineSchedule()), 2, parameterization="sedd")


def test_a_tagged_callable_is_checked_like_a_wrapper():
    """Any callable may say what it returns (``unifusion_parameterization``); untagged callables are not checked."""

    def sedd_net(x_t, t):
        return torch.zeros(*x_t.shape, 9)

    kernel = uf.UniformKernel(9)
    uf.BayesianSampler(sedd_net, kernel, 2)  # untagged: nothing known
    sedd_net.unifusion_parameterization = "sedd"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"model: returns SEDD log scores \(parameterization 'sedd', from its "
                                         r"unifusion_parameterization tag\), but BayesianSampler reads"):
        uf.BayesianSampler(sedd_net, kernel, 2)
    assert uf.EulerSampler(sedd_net, kernel, 2, parameterization="sedd").sample(1, 3).shape == (1, 3)


def test_calling_a_converted_head_checks_devices():
    """Called directly, an x0_model_as wrapper names ``x_t`` when it is on another device than the wrapped model's
    parameters; the samplers see the wrapped model's device; a meta model is named as the model."""
    kernel = uf.UniformKernel(_OnCuda.num_states)
    converted = uf.samplers.x0_model_as(_OnCuda(), kernel, "sedd")
    moved = r"is on cpu but the model's parameters are on cuda:0; move it with \.to\('cuda:0'\)"
    with pytest.raises(ValueError, match="x_t: " + moved):
        converted(torch.zeros(2, 3, dtype=torch.long), 0.5)
    with pytest.raises(ValueError, match="prompt: " + moved):
        uf.EulerSampler(converted, kernel, 2, parameterization="sedd").sample(2, 3, prompt=torch.full((2, 3), -1))
    with pytest.raises(ValueError, match="x_t: is on the meta device"):
        converted(torch.zeros(2, 3, dtype=torch.long, device="meta"), 0.5)
    with torch.device("meta"):
        meta_model = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=False)
    meta_kernel = uf.UniformKernel(meta_model.num_states)
    meta_converted = uf.samplers.x0_model_as(meta_model, meta_kernel, "m2s")
    with pytest.raises(ValueError, match="model: its parameters are on the meta device"):
        meta_converted(torch.zeros(2, 3, dtype=torch.long), 0.5)
    with pytest.raises(ValueError, match="model: its parameters are on the meta device"):
        uf.EulerSampler(meta_converted, meta_kernel, 2, parameterization="m2s").sample(1, 4)


# ---------------------------------------------------------------------------------------------------- generate
def test_generate_names_its_own_arguments(model):
    """DiffusionLM.generate's errors name generate's arguments (prompt_ids, model), not the sampler's it calls."""
    prompt = _x0(model, B=1, L=3)
    with pytest.raises(ValueError, match="^prompt_ids: is on the meta device"):
        model.generate(prompt.to("meta"), max_new_tokens=2, num_steps=2)
    with pytest.raises(ValueError, match=rf"^prompt_ids: expected clean token ids in \[0, {model.num_states}\) "
                                         rf"other than the mask id {model.mask_token_id}, got values in"):
        model.generate(torch.tensor([[1, model.mask_token_id]]), max_new_tokens=2, num_steps=2)
    with pytest.raises(ValueError, match=rf"^prompt_ids: expected clean token ids in \[0, {model.num_states}\)"):
        model.generate(torch.tensor([[1, model.num_states]]), max_new_tokens=2, num_steps=2)
    with pytest.raises(TypeError, match="^generator: expected a torch.Generator or None, got int"):
        model.generate(prompt, max_new_tokens=2, num_steps=2, generator=0)  # type: ignore[arg-type]
    with torch.device("meta"):
        meta_model = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=False)
    for meta_prompt in (prompt, prompt.to("meta")):
        with pytest.raises(ValueError, match="^model: its parameters are on the meta device"):
            meta_model.generate(meta_prompt, max_new_tokens=2, num_steps=2)
    # a uniform kernel on the mask model: the mask id is then an ordinary noise state, allowed in the prompt
    out = model.generate(torch.tensor([[1, model.mask_token_id]]), max_new_tokens=2, num_steps=2,
                         kernel=uf.UniformKernel(model.num_states), generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 4) and out[0, 1] == model.mask_token_id
