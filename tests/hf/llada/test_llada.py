"""LLaDA as a unifusion model kind, against LLaDA's own code (dllm's modeling_llada.py, ML-GSAI/LLaDA generate.py)
run unmodified outside the repository on a tiny random checkpoint (fixtures/README.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import unifusion as uf
from unifusion.hf import LLaDALM, wrap_diffusion_lm
from unifusion.hf.llada.generation import llada_generate
from unifusion.samplers.policies import ConfidenceThreshold, LLaDAOrder, LowConfidence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _native_checks as checks  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MASK = 90


@pytest.fixture(scope="module")
def model() -> LLaDALM:
    return uf.load_diffusion_lm(FIXTURES / "checkpoint")


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return checks.reference(FIXTURES)


def test_loads_as_llada_with_the_configs_mask_token(model):
    assert type(model) is LLaDALM and model.mask_token_id == MASK and model.num_states == 96
    assert model.kernel.mask_id == MASK and model.block_size is None and not model.shifted
    assert model.config.eos_token_id == 88 and model.config.pad_token_id == 89


def test_logits_equal_their_modeling_code_on_a_padded_batch(model, ref):
    with torch.no_grad():
        logits = model(ref["input_ids"], attention_mask=ref["attention_mask"])
        plain = model(ref["input_ids"][:1])
    # every position, padded ones included (LLaDA masks padded keys only, as this kind does)
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=checks.RECORDED_ATOL)
    torch.testing.assert_close(plain, ref["logits_unpadded_row0"], rtol=0, atol=checks.RECORDED_ATOL)


RUNS = json.loads((FIXTURES / "generate_runs.json").read_text())


@pytest.mark.parametrize("run", ["semi_ar", "one_block"])
def test_greedy_generate_equals_their_generate_py_token_for_token(model, ref, run):
    gen, block, steps = RUNS[run]["gen_length"], RUNS[run]["block_length"], RUNS[run]["steps"]
    out = model.generate(ref["prompt_ids"], attention_mask=ref["prompt_attention_mask"], max_new_tokens=gen,
                         policy=LowConfidence(), block_size=block, num_steps=steps // (gen // block),
                         do_sample=False, eos_token_id=None)
    assert torch.equal(out, ref[f"generate_{run}"])


@pytest.mark.parametrize("run", sorted(RUNS))
def test_generate_reference_equals_their_generate_py_token_for_token(model, ref, run):
    """Greedy, Gumbel-max sampled (their global seed = our generator's seed), guided, random remasking."""
    kwargs = dict(RUNS[run])
    generator = torch.Generator().manual_seed(kwargs.pop("seed", 0))
    out = model.generate_reference(ref["prompt_ids"], attention_mask=ref["prompt_attention_mask"],
                                   generator=generator, **kwargs)
    assert torch.equal(out, ref[f"generate_{run}"])


def llada_order_generate(model, ref, run: dict, **extra):
    """``generate(policy=LLaDAOrder(...))`` with the arguments that reproduce their ``generate(**run)``."""
    kwargs = dict(run)
    gen, block, steps = kwargs["gen_length"], kwargs["block_length"], kwargs["steps"]
    temperature = kwargs.get("temperature", 0.0)
    sampling = {"do_sample": False} if temperature == 0 else {"temperature": temperature}
    return model.generate(ref["prompt_ids"], attention_mask=ref["prompt_attention_mask"], max_new_tokens=gen,
                          policy=LLaDAOrder(kwargs.get("remasking", "low_confidence")), block_size=block,
                          num_steps=steps // (gen // block), cfg_scale=kwargs.get("cfg_scale", 0.0),
                          eos_token_id=None, generator=torch.Generator().manual_seed(kwargs.get("seed", 0)),
                          **sampling, **extra)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_llada_order_equals_their_generate_py_token_for_token(model, ref, run):
    """``generate(policy=LLaDAOrder(remasking), cfg_scale=w)``: greedy, Gumbel-max sampled (their global seed = our
    generator's seed), guided, random remasking — their tokens, through the generic decoding path."""
    assert torch.equal(llada_order_generate(model, ref, RUNS[run]), ref[f"generate_{run}"])


def test_llada_order_records_a_trace_the_replay_reproduces(model, ref):
    checks.check_trace_replay(model, ref, LLaDAOrder())


def test_llada_order_with_guidance_and_the_prefix_cache_and_per_row_generators(model, ref):
    """Sampled, guided and random-remasked runs beyond the fixtures equal ``llada_generate`` (their sampler, proven
    above); with per-row generators a row draws as the batch of that row alone (LLaDA's draws span the whole
    sequence, so its padding counts); the prefix cache at refresh 1 keeps their greedy tokens."""
    prompt, attn = ref["prompt_ids"], ref["prompt_attention_mask"]
    for run in ({"gen_length": 8, "block_length": 4, "steps": 8, "temperature": 0.7, "cfg_scale": 0.5, "seed": 3},
                {"gen_length": 8, "block_length": 8, "steps": 4, "temperature": 1.3, "remasking": "random",
                 "seed": 4}):
        named = {k: v for k, v in run.items() if k != "seed"}
        theirs = llada_generate(model, prompt, attention_mask=attn, generator=torch.Generator().manual_seed(
            run["seed"]), **named)
        assert torch.equal(llada_order_generate(model, ref, run), theirs)
    rows = [torch.Generator().manual_seed(s) for s in (5, 6)]
    both = model.generate(prompt, attention_mask=attn, max_new_tokens=8, policy=LLaDAOrder(), block_size=4,
                          num_steps=2, eos_token_id=None, generator=rows)
    alone = model.generate(prompt[1:], attention_mask=attn[1:], max_new_tokens=8, policy=LLaDAOrder(),
                           block_size=4, num_steps=2, eos_token_id=None, generator=torch.Generator().manual_seed(6))
    assert torch.equal(both[1], alone[0])
    assert RUNS["semi_ar"] == {"gen_length": 8, "block_length": 4, "steps": 4}
    cached = model.generate(prompt, attention_mask=attn, max_new_tokens=8, policy=LLaDAOrder(), block_size=4,
                            num_steps=2, do_sample=False, eos_token_id=None, cache_refresh=1)
    assert torch.equal(cached, ref["generate_semi_ar"])  # the prefix cache at refresh 1 is exact


def test_cfg_scale_is_refused_where_it_does_not_apply(model, ref):
    prompt = ref["prompt_ids"]
    with pytest.raises(ValueError, match="cfg_scale: classifier-free guidance runs with a decoding policy"):
        model.generate(prompt, attention_mask=ref["prompt_attention_mask"], max_new_tokens=4, cfg_scale=1.0)
    with pytest.raises(ValueError, match="cfg_scale: the prefix cache"):
        model.generate(prompt[:1], max_new_tokens=4, policy=LLaDAOrder(), cfg_scale=1.0, cache_refresh=1)
    with pytest.raises(ValueError, match="cfg_scale: expected a finite float >= 0, got -1"):
        model.generate(prompt[:1], max_new_tokens=4, policy=LLaDAOrder(), cfg_scale=-1.0)
    with pytest.raises(TypeError, match="cfg_scale: expected a float"):
        model.generate(prompt[:1], max_new_tokens=4, policy=LLaDAOrder(), cfg_scale="1")
    with pytest.raises(ValueError, match="top_k, top_p: LLaDA's sampler truncates nothing"):
        model.generate(prompt[:1], max_new_tokens=4, policy=LLaDAOrder(), top_k=5)


def test_other_policies_generate_and_keep_the_prompt(model, ref):
    prompt, attn = ref["prompt_ids"], ref["prompt_attention_mask"]
    g = torch.Generator().manual_seed(0)
    for kwargs in ({"policy": ConfidenceThreshold(0.9), "block_size": 4}, {"num_steps": 4}):
        out = model.generate(prompt, attention_mask=attn, max_new_tokens=8, generator=g, **kwargs)
        assert out.shape == (2, 13) and torch.equal(out[:, :5], prompt) and not bool((out[:, 5:] == MASK).any())


def test_prefix_cache_is_exact_at_refresh_1_and_its_cached_step_equals_the_forward(model, ref):
    checks.check_prefix_cache(model, ref)


def test_trace_replay_equals_the_log_probs_generate_committed_with(model, ref):
    checks.check_trace_replay(model, ref)


def test_fused_loss_is_their_mdlm_objective_on_their_logits(model, ref):
    checks.check_fused_loss_is_mdlm_on_their_logits(model, ref, ref["logits"],
                                                    torch.ones_like(ref["input_ids"], dtype=torch.bool))


def test_loss_bound_and_sequence_logprob_are_unbiased_for_the_enumerated_elbo(model):
    checks.check_estimators_match_the_enumerated_elbo(model)


def test_saved_folder_is_their_layout_and_loads_back(tmp_path):
    checks.check_saved_folder_is_their_layout(LLaDALM, FIXTURES, tmp_path)


def test_sharded_checkpoint_loads_lazily_in_the_dtype_asked(tmp_path):
    checks.check_sharded_lazy_load_in_the_dtype_asked(LLaDALM, FIXTURES, tmp_path)


def test_bad_checkpoints_are_value_errors_naming_the_problem(tmp_path):
    checks.check_bad_checkpoints(LLaDALM, FIXTURES, tmp_path, MASK)
    config = json.loads((FIXTURES / "checkpoint" / "config.json").read_text())
    with pytest.raises(ValueError, match="include_bias"):
        LLaDALM.backbone_config({**config, "include_bias": True})


def test_wrap_diffusion_lm_moves_their_models_tensors_onto_llama(ref):
    class Theirs(torch.nn.Module):  # stands in for their LLaDAModelLM: its config and its state dict's names
        def __init__(self, tied: bool = False) -> None:
            super().__init__()
            from transformers import PretrainedConfig

            config = json.loads((FIXTURES / "checkpoint" / "config.json").read_text())
            self.config = PretrainedConfig(**{**config, "weight_tying": tied, "model_type": None})
            self.config.model_type = "llada"
            self.weights = load_file(str(FIXTURES / "checkpoint" / "model.safetensors"))
            if tied:  # their tie_weights makes ff_out the embedding: one tensor under two names
                self.weights["model.transformer.ff_out.weight"] = self.weights["model.transformer.wte.weight"]

        def state_dict(self, *args, **kwargs):  # type: ignore[override]
            return self.weights

    theirs = Theirs()
    wrapped = wrap_diffusion_lm(theirs)
    assert type(wrapped) is LLaDALM
    embed = theirs.weights["model.transformer.wte.weight"]
    assert wrapped.hf_model.model.embed_tokens.weight.data_ptr() == embed.data_ptr()  # moved, not copied
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ref["input_ids"], attention_mask=ref["attention_mask"]), ref["logits"],
                                   rtol=0, atol=checks.RECORDED_ATOL)
    tied = wrap_diffusion_lm(Theirs(tied=True))
    assert tied.hf_model.lm_head.weight is tied.hf_model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="unexpected weights \\['extra'\\]"):
        extra = Theirs()
        extra.weights["extra"] = torch.zeros(1)
        wrap_diffusion_lm(extra)
