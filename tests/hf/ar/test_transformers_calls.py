"""DiffusionLM.generate called as a transformers user calls generate (issue 44): the tokenizer's output unpacked into
it (left or right padding), transformers' option precedence and "off" values, ``return_dict_in_generate`` with
``scores`` / ``logits``, and the options that do not apply refused — on a tiny random block model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _hf_tiny import tiny_model

import unifusion as uf
from unifusion.hf import adapt_ar_model

TEXTS = ["the cat sat on the mat", "a dog", "she was in the garden with her"]


@pytest.fixture(scope="module")
def tok():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(Path(__file__).parents[2] / "data" / "tiny_tokenizer")


@pytest.fixture(scope="module")
def model(tok):
    return adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=4, tokenizer=tok).eval()


@pytest.mark.parametrize("side", ["left", "right"])
def test_generate_takes_the_tokenizer_output_padded_on_either_side(model, tok, side) -> None:
    """``model.generate(**tok(texts, return_tensors="pt", padding=True))``: each row continues its own text exactly
    as it does alone; the prompt columns come back as given and ``out[:, P:]`` are the new tokens."""
    tok.padding_side = side
    try:
        inputs = tok(TEXTS, return_tensors="pt", padding=True)
    finally:
        tok.padding_side = "right"
    assert not bool(inputs["attention_mask"].all())  # the batch is padded
    P = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert out.shape == (3, P + 8)
    assert torch.equal(out[:, :P], inputs["input_ids"])
    for b, text in enumerate(TEXTS):
        alone = model.generate(**tok([text], return_tensors="pt"), max_new_tokens=8, do_sample=False,
                               eos_token_id=None)
        assert out[b, P:].tolist() == alone[0, -8:].tolist(), (side, b)
    # input_ids= alone (no mask, nothing padded) is the same call as the positional prompt
    ids = tok(TEXTS[:1], return_tensors="pt")["input_ids"]
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=4, do_sample=False),
                       model.generate(ids, max_new_tokens=4, do_sample=False))


def test_the_prompt_is_given_once_and_masks_with_holes_are_refused(model, tok) -> None:
    inputs = tok(TEXTS[:2], return_tensors="pt", padding=True)
    with pytest.raises(TypeError, match="prompt_ids: give the prompt once"):
        model.generate(inputs["input_ids"], input_ids=inputs["input_ids"], max_new_tokens=4)
    with pytest.raises(TypeError, match="prompt_ids: give the prompt once"):
        model.generate(max_new_tokens=4)
    holes = torch.ones_like(inputs["input_ids"])
    holes[0, 2] = 0
    with pytest.raises(ValueError, match="attention_mask: expected each row's real tokens in one run"):
        model.generate(inputs["input_ids"], attention_mask=holes, max_new_tokens=4)


def test_return_dict_in_generate_gives_the_committing_distributions(model, tok) -> None:
    """``return_dict_in_generate=True, output_scores=True, output_logits=True``: an output record whose ``scores``
    are one ``(B, S)`` log-distribution per generated column, that of the call which committed its token (the drawn
    token lies in its top-k support and its score is the trace's commit log-probability), and whose ``logits`` are
    that call's raw logits."""
    inputs = tok(TEXTS[:2], return_tensors="pt", padding=True)
    P = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=8, temperature=0.7, top_k=5, eos_token_id=None,
                         return_dict_in_generate=True, output_scores=True, output_logits=True,
                         generator=torch.Generator().manual_seed(0))
    plain = model.generate(**inputs, max_new_tokens=8, temperature=0.7, top_k=5, eos_token_id=None,
                           generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.sequences, plain)  # asking for the scores changes no token
    S = model.num_states
    assert len(out.scores) == len(out.logits) == 8
    assert all(s.shape == (2, S) and s.dtype == torch.float32 for s in out.scores + out.logits)
    scores, logits = torch.stack(out.scores, 1), torch.stack(out.logits, 1)  # (B, 8, S)
    new = out.sequences[:, P:]
    torch.testing.assert_close(scores.exp().sum(-1), torch.ones(2, 8))
    assert bool((torch.isfinite(scores).sum(-1) <= 5).all())  # top-k cut the rest to -inf
    drawn = scores.gather(-1, new[..., None])[..., 0]
    assert bool(torch.isfinite(drawn).all())
    torch.testing.assert_close(drawn, out.commit_logprob[:, P:])  # the trace's log-probability of the same draw
    assert bool((scores[..., model.mask_token_id] == float("-inf")).all())
    # the scores are the logits' distribution at T = 0.7 within the top-k support
    kept = torch.isfinite(scores)
    masked = (logits / 0.7).masked_fill(~kept, float("-inf"))
    torch.testing.assert_close(scores[kept], masked.log_softmax(-1)[kept])


def test_scores_are_zero_after_eos_and_greedy_tokens_are_their_argmax(model, tok) -> None:
    inputs = tok(TEXTS[:1], return_tensors="pt")
    P = inputs["input_ids"].shape[1]
    free = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, P:]
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=int(free[2]), pad_token_id=0,
                         return_dict_in_generate=True, output_scores=True)
    scores = torch.stack(out.scores, 1)[0]
    new = out.sequences[0, P:]
    assert torch.equal(scores[:3].argmax(-1), new[:3])
    assert bool((scores[3:] == 0).all()) and bool((new[3:] == 0).all())
    assert out.logits is None  # only what was asked


