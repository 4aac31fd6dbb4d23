"""DiffusionGemmaLM as a BlockDenoiser, and its generate: transformers' DiffusionGemmaForBlockDiffusion.generate
reproduced token for token by unifusion's PolicySampler + EntropyBound (``parity=True``) on two tiny random
configurations and two seeds, and the default mode's fixes of the reference's defects (nothing downloads)."""

from __future__ import annotations

import pytest
import torch

import unifusion as uf
from unifusion.samplers import BayesianSampler, PolicySampler
from unifusion.samplers.policies import EntropyBound, LowConfidence
from unifusion.samplers.policy_sampler import BlockDenoiser

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
    pytest.skip("this transformers has no DiffusionGemma", allow_module_level=True)
from test_diffusion_gemma import VOCAB, tiny, tokens  # noqa: E402
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (  # noqa: E402
    DiffusionGemmaGenerationConfig as GenerationConfig,
)
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (  # noqa: E402
    EntropyBoundSamplerConfig,
)

torch.set_num_threads(1)


def sharp(canvas_length: int = 8, seed: int = 1, eos_boost: float | None = None) -> uf.hf.DiffusionGemmaLM:
    """The second configuration: canvas 8, sliding window 4 (shorter than the prompts), 2 experts of which the top
    1, and a head scaled by 30 so that entropies are well below log V and canvases stop early."""
    hf = tiny(canvas_length, seed, sliding_window=4, num_experts=2, top_k_experts=1)
    with torch.no_grad():
        hf.lm_head.weight.mul_(30.0)
        if eos_boost is not None:
            hf.lm_head.weight[1].mul_(eos_boost)
    return uf.hf.wrap_diffusion_lm(hf)


@pytest.fixture(scope="module")
def model() -> uf.hf.DiffusionGemmaLM:
    return uf.hf.wrap_diffusion_lm(tiny())


@pytest.fixture(scope="module")
def sharp_model() -> uf.hf.DiffusionGemmaLM:
    return sharp()


def config(**kw: object) -> GenerationConfig:
    bound = kw.pop("entropy_bound", 0.3)
    base = dict(max_new_tokens=7, max_denoising_steps=4, t_min=0.4, t_max=0.8, stability_threshold=1,
                confidence_threshold=0.005)
    base.update(kw)
    return GenerationConfig(sampler_config=EntropyBoundSamplerConfig(entropy_bound=bound), **base)


def both(model, prompt, gc, seed, **kw):
    torch.manual_seed(seed)
    reference = model.base_model.generate(prompt, generation_config=gc, **kw)
    torch.manual_seed(seed)
    ours = model.generate(prompt, gc, parity=True, return_dict=True, **kw)
    return reference, ours


# -- parity with transformers ----------------------------------------------------------------------------------


