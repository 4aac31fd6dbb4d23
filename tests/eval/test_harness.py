"""The ``unifusion`` model inside lm-evaluation-harness, offline: local task configs (``tests/data/harness/``, the
``json`` loader over small files) run end to end on a tiny random model — saved checkpoint, live model, the command
line and two processes under torchrun — and the harness's numbers equal the library's: ``run_multiple_choice``,
``score_choices`` / ``fair_pmi_scores`` with each question's seed, ``nll_bound`` and ``DiffusionLM.generate``."""

from __future__ import annotations

import atexit
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
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
from _harness_setup import ALL_TASKS, DATA, ROOT, TASKS  # noqa: E402
from _hf_tiny import tiny_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import unifusion as uf  # noqa: E402
from unifusion.eval import fair_pmi_scores, nll_bound, run_multiple_choice, score_choices  # noqa: E402
from unifusion.eval.harness import MODEL_ARGS, UnifusionLM, cli_main, request_seed  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "harness_root")


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(TASKS), include_defaults=False)  # our three tasks, without indexing lm_eval's


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


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _mask(model):
    return uf.MaskKernel(model.num_states, model.mask_token_id)


def _decoded(tokenizer, model, ids, until=()):
    """What generate_until returns for new ids: mask dropped, cut at EOS, decoded, cut at the first stop string."""
    ids = [i for i in ids if i != model.mask_token_id]
    ids = ids[: ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [text.index(u) for u in until if u in text]
    return text[: min(cuts)] if cuts else text


def _generated(model, tokenizer, kernel, context, *, seed, max_new, num_steps, sampled, temperature=1.0, top_k=None,
               top_p=None, until=(), repeat=0):
    """DiffusionLM.generate on the request alone, with the request's documented seed (request_seed)."""
    ids = _ids(tokenizer, context)
    settings = [max_new, sampled, temperature, top_k, top_p]  # the stop strings only cut the text
    g = torch.Generator().manual_seed(request_seed(seed, "generate_until", context, settings, repeat))
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, num_steps=num_steps, kernel=kernel,
                         temperature=temperature, top_k=top_k, top_p=top_p, generator=g)
    return _decoded(tokenizer, model, out[0, len(ids):].tolist(), until)


def _sorted_samples(out, task):
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def test_the_model_is_registered():
    from lm_eval.api.registry import get_model

    assert get_model("unifusion") is UnifusionLM


def test_missing_lm_eval_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)  # `from lm_eval.api.model import LM` fails
    spec = importlib.util.spec_from_file_location("unifusion.eval._harness_without_lm_eval",
                                                  ROOT / "unifusion" / "eval" / "harness" / "__init__.py")
    assert spec is not None and spec.loader is not None
    with pytest.raises(ImportError, match=r'pip install "unifusion\[eval\]"'):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


# ------------------------------------------------------------------------------------------------ loglikelihood
@pytest.mark.parametrize("method", ["score", "fair_pmi"])
def test_multiple_choice_equals_run_multiple_choice(model, tokenizer, checkpoint, task_manager, method):
    # seeding=task: one generator streamed through the task's questions, as run_multiple_choice does; the rows of
    # all questions are pooled into forwards of 3 rows, which changes no number
    fair = method == "fair_pmi"
    out = _evaluate("unifusion", ["unifusion_tiny_mc"], task_manager,
                    model_args=f"pretrained={checkpoint},fair_pmi={fair},num_times=4,seed=7,seeding=task", batch_size=3)
    ref = run_multiple_choice(DATA / "tiny_task.json", model, _mask(model), tokenizer, method=method, num_times=4,
                              seed=7, batch_size=8, progress=False)
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


