"""DiffusionGemma as a unifusion denoiser, on tiny random configs (nothing downloads).

The reference is transformers' own ``DiffusionGemmaForBlockDiffusion``: its decoder logits for (prefix, canvas), and
its ``generate`` (reproduced token for token by a loop written from the notes' description of it over
:mod:`unifusion.hf.diffusion_gemma.cache`).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from _hf_tiny import VOCAB
from _hf_tiny import tiny_diffusion_gemma as tiny

import unifusion as uf
from unifusion.denoiser import Denoiser
from unifusion.hf.diffusion_gemma.cache import commit, denoise, prefill
from unifusion.hf.diffusion_gemma.model import CARRY_LOGIT, DiffusionGemmaLM
from unifusion.hf.registry import register_diffusion_lm, supported_diffusion_lms, wrap_diffusion_lm

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
    pytest.skip("this transformers has no DiffusionGemma", allow_module_level=True)
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (  # noqa: E402
    DiffusionGemmaGenerationConfig,
    EntropyBoundSamplerConfig,
)

TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "tiny_tokenizer"


@pytest.fixture(scope="module")
def model() -> DiffusionGemmaLM:
    return wrap_diffusion_lm(tiny())


def tokens(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB - 3, shape, generator=torch.Generator().manual_seed(seed))


def reference_logits(model: DiffusionGemmaLM, prefix: torch.Tensor, canvas: torch.Tensor, **kw: object):
    with torch.no_grad():
        return model.base_model(input_ids=prefix, decoder_input_ids=canvas, **kw).logits


# -- the wrapper -------------------------------------------------------------------------------------------------


def test_wrap_dispatches_on_model_type(model):
    assert isinstance(model, DiffusionGemmaLM) and isinstance(model, Denoiser)
    assert (model.num_states, model.vocab_size, model.mask_token_id, model.canvas_length) == (VOCAB, VOCAB, None, 4)
    assert model.device == torch.device("cpu") and model.dtype == torch.float32 and model.tokenizer is None
    assert isinstance(model.kernel, uf.UniformKernel) and model.kernel.num_states == VOCAB
    assert model.final_logit_softcap == 30.0 and model.sliding_window == 8
    assert "diffusion_gemma" in supported_diffusion_lms()
    with pytest.warns(UserWarning, match="already"):
        assert wrap_diffusion_lm(model) is model
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"\[.*'diffusion_gemma'.*\].*llama.*adapt_ar_model"):  # every kind listed
        wrap_diffusion_lm(llama)
    with pytest.raises(TypeError, match="DiffusionGemmaForBlockDiffusion"):
        wrap_diffusion_lm(model.base_model.model)
    with pytest.raises(ValueError, match="mask"):
        wrap_diffusion_lm(model.base_model, kernel=uf.MaskKernel(VOCAB, mask_id=VOCAB - 1))


def test_registry_takes_new_families():
    seen = []
    register_diffusion_lm("toy_diffusion", lambda m, **kw: seen.append(m) or DiffusionGemmaLM(tiny()))
    try:
        fake = type("Fake", (), {"config": type("C", (), {"model_type": "toy_diffusion"})()})()
        assert isinstance(wrap_diffusion_lm(fake), DiffusionGemmaLM) and seen == [fake]
        with pytest.warns(UserWarning, match="replacing"):
            register_diffusion_lm("toy_diffusion", lambda m, **kw: DiffusionGemmaLM(tiny()))
    finally:
        from unifusion.hf import registry
        registry._REGISTRY.pop("toy_diffusion")


def test_one_canvas_is_the_reference_forward_bit_for_bit(model):
    P, K = 11, 4  # the prompt is longer than the sliding window (8)
    x_t = tokens((3, P + K), 0)
    with torch.no_grad():
        logits = model(x_t, torch.full((3,), 0.5), prompt_length=P)
    assert logits.shape == (3, P + K, VOCAB) and logits.dtype == torch.float32
    assert torch.equal(logits[:, P:], reference_logits(model, x_t[:, :P], x_t[:, P:]))
    # prompt columns: the point mass on the clean token
    assert torch.equal(logits[:, :P].argmax(-1), x_t[:, :P])
    assert (logits[:, :P].amax(-1) == 0).all() and (logits[:, :P] <= 0).all()
    assert (logits[:, :P] == CARRY_LOGIT).sum() == 3 * P * (VOCAB - 1)


def test_bf16_weights_give_the_reference_float32_logits():
    model = wrap_diffusion_lm(tiny().to(torch.bfloat16))
    x_t = tokens((2, 15), 12)
    prompt = torch.arange(15)[None, :] < torch.tensor([[11], [7]])
    with torch.no_grad():
        plain = model(x_t, None, prompt_length=11)
        ragged = model(x_t, None, prompt_mask=prompt, self_conditioning_logits=torch.zeros(2, 15, VOCAB))
    ref = reference_logits(model, x_t[:, :11], x_t[:, 11:])
    assert plain.dtype == torch.float32 and torch.equal(plain[:, 11:], ref)
    assert ragged.dtype == torch.float32 and torch.isfinite(ragged).all()


@pytest.mark.parametrize("layout", ["three_canvases", "ragged_prompts", "left_padding", "right_padding"])
def test_each_canvas_sees_its_clean_prefix_and_itself(model, layout):
    """Canvas c of a row equals the reference decoder on (clean prefix = prompt + canvases < c, canvas c)."""
    K, L = 4, 20
    x0, noise = tokens((2, L), 1), tokens((2, L), 2)
    lengths = {"three_canvases": [9, 9], "ragged_prompts": [11, 6]}.get(layout, [9, 5])
    prompt = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    mask = torch.ones(2, L, dtype=torch.bool)
    if layout == "left_padding":
        mask[1, :3] = False
        prompt[1] = (torch.arange(L) >= 3) & (torch.arange(L) < 3 + lengths[1])
    if layout == "right_padding":
        mask[0, L - 5:] = False
    x_t = torch.where(prompt | ~mask, x0, noise)
    with torch.no_grad():
        logits = model(x_t, None, prompt_mask=prompt, x0=x0, attention_mask=None if mask.all() else mask)
    for b in range(2):
        first, start = int((~mask[b]).long().cumprod(0).sum()), int(prompt[b].nonzero().max()) + 1
        end = first + int(mask[b].sum())
        for a in range(start, end, K):
            e = min(a + K, end)
            ref = reference_logits(model, x0[b:b + 1, first:a], x_t[b:b + 1, a:e])
            torch.testing.assert_close(logits[b:b + 1, a:e], ref, rtol=0, atol=2e-6)
        outside = torch.ones(L, dtype=torch.bool)
        outside[start:end] = False
        assert torch.equal(logits[b, outside].argmax(-1), x0[b, outside])  # carried over


def test_without_x0_the_committed_canvases_are_read_from_x_t(model):
    P, K = 6, 4
    x0, x_t = tokens((1, P + 2 * K), 3), tokens((1, P + 2 * K), 4)
    x_t[:, :P] = x0[:, :P]
    with torch.no_grad():
        logits = model(x_t, None, prompt_length=P)
    torch.testing.assert_close(logits[:, P + K:], reference_logits(model, x_t[:, :P + K], x_t[:, P + K:]),
                               rtol=0, atol=2e-6)


def test_eager_attention_equals_sdpa():
    hf = tiny()
    sdpa = wrap_diffusion_lm(hf)
    x_t = tokens((2, 21), 5)
    prompt = torch.arange(21)[None, :] < torch.tensor([[9], [4]])
    with torch.no_grad():
        a = sdpa(x_t, None, prompt_mask=prompt)
        hf.set_attn_implementation("eager")
        b = sdpa(x_t, None, prompt_mask=prompt)
    torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


# -- losses and gradients --------------------------------------------------------------------------------------


def _sft_batch(model, seed=0, L=15, P=(6, 9)):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randint(3, VOCAB - 3, (2, L), generator=g)
    prompt = torch.arange(L)[None, :] < torch.tensor(P)[:, None]
    t = torch.tensor([0.3, 0.8])
    x_t = torch.where(prompt, x0, model.kernel.sample(x0, t, generator=g))
    return x0, x_t, t, prompt


def test_loss_is_gidd_of_the_reference_logits_and_zero_on_the_prompt(model):
    """Done-when of the issue: per-position loss on [prompt | canvas] = gidd_loss of the model's own decoder logits
    for (prompt, x_t), to float rounding; exactly 0 on the prompt."""
    P, K = 7, 4
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(3, VOCAB - 3, (3, P + K), generator=g)
    t = torch.tensor([0.1, 0.5, 0.9])
    x_t = torch.cat([x0[:, :P], model.kernel.sample(x0[:, P:], t, generator=g)], dim=1)
    prompt = torch.arange(P + K)[None, :].expand(3, -1) < P
    tt = t[:, None].expand(3, P + K)
    with torch.no_grad():
        ours = uf.losses.gidd_loss(model(x_t, t, prompt_mask=prompt), x0, x_t, tt, model.kernel)
        ref = uf.losses.gidd_loss(reference_logits(model, x0[:, :P], x_t[:, P:]), x0[:, P:], x_t[:, P:],
                                  tt[:, P:], model.kernel)
        fused = model(x_t, t, prompt_mask=prompt, x0=x0, kernel=model.kernel)
        reference = uf.losses.reference_gidd_loss(model(x_t, t, prompt_mask=prompt), x0, x_t, tt, model.kernel)
    assert torch.equal(ours[:, :P], torch.zeros(3, P)) and torch.equal(fused[:, :P], torch.zeros(3, P))
    assert torch.equal(reference[:, :P], torch.zeros(3, P))
    torch.testing.assert_close(ours[:, P:], ref)
    torch.testing.assert_close(fused, ours)
    torch.testing.assert_close(reference, ours)
    assert (ours[:, P:] > 0).all()


def test_diffusion_loss_passes_the_prompt_and_the_clean_tokens(model):
    """``diffusion_loss(wrapped, x0, kernel, prompt_mask=)`` (the model declares ``conditions_on_prompt``): the
    same x_t and per-position loss as the wrapper called by hand with the prompt mask and x0, fused and unfused;
    0 on the prompt, which does not count."""
    x0, _, _, prompt = _sft_batch(model)
    t = torch.tensor([0.3, 0.8])
    for fused in (False, True):
        with torch.no_grad():
            out = uf.diffusion_loss(model, x0, model.kernel, prompt_mask=prompt, t=t, fused=fused,
                                    generator=torch.Generator().manual_seed(1))
            logits = model(out.x_t, t, prompt_mask=prompt, x0=x0)
            by_hand = uf.losses.gidd_loss(logits, x0, out.x_t, t[:, None].expand_as(out.x_t), model.kernel)
        assert torch.equal(out.x_t[prompt], x0[prompt])
        assert torch.equal(out.loss[prompt], torch.zeros(int(prompt.sum())))
        assert out.num_tokens == (~prompt).sum()
        torch.testing.assert_close(out.loss, torch.where(prompt, 0.0, by_hand))


def test_gradients_reach_every_weight_of_the_text_model():
    model = wrap_diffusion_lm(tiny())
    x0, x_t, t, prompt = _sft_batch(model)
    loss = model(x_t, t, prompt_mask=prompt, x0=x0, kernel=model.kernel, self_conditioning_prob=1.0,
                 generator=torch.Generator().manual_seed(0))
    loss.sum().backward()
    missing = [n for n, p in model.base_model.named_parameters()
               if "vision" not in n and (p.grad is None or not p.grad.abs().sum() > 0)]
    assert missing == []
    names = {n for n, _ in model.base_model.named_parameters()}
    assert {"model.encoder.language_model.layers.0.experts.gate_up_proj",
            "model.encoder.language_model.layers.1.router.proj.weight",
            "model.decoder.self_conditioning.gate_proj.weight"} <= names


def test_self_conditioning(model):
    P, K = 5, 4
    x_t = tokens((2, P + K), 6)
    previous = torch.randn(2, P + K, VOCAB, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(x_t, None, prompt_length=P, self_conditioning_logits=previous)
        ref = reference_logits(model, x_t[:, :P], x_t[:, P:], self_conditioning_logits=previous[:, P:])
        plain = model(x_t, None, prompt_length=P)
        never = model(x_t, None, prompt_length=P, self_conditioning_prob=0.0)
        always = model(x_t, None, prompt_length=P, self_conditioning_prob=1.0)
        first = reference_logits(model, x_t[:, :P], x_t[:, P:])
        second = reference_logits(model, x_t[:, :P], x_t[:, P:], self_conditioning_logits=first)
    assert torch.equal(ours[:, P:], ref) and not torch.equal(ours, plain)
    assert torch.equal(never, plain)
    torch.testing.assert_close(always[:, P:], second, rtol=0, atol=1e-6)
    # per row, with probability p: rows that draw "no" are the plain pass
    g = torch.Generator().manual_seed(3)
    draws = torch.rand(2, generator=torch.Generator().manual_seed(3)) < 0.5
    with torch.no_grad():
        half = model(x_t, None, prompt_length=P, self_conditioning_prob=0.5, generator=g)
    for b in range(2):
        torch.testing.assert_close(half[b], (always if draws[b] else plain)[b], rtol=0, atol=1e-6)


# -- cached decoding primitives, and the reference generate --------------------------------------------------------


def test_cached_canvas_steps_equal_the_uncached_forward(model):
    P, K = 10, 4
    x0, noise = tokens((2, P + 3 * K), 7), tokens((2, P + 3 * K), 8)
    x_t = torch.cat([x0[:, :P], noise[:, P:]], dim=1)
    with torch.no_grad():
        full = model(x_t, None, prompt_length=P, x0=x0)
        state = prefill(model, x0[:, :P])
        for c in range(3):
            a = P + c * K
            if c:
                commit(model, state, x0[:, a - K:a])
            torch.testing.assert_close(denoise(model, state, x_t[:, a:a + K]), full[:, a:a + K], rtol=0, atol=2e-6)
    assert state.length == P + 2 * K and state.cache.get_seq_length() == P + 2 * K


def _reference_loop(model, prompt, cfg):
    """DiffusionGemma's generate, as the notes describe it (global RNG, op by op), over the cached primitives."""
    K, V = model.canvas_length, model.vocab_size
    B = prompt.shape[0]
    N, bound, t_min, t_max = cfg["max_denoising_steps"], cfg["entropy_bound"], cfg["t_min"], cfg["t_max"]
    S, confidence, eos, pad = cfg["stability_threshold"], cfg["confidence_threshold"], cfg["eos"], cfg["pad"]
    state, seq = prefill(model, prompt), prompt
    finished = torch.zeros(B, dtype=torch.bool)
    for c in range(math.ceil(cfg["max_new_tokens"] / K)):
        if c:
            commit(model, state, seq[:, -K:])
        canvas = torch.randint(low=0, high=V, size=(B, K))
        argmax, sc, done = canvas, None, torch.zeros(B, dtype=torch.bool)
        history = torch.full((S, B, K), -1, dtype=torch.long)
        for n in reversed(range(1, N + 1)):
            z = denoise(model, state, canvas, self_conditioning_logits=sc)
            z = z / (t_min + (t_max - t_min) * (torch.tensor(n, dtype=torch.int32) / N))
            draw = torch.multinomial(torch.softmax(z, -1, dtype=torch.float32).view(-1, V), num_samples=1)
            draw = draw.view(B, K)
            new_argmax = z.argmax(-1)
            entropy, order = torch.sort(torch.distributions.Categorical(logits=z).entropy(), dim=-1)
            accept = torch.zeros(B, K, dtype=torch.bool).scatter(-1, order, entropy.cumsum(-1) - entropy <= bound)
            new_canvas = torch.where(~accept, torch.randint(low=0, high=V, size=(B, K)),
                                     torch.where(accept, draw, canvas))
            if done.any():
                new_argmax = torch.where(done[:, None], argmax, new_argmax)
                new_canvas = torch.where(done[:, None], canvas, new_canvas)
                z = torch.where(done[:, None, None], sc, z)
            stable = (history == new_argmax[None]).all(-1).all(0)  # S = 0: always stable
            if S:
                history = torch.cat([history[1:], new_argmax[None]])
            done = done | (stable & (torch.distributions.Categorical(logits=z).entropy().mean(-1) < confidence))
            canvas, argmax, sc = new_canvas, new_argmax, z
            if done.all():
                break
        new = argmax.clone()
        is_eos = torch.isin(new, torch.tensor(eos))
        now = is_eos.any(-1)
        new[finished] = pad
        after = (is_eos.cumsum(-1) > 0) & ~((is_eos.cumsum(-1) == 1) & is_eos)
        new[now[:, None] & after] = pad
        seq, finished = torch.cat([seq, new], dim=1), finished | now
        if finished.all():
            break
    return seq


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", ["all_steps", "early_stop_and_eos"])
def test_reference_generate_is_reproduced_token_for_token(model, seed, case):
    cfg = dict(max_new_tokens=7, max_denoising_steps=4, entropy_bound=0.3, t_min=0.4, t_max=0.8,
               stability_threshold=1, confidence_threshold=0.005, eos=[1], pad=0)
    if case == "early_stop_and_eos":
        # the tiny model's mean entropy falls through 4.836 nats at different steps in different rows, so rows stop
        # early one by one (stability_threshold=0: confidence alone); many EOS ids end rows in different canvases
        cfg.update(max_new_tokens=12, max_denoising_steps=6, entropy_bound=2.0, stability_threshold=0,
                   confidence_threshold=4.836, eos=list(range(1, 30)))
    prompt = tokens((3, 6), 10 + seed)
    gc = DiffusionGemmaGenerationConfig(
        max_new_tokens=cfg["max_new_tokens"], max_denoising_steps=cfg["max_denoising_steps"],
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=cfg["entropy_bound"]), t_min=cfg["t_min"],
        t_max=cfg["t_max"], stability_threshold=cfg["stability_threshold"],
        confidence_threshold=cfg["confidence_threshold"], eos_token_id=cfg["eos"], pad_token_id=cfg["pad"])
    torch.manual_seed(seed)
    expected = model.base_model.generate(prompt, generation_config=gc)
    torch.manual_seed(seed)
    with torch.no_grad():
        ours = _reference_loop(model, prompt, cfg)
    assert torch.equal(ours, expected.sequences)
    if case == "early_stop_and_eos":
        assert (expected.tokens_per_forward != expected.tokens_per_forward[0]).any() or seed == 0
        assert (expected.sequences[:, -1] == 0).any()


