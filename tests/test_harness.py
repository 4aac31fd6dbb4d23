"""The ``unifusion`` model inside lm-evaluation-harness, offline: local task configs (``tests/data/harness/``, the
``json`` loader over small files) run end to end on a tiny random model — saved checkpoint, live model and the
command line — and the harness's numbers equal ``run_multiple_choice``'s and ``nll_bound``'s."""

from __future__ import annotations

import atexit
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

# the datasets library reads these when it is imported: offline, and a private cache
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="unifusion-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)

import lm_eval  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from _hf_tiny import tiny_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import unifusion as uf  # noqa: E402
from unifusion.eval import nll_bound, run_multiple_choice, score_choices  # noqa: E402
from unifusion.eval.harness import UnifusionLM, cli_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TASKS = DATA / "harness"
ALL_TASKS = ["unifusion_tiny_mc", "unifusion_tiny_rolling", "unifusion_tiny_gen"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # a 32-wide model gains nothing from threads, and on a busy 2-core machine OpenMP's barriers make every matmul
    # wait for a descheduled worker (measured: 0.03 ms per linear with 1 thread, 16 ms with 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the task configs name their data files relative to the repository root


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(TASKS), include_defaults=False)  # our three tasks, without indexing lm_eval's


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


def _evaluate(lm, tasks, task_manager, **kwargs):
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, log_samples=True,
                                   verbosity="WARNING", **kwargs)


def _request(*args, doc_id=None, task_name=None):
    return SimpleNamespace(args=args, doc_id=doc_id, task_name=task_name)


def _sorted_samples(out, task):
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def test_the_model_is_registered():
    from lm_eval.api.registry import get_model

    assert get_model("unifusion") is UnifusionLM


def test_missing_lm_eval_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)  # `from lm_eval.api.model import LM` fails
    spec = importlib.util.spec_from_file_location("unifusion.eval._harness_without_lm_eval",
                                                  ROOT / "unifusion" / "eval" / "harness.py")
    assert spec is not None and spec.loader is not None
    with pytest.raises(ImportError, match=r'pip install "unifusion\[eval\]"'):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.mark.parametrize("method", ["score", "fair_pmi"])
def test_multiple_choice_equals_run_multiple_choice(model, tokenizer, checkpoint, task_manager, method):
    fair = method == "fair_pmi"
    out = _evaluate("unifusion", ["unifusion_tiny_mc"], task_manager,
                    model_args=f"pretrained={checkpoint},fair_pmi={fair},num_times=4,seed=7", batch_size=8)
    ref = run_multiple_choice(DATA / "tiny_task.json", model, uf.MaskKernel(model.num_states, model.mask_token_id),
                              tokenizer, method=method, num_times=4, seed=7, batch_size=8, progress=False)
    assert ref.num_examples == 6
    assert out["results"]["unifusion_tiny_mc"]["acc,none"] == ref.accuracy
    samples = _sorted_samples(out, "unifusion_tiny_mc")
    assert len(samples) == len(ref.scores)
    for sample, scores, pred in zip(samples, ref.scores, ref.predictions):
        harness = [-float(r[0]) for r in sample["filtered_resps"]]
        assert all(math.isfinite(v) for v in harness)
        assert harness == pytest.approx(scores, rel=1e-12, abs=1e-12), (method, sample["doc_id"])
        assert min(range(len(harness)), key=harness.__getitem__) == pred
        assert all(isinstance(r[1], bool) for r in sample["filtered_resps"])


