"""``torch.compile`` of a user's whole training step: :func:`unifusion.diffusion_loss` on a
:class:`~unifusion.DiffusionLM` (a tiny random Llama, SDPA), ``fullgraph=True``, backward included.

With the annealing step given as a 0-d tensor (``step=torch.tensor(k)``) γ_k is a tensor the graph takes as an input:
one graph serves the whole annealing run, the endpoints γ = 0 and γ = 1 included, with no graph break, and its losses
and gradients are eager's bit for bit (global generator seeded alike; ``aot_eager``, so no Inductor C++ build and
no kernel of another numerics). A Python int ``step`` is a constant of the graph: it recompiles a bounded number of
times. Dynamo's own counters (``CompileCounterWithBackend``, ``counters["graph_break"]``) do the counting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _hf_tiny import tiny_model
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import unifusion as uf
from unifusion.hf import adapt_ar_model, anneal_schedule, annealed_attention_mask
from unifusion.validation import validation_enabled

B, L = 2, 16
ANNEAL = 10
STEPS = (0, 3, 7, 10, 25)  # γ = 0 (causal), 0.3, 0.7, 1 (bidirectional), 1 (past the horizon)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test traces from scratch and leaves no compiled frame or counter behind."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def _model(block_size: int | None = None) -> uf.DiffusionLM:
    model = adapt_ar_model(tiny_model("llama", attn_implementation="sdpa"), block_size=block_size)
    return model.train()


def _kernel(name: str, model: uf.DiffusionLM) -> Any:
    S, mask_id = model.num_states, model.mask_token_id
    assert mask_id is not None
    return {"mask": uf.MaskKernel(S, mask_id), "uniform": uf.UniformKernel(S),
            "hybrid": uf.HybridKernel(S, mask_id, p_uniform=0.3)}[name]


def _x0() -> torch.Tensor:
    return torch.randint(3, 120, (B, L), generator=torch.Generator().manual_seed(0))


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _one_step(step_fn: Callable[..., Any], model: uf.DiffusionLM, x0: torch.Tensor, step: Any, seed: int, *,
              backward_inside: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Loss, γ and the parameters' gradients of one step (backward inside ``step_fn``, or here after it)."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss, gamma = step_fn(x0, step)
    if not backward_inside:
        loss.backward()
    return loss.detach(), gamma, _grads(model)


# the three steps a user would write: plain model (an x0 head on logits) with the backward inside the compiled step,
# fused loss, block model with padding
CASES = {
    "mask-backward-inside": dict(kernel="mask", block_size=None, fused=False, padded=False, backward_inside=True),
    "hybrid-fused": dict(kernel="hybrid", block_size=None, fused=True, padded=False, backward_inside=False),
    "uniform-block-padded": dict(kernel="uniform", block_size=4, fused=False, padded=True, backward_inside=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_graph_for_the_whole_annealing_run_with_eagers_values(case: str) -> None:
    """A tensor ``step``: one frame compiled, no graph break, no recompile across γ = 0, 0.3, 0.7, 1, 1; losses,
    γ and every parameter's gradient equal eager's bit for bit (tolerance 0). ``loss.backward()`` inside the
    compiled function needs Dynamo's ``trace_autograd_ops``; outside it, AOTAutograd compiles the backward too."""
    spec = CASES[case]
    model = _model(spec["block_size"])
    kernel = _kernel(spec["kernel"], model)
    x0 = _x0()
    pad = None
    if spec["padded"]:
        pad = torch.ones(B, L, dtype=torch.long)
        pad[1, L - 5:] = 0  # right padding on the second row

    def step_fn(x0: torch.Tensor, step: Any) -> tuple[torch.Tensor, Any]:
        out = uf.diffusion_loss(model, x0, kernel, step=step, anneal_steps=ANNEAL, attention_mask=pad,
                                fused=spec["fused"])
        loss = out.mean()
        if inside:
            loss.backward()
            loss = loss.detach()  # a compiled step may not return a tensor whose graph its backward consumed
        return loss, out.bidirectional_prob

    inside = spec["backward_inside"]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step_fn, backend=counter, fullgraph=True)
    for seed, k in enumerate(STEPS):
        with torch._dynamo.config.patch(trace_autograd_ops=inside):
            loss, gamma, grads = _one_step(compiled, model, x0, torch.tensor(k), seed, backward_inside=inside)
        ref_loss, ref_gamma, ref_grads = _one_step(step_fn, model, x0, torch.tensor(k), seed, backward_inside=inside)
        assert torch.equal(loss, ref_loss), (k, loss, ref_loss)
        assert torch.equal(gamma, ref_gamma) and gamma.item() == anneal_schedule(k, ANNEAL), (k, gamma)
        assert len(grads) == len(ref_grads) > 0
        for g, ref in zip(grads, ref_grads, strict=True):
            assert torch.equal(g, ref), (k, (g - ref).abs().max())
    assert counter.frame_count == 1, counter.frame_count
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_a_python_int_step_recompiles_a_bounded_number_of_times() -> None:
    """A Python ``step`` is a constant of the trace: the first value is specialised, the second makes Dynamo trace it
    symbolically (one graph for every later 0 < γ < 1), and γ = 1 takes its own mask-free path: at most three graphs
    for the whole run (one more if γ = 0 comes after the first step), still without a graph break."""
    model = _model()
    kernel = _kernel("mask", model)
    x0 = _x0()

    def step_fn(x0: torch.Tensor, step: int) -> tuple[torch.Tensor, Any]:
        out = uf.diffusion_loss(model, x0, kernel, step=step, anneal_steps=ANNEAL)
        return out.mean(), out.bidirectional_prob

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step_fn, backend=counter, fullgraph=True)
    frames = []
    for k in (1, 4, 7, 10, 25):
        loss, _, _ = _one_step(compiled, model, x0, k, k)
        ref, _, _ = _one_step(step_fn, model, x0, k, k)
        assert torch.equal(loss, ref), k
        frames.append(counter.frame_count)
    # γ = 0.1 specialised, 0.4 traced symbolically and reused for 0.7, then 1 (reused past the horizon)
    assert frames[2] == frames[1] and frames[4] == frames[3] and frames[-1] <= 3, frames
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_a_generator_in_a_compiled_step_says_to_seed_the_global_one() -> None:
    """Dynamo cannot trace a ``torch.Generator``: with ``fullgraph=True`` the error names the argument and the fix."""
    model = _model()
    kernel = _kernel("mask", model)

    def step_fn(x0: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        return uf.diffusion_loss(model, x0, kernel, step=torch.tensor(3), generator=g).mean()

    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"generator: torch.compile cannot trace"):
        torch.compile(step_fn, backend="eager", fullgraph=True)(_x0(), torch.Generator().manual_seed(0))


