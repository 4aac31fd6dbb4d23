"""LLaDA-MoE as a unifusion model kind, against its own code (dllm's modeling_lladamoe.py and MDLMSampler, ML-GSAI
LLaDA generate.py) run unmodified outside the repository on a tiny random checkpoint (fixtures/README.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import unifusion as uf
from unifusion.hf import LLaDAMoELM, wrap_diffusion_lm
from unifusion.hf.llada.generation import llada_generate
from unifusion.samplers.policies import ConfidenceThreshold, LLaDAOrder, LowConfidence, RoundedSplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _native_checks as checks  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MASK, EOS = 90, 88
RUNS = json.loads((FIXTURES / "generate_runs.json").read_text())
CONFIG = json.loads((FIXTURES / "checkpoint" / "config.json").read_text())


@pytest.fixture(scope="module")
def model() -> LLaDAMoELM:
    return uf.load_diffusion_lm(FIXTURES / "checkpoint")


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return checks.reference(FIXTURES)


def test_loads_on_qwen3_moe_with_the_configs_mask_token_and_their_layers(model):
    from transformers import Qwen3MoeForCausalLM

    assert type(model) is LLaDAMoELM and type(model.hf_model) is Qwen3MoeForCausalLM
    assert model.mask_token_id == MASK and model.num_states == 96 and model.kernel.mask_id == MASK
    assert model.block_size is None and not model.shifted
    layers = model.hf_model.model.layers
    assert type(layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock" and type(layers[1].mlp).__name__ == "Qwen3MoeMLP"
    assert not model.hf_model.config.norm_topk_prob and model.hf_model.config.num_experts_per_tok == 2


def test_logits_equal_their_modeling_code_on_a_padded_batch(model, ref):
    with torch.no_grad():
        logits = model(ref["input_ids"], attention_mask=ref["attention_mask"])
        plain = model(ref["input_ids"][:1])
    # every position, padded ones included (their code masks padded keys only, as this kind does)
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=checks.RECORDED_ATOL)
    torch.testing.assert_close(plain, ref["logits_unpadded_row0"], rtol=0, atol=checks.RECORDED_ATOL)


def test_bf16_logits_equal_their_bf16_logits(ref):
    """Loaded with dtype=bfloat16, the logits are their model's loaded in bf16 (both RoPE in the weights' dtype,
    RMSNorm and softmaxes in float32). On a CPU without native bf16, as the one they were recorded on, to within one
    bf16 step at the logits' scale (|z| < 32: 1/8; measured difference 0). A CPU with native bf16 (AVX512-BF16) rounds
    its bf16 matmuls otherwise, so on every CPU: their bf16 logits are much closer to ours than to their own float32
    ones (mean difference, an AVX512-BF16 CPU on 2026-11-30: 0.030 against 0.092)."""
    bf16 = uf.load_diffusion_lm(FIXTURES / "checkpoint", dtype="bfloat16")
    with torch.no_grad():
        logits = bf16(ref["input_ids"], attention_mask=ref["attention_mask"]).float()
    assert float(ref["logits"].abs().max()) < 32
    assert float((ref["logits_bf16"] - ref["logits"]).abs().max()) > 0.25
    ours_to_theirs = float((logits - ref["logits_bf16"]).abs().mean())
    their_bf16_to_float32 = float((ref["logits_bf16"] - ref["logits"]).abs().mean())
    assert ours_to_theirs < 0.5 * their_bf16_to_float32, (ours_to_theirs, their_bf16_to_float32)
    if not uf.precision.native_bf16("cpu"):
        torch.testing.assert_close(logits, ref["logits_bf16"], rtol=0, atol=0.125)


@pytest.mark.parametrize("policy", [LowConfidence(), LLaDAOrder()], ids=repr)
@pytest.mark.parametrize("run", ["semi_ar", "one_block"])
def test_greedy_generate_equals_their_generate_py_token_for_token(model, ref, run, policy):
    gen, block, steps = RUNS[run]["gen_length"], RUNS[run]["block_length"], RUNS[run]["steps"]
    out = model.generate(ref["prompt_ids"], attention_mask=ref["prompt_attention_mask"], max_new_tokens=gen,
                         policy=policy, block_size=block, num_steps=steps // (gen // block),
                         do_sample=False, eos_token_id=None)
    assert torch.equal(out, ref[f"generate_{run}"])


@pytest.mark.parametrize("policy", [LowConfidence(), LLaDAOrder()], ids=repr)
@pytest.mark.parametrize("run", ["mdlm_semi_ar", "mdlm_one_block"])
def test_greedy_generate_equals_dllms_mdlm_sampler_token_for_token(model, ref, run, policy):
    """dllm's MDLMSampler takes the prompts unpadded and right-pads with EOS; unifusion's generate left-pads them
    (RoPE is relative, padded keys are masked): the same tokens after each prompt, committed at the same steps."""
    gen, block, steps = RUNS[run]["max_new_tokens"], RUNS[run]["block_size"], RUNS[run]["steps"]
    attn = ref["prompt_attention_mask"]
    out = model.generate(ref["prompt_ids"], attention_mask=attn, max_new_tokens=gen, policy=policy,
                         block_size=block, num_steps=steps // (gen // block), do_sample=False, eos_token_id=None,
                         return_trace=True)
    theirs, their_steps = ref[f"generate_{run}"], ref[f"commit_step_{run}"]
    for j, n in enumerate(attn.sum(-1).tolist()):
        pad = attn.shape[1] - n
        assert torch.equal(out.sequences[j, pad:], theirs[j, :n + gen])
        assert torch.equal(out.commit_step[j, pad:], their_steps[j, :n + gen])
        assert bool((theirs[j, n + gen:] == EOS).all())


def test_llada_order_sampled_guided_and_random_equal_their_sampler_on_lladamoe(model, ref):
    """Their sampler's sampled, guided and random-remasked runs on this kind (``llada_generate``, their
    ``generate.py`` on any unshifted mask denoiser; proven on LLaDA's fixtures) are ``generate(policy=LLaDAOrder)``."""
    prompt, attn = ref["prompt_ids"], ref["prompt_attention_mask"]
    for seed, run in enumerate([{"temperature": 1.0}, {"cfg_scale": 1.5}, {"remasking": "random", "temperature": 0.5}]):
        theirs = llada_generate(model, prompt, attention_mask=attn, steps=4, gen_length=8, block_length=4,
                                generator=torch.Generator().manual_seed(seed), **run)
        sampling = {"temperature": run["temperature"]} if "temperature" in run else {"do_sample": False}
        ours = model.generate(prompt, attention_mask=attn, max_new_tokens=8, block_size=4, num_steps=2,
                              policy=LLaDAOrder(run.get("remasking", "low_confidence")),
                              cfg_scale=run.get("cfg_scale", 0.0), eos_token_id=None,
                              generator=torch.Generator().manual_seed(seed), **sampling)
        assert torch.equal(ours, theirs), run


