"""unifusion.hf.ar.attention: the annealing schedule and mask, the attention paths (the model's own causal mask,
``is_causal=False`` without a mask at γ = 1, dense boolean/additive masks, flex attention's BlockMask, flash attention's
refusals) and sliding windows; the mask-free path's outputs equal the dense-mask path's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _hf_tiny import FAMILIES, VOCAB, random_ids, tiny_model, with_bos

import unifusion as uf
from unifusion.hf import adapt_ar_model, anneal_schedule, annealed_attention_mask
from unifusion.hf.ar import attention as hf_attention
from unifusion.hf.ar.families import FAMILIES as REGISTRY

L = 8  # network length 9 > the sliding windows of 4 in _hf_tiny
MASK_ID = 3
ALL_FAMILIES = list(dict.fromkeys(FAMILIES + sorted(REGISTRY)))
WINDOWED = {"mistral", "gemma2", "gemma3_text"}  # the tiny configs with sliding_window=4
DENSE_ONLY = {t for t, f in REGISTRY.items() if not f.is_causal_kwarg}  # falcon, stablelm


def _both_paths(model: uf.DiffusionLM, fn):
    """``fn()`` on the default path and with the dense mask forced."""
    model.dense_bidirectional_mask = False
    fast = fn()
    model.dense_bidirectional_mask = True
    try:
        dense = fn()
    finally:
        model.dense_bidirectional_mask = False
    return fast, dense


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # float32 rounding (exact on CPU today)


class SDPASpy:
    """Records ``(attn_mask, is_causal)`` of every ``F.scaled_dot_product_attention`` call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[torch.Tensor | None, bool]] = []
        real = F.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
            self.calls.append((attn_mask, bool(is_causal)))
            return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)

    def take(self) -> list[tuple[torch.Tensor | None, bool]]:
        calls, self.calls = self.calls, []
        return calls


# ---------------------------------------------------------------------------------------------------------------
# the same outputs on every family


@pytest.mark.parametrize("model_type", ALL_FAMILIES)
@torch.no_grad()
def test_no_mask_path_equals_dense_mask_path(model_type: str) -> None:
    model = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID)
    expected = "mask" if model_type in WINDOWED | DENSE_ONLY else "non_causal"
    assert model.attention_path(L) == expected
    x, t = random_ids(), torch.tensor([0.2, 0.9])
    fast, dense = _both_paths(model, lambda: model(x, t))
    _close(fast, dense)
    h_fast, h_dense = _both_paths(model, lambda: model.hidden_states(x))
    _close(h_fast, h_dense)
    # still bidirectional: a change of the last token reaches output L - 2
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1 - 4) % (VOCAB - 4) + 4
    assert (model(x2)[:, L - 2] - fast[:, L - 2]).abs().max() > 1e-4


