"""The lm-eval model's generate_until with decoding policies (unifusion.eval.harness._generation): the model
arguments and gen_kwargs that choose the policy, block size, threshold and steps; what reaches DiffusionLM.generate;
rows independent of their batch; bad options. Tiny random model, the bundled tiny tokenizer."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from _hf_tiny import tiny_model  # noqa: E402

import unifusion as uf  # noqa: E402

pytest.importorskip("lm_eval")
from unifusion.eval.harness import UnifusionLM, request_seed  # noqa: E402
from unifusion.samplers.policies import ConfidenceThreshold, LowConfidence  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="module")
def model(tokenizer):
    return uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=3), tokenizer=tokenizer).eval()


def _request(context, gen_kwargs):
    return SimpleNamespace(args=(context, gen_kwargs), doc_id=None, task_name=None)


def test_policy_options_reach_generate(model, tokenizer, monkeypatch):
    seen: list[dict] = []
    original = type(model).generate

    def spy(self, prompt_ids, **kwargs):
        seen.append(kwargs)
        return original(self, prompt_ids, **kwargs)

    monkeypatch.setattr(type(model), "generate", spy)
    lm = UnifusionLM(model=model, tokenizer=tokenizer, policy="low_confidence", block_size=4, num_steps=2, seed=1)
    lm.generate_until([_request("the animal is", {"until": [], "max_gen_toks": 8})])
    kw = seen[-1]
    assert isinstance(kw["policy"], LowConfidence) and kw["block_size"] == 4 and kw["num_steps"] == 2
    assert kw["eos_token_id"] == tokenizer.eos_token_id
    # gen_kwargs override the model arguments per task; threshold alone picks the threshold policy
    lm.generate_until([_request("the animal is", {"until": [], "max_gen_toks": 8, "threshold": 0.6,
                                                  "policy": "threshold", "block_size": 8})])
    kw = seen[-1]
    assert isinstance(kw["policy"], ConfidenceThreshold) and kw["policy"].threshold == 0.6 and kw["block_size"] == 8
    lm2 = UnifusionLM(model=model, tokenizer=tokenizer, threshold="0.8", seed=1)
    lm2.generate_until([_request("the animal is", {"until": [], "max_gen_toks": 4})])
    assert isinstance(seen[-1]["policy"], ConfidenceThreshold) and seen[-1]["policy"].threshold == 0.8
    # no policy: the Bayesian sampler, called as before
    UnifusionLM(model=model, tokenizer=tokenizer, num_steps=3, seed=1).generate_until(
        [_request("the animal is", {"until": [], "max_gen_toks": 4})])
    assert "policy" not in seen[-1] and seen[-1]["num_steps"] == 3


def test_policy_requests_do_not_depend_on_their_batch(model, tokenizer):
    lm = UnifusionLM(model=model, tokenizer=tokenizer, policy="threshold", threshold=0.5, block_size=4, seed=2,
                     batch_size=8)
    gk = {"until": [], "max_gen_toks": 8, "do_sample": True, "temperature": 0.8}
    contexts = ["the animal is cat .", "the animal is dog .", "the big dog ran"]
    batch = [_request(c, gk) for c in contexts]
    texts = lm.generate_until(batch)
    assert texts == [lm.generate_until([r])[0] for r in batch]
    # the text is DiffusionLM.generate's with the request's seed
    ids = tokenizer(contexts[2], add_special_tokens=False)["input_ids"]
    settings = [8, True, 0.8, None, None, "threshold", 4, 0.5, None, None]
    g = torch.Generator().manual_seed(request_seed(2, "generate_until", contexts[2], settings, 0))
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, policy=ConfidenceThreshold(0.5), block_size=4,
                         temperature=0.8, generator=[g], kernel=lm.kernel, eos_token_id=tokenizer.eos_token_id)
    new = out[0, len(ids):].tolist()
    new = new[: new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new
    assert texts[2] == tokenizer.decode(new, skip_special_tokens=True)


def test_merge_commits_on_a_block_model_gives_the_same_texts(tokenizer):
    """merge_commits="true" (a model argument, as the command line gives it) reaches generate and changes no text."""
    block = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=3), tokenizer=tokenizer,
                              block_size=4).eval()
    gk = {"until": [], "max_gen_toks": 12, "do_sample": True}
    batch = [_request(c, gk) for c in ("the animal is cat .", "the big dog ran")]
    texts = [UnifusionLM(model=block, tokenizer=tokenizer, policy="low_confidence", num_steps=2, seed=1,
                         merge_commits=merge).generate_until(batch) for merge in ("false", "true")]
    assert texts[0] == texts[1]
    # no policy: a block model decodes with the default policy (low_confidence for its mask kernel), as generate does
    # (the request seeds follow the named options, so its texts are other draws than policy=low_confidence's)
    default = UnifusionLM(model=block, tokenizer=tokenizer, num_steps=2, seed=1).generate_until(batch)
    assert len(default) == 2 and all(isinstance(text, str) for text in default)


def test_model_arguments_that_generate_until_would_refuse_fail_before_any_task(model, tokenizer):
    """The decoding options are checked against the model and kernel when the harness model is built, so a wrong one
    does not cost the loglikelihood tasks that run before generate_until."""
    block = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=3), tokenizer=tokenizer,
                              block_size=4).eval()
    with pytest.raises(ValueError, match="policy: EntropyBound renoises positions uniformly"):
        UnifusionLM(model=block, tokenizer=tokenizer, policy="entropy_bound")  # a mask kernel
    with pytest.raises(ValueError, match="policy: LowConfidence commits masked positions"):
        UnifusionLM(model=block, tokenizer=tokenizer, policy="low_confidence", kernel="uniform")
    with pytest.raises(ValueError, match="block_size: the model was trained with blocks of 4, got 8"):
        UnifusionLM(model=block, tokenizer=tokenizer, policy="low_confidence", block_size=8)
    with pytest.raises(ValueError, match="cache_refresh: this is a block model"):
        UnifusionLM(model=block, tokenizer=tokenizer, policy="low_confidence", cache_refresh=2)
    with pytest.raises(ValueError, match="cache_refresh: the approximate prefix cache"):
        UnifusionLM(model=model, tokenizer=tokenizer, policy="entropy_bound", kernel="uniform", cache_refresh=2)


def test_bad_decoding_options(model, tokenizer):
    with pytest.raises(ValueError, match="policy"):
        UnifusionLM(model=model, tokenizer=tokenizer, policy="greedy")
    with pytest.raises(ValueError, match="policy"):
        UnifusionLM(model=model, tokenizer=tokenizer, block_size=4)
    with pytest.raises(ValueError, match="threshold"):
        UnifusionLM(model=model, tokenizer=tokenizer, policy="threshold", threshold=1.5)
    with pytest.raises(ValueError, match="merge_commits"):
        UnifusionLM(model=model, tokenizer=tokenizer, policy="low_confidence", merge_commits=True)  # no blocks
    with pytest.raises(ValueError, match="merge_commits"):
        UnifusionLM(model=model, tokenizer=tokenizer, merge_commits="maybe")
    lm = UnifusionLM(model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="policy"):
        lm.generate_until([_request("the animal is", {"until": [], "policy": "beam"})])
