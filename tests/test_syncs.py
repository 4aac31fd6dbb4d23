"""Host syncs in the hot loops, counted on the CPU (a GPU would wait at each of them).

With default settings (validation on): one ``diffusion_loss`` step makes at most one host sync (all its value checks
read back together) and its backward none; the fused loss adds only the backward's one documented read of the incoming
gradient; a ``DiffusionLM`` forward makes one (none with validation off); the samplers validate once per
``sample()`` call, so their count does not grow with the number of steps (one generator or one per row);
``nll_bound`` likewise per time.
"""

from __future__ import annotations

import pytest
import torch
from _dispatch_count import DispatchCounter, count_syncs
from _hf_tiny import tiny_model

import unifusion as uf


@pytest.fixture(scope="module")
def model():
    return uf.adapt_ar_model(tiny_model("llama"))


def kernels(model):
    S, m = model.num_states, model.mask_token_id
    return {"uniform": uf.UniformKernel(S), "mask": uf.MaskKernel(S, m), "hybrid": uf.HybridKernel(S, m, 0.1)}


class Plain(torch.nn.Module):
    """A callable x0 model that is not a DiffusionLM."""

    def __init__(self, S: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(S, S)

    def forward(self, x_t, t):
        return self.emb(x_t)


def _x0(model):
    return torch.randint(0, model.num_states - 1, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kernel_name", ["uniform", "mask", "hybrid"])
@pytest.mark.parametrize("fused", [False, True])
def test_diffusion_loss_step(model, kernel_name, fused):
    kernel = kernels(model)[kernel_name]
    out, c = count_syncs(uf.diffusion_loss, model, _x0(model), kernel, generator=torch.Generator().manual_seed(1),
                         fused=fused, attention_mask=torch.ones(2, 8, dtype=torch.long))
    assert c.syncs <= 1, c.sync_ops
    with DispatchCounter() as b:
        out.mean().backward()
    assert b.syncs <= (1 if fused else 0), b.sync_ops


def test_diffusion_loss_with_a_plain_model_and_given_times(model):
    kernel = uf.UniformKernel(model.num_states)
    _, c = count_syncs(uf.diffusion_loss, Plain(model.num_states), _x0(model), kernel, t=torch.full((2, 1), 0.3))
    assert c.syncs <= 1, c.sync_ops


def test_model_forward(model):
    x_t, t = _x0(model), torch.rand(2)
    _, c = count_syncs(model, x_t, t, attention_mask=torch.ones(2, 8))
    assert c.syncs == 1, c.sync_ops
    with uf.validation(False):
        _, c = count_syncs(model, x_t, t)
    assert c.syncs == 0, c.sync_ops


def _sampler_syncs(make, steps):
    return [count_syncs(make(n).sample, 2, 8, generator=torch.Generator().manual_seed(0))[1] for n in steps]


@pytest.mark.parametrize("kernel_name", ["uniform", "mask", "hybrid"])
@pytest.mark.parametrize("options", [{}, {"top_k": 5}, {"top_p": 0.9, "temperature": 0.7}])
def test_bayesian_sampler_validates_once_per_call(model, kernel_name, options):
    kernel = kernels(model)[kernel_name]
    few, many = _sampler_syncs(lambda n: uf.BayesianSampler(model, kernel, n, **options), (2, 8))
    assert few.syncs == many.syncs <= 1, (few.sync_ops, many.sync_ops)


def test_bayesian_sampler_with_a_prompt(model):
    kernel = kernels(model)["mask"]
    prompt = torch.full((8,), -1)
    prompt[:3] = torch.tensor([1, 2, 3])
    counts = [count_syncs(uf.BayesianSampler(model, kernel, n).sample, 2, 8, prompt=prompt)[1] for n in (2, 8)]
    assert counts[0].syncs == counts[1].syncs <= 2, [c.sync_ops for c in counts]  # prompt checks + first output


@pytest.mark.parametrize("kernel_name", ["uniform", "mask", "hybrid"])
@pytest.mark.parametrize("parameterization", ["x0", "sedd", "m2s", "ctmc"])
def test_euler_sampler_validates_once_per_call(model, kernel_name, parameterization):
    kernel = kernels(model)[kernel_name]
    head = model if parameterization == "x0" else uf.samplers.x0_model_as(model, kernel, parameterization)
    few, many = _sampler_syncs(lambda n: uf.EulerSampler(head, kernel, n, parameterization=parameterization), (2, 8))
    assert few.syncs == many.syncs <= 1, (few.sync_ops, many.sync_ops)


@pytest.mark.parametrize("kernel_name", ["uniform", "mask", "hybrid"])
@pytest.mark.parametrize("cls", [uf.BayesianSampler, uf.EulerSampler])
def test_per_row_generators_add_no_sync_per_step(model, kernel_name, cls):
    kernel = kernels(model)[kernel_name]
    counts = [count_syncs(cls(model, kernel, n).sample, 2, 8, generator=[torch.Generator().manual_seed(i)
                                                                          for i in range(2)])[1] for n in (2, 8)]
    assert counts[0].syncs == counts[1].syncs <= 1, [c.sync_ops for c in counts]


def test_cache_unchanged_keeps_its_one_documented_sync_per_step(model):
    kernel = kernels(model)["mask"]
    few, many = _sampler_syncs(lambda n: uf.BayesianSampler(model, kernel, n, cache_unchanged=True), (2, 8))
    assert many.syncs - few.syncs == 6  # one per extra step


def test_nll_bound_does_not_sync_per_time(model):
    kernel = uf.UniformKernel(model.num_states)
    counts = [count_syncs(uf.eval.nll_bound, model, _x0(model), kernel, num_times=k)[1] for k in (2, 8)]
    assert counts[0].syncs == counts[1].syncs <= 2, [c.sync_ops for c in counts]
