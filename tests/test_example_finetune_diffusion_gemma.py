"""CPU smoke runs of examples/finetune_diffusion_gemma.py on a tiny random DiffusionGemma (its ``main``, in this
process): the diffusion loss through ``diffusion_loss(prompt_mask=)``, and the fused loss with self-conditioning, the
encoder's AR loss, router freezing and the clipped weighting; the saved folder reloads through the registry."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import re
from pathlib import Path

import pytest
import torch

import unifusion as uf

pytest.importorskip("transformers")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "finetune_diffusion_gemma.py"
STEP = re.compile(r"^step\s+(\d+) \| loss (\S+) \| grad_norm (\S+)", re.M)


def _example():
    spec = importlib.util.spec_from_file_location("_example_finetune_diffusion_gemma", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> str:
    """What ``main(args)`` prints (``--help`` exits with 0)."""
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        try:
            assert _example().main(list(args)) == 0
        except SystemExit as exit_:
            assert exit_.code in (0, None), exit_.code
    return printed.getvalue()


def test_help():
    assert "DiffusionGemma" in _run("--help")


@pytest.mark.filterwarnings("ignore:save_pretrained. no tokenizer given")  # the tiny model has none
@pytest.mark.parametrize("flags", [
    [],
    ["--fused", "--self-conditioning", "0.5", "--ar-weight", "0.5", "--freeze-router", "--weighting", "clip"],
])
def test_finetune_runs_and_saves(flags, tmp_path):
    out = _run("--tiny", "--steps", "2", "--dtype", "float32", "--out", str(tmp_path / "m"), *flags)
    steps = STEP.findall(out)
    assert [int(s) for s, _, _ in steps] == [1, 2]
    assert all(math.isfinite(float(v)) and float(v) > 0 and math.isfinite(float(g)) for _, v, g in steps)
    if "--freeze-router" in flags:
        assert "frozen router tensors: 6" in out
    model = uf.hf.registry.load_registered(tmp_path / "m")
    assert isinstance(model, uf.hf.DiffusionGemmaLM) and torch.isfinite(model.lm_head_weight).all()
