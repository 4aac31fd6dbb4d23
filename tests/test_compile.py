"""The ``"auto"`` backend (unifusion._compile): eager until a configuration repeats with enough work, then compiled
in a background thread and swapped in once ready; compiler failures fall back to eager with one warning."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from _auto_backend import fresh_auto_backend

import unifusion as uf
from unifusion import _compile
from unifusion.losses import fast


@pytest.fixture
def auto(monkeypatch):
    """The ``"auto"`` backend with fresh bookkeeping, a threshold of 100 elements and 2 calls."""
    fresh_auto_backend(monkeypatch, clear_cache=False)
    yield
    _compile.wait_for_compilation()


class _FakeCompiler:
    """Stands in for torch.compile: records what it compiles and which thread runs the compiled copy."""

    def __init__(self, fail: bool = False, gate: threading.Event | None = None) -> None:
        self.compiled: list[str] = []
        self.threads: list[str] = []
        self.fail, self.gate = fail, gate

    def __call__(self, fn, dynamic=None, options=None):
        self.compiled.append(fn.__name__)

        def run(*args):
            self.threads.append(threading.current_thread().name)
            if self.gate is not None:
                self.gate.wait(10)
            if self.fail:
                raise RuntimeError("no C++ compiler")
            return ("compiled", fn(*args))

        return run


def _double(x):
    return x * 2


def _call(x, key=("k",)):
    """One call through the machinery: ('compiled', out) or ('eager', out)."""
    return _compile.run(_double, key, lambda fn: fn(x), lambda: ("eager", _double(x)), work=x.numel(),
                        warmup=lambda fn: fn(x[:2].clone()))


def test_auto_is_the_default_and_small_work_never_compiles(auto, monkeypatch):
    fake = _FakeCompiler()
    monkeypatch.setattr(_compile, "_cache", {})
    monkeypatch.setattr(torch, "compile", fake)
    assert uf.get_backend() == "auto"
    for _ in range(5):
        kind, out = _call(torch.ones(10))  # 10 elements < AUTO_MIN_WORK
        assert kind == "eager" and out.tolist() == [2.0] * 10
    assert _compile.wait_for_compilation(5)
    assert fake.compiled == [] and uf.compile_stats() == {"compiled": 0, "pending": 0, "seconds": 0.0}


def test_auto_compiles_in_the_background_after_repeated_work_and_swaps_in(auto, monkeypatch):
    gate = threading.Event()
    fake = _FakeCompiler(gate=gate)
    monkeypatch.setattr(_compile, "_cache", {})
    monkeypatch.setattr(torch, "compile", fake)
    x = torch.arange(200.0)
    assert _call(x)[0] == "eager"  # first use: counted
    assert _call(x)[0] == "eager"  # second use: compilation starts in a background thread, this call stays eager
    assert uf.compile_stats()["pending"] == 1
    assert _call(x)[0] == "eager"  # the compiler is still busy (held by the gate): the caller does not wait
    gate.set()
    assert _compile.wait_for_compilation(10)
    kind, out = _call(x)
    assert kind == "compiled" and torch.equal(out, x * 2)
    assert fake.compiled == ["_double_0"]
    assert fake.threads[0].startswith("unifusion-compile-")  # the warm-up ran off the caller's thread
    assert fake.threads[-1] == threading.current_thread().name
    stats = uf.compile_stats()
    assert stats["compiled"] == 1 and stats["pending"] == 0 and stats["seconds"] > 0
    assert _call(x, key=("other",))[0] == "eager"  # each configuration counts its own uses


def test_a_background_compiler_failure_warns_once_and_stays_eager(auto, monkeypatch):
    fake = _FakeCompiler(fail=True)
    monkeypatch.setattr(_compile, "_cache", {})
    monkeypatch.setattr(torch, "compile", fake)
    x = torch.arange(200.0)
    _call(x)
    _call(x)
    assert _compile.wait_for_compilation(10)
    with pytest.warns(RuntimeWarning, match="torch.compile failed .*no C\\+\\+ compiler"):
        kind, _ = _call(x)
    assert kind == "eager" and uf.get_backend() == "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _call(x)[0] == "eager"


def test_compiled_backend_compiles_on_first_call_and_eager_never(auto, monkeypatch):
    fake = _FakeCompiler()
    monkeypatch.setattr(_compile, "_cache", {})
    monkeypatch.setattr(torch, "compile", fake)
    uf.set_backend("eager")
    assert _call(torch.arange(200.0))[0] == "eager"
    uf.set_backend("compiled")
    assert _call(torch.ones(3))[0] == "compiled"  # no threshold, in the caller's thread
    assert fake.threads == [threading.current_thread().name]


def test_auto_on_the_real_loss_switches_to_compiled_with_the_same_values(auto):
    """End to end on the fast GIDD loss: after two calls above the threshold the background compilation finishes,
    the next call runs the compiled copy (no recompilation: the warm-up specialised as the real call), same values."""
    S, n = 64, 24
    kernel = uf.MaskKernel(S, S - 1)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, S - 1, (n,), generator=g)
    t = torch.rand(n, generator=g) * 0.9 + 0.05
    x_t = kernel.sample(x0, t, generator=g)
    logits = torch.randn(n, S, generator=g)

    def step():
        L = logits.clone().requires_grad_()
        out = fast.gidd_loss(L, x0, x_t, t, kernel)
        out.sum().backward()
        return out.detach(), L.grad

    eager = [step(), step()]  # both eager; the second starts the background compilation
    assert _compile.wait_for_compilation(600)
    assert uf.compile_stats()["compiled"] >= 1
    torch._dynamo.utils.counters.clear()
    value, grad = step()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # served by the warm-up's compiled graph
    torch.testing.assert_close(value, eager[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, eager[0][1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(eager[1][0], eager[0][0], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ the real default
_RECORD_COMPILES = """
import torch
compiles = []
_compile_fn = torch.compile
def _recording_compile(*args, **kwargs):
    compiles.append(getattr(args[0], "__name__", repr(args[0])) if args else "?")
    return _compile_fn(*args, **kwargs)