def test_saved_checkpoint_runs_the_three_request_types(checkpoint, task_manager):
    out = _evaluate("unifusion", ALL_TASKS, task_manager, batch_size="auto", device="cpu",
                    model_args=f"pretrained={checkpoint},num_times=2,nll_times=4,num_steps=2,dtype=auto")
    res = out["results"]
    assert 0.0 <= res["unifusion_tiny_mc"]["acc,none"] <= 1.0
    assert all(math.isfinite(res["unifusion_tiny_rolling"][k]) and res["unifusion_tiny_rolling"][k] > 0
               for k in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"))
    assert 0.0 <= res["unifusion_tiny_gen"]["exact_match,none"] <= 1.0
    assert out["config"]["model"] == "unifusion"


def test_loglikelihood_rolling_is_the_negative_nll_bound(model, tokenizer, task_manager):
    lm = UnifusionLM(model=model, tokenizer=tokenizer, nll_times=8, seed=5)
    out = _evaluate(lm, ["unifusion_tiny_rolling"], task_manager)
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
    got = []
    for s in _sorted_samples(out, "unifusion_tiny_rolling"):
        resp = s["filtered_resps"][0]
        got.append(float(resp[0] if isinstance(resp, (list, tuple)) else resp))
    assert got == pytest.approx(expected, rel=1e-10)
    assert all(v < 0 for v in got)  # a bound on −log p of a whole text is positive


def test_loglikelihood_rolling_windows_long_texts(model, tokenizer):
    text = "the cat sat on the mat . the big dog ran to the river ."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 6
    lm = UnifusionLM(model=model, tokenizer=tokenizer, nll_times=4, seed=3, max_length=5)
    (got,) = lm.loglikelihood_rolling([_request(text)])
    g = torch.Generator().manual_seed(3)
    kernel = uf.MaskKernel(model.num_states, model.mask_token_id)
    expected = sum(-float(nll_bound(model, torch.tensor([ids[lo: lo + 5]]), kernel, num_times=4, generator=g,
                                    per_token=False)) for lo in range(0, len(ids), 5))
    assert got == pytest.approx(expected, rel=1e-10) and math.isfinite(got)


def test_generate_until_runs_in_the_harness(model, tokenizer, task_manager):
    lm = UnifusionLM(model=model, tokenizer=tokenizer, num_steps=4, kernel="uniform", seed=1)
    out = _evaluate(lm, ["unifusion_tiny_gen"], task_manager)
    assert 0.0 <= out["results"]["unifusion_tiny_gen"]["exact_match,none"] <= 1.0
    for sample in out["samples"]["unifusion_tiny_gen"]:
        (text,) = sample["resps"][0]
        assert isinstance(text, str) and "." not in text  # the task's `until: ["."]`
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= 6  # max_gen_toks


def test_generate_until_truncates_at_the_first_stop_string(model, tokenizer):
    # batch_size=1: every request is sampled on its own from the seed, so the same request gives the same sample
    lm = UnifusionLM(model=model, tokenizer=tokenizer, num_steps=4, kernel="uniform", seed=11, batch_size=1)
    context = "the animal is cat . what is"
    (full,) = lm.generate_until([_request(context, {"until": [], "max_gen_toks": 12})])
    words = full.split()
    assert len(words) >= 4, full
    stop, other = words[2], words[3]  # both occur in the untruncated text: the first occurrence of either wins
    cut = min(full.index(stop), full.index(other))
    first, again = lm.generate_until([_request(context, {"until": [other, stop], "max_gen_toks": 12}),
                                      _request(context, {"until": other if cut == full.index(other) else stop,
                                                         "max_gen_toks": 12})])
    assert first == again == full[:cut]  # same seed: same sample, cut before the earliest stop string
    assert len(first) < len(full)
    # greedy requests (do_sample false / temperature 0) run at T = 1e-4 and still stop at the stop string
    (greedy,) = lm.generate_until([_request(context, {"until": [stop], "max_gen_toks": 12, "do_sample": False})])
    assert isinstance(greedy, str) and stop not in greedy


def test_generate_until_batches_equal_prompts(model, tokenizer):
    lm = UnifusionLM(model=model, tokenizer=tokenizer, num_steps=3, kernel="uniform", seed=4, batch_size=2)
    contexts = ["the animal is cat .", "the animal is dog .", "a fish"]  # two of one length, one shorter
    texts = lm.generate_until([_request(c, {"until": [], "max_gen_toks": 5}) for c in contexts])
    enc = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in contexts]
    assert len(enc[0]) == len(enc[1]) != len(enc[2])
    kernel = uf.UniformKernel(model.num_states)
    pair = model.generate(torch.tensor(enc[:2]), max_new_tokens=5, num_steps=3, kernel=kernel,
                          generator=torch.Generator().manual_seed(4))
    single = model.generate(torch.tensor(enc[2:]), max_new_tokens=5, num_steps=3, kernel=kernel,
                            generator=torch.Generator().manual_seed(4))
    rows = [pair[0, len(enc[0]):], pair[1, len(enc[1]):], single[0, len(enc[2]):]]
    eos = tokenizer.eos_token_id
    expected = []
    for row in rows:
        ids = row.tolist()
        ids = ids[: ids.index(eos)] if eos in ids else ids
        expected.append(tokenizer.decode(ids, skip_special_tokens=True))
    assert texts == expected