@pytest.mark.parametrize("method", ["score", "fair_pmi"])
def test_each_question_draws_from_its_own_seed(model, tokenizer, task_manager, method):
    """seeding=request (the default): a question's scores are score_choices / fair_pmi_scores with the generator
    seeded by request_seed(seed, "loglikelihood", its [context, continuation] pairs), whatever the batch size, the
    questions before it or the tasks evaluated with it."""
    lm = UnifusionLM(model=model, tokenizer=tokenizer, method=method, num_times=4, seed=7, batch_size=5)
    out = _evaluate(lm, ["unifusion_tiny_mc"], task_manager)
    kernel, null = _mask(model), _ids(tokenizer, "Answer:")
    docs = [json.loads(line) for line in (TASKS / "mc.jsonl").read_text().splitlines()]
    got = [[r[0] for r in s["filtered_resps"]] for s in _sorted_samples(out, "unifusion_tiny_mc")]
    for doc, values in zip(docs, got):
        pairs = [[doc["input"], " " + c] for c in doc["choices"]]  # the harness's target delimiter is a space
        g = torch.Generator().manual_seed(request_seed(7, "loglikelihood", pairs))
        choices = [_ids(tokenizer, " " + c) for c in doc["choices"]]
        if method == "score":
            ref = score_choices(model, kernel, _ids(tokenizer, doc["input"]), choices, num_times=4, generator=g)
        else:
            ref = fair_pmi_scores(model, kernel, _ids(tokenizer, doc["input"]), choices, null, num_times=4,
                                  generator=g)
        assert values == pytest.approx((-ref).tolist(), rel=1e-12, abs=1e-12)
    assert got[2] == got[5]  # docs 2 and 5 are the same question: the same numbers
    # another batch size, another task's question first and the questions in reverse: the same numbers
    lm = UnifusionLM(model=model, tokenizer=tokenizer, method=method, num_times=4, seed=7, batch_size=64)
    requests = [_request(doc["input"], " " + c, doc_id=d, task_name="mc") for d, doc in enumerate(docs)
                for c in doc["choices"]]
    reverse = [r for d in reversed(range(len(docs))) for r in requests[3 * d: 3 * d + 3]]
    values = [v for v, _ in lm.loglikelihood([_request("the dog", " ran", doc_id=0, task_name="other"), *reverse])]
    assert [values[1 + 3 * (5 - d): 4 + 3 * (5 - d)] for d in range(len(docs))] == got


def test_contexts_of_one_question_share_the_random_draws(model, tokenizer):
    # WinoGrande's partial scoring: one context per option, the same continuation, all in one document
    contexts, answer = ["the cat sat on the", "the dog sat on the"], " mat ."
    a, kernel = _ids(tokenizer, answer), _mask(model)
    requests = [_request(c, answer, doc_id=0, task_name="wino") for c in contexts]
    for seeding in ("request", "task"):
        lm = UnifusionLM(model=model, tokenizer=tokenizer, num_times=4, seed=9, seeding=seeding)
        seed = request_seed(9, "loglikelihood", [[c, answer] for c in contexts]) if seeding == "request" else 9
        expected = [-float(score_choices(model, kernel, _ids(tokenizer, c), [a], num_times=4,
                                         generator=torch.Generator().manual_seed(seed))[0]) for c in contexts]
        assert [v for v, _ in lm.loglikelihood(requests)] == pytest.approx(expected, rel=1e-12)
    # seeding=task: two documents with the same context continue the task's stream, and a task starts afresh
    lm = UnifusionLM(model=model, tokenizer=tokenizer, num_times=4, seed=9, seeding="task")
    same = [_request(contexts[0], answer, doc_id=d, task_name="t") for d in (0, 1)]
    g = torch.Generator().manual_seed(9)
    expected = [-float(score_choices(model, kernel, _ids(tokenizer, contexts[0]), [a], num_times=4, generator=g)[0])
                for _ in same]
    assert expected[0] != expected[1]
    other = [_request(contexts[0], answer, doc_id=0, task_name="u")]
    assert [v for v, _ in lm.loglikelihood(same + other)] == pytest.approx(expected + expected[:1], rel=1e-12)


def test_loglikelihood_pools_rows_and_is_greedy_matches_one_forward_per_answer(model, tokenizer):
    """The rows of all questions go through the model batch_size at a time (is_greedy's rows too: it was one
    unbatched forward per request); is_greedy equals the slow definition, one forward per answer with the span
    all mask at t = 1 − 10⁻³; check_greedy=False skips those rows and leaves the scores unchanged."""
    docs = [json.loads(line) for line in (TASKS / "mc.jsonl").read_text().splitlines()]
    requests = [_request(doc["input"], " " + c, doc_id=d, task_name="mc") for d, doc in enumerate(docs)
                for c in doc["choices"]]
    calls = []
    forward = model.forward

    def counting(x_t, t, **kwargs):
        calls.append(x_t.shape[0])
        return forward(x_t, t, **kwargs)

    model.forward = counting
    try:
        lm = UnifusionLM(model=model, tokenizer=tokenizer, num_times=4, batch_size=16)
        got = lm.loglikelihood(requests)
        with_greedy = list(calls)
        calls.clear()
        lm = UnifusionLM(model=model, tokenizer=tokenizer, num_times=4, batch_size=16, check_greedy=False)
        plain = lm.loglikelihood(requests)
        without = list(calls)
    finally:
        del model.forward
    lengths: dict[int, int] = {}
    for r in requests:
        n = len(_ids(tokenizer, r.args[0])) + len(_ids(tokenizer, r.args[1]))
        lengths[n] = lengths.get(n, 0) + 4 + 1  # K rows and one is_greedy row per answer
    assert len(with_greedy) == sum(math.ceil(rows / 16) for rows in lengths.values())
    assert len(with_greedy) == 6  # 90 rows of one length; one scorer call plus 3 greedy forwards per question: 24
    assert sum(with_greedy) == 5 * len(requests) and sum(without) == 4 * len(requests)
    assert [v for v, _ in plain] == [v for v, _ in got] and not any(g for _, g in plain)
    t = torch.full((1,), 1.0 - 1e-3)
    for r, (_, greedy) in zip(requests, got):
        c, a = _ids(tokenizer, r.args[0]), _ids(tokenizer, r.args[1])
        logits = model(torch.tensor([c + [model.mask_token_id] * len(a)]), t)[0, len(c):].detach()
        logits[:, model.mask_token_id] = float("-inf")
        assert greedy == bool((logits.argmax(-1) == torch.tensor(a)).all())