def test_value_checks_are_off_while_traced_and_on_in_eager() -> None:
    """:func:`validation_enabled` is False inside a traced region (a value check would be a host sync) and True
    outside it; eager calls still reject a negative tensor ``step`` and an out-of-range tensor γ."""

    def probe(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if validation_enabled() else x - 1

    assert validation_enabled()
    assert torch.equal(torch.compile(probe, backend="eager", fullgraph=True)(torch.zeros(1)), -torch.ones(1))
    model = _model()
    kernel = _kernel("mask", model)
    with pytest.raises(ValueError, match="step: expected a non-negative step, got -1"):
        uf.diffusion_loss(model, _x0(), kernel, step=torch.tensor(-1))
    with pytest.raises(TypeError, match="step: expected an int or a 0-d integer or floating tensor"):
        uf.diffusion_loss(model, _x0(), kernel, step=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"bidirectional_prob: expected a value in \[0, 1\], got 1.5"):
        uf.diffusion_loss(model, _x0(), kernel, bidirectional_prob=torch.tensor(1.5))
    with pytest.raises(ValueError, match="step, bidirectional_prob: give one of them"):
        uf.diffusion_loss(model, _x0(), kernel, step=torch.tensor(1), bidirectional_prob=torch.tensor(0.5))


@pytest.mark.parametrize("K", [3, 7, 10, 1000, 0])
def test_a_tensor_step_gives_the_floats_gamma_and_mask(K: int) -> None:
    """γ of a tensor step equals the float of the same k exactly (float64 divides as Python does), and the annealed
    mask of a tensor γ equals the float γ's for the same generator inside (0, 1), and is exactly causal / full at the
    endpoints (where the tensor draws and the float does not)."""
    n = 9
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for k in (0, 1, 2, 5, K, K + 3):
        gamma = anneal_schedule(torch.tensor(k), K)
        assert gamma.dim() == 0 and gamma.item() == anneal_schedule(k, K), (k, K)
        A = annealed_attention_mask(3, n, gamma, generator=torch.Generator().manual_seed(k))
        ref = annealed_attention_mask(3, n, anneal_schedule(k, K), generator=torch.Generator().manual_seed(k))
        assert torch.equal(A, ref), (k, K)
    assert torch.equal(annealed_attention_mask(2, n, torch.tensor(0.0))[:, 0], causal.expand(2, n, n))
    assert annealed_attention_mask(2, n, torch.tensor(1.0)).all()


def test_a_tensor_step_matches_the_int_step_in_eager() -> None:
    """Eagerly, ``step=torch.tensor(k)`` and ``step=k`` give the same loss bit for bit for 0 < γ < 1 (the same
    draws), and a tensor γ always takes the dense-mask path."""
    model = _model()
    kernel = _kernel("mask", model)
    for k in (2, 6):
        a = uf.diffusion_loss(model, _x0(), kernel, step=torch.tensor(k), anneal_steps=ANNEAL,
                              generator=torch.Generator().manual_seed(k))
        b = uf.diffusion_loss(model, _x0(), kernel, step=k, anneal_steps=ANNEAL,
                              generator=torch.Generator().manual_seed(k))
        assert torch.equal(a.loss, b.loss) and torch.equal(a.x_t, b.x_t), k
    assert model.attention_path(L, torch.tensor(0.0)) == "mask"
    assert model.attention_path(L, torch.tensor(1.0)) == "mask"
    assert model.attention_path(L, 1.0) == "non_causal"


def test_a_block_models_step_compiles_across_batch_lengths() -> None:
    """``fullgraph=True`` over batch lengths 32, 48, 40 (padded chat batches change length): Dynamo traces the second
    length with symbolic sizes, so every random draw of the step (times, corruption, the annealed mask) must take a
    symbolic shape. At most two frames, no graph break, and each length's loss equals eager's bit for bit."""
    model = _model(block_size=8)
    kernel = _kernel("mask", model)

    def step_fn(x0: torch.Tensor, step: Any) -> tuple[torch.Tensor, Any]:
        out = uf.diffusion_loss(model, x0, kernel, step=step, anneal_steps=ANNEAL)
        return out.mean(), out.bidirectional_prob

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step_fn, backend=counter, fullgraph=True)
    for seed, length in enumerate((32, 48, 40)):
        x0 = torch.randint(3, 120, (B, length), generator=torch.Generator().manual_seed(seed))
        loss, _, grads = _one_step(compiled, model, x0, torch.tensor(4), seed)
        ref, _, ref_grads = _one_step(step_fn, model, x0, torch.tensor(4), seed)
        assert torch.equal(loss, ref), (length, loss, ref)
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True)), length
    assert counter.frame_count <= 2, counter.frame_count
    assert not counters["graph_break"], dict(counters["graph_break"])