def test_contexts_of_one_question_share_the_random_draws(model, tokenizer):
    # WinoGrande's partial scoring: one context per option, the same continuation, all in one document
    lm = UnifusionLM(model=model, tokenizer=tokenizer, num_times=4, seed=9)
    contexts, answer = ["the cat sat on the", "the dog sat on the"], " mat ."
    requests = [_request(c, answer, doc_id=0, task_name="wino") for c in contexts]
    got = [v for v, _ in lm.loglikelihood(requests)]
    kernel = uf.MaskKernel(model.num_states, model.mask_token_id)
    a = tokenizer(answer, add_special_tokens=False)["input_ids"]
    expected = [-float(score_choices(model, kernel, tokenizer(c, add_special_tokens=False)["input_ids"], [a],
                                     num_times=4, generator=torch.Generator().manual_seed(9))[0]) for c in contexts]
    assert got == pytest.approx(expected, rel=1e-12)
    # two documents with the same context: the scorer's stream continues from one question to the next
    same = [_request(contexts[0], answer, doc_id=d, task_name="t") for d in (0, 1)]
    g = torch.Generator().manual_seed(9)
    c0 = tokenizer(contexts[0], add_special_tokens=False)["input_ids"]
    expected = [-float(score_choices(model, kernel, c0, [a], num_times=4, generator=g)[0]) for _ in same]
    assert [v for v, _ in lm.loglikelihood(same)] == pytest.approx(expected, rel=1e-12)
    assert expected[0] != expected[1]


class _FakeGenerator:
    """Stands in for a torch.Generator on a device this machine lacks (the meta device plays the GPU)."""

    def __init__(self, seed, device):
        self.seed, self.device = seed, torch.device(device)

    def get_state(self):
        return self.seed

    def set_state(self, state):
        self.seed = state


def test_each_generator_is_on_the_device_of_its_draws(tokenizer, monkeypatch):
    """The GPU bug (#16): loglikelihood_rolling put its windows on the model's device and handed nll_bound a CPU
    generator ("Expected a 'cuda' device type for generator"). A model on the meta device stands in for the GPU (the
    scorers and the sampler are spies, so it never runs); every generator must be on the device its draws are made
    on: nll_bound's and the sampler's on the model's, the multiple-choice scorers' on the CPU (they draw there and
    move the rows, which keeps run_multiple_choice's numbers)."""
    import unifusion.eval.harness as harness

    dm = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=2), tokenizer=tokenizer).to("meta")
    monkeypatch.setattr(harness, "_seeded_generator", _FakeGenerator)
    seen = []

    def fake_nll_bound(model, x0, kernel, *, generator, **kwargs):
        seen.append(("nll_bound", x0.device, generator.device))
        return torch.zeros(x0.shape[0], dtype=torch.float64)

    def fake_score_choices(model, kernel, context, choices, *, generator, **kwargs):
        seen.append(("score_choices", torch.device("cpu"), generator.device))
        return torch.zeros(len(choices), dtype=torch.float64)

    def fake_generate(prompt_ids, *, max_new_tokens, generator, **kwargs):
        seen.append(("generate", prompt_ids.device, generator.device))
        return torch.zeros(prompt_ids.shape[0], prompt_ids.shape[1] + max_new_tokens, dtype=torch.long)

    monkeypatch.setattr(harness, "nll_bound", fake_nll_bound)
    monkeypatch.setattr(harness, "score_choices", fake_score_choices)
    monkeypatch.setattr(dm, "generate", fake_generate)
    lm = UnifusionLM(model=dm, tokenizer=tokenizer, max_length=4)
    monkeypatch.setattr(lm, "_is_greedy", lambda *args: False)  # a forward pass: cannot run on meta
    assert lm.loglikelihood_rolling([_request("the cat sat on the mat")]) == [0.0]
    assert lm.loglikelihood([_request("the cat", " sat")]) == [(0.0, False)]
    assert lm.generate_until([_request("the cat", {"until": ["."], "max_gen_toks": 2})]) == [""]
    meta, cpu = torch.device("meta"), torch.device("cpu")
    assert [s[0] for s in seen] == ["nll_bound", "nll_bound", "score_choices", "generate"]  # 2 windows of 4 tokens
    assert [s[1:] for s in seen] == [(meta, meta), (meta, meta), (cpu, cpu), (meta, meta)]


def test_requests_run_in_eval_mode_and_restore_the_training_mode(tokenizer):
    dm = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=2), tokenizer=tokenizer)
    dm.train()
    frozen = next(m for m in dm.modules() if m is not dm)
    frozen.eval()  # a submodule the training script keeps in eval mode stays there
    seen = []
    forward = dm.forward
    dm.forward = lambda *a, **k: seen.append((dm.training, torch.is_grad_enabled())) or forward(*a, **k)
    lm = UnifusionLM(model=dm, tokenizer=tokenizer, num_times=2, nll_times=2, num_steps=2)
    lm.loglikelihood([_request("the cat", " sat")])
    lm.loglikelihood_rolling([_request("the cat sat")])
    lm.generate_until([_request("the cat", {"until": ["."], "max_gen_toks": 2})])
    assert seen and set(seen) == {(False, False)}
    assert dm.training and not frozen.training


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