def test_is_greedy_reflects_the_models_argmax(tokenizer):
    dm = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=0), tokenizer=tokenizer)
    with torch.no_grad():  # a zero output head: all logits tie and argmax is token 0 (<pad>) at every position
        dm.lm_head_weight.zero_()
        if dm.lm_head_bias is not None:
            dm.lm_head_bias.zero_()
    lm = UnifusionLM(model=dm, tokenizer=tokenizer, num_times=2)
    assert _ids(tokenizer, "<pad><pad>") == [0, 0]
    got = lm.loglikelihood([_request("the cat", "<pad><pad>"), _request("the dog", "<pad> of")])
    assert [g for _, g in got] == [True, False]


def test_loglikelihood_cuts_long_contexts_and_continuations_with_one_warning(model, tokenizer):
    lm = UnifusionLM(model=model, tokenizer=tokenizer, num_times=4, seed=2, max_length=6)
    context, long_answer = "the cat sat on the mat . the dog", " the big dog ran to the river ."
    c, a = _ids(tokenizer, context), _ids(tokenizer, long_answer)
    assert len(c) > 5 and len(a) > 6
    with pytest.warns(UserWarning, match=r"loglikelihood: of 2 requests, 2 contexts were cut from the left and 1 "
                                         r"continuation longer than max_length kept its last 6 tokens to fit "
                                         r"max_length=6 \(the longest cut: \d+ tokens\)") as caught:
        got = lm.loglikelihood([_request(context, " mat"), _request("the cat", long_answer)])
    assert len([w for w in caught if "loglikelihood" in str(w.message)]) == 1  # once per call
    kernel = _mask(model)

    def expected(ctx, ans, content):
        g = torch.Generator().manual_seed(request_seed(2, "loglikelihood", content))
        return -float(score_choices(model, kernel, ctx, [ans], num_times=4, generator=g)[0])

    m = _ids(tokenizer, " mat")
    assert got[0][0] == pytest.approx(expected(c[-(6 - len(m)):], m, [[context, " mat"]]), rel=1e-12)
    assert got[1][0] == pytest.approx(expected([], a[-6:], [["the cat", long_answer]]), rel=1e-12)


