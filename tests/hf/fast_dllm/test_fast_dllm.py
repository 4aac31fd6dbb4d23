"""Fast-dLLM v2 as a unifusion model kind, against its own code (the Hub folder's modeling.py, NVlabs/Fast-dLLM
v2/generation_functions.py) run unmodified outside the repository on a tiny random checkpoint (fixtures/README.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import unifusion as uf
from unifusion.hf import FastDLLMv2LM, wrap_diffusion_lm
from unifusion.samplers.policies import ConfidenceThreshold, FastDLLMv2Order, LowConfidence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _native_checks as checks  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MASK, PAD, K = 90, 89, 4
RUNS = json.loads((FIXTURES / "generate_runs.json").read_text())


@pytest.fixture(scope="module")
def model() -> FastDLLMv2LM:
    return uf.load_diffusion_lm(FIXTURES / "checkpoint")


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return checks.reference(FIXTURES)


def shifted(their_logits: torch.Tensor) -> torch.Tensor:
    """Their logits (column i predicts token i + 1) read as x0 logits: column i − 1 for token i, column 0 for 0."""
    return torch.cat([their_logits[..., :1, :], their_logits[..., :-1, :]], -2)


def test_loads_with_the_configs_block_size_and_mask_token(model):
    assert type(model) is FastDLLMv2LM and model.mask_token_id == MASK and model.num_states == 96
    assert model.block_size == K and model.shifted and model.kernel.mask_id == MASK
    assert model.config.eos_token_id == 88 and model.config.pad_token_id == PAD
    release = {"bd_size": 32, "vocab_size": 152064}  # Fast_dLLM_v2_7B's config names no mask id
    assert FastDLLMv2LM.mask_id_of(release, 152064) == 151665 and FastDLLMv2LM.block_size_of(release) == 32
    assert FastDLLMv2LM.block_size_of({}) == 32


def test_logits_equal_their_modeling_code_on_padded_batches(model, ref):
    with torch.no_grad():
        torch.testing.assert_close(model(ref["input_ids"]), shifted(ref["logits"]), rtol=0, atol=checks.RECORDED_ATOL)
        ids = ref["input_ids_block_padded"]
        attn = torch.ones_like(ids)
        attn[1, 8:] = 0  # row 1 right-padded from a block boundary: their batch computes its real columns alike
        ours = model(ids, attention_mask=attn)
    torch.testing.assert_close(ours[attn.bool()], shifted(ref["logits_block_padded"])[attn.bool()], rtol=0,
                               atol=checks.RECORDED_ATOL)
    # padding inside a block (right) and by a whole block (left): padded keys blocked, positions counting the real
    # tokens, so each row equals theirs run alone at its real length (another batch shape: float32 noise ~2e-5)
    lengths = ref["lengths"].tolist()
    attn = (torch.arange(12)[None, :] < ref["lengths"][:, None]).long()
    left = torch.cat([torch.full((1, K), PAD), ref["input_ids"][:1, :8]], 1)
    left_attn = torch.cat([torch.zeros(1, K), torch.ones(1, 8)], 1).long()
    with torch.no_grad():
        right = model(ref["input_ids"], attention_mask=attn)
        left_out = model(left, attention_mask=left_attn)[0, K:]
    for i, n in enumerate(lengths):
        torch.testing.assert_close(right[i, :n], shifted(ref[f"logits_row{i}_alone"]), rtol=0,
                                   atol=checks.RECORDED_ATOL)
    torch.testing.assert_close(left_out, shifted(ref["logits_row0_alone"][:8]), rtol=0,
                               atol=checks.RECORDED_ATOL)


@pytest.mark.parametrize("run", sorted(RUNS["batch_sample"]))
def test_generate_reference_equals_their_batch_sample_token_for_token(model, ref, run):
    spec = RUNS["batch_sample"][run]
    n = torch.tensor(spec["lengths"])
    prompt = ref["prompt_ids"][:len(n), :int(n.max())]
    attn = (torch.arange(prompt.shape[1])[None, :] < n[:, None]).long()
    out = model.generate_reference(prompt, attention_mask=attn, max_new_tokens=spec["max_new_tokens"],
                                   small_block_size=spec["small_block_size"], threshold=spec["threshold"],
                                   stop_token_id=None if spec["stop_token"] < 0 else spec["stop_token"])
    for i in range(len(n)):
        assert torch.equal(out[i], ref[f"batch_{run}_row{i}"]), (i, out[i].tolist())


@pytest.mark.parametrize("run", sorted(RUNS["generate"]))
def test_generate_reference_equals_their_model_files_generate_on_one_row(model, ref, run):
    """Their model file's ``generate`` stops decoding at the stop token and cuts the row after it; the evaluation
    decoder finishes the block and fills it with pad ids: the same tokens up to the stop."""
    spec = RUNS["generate"][run]
    prompt = ref["prompt_ids"][spec["row"]:spec["row"] + 1, :spec["length"]]
    theirs = ref[f"generate_{run}"]
    out = model.generate_reference(prompt, max_new_tokens=spec["max_new_tokens"],
                                   small_block_size=spec["small_block_size"], threshold=spec["threshold"],
                                   stop_token_id=None if spec["stop_token"] < 0 else spec["stop_token"])[0]
    assert torch.equal(out[:theirs.shape[0]], theirs)
    assert bool((out[theirs.shape[0]:] == PAD).all())


def test_generate_reference_refuses_bad_input(model, ref):
    prompt = ref["prompt_ids"][:2, :6]
    with pytest.raises(ValueError, match="small_block_size: expected a divisor of the block size 4, got 3"):
        model.generate_reference(prompt, max_new_tokens=8, small_block_size=3)
    with pytest.raises(ValueError, match="attention_mask: Fast-dLLM v2's decoder takes right-padded prompts"):
        model.generate_reference(prompt, max_new_tokens=8, small_block_size=2,
                                 attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]] * 2))


@pytest.mark.parametrize("merge_commits", [False, True])
def test_cached_step_logits_equal_the_shifted_one_stream_forward(model, merge_commits):
    """Each cached step's logits equal the forward's on the sequence as it stands (behind the (−P) mod K invisible
    pads, a left-padded row among them): a block's first column reads the previous block's last column, which the
    cache keeps from the prefill or the commit."""
    prompt = torch.randint(0, 80, (2, 5), generator=torch.Generator().manual_seed(2))
    prompt_mask = torch.tensor([[False, False, True, True, True], [True] * 5])
    decoder = model.block_decoder(merge_commits=merge_commits)
    state = decoder.start_blocks(prompt, prompt_mask)
    rows, t = torch.arange(2), torch.full((2,), 0.5)
    seq, valid = prompt.clone(), prompt_mask.clone()
    for b, block in enumerate([torch.tensor([[MASK, 7, MASK, 9], [MASK] * 4]), torch.tensor([[3, MASK, 4, MASK]] * 2)]):
        cached = decoder.denoise_block(state, block, t, rows, None)
        full = torch.cat([torch.full((2, 3), PAD), seq, block], 1)  # 3 invisible pads: 3 + 5 ≡ 0 (mod 4)
        mask = torch.cat([torch.zeros(2, 3, dtype=torch.bool), valid, torch.ones(2, K, dtype=torch.bool)], 1)
        with torch.no_grad():
            direct = model(full, attention_mask=mask.long())[:, -K:]
        torch.testing.assert_close(cached, direct, rtol=0, atol=5e-5)
        committed = torch.where(block == MASK, 11 + b, block)
        state = decoder.commit_block(state, committed, rows)
        seq = torch.cat([seq, committed], 1)
        valid = torch.cat([valid, torch.ones(2, K, dtype=torch.bool)], 1)


@pytest.mark.parametrize("run", ["mid_block", "short_prompt"])
def test_generate_decodes_the_prompts_last_block_as_their_decoder_on_unaligned_prompts(model, ref, run):
    """Their decoder cuts blocks from column 0: a prompt of 6 (3) tokens shares the block of columns 4–7 (0–3) with
    the first new tokens, which it decodes with their threshold (every masked position above it, and the most
    confident). ``generate(policy=ConfidenceThreshold(τ))`` (``block_origin="sequence_start"``; cached, merged
    commits, uncached) decodes that block as their model file's ``generate`` did (recorded tokens); their later
    blocks open with an AR step that no policy takes."""
    spec = RUNS["generate"][run]
    n = spec["length"]
    prompt = ref["prompt_ids"][spec["row"]:spec["row"] + 1, :n]
    end = n // K * K + K
    assert model.block_origin == "sequence_start" and n % K and spec["small_block_size"] >= end - n
    for kw in ({"use_cache": True}, {"use_cache": True, "merge_commits": True}, {"use_cache": False}):
        out = model.generate(prompt, max_new_tokens=end - n, policy=ConfidenceThreshold(spec["threshold"]),
                             do_sample=False, eos_token_id=None, **kw)
        assert torch.equal(out[0], ref[f"generate_{run}"][:end]), kw


def test_padded_rows_of_every_prompt_length_equal_the_rows_alone(model):
    g = torch.Generator().manual_seed(3)
    checks.check_padded_rows_equal_rows_alone(model, [torch.randint(0, 80, (n,), generator=g) for n in (5, 6, 9, 3)],
                                              pad_id=PAD)


def test_fast_dllm_v2_order_equals_their_generate_on_a_whole_block_prompt(model, ref):
    """``generate(policy=FastDLLMv2Order(threshold, small_block_size), do_sample=False)``: their model file's tokens
    on the fixture whose prompt fills whole blocks (theirs also returns the next block's AR token), cached, merged
    and uncached."""
    spec = RUNS["generate"]["at_boundary"]
    prompt = ref["prompt_ids"][spec["row"]:spec["row"] + 1, :spec["length"]]
    assert prompt.shape[1] % K == 0 and prompt.shape[1] > K
    theirs = ref["generate_at_boundary"]
    for kw in ({}, {"merge_commits": True}, {"use_cache": False}):
        out = model.generate(prompt, max_new_tokens=spec["max_new_tokens"], do_sample=False, eos_token_id=None,
                             policy=FastDLLMv2Order(spec["threshold"], spec["small_block_size"]), **kw)
        assert torch.equal(out[0], theirs[:out.shape[1]]) and theirs.shape[0] == out.shape[1] + 1


@pytest.mark.parametrize("length", [K + 1, K + 2, 2 * K - 1, 2 * K + 3])
def test_fast_dllm_v2_order_equals_their_batch_decoder_on_prompts_that_end_inside_a_block(model, length):
    """Blocks from column 0 (``block_origin="sequence_start"``): a prompt of more than K tokens that ends inside a
    block is decoded with that block, then block by block with their AR step; thresholds 0.9 / 0.5 / 1, sub-blocks of
    2, 4, 1, three rows: the tokens of ``generate_reference`` (their batch_sample, proven above) on the columns both
    decode (theirs ends after its block count, ``generate`` after ``max_new_tokens``)."""
    prompt = torch.randint(0, 80, (3, length), generator=torch.Generator().manual_seed(length))
    new = 8 + (-(length + 8)) % K
    for threshold, sub in ((0.9, 2), (0.5, 4), (1.0, 1)):
        theirs = model.generate_reference(prompt, max_new_tokens=new, small_block_size=sub, threshold=threshold,
                                          stop_token_id=None)
        out = model.generate(prompt, max_new_tokens=new, policy=FastDLLMv2Order(threshold, sub), do_sample=False,
                             eos_token_id=None)
        both = min(out.shape[1], min(row.shape[0] for row in theirs))
        assert both >= length + K
        for i in range(3):
            assert torch.equal(out[i, :both], theirs[i][:both]), (threshold, sub, i)


def test_fast_dllm_v2_order_equals_their_batch_decoder_on_whole_block_prompts(model, ref):
    """Thresholds 0.9 / 0.5 / 1 (one per step), sub-blocks of 1, 2, 4, on a batch of three prompts of two and three
    blocks: the tokens of ``generate_reference`` (their batch_sample, proven above)."""
    ids = ref["prompt_ids"]
    for prompt in (ids[:, :8], torch.cat([ids[:, :8], ids[:, 2:6]], 1)):
        for threshold, sub in ((0.9, 2), (0.5, 4), (1.0, 1)):
            theirs = model.generate_reference(prompt, max_new_tokens=8, small_block_size=sub, threshold=threshold)
            out = model.generate(prompt, max_new_tokens=8, policy=FastDLLMv2Order(threshold, sub), do_sample=False,
                                 eos_token_id=None)
            for i in range(3):
                assert torch.equal(out[i], theirs[i][:out.shape[1]]), (prompt.shape, threshold, sub, i)
    with pytest.raises(ValueError, match="do_sample: Fast-dLLM v2's decoder is greedy"):
        model.generate(ids[:1, :8], max_new_tokens=4, policy=FastDLLMv2Order())


def test_cached_generate_equals_uncached_with_every_policy(model, ref):
    prompt, g = ref["prompt_ids"][:2, :6], torch.Generator()
    attn = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    for policy in (LowConfidence(), ConfidenceThreshold(0.5)):
        kw = {"attention_mask": attn, "max_new_tokens": 8, "policy": policy, "eos_token_id": None, "num_steps": 2,
              "do_sample": False}
        cached = model.generate(prompt, use_cache=True, **kw)
        assert torch.equal(cached, model.generate(prompt, use_cache=False, **kw))
        assert torch.equal(cached, model.generate(prompt, use_cache=True, merge_commits=True, **kw))
        assert torch.equal(cached[:, :6], prompt) and not bool((cached[:, 6:] == MASK).any())
    sampled = {"attention_mask": attn, "max_new_tokens": 8, "policy": LowConfidence(), "eos_token_id": None,
               "temperature": 0.8}
    a = model.generate(prompt, use_cache=True, generator=g.manual_seed(4), **sampled)
    assert torch.equal(a, model.generate(prompt, use_cache=False, generator=g.manual_seed(4), **sampled))


def test_trace_replay_equals_the_log_probs_generate_committed_with(model, ref):
    prompt, attn = ref["prompt_ids"][:2, :5], torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    for use_cache in (True, False):
        out = model.generate(prompt, attention_mask=attn, max_new_tokens=8, num_steps=2, policy=LowConfidence(),
                             eos_token_id=None, temperature=0.8, return_trace=True, use_cache=use_cache,
                             generator=[torch.Generator().manual_seed(i) for i in range(2)])
        completion = out.commit_step >= 0
        valid = torch.cat([attn, torch.ones(2, 8, dtype=attn.dtype)], 1)
        with torch.no_grad():
            r = uf.rl.sequence_logprob(model, out.sequences, completion, estimator="trace", trace=out.commit_step,
                                       temperature=0.8, attention_mask=valid)
        torch.testing.assert_close(r.per_token, out.commit_logprob, atol=1e-4, rtol=0)


def test_training_stream_predicts_each_block_from_the_clean_blocks_before_it(model):
    """``model(x_t, clean=x0)`` (the ``[x_t | x0]`` stream the losses run) gives block b's columns what the one-stream
    forward gives on the clean blocks before b and x_t's block b — a block's first column included, whose shifted
    prediction reads the clean previous block (in their training, its noisy one)."""
    g = torch.Generator().manual_seed(9)
    x0 = torch.randint(0, 80, (3, 3 * K), generator=g)
    x_t = torch.where(torch.rand(x0.shape, generator=g) < 0.6, MASK, x0)
    with torch.no_grad():
        stream = model(x_t, clean=x0)
        for b in range(3):
            seen = torch.cat([x0[:, :b * K], x_t[:, b * K:]], 1)
            torch.testing.assert_close(stream[:, b * K:(b + 1) * K], model(seen)[:, b * K:(b + 1) * K], rtol=0,
                                       atol=5e-5)  # 2L against L columns: float32 noise ~1e-5
        noisy_before = model(x_t)[:, K]  # the block start read at the noisy previous block: another prediction
    assert (stream[:, K] - noisy_before).abs().amax() > 1.0


def test_loss_bound_and_sequence_logprob_are_unbiased_for_the_enumerated_block_elbo(model):
    checks.check_block_estimators_match_the_enumerated_block_elbo(model)


def test_estimators_score_an_unaligned_rollout_under_the_decoders_blocks_from_column_0(model):
    """A prompt of 6 and a completion of 8 the model sampled (seed 12): the estimators are unbiased for the block ELBO
    enumerated under the decoder's blocks [4–7] (two prompt tokens clean), [8–11], [12–13] (measured within 1.5
    standard errors; the blocks cut at the prompt's end instead, [6–9], [10–13], are 12.8 / 15.1 / 13.2 standard
    errors off on SDAR / LLaDA 2 / Fast-dLLM v2)."""
    checks.check_block_estimators_match_the_enumerated_block_elbo(model, prompt_length=6, rollout=True, seed=12)


def test_complementary_pairs_are_unbiased_for_the_enumerated_block_elbo(model):
    """Their masking (one time per block, the complementary copy): ``diffusion_loss(..., complementary=True)`` with
    ELBO weights, on a completion starting inside the first block (so the second block's first token is predicted
    after a noisy first block in the stream), averages to the block ELBO enumerated on the one-stream forward (the
    other blocks clean) within 4 standard errors."""
    L, P, R = 2 * K, 2, 256
    x0 = torch.randint(0, 80, (L,), generator=torch.Generator().manual_seed(5))
    elbo = 0.0
    for b in range(2):
        positions = [i for i in range(b * K, (b + 1) * K) if i >= P]
        elbo += checks.exact_elbo(checks.subset_log_probs(model, x0, positions), positions)
    prompt = torch.zeros(R, L, dtype=torch.bool)
    prompt[:, :P] = True
    with torch.no_grad():
        pair = uf.diffusion_loss(model, x0.repeat(R, 1), model.kernel, objective="mdlm", prompt_mask=prompt,
                                 complementary=True, generator=torch.Generator().manual_seed(7))
    rows = -pair.loss.double().sum(-1)
    values = (rows[:R] + rows[R:]) / 2
    mean, se = float(values.mean()), float(values.std() / R ** 0.5)
    assert abs(mean - elbo) < 4 * se + 1e-4, (mean, se, elbo)


def test_fused_loss_is_the_mdlm_loss_on_their_logits(model, ref):
    """At a block's columns after a clean block, the fused MDLM loss of the one-stream forward (x_t as the clean
    stream) is theirs: (1/t) · −log softmax(their shifted logits)[x0] at the masked positions."""
    checks.check_fused_loss_is_mdlm_on_their_logits(model, ref, shifted(ref["logits"]),
                                                    torch.ones_like(ref["input_ids"], dtype=torch.bool))


def test_saved_folder_is_their_layout_and_loads_back(tmp_path):
    checks.check_saved_folder_is_their_layout(FastDLLMv2LM, FIXTURES, tmp_path)


def test_sharded_checkpoint_loads_lazily_in_the_dtype_asked(tmp_path):
    checks.check_sharded_lazy_load_in_the_dtype_asked(FastDLLMv2LM, FIXTURES, tmp_path)


def test_bad_checkpoints_are_value_errors_naming_the_problem(tmp_path):
    checks.check_bad_checkpoints(FastDLLMv2LM, FIXTURES, tmp_path, MASK)
    folder = checks.copy_checkpoint(FIXTURES, tmp_path / "block")
    (folder / "unifusion_config.json").write_text(json.dumps({"block_size": 8}))
    with pytest.raises(ValueError, match="block_size = 8, config.json 4"):
        FastDLLMv2LM.from_pretrained(folder)
    config = json.loads((FIXTURES / "checkpoint" / "config.json").read_text())
    for bad, match in (({"bd_size": 0}, "bd_size = 0"), ({"layer_types": ["sliding_attention"] * 2}, "layer_types"),
                       ({"use_sliding_window": True}, "use_sliding_window")):
        with pytest.raises(ValueError, match=match):
            FastDLLMv2LM.backbone_config({**config, **bad})


def test_an_estimator_the_block_kind_cannot_take_is_a_value_error_naming_it(model):
    x0 = torch.randint(0, 80, (2, 8), generator=torch.Generator().manual_seed(0))
    completion = torch.zeros(2, 8, dtype=torch.bool)
    completion[:, 3:] = True
    for estimator in ("mean_field", "coupled"):
        with pytest.raises(ValueError, match=f"FastDLLMv2LM with blocks supports estimator='elbo'.*'{estimator}'"):
            uf.rl.sequence_logprob(model, x0, completion, estimator=estimator)


def test_wrap_diffusion_lm_moves_their_models_tensors_onto_qwen2(ref):
    class Theirs(torch.nn.Module):  # stands in for their Fast_dLLM_QwenForCausalLM: its config and state dict names
        def __init__(self) -> None:
            super().__init__()
            from transformers import PretrainedConfig

            config = json.loads((FIXTURES / "checkpoint" / "config.json").read_text())
            kept = {k: v for k, v in config.items() if k not in ("model_type", "rope_scaling")}
            self.config = PretrainedConfig(**kept)
            self.config.model_type = "Fast_dLLM_Qwen"
            self.weights = load_file(str(FIXTURES / "checkpoint" / "model.safetensors"))

        def state_dict(self, *args, **kwargs):  # type: ignore[override]
            return self.weights

    theirs = Theirs()
    wrapped = wrap_diffusion_lm(theirs)
    assert type(wrapped) is FastDLLMv2LM and wrapped.block_size == K
    embed = theirs.weights["model.embed_tokens.weight"]
    assert wrapped.hf_model.model.embed_tokens.weight.data_ptr() == embed.data_ptr()  # moved, not copied
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ref["input_ids"]), shifted(ref["logits"]), rtol=0, atol=checks.RECORDED_ATOL)