def test_command_line_writes_results(checkpoint, tmp_path):
    out_dir = tmp_path / "results"
    code = cli_main(["--model_args", f"pretrained={checkpoint},num_times=2,fair_pmi=True", "--tasks",
                     "unifusion_tiny_mc", "--include_path", str(TASKS), "--output_path", str(out_dir), "--limit", "3",
                     "--batch_size", "8", "--device", "cpu"])
    assert code == 0
    (result_file,) = list(out_dir.rglob("results*.json"))
    result = json.loads(result_file.read_text())
    assert 0.0 <= result["results"]["unifusion_tiny_mc"]["acc,none"] <= 1.0
    assert result["config"]["model"] == "unifusion"  # the default --model
    assert result["config"]["model_args"]["fair_pmi"] is True  # parsed from the string "True"
    assert result["n-samples"]["unifusion_tiny_mc"]["effective"] == 3


def test_command_line_help_and_bad_options(capsys):
    assert cli_main(["--help"]) == 0
    assert "--model_args" in capsys.readouterr().out  # the options of a run, not the list of subcommands
    assert cli_main(["--tasks", "x", "--no_such_option", "1"]) == 2
    assert "--no_such_option" in capsys.readouterr().err


def test_unifusion_harness_hands_its_arguments_to_cli_main(monkeypatch):
    import unifusion.eval.harness as harness
    from unifusion.cli import main

    seen = []
    monkeypatch.setattr(harness, "cli_main", lambda argv: seen.append(argv) or 0)
    argv = ["--model_args", "pretrained=DIR", "--tasks", "t", "--limit", "2"]
    assert main(["harness", *argv]) == 0
    assert seen == [argv]


def test_bad_model_args_name_the_argument(model, tokenizer, checkpoint):
    with pytest.raises(ValueError, match="give exactly one of pretrained"):
        UnifusionLM(tokenizer=tokenizer)
    with pytest.raises(TypeError, match="model: expected a unifusion DiffusionLM"):
        UnifusionLM(model=torch.nn.Linear(2, 2), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="method: expected one of"):
        UnifusionLM(model=model, tokenizer=tokenizer, method="bogus")
    with pytest.raises(ValueError, match="fair_pmi: expected true or false"):
        UnifusionLM(model=model, tokenizer=tokenizer, fair_pmi="maybe")
    with pytest.raises(ValueError, match="fair_pmi: .* contradicts method"):
        UnifusionLM(model=model, tokenizer=tokenizer, fair_pmi=True, method="score")
    with pytest.raises(ValueError, match="num_times: expected an integer"):
        UnifusionLM(model=model, tokenizer=tokenizer, num_times="many")
    with pytest.raises(ValueError, match="num_steps: expected an integer >= 1"):
        UnifusionLM(model=model, tokenizer=tokenizer, num_steps=0)
    with pytest.raises(TypeError, match="unknown argument"):
        UnifusionLM.create_from_arg_string(f"pretrained={checkpoint},num_tims=3")
    with pytest.raises(ValueError, match="kernel: expected 'mask', 'uniform'"):
        UnifusionLM(model=model, tokenizer=tokenizer, kernel="gaussian")
    with pytest.raises(ValueError, match="tokenizer: no tokenizer found"):
        UnifusionLM(model=model, tokenizer=str(checkpoint / "nowhere"))
    with pytest.raises(ValueError, match="continuation: ''"):
        UnifusionLM(model=model, tokenizer=tokenizer).loglikelihood([_request("the cat", "")])


def test_model_args_from_strings_and_defaults(model, tokenizer, checkpoint):
    lm = UnifusionLM.create_from_arg_string(
        f"pretrained={checkpoint},num_times=3,kernel=uniform,seed=2,fair_pmi=False,temperature=0.5,top_p=0.9",
        {"batch_size": "auto", "device": "cpu"})
    assert (lm.num_times, lm.seed, type(lm.kernel).__name__, lm.batch_size_per_forward) == (3, 2, "UniformKernel", 64)
    assert (lm.method, lm.temperature, lm.top_p, lm.num_steps) == ("score", 0.5, 0.9, 64)
    lm = UnifusionLM(model=model, tokenizer=tokenizer, fair_pmi="true")
    assert (lm.method, lm.num_times, type(lm.kernel).__name__) == ("fair_pmi", 128, "MaskKernel")
    assert UnifusionLM(model=model, tokenizer=tokenizer).num_times == 32  # the paper's grid
    no_mask = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=1), add_mask_token=False)
    assert isinstance(UnifusionLM(model=no_mask, tokenizer=tokenizer).kernel, uf.UniformKernel)
    with pytest.raises(ValueError, match="kernel: 'mask' needs a model with a mask token"):
        UnifusionLM(model=no_mask, tokenizer=tokenizer, kernel="mask")