# ------------------------------------------------------------------------------------------------ rolling
def test_loglikelihood_rolling_is_the_negative_nll_bound(model, tokenizer, task_manager):
    texts = [json.loads(line)["text"] for line in (TASKS / "rolling.jsonl").read_text().splitlines()]
    kernel = _mask(model)
    lm = UnifusionLM(model=model, tokenizer=tokenizer, nll_times=8, seed=5)
    out = _evaluate(lm, ["unifusion_tiny_rolling"], task_manager)
    metrics = out["results"]["unifusion_tiny_rolling"]
    assert all(math.isfinite(metrics[k]) and metrics[k] > 0 for k in
               ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"))
    got = []
    for s in _sorted_samples(out, "unifusion_tiny_rolling"):
        resp = s["filtered_resps"][0]
        got.append(float(resp[0] if isinstance(resp, (list, tuple)) else resp))

    def bound(text, g):
        ids = torch.tensor(_ids(tokenizer, text)).unsqueeze(0)
        return -float(nll_bound(model, ids, kernel, num_times=8, generator=g, per_token=False))

    # seeding=request: each text its own generator
    assert got == pytest.approx([bound(text, torch.Generator().manual_seed(request_seed(5, "loglikelihood_rolling",
                                                                                        text))) for text in texts],
                                rel=1e-10)
    assert all(v < 0 for v in got)  # a bound on −log p of a whole text is positive
    # seeding=task: one generator through a task's texts in order, seeded afresh at the next task's first text
    g = torch.Generator().manual_seed(5)
    expected = [bound(text, g) for text in texts]
    lm = UnifusionLM(model=model, tokenizer=tokenizer, nll_times=8, seed=5, seeding="task")
    requests = [_request(text, task_name=task) for task in ("a", "b") for text in texts]
    assert lm.loglikelihood_rolling(requests) == pytest.approx(expected + expected, rel=1e-10)


def test_loglikelihood_rolling_windows_long_texts(model, tokenizer):
    text = "the cat sat on the mat . the big dog ran to the river ."
    ids = _ids(tokenizer, text)
    assert len(ids) > 6
    lm = UnifusionLM(model=model, tokenizer=tokenizer, nll_times=4, seed=3, max_length=5)
    (got,) = lm.loglikelihood_rolling([_request(text)])
    g = torch.Generator().manual_seed(request_seed(3, "loglikelihood_rolling", text))
    expected = sum(-float(nll_bound(model, torch.tensor([ids[lo: lo + 5]]), _mask(model), num_times=4, generator=g,
                                    per_token=False)) for lo in range(0, len(ids), 5))
    assert got == pytest.approx(expected, rel=1e-10) and math.isfinite(got)


# ------------------------------------------------------------------------------------------------ generation
def test_generate_until_runs_in_the_harness(model, tokenizer, task_manager):
    lm = UnifusionLM(model=model, tokenizer=tokenizer, num_steps=4, kernel="uniform", seed=1)
    out = _evaluate(lm, ["unifusion_tiny_gen"], task_manager)
    assert 0.0 <= out["results"]["unifusion_tiny_gen"]["exact_match,none"] <= 1.0
    kernel = uf.UniformKernel(model.num_states)
    for sample in out["samples"]["unifusion_tiny_gen"]:
        (text,) = sample["resps"][0]
        assert isinstance(text, str) and "." not in text  # the task's `until: ["."]`
        # the task sets no do_sample / temperature: argmax decoding, max_gen_toks 6, DiffusionLM.generate with top_k=1
        assert text == _generated(model, tokenizer, kernel, sample["arguments"][0][0], seed=1, max_new=6, num_steps=4,
                                  sampled=False, top_k=1, until=["."])


@pytest.mark.parametrize("kernel", ["mask", "uniform"])
def test_generate_until_rows_are_independent_of_their_batch(model, tokenizer, kernel):
    """#16: two identical greedy requests in one batch gave different texts, and a request alone differed from
    the same request in a batch. Every request now draws from its own generator: alone, in a batch, twice, its
    text is DiffusionLM.generate's with the request's seed (sampled: at the task's temperature and top_k)."""
    lm = UnifusionLM(model=model, tokenizer=tokenizer, num_steps=5, kernel=kernel, seed=4, batch_size=8)
    k = lm.kernel
    greedy = {"until": [], "max_gen_toks": 5, "do_sample": False}
    sampled = {"until": [], "max_gen_toks": 5, "do_sample": True, "temperature": 0.7, "top_k": 20}
    contexts = ["the animal is cat .", "the animal is dog .", "the big dog ran"]
    assert len(_ids(tokenizer, contexts[0])) == len(_ids(tokenizer, contexts[1]))  # one batch for these two
    batch = [_request(c, kw) for kw in (greedy, sampled) for c in contexts] + [_request(contexts[0], greedy)]
    texts = lm.generate_until(batch)
    alone = [lm.generate_until([r])[0] for r in batch[:6]]
    assert texts[:6] == alone
    assert texts[6] == texts[0]  # the same greedy request twice: the same text
    for c, text in zip(contexts, texts[:3]):
        assert text == _generated(model, tokenizer, k, c, seed=4, max_new=5, num_steps=5, sampled=False, top_k=1)
    for c, text in zip(contexts, texts[3:6]):
        assert text == _generated(model, tokenizer, k, c, seed=4, max_new=5, num_steps=5, sampled=True,
                                  temperature=0.7, top_k=20)
    assert UnifusionLM(model=model, tokenizer=tokenizer, num_steps=5, kernel=kernel, seed=4,
                       batch_size=1).generate_until(batch) == texts


def test_sampled_repeats_differ_and_greedy_repeats_agree(model, tokenizer):
    lm = UnifusionLM(model=model, tokenizer=tokenizer, num_steps=4, kernel="uniform", seed=6)
    sampled = _request("the animal is", {"until": [], "max_gen_toks": 8, "do_sample": True})
    greedy = _request("the animal is", {"until": [], "max_gen_toks": 8})
    texts = lm.generate_until([sampled] * 3 + [greedy] * 2)  # the harness's `repeats`: one object, several times
    assert len(set(texts[:3])) == 3 and texts[3] == texts[4]
    k = lm.kernel
    for repeat, text in enumerate(texts[:3]):
        assert text == _generated(model, tokenizer, k, "the animal is", seed=6, max_new=8, num_steps=4, sampled=True,
                                  repeat=repeat)


def test_generate_until_truncates_at_the_first_stop_string(model, tokenizer):
    lm = UnifusionLM(model=model, tokenizer=tokenizer, num_steps=4, kernel="uniform", seed=11)
    context = "the animal is cat . what is"
    sample = {"do_sample": True, "max_gen_toks": 12}
    (full,) = lm.generate_until([_request(context, {"until": [], **sample})])
    words = full.split()
    assert len(words) >= 4, full
    stop, other = words[2], words[3]  # both occur in the untruncated text: the first occurrence of either wins
    cut = min(full.index(stop), full.index(other))
    first, again = lm.generate_until([_request(context, {"until": [other, stop], **sample}),
                                      _request(context, {"until": [stop, other], **sample})])
    assert first == again == full[:cut]  # the stop strings are not part of the seed: the same sample, cut
    assert len(first) < len(full)


def test_generation_length_settings_and_prompt_cuts(model, tokenizer):
    lm = UnifusionLM(model=model, tokenizer=tokenizer)
    assert lm.max_length == 127 and lm.model_max_length == 127  # max_position_embeddings 128 − the BOS position
    with pytest.raises(ValueError, match="max_length: 500 exceeds what the model takes: 127"):
        UnifusionLM(model=model, tokenizer=tokenizer, max_length=500)
    lm = UnifusionLM(model=model, tokenizer=tokenizer, max_gen_toks=3, max_length=8, num_steps=2)
    job = lm._generation_job(_request("the cat", {"max_gen_toks": 50}))
    assert job.max_new == 3  # the model's cap
    assert lm._generation_job(_request("the cat", {"max_new_tokens": 2})).max_new == 2  # lm-eval's aliases
    assert lm._generation_job(_request("the cat", {})).max_new == 3  # the harness's 256, capped
    long = "the big dog ran to the river and the red bird sat"
    with pytest.warns(UserWarning, match=r"generate_until: 1 of 2 prompts were cut from the left to fit "
                                         r"max_length=8 .*the longest cut: \d+ tokens"):
        texts = lm.generate_until([_request(long, {"until": []}), _request("the cat", {"until": []})])
    assert len(texts) == 2
    job = lm._generation_job(_request(long, {}))
    assert job.prompt == _ids(tokenizer, long)[-5:]  # 8 − 3 new tokens


def test_unknown_gen_kwargs_warn_once(model, tokenizer):
    lm = UnifusionLM(model=model, tokenizer=tokenizer, num_steps=2)
    requests = [_request(c, {"until": ["."], "max_gen_toks": 2, "num_beams": 4, "repetition_penalty": 1.1})
                for c in ("the cat", "the dog")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm.generate_until(requests)
    messages = [str(w.message) for w in caught if "gen_kwargs" in str(w.message)]
    assert messages == ["generate_until: ignoring gen_kwargs the diffusion sampler has no counterpart for: "
                        "num_beams (2 requests), repetition_penalty (2 requests)"]


def test_progress_bars_follow_disable_tqdm(model, tokenizer, capsys):
    lm = UnifusionLM(model=model, tokenizer=tokenizer, num_times=2, nll_times=2, num_steps=2)
    calls = [("loglikelihood", [_request("the cat", " sat")]), ("loglikelihood_rolling", [_request("the cat")]),
             ("generate_until", [_request("the cat", {"until": ["."], "max_gen_toks": 2})])]
    for name, requests in calls:
        getattr(lm, name)(requests)
        assert f"{name}: 100%" in capsys.readouterr().err, name
        getattr(lm, name)(requests, disable_tqdm=True)
        assert name not in capsys.readouterr().err, name


# ------------------------------------------------------------------------------------------------ chat templates
def test_chat_templates_apply_through_the_tokenizer(model, tokenizer, task_manager):
    chat = AutoTokenizer.from_pretrained(DATA / "tiny_tokenizer")
    chat.chat_template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}answer :{% endif %}")
    lm = UnifusionLM(model=model, tokenizer=chat, num_steps=2, seed=1)
    assert lm.tokenizer_name.endswith("tiny_tokenizer") and "/" not in lm.tokenizer_name
    assert lm.chat_template(True) == chat.chat_template and lm.chat_template(False) is None
    out = _evaluate(lm, ["unifusion_tiny_gen"], task_manager, apply_chat_template=True)
    for sample in out["samples"]["unifusion_tiny_gen"]:
        prompt = sample["arguments"][0][0]
        assert prompt == f"<user> {sample['doc']['input']} answer :"
        (text,) = sample["resps"][0]
        assert text == _generated(model, chat, lm.kernel, prompt, seed=1, max_new=6, num_steps=2, sampled=False,
                                  top_k=1, until=["."])
    plain = UnifusionLM(model=model, tokenizer=tokenizer, num_steps=2)
    with pytest.raises(ValueError, match="apply_chat_template: the tokenizer .* has no chat template"):
        _evaluate(plain, ["unifusion_tiny_gen"], task_manager, apply_chat_template=True)


# ------------------------------------------------------------------------------------------------ devices, modes
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
    estimators, the scorers' draws and the sampler are spies, so it never runs); every generator must be on the
    device its draws are made on: nll_bound's and the sampler's on the model's, the multiple-choice scorers' on the
    CPU (they draw there and move the rows, which keeps run_multiple_choice's numbers)."""
    from unifusion.eval.harness import _generation, _loglikelihood

    dm = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=2), tokenizer=tokenizer).to("meta")
    for module in (_loglikelihood, _generation):
        monkeypatch.setattr(module, "seeded_generator", _FakeGenerator)
    seen = []

    def fake_nll_bound(model, x0, kernel, *, generator, **kwargs):
        seen.append(("nll_bound", x0.device, generator.device))
        return torch.zeros(x0.shape[0], dtype=torch.float64)

    def fake_corrupt(kernel, span, t, generator):
        seen.append(("corrupt", span.device, generator.device))
        return span.expand(t.shape[0], -1), torch.ones(t.shape[0], span.shape[0], dtype=torch.bool)

    def fake_sample(self, prompts, max_new, generators, **kwargs):
        seen.extend(("sample", prompts.device, g.device) for g in generators)
        return torch.zeros(prompts.shape[0], prompts.shape[1] + max_new, dtype=torch.long)

    monkeypatch.setattr(_loglikelihood, "nll_bound", fake_nll_bound)
    monkeypatch.setattr(_loglikelihood, "corrupt_span", fake_corrupt)
    monkeypatch.setattr(_loglikelihood.RowPool, "add", lambda self, block: block.owner.done(
        block.kind, False if block.kind == "greedy" else torch.zeros(block.x_t.shape[0], block.answer_ids.numel())))
    monkeypatch.setattr(UnifusionLM, "_sample", fake_sample)
    lm = UnifusionLM(model=dm, tokenizer=tokenizer, max_length=4, check_greedy=False)
    assert all(g.device == torch.device("cpu") for g in lm._question_generators(None, [["a", "b"]], {}))
    assert lm.loglikelihood_rolling([_request("the cat sat on the mat")]) == [0.0]
    assert lm.loglikelihood([_request("the cat", " sat")]) == [(0.0, False)]
    assert lm.generate_until([_request("the cat", {"until": ["."], "max_gen_toks": 2})]) == [""]
    meta, cpu = torch.device("meta"), torch.device("cpu")
    assert [s[0] for s in seen] == ["nll_bound", "nll_bound", "corrupt", "sample"]  # 2 windows of 4 tokens
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


