"""One rule for the shape of ``t`` in every public function (``unifusion._validation.TIME_RULE``, docs/concepts.md).

A float, a 0-d tensor, ``(B,)`` and ``(B, 1)`` mean the same thing for tokens of shape ``(B, L)``: ``(B,)`` is one time
per row, also when B == L (where plain broadcasting would silently spread it along the positions). A 1-D ``t`` of
another length is a ``ValueError`` that states the rule. Checked by value: the ``(B,)`` result equals the ``(B, L)``
one, and row b equals the call with row b's time as a float.
"""

from __future__ import annotations

import pytest
import torch
from _hf_tiny import tiny_model

import unifusion as uf
from unifusion.samplers.euler import clean_distribution_from_head, reverse_rate_from_head
from unifusion.schedules import (
    CosineSchedule,
    DUOCosineSchedule,
    GeometricSchedule,
    LinearSchedule,
    LogLinearSchedule,
    MDLMCosineSchedule,
)

B = L = 4  # the ambiguous case: broadcasting a (B,) t against (B, L) tokens would pair t_j with position j
S = 9
T_ROW = torch.tensor([0.1, 0.4, 0.6, 0.9])


def _times():
    return T_ROW, {"(B,)": T_ROW, "(B, 1)": T_ROW[:, None], "(B, L)": T_ROW[:, None].expand(B, L).clone()}


def _tokens(S_: int = S):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, S_ - 1, (B, L), generator=g), torch.randint(0, S_ - 1, (B, L), generator=g)


