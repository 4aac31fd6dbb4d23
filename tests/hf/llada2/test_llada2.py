"""LLaDA 2.x as a unifusion model kind, against LLaDA 2's own code (dllm's modeling_llada2_moe.py, its LLaDA 2.0 and
2.1 samplers) run unmodified outside the repository on a tiny random checkpoint (fixtures/README.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import unifusion as uf
from unifusion.hf import LLaDA2LM, wrap_diffusion_lm
from unifusion.hf.llada2.architecture import LLaDA2MoeRouter
from unifusion.samplers.policies import ConfidenceThreshold, LowConfidence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _native_checks as checks  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MASK = 90
RUNS = json.loads((FIXTURES / "generate_runs.json").read_text())


@pytest.fixture(scope="module")
def model() -> LLaDA2LM:
    return uf.load_diffusion_lm(FIXTURES / "checkpoint")


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return checks.reference(FIXTURES)


def test_loads_as_llada2_block_causal_unshifted_with_the_configs_mask_token(model, ref):
    assert type(model) is LLaDA2LM and model.mask_token_id == MASK and model.num_states == 96
    assert model.kernel.mask_id == MASK and not model.shifted and model.block_size == int(ref["block_size"]) == 4
    assert model.config.eos_token_id == 88 and model.config.pad_token_id == 89
    routers = [m for m in model.modules() if isinstance(m, LLaDA2MoeRouter)]
    assert len(routers) == 2 and all(not r.expert_bias.requires_grad for r in routers)
    assert all(bool(r.expert_bias.abs().sum() > 0) for r in routers)  # their expert bias, loaded
    assert LLaDA2LM.default_mask_token_id == 156895 and LLaDA2LM.default_block_size == 32


def test_logits_equal_their_modeling_code_on_a_padded_batch(model, ref):
    """Their forward with the block-causal mask (blocks from column 0, padded keys masked), every position."""
    with torch.no_grad():
        logits = model(ref["input_ids"], attention_mask=ref["attention_mask"])
        plain = model(ref["input_ids"][:1])
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=checks.RECORDED_ATOL)
    torch.testing.assert_close(plain, ref["logits_unpadded_row0"], rtol=0, atol=checks.RECORDED_ATOL)


def test_training_stream_equals_their_bd3lm_trainers_and_the_fused_loss_is_their_objective(model, ref):
    """Their model on their BD3-LM trainer's [x_t | x_0] stream (its mask and position ids): the same logits; the fused
    MDLM loss at time t is CE / t at the masked tokens (their loss weight 1/t for the linear schedule), 0 elsewhere."""
    x0, x_t = ref["train_x0"], ref["train_x_t"]
    t = torch.tensor([0.3, 0.7])
    with torch.no_grad():
        logits = model(x_t, clean=x0)
        loss = model(x_t, t, x0=x0, kernel=model.kernel, objective="mdlm", clean=x0)
    torch.testing.assert_close(logits, ref["train_logits"], rtol=0, atol=checks.RECORDED_ATOL)
    their = ref["train_logits"].double()
    their[..., MASK] = float("-inf")  # x_θ leaves the mask state out; their head row of the mask token is 0
    ce = -torch.log_softmax(their, -1).gather(-1, x0[..., None])[..., 0] / t[:, None].double()
    masked = x_t == MASK
    assert bool(masked.any()) and bool((~masked).any())
    torch.testing.assert_close(loss.double()[masked], ce[masked], rtol=1e-4, atol=1e-4)
    assert bool((loss[~masked] == 0).all())


@pytest.mark.parametrize("run", sorted(RUNS))
def test_generate_reference_equals_their_samplers_token_for_token(model, ref, run):
    """Greedy and sampled (their global seed = our generator's seed; top-k, top-p), LLaDA 2.0's and 2.1's."""
    kind, prompts, kwargs = RUNS[run]
    kwargs = dict(kwargs)
    assert kwargs.pop("block_size") == model.block_size
    assert (kind == "llada21") == ("editing_threshold" in kwargs)  # LLaDA 2.1's sampler: editing
    generator = torch.Generator().manual_seed(kwargs.pop("seed", 0))
    out = model.generate_reference(ref[prompts], generator=generator, **kwargs)
    assert torch.equal(out, ref[f"generate_{run}"])


@pytest.mark.parametrize("use_cache", [False, True])
def test_generate_with_a_policy_equals_their_sampler_on_block_aligned_prompts(model, ref, use_cache):
    """With the prompt a multiple of the block size, unifusion's block decoding is their LLaDA 2.0 sampler: their
    count schedule and threshold rule are LowConfidence / ConfidenceThreshold's (cached and uncached)."""
    prompt = ref["prompt_ids_aligned"]
    kw = {"max_new_tokens": 8, "do_sample": False, "eos_token_id": None, "use_cache": use_cache}
    low = model.generate(prompt, policy=LowConfidence(), num_steps=4, **kw)
    assert torch.equal(low, ref["generate_aligned_low_confidence"])
    threshold = model.generate(prompt, policy=ConfidenceThreshold(0.6), num_steps=2, **kw)
    assert torch.equal(threshold, ref["generate_aligned_threshold"])


@pytest.mark.parametrize("use_cache, merge_commits", [(True, False), (True, True), (False, False)])
def test_generate_with_a_policy_equals_their_sampler_on_unaligned_prompts(model, ref, use_cache, merge_commits):
    """Prompts of 6 tokens (P mod K = 2): their sampler decodes the block of columns 4–7, holding the prompt's last
    two tokens, first; ``generate`` cuts its blocks from column 0 as they do (``block_origin="sequence_start"``),
    so LowConfidence and ConfidenceThreshold give their recorded tokens (cached, merged commits, uncached)."""
    prompt = ref["prompt_ids"]
    assert model.block_origin == "sequence_start" and prompt.shape[1] % 4 == 2
    kw = {"do_sample": False, "eos_token_id": None, "use_cache": use_cache, "merge_commits": merge_commits}
    for run, policy in (("low_confidence", LowConfidence()), ("threshold", ConfidenceThreshold(0.6))):
        theirs = ref[f"generate_{run}"]
        out = model.generate(prompt, max_new_tokens=theirs.shape[1] - prompt.shape[1], policy=policy, num_steps=4,
                             **kw)
        assert torch.equal(out, theirs), run


def test_padded_rows_of_every_prompt_length_equal_the_rows_alone(model):
    g = torch.Generator().manual_seed(3)
    checks.check_padded_rows_equal_rows_alone(model, [torch.randint(0, 80, (n,), generator=g) for n in (5, 6, 9, 3)],
                                              pad_id=0)


def test_cached_generate_equals_uncached_on_left_padded_prompts(model, ref):
    prompt = torch.cat([ref["prompt_ids"][:, :1], ref["prompt_ids"]], 1)
    attn = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1] * 7])
    for policy, extra in ((LowConfidence(), {"do_sample": False}), (ConfidenceThreshold(0.3), {"temperature": 0.9})):
        outs = []
        for kw in ({"use_cache": False}, {"use_cache": True}, {"use_cache": True, "merge_commits": True}):
            g = [torch.Generator().manual_seed(i) for i in range(2)]
            outs.append(model.generate(prompt, attention_mask=attn, max_new_tokens=9, policy=policy, num_steps=2,
                                       eos_token_id=None, generator=g, **extra, **kw))
        assert outs[0].shape == (2, 16) and torch.equal(outs[0][:, :7], prompt)
        assert not bool((outs[0] == MASK).any())
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_fused_loss_is_the_mdlm_objective_on_their_logits(model, ref):
    checks.check_fused_loss_is_mdlm_on_their_logits(model, ref, ref["logits"],
                                                    torch.ones_like(ref["input_ids"], dtype=torch.bool))