# ------------------------------------------------------------------------------------------------ entry points
def test_saved_checkpoint_runs_the_three_request_types(checkpoint, task_manager):
    out = _evaluate("unifusion", ALL_TASKS, task_manager, batch_size="auto", device="cpu",
                    model_args=f"pretrained={checkpoint},num_times=2,nll_times=4,num_steps=2,dtype=auto")
    res = out["results"]
    assert 0.0 <= res["unifusion_tiny_mc"]["acc,none"] <= 1.0
    assert all(math.isfinite(res["unifusion_tiny_rolling"][k]) and res["unifusion_tiny_rolling"][k] > 0
               for k in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"))
    assert 0.0 <= res["unifusion_tiny_gen"]["exact_match,none"] <= 1.0
    assert out["config"]["model"] == "unifusion"


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


def test_unifusion_harness_help_explains_the_model_first(capsys):
    from unifusion.cli import main

    assert main(["harness", "--help"]) == 0
    out = capsys.readouterr().out
    preamble, _, harness_help = out.partition("=" * 100)
    assert preamble.startswith("unifusion harness: EleutherAI's lm-evaluation-harness")
    for name, default, meaning in MODEL_ARGS:  # every model argument, its default and meaning, in the preamble
        assert name in preamble and default in preamble and meaning in preamble, name
    assert "usage: unifusion harness --model_args pretrained=DIR" in harness_help
    assert "(default: unifusion;" in harness_help and "Model name (default: hf)" not in harness_help
    assert "--tasks" in harness_help and "--include_path" in harness_help
    assert cli_main(["--tasks", "x", "--no_such_option", "1"]) == 2
    assert "--no_such_option" in capsys.readouterr().err


def test_config_file_model_is_not_overridden(tmp_path, monkeypatch):
    import unifusion.eval.harness as harness

    config = tmp_path / "run.yaml"
    config.write_text("model: hf\ndevice: cpu\ntasks: [x]\n")
    seen = []

    class FakeCLI:
        def parse_args(self):
            seen.append(list(sys.argv))

        def execute(self, args):
            pass

    monkeypatch.setattr("lm_eval._cli.HarnessCLI", FakeCLI)
    assert harness.cli_main(["--config", str(config)]) == 0
    assert "--model" not in seen[0] and "--device" not in seen[0]  # the YAML's model and device stand
    assert harness.cli_main(["--tasks", "x"]) == 0
    assert seen[1][-4:-2] == ["--model", "unifusion"] and seen[1][-2] == "--device"


def test_unifusion_harness_hands_its_arguments_to_cli_main(monkeypatch):
    import unifusion.eval.harness as harness
    from unifusion.cli import main

    seen = []
    monkeypatch.setattr(harness, "cli_main", lambda argv: seen.append(argv) or 0)
    argv = ["--model_args", "pretrained=DIR", "--tasks", "t", "--limit", "2"]
    assert main(["harness", *argv]) == 0
    assert seen == [argv]


# ------------------------------------------------------------------------------------------------ data parallel
@pytest.mark.distributed
@pytest.mark.ci_only  # two interpreters importing lm-eval; the split's rules: test_data_parallel_rejects_... below
def test_two_processes_give_the_single_process_results(checkpoint, task_manager, tmp_path):
    """torchrun --nproc_per_node=2 (gloo, CPU): each process evaluates every other document (5 multiple-choice
    questions: one process gets 3, the other 2 and the evaluator's padding copy of its last request), rank 0
    gathers; every response and metric equals the single-process run's."""
    args = f"pretrained={checkpoint},num_times=2,nll_times=4,num_steps=3,seed=3,device=cpu,batch_size=4"
    single = _evaluate("unifusion", ALL_TASKS, task_manager, model_args=args, limit=5)
    out = tmp_path / "dist.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "harness_dist_worker.py"), args, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dist = json.loads(out.read_text())
    assert dist["world_size"] == 2
    for task in ALL_TASKS:
        expected = [[s["doc_id"], s["filtered_resps"]] for s in _sorted_samples(single, task)]
        assert dist["samples"][task] == json.loads(json.dumps(expected)), task
        for key, value in single["results"][task].items():  # stderr: bootstrapped over the gathered order
            if isinstance(value, float) and "stderr" not in key:
                assert dist["results"][task][key] == pytest.approx(value, rel=1e-12), (task, key)


def test_data_parallel_rejects_what_cannot_be_split(model, tokenizer, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    lm = UnifusionLM(model=model, tokenizer=tokenizer)
    assert (lm.rank, lm.world_size, lm.device) == (1, 2, torch.device("cpu"))
    assert lm.accelerator.gather is not None  # lm-eval 0.4.10-0.4.12 call lm.accelerator.gather
    with pytest.raises(ValueError, match="seeding: 'task' .* with 2 processes use seeding=request"):
        UnifusionLM(model=model, tokenizer=tokenizer, seeding="task")


# ------------------------------------------------------------------------------------------------ arguments
def test_default_kernel_is_the_one_recorded_with_the_model(model, tokenizer, tmp_path):
    """No kernel= argument: the library's one rule (unifusion.hf.default_kernel), so a checkpoint that recorded a
    uniform kernel is evaluated with it although the model has a mask token; kernel= still overrides it."""
    recorded = uf.UniformKernel(model.num_states, uf.schedules.CosineSchedule())
    model.save_pretrained(tmp_path, kernel=recorded)
    assert model.mask_token_id is not None
    lm = UnifusionLM(pretrained=str(tmp_path), device="cpu", num_steps=2, seed=5)
    assert type(lm.kernel) is uf.UniformKernel and type(lm.kernel.schedule) is uf.schedules.CosineSchedule
    assert uf.hf.kernel_config(lm.kernel) == uf.hf.kernel_config(recorded)
    (text,) = lm.generate_until([_request("the cat", {"until": [], "max_gen_toks": 4})])
    assert text == _generated(lm.model, tokenizer, recorded, "the cat", seed=5, max_new=4, num_steps=2,
                              sampled=False, top_k=1)
    assert isinstance(UnifusionLM(pretrained=str(tmp_path), device="cpu", kernel="mask").kernel, uf.MaskKernel)
    live = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=3), tokenizer=tokenizer)
    live.kernel = recorded  # a live model that knows its training kernel
    assert UnifusionLM(model=live, tokenizer=tokenizer).kernel is recorded