def test_an_explicit_keyword_wins_over_the_generation_config(model, tok) -> None:
    """transformers' precedence: generation_config temperature 0.3 with ``temperature=1.0`` samples at 1.0; the
    config alone samples at 0.3."""
    from transformers import GenerationConfig

    inputs = tok(TEXTS[:2], return_tensors="pt", padding=True)
    config = GenerationConfig(temperature=0.3, top_k=3, do_sample=True)

    def run(**kwargs):
        return model.generate(**inputs, max_new_tokens=12, eos_token_id=None,
                              generator=torch.Generator().manual_seed(1), **kwargs)

    assert torch.equal(run(generation_config=config, temperature=1.0, top_k=0), run(temperature=1.0))
    assert torch.equal(run(generation_config=config), run(temperature=0.3, top_k=3))
    assert not torch.equal(run(generation_config=config), run(generation_config=config, temperature=1.0))


def test_transformers_off_values_mean_off(model, tok) -> None:
    inputs = tok(TEXTS[:2], return_tensors="pt", padding=True)

    def run(**kwargs):
        return model.generate(**inputs, max_new_tokens=8, eos_token_id=None,
                              generator=torch.Generator().manual_seed(2), **kwargs)

    reference = run()
    for off in ({"top_k": 0}, {"top_p": 1.0}, {"repetition_penalty": 1.0, "num_beams": 1, "typical_p": 1.0},
                {"logits_processor": [], "stopping_criteria": [], "output_attentions": False}):
        assert torch.equal(run(**off), reference), off
    # greedy decoding ignores the temperature, as transformers does (temperature=0 included)
    assert torch.equal(run(do_sample=False, temperature=0.0), run(do_sample=False))


def test_generation_options_that_would_be_ignored_are_refused(tok) -> None:
    from transformers import GenerationConfig

    plain = adapt_ar_model(tiny_model("llama"), add_mask_token=True, tokenizer=tok).eval()  # the BayesianSampler
    inputs = tok(TEXTS[:1], return_tensors="pt")
    with pytest.raises(ValueError, match="output_scores: the scores come back in the output record"):
        plain.generate(**inputs, max_new_tokens=4, output_scores=True)
    with pytest.raises(ValueError, match="output_logits: records the distribution .* BayesianSampler"):
        plain.generate(**inputs, max_new_tokens=4, return_dict_in_generate=True, output_logits=True)
    with pytest.raises(ValueError, match="output_attentions: does not apply to diffusion decoding"):
        plain.generate(**inputs, max_new_tokens=4, output_attentions=True)
    with pytest.raises(ValueError, match="generation_config.output_hidden_states: does not apply"):
        plain.generate(**inputs, generation_config=GenerationConfig(max_new_tokens=4, output_hidden_states=True))
    with pytest.raises(ValueError, match="logits_processor: does not apply"):
        plain.generate(**inputs, max_new_tokens=4, logits_processor=[lambda ids, scores: scores])
    with pytest.raises(ValueError, match="token_type_ids: the model reads one segment"):
        plain.generate(**inputs, token_type_ids=torch.ones_like(inputs["input_ids"]), max_new_tokens=4)
    # the record without scores works on the full-sequence sampler too
    out = plain.generate(**inputs, max_new_tokens=4, num_steps=2, return_dict_in_generate=True)
    assert isinstance(out, uf.samplers.PolicyOutput) and out.sequences.shape[1] == inputs["input_ids"].shape[1] + 4


def test_the_text_generation_pipeline_runs_generate(model, tok) -> None:
    """``transformers.pipeline("text-generation", model=diffusion_lm, tokenizer=tok)``: one text or a padded batch,
    the tokens those of ``model.generate`` on the same call."""
    from transformers import pipeline

    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    for batch_size in (1, 2):
        got = pipe(TEXTS[:2], max_new_tokens=6, do_sample=False, return_tensors=True, batch_size=batch_size)
        for text, (row,) in zip(TEXTS[:2], got, strict=True):
            alone = model.generate(**tok([text], return_tensors="pt"), max_new_tokens=6, do_sample=False)
            ids = row["generated_token_ids"]  # batched: the pipeline's own left padding first
            pads = len(ids) - alone.shape[1]
            assert ids[pads:] == alone[0].tolist() and set(ids[:pads]) <= {tok.pad_token_id}, (batch_size, text)
    text = pipe(TEXTS[0], max_new_tokens=4)[0]["generated_text"]  # the pipeline's sampling defaults run too
    assert text.startswith(TEXTS[0]) and len(text) > len(TEXTS[0])


def test_the_diffusion_gemma_pipeline_is_refused_at_construction() -> None:
    from _hf_tiny import tiny_diffusion_gemma
    from transformers import pipeline

    from unifusion.hf import wrap_diffusion_lm

    gemma = wrap_diffusion_lm(tiny_diffusion_gemma())
    tokenizer = __import__("transformers").PreTrainedTokenizerFast.from_pretrained(
        Path(__file__).parents[2] / "data" / "tiny_tokenizer")
    with pytest.raises(TypeError, match=r"text-generation pipeline .* call model.generate"):
        pipeline("text-generation", model=gemma, tokenizer=tokenizer)


def test_scores_of_a_uniform_kernel_block_model_are_refused(model, tok) -> None:
    inputs = tok(TEXTS[:1], return_tensors="pt")
    with pytest.raises(ValueError, match="output_scores: records the distribution .* EntropyBound resamples"):
        model.generate(**inputs, max_new_tokens=4, kernel=uf.UniformKernel(model.num_states),
                       return_dict_in_generate=True, output_scores=True)