CASES = {
    # every canvas runs all its steps; output rounded up to whole canvases (7 → 8)
    "all_steps": ("model", dict()),
    # rows stop canvases at different steps (confidence alone), many EOS ids end rows in different canvases: the
    # reference keeps denoising a finished row's pad canvases and waits for it, and so does parity mode
    "early_stop_and_eos": ("model", dict(max_new_tokens=12, max_denoising_steps=6, entropy_bound=2.0,
                                         stability_threshold=0, confidence_threshold=4.836,
                                         eos_token_id=list(range(1, 30)), pad_token_id=0)),
    # sharp head, canvas 8 longer than the sliding window, 3 canvases, rows stop each at their own step
    "sharp": ("sharp_model", dict(max_new_tokens=20, max_denoising_steps=6, entropy_bound=1.0,
                                  stability_threshold=0, confidence_threshold=0.8)),
    "sharp_eos": ("sharp_model", dict(max_new_tokens=24, max_denoising_steps=5, entropy_bound=2.0,
                                      confidence_threshold=0.9, eos_token_id=[1, 7, 9, 11], pad_token_id=0)),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_generate_parity_token_for_token(request, case, seed):
    name, kw = CASES[case]
    model = request.getfixturevalue(name)
    prompt = tokens((3, 6), 20 + seed)
    reference, ours = both(model, prompt, config(**kw), seed)
    assert torch.equal(ours.sequences, reference.sequences)
    assert torch.equal(ours.tokens_per_forward, reference.tokens_per_forward.float())
    assert ours.cache.get_seq_length() == reference.cache.get_seq_length()  # the last canvas not committed (D3)


def test_parity_keeps_eos_finished_rows_running():
    """A row that ended at EOS in an earlier canvas still takes part in the reference's later canvases (its pad canvas
    is denoised, draws are spent on it, and the canvas ends only when it is done too): parity mode does the same."""
    model = sharp(seed=3, eos_boost=1.5)
    gc = config(max_new_tokens=24, max_denoising_steps=5, entropy_bound=2.0, confidence_threshold=0.9,
                eos_token_id=[1], pad_token_id=0)
    seen = 0
    for seed in range(4):
        prompt = tokens((3, 5), 40 + seed)
        reference, ours = both(model, prompt, gc, seed)
        assert torch.equal(ours.sequences, reference.sequences)
        pad_canvas = (reference.sequences[:, -8:] == 0).all(-1)
        seen += int(bool(pad_canvas.any()) and not bool(pad_canvas.all()))
    assert seen > 0  # some run had a row finished while another went on


def test_parity_with_left_padding(sharp_model):
    prompt = tokens((2, 7), 5)
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    prompt[0, :3] = 0
    gc = config(max_new_tokens=16, max_denoising_steps=5, entropy_bound=1.0, stability_threshold=0,
                confidence_threshold=0.8)
    reference, ours = both(sharp_model, prompt, gc, 3, attention_mask=mask)
    assert torch.equal(ours.sequences, reference.sequences)


# -- the model as a BlockDenoiser, other samplers ---------------------------------------------------------------


def test_policy_sampler_runs_on_the_wrapper_as_the_reference(sharp_model):
    """PolicySampler over the wrapper's own start_blocks/denoise_block/commit_block, one call for all canvases: the
    reference's tokens when the output is whole canvases and nothing stops at EOS."""
    K, P, n = 8, 6, 24
    prompt = tokens((2, P), 9)
    gc = config(max_new_tokens=n, max_denoising_steps=5, entropy_bound=1.0, stability_threshold=0,
                confidence_threshold=0.8)
    torch.manual_seed(0)
    reference = sharp_model.base_model.generate(prompt, generation_config=gc)
    assert isinstance(sharp_model, BlockDenoiser)
    policy = EntropyBound(1.0, stability_threshold=0, confidence_threshold=0.8)
    sampler = PolicySampler(sharp_model, uf.UniformKernel(VOCAB), policy, num_steps=5, block_size=K)
    ids = torch.cat([prompt, torch.full((2, n), -1)], dim=1)
    torch.manual_seed(0)
    out = sampler.sample(2, P + n, prompt=ids, return_dict=True)
    assert torch.equal(out.sequences, reference.sequences)
    # per-row generators: a row's tokens do not depend on its neighbours
    gens = [torch.Generator().manual_seed(s) for s in (5, 6)]
    pair = sampler.sample(2, P + n, prompt=ids, generator=gens)
    alone = sampler.sample(1, P + n, prompt=ids[1:], generator=[torch.Generator().manual_seed(6)])
    assert torch.equal(pair[1:], alone)
    # EOS: a row stops, drops out of the cache, the others go on
    eos = int(pair[0, P + 2])
    gens = [torch.Generator().manual_seed(s) for s in (5, 6)]
    stopped = sampler.sample(2, P + n, prompt=ids, generator=gens, eos_token_id=eos, pad_token_id=0,
                             return_dict=True)
    assert stopped.sequences.shape == (2, P + n)
    for row in range(2):  # each row: its tokens without EOS stopping, up to its first EOS, then pad
        free = pair[row, P:]
        cut = int((free == eos).int().argmax()) if (free == eos).any() else n - 1
        assert torch.equal(stopped.sequences[row, P:P + cut + 1], free[:cut + 1])
        assert (stopped.sequences[row, P + cut + 1:] == 0).all()
    assert stopped.num_forwards[0] < stopped.num_forwards[1]  # row 0 left the cache after its first canvas


def test_x0_callable_samplers(sharp_model):
    """with_prompt(P) is the plain x0 call: PolicySampler on it (one canvas: the whole-sequence forward is exact)
    gives the block path's tokens; BayesianSampler runs on it and keeps the prompt."""
    K, P = 8, 6
    prompt = tokens((2, P), 11)
    ids = torch.cat([prompt, torch.full((2, K), -1)], dim=1)
    policy = EntropyBound(1.0, stability_threshold=0, confidence_threshold=0.8)
    kernel = uf.UniformKernel(VOCAB)
    block = PolicySampler(sharp_model, kernel, policy, num_steps=5, block_size=K)
    plain = PolicySampler(sharp_model.with_prompt(P), kernel, policy, num_steps=5, block_size=K)
    assert block.blockwise and not plain.blockwise
    g = [torch.Generator().manual_seed(s) for s in (1, 2)]
    a = block.sample(2, P + K, prompt=ids, generator=g)
    g = [torch.Generator().manual_seed(s) for s in (1, 2)]
    b = plain.sample(2, P + K, prompt=ids, generator=g)
    assert torch.equal(a, b)
    bayes = BayesianSampler(sharp_model.with_prompt(P), kernel, num_steps=4)
    out = bayes.sample(2, P + K, prompt=ids, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, P + K) and torch.equal(out[:, :P], prompt) and ((out >= 0) & (out < VOCAB)).all()
    with pytest.raises(ValueError, match="mask"):
        PolicySampler(sharp_model, uf.MaskKernel(VOCAB, mask_id=VOCAB - 1), LowConfidence())
    with pytest.raises(ValueError, match="prompt_length"):
        sharp_model.with_prompt(0)


# -- the default mode: what it fixes -------------------------------------------------------------------------------


def test_default_output_length_cache_and_schedule(sharp_model):
    P, n = 6, 20  # 20 new tokens = 2.5 canvases of 8
    prompt = tokens((2, P), 13)
    gc = config(max_new_tokens=n, max_denoising_steps=5, entropy_bound=1.0, stability_threshold=0,
                confidence_threshold=0.8)
    torch.manual_seed(0)
    reference = sharp_model.base_model.generate(prompt, generation_config=gc)
    assert reference.sequences.shape[1] == P + 24 and reference.cache.get_seq_length() == P + 16  # D2, D3
    torch.manual_seed(0)
    out = sharp_model.generate(prompt, gc, return_dict=True)
    assert out.sequences.shape == (2, P + n)  # cut at max_new_tokens
    assert out.cache.get_seq_length() == P + n  # every returned token is in the cache
    assert torch.equal(out.sequences[:, :P], prompt)
    assert (out.num_forwards <= 3 * 5).all() and (out.tokens_per_forward > 0).all()
    # the returned cache continues the sequence: the reference's decoder call on it equals the uncached forward
    canvas = tokens((2, 8), 14)
    with torch.no_grad():
        cached = sharp_model.base_model(decoder_input_ids=canvas, cache=out.cache, decoder_position_ids=torch.arange(
            P + n, P + n + 8, dtype=torch.int32)[None]).logits
        full = sharp_model(torch.cat([out.sequences, canvas], 1), None, prompt_length=P + n)[:, P + n:]
    torch.testing.assert_close(cached, full, rtol=0, atol=2e-5)
    # the temperature reaches t_min at the last step (the reference stops one step short)
    default = EntropyBound(1.0, reach_t_min=True).temperatures(5, torch.device("cpu"))
    ref = EntropyBound(1.0).temperatures(5, torch.device("cpu"))
    assert default[0] == ref[0] == torch.tensor(0.8) and default[-1] == torch.tensor(0.4) and ref[-1] > 0.4


def test_default_rows_do_not_depend_on_their_neighbours(sharp_model):
    prompt = tokens((2, 6), 15)
    gc = config(max_new_tokens=16, max_denoising_steps=5, entropy_bound=1.0, stability_threshold=0,
                confidence_threshold=0.8)
    torch.manual_seed(1)
    alone = sharp_model.generate(prompt[:1], gc)
    torch.manual_seed(1)
    pair = sharp_model.generate(prompt, gc)
    assert torch.equal(pair[:1], alone)  # the reference changes row 0 when a row is added (D6)
    gens = [torch.Generator().manual_seed(s) for s in (3, 4)]
    pair = sharp_model.generate(prompt, gc, generator=gens)
    assert torch.equal(pair[1:], sharp_model.generate(prompt[1:], gc, generator=[torch.Generator().manual_seed(4)]))


def test_default_eos_stops_rows_and_falls_back_to_the_text_config():
    model = sharp(seed=3, eos_boost=1.5)
    prompt = tokens((3, 5), 41)
    gc = config(max_new_tokens=24, max_denoising_steps=5, entropy_bound=2.0, confidence_threshold=0.9)
    assert model.text_config.eos_token_id == 1 and model.text_config.pad_token_id == 0
    torch.manual_seed(0)
    out = model.generate(prompt, gc, return_dict=True)  # no EOS in the generation config: the text config's
    seq = out.sequences[:, 5:]
    is_eos = seq == 1
    assert is_eos.any()
    for row, forwards in zip(range(3), out.num_forwards.tolist()):
        if is_eos[row].any():
            first = int(is_eos[row].int().argmax())
            assert (seq[row, first + 1:] == 0).all()  # pad after EOS
            assert forwards <= 5 * (first // 8 + 1)  # no decoder pass after the canvas holding EOS
            assert out.tokens_per_forward[row] == pytest.approx((first + 1) / forwards)
    reference, parity = both(model, prompt, gc, 0)  # parity: EOS only from the generation config, as the reference
    assert torch.equal(parity.sequences, reference.sequences) and parity.sequences.shape[1] == 5 + 24


def test_generation_config_checks(model):
    prompt = tokens((1, 4), 0)
    bad = config()
    bad.confidence_threshold = 0.0  # the reference's validate() raises AttributeError for this (D1)
    with pytest.raises(ValueError, match="confidence_threshold"):
        model.generate(prompt, bad)
    bad = config()
    bad.stability_threshold = -1
    with pytest.raises(ValueError, match="stability_threshold"):
        model.generate(prompt, bad)
    bad = config()
    bad.t_max = bad.t_min
    with pytest.raises(ValueError, match="t_max"):
        model.generate(prompt, bad, parity=True)
    model.generate(prompt, bad)  # a constant temperature is fine outside parity mode
    with pytest.raises(ValueError, match="policy, parity"):
        model.generate(prompt, config(), policy=EntropyBound(0.1), parity=True)
    with pytest.raises(ValueError, match="generator"):
        model.generate(prompt, config(), generator=[torch.Generator()], parity=True)
    with pytest.raises(TypeError, match="prompt_ids: expected integer token ids"):
        model.generate(prompt.float(), config())
    with pytest.raises(ValueError, match="attention_mask"):
        model.generate(prompt, config(), attention_mask=torch.tensor([[1, 0, 1, 1]]))
    # defaults: the model's generation_config, then the reference's (256 new tokens, 48 steps)
    out = model.generate(prompt, GenerationConfig(max_new_tokens=5, max_denoising_steps=2),
                         policy=EntropyBound(float("inf"), confidence_threshold=None), return_dict=True)
    assert out.sequences.shape == (1, 9) and out.num_forwards.tolist() == [4]


def test_generate_called_as_transformers_calls_it(model):
    """transformers' call (issue 44): ``generate(input_ids=..., attention_mask=..., max_new_tokens=...)`` with the
    config's fields as keywords over ``generation_config``, ``return_dict_in_generate=True`` for the record; what it
    cannot honour is refused."""
    prompt = tokens((2, 5), 3)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left padding
    base = config(max_new_tokens=8, max_denoising_steps=2)

    def gens():
        return [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)]

    by_config = model.generate(prompt, base, attention_mask=mask, generator=gens())
    by_keywords = model.generate(input_ids=prompt, attention_mask=mask, generation_config=config(max_new_tokens=3),
                                 max_new_tokens=8, max_denoising_steps=2, generator=gens())
    assert torch.equal(by_keywords, by_config)
    record = model.generate(input_ids=prompt, attention_mask=mask, generation_config=base, generator=gens(),
                            return_dict_in_generate=True)
    assert torch.equal(record.sequences, by_config)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['temperature'\]"):
        model.generate(input_ids=prompt, generation_config=base, temperature=0.5)
    with pytest.raises(ValueError, match="output_scores: not recorded"):
        model.generate(input_ids=prompt, generation_config=base, return_dict_in_generate=True, output_scores=True)
    with pytest.raises(TypeError, match="prompt_ids: give the prompt once"):
        model.generate(prompt, base, input_ids=prompt)


# -- fine-tuning through diffusion_loss ----------------------------------------------------------------------------


def test_diffusion_loss_with_prompt_mask_through_conditioned_on(model):
    """uf.diffusion_loss(model.conditioned_on(x0, prompt_mask=pm), x0, kernel, prompt_mask=pm) is the wrapper's own
    fused loss on the same x_t (0 on the prompt and on padding), and its gradients reach the weights."""
    x0 = tokens((2, 15), 30)
    prompt = torch.arange(15)[None, :] < torch.tensor([[5], [9]])
    mask = torch.ones(2, 15, dtype=torch.bool)
    mask[1, -2:] = False  # right padding
    t = torch.tensor([0.3, 0.8])
    scorer = model.conditioned_on(x0, prompt_mask=prompt, attention_mask=mask)
    out = uf.diffusion_loss(scorer, x0, model.kernel, prompt_mask=prompt, attention_mask=mask, t=t,
                            generator=torch.Generator().manual_seed(0))
    assert (out.loss[prompt] == 0).all() and (out.loss[~mask] == 0).all() and out.num_tokens == 10 + 4
    fused = model(out.x_t, t, prompt_mask=prompt, attention_mask=mask, x0=x0, kernel=model.kernel)
    torch.testing.assert_close(out.loss, fused, rtol=1e-5, atol=1e-5)
    out.loss.sum().backward()
    assert model.lm_head_weight.grad is not None and torch.isfinite(model.lm_head_weight.grad).all()
    model.zero_grad(set_to_none=True)
    sc = model.conditioned_on(x0, prompt_mask=prompt, attention_mask=mask, self_conditioning_prob=1.0,
                              generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert not torch.equal(sc(out.x_t, t), scorer(out.x_t, t))  # the second pass sees the first's logits