MDLM_EXTRA = json.loads((FIXTURES / "mdlm_extra_runs.json").read_text())


@pytest.mark.parametrize("run", sorted(MDLM_EXTRA))
def test_llada_order_with_rounded_split_equals_dllms_mdlm_sampler_token_for_token(model, ref, run):
    """dllm's MDLMSampler with its own per-step counts (rounded, half to even: 5 masks over 2 steps commit 2 then 3;
    ``RoundedSplit``), greedy on the left-padded prompts, and sampled, random-remasked and guided (their global seed
    = our generator's seed) on prompts of one length: the same tokens, committed at the same steps."""
    spec = MDLM_EXTRA[run]
    theirs = load_file(str(FIXTURES / "mdlm_extra.safetensors"))
    gen, block, steps = spec["max_new_tokens"], spec["block_size"], spec["steps"]
    prompt, attn = (ref["prompt_ids"], ref["prompt_attention_mask"]) if spec["prompts"] == "padded" else \
        (theirs["equal_prompt_ids"], torch.ones_like(theirs["equal_prompt_ids"]))
    sampling = {"do_sample": False} if spec["temperature"] == 0 else {"temperature": spec["temperature"]}
    out = model.generate(prompt, attention_mask=attn, max_new_tokens=gen, block_size=block,
                         num_steps=-(-steps // (gen // block)), eos_token_id=None, return_trace=True,
                         policy=LLaDAOrder(spec["remasking"], schedule=RoundedSplit()),
                         cfg_scale=spec.get("cfg_scale", 0.0), generator=torch.Generator().manual_seed(spec["seed"]),
                         **sampling)
    tokens, their_steps = theirs[f"generate_{run}"], theirs[f"commit_step_{run}"]
    for j, n in enumerate(attn.sum(-1).tolist()):
        pad = attn.shape[1] - n
        assert torch.equal(out.sequences[j, pad:], tokens[j, :n + gen])
        assert torch.equal(out.commit_step[j, pad:], their_steps[j, :n + gen])


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
    checks.check_saved_folder_is_their_layout(LLaDAMoELM, FIXTURES, tmp_path)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="the process's mappings are read from Linux's /proc")
