"""``unifusion harness --model_args pretrained=DIR`` on saved tiny LLaDA, Dream, SDAR, LLaDA-MoE, Fast-dLLM v2 and
LLaDA 2 checkpoints (their layout), offline: the folder loads through the registry and the three request types run."""

from __future__ import annotations

import atexit
import math
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="unifusion-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)

import pytest  # noqa: E402

lm_eval = pytest.importorskip("lm_eval")
from _harness_setup import ALL_TASKS, TASKS  # noqa: E402
from _hf_tiny import tiny_native  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from unifusion.eval.harness import UnifusionLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "harness_root")
FIXTURES = Path(__file__).resolve().parents[1] / "hf"


@pytest.fixture(scope="module", params=["llada", "dream", "sdar", "lladamoe", "fast_dllm", "llada2"])
def checkpoint(request, tokenizer, tmp_path_factory):
    """The kind's tiny fixture config at the tiny tokenizer's vocabulary (+ a mask token), random weights, saved with
    the tokenizer by the kind's save_pretrained."""
    kind = request.param
    model = tiny_native(kind, tokenizer)
    cls = type(model)
    path = tmp_path_factory.mktemp(kind) / "model"
    model.save_pretrained(path)
    return cls, path


def test_saved_checkpoint_runs_the_three_request_types(checkpoint):
    cls, path = checkpoint
    lm = UnifusionLM(pretrained=str(path), device="cpu")
    assert type(lm.model) is cls and not lm.model.training
    out = lm_eval.simple_evaluate(
        model="unifusion", tasks=ALL_TASKS, task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        model_args=f"pretrained={path},num_times=2,num_steps=2", device="cpu", batch_size=4, verbosity="WARNING")
    res = out["results"]
    assert 0.0 <= res["unifusion_tiny_mc"]["acc,none"] <= 1.0
    assert all(math.isfinite(res["unifusion_tiny_rolling"][k]) and res["unifusion_tiny_rolling"][k] > 0
               for k in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"))
    assert 0.0 <= res["unifusion_tiny_gen"]["exact_match,none"] <= 1.0
