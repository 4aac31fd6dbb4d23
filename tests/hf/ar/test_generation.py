"""unifusion.samplers.generation through DiffusionLM.generate — shapes, the prompt prefix, determinism, the default
kernel, equality with the sampler, argument checks — on tiny random models (tests/_hf_tiny.py)."""

from __future__ import annotations

import pytest
import torch
from _hf_tiny import VOCAB, tiny_model

import unifusion as uf
from unifusion.hf import adapt_ar_model

MASK_ID = 3


def _prompt(B: int = 2, P: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, VOCAB, (B, P), generator=torch.Generator().manual_seed(seed))



@pytest.mark.parametrize("recorded", [None, "uniform", "hybrid"])
def test_generate_defaults_to_the_recorded_kernel_else_mask_else_uniform(recorded, monkeypatch) -> None:
    """generate's default kernel: the recorded one; else the mask kernel on the mask token; else uniform (a model
    without a mask token) — the rule of unifusion.hf.default_kernel, which the CLI follows too."""
    from unifusion.samplers import bayesian, generation

    used: list[uf.Kernel] = []

    class Spy(bayesian.BayesianSampler):
        def __init__(self, model, kernel, *args, **kwargs):
            used.append(kernel)
            super().__init__(model, kernel, *args, **kwargs)

    monkeypatch.setattr(generation, "BayesianSampler", Spy)  # the name generate calls
    with_mask = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    S = with_mask.num_states
    kernels = {None: None, "uniform": uf.UniformKernel(S), "hybrid": uf.HybridKernel(S, MASK_ID, 0.3)}
    with_mask.kernel = kernels[recorded]
    with_mask.generate(_prompt(1, 2), max_new_tokens=2, num_steps=2)
    without_mask = adapt_ar_model(tiny_model("llama"), add_mask_token=False)
    without_mask.generate(_prompt(1, 2), max_new_tokens=2, num_steps=2)
    if recorded is None:
        assert type(used[0]) is uf.MaskKernel and used[0].mask_id == MASK_ID
    else:
        assert used[0] is with_mask.kernel
    assert type(used[1]) is uf.UniformKernel and used[1].num_states == without_mask.num_states