def test_loss_bound_and_sequence_logprob_are_unbiased_for_the_enumerated_block_elbo(model):
    checks.check_block_estimators_match_the_enumerated_block_elbo(model)


def test_estimators_score_an_unaligned_rollout_under_the_decoders_blocks_from_column_0(model):
    """A prompt of 6 and a completion of 8 the model sampled (seed 12): the estimators are unbiased for the block ELBO
    enumerated under the decoder's blocks [4–7] (two prompt tokens clean), [8–11], [12–13] (measured within 1.5
    standard errors; the blocks cut at the prompt's end instead, [6–9], [10–13], are 12.8 / 15.1 / 13.2 standard
    errors off on SDAR / LLaDA 2 / Fast-dLLM v2)."""
    checks.check_block_estimators_match_the_enumerated_block_elbo(model, prompt_length=6, rollout=True, seed=12)


def test_their_objective_runs_and_mask_estimators_are_refused_naming_the_estimator(model, ref):
    x0 = ref["train_x0"]
    prompt = torch.zeros_like(x0, dtype=torch.bool)
    prompt[:, :4] = True
    with torch.no_grad():  # dllm's BD3-LM trainer's objective: one time per sequence, t ≥ 1e-3
        out = uf.diffusion_loss(model, x0, model.kernel, objective="mdlm", block_times="sequence", t_min=1e-3,
                                prompt_mask=prompt, generator=torch.Generator().manual_seed(0))
    assert bool(torch.isfinite(out.loss).all()) and bool((out.loss[prompt] == 0).all())
    with pytest.raises(ValueError, match="estimator: LLaDA2LM with blocks supports estimator='elbo'"):
        uf.rl.check_estimator(model, "mean_field")