def _generator_kernel() -> uf.GeneratorKernel:
    R = torch.rand(S, S, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    R = R - torch.diag(torch.diagonal(R))
    return uf.GeneratorKernel(R - torch.diag(R.sum(-1)))


KERNELS = {"uniform": uf.UniformKernel(S), "mask": uf.MaskKernel(S, S - 1), "hybrid": uf.HybridKernel(S, S - 1, 0.2),
           "generator": _generator_kernel()}


def _half(t):
    return t / 2


def _entry_points(kernel):
    """Every public function taking tokens (B, L) and a time: name → fn(t) → tensor with leading dims (B, L)."""
    x0, x_t = _tokens()
    x_t = torch.where(torch.rand(B, L, generator=torch.Generator().manual_seed(1)) < 0.5, x0, x_t)
    if kernel.mask_id is not None:
        x_t[:, 0] = kernel.mask_id
    logits = torch.randn(B, L, S, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    probs = torch.softmax(torch.where(torch.arange(S) == (kernel.mask_id if kernel.mask_id is not None else -1),
                                      -torch.inf, logits), -1)
    score = torch.rand(B, L, S, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.1
    log_exit = torch.randn(B, L, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def ctmc(t):
        exit_rate, jump = uf.convert_x0_to("ctmc", probs, kernel, x_t, t)
        return torch.cat([exit_rate.unsqueeze(-1), jump], -1)

    points = {
        "marginal(ids)": lambda t: kernel.marginal(x0, t),
        "marginal(probs)": lambda t: kernel.marginal(probs, t),
        "rate_into": lambda t: kernel.rate_into(x_t, t),
        "transition_into": lambda t: kernel.transition_into(x_t, _half(t), t),
        "posterior": lambda t: kernel.posterior(probs, x_t, _half(t), t),
        "sample": lambda t: kernel.sample(x0, t, generator=torch.Generator().manual_seed(3)),
        "sample_prior": lambda t: kernel.sample_prior((B, L), t=t, generator=torch.Generator().manual_seed(3)),
        "ReverseRate.from_x0": lambda t: uf.ReverseRate.from_x0(kernel, probs, x_t, t).rates,
        "ReverseRate.from_x0_logits": lambda t: uf.ReverseRate.from_x0_logits(kernel, logits, x_t, t).rates,
        "ReverseRate.from_score": lambda t: uf.ReverseRate.from_score(kernel, score, x_t, t).rates,
        "ReverseRate.from_posterior_mean": lambda t: uf.ReverseRate.from_posterior_mean(kernel, probs, x_t, t).rates,
        "ReverseRate.true_conditional": lambda t: uf.ReverseRate.true_conditional(kernel, x0, x_t, t).rates,
        "convert_x0_to(rate)": lambda t: uf.convert_x0_to("rate", probs, kernel, x_t, t).rates,
        "convert_x0_to(sedd)": lambda t: uf.convert_x0_to("sedd", probs, kernel, x_t, t),
        "convert_x0_to(m2s)": lambda t: uf.convert_x0_to("m2s", probs, kernel, x_t, t, strict=False),
        "convert_x0_to(ctmc)": ctmc,
        "gidd_loss": lambda t: uf.losses.gidd_loss(logits, x0, x_t, t, kernel),
        "reference_gidd_loss": lambda t: uf.losses.reference_gidd_loss(logits, x0, x_t, t, kernel),
        "x0_head_loss": lambda t: uf.losses.x0_head_loss(logits, x0, x_t, t, kernel),
        "sedd_loss": lambda t: uf.losses.sedd_loss(torch.log(score), x0, x_t, t, kernel),
        "m2s_loss": lambda t: uf.losses.m2s_loss(logits, x0, x_t, t, kernel),
        "ctmc_loss": lambda t: uf.losses.ctmc_loss(log_exit, logits, x0, x_t, t, kernel),
        "reverse_rate_from_head(x0)": lambda t: reverse_rate_from_head("x0", logits, kernel, x_t, t).rates,
        "reverse_rate_from_head(sedd)": lambda t: reverse_rate_from_head("sedd", torch.log(score), kernel, x_t,
                                                                         t).rates,
        "reverse_rate_from_head(m2s)": lambda t: reverse_rate_from_head("m2s", logits, kernel, x_t, t).rates,
    }
    for p in ("x0", "sedd", "m2s"):
        head = torch.log(score) if p == "sedd" else logits
        points[f"clean_distribution_from_head({p})"] = (
            lambda t, p=p, head=head: clean_distribution_from_head(p, head, kernel, x_t, t, torch.float64))
    points["clean_distribution_from_head(ctmc)"] = lambda t: clean_distribution_from_head(
        "ctmc", (log_exit, logits), kernel, x_t, t, torch.float64)
    if isinstance(kernel, uf.GeneratorKernel):
        # matrix exponentials per position are slow: the kernel's own methods, one rate constructor, one loss and the
        # final step's marginal inversion (the rest share their time handling with the structured kernels above)
        keep = ("marginal(ids)", "marginal(probs)", "rate_into", "transition_into", "posterior", "sample",
                "sample_prior", "ReverseRate.from_x0_logits", "reference_gidd_loss",
                "clean_distribution_from_head(sedd)")
        return {name: points[name] for name in keep}
    points["fused_linear_diffusion_loss"] = lambda t: uf.losses.fused_linear_diffusion_loss(
        logits, torch.eye(S, dtype=torch.float64), x0, x_t, t, kernel)
    for weighting in ("elbo", "clip", "dynamic"):
        points[f"gidd_loss_weight({weighting})"] = (
            lambda t, weighting=weighting: uf.losses.gidd_loss_weight(x0, x_t, t, kernel, weighting))
    if isinstance(kernel, uf.MaskKernel):
        points["mdlm_loss"] = lambda t: uf.losses.mdlm_loss(logits, x0, x_t, t, kernel)
        points["reference_mdlm_loss"] = lambda t: uf.losses.reference_mdlm_loss(logits, x0, x_t, t, kernel)
    return points


RANDOM = ("sample", "sample_prior")  # draws: equal across forms for one generator seed, not row by row


@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_every_entry_point_reads_a_1d_t_as_one_time_per_row(kernel_name):
    kernel = KERNELS[kernel_name]
    t_row, forms = _times()
    for name, fn in _entry_points(kernel).items():
        expected = fn(forms["(B, L)"])
        assert expected.shape[:2] == (B, L), name
        for form in ("(B,)", "(B, 1)"):
            torch.testing.assert_close(fn(forms[form]), expected, msg=f"{name} with t of shape {form}")
        # a row of its own: each row equals the same call with that row's time as a float (and as a 0-d tensor)
        if name not in RANDOM:
            for b, scalar in ((0, float(t_row[0])), (1, t_row[1].clone()), (B - 1, float(t_row[B - 1]))):
                row = fn(scalar)
                torch.testing.assert_close(expected[b].to(row.dtype), row[b], rtol=1e-5, atol=1e-6,
                                           msg=f"{name}: row {b}")


@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_a_1d_t_of_another_length_is_an_error_that_states_the_rule(kernel_name):
    kernel = KERNELS[kernel_name]
    bad = torch.full((L + 1,), 0.5)
    for name, fn in _entry_points(kernel).items():
        with pytest.raises(ValueError, match="a 1-D t holds one time per row"):
            fn(bad)
            pytest.fail(name)
    with pytest.raises(ValueError, match="tokens' number of dims"):
        KERNELS["uniform"].marginal(torch.zeros(2, 3, 4, dtype=torch.long), torch.full((2, 3), 0.5))


@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_floats_and_0d_tensors_everywhere(kernel_name):
    kernel = KERNELS[kernel_name]
    for name, fn in _entry_points(kernel).items():
        a, b = fn(0.5), fn(torch.tensor(0.5))
        assert a.shape[:2] == (B, L), name
        torch.testing.assert_close(a.to(b.dtype), b, msg=name)  # draws too: the same generator seed


@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_a_t_with_more_dims_than_the_tokens_is_an_error_that_states_the_rule(kernel_name):
    """The easy slip: a ``(B, 1, 1)`` t against ``(B, L)`` tokens would broadcast to a ``(B, B, L)`` grid of times
    (``sample`` would return ``(B, B, L)`` tokens, ``marginal`` ``(B, B, L, S)``). Every entry point refuses it,
    naming ``t``, both shapes and the rule."""
    kernel = KERNELS[kernel_name]
    for bad in (T_ROW[:, None, None], T_ROW[:, None, None].expand(B, B, L)):
        for name, fn in _entry_points(kernel).items():
            with pytest.raises(ValueError, match=rf"t: got shape \({B}, (1|{B}), (1|{L})\), more dims than the "
                                                 rf"tokens' shape \({B}, {L}\).*tokens' number of dims"):
                fn(bad)
                pytest.fail(name)


def test_a_grid_of_times_is_explicit_tokens_with_the_grid_dims():
    """A grid of times over one token sequence: the tokens carry the grid's leading dim, ``(1, L)`` against
    ``(T, 1)``; row k is the marginal at t_k. Without it (tokens ``(L,)``) the extra dim is refused."""
    kernel = KERNELS["hybrid"]
    x0 = torch.arange(3)
    t = torch.tensor([[0.2], [0.5]], dtype=torch.float64)
    q = kernel.marginal(x0[None], t)
    assert q.shape == (2, 3, S)
    for k in range(2):
        torch.testing.assert_close(q[k], kernel.marginal(x0, t[k, 0]))
    with pytest.raises(ValueError, match=r"t: got shape \(2, 1\), more dims than the tokens' shape \(3,\) "
                                         r"\(broadcasting would make a \(2, 3\) grid\)"):
        kernel.marginal(x0, t)


# ------------------------------------------------------------------------------------------------ no tokens: prior
@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_prior_takes_every_form(kernel_name):
    """``prior(t)`` has no tokens: ``(S,)`` for a float or 0-d tensor, ``(*t.shape, S)`` for a tensor; row b is
    π_{t_b}."""
    kernel = KERNELS[kernel_name]
    t_row, _ = _times()
    rows = kernel.prior(t_row, dtype=torch.float64)
    assert rows.shape == (B, S) and kernel.prior(t_row[:, None]).shape == (B, 1, S)
    for b in range(B):
        single = kernel.prior(float(t_row[b]), dtype=torch.float64)
        assert single.shape == (S,)
        torch.testing.assert_close(rows[b], single)
        torch.testing.assert_close(kernel.prior(t_row[b].double(), dtype=torch.float64), single)


def test_sample_prior_reads_a_1d_t_per_row_by_value():
    """GIDD's hybrid prior depends strongly on t (p_u = 0.99, γ = 2: π_t(mask) = 1/(1 + 396 (1 − t))): with one time
    per row, rows at t ≈ 1 are all mask and rows at t = 0.01 almost never are — read along the positions instead, the
    *columns* would be."""
    kernel = uf.HybridKernel(S, S - 1, 0.99, gamma=2.0)
    t = torch.tensor([0.01, 1 - 1e-6, 0.01, 1 - 1e-6])
    for form in (t, t[:, None]):
        draws = kernel.sample_prior((B, B), t=form, generator=torch.Generator().manual_seed(0))
        is_mask = draws == kernel.mask_id
        assert is_mask[1].all() and is_mask[3].all()
        assert not is_mask[0].any() and not is_mask[2].any()
    with pytest.raises(ValueError, match="a 1-D t holds one time per row"):
        kernel.sample_prior((B, B + 1), t=torch.full((B + 1,), 0.5))
    with pytest.raises(TypeError, match="t: expected None, a float or a float tensor"):
        kernel.sample_prior((B, B), t="0.5")  # type: ignore[arg-type]


SCHEDULES = (LinearSchedule(), CosineSchedule(), LogLinearSchedule(), GeometricSchedule(),
             MDLMCosineSchedule(), DUOCosineSchedule(), DUOCosineSchedule(chain_factor=False))
SCHEDULE_METHODS = ("alpha", "alpha_prime", "hazard", "log_alpha", "one_minus_alpha", "sigma")


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_schedules_are_elementwise_in_every_form(schedule):
    """Schedules take no tokens: every method is elementwise. A float gives a 0-d float64 tensor, a tensor keeps its
    shape (``(B,)``, ``(B, 1)``, ``(B, L)``) and floating dtype; entry b of any form is the float call at t_b."""
    t_row, forms = _times()
    methods = [m for m in SCHEDULE_METHODS if hasattr(schedule, m)]
    assert len(methods) == 5 + isinstance(schedule, GeometricSchedule)
    for method in methods:
        fn = getattr(schedule, method)
        full = fn(forms["(B, L)"])
        assert full.shape == (B, L) and full.dtype == torch.float32, method
        assert torch.isfinite(full).all(), method
        torch.testing.assert_close(fn(forms["(B,)"]), full[:, 0], msg=method)
        torch.testing.assert_close(fn(forms["(B, 1)"]), full[:, :1], msg=method)
        as64 = fn(forms["(B, L)"].double())
        assert as64.dtype == torch.float64, method
        for b in range(B):
            scalar = fn(float(t_row[b]))
            assert scalar.shape == () and scalar.dtype == torch.float64, method
            torch.testing.assert_close(scalar, as64[b, 0], msg=f"{method}: t_{b} as a float")
            torch.testing.assert_close(fn(t_row[b]), full[b, 0], msg=f"{method}: t_{b} as a 0-d tensor")
        # the methods agree with each other in every form: β = 1 − α, log α, hazard = −α'/α
        alpha = schedule.alpha(forms["(B,)"].double())
        if method == "one_minus_alpha":
            torch.testing.assert_close(as64[:, 0], 1 - alpha)
        elif method == "log_alpha":
            torch.testing.assert_close(as64[:, 0], torch.log(alpha))
        elif method == "hazard":
            torch.testing.assert_close(as64[:, 0], -schedule.alpha_prime(forms["(B,)"].double()) / alpha)
    with pytest.raises(TypeError, match="t: expected a float or a floating-point tensor"):
        schedule.alpha(torch.tensor([1, 2]))


# ------------------------------------------------------------------------------------------------ models
class _TimeModel:
    """An x0 model whose logits depend on x_t and on t per row: A[x_t] + t_b · C[x_t]; records the t it was given."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(11)
        self.A, self.C = torch.randn(S, S, generator=g), torch.randn(S, S, generator=g)
        self.seen: list[torch.Tensor] = []

    def __call__(self, x_t, t, **_):
        self.seen.append(t)
        assert t.shape == (x_t.shape[0],)  # models are always called with one time per sequence
        return self.A[x_t] + t[:, None, None] * self.C[x_t]


@pytest.mark.parametrize("parameterization", ["x0", "sedd", "m2s", "ctmc"])
@pytest.mark.parametrize("kernel_name", ["uniform", "mask"])
def test_x0_model_as_takes_every_form_one_time_per_row(parameterization, kernel_name):
    kernel = KERNELS[kernel_name]
    model = _TimeModel()
    wrapped = uf.samplers.x0_model_as(model, kernel, parameterization, dtype=torch.float64)
    x_t = _tokens()[1]
    if kernel.mask_id is not None:
        x_t[:, :2] = kernel.mask_id

    def head(t):
        out = wrapped(x_t, t)
        return torch.cat([out[0].unsqueeze(-1), out[1]], -1) if parameterization == "ctmc" else out

    t_row, forms = _times()
    expected = head(forms["(B,)"])
    assert expected.shape == (B, L, S + (parameterization == "ctmc"))
    torch.testing.assert_close(head(forms["(B, 1)"]), expected)
    for b in range(B):
        for scalar in (float(t_row[b]), t_row[b].clone()):
            torch.testing.assert_close(head(scalar)[b], expected[b])
    assert all(t.shape == (B,) for t in model.seen)
    with pytest.raises(ValueError, match="one time per sequence"):
        wrapped(x_t, forms["(B, L)"])
    with pytest.raises(ValueError, match="a 1-D t holds one time per row"):
        wrapped(x_t, torch.full((B + 1,), 0.5))


@pytest.fixture(scope="module")
def tc_model():
    """A DiffusionLM whose output depends on t (time conditioning with a non-zero output layer)."""
    model = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=False, time_conditioning=True)
    torch.nn.init.normal_(model.time_embedding.proj_out.weight, std=0.5)
    return model.eval()


def _check_model_call(call, t_row, forms, what):
    expected = call(forms["(B,)"])
    torch.testing.assert_close(call(forms["(B, 1)"]), expected, msg=what)
    for b, scalar in ((0, float(t_row[0])), (B - 1, t_row[B - 1].clone())):
        torch.testing.assert_close(call(scalar)[b], expected[b], rtol=1e-5, atol=1e-5, msg=f"{what}: row {b}")
    assert not torch.allclose(expected[0], expected[-1])  # t matters: the check above is not vacuous
    with pytest.raises(ValueError, match="one time per sequence"):
        call(forms["(B, L)"])
    with pytest.raises(ValueError, match="a 1-D t holds one time per row"):
        call(torch.full((B + 1,), 0.5))


@torch.no_grad()
def test_diffusion_lm_forward_hidden_states_and_loss_take_every_form(tc_model):
    x0 = torch.randint(0, tc_model.num_states, (B, L), generator=torch.Generator().manual_seed(0))
    x_t = torch.randint(0, tc_model.num_states, (B, L), generator=torch.Generator().manual_seed(1))
    kernel = uf.UniformKernel(tc_model.num_states)
    t_row, forms = _times()
    _check_model_call(lambda t: tc_model(x_t, t), t_row, forms, "forward")
    _check_model_call(lambda t: tc_model.hidden_states(x_t, t), t_row, forms, "hidden_states")
    _check_model_call(lambda t: tc_model.loss(x_t, t, x0, kernel), t_row, forms, "loss")


def test_diffusion_loss_takes_every_form(tc_model):
    kernel = uf.UniformKernel(tc_model.num_states)
    x0 = torch.randint(0, tc_model.num_states, (B, L), generator=torch.Generator().manual_seed(0))
    t_row, forms = _times()

    def loss(t):
        return uf.diffusion_loss(tc_model, x0, kernel, t=t, generator=torch.Generator().manual_seed(5))

    ref = loss(t_row)
    assert torch.equal(ref.t, t_row)
    torch.testing.assert_close(loss(forms["(B, 1)"]).loss, ref.loss)
    for scalar in (0.5, torch.tensor(0.5)):
        out = loss(scalar)
        assert torch.equal(out.t, torch.full((B,), 0.5))
        torch.testing.assert_close(out.loss, loss(torch.full((B,), 0.5)).loss)
    # row by row: the loss of row b with its own time, from the same corruption (x_t given back to the loss)
    with torch.no_grad():
        logits = tc_model(ref.x_t, t_row)
        per_row = uf.losses.gidd_loss(logits, x0, ref.x_t, t_row, kernel)
        torch.testing.assert_close(ref.loss.detach(), per_row, rtol=1e-5, atol=1e-6)
        for b in range(B):
            own = uf.losses.gidd_loss(logits[b], x0[b], ref.x_t[b], float(t_row[b]), kernel)
            torch.testing.assert_close(per_row[b], own, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one time per sequence"):
        loss(forms["(B, L)"])
    with pytest.raises(ValueError, match="a 1-D t holds one time per row"):
        loss(torch.full((B + 1,), 0.5))


# ------------------------------------------------------------------------------------------------ evaluation
@pytest.mark.parametrize("batch_size", [None, B])
def test_nll_bound_passes_one_time_per_row_to_the_model_and_the_loss(batch_size):
    """B == L: the model gets one time per row — its rows are the B sequences, once per time in the call (all 3
    times in one call by default, one per call with ``batch_size=B``) — and the bound's integrand uses row r's time
    for every position of row r (recomputed here from what the model saw, with per-position times)."""
    kernel = KERNELS["uniform"]
    model = _TimeModel()
    seen_x_t: list[torch.Tensor] = []

    def recording(x_t, t):
        seen_x_t.append(x_t.clone())
        return model(x_t, t)

    x0 = _tokens()[0]
    num_times = 3
    out = uf.eval.nll_bound(recording, x0, kernel, num_times=num_times, generator=torch.Generator().manual_seed(0),
                            per_token=False, batch_size=batch_size)
    assert out.shape == (B,) and len(model.seen) == (1 if batch_size is None else num_times)
    expected = torch.zeros(B, dtype=torch.float64)
    for t, x_t in zip(model.seen, seen_x_t):
        rows = x_t.shape[0]
        assert t.shape == (rows,) and rows % B == 0
        logits = model.A[x_t] + t[:, None, None] * model.C[x_t]
        t_pos = t.double()[:, None].expand(rows, L)  # row r's time at every position of row r
        x0_rows = x0.repeat(rows // B, 1)  # row r is sequence r mod B
        D = uf.losses.reference_gidd_loss(logits, x0_rows, x_t, t_pos, kernel).double().sum(-1)
        expected += D.view(rows // B, B).sum(0)
    torch.testing.assert_close(out, expected / num_times, rtol=1e-5, atol=1e-6)


def test_the_evaluators_call_the_model_with_one_time_per_row():
    kernel = KERNELS["uniform"]
    model = _TimeModel()
    uf.eval.score_choices(model, kernel, [1, 2, 3], [[4, 5], [6, 7]], num_times=3,
                          generator=torch.Generator().manual_seed(0))
    uf.eval.fair_pmi_scores(model, kernel, [1, 2, 3], [[4, 5], [6, 7]], [1], num_times=3,
                            generator=torch.Generator().manual_seed(0))
    assert model.seen and all(t.dim() == 1 for t in model.seen)
    model.seen.clear()
    for sampler in (uf.BayesianSampler(model, kernel, 3), uf.EulerSampler(model, kernel, 3)):
        sampler.sample(B, L, generator=torch.Generator().manual_seed(0))
    assert len(model.seen) == 6 and all(t.shape == (B,) for t in model.seen)


def test_sample_times_is_one_time_per_row():
    t = uf.sample_times(B)
    assert t.shape == (B,) and ((t > 0) & (t < 1)).all()