def test_kernel_is_checked_against_the_model_at_construction(model, tokenizer):
    with pytest.raises(ValueError, match=r"kernel: mask_id=5 but the model's mask token is \d+"):
        UnifusionLM(model=model, tokenizer=tokenizer, kernel=uf.MaskKernel(model.num_states, 5))
    with pytest.raises(ValueError, match="kernel: has 7 states but the model predicts"):
        UnifusionLM(model=model, tokenizer=tokenizer, kernel=uf.UniformKernel(7))


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
    with pytest.raises(ValueError, match="seeding: expected one of"):
        UnifusionLM(model=model, tokenizer=tokenizer, seeding="global")
    with pytest.raises(ValueError, match="top_p: expected a float in"):
        UnifusionLM(model=model, tokenizer=tokenizer, top_p=1.5)
    with pytest.raises(ValueError, match="temperature: expected > 0"):
        UnifusionLM(model=model, tokenizer=tokenizer, temperature=0)
    with pytest.raises(ValueError, match="check_greedy: expected true or false"):
        UnifusionLM(model=model, tokenizer=tokenizer, check_greedy="sometimes")
    with pytest.raises(TypeError, match="unknown argument"):
        UnifusionLM.create_from_arg_string(f"pretrained={checkpoint},num_tims=3")
    with pytest.raises(ValueError, match="kernel: expected 'mask', 'uniform'"):
        UnifusionLM(model=model, tokenizer=tokenizer, kernel="gaussian")
    with pytest.raises(ValueError, match="tokenizer: no tokenizer found"):
        UnifusionLM(model=model, tokenizer=str(checkpoint / "nowhere"))
    with pytest.raises(ValueError, match="continuation: ''"):
        UnifusionLM(model=model, tokenizer=tokenizer).loglikelihood([_request("the cat", "")])
    with pytest.raises(ValueError, match="top_k: expected an integer >= 0"):
        UnifusionLM(model=model, tokenizer=tokenizer).generate_until([_request("the cat", {"top_k": -1})])


