"""The ``unifusion`` model inside lm-evaluation-harness, offline: local task configs (``tests/data/harness/``, the
``json`` loader over small files) run end to end on a tiny random model — saved checkpoint, live model and the
command line — and the harness's multiple-choice numbers equal ``run_multiple_choice``'s."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

# the datasets library reads these when it is imported: offline, and a private cache
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="unifusion-datasets-"))

import lm_eval  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from _hf_tiny import tiny_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import unifusion as uf  # noqa: E402
from unifusion.eval import nll_bound, run_multiple_choice  # noqa: E402
from unifusion.eval.harness import UnifusionLM, cli_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TASKS = DATA / "harness"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the task configs name their data files relative to the repository root


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DATA / "tiny_tokenizer")


@pytest.fixture(scope="module")
def model(tokenizer):
    return uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=3), tokenizer=tokenizer).eval()


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("harness") / "model"
    model.save_pretrained(path)  # writes the tokenizer given to adapt_ar_model beside the weights
    return path


def _evaluate(lm, tasks, **kwargs):
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_path=str(TASKS)),
                                   log_samples=True, **kwargs)


def test_the_model_is_registered():
    from lm_eval.api.registry import get_model

    assert get_model("unifusion") is UnifusionLM


def test_multiple_choice_equals_run_multiple_choice(model, tokenizer, checkpoint):
    for method in ("score", "fair_pmi"):
        out = _evaluate("unifusion", ["unifusion_tiny_mc"],
                        model_args=f"pretrained={checkpoint},method={method},num_times=4,seed=7")
        ref = run_multiple_choice(DATA / "tiny_task.json", model, uf.MaskKernel(model.num_states, model.mask_token_id),
                                  tokenizer, method=method, num_times=4, seed=7, progress=False)
        assert out["results"]["unifusion_tiny_mc"]["acc,none"] == pytest.approx(ref.accuracy, abs=0)
        samples = sorted(out["samples"]["unifusion_tiny_mc"], key=lambda s: s["doc_id"])
        assert len(samples) == len(ref.scores) == 6
        for sample, scores in zip(samples, ref.scores):
            harness = [-float(r[0]) for r in sample["filtered_resps"]]
            assert harness == pytest.approx(scores, rel=1e-12, abs=1e-12), (method, sample["doc_id"])


def test_loglikelihood_rolling_is_the_negative_nll_bound(model, tokenizer):
    lm = UnifusionLM(model=model, tokenizer=tokenizer, nll_times=8, seed=5)
    out = _evaluate(lm, ["unifusion_tiny_rolling"])
    metrics = out["results"]["unifusion_tiny_rolling"]
    assert all(math.isfinite(metrics[k]) and metrics[k] > 0 for k in
               ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"))
    texts = [json.loads(line)["text"] for line in (TASKS / "rolling.jsonl").read_text().splitlines()]
    g = torch.Generator().manual_seed(5)
    kernel = uf.MaskKernel(model.num_states, model.mask_token_id)
    expected = []
    for text in texts:  # the harness scores the documents in order with one generator
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]).unsqueeze(0)
        expected.append(-float(nll_bound(model, ids, kernel, num_times=8, generator=g, per_token=False)))
    got = [float(s["filtered_resps"][0]) if not isinstance(s["filtered_resps"][0], (list, tuple))
           else float(s["filtered_resps"][0][0]) for s in sorted(out["samples"]["unifusion_tiny_rolling"],
                                                                   key=lambda s: s["doc_id"])]
    assert got == pytest.approx(expected, rel=1e-10)
    assert all(v < 0 for v in got)  # a bound on −log p of a whole text is positive


def test_generate_until_stops_at_the_stop_string(model, tokenizer):
    lm = UnifusionLM(model=model, tokenizer=tokenizer, num_steps=4, kernel="uniform", seed=1)
    out = _evaluate(lm, ["unifusion_tiny_gen"])
    assert 0.0 <= out["results"]["unifusion_tiny_gen"]["exact_match,none"] <= 1.0
    for sample in out["samples"]["unifusion_tiny_gen"]:
        (text,) = sample["resps"][0]
        assert isinstance(text, str) and "." not in text
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= 6
    # the same request twice gives the same text (the sampler is seeded per request)
    request = type("R", (), {"args": ("the animal is cat . what is", {"until": ["?"], "max_gen_toks": 5})})()
    first, second = lm.generate_until([request, request])
    assert first == second and "?" not in first


def test_is_greedy_reflects_the_models_argmax(tokenizer):
    dm = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=0), tokenizer=tokenizer)
    with torch.no_grad():  # a zero output head: all logits tie and argmax is token 0 at every position
        dm.lm_head_weight.zero_()
        if dm.lm_head_bias is not None:
            dm.lm_head_bias.zero_()
    lm = UnifusionLM(model=dm, tokenizer=tokenizer, num_times=2)
    context = [5, 6]
    assert lm._is_greedy(context, [0, 0], torch.Generator().manual_seed(0))
    assert not lm._is_greedy(context, [0, 9], torch.Generator().manual_seed(0))


def test_command_line_on_a_saved_checkpoint(checkpoint, tmp_path):
    out_dir = tmp_path / "results"
    code = cli_main(["--model_args", f"pretrained={checkpoint},num_times=2", "--tasks", "unifusion_tiny_mc",
                     "--include_path", str(TASKS), "--output_path", str(out_dir), "--limit", "3",
                     "--batch_size", "8", "--device", "cpu"])
    assert code == 0
    (result_file,) = list(out_dir.rglob("results*.json"))
    result = json.loads(result_file.read_text())
    assert 0.0 <= result["results"]["unifusion_tiny_mc"]["acc,none"] <= 1.0
    assert result["config"]["model"] == "unifusion"
    # and through `unifusion harness ...`
    from unifusion.cli import main

    assert main(["harness", "--model_args", f"pretrained={checkpoint},num_times=2", "--tasks", "unifusion_tiny_mc",
                 "--include_path", str(TASKS), "--limit", "2"]) == 0


def test_bad_model_args_name_the_argument(model, tokenizer, checkpoint):
    with pytest.raises(ValueError, match="give exactly one of pretrained"):
        UnifusionLM(tokenizer=tokenizer)
    with pytest.raises(TypeError, match="model: expected a unifusion DiffusionLM"):
        UnifusionLM(model=torch.nn.Linear(2, 2), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="method: expected one of"):
        UnifusionLM(model=model, tokenizer=tokenizer, method="bogus")
    with pytest.raises(ValueError, match="num_times: expected an integer"):
        UnifusionLM(model=model, tokenizer=tokenizer, num_times="many")
    with pytest.raises(TypeError, match="unknown argument"):
        UnifusionLM.create_from_arg_string(f"pretrained={checkpoint},num_tims=3")
    with pytest.raises(ValueError, match="kernel: expected 'mask', 'uniform'"):
        UnifusionLM(model=model, tokenizer=tokenizer, kernel="gaussian")
    lm = UnifusionLM.create_from_arg_string(f"pretrained={checkpoint},num_times=3,kernel=uniform,seed=2",
                                            {"batch_size": "auto", "device": "cpu"})
    assert (lm.num_times, lm.seed, type(lm.kernel).__name__, lm.batch_size_per_forward) == (3, 2, "UniformKernel", 64)
