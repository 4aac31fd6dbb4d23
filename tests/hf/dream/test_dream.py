"""Dream as a unifusion model kind, against Dream's own code (dllm's modeling_dream.py and generation_utils.py) run
unmodified outside the repository on a tiny random checkpoint (fixtures/README.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import unifusion as uf
from unifusion.hf import DreamLM
from unifusion.samplers.policies import DreamOrder, LowConfidence, TimeGrid, TopKEntropy, TopKMargin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _native_checks as checks  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MASK = 90


@pytest.fixture(scope="module")
def model() -> DreamLM:
    return uf.load_diffusion_lm(FIXTURES / "checkpoint")


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return checks.reference(FIXTURES)


def their_x0_logits(ref: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Their logits shifted as their ``diffusion_generate`` shifts them (column i − 1 predicts token i), and where
    they are defined: a real column whose source column i − 1 is real too (column 0 reads itself)."""
    logits, valid = ref["logits"], ref["attention_mask"].bool()
    shifted = torch.cat([logits[:, :1], logits[:, :-1]], 1)
    source_real = torch.cat([valid[:, :1], valid[:, :-1]], 1)
    return shifted, valid & source_real


def test_loads_as_dream_with_the_configs_mask_token(model):
    assert type(model) is DreamLM and model.mask_token_id == MASK and model.num_states == 96
    assert model.kernel.mask_id == MASK and model.block_size is None and model.shifted


def test_logits_equal_their_modeling_code_shifted_on_a_padded_batch(model, ref):
    expected, defined = their_x0_logits(ref)
    with torch.no_grad():
        logits = model(ref["input_ids"], attention_mask=ref["attention_mask"])
        plain = model(ref["input_ids"][:1])
    assert int(defined.sum()) == 36 - 3 - 1 - 3  # left pads, the first real token after them, right pads
    torch.testing.assert_close(logits[defined], expected[defined], rtol=0, atol=checks.RECORDED_ATOL)
    unpadded = ref["logits_unpadded_row0"]
    torch.testing.assert_close(plain, torch.cat([unpadded[:, :1], unpadded[:, :-1]], 1), rtol=0,
                               atol=checks.RECORDED_ATOL)


def test_policies_generate_from_left_padded_prompts(model, ref):
    prompt, attn = ref["prompt_ids"], ref["prompt_attention_mask"]
    for policy in (LowConfidence(), TopKMargin()):
        out = model.generate(prompt, attention_mask=attn, max_new_tokens=8, policy=policy, do_sample=False,
                             eos_token_id=None)
        assert out.shape == (2, 13) and torch.equal(out[:, :5], prompt) and not bool((out[:, 5:] == MASK).any())
        alone = model.generate(prompt[1:, 2:], max_new_tokens=8, policy=policy, do_sample=False, eos_token_id=None)
        assert torch.equal(alone[0], out[1, 2:])  # the padded row equals the row alone (positions count real tokens)


@pytest.mark.parametrize("run", ["maskgit_plus", "maskgit_plus_4_steps", "entropy", "topk_margin"])
def test_greedy_diffusion_generate_equals_theirs_token_for_token(model, ref, run):
    new, steps, alg = json.loads((FIXTURES / "generate_runs.json").read_text())[run]
    out = model.diffusion_generate(ref["prompt_ids"], attention_mask=ref["prompt_attention_mask"],
                                   max_new_tokens=new, steps=steps, alg=alg, temperature=0.0)
    assert torch.equal(out, ref[f"generate_{run}"])


RUNS = json.loads((FIXTURES / "generate_runs.json").read_text())


@pytest.mark.parametrize("run", sorted(RUNS))
def test_dream_order_equals_their_diffusion_generate_token_for_token(model, ref, run):
    """``generate(policy=DreamOrder(alg), num_steps=steps, do_sample=False)``: their greedy tokens (their time grid's
    counts, their confidences, their torch.topk order) through the generic decoding path; and the plain policies
    with Dream's schedule (``TimeGrid``) give them too on this checkpoint (x_θ without the mask state: the same
    order wherever the mask token's mass does not reorder the positions)."""
    new, steps, alg = RUNS[run]
    kw = {"attention_mask": ref["prompt_attention_mask"], "max_new_tokens": new, "num_steps": steps,
          "do_sample": False, "eos_token_id": None}
    assert torch.equal(model.generate(ref["prompt_ids"], policy=DreamOrder(alg), **kw), ref[f"generate_{run}"])
    plain = {"maskgit_plus": LowConfidence, "topk_margin": TopKMargin, "entropy": TopKEntropy}[alg]
    assert torch.equal(model.generate(ref["prompt_ids"], policy=plain(schedule=TimeGrid()), **kw),
                       ref[f"generate_{run}"])


SAMPLED_RUNS = json.loads((FIXTURES / "sampled_runs.json").read_text())


