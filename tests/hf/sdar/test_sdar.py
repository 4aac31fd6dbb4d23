"""SDAR / TraDo as a unifusion model kind, against SDAR's own code (JetAstra/SDAR modeling_sdar.py and generate.py)
run unmodified outside the repository on a tiny random checkpoint (fixtures/README.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import unifusion as uf
from unifusion.hf import SDARLM, wrap_diffusion_lm
from unifusion.samplers.policies import LowConfidence, SDAROrder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _native_checks as checks  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MASK = 90
RUNS = json.loads((FIXTURES / "generate_runs.json").read_text())


@pytest.fixture(scope="module")
def model() -> SDARLM:
    return uf.load_diffusion_lm(FIXTURES / "checkpoint")


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return checks.reference(FIXTURES)


def test_loads_as_sdar_on_qwen3_with_the_configs_mask_token_and_block_size(model):
    assert type(model) is SDARLM and type(model.hf_model).__name__ == "Qwen3ForCausalLM"
    assert model.mask_token_id == MASK and model.num_states == 96 and model.kernel.mask_id == MASK
    assert model.block_size == 4 and not model.shifted and model.prefix_decoder(12, 1) is None
    assert model.config.eos_token_id == 88 and model.config.pad_token_id is None


def test_logits_equal_their_modeling_code_under_block_causal_attention_on_a_padded_batch(model, ref):
    with torch.no_grad():
        logits = model(ref["input_ids"], attention_mask=ref["attention_mask"])
    # every position, padded ones too
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=checks.RECORDED_ATOL)


def test_training_stream_equals_theirs_and_the_fused_loss_is_their_objective(model, ref):
    """Their [x_t | x_0] stream (their noise, their block_attn_mask): the same logits; the fused MDLM loss at their
    p_mask is CE / p_mask at the masked answer tokens, the terms of their training loss."""
    x0, x_t, masked, p = ref["train_x0"], ref["train_x_t"], ref["train_masked"], ref["train_p_mask"]
    with torch.no_grad():
        logits = model(x_t, clean=x0)
        t = p.amax(-1)  # one time per sequence (theirs: one per packed sample)
        loss = model(x_t, t, x0=x0, kernel=uf.MaskKernel(96, MASK), objective="mdlm", clean=x0)
    torch.testing.assert_close(logits, ref["train_logits"], rtol=0, atol=checks.RECORDED_ATOL)
    their = ref["train_logits"].double()
    their[..., MASK] = float("-inf")  # x_θ leaves the mask state out; their head row of the mask token is 0
    ce = -torch.log_softmax(their, -1).gather(-1, x0[..., None])[..., 0] / t[:, None].double()
    assert bool(masked.any()) and torch.equal(masked, x_t == MASK)
    torch.testing.assert_close(loss.double()[masked], ce[masked], rtol=1e-4, atol=1e-4)
    assert bool((loss[~masked] == 0).all())


@pytest.mark.parametrize("run", sorted(RUNS))
def test_block_diffusion_generate_equals_their_generate_py_token_for_token(model, ref, run):
    """Greedy (top_k=1) with their default dynamic remasking, on a prompt that fills whole blocks and on one whose
    last block is decoded with the first new tokens; sequential; sampled (their global seed = our generator's seed)
    with dynamic and static remasking, top-k/top-p, and stop tokens."""
    kwargs = dict(RUNS[run])
    generator = torch.Generator().manual_seed(kwargs.pop("seed", 0))
    prompt = ref[f"prompt_{kwargs.pop('prompt')}"]
    out = model.block_diffusion_generate(prompt, generator=generator, **kwargs)
    assert torch.equal(out, ref[f"generate_{run}"])


@pytest.mark.parametrize("run", ["greedy_dynamic", "greedy_dynamic_ragged"])
def test_generate_with_a_policy_reproduces_their_greedy_decoder(model, ref, run):
    """Their greedy decoder with dynamic remasking commits a block in one step (confidence 1 after top-1
    filtering): ``generate(policy=LowConfidence(), num_steps=1)``, cached (merged commits or not) and uncached, gives
    their tokens, on a prompt of whole blocks and on one of 6 whose last block holds the first new tokens."""
    prompt = ref[f"prompt_{RUNS[run]['prompt']}"]
    theirs = ref[f"generate_{run}"]
    for kw in ({"use_cache": True}, {"use_cache": True, "merge_commits": True}, {"use_cache": False}):
        out = model.generate(prompt, max_new_tokens=theirs.shape[1] - prompt.shape[1], policy=LowConfidence(),
                             num_steps=1, do_sample=False, eos_token_id=None, **kw)
        assert torch.equal(out, theirs), kw


@pytest.mark.parametrize("length", [5, 6, 7, 9])
def test_generate_cuts_blocks_from_column_0_as_their_decoder_on_unaligned_prompts(model, length):
    """SDAR was trained, and decodes, with blocks at column multiples of K (``block_origin="sequence_start"``): on
    prompts with P mod K ≠ 0 ``generate(policy=LowConfidence(), num_steps=1)`` (greedy; cached, merged commits,
    uncached) equals ``block_diffusion_generate`` (their decoder, equal to their code on the fixtures) token for
    token, for two rows at once."""
    prompt = torch.randint(0, 80, (2, length), generator=torch.Generator().manual_seed(length))
    theirs = model.block_diffusion_generate(prompt, gen_length=16 - length, denoising_steps=4, top_k=1)
    assert model.block_origin == "sequence_start" and theirs.shape == (2, 16)
    for kw in ({"use_cache": True}, {"use_cache": True, "merge_commits": True}, {"use_cache": False}):
        out = model.generate(prompt, max_new_tokens=16 - length, policy=LowConfidence(), num_steps=1,
                             do_sample=False, eos_token_id=None, **kw)
        assert torch.equal(out, theirs), kw


def test_padded_rows_of_every_prompt_length_equal_the_rows_alone(model):
    g = torch.Generator().manual_seed(3)
    checks.check_padded_rows_equal_rows_alone(model, [torch.randint(0, 80, (n,), generator=g) for n in (5, 6, 9, 3)],
                                              pad_id=0)


@pytest.mark.parametrize("run", ["greedy_dynamic", "sampled_static"])
def test_sdar_order_equals_their_generate_py_on_whole_block_prompts(model, ref, run):
    """``generate(policy=SDAROrder(strategy, threshold), num_steps=denoising_steps)`` with their temperature,
    top-k, top-p and seed: their tokens on the fixture runs whose prompt fills whole blocks, cached and uncached."""
    kwargs = dict(RUNS[run])
    prompt = ref[f"prompt_{kwargs['prompt']}"]
    assert prompt.shape[1] % 4 == 0
    policy = SDAROrder(kwargs.get("remasking_strategy", "low_confidence_dynamic"),
                       kwargs.get("confidence_threshold", 0.85))
    for use_cache in (True, False):
        out = model.generate(prompt, max_new_tokens=kwargs["gen_length"], num_steps=kwargs["denoising_steps"],
                             policy=policy, temperature=kwargs.get("temperature", 1.0), top_k=kwargs.get("top_k"),
                             top_p=kwargs.get("top_p"), eos_token_id=None, use_cache=use_cache,
                             generator=torch.Generator().manual_seed(kwargs.get("seed", 0)))
        assert torch.equal(out, ref[f"generate_{run}"])


def test_sdar_order_equals_block_diffusion_generate_for_every_strategy(model, ref):
    """Every strategy, greedy (``top_k=1``: all confidences 1, their torch.topk's tie order) and sampled, on a batch
    of two whole-block prompts: the tokens of ``block_diffusion_generate`` (their decoder, proven above)."""
    prompt = torch.cat([ref["prompt_0"], ref["prompt_0"].flip(-1)])
    for strategy in ("low_confidence_dynamic", "low_confidence_static", "sequential"):
        for seed, (opts, steps) in enumerate([({"top_k": 1}, 2), ({"temperature": 3.0}, 4),
                                              ({"temperature": 2.0, "top_p": 0.9, "top_k": 40}, 2)]):
            theirs = model.block_diffusion_generate(prompt, gen_length=8, denoising_steps=steps,
                                                    remasking_strategy=strategy, confidence_threshold=0.3,
                                                    generator=torch.Generator().manual_seed(seed), **opts)
            ours = model.generate(prompt, max_new_tokens=8, num_steps=steps, policy=SDAROrder(strategy, 0.3),
                                  eos_token_id=None, generator=torch.Generator().manual_seed(seed), **opts)
            assert torch.equal(ours, theirs), (strategy, opts)


@pytest.mark.parametrize("length", [5, 6, 7])
def test_sdar_order_equals_block_diffusion_generate_on_prompts_that_end_inside_a_block(model, length):
    """Blocks from column 0 (``block_origin="sequence_start"``): the prompt's last ``length mod K`` tokens share a
    block with the first new ones, in both decoders. Greedy with every strategy, and sampled where the rows of a block
    finish together (static, sequential): the tokens of ``block_diffusion_generate`` (their decoder, proven above).
    Sampled dynamic remasking is left out: there SDAR keeps stepping a row whose block is done while another's is
    not, and its top-k then re-writes one of that row's committed tokens (``generate`` never does)."""
    prompt = torch.randint(0, 80, (2, length), generator=torch.Generator().manual_seed(length))
    runs = [(strategy, {"top_k": 1}, 4) for strategy in ("low_confidence_dynamic", "low_confidence_static",
                                                          "sequential")]
    runs += [(strategy, opts, 4) for strategy in ("low_confidence_static", "sequential")
             for opts in ({"temperature": 3.0}, {"temperature": 2.0, "top_p": 0.9, "top_k": 40})]
    for seed, (strategy, opts, steps) in enumerate(runs):
        theirs = model.block_diffusion_generate(prompt, gen_length=8, denoising_steps=steps,
                                                remasking_strategy=strategy, confidence_threshold=0.3,
                                                generator=torch.Generator().manual_seed(seed), **opts)
        for use_cache in (True, False):
            ours = model.generate(prompt, max_new_tokens=theirs.shape[1] - length, num_steps=steps,
                                  policy=SDAROrder(strategy, 0.3), eos_token_id=None, use_cache=use_cache,
                                  generator=torch.Generator().manual_seed(seed), **opts)
            assert torch.equal(ours, theirs), (strategy, opts, use_cache)


def test_loss_bound_and_sequence_logprob_are_unbiased_for_the_enumerated_block_elbo(model):
    checks.check_block_estimators_match_the_enumerated_block_elbo(model)


def test_estimators_score_an_unaligned_rollout_under_the_decoders_blocks_from_column_0(model):
    """A prompt of 6 and a completion of 8 the model sampled (seed 12): the estimators are unbiased for the block ELBO
    enumerated under the decoder's blocks [4–7] (two prompt tokens clean), [8–11], [12–13] (measured within 1.5
    standard errors; the blocks cut at the prompt's end instead, [6–9], [10–13], are 12.8 / 15.1 / 13.2 standard
    errors off on SDAR / LLaDA 2 / Fast-dLLM v2)."""
    checks.check_block_estimators_match_the_enumerated_block_elbo(model, prompt_length=6, rollout=True, seed=12)


def test_mask_estimators_and_packed_documents_are_refused_naming_them(model):
    with pytest.raises(ValueError, match="estimator: SDARLM with blocks supports estimator='elbo'"):
        uf.rl.check_estimator(model, "mean_field")
    x0 = torch.randint(0, 80, (1, 12))
    with pytest.raises(ValueError, match="document_ids: SDARLM does not take packed documents"):
        uf.diffusion_loss(model, x0, model.kernel, document_ids=(torch.arange(12) >= 8).long()[None])


def test_saved_folder_is_their_layout_and_loads_back(tmp_path):
    checks.check_saved_folder_is_their_layout(SDARLM, FIXTURES, tmp_path)
    record = json.loads((tmp_path / "saved" / "unifusion_config.json").read_text())
    assert record["block_size"] == 4 and record["model_type"] == "sdar"


def test_sharded_checkpoint_loads_lazily_in_the_dtype_asked(tmp_path):
    checks.check_sharded_lazy_load_in_the_dtype_asked(SDARLM, FIXTURES, tmp_path)


def test_bad_checkpoints_are_value_errors_naming_the_problem(tmp_path):
    checks.check_bad_checkpoints(SDARLM, FIXTURES, tmp_path, MASK)
    folder = checks.copy_checkpoint(FIXTURES, tmp_path / "block")
    (folder / "unifusion_config.json").write_text(json.dumps({"block_size": 8}))
    with pytest.raises(ValueError, match="block_size = 8, config.json 4"):
        SDARLM.from_pretrained(folder)
    (folder / "unifusion_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "block_size": -1}))
    with pytest.raises(ValueError, match="block_size = -1"):
        SDARLM.from_pretrained(folder)
    with pytest.raises(ValueError, match="use_sliding_window"):
        SDARLM.backbone_config({**config, "use_sliding_window": True})


def test_wrap_diffusion_lm_moves_their_models_tensors_onto_qwen3(ref):
    class Theirs(torch.nn.Module):  # stands in for their SDARForCausalLM: its config and its state dict's names
        def __init__(self) -> None:
            super().__init__()
            from transformers import PretrainedConfig

            config = json.loads((FIXTURES / "checkpoint" / "config.json").read_text())
            self.config = PretrainedConfig(**{**config, "model_type": None})
            self.config.model_type = "sdar"
            self.weights = load_file(str(FIXTURES / "checkpoint" / "model.safetensors"))

        def state_dict(self, *args, **kwargs):  # type: ignore[override]
            return self.weights

    theirs = Theirs()
    wrapped = wrap_diffusion_lm(theirs)
    assert type(wrapped) is SDARLM and wrapped.block_size == 4
    embed = theirs.weights["model.embed_tokens.weight"]
    assert wrapped.hf_model.model.embed_tokens.weight.data_ptr() == embed.data_ptr()  # moved, not copied
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ref["input_ids"], attention_mask=ref["attention_mask"]), ref["logits"],
                                   rtol=0, atol=checks.RECORDED_ATOL)


def test_trace_replay_equals_the_log_probs_generate_committed_with(model, ref):
    """``sequence_logprob(estimator="trace")`` replays a sampled ``generate``'s commit log-probabilities through the
    training stream (each block seeing the committed blocks before it), cached and uncached, for a prompt of 6 (its
    blocks cut from column 0, as the decoder cut them)."""
    prompt = torch.cat([ref["prompt_1"], ref["prompt_1"].flip(-1)])
    for use_cache in (True, False):
        out = model.generate(prompt, max_new_tokens=8, num_steps=2, policy=LowConfidence(), eos_token_id=None,
                             temperature=0.8, return_trace=True, use_cache=use_cache,
                             generator=[torch.Generator().manual_seed(i) for i in range(2)])
        completion = out.commit_step >= 0
        with torch.no_grad():
            r = uf.rl.sequence_logprob(model, out.sequences, completion, estimator="trace", trace=out.commit_step,
                                       temperature=0.8)
        torch.testing.assert_close(r.per_token, out.commit_logprob, atol=1e-4, rtol=0)