def test_every_weight_is_read_from_the_file_bit_for_bit_and_none_stays_mapped(tmp_path):
    """The experts, read from the file into transformers' fused (E, 2I, d) / (E, d, I) parameters, and every other
    weight equal safetensors' own reading of the file, in the saved float32 and cast to bf16 as they are read; a
    shard holding expert parts is read with file reads, so the loaded models map none of it."""
    folder = checks.copy_checkpoint(FIXTURES, tmp_path)
    f32 = uf.load_diffusion_lm(folder)
    bf16 = uf.load_diffusion_lm(folder, dtype=torch.bfloat16)
    assert str(folder / "model.safetensors") not in Path("/proc/self/maps").read_text()
    theirs = load_file(str(folder / "model.safetensors"))
    names = LLaDAMoELM.weight_names(CONFIG)
    I, E = CONFIG["expert_intermediate_size"], CONFIG["num_experts"]
    for loaded, dtype in ((f32, torch.float32), (bf16, torch.bfloat16)):
        params = dict(loaded.hf_model.named_parameters())
        assert all(p.dtype == dtype for p in params.values())
        experts = loaded.hf_model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape == (E, 2 * I, CONFIG["hidden_size"])
        for e in range(E):
            layer = f"model.layers.0.mlp.experts.{e}."
            assert torch.equal(experts.gate_up_proj[e, :I], theirs[layer + "gate_proj.weight"].to(dtype))
            assert torch.equal(experts.gate_up_proj[e, I:], theirs[layer + "up_proj.weight"].to(dtype))
            assert torch.equal(experts.down_proj[e], theirs[layer + "down_proj.weight"].to(dtype))
        whole = [key for key, target in names.items() if isinstance(target, str)]
        assert len(whole) + 3 * E == len(theirs)
        for key in whole:
            assert torch.equal(params[names[key]], theirs[key].to(dtype)), key


def test_sharded_checkpoint_loads_lazily_in_the_dtype_asked(tmp_path):
    checks.check_sharded_lazy_load_in_the_dtype_asked(LLaDAMoELM, FIXTURES, tmp_path)


def test_bad_checkpoints_are_value_errors_naming_the_problem(tmp_path):
    checks.check_bad_checkpoints(LLaDAMoELM, FIXTURES, tmp_path, MASK)
    for key, value in (("qk_layernorm", False), ("shared_expert_intermediate_size", 16),
                       ("moe_router_enable_expert_bias", True), ("clip_qkv", 8.0), ("partial_rotary_factor", 0.5)):
        with pytest.raises(ValueError, match=key):
            LLaDAMoELM.backbone_config({**CONFIG, key: value})
    with pytest.raises(ValueError, match="moe_layer_freq"):
        LLaDAMoELM.backbone_config({**CONFIG, "moe_layer_freq": [1]})


def test_a_released_folder_still_saying_llada_is_told_to_say_lladamoe(tmp_path):
    folder = checks.copy_checkpoint(FIXTURES, tmp_path)
    (folder / "config.json").write_text(json.dumps({**CONFIG, "model_type": "llada"}))
    with pytest.raises(ValueError, match="set its model_type to 'lladamoe'"):
        uf.load_diffusion_lm(folder)


def test_an_experts_tensor_of_the_wrong_shape_names_it(tmp_path):
    from safetensors.torch import save_file

    folder = checks.copy_checkpoint(FIXTURES, tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    weights[name] = weights[name][:-1]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{name}.*shape \\(15, 32\\).*\\(16, 32\\)"):
        LLaDAMoELM.from_pretrained(folder)


def test_wrap_diffusion_lm_puts_their_models_tensors_on_qwen3_moe(ref):
    class Theirs(torch.nn.Module):  # stands in for their LLaDAMoEModelLM: its config and its state dict's names
        def __init__(self) -> None:
            super().__init__()
            from transformers import PretrainedConfig

            config = {k: v for k, v in CONFIG.items() if k != "rope_scaling"}  # null; transformers 5 warns on the key
            self.config = PretrainedConfig(**{**config, "model_type": None})
            self.config.model_type = "lladamoe"
            self.weights = load_file(str(FIXTURES / "checkpoint" / "model.safetensors"))

        def state_dict(self, *args, **kwargs):  # type: ignore[override]
            return self.weights

    theirs = Theirs()
    wrapped = wrap_diffusion_lm(theirs)
    assert type(wrapped) is LLaDAMoELM
    embed = theirs.weights["model.embed_tokens.weight"]
    assert wrapped.hf_model.model.embed_tokens.weight.data_ptr() == embed.data_ptr()  # moved, not copied
    experts = wrapped.hf_model.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj[2, 16:], theirs.weights["model.layers.0.mlp.experts.2.up_proj.weight"])
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ref["input_ids"], attention_mask=ref["attention_mask"]), ref["logits"],
                                   rtol=0, atol=checks.RECORDED_ATOL)
    with pytest.raises(ValueError, match="unexpected weights \\['extra'\\]"):
        extra = Theirs()
        extra.weights["extra"] = torch.zeros(1)
        wrap_diffusion_lm(extra)