# -- save / load, likelihood, bad input ------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER))
    kernel = uf.UniformKernel(VOCAB, uf.schedules.LogLinearSchedule(eps=1e-3))
    model = wrap_diffusion_lm(tiny(seed=4), tokenizer=tokenizer, kernel=kernel)
    model.save_pretrained(tmp_path / "m")
    loaded = DiffusionGemmaLM.from_pretrained(tmp_path / "m")
    assert {p.name for p in (tmp_path / "m").iterdir()} >= {"config.json", "model.safetensors",
                                                           "unifusion_config.json", "tokenizer_config.json"}
    assert repr(loaded.kernel) == repr(kernel) and loaded.tokenizer is not None and not loaded.training
    for (name, a), b in zip(model.base_model.state_dict().items(), loaded.base_model.state_dict().values()):
        assert torch.equal(a, b), name
    x_t = tokens((2, 9), 9)
    with torch.no_grad():
        assert torch.equal(model(x_t, None, prompt_length=4), loaded(x_t, None, prompt_length=4))
    # a plain transformers checkpoint loads too, under UniformKernel(V)
    model.base_model.save_pretrained(tmp_path / "plain")
    plain = DiffusionGemmaLM.from_pretrained(tmp_path / "plain")
    assert repr(plain.kernel) == repr(uf.UniformKernel(VOCAB)) and plain.tokenizer is None
    with pytest.raises(ValueError, match="directory: no such folder"):
        DiffusionGemmaLM.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="directory: expected a DiffusionGemma checkpoint folder .with config.json"):
        DiffusionGemmaLM.from_pretrained(tmp_path / "empty")


