"""``unifusion harness --model_args pretrained=DIR`` on a saved tiny DiffusionGemma, offline: the folder loads through
the registry, loglikelihood is the conditional bound (the library's ``nll_bound`` of ``conditioned_on`` with the
request's seed), loglikelihood_rolling the bound given BOS, generate_until the model's own sampler."""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import tempfile
from types import SimpleNamespace

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="unifusion-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
    pytest.skip("this transformers has no DiffusionGemma", allow_module_level=True)
from _harness_setup import ALL_TASKS, TASKS  # noqa: E402
from _hf_tiny import tiny_diffusion_gemma  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import unifusion as uf  # noqa: E402
from unifusion.eval import nll_bound  # noqa: E402
from unifusion.eval.harness import UnifusionLM, cli_main, request_seed  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "harness_root")


@pytest.fixture(scope="module")
def checkpoint(tokenizer, tmp_path_factory):
    """A random DiffusionGemma (canvas 4) with the tiny tokenizer's special ids, saved by the wrapper."""
    hf = tiny_diffusion_gemma(4, 0, len(tokenizer), max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = uf.hf.wrap_diffusion_lm(hf, tokenizer=tokenizer)
    path = tmp_path_factory.mktemp("gemma_harness") / "model"
    model.save_pretrained(path)
    return path


def test_the_checkpoint_loads_through_the_registry(checkpoint, tokenizer):
    assert uf.hf.registry.registered_model_type(checkpoint) == "diffusion_gemma"
    model, tok = uf.hf.load_diffusion_model(str(checkpoint))
    assert isinstance(model, uf.hf.DiffusionGemmaLM) and tok is not None and not model.training
    lm = UnifusionLM(pretrained=str(checkpoint), device="cpu")
    assert isinstance(lm.model, uf.hf.DiffusionGemmaLM) and lm.conditional and lm.max_length == 63
    with pytest.raises(ValueError, match="method"):
        UnifusionLM(pretrained=str(checkpoint), device="cpu", method="fair_pmi")


def test_saved_checkpoint_runs_the_three_request_types(checkpoint):
    out = lm_eval.simple_evaluate(
        model="unifusion", tasks=ALL_TASKS, task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        model_args=f"pretrained={checkpoint},num_times=2,num_steps=2", device="cpu", batch_size=4,
        verbosity="WARNING")
    res = out["results"]
    assert 0.0 <= res["unifusion_tiny_mc"]["acc,none"] <= 1.0
    assert all(math.isfinite(res["unifusion_tiny_rolling"][k]) and res["unifusion_tiny_rolling"][k] > 0
               for k in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"))
    assert 0.0 <= res["unifusion_tiny_gen"]["exact_match,none"] <= 1.0


def test_loglikelihood_is_the_conditional_bound(checkpoint, tokenizer):
    lm = UnifusionLM(pretrained=str(checkpoint), device="cpu", num_times=3)
    context, continuation = "the animal is cat", " dog"
    (value, greedy), = lm.loglikelihood([SimpleNamespace(args=(context, continuation))])
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    answer = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    x0 = torch.tensor([[tokenizer.bos_token_id, *ids, *answer]])
    g = torch.Generator().manual_seed(request_seed(0, "loglikelihood", [[context, continuation]]))
    bound = nll_bound(lm.model.conditioned_on(x0, prompt_length=len(ids) + 1), x0, lm.model.kernel, num_times=3,
                      generator=g, per_token=False)
    assert value == pytest.approx(-float(bound[0]), rel=1e-12) and value < 0 and isinstance(greedy, bool)
    (rolling,) = lm.loglikelihood_rolling([SimpleNamespace(args=("the animal is cat .",))])
    assert math.isfinite(rolling) and rolling < 0


def test_generate_until_is_the_models_generate(checkpoint, tokenizer):
    lm = UnifusionLM(pretrained=str(checkpoint), device="cpu", num_steps=3)
    context = "the animal is cat . what is the animal ? answer :"
    (text,) = lm.generate_until([SimpleNamespace(args=(context, {"until": ["."], "max_gen_toks": 6}))])
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    settings = [6, False, 1.0, 1, None]
    g = torch.Generator().manual_seed(request_seed(0, "generate_until", context, settings, 0))
    prompt = torch.tensor([[tokenizer.bos_token_id, *ids]])
    out = lm.model.generate(prompt, SimpleNamespace(max_new_tokens=6, max_denoising_steps=3), generator=[g])
    new = out[0, prompt.shape[1]:].tolist()
    new = new[: new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new
    expected = tokenizer.decode(new, skip_special_tokens=True)
    assert text == (expected[: expected.index(".")] if "." in expected else expected)


def test_command_line_scores_a_diffusion_gemma_folder(checkpoint, tmp_path):
    out_dir = tmp_path / "results"
    code = cli_main(["--model_args", f"pretrained={checkpoint},num_times=2", "--tasks", "unifusion_tiny_mc",
                     "--include_path", str(TASKS), "--output_path", str(out_dir), "--limit", "2", "--device", "cpu"])
    assert code == 0
    (result_file,) = list(out_dir.rglob("results*.json"))
    assert 0.0 <= json.loads(result_file.read_text())["results"]["unifusion_tiny_mc"]["acc,none"] <= 1.0