@pytest.mark.parametrize("run", sorted(SAMPLED_RUNS))
def test_dream_order_and_diffusion_generate_equal_their_sampled_runs_token_for_token(model, ref, run):
    """Their sampled ``diffusion_generate`` (``torch.manual_seed(seed)`` before it; ``origin``, top-p, top-k,
    ``alg_temp`` sampled and greedy): ``generate(policy=DreamOrder(alg, alg_temp=...))`` and the named method, with a
    generator seeded alike, give their tokens."""
    kwargs = dict(SAMPLED_RUNS[run])
    seed, theirs = kwargs.pop("seed"), load_file(str(FIXTURES / "sampled.safetensors"))[f"generate_{run}"]
    prompt, attn = ref["prompt_ids"], ref["prompt_attention_mask"]
    temperature = kwargs.get("temperature", 0.0)
    sampling = {"do_sample": False} if temperature == 0 else {"temperature": temperature}
    ours = model.generate(prompt, attention_mask=attn, max_new_tokens=kwargs["max_new_tokens"],
                          num_steps=kwargs["steps"], policy=DreamOrder(kwargs["alg"], alg_temp=kwargs.get("alg_temp")),
                          top_p=kwargs.get("top_p"), top_k=kwargs.get("top_k"), eos_token_id=None,
                          generator=torch.Generator().manual_seed(seed), **sampling)
    assert torch.equal(ours, theirs)
    named = model.diffusion_generate(prompt, attention_mask=attn, generator=torch.Generator().manual_seed(seed),
                                     **kwargs)
    assert torch.equal(named, theirs)


@pytest.mark.parametrize("alg", ["origin", "maskgit_plus", "topk_margin", "entropy"])
def test_dream_order_sampled_equals_diffusion_generate_with_the_same_seed(model, ref, alg):
    """Sampled (temperature, top-p, top-k), and positions drawn with ``alg_temp``, over more steps than tokens and
    fewer, more seeds: ``DreamOrder`` draws what ``diffusion_generate`` (proven above) draws, in order."""
    prompt, attn = ref["prompt_ids"], ref["prompt_attention_mask"]
    cases = [({"temperature": 1.0, "top_p": 0.9}, 12), ({"temperature": 0.7, "top_k": 20}, 4), ({}, 4)]
    if alg != "origin":
        cases += [({"temperature": 1.0, "alg_temp": 0.5}, 6), ({"alg_temp": 1.0, "top_p": 0.8}, 4)]
    for seed, (extra, steps) in enumerate(cases):
        theirs = model.diffusion_generate(prompt, attention_mask=attn, max_new_tokens=8, steps=steps, alg=alg,
                                          generator=torch.Generator().manual_seed(seed), **extra)
        temperature = extra.get("temperature", 0.0)
        sampling = {"do_sample": False} if temperature == 0 else {"temperature": temperature}
        ours = model.generate(prompt, attention_mask=attn, max_new_tokens=8, num_steps=steps, eos_token_id=None,
                              policy=DreamOrder(alg, alg_temp=extra.get("alg_temp")), top_p=extra.get("top_p"),
                              top_k=extra.get("top_k"), generator=torch.Generator().manual_seed(seed), **sampling)
        assert torch.equal(ours, theirs), (extra, steps)


def test_dream_order_records_a_trace_the_replay_reproduces(model, ref):
    checks.check_trace_replay(model, ref, DreamOrder("maskgit_plus"))


def test_diffusion_generate_samples_with_a_generator(model, ref):
    kwargs = {"attention_mask": ref["prompt_attention_mask"], "max_new_tokens": 8, "steps": 4, "temperature": 1.0,
              "top_p": 0.9}
    for alg in ("origin", "maskgit_plus"):
        a = model.diffusion_generate(ref["prompt_ids"], alg=alg, generator=torch.Generator().manual_seed(0), **kwargs)
        b = model.diffusion_generate(ref["prompt_ids"], alg=alg, generator=torch.Generator().manual_seed(0), **kwargs)
        assert torch.equal(a, b) and not bool((a[:, 5:] == MASK).any()) and torch.equal(a[:, :5], ref["prompt_ids"])
    with pytest.raises(ValueError, match="alg"):
        model.diffusion_generate(ref["prompt_ids"], alg="nope", **kwargs)


def test_prefix_cache_is_exact_at_refresh_1_and_its_cached_step_equals_the_forward(model, ref):
    checks.check_prefix_cache(model, ref)


def test_trace_replay_equals_the_log_probs_generate_committed_with(model, ref):
    checks.check_trace_replay(model, ref)


def test_fused_loss_is_their_mdlm_objective_on_their_logits(model, ref):
    expected, defined = their_x0_logits(ref)
    checks.check_fused_loss_is_mdlm_on_their_logits(model, ref, expected, defined)


def test_loss_bound_and_sequence_logprob_are_unbiased_for_the_enumerated_elbo(model):
    checks.check_estimators_match_the_enumerated_elbo(model)


def test_saved_folder_is_their_layout_and_loads_back(tmp_path):
    checks.check_saved_folder_is_their_layout(DreamLM, FIXTURES, tmp_path)


def test_sharded_checkpoint_loads_lazily_in_the_dtype_asked(tmp_path):
    checks.check_sharded_lazy_load_in_the_dtype_asked(DreamLM, FIXTURES, tmp_path)


def test_bad_checkpoints_are_value_errors_naming_the_problem(tmp_path):
    checks.check_bad_checkpoints(DreamLM, FIXTURES, tmp_path, MASK)
    config = json.loads((FIXTURES / "checkpoint" / "config.json").read_text())
    with pytest.raises(ValueError, match="use_sliding_window"):
        DreamLM.backbone_config({**config, "use_sliding_window": True})