def test_conditional_bound_is_finite_and_depends_on_the_prompt(model):
    x0, _, _, prompt = _sft_batch(model, L=12, P=(5, 8))
    response = (~prompt).sum(-1)
    g = torch.Generator().manual_seed(0)
    bound = uf.eval.nll_bound(model.conditioned_on(x0, prompt_mask=prompt), x0, model.kernel, num_times=4,
                              generator=g, per_token=False) / response
    assert bound.shape == (2,) and bound.dtype == torch.float64 and torch.isfinite(bound).all() and (bound > 0).all()
    other = x0.clone()
    other[:, :3] = (other[:, :3] + 7) % VOCAB
    g = torch.Generator().manual_seed(0)
    moved = uf.eval.nll_bound(model.conditioned_on(other, prompt_mask=prompt), other, model.kernel, num_times=4,
                              generator=g, per_token=False) / response
    assert not torch.allclose(bound, moved)


def test_bad_input_names_the_argument(model):
    x_t = tokens((2, 10), 11)
    prompt = torch.arange(10)[None, :].expand(2, -1) < 4
    cases = [
        (dict(), ValueError, "prompt_mask, prompt_length"),
        (dict(prompt_length=4, prompt_mask=prompt), ValueError, "prompt_mask, prompt_length"),
        (dict(prompt_length=0), ValueError, "no prompt token"),
        (dict(prompt_length=10), ValueError, "whole of row 0"),
        (dict(prompt_mask=prompt.long()), TypeError, "prompt_mask"),
        (dict(prompt_mask=prompt[:, :5]), ValueError, "prompt_mask"),
        (dict(prompt_mask=prompt.roll(1, -1)), ValueError, "not a prefix"),
        (dict(prompt_length=4.0), TypeError, "prompt_length"),
        (dict(prompt_length=4, bidirectional_prob=0.5), ValueError, "bidirectional_prob"),
        (dict(prompt_length=4, kernel=model.kernel), ValueError, "x0, kernel"),
        (dict(prompt_length=4, self_conditioning_prob=1.5), ValueError, "self_conditioning_prob"),
        (dict(prompt_length=4, self_conditioning_logits=torch.zeros(2, 10, 5)), ValueError,
         "self_conditioning_logits"),
        (dict(prompt_length=4, x0=x_t[:, :3]), ValueError, "x0"),
        (dict(prompt_length=4, attention_mask=torch.tensor([[1, 0] * 5] * 2)), ValueError, "attention_mask"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            model(x_t, None, **kwargs)
    with pytest.raises(ValueError, match="x_t"):
        model(x_t + VOCAB, None, prompt_length=4)
    with pytest.raises(ValueError, match="t: "):
        model(x_t, torch.full((2, 10), 0.5), prompt_length=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x_t, 0.5, prompt_length=torch.tensor([4, 5]))


def test_nll_bound_and_diffusion_loss_condition_on_the_prompt_without_a_wrapper(model):
    """One prompt rule (``unifusion.denoiser.prompt_conditioning``): ``nll_bound(model, x0, kernel, prompt_mask=pm)``
    runs on DiffusionGemma as it is and equals the bound through ``conditioned_on`` (the same draws; the prompt
    columns, which the wrapper scores exactly 0, are simply not summed); ``diffusion_loss`` passes the same keywords;
    without a prompt the error names ``prompt_mask``."""
    from unifusion.denoiser import prompt_conditioning

    x0, _, _, prompt = _sft_batch(model, L=12, P=(5, 8))
    kw = dict(num_times=4, per_token=False)
    plain = uf.eval.nll_bound(model, x0, model.kernel, prompt_mask=prompt, generator=torch.Generator().manual_seed(0),
                              **kw)
    wrapped = uf.eval.nll_bound(model.conditioned_on(x0, prompt_mask=prompt), x0, model.kernel, prompt_mask=prompt,
                                generator=torch.Generator().manual_seed(0), **kw)
    assert torch.isfinite(plain).all() and (plain > 0).all()
    torch.testing.assert_close(plain, wrapped, rtol=1e-12, atol=0.0)
    assert prompt_conditioning(model, x0, prompt).keys() == {"prompt_mask", "x0"}
    assert prompt_conditioning(lambda x_t, t: x_t, x0, prompt) == {}  # a model that reads its prompt from x_t
    with pytest.raises(ValueError, match="prompt_mask: DiffusionGemmaLM conditions on a clean prompt"):
        uf.eval.nll_bound(model, x0, model.kernel, **kw)