torch.compile = _recording_compile
"""

_CHECK_NOTHING_COMPILED = """
import json
import unifusion
from unifusion import _compile
print("RESULT " + json.dumps({"backend": unifusion.get_backend(), "stats": unifusion.compile_stats(),
                              "compiles": compiles, "cache": len(_compile._cache)}))
"""


def _run_fresh(code: str, tmp_path) -> dict:
    """Run ``code`` in a fresh interpreter with the library's own default backend (UNIFUSION_BACKEND unset, unlike
    this test session) and return the RESULT line it printed."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "UNIFUSION_BACKEND"}
    script = tmp_path / "fresh.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def test_auto_is_the_real_default_and_importing_compiles_nothing(tmp_path):
    out = _run_fresh(_RECORD_COMPILES + "import unifusion as uf\n" + _CHECK_NOTHING_COMPILED, tmp_path)
    assert out["backend"] == "auto"
    assert out["stats"] == {"compiled": 0, "pending": 0, "seconds": 0.0}
    assert out["compiles"] == [] and out["cache"] == 0


def _readme_usage_block() -> str:
    """The first ```python block under '## Usage' in README.md."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    usage = text.split("\n## Usage\n", 1)[1].split("\n## ", 1)[0]
    return usage.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_usage_block_runs_as_is_with_the_default_backend_and_compiles_nothing(tmp_path):
    """The README's first example, verbatim, in a fresh process on the default backend: it runs in seconds (no
    compiler stall) and triggers no compilation, neither in the caller's thread nor in the background."""
    import time

    block = _readme_usage_block()
    assert "uf." in block and "backward()" in block  # the block we mean: the Usage example
    start = time.perf_counter()
    out = _run_fresh(_RECORD_COMPILES + block + "\nassert uf.wait_for_compilation(60)\n" + _CHECK_NOTHING_COMPILED,
                     tmp_path)
    seconds = time.perf_counter() - start
    assert out["backend"] == "auto"
    assert out["stats"]["compiled"] == 0 and out["stats"]["pending"] == 0
    assert out["compiles"] == [] and out["cache"] == 0
    assert seconds < 120  # interpreter start + import torch dominate (seconds); a compile would add a minute