def test_trace_replay_equals_the_log_probs_generate_committed_with(model, ref):
    """``sequence_logprob(estimator="trace")`` replays a sampled ``generate``'s commit log-probabilities through the
    training stream, cached and uncached, for prompts of 6 (blocks cut from column 0, as the decoder cut them)."""
    prompt = ref["prompt_ids"]
    for use_cache in (True, False):
        out = model.generate(prompt, max_new_tokens=8, num_steps=2, policy=LowConfidence(), eos_token_id=None,
                             temperature=0.8, return_trace=True, use_cache=use_cache,
                             generator=[torch.Generator().manual_seed(i) for i in range(2)])
        completion = out.commit_step >= 0
        with torch.no_grad():
            r = uf.rl.sequence_logprob(model, out.sequences, completion, estimator="trace", trace=out.commit_step,
                                       temperature=0.8)
        torch.testing.assert_close(r.per_token, out.commit_logprob, atol=1e-4, rtol=0)


def test_training_backward_reaches_the_chosen_experts_and_not_the_expert_bias(model, ref):
    x0 = ref["input_ids"].clamp(max=80)
    x_t = torch.where(torch.arange(x0.shape[1]) % 3 == 0, MASK, x0)
    model.train()
    try:
        loss = model(x_t, torch.full((3,), 0.5), x0=x0, kernel=model.kernel, objective="mdlm", clean=x0).sum()
        loss.backward()
    finally:
        model.eval()
    moe = model.hf_model.model.layers[1].mlp
    assert moe.gate.expert_bias.grad is None and moe.gate.weight.grad is not None
    assert sum(e.down_proj.weight.grad is not None for e in moe.experts) >= 2
    model.zero_grad(set_to_none=True)


def test_saved_folder_is_their_layout_and_loads_back(tmp_path):
    checks.check_saved_folder_is_their_layout(LLaDA2LM, FIXTURES, tmp_path)


def test_sharded_checkpoint_loads_lazily_in_the_dtype_asked(tmp_path):
    checks.check_sharded_lazy_load_in_the_dtype_asked(LLaDA2LM, FIXTURES, tmp_path)


def test_bad_checkpoints_and_inputs_are_value_errors_naming_the_problem(tmp_path, model, ref):
    checks.check_bad_checkpoints(LLaDA2LM, FIXTURES, tmp_path, MASK)
    config = json.loads((FIXTURES / "checkpoint" / "config.json").read_text())
    for key, value in (("norm_head", True), ("rope_scaling", {"type": "yarn", "factor": 2.0}),
                       ("score_function", "softmax"), ("norm_topk_prob", False)):
        with pytest.raises(ValueError, match=key):
            LLaDA2LM.backbone_config({**config, key: value})
    folder = checks.copy_checkpoint(FIXTURES, tmp_path / "block")
    (folder / "unifusion_config.json").write_text(json.dumps({"block_size": 8}))
    with pytest.raises(ValueError, match="block_size"):
        LLaDA2LM.from_pretrained(folder)
    with pytest.raises(ValueError, match="prompt_ids"):
        model.generate_reference(ref["prompt_ids"][0], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate_reference(ref["prompt_ids"], max_new_tokens=0)


def test_wrap_diffusion_lm_moves_their_models_tensors_onto_the_backbone(ref):
    class Theirs(torch.nn.Module):  # stands in for their LLaDA2MoeModelLM: its config and its state dict's names
        def __init__(self) -> None:
            super().__init__()
            from transformers import PretrainedConfig

            config = json.loads((FIXTURES / "checkpoint" / "config.json").read_text())
            config.pop("rope_scaling")  # None, the default (transformers 5 warns on the key)
            self.config = PretrainedConfig(**{**config, "model_type": None})
            self.config.model_type = "llada2_moe"
            self.weights = load_file(str(FIXTURES / "checkpoint" / "model.safetensors"))

        def state_dict(self, *args, **kwargs):  # type: ignore[override]
            return self.weights

    theirs = Theirs()
    wrapped = wrap_diffusion_lm(theirs)
    assert type(wrapped) is LLaDA2LM
    embed = theirs.weights["model.word_embeddings.weight"]
    assert wrapped.hf_model.model.embed_tokens.weight.data_ptr() == embed.data_ptr()  # moved, not copied
    assert not wrapped.hf_model.model.layers[1].mlp.gate.expert_bias.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ref["input_ids"], attention_mask=ref["attention_mask"]), ref["logits"],
                                   rtol=0, atol=checks.RECORDED_ATOL)
