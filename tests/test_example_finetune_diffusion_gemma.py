"""CPU smoke runs of examples/finetune_diffusion_gemma.py on a tiny random DiffusionGemma (a subprocess each): the
diffusion loss through ``diffusion_loss(prompt_mask=)``, and the fused loss with self-conditioning, the encoder's AR
loss, router freezing and the clipped weighting; the saved folder reloads through the registry."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import unifusion as uf

pytest.importorskip("transformers")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "finetune_diffusion_gemma.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
STEP = re.compile(r"^step\s+(\d+) \| loss (\S+) \| grad_norm (\S+)", re.M)


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300,
                          env=ENV)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def test_help():
    assert "DiffusionGemma" in _run("--help")


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