@pytest.mark.parametrize("mask", [True, False])
def test_generate_shapes_prefix_and_determinism(mask: bool) -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID if mask else None, add_mask_token=mask)
    prompt = _prompt(2, 3)
    out = model.generate(prompt, max_new_tokens=5, num_steps=4, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 8) and out.dtype == torch.int64
    assert torch.equal(out[:, :3], prompt)
    assert ((out >= 0) & (out < model.num_states)).all()
    if mask:
        assert not (out == MASK_ID).any()  # the last step lands on clean tokens
    again = model.generate(prompt, seq_len=8, num_steps=4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    other = model.generate(prompt, seq_len=8, num_steps=4, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(out, other)

def test_generate_equals_the_sampler_with_a_prefix_prompt() -> None:
    model = adapt_ar_model(tiny_model("qwen2"), mask_token_id=MASK_ID)
    prompt = _prompt(1, 4)
    out = model.generate(prompt[0], max_new_tokens=4, num_steps=3, temperature=0.8, top_p=0.9,
                         generator=torch.Generator().manual_seed(5))
    fixed = torch.full((1, 8), -1)
    fixed[:, :4] = prompt
    ref = uf.BayesianSampler(model, uf.MaskKernel(model.num_states, mask_id=MASK_ID), 3, temperature=0.8,
                             top_p=0.9).sample(1, 8, prompt=fixed, generator=torch.Generator().manual_seed(5))
    assert torch.equal(out, ref)
    uniform = uf.UniformKernel(model.num_states)
    a = model.generate(prompt, max_new_tokens=4, num_steps=3, kernel=uniform,
                       generator=torch.Generator().manual_seed(2))
    b = uf.BayesianSampler(model, uniform, 3).sample(1, 8, prompt=fixed, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b)

def test_generate_empty_prompt_is_unconditional() -> None:
    model = adapt_ar_model(tiny_model("llama"), add_mask_token=False)
    out = model.generate(torch.zeros(3, 0, dtype=torch.long), max_new_tokens=6, num_steps=2,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (3, 6)

def test_generate_validates_arguments() -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    p = _prompt(2, 3)
    with pytest.raises(TypeError, match="prompt_ids"):
        model.generate([1, 2, 3], max_new_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prompt_ids"):
        model.generate(p.float(), max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_ids"):
        model.generate(p[None], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens, seq_len"):
        model.generate(p)
    with pytest.raises(ValueError, match="max_new_tokens, seq_len"):
        model.generate(p, max_new_tokens=2, seq_len=5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(p, max_new_tokens=0)
    with pytest.raises(ValueError, match="seq_len"):
        model.generate(p, seq_len=3)
    with pytest.raises(TypeError, match="max_new_tokens"):
        model.generate(p, max_new_tokens=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seq_len"):
        model.generate(p, seq_len=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_steps"):
        model.generate(p, max_new_tokens=2, num_steps=0)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(p, max_new_tokens=2, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(p, max_new_tokens=2, top_p=1.5)
    with pytest.raises(ValueError, match="prompt"):
        model.generate(torch.full((1, 2), MASK_ID), max_new_tokens=2)  # a mask token cannot be kept


# ---------------------------------------------------------------------------------------------------------------
# transformers' vocabulary (issue 34): GenerationConfig, max_length, do_sample, EOS lists, stop strings, streamers


@pytest.fixture(scope="module")
def hf_tokenizer():
    from pathlib import Path

    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(Path(__file__).parents[2] / "data" / "tiny_tokenizer")


@pytest.fixture(scope="module")
def block_model(hf_tokenizer):
    return adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=4, tokenizer=hf_tokenizer).eval()


class _Capture:
    """A transformers BaseStreamer that records what generate pushes."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        assert self.ended == 0
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ended += 1


def _greedy(model, prompt, **kwargs):
    return model.generate(prompt, max_length=prompt.shape[1] + 12, do_sample=False, eos_token_id=None, **kwargs)


def test_greedy_is_deterministic_and_the_argmax(block_model) -> None:
    prompt = _prompt(1, 3)
    a = _greedy(block_model, prompt, generator=torch.Generator().manual_seed(0))
    b = _greedy(block_model, prompt, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == (1, 15)
    assert torch.equal(_greedy(block_model, prompt, use_cache=False), a)  # the uncached path decides the same
    # one new token: the argmax of x_θ at that position (mask state excluded)
    one = block_model.generate(prompt, max_new_tokens=1, do_sample=False, eos_token_id=None)
    x_t = torch.cat([prompt, torch.full((1, 1), block_model.mask_token_id)], 1)
    with torch.no_grad():
        logits = block_model(x_t, torch.full((1,), 0.5))[0, -1]
    logits[block_model.mask_token_id] = -float("inf")
    assert one[0, -1].item() == logits.argmax().item()
    sampled = [block_model.generate(prompt, max_new_tokens=12, eos_token_id=None,
                                    generator=torch.Generator().manual_seed(s)) for s in range(3)]
    assert any(not torch.equal(s, a) for s in sampled)


def test_eos_list_stops_at_either_id(block_model) -> None:
    prompt = _prompt(1, 3)
    free = _greedy(block_model, prompt)[0, 3:].tolist()
    a, b = free[5], free[8]  # two generated ids; the run stops at the first occurrence of either
    first = min(free.index(a), free.index(b))
    out = block_model.generate(prompt, max_length=15, do_sample=False, eos_token_id=[b, a], pad_token_id=0)
    expected = free[:first + 1] + [0] * (len(free) - first - 1)
    assert out[0, 3:].tolist() == expected


def test_the_streamer_receives_the_prompt_then_exactly_the_returned_tokens(block_model, hf_tokenizer, capsys
                                                                          ) -> None:
    from transformers import TextStreamer

    prompt = _prompt(1, 3)
    free = _greedy(block_model, prompt)[0, 3:].tolist()
    eos = [free[6], free[9]]
    capture = _Capture()
    out = block_model.generate(prompt, max_length=15, do_sample=False, eos_token_id=eos, streamer=capture)
    assert torch.equal(capture.puts[0], prompt) and capture.ended == 1
    assert len(capture.puts) >= 3  # prompt, then block by block (blocks of 4 after a 3-token prompt)
    assert torch.cat(capture.puts[1:]).tolist() == out[0, 3:].tolist()
    capsys.readouterr()
    out = block_model.generate(prompt, max_length=15, do_sample=False, eos_token_id=eos,
                               streamer=TextStreamer(hf_tokenizer, skip_prompt=True))
    printed = capsys.readouterr().out
    assert printed.rstrip("\n") == hf_tokenizer.decode(out[0, 3:].tolist())
    with pytest.raises(ValueError, match="streamer: streams one sequence.*batch of 2"):
        block_model.generate(_prompt(2, 3), max_new_tokens=4, streamer=_Capture())


def test_the_full_sequence_sampler_streams_once(hf_tokenizer) -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, tokenizer=hf_tokenizer)
    capture = _Capture()
    out = model.generate(_prompt(1, 3), max_new_tokens=5, num_steps=4, streamer=capture,
                         generator=torch.Generator().manual_seed(0))
    assert len(capture.puts) == 2 and torch.cat(capture.puts[1:]).tolist() == out[0, 3:].tolist()


def test_stop_strings_end_the_row_after_the_completing_token(block_model, hf_tokenizer) -> None:
    prompt = _prompt(1, 3)
    free = _greedy(block_model, prompt)[0, 3:].tolist()
    stop = hf_tokenizer.decode([free[6]])
    assert stop.strip(), stop
    text = [hf_tokenizer.decode(free[:n + 1]) for n in range(len(free))]
    end = next(n for n, t in enumerate(text) if stop in t)
    capture = _Capture()
    out = block_model.generate(prompt, max_length=15, do_sample=False, eos_token_id=None, pad_token_id=0,
                               stop_strings=[stop], streamer=capture)
    assert out[0, 3:].tolist() == free[:end + 1] + [0] * (len(free) - end - 1)
    assert torch.cat(capture.puts[1:]).tolist() == out[0, 3:].tolist()
    with pytest.raises(ValueError, match="stop_strings: need a tokenizer"):
        adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, block_size=4).generate(
            prompt, max_new_tokens=4, stop_strings="x")


def test_a_generation_config_speaks_for_the_keywords(block_model) -> None:
    from transformers import GenerationConfig

    prompt = _prompt(1, 3)
    free = _greedy(block_model, prompt)[0, 3:].tolist()
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=[free[7], free[10]], pad_token_id=0)
    by_config = block_model.generate(prompt, generation_config=config)
    by_keywords = block_model.generate(prompt, max_new_tokens=12, do_sample=False,
                                       eos_token_id=[free[7], free[10]], pad_token_id=0)
    assert torch.equal(by_config, by_keywords)
    # a keyword wins over the config; the model's own (saved) config runs as it is
    assert block_model.generate(prompt, generation_config=config, max_new_tokens=4).shape == (1, 7)
    assert block_model.generation_config is not None
    assert block_model.generate(prompt, generation_config=block_model.generation_config, max_new_tokens=4,
                                num_beams=1).shape == (1, 7)


def test_options_that_do_not_apply_are_refused(block_model) -> None:
    from transformers import GenerationConfig

    prompt = _prompt(1, 3)
    with pytest.raises(ValueError, match=r"num_beams: does not apply to diffusion decoding \(only 1 .*got 4"):
        block_model.generate(prompt, max_new_tokens=4, num_beams=4)
    with pytest.raises(ValueError, match=r"generation_config.repetition_penalty: does not apply.*got 1.3"):
        block_model.generate(prompt, generation_config=GenerationConfig(max_new_tokens=4, repetition_penalty=1.3))
    with pytest.raises(ValueError, match=r"min_p: does not apply to diffusion decoding \(only 0.0 .*got 0.1"):
        block_model.generate(prompt, max_new_tokens=4, min_p=0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'beams'"):
        block_model.generate(prompt, max_new_tokens=4, beams=4)
    with pytest.raises(ValueError, match="max_new_tokens, max_length: give one of them"):
        block_model.generate(prompt, max_new_tokens=4, max_length=9)
    with pytest.raises(TypeError, match="generation_config: expected a transformers.GenerationConfig"):
        block_model.generate(prompt, max_new_tokens=4, generation_config={"do_sample": False})
    with pytest.raises(TypeError, match="eos_token_id: expected an int, a non-empty list of ints"):
        block_model.generate(prompt, max_new_tokens=4, eos_token_id=[])
    with pytest.raises(ValueError, match="do_sample: greedy decoding .* mask policies, got EntropyBound"):
        block_model.generate(prompt, max_new_tokens=4, do_sample=False, kernel=uf.UniformKernel(VOCAB + 1),
                             policy=uf.samplers.policies.EntropyBound(1.0))
