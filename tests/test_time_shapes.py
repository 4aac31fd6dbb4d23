"""One rule for the shape of ``t`` in every public function (``unifusion._validation.TIME_RULE``).

A float, a 0-d tensor, ``(B,)`` and ``(B, 1)`` mean the same thing for tokens of shape ``(B, L)``: ``(B,)`` is one time
per row, also when B == L (where plain broadcasting would silently spread it along the positions). A 1-D ``t`` of
another length is a ``ValueError`` that states the rule.
"""

from __future__ import annotations

import pytest
import torch
from _hf_tiny import tiny_model

import unifusion as uf

B = L = 4  # the ambiguous case: broadcasting a (B,) t against (B, L) tokens would pair t_j with position j
S = 9


def _times():
    t_row = torch.tensor([0.1, 0.4, 0.6, 0.9])
    return t_row, {"(B,)": t_row, "(B, 1)": t_row[:, None], "(B, L)": t_row[:, None].expand(B, L).clone()}


def _tokens(S_: int = S):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, S_ - 1, (B, L), generator=g), torch.randint(0, S_ - 1, (B, L), generator=g)


KERNELS = {"uniform": uf.UniformKernel(S), "mask": uf.MaskKernel(S, S - 1), "hybrid": uf.HybridKernel(S, S - 1, 0.2)}


def _entry_points(kernel):
    """Every public function taking tokens (B, L) and a time: name → fn(t) → tensor."""
    x0, x_t = _tokens()
    x_t = torch.where(torch.rand(B, L, generator=torch.Generator().manual_seed(1)) < 0.5, x0, x_t)
    if kernel.mask_id is not None:
        x_t[:, 0] = kernel.mask_id
    logits = torch.randn(B, L, S, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    probs = torch.softmax(torch.where(torch.arange(S) == (kernel.mask_id if kernel.mask_id is not None else -1),
                                      -torch.inf, logits), -1)
    score = torch.rand(B, L, S, dtype=torch.float64) + 0.1
    return {
        "marginal(ids)": lambda t: kernel.marginal(x0, t),
        "marginal(probs)": lambda t: kernel.marginal(probs, t),
        "rate_into": lambda t: kernel.rate_into(x_t, t),
        "transition_into": lambda t: kernel.transition_into(x_t, t / 2 if isinstance(t, torch.Tensor) else t / 2, t),
        "posterior": lambda t: kernel.posterior(probs, x_t, t / 2, t),
        "sample": lambda t: kernel.sample(x0, t, generator=torch.Generator().manual_seed(3)),
        "ReverseRate.from_x0": lambda t: uf.ReverseRate.from_x0(kernel, probs, x_t, t).rates,
        "ReverseRate.from_x0_logits": lambda t: uf.ReverseRate.from_x0_logits(kernel, logits, x_t, t).rates,
        "ReverseRate.from_score": lambda t: uf.ReverseRate.from_score(kernel, score, x_t, t).rates,
        "ReverseRate.true_conditional": lambda t: uf.ReverseRate.true_conditional(kernel, x0, x_t, t).rates,
        "convert_x0_to(sedd)": lambda t: uf.convert_x0_to("sedd", probs, kernel, x_t, t),
        "gidd_loss": lambda t: uf.losses.gidd_loss(logits, x0, x_t, t, kernel),
        "reference_gidd_loss": lambda t: uf.losses.reference_gidd_loss(logits, x0, x_t, t, kernel),
        "x0_head_loss": lambda t: uf.losses.x0_head_loss(logits, x0, x_t, t, kernel),
        "sedd_loss": lambda t: uf.losses.sedd_loss(torch.log(score), x0, x_t, t, kernel),
        "m2s_loss": lambda t: uf.losses.m2s_loss(logits, x0, x_t, t, kernel),
        "fused_linear_diffusion_loss": lambda t: uf.losses.fused_linear_diffusion_loss(
            logits, torch.eye(S, dtype=torch.float64), x0, x_t, t, kernel),
    }


@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_every_entry_point_reads_a_1d_t_as_one_time_per_row(kernel_name):
    kernel = KERNELS[kernel_name]
    t_row, forms = _times()
    for name, fn in _entry_points(kernel).items():
        expected = fn(forms["(B, L)"])
        for form in ("(B,)", "(B, 1)"):
            torch.testing.assert_close(fn(forms[form]), expected, msg=f"{name} with t of shape {form}")
        # a row of its own: each row equals the same call with that row's time as a float
        if name not in ("sample",):
            for b in (0, 3):
                row = fn(float(t_row[b]))
                torch.testing.assert_close(expected[b].to(row.dtype), row[b], rtol=1e-5, atol=1e-6,
                                           msg=f"{name}: row {b}")


@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_a_1d_t_of_another_length_is_an_error_that_states_the_rule(kernel_name):
    kernel = KERNELS[kernel_name]
    bad = torch.full((L + 1,), 0.5)
    for _name, fn in _entry_points(kernel).items():
        with pytest.raises(ValueError, match="a 1-D t holds one time per row"):
            fn(bad)
    with pytest.raises(ValueError, match="tokens' number of dims"):
        KERNELS["uniform"].marginal(torch.zeros(2, 3, 4, dtype=torch.long), torch.full((2, 3), 0.5))


def test_floats_and_0d_tensors_everywhere():
    kernel = KERNELS["mask"]
    for name, fn in _entry_points(kernel).items():
        a, b = fn(0.5), fn(torch.tensor(0.5))
        if name != "sample":
            torch.testing.assert_close(a.to(b.dtype), b, msg=name)


def test_a_grid_of_times_over_the_tokens_still_broadcasts():
    """More dims than the tokens (a grid) is plain broadcasting: nothing to misread."""
    q = KERNELS["uniform"].marginal(torch.arange(3), torch.tensor([[0.2], [0.5]]))
    assert q.shape == (2, 3, S)


def test_diffusion_loss_and_the_model_take_every_form():
    model = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=False)
    kernel = uf.UniformKernel(model.num_states)
    x0 = torch.randint(0, model.num_states, (B, L), generator=torch.Generator().manual_seed(0))
    t_row, forms = _times()
    model.eval()
    ref = uf.diffusion_loss(model, x0, kernel, t=t_row, generator=torch.Generator().manual_seed(5))
    assert torch.equal(ref.t, t_row)
    for form in ("(B, 1)",):
        out = uf.diffusion_loss(model, x0, kernel, t=forms[form], generator=torch.Generator().manual_seed(5))
        torch.testing.assert_close(out.loss, ref.loss)
    out = uf.diffusion_loss(model, x0, kernel, t=0.5, generator=torch.Generator().manual_seed(5))
    assert torch.equal(out.t, torch.full((B,), 0.5))
    with pytest.raises(ValueError, match="one time per sequence"):
        uf.diffusion_loss(model, x0, kernel, t=forms["(B, L)"])
    with pytest.raises(ValueError, match="a 1-D t holds one time per row"):
        uf.diffusion_loss(model, x0, kernel, t=torch.full((B + 1,), 0.5))
    logits = model(x0, t_row)
    torch.testing.assert_close(model(x0, t_row[:, None]), logits)
    torch.testing.assert_close(model(x0, 0.5), model(x0, torch.full((B,), 0.5)))
    with pytest.raises(ValueError, match="one time per sequence"):
        model(x0, forms["(B, L)"])


def test_nll_bound_and_sample_times_are_unchanged_in_shape():
    t = uf.sample_times(B)
    assert t.shape == (B,)