def test_model_args_from_strings_and_defaults(model, tokenizer, checkpoint):
    lm = UnifusionLM.create_from_arg_string(
        f"pretrained={checkpoint},num_times=3,kernel=uniform,seed=2,fair_pmi=False,temperature=0.5,top_p=0.9,"
        "top_k=0,do_sample=True,max_gen_toks=16,check_greedy=false",
        {"batch_size": "auto", "device": "cpu"})
    assert (lm.num_times, lm.seed, type(lm.kernel).__name__, lm.batch_size_per_forward) == (3, 2, "UniformKernel", 64)
    assert (lm.method, lm.temperature, lm.top_p, lm.top_k, lm.num_steps) == ("score", 0.5, 0.9, None, 64)
    assert (lm.do_sample, lm.max_gen_toks, lm.check_greedy, lm.seeding) == (True, 16, False, "request")
    job = lm._generation_job(_request("the cat", {}))  # the task sets nothing: the model's do_sample=True
    assert (job.sampled, job.temperature, job.top_p, job.top_k) == (True, 0.5, 0.9, None)
    job = lm._generation_job(_request("the cat", {"temperature": 0}))  # temperature 0: argmax decoding
    assert (job.sampled, job.temperature, job.top_k, job.top_p) == (False, 1.0, 1, None)
    lm = UnifusionLM(model=model, tokenizer=tokenizer, fair_pmi="true")
    assert (lm.method, lm.num_times, type(lm.kernel).__name__) == ("fair_pmi", 128, "MaskKernel")
    assert UnifusionLM(model=model, tokenizer=tokenizer).num_times == 32  # the paper's grid
    no_mask = uf.adapt_ar_model(tiny_model("llama", vocab_size=len(tokenizer), seed=1), add_mask_token=False)
    assert isinstance(UnifusionLM(model=no_mask, tokenizer=tokenizer).kernel, uf.UniformKernel)
    with pytest.raises(ValueError, match="kernel: 'mask' needs a model with a mask token"):
        UnifusionLM(model=no_mask, tokenizer=tokenizer, kernel="mask")
    assert request_seed(0, "x", "a") == request_seed(0, "x", "a") != request_seed(1, "x", "a")
    assert 0 <= request_seed(0, "x", "a") < 2 ** 63