@pytest.mark.parametrize("model_type", ["mistral", "gemma2", "gemma3_text"])
@torch.no_grad()
def test_sliding_window_keeps_the_mask_until_it_is_vacuous(model_type: str) -> None:
    """w = 4 < L + 1 bites: the dense, windowed mask stays. w ≥ L + 1 cannot bite: no mask."""
    narrow = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID)
    assert narrow.family.sliding_window(narrow.config) == 4
    assert narrow.attention_path(L) == "mask"
    assert narrow.attention_path(3) == "non_causal"  # 4 network positions: |i - j| ≤ 3 < 4
    x = random_ids()
    _close(*_both_paths(narrow, lambda: narrow(x[:, :3])))
    wide = adapt_ar_model(tiny_model(model_type, sliding_window=L + 1), mask_token_id=MASK_ID)
    assert wide.attention_path(L) == "non_causal" and wide.attention_path(L + 1) == "mask"
    _close(*_both_paths(wide, lambda: wide(x)))
    longer = random_ids(length=L + 1)
    _close(*_both_paths(wide, lambda: wide(longer)))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_gradients_equal_with_and_without_checkpointing(model_type: str) -> None:
    """Training at γ = 1 (after annealing): same loss gradients on both paths, also when layers are recomputed."""
    model = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID).train()
    x0 = random_ids()
    kernel = uf.MaskKernel(model.num_states, mask_id=MASK_ID)
    t = torch.tensor([0.3, 0.8])
    x_t = kernel.sample(x0, t[:, None], generator=torch.Generator().manual_seed(0))

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model.loss(x_t, t, x0, kernel).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        fast, dense = _both_paths(model, grads)
        assert len(fast) == len(dense) > 0
        for a, b in zip(fast, dense):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_eager_attention_runs_without_a_mask_too() -> None:
    sdpa = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    eager = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    eager.base_model.set_attn_implementation("eager")
    assert eager.config._attn_implementation == "eager" and eager.attention_path(L) == "non_causal"
    x = random_ids()
    fast, dense = _both_paths(eager, lambda: eager(x))
    _close(fast, dense)
    torch.testing.assert_close(fast, sdpa(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# the schedule and the annealed mask


def test_anneal_schedule() -> None:
    assert anneal_schedule(0, 100) == 0.0
    assert anneal_schedule(25, 100) == 0.25
    assert anneal_schedule(100, 100) == 1.0
    assert anneal_schedule(1000, 100) == 1.0
    assert anneal_schedule(0, 0) == 1.0
    with pytest.raises(ValueError, match="step"):
        anneal_schedule(-1, 10)
    with pytest.raises(ValueError, match="anneal_steps"):
        anneal_schedule(1, -10)
    with pytest.raises(TypeError, match="step"):
        anneal_schedule(1.5, 10)  # type: ignore[arg-type]

def test_annealed_mask_semantics() -> None:
    n = 64
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(annealed_attention_mask(2, n, 0.0)[0, 0], causal)
    assert annealed_attention_mask(2, n, 1.0).all()
    g = torch.Generator().manual_seed(0)
    A = annealed_attention_mask(4, n, 0.3, generator=g)
    assert A.shape == (4, 1, n, n)
    assert (A | ~causal).all()  # A ⊇ causal
    upper = A[:, 0][:, ~causal]
    assert abs(upper.float().mean().item() - 0.3) < 0.02  # B_ij ~ Bernoulli(γ) above the diagonal
    assert not torch.equal(A[0], A[1])  # drawn per sequence
    A2 = annealed_attention_mask(4, n, 0.3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(A, A2)
    valid = torch.ones(1, n, dtype=torch.bool)
    valid[0, -3:] = False
    Ap = annealed_attention_mask(1, n, 1.0, key_valid=valid)[0, 0]
    assert not Ap[: n - 3, n - 3 :].any()  # padded keys blocked for real queries
    assert torch.equal(Ap[n - 3 :, n - 3 :], torch.eye(3, dtype=torch.bool))  # padded queries see themselves
    Aw = annealed_attention_mask(1, n, 1.0, window=4)[0, 0]
    i = torch.arange(n)
    assert torch.equal(Aw, (i[:, None] - i[None, :]).abs() < 4)

@torch.no_grad()
def test_intermediate_gamma_uses_generator() -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    x = random_ids()
    a = model(x, bidirectional_prob=0.5, generator=torch.Generator().manual_seed(1))
    b = model(x, bidirectional_prob=0.5, generator=torch.Generator().manual_seed(1))
    c = model(x, bidirectional_prob=0.5, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)

@torch.no_grad()
def test_annealed_forward_uses_the_paper_mask() -> None:
    """model(x, γ) = base([BOS, x]) under A = causal ∨ Bernoulli(γ), drawn by annealed_attention_mask."""
    base = tiny_model("llama")
    model = adapt_ar_model(base, mask_token_id=MASK_ID)
    x = random_ids()
    A = annealed_attention_mask(2, L + 1, 0.5, generator=torch.Generator().manual_seed(3))
    ref = base(with_bos(x), attention_mask=A).logits[:, :-1]
    out = model(x, bidirectional_prob=0.5, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)

@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2"])
@torch.no_grad()
def test_annealed_forward_leaves_global_rng_alone(model_type: str) -> None:
    model = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID)
    state = torch.get_rng_state()
    model(random_ids(), bidirectional_prob=0.5, attention_mask=torch.ones(2, L), generator=torch.Generator())
    assert torch.equal(state, torch.get_rng_state())

@pytest.mark.parametrize("model_type", ["mistral", "gemma2"])
@torch.no_grad()
def test_sliding_window_is_kept_and_symmetrised(model_type: str) -> None:
    """Windowed layers keep |i - j| < w: with w = 4 on both layers, x_L (distance 8) cannot reach output 0."""
    layer_types = {"gemma2": ["sliding_attention", "sliding_attention"]}.get(model_type)
    extra = {"layer_types": layer_types} if layer_types else {}
    model = adapt_ar_model(tiny_model(model_type, **extra), mask_token_id=MASK_ID)
    x = random_ids()
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1 - 4) % (VOCAB - 4) + 4
    out, out2 = model(x), model(x2)
    torch.testing.assert_close(out[:, 0], out2[:, 0], rtol=0, atol=0)  # beyond 2 layers × (w - 1) = 6
    assert (out[:, L - 2] - out2[:, L - 2]).abs().max() > 1e-4  # within the window
    # without the window the far token is seen
    wide = adapt_ar_model(tiny_model(model_type, sliding_window=64, **extra), mask_token_id=MASK_ID)
    assert (wide(x)[:, 0] - wide(x2)[:, 0]).abs().max() > 1e-4

@torch.no_grad()
def test_gemma2_gets_additive_mask_and_eager_matches() -> None:
    model = adapt_ar_model(tiny_model("gemma2"), mask_token_id=MASK_ID)
    assert model.config._attn_implementation == "eager"
    assert hf_attention.mask_style(model.family, model.config) == "additive"
    assert model.final_logit_softcap == 30.0
    assert model(random_ids()).abs().max() <= 30.0

@torch.no_grad()
def test_eager_llama_uses_additive_mask() -> None:
    sdpa = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    eager = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    eager.base_model.config._attn_implementation = "eager"
    for layer in eager.base_model.model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    x = random_ids()
    torch.testing.assert_close(eager(x), sdpa(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager(x, bidirectional_prob=0.0), sdpa(x, bidirectional_prob=0.0))


# ---------------------------------------------------------------------------------------------------------------
# what SDPA receives


@torch.no_grad()
def test_sdpa_gets_no_mask_and_is_causal_false_at_gamma_one(monkeypatch: pytest.MonkeyPatch) -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    layers = model.config.num_hidden_layers
    spy = SDPASpy(monkeypatch)
    x = random_ids()

    model(x)  # γ = 1: no mask tensor, non-causal kernels
    assert spy.take() == [(None, False)] * layers
    model.hidden_states(x)
    assert spy.take() == [(None, False)] * layers
    model(x, bidirectional_prob=0.0)  # γ = 0: the model's own causal path
    assert spy.take() == [(None, True)] * layers

    model(x, bidirectional_prob=0.5, generator=torch.Generator().manual_seed(0))  # annealing: the Bernoulli mask
    calls = spy.take()
    assert len(calls) == layers and all(m is not None and m.shape == (2, 1, L + 1, L + 1) for m, _ in calls)
    assert not any(c for _, c in calls)
    model(x, attention_mask=torch.ones(2, L))  # padding: a mask
    assert all(m is not None and m.shape[-1] == L + 1 for m, _ in spy.take())
    model.dense_bidirectional_mask = True  # forced dense mask
    model(x)
    assert all(m is not None and bool(m.all()) for m, _ in spy.take())


@pytest.mark.parametrize("model_type", sorted(DENSE_ONLY | {"mistral", "gemma3_text"}))
@torch.no_grad()
def test_families_that_need_the_mask_get_one(model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID)
    spy = SDPASpy(monkeypatch)
    model(random_ids())
    calls = spy.take()
    assert calls and all(m is not None for m, _ in calls)


@torch.no_grad()
def test_older_transformers_without_the_keyword_keep_the_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    x = random_ids()
    fast = model(x)
    monkeypatch.setattr(hf_attention, "_has_is_causal_kwarg", lambda: False)
    assert model.attention_path(L) == "mask"
    spy = SDPASpy(monkeypatch)
    _close(model(x), fast)
    assert all(m is not None for m, _ in spy.take())


def test_has_is_causal_kwarg_on_the_installed_transformers() -> None:
    from transformers.utils.generic import TransformersKwargs

    assert hf_attention._has_is_causal_kwarg() == ("is_causal" in TransformersKwargs.__annotations__)


def test_attention_path_reports_and_validates() -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    assert model.attention_path(L, 0.0) == "causal"
    assert model.attention_path(L, 0.5) == "mask"
    assert model.attention_path(L, 1.0) == "non_causal"
    assert model.attention_path(L, 1.0, padded=True) == "mask"
    assert model.attention_path(L, 0.0, padded=True) == "mask"
    model.dense_bidirectional_mask = True
    assert model.attention_path(L) == "mask"
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="length"):
            model.attention_path(bad)  # type: ignore[arg-type]
    for bad_gamma in (-0.1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="bidirectional_prob"):
            model.attention_path(L, bad_gamma)  # type: ignore[arg-type]


@torch.no_grad()
def test_sampler_runs_on_the_no_mask_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    spy = SDPASpy(monkeypatch)
    out = model.generate(random_ids(1, 3), max_new_tokens=4, num_steps=2, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 7)
    calls = spy.take()
    assert len(calls) == 2 * model.config.num_hidden_layers and all(c == (None, False) for c in calls)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_cuda_no_mask_path_matches_dense_mask() -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID).cuda()
    x = random_ids(length=64).cuda()
    fast, dense = _both_paths(model, lambda: model(x))
    torch.testing.assert_close(fast, dense, rtol=1e-4, atol=1e-4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fast, dense = _both_paths(model, lambda: model(x))
    torch.testing.assert_close(fast.float(), dense.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------------------------
# flex attention: annealing, padding and sliding windows through a BlockMask; flash attention: the decision logic


class AttentionSpy:
    """Replaces one attention implementation in transformers' registry; records ``(attention_mask, is_causal)`` of
    every call and runs ``run`` (the real kernel by default)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, impl: str, run=None) -> None:
        from transformers.modeling_utils import AttentionInterface

        self.calls: list[tuple[object, object]] = []
        real = run or AttentionInterface._global_mapping[impl]

        def spy(module, query, key, value, attention_mask, **kwargs):
            self.calls.append((attention_mask, kwargs.get("is_causal")))
            return real(module, query, key, value, attention_mask, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, impl, spy)

    def take(self) -> list[tuple[object, object]]:
        calls, self.calls = self.calls, []
        return calls


def _flex_pair(model_type: str) -> tuple[uf.DiffusionLM, uf.DiffusionLM]:
    """The same random weights adapted twice: SDPA and flex attention."""
    sdpa = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID)
    base = tiny_model(model_type)
    base.set_attn_implementation("flex_attention")
    flex = adapt_ar_model(base, mask_token_id=MASK_ID)
    assert flex.config._attn_implementation == "flex_attention" and sdpa.config._attn_implementation == "sdpa"
    return sdpa, flex


def _dense_pattern(block_mask, B: int, n: int) -> torch.Tensor:
    """Element-level pattern of a BlockMask: its mask_mod on every (b, q, kv), restricted to the blocks it keeps."""
    from torch.nn.attention.flex_attention import create_mask

    blocks = block_mask.to_dense()[:, 0].bool()  # (B, q blocks, kv blocks): partial or full
    size = block_mask.BLOCK_SIZE
    keep = blocks.repeat_interleave(size[0], 1).repeat_interleave(size[1], 2)[:, :n, :n]
    return create_mask(block_mask.mask_mod, B, 1, n, n, device="cpu")[:, 0] & keep


# Inductor compiles flex attention on the CPU (transformers wraps it in torch.compile): ~10-20 s per family cold.
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])  # plain; per-layer-type sliding windows (a dict)
@torch.no_grad()
def test_flex_attention_uses_a_block_mask_with_the_dense_paths_outputs(model_type: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.nn.attention.flex_attention import BlockMask

    sdpa, flex = _flex_pair(model_type)
    layers = flex.config.num_hidden_layers
    windowed = model_type in WINDOWED
    x = random_ids()
    n = L + 1
    spy = AttentionSpy(monkeypatch, "flex_attention")
    gammas = (0.5, 1.0) if windowed else (0.0, 0.5, 1.0)
    for gamma in gammas:
        expected = {0.0: "causal", 0.5: "block_mask", 1.0: "block_mask" if windowed else "non_causal"}[gamma]
        assert flex.attention_path(L, gamma) == expected
        assert sdpa.attention_path(L, gamma) == expected.replace("block_mask", "mask")
        out = flex(x, bidirectional_prob=gamma, generator=torch.Generator().manual_seed(7))
        ref = sdpa(x, bidirectional_prob=gamma, generator=torch.Generator().manual_seed(7))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # flex vs SDPA kernels: float32 rounding
        calls = spy.take()
        assert len(calls) == layers and all(isinstance(m, BlockMask) for m, _ in calls)
        if expected == "block_mask":  # ours: exactly the Bernoulli pattern of the dense path, from the same draws
            A = annealed_attention_mask(2, n, gamma, generator=torch.Generator().manual_seed(7))[:, 0]
            band = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs() < 4
            kinds = flex.config.layer_types if windowed else ["full_attention"] * layers
            for (mask, _), kind in zip(calls, kinds):
                want = A & band if kind == "sliding_attention" else A
                assert torch.equal(_dense_pattern(mask, 2, n), want)
        if expected == "non_causal":  # no mask from us (is_causal=False); transformers' own all-visible block mask
            kwargs = flex.network_inputs(x)
            assert "attention_mask" not in kwargs and kwargs["is_causal"] is False
            assert all(bool(_dense_pattern(m, 2, n).all()) for m, _ in calls)
    # padding (left and right): a block mask too, real positions equal to the SDPA path's
    pad = torch.tensor([[1] * L, [0, 0] + [1] * (L - 2)])
    out = flex(x, attention_mask=pad)
    torch.testing.assert_close(out[pad.bool()], sdpa(x, attention_mask=pad)[pad.bool()], rtol=1e-5, atol=1e-5)
    assert all(isinstance(m, BlockMask) for m, _ in spy.take())


def _fake_flash(module, query, key, value, attention_mask, **kwargs):
    """Stands in for transformers' flash_attention_forward (not installable without CUDA): the same reading of
    ``is_causal`` (the keyword if given, else the module's flag), computed with SDPA; refuses a 4D mask as flash
    attention cannot take one."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert attention_mask is None, "flash attention takes no 4D mask"
    is_causal = kwargs.pop("is_causal", None)
    is_causal = module.is_causal if is_causal is None else is_causal
    return sdpa_attention_forward(module, query, key, value, None, is_causal=is_causal, **kwargs)


@torch.no_grad()
def test_flash_attention_runs_the_maskless_calls_and_refuses_a_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    sdpa = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    flash = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    flash.config._attn_implementation = "flash_attention_2"  # decision logic only: the kernel is faked
    spy = AttentionSpy(monkeypatch, "flash_attention_2", run=_fake_flash)
    layers = flash.config.num_hidden_layers
    x = random_ids()
    assert flash.attention_path(L, 1.0) == "non_causal" and flash.attention_path(L, 0.0) == "causal"
    torch.testing.assert_close(flash(x), sdpa(x), rtol=1e-6, atol=1e-6)
    assert spy.take() == [(None, False)] * layers  # γ = 1: no mask, is_causal=False
    torch.testing.assert_close(flash(x, bidirectional_prob=0.0), sdpa(x, bidirectional_prob=0.0), rtol=1e-6,
                               atol=1e-6)
    assert spy.take() == [(None, None)] * layers  # γ = 0: the module's own causal flag
    refusals = [
        (dict(bidirectional_prob=0.5, generator=torch.Generator().manual_seed(0)), "annealing"),
        (dict(attention_mask=torch.ones(2, L)), "padding"),
    ]
    for kwargs, reason in refusals:
        for call in (flash, flash.hidden_states):
            with pytest.raises(ValueError, match=rf"attn_implementation='flash_attention_2' .*\({reason}.*"
                                                 r"attn_implementation='sdpa', 'eager' or 'flex_attention'"):
                call(x, **kwargs)
    with pytest.raises(ValueError, match=r"attn_implementation='flash_attention_2' .*annealing"):
        flash.attention_path(L, 0.5)
    with pytest.raises(ValueError, match=r"attn_implementation='flash_attention_2' .*padding"):
        flash.attention_path(L, 1.0, padded=True)
    flash.dense_bidirectional_mask = True
    with pytest.raises(ValueError, match="dense_bidirectional_mask=True"):
        flash(x)
    assert spy.take() == []  # refused before any attention ran
    windowed = adapt_ar_model(tiny_model("mistral"), mask_token_id=MASK_ID)  # window 4 < L + 1 bites at γ = 1
    windowed.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"a sliding window of 4 < 9 positions"):
        windowed(x)
    assert windowed.attention_path(3) == "non_causal"  # 4 positions: the window cannot bite