def test_loglikelihood_of_a_block_model_runs_the_block_layout(model, tokenizer):
    """A block model gets the clean rows [context, answer]; one block (K >= the row length) is the plain model."""
    docs = [json.loads(line) for line in (TASKS / "mc.jsonl").read_text().splitlines()]
    requests = [_request(doc["input"], " " + c, doc_id=d, task_name="mc") for d, doc in enumerate(docs[:2])
                for c in doc["choices"]]
    plain = UnifusionLM(model=model, tokenizer=tokenizer, num_times=4, seed=3).loglikelihood(requests)
    one_block = uf.adapt_ar_model(model.base_model, tokenizer=tokenizer, mask_token_id=model.mask_token_id,
                                  block_size=1000).eval()
    assert UnifusionLM(model=one_block, tokenizer=tokenizer, num_times=4, seed=3).loglikelihood(requests) == plain
    block = uf.adapt_ar_model(model.base_model, tokenizer=tokenizer, mask_token_id=model.mask_token_id,
                              block_size=2).eval()
    seen = []
    forward = block.forward

    def spy(x_t, t, **kwargs):
        seen.append((x_t, kwargs.get("clean")))
        return forward(x_t, t, **kwargs)

    block.forward = spy
    got = UnifusionLM(model=block, tokenizer=tokenizer, num_times=4, seed=3).loglikelihood(requests)
    assert got != plain and all(math.isfinite(v) for v, _ in got)
    for x_t, clean in seen:  # clean rows: the context as in x_t, the answer clean where x_t holds noise
        assert clean is not None and clean.shape == x_t.shape
    c, a = _ids(tokenizer, requests[0].args[0]), _ids(tokenizer, requests[0].args[1])
    assert seen[0][1][0].tolist() == c + a
