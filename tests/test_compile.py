"""unifusion.backend: eager or compiled, chosen from the call's size and the setting only; a configuration compiles
synchronously in the caller's thread on first use, once, with one log record; a compiler failure serves the call
eagerly with one warning, an out-of-memory error propagates. Nothing runs in the background."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import unifusion as uf
from unifusion import _compile, backend
from unifusion.losses import _x0_driver, fast

OOM = "CUDA out of memory. Tried to allocate 8.00 GiB"


class _FakeCompiler:
    """Stands in for torch.compile: records what it compiles and which thread runs the compiled copy; the copy raises
    what ``raises`` holds while it holds something."""

    def __init__(self) -> None:
        self.compiled: list[str] = []
        self.threads: list[str] = []
        self.raises: list[BaseException] = []

    def __call__(self, fn, dynamic=None, fullgraph=None, options=None):
        self.compiled.append(fn.__name__)

        def run(*args):
            self.threads.append(threading.current_thread().name)
            time.sleep(0.01)  # "compiling"
            if self.raises:
                raise self.raises[0]
            return ("compiled", fn(*args))

        return run


@pytest.fixture
def fake(monkeypatch):
    """``"auto"`` with no compiled copies yet, a threshold of 100 logits and a fake torch.compile."""
    monkeypatch.setattr(_compile, "COMPILER", _compile.Compiler("auto"))
    monkeypatch.setattr(_compile, "AUTO_MIN_LOGITS", 100)
    backend.set_backend("auto")
    compiler = _FakeCompiler()
    monkeypatch.setattr(torch, "compile", compiler)
    return compiler


def _double(x):
    return x * 2


def _call(x, key=("k",), eager_calls=None):
    """One call through the machinery: ('compiled', out) or ('eager', out)."""
    def eager():
        if eager_calls is not None:
            eager_calls.append(1)
        return ("eager", _double(x))

    return _compile.run(_double, key, lambda fn: fn(x), eager, num_logits=x.numel(), what=lambda: f"doubling {key}")


def test_the_choice_is_a_function_of_the_setting_and_the_size():
    """"auto" compiles from AUTO_MIN_LOGITS logits per call up: the issue's benchmark call (2048 × 49,152 logits)
    compiles, the README's usage block (128 positions × 1,000 states) does not; "compiled" and "eager" force it."""
    backend.set_backend("auto")
    assert backend.AUTO_MIN_LOGITS == 1 << 24
    assert backend.runs_compiled(2048 * 49_152) and not backend.runs_compiled(128 * 1000)
    assert backend.runs_compiled(1 << 24) and not backend.runs_compiled((1 << 24) - 1)
    with backend.using("compiled"):
        assert backend.get_backend() == "compiled" and backend.runs_compiled(1)
        with backend.using("eager"):
            assert not backend.runs_compiled(1 << 40)
        assert backend.get_backend() == "compiled"
    assert backend.get_backend() == "auto"
    with pytest.raises(ValueError, match="backend"):
        backend.set_backend("triton")
    with pytest.raises(ValueError, match="backend"), backend.using("triton"):  # type: ignore[arg-type]
        pass
    assert backend.get_backend() == "auto"


def test_a_large_call_compiles_in_the_callers_thread_once_and_says_so(fake, caplog):
    """Small calls run eagerly; the first large call of a configuration compiles it in this thread (no counting of
    earlier calls, no background thread), with one log record naming it and its seconds; later calls reuse it."""
    threads_before = set(threading.enumerate())
    with caplog.at_level(logging.INFO, logger="unifusion"):
        for _ in range(3):
            assert _call(torch.ones(10))[0] == "eager"  # 10 logits < 100
        assert fake.compiled == [] and not caplog.records
        kind, out = _call(torch.arange(200.0))
        assert kind == "compiled" and torch.equal(out, torch.arange(200.0) * 2)
        assert fake.compiled == ["_double_0"] and fake.threads == [threading.current_thread().name]
        (record,) = caplog.records
        assert record.name == "unifusion" and record.levelno == logging.WARNING  # shown without any logging set up
        message = record.getMessage()
        assert "compiled doubling ('k',) in" in message and " s (once per configuration" in message
        first = backend.compile_stats()
        assert first["compiled"] == 1 and first["seconds"] >= 0.01
        assert _call(torch.arange(300.0))[0] == "compiled"  # same configuration: no second compilation, no record
        assert _call(torch.ones(10))[0] == "eager"  # a small call stays eager after a large one
        assert len(caplog.records) == 1 and backend.compile_stats() == first
        assert _call(torch.arange(200.0), key=("other",))[0] == "compiled"  # another configuration: its own record
        assert len(caplog.records) == 2 and backend.compile_stats()["compiled"] == 2
    assert set(threading.enumerate()) <= threads_before  # no thread started (another one may have ended meanwhile)
    backend.set_backend("compiled")
    assert _call(torch.ones(3))[0] == "compiled"  # "compiled": any size
    backend.set_backend("eager")
    assert _call(torch.arange(1000.0))[0] == "eager"  # "eager": never


def test_a_compiler_failure_is_remembered_for_its_configuration_only(fake):
    """A failed compilation serves the call eagerly and warns once, naming the configuration and the error; that
    configuration stays eager (no second attempt, no second warning), the setting is unchanged, and another
    configuration still compiles."""
    fake.raises.append(RuntimeError("no C++ compiler"))
    eager_calls: list[int] = []
    with pytest.warns(RuntimeWarning, match="torch.compile failed for doubling \\('k',\\) .*no C\\+\\+ compiler"):
        kind, out = _call(torch.arange(200.0), eager_calls=eager_calls)
    assert kind == "eager" and torch.equal(out, torch.arange(200.0) * 2) and eager_calls == [1]
    assert backend.get_backend() == "auto" and backend.compile_stats()["compiled"] == 0
    assert backend.compile_failures() == {"doubling ('k',)": "RuntimeError: no C++ compiler"}
    fake.raises.clear()  # the compiler works again: only the failed configuration stays eager
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _call(torch.arange(200.0))[0] == "eager"
        assert _call(torch.arange(200.0), key=("other",))[0] == "compiled"
    assert fake.compiled == ["_double_0", "_double_1"] and backend.compile_stats()["compiled"] == 1


def test_the_state_is_held_by_an_explicit_compiler_object(fake):
    """The setting, the compiled copies, the statistics and the failures belong to a ``Compiler`` object; the module's
    functions and unifusion.backend act on the process's one, ``_compile.COMPILER``, and another Compiler shares
    none of it."""
    own = _compile.Compiler("compiled")
    fake.raises.append(RuntimeError("no C++ compiler"))
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert own.run(_double, ("k",), lambda fn: ("compiled", fn(torch.ones(2))), lambda: ("eager", None),
                       num_logits=2, what=lambda: "doubling")[0] == "eager"
    assert set(own.failed.values()) == {("doubling", "RuntimeError: no C++ compiler")}
    fake.raises.clear()
    assert backend.compile_failures() == {} and backend.get_backend() == "auto"  # the process's compiler: untouched
    assert _call(torch.arange(200.0))[0] == "compiled" and backend.compile_stats()["compiled"] == 1
    assert own.stats == {"compiled": 0, "seconds": 0.0} and len(own.copies) == 1 and len(_compile.COMPILER.copies) == 1
    with backend.using("eager"):
        assert _compile.COMPILER.backend == "eager" and own.backend == "compiled"
    with pytest.raises(ValueError, match="backend"):
        _compile.Compiler("triton")


def _wrapped_oom() -> RuntimeError:
    """An OOM as Dynamo/Inductor may re-raise it: another RuntimeError raised from it."""
    try:
        try:
            raise torch.OutOfMemoryError(OOM)
        except torch.OutOfMemoryError as oom:
            raise RuntimeError("backend compiler failed") from oom
    except RuntimeError as err:
        return err


@pytest.mark.parametrize("error", [torch.OutOfMemoryError(OOM), _wrapped_oom()], ids=["oom", "wrapped"])
def test_an_out_of_memory_error_propagates_and_keeps_the_backend(fake, error):
    """Out of device memory inside a compiled call is not a compiler failure: it propagates as the eager call's
    would (no eager rerun, which would hide it) and leaves the setting alone."""
    backend.set_backend("compiled")
    x = torch.arange(200.0)
    assert _call(x)[0] == "compiled"
    fake.raises.append(error)
    eager_calls: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "torch.compile failed" warning
        with pytest.raises(RuntimeError) as info:
            _call(x, eager_calls=eager_calls)
    assert info.value is error and _compile.is_oom(info.value)
    assert eager_calls == [] and backend.get_backend() == "compiled"
    fake.raises.clear()
    assert _call(x)[0] == "compiled"  # a smaller batch later still runs compiled


def test_is_oom_reads_the_cause_chain():
    assert _compile.is_oom(torch.OutOfMemoryError(OOM)) and _compile.is_oom(_wrapped_oom())
    assert not _compile.is_oom(RuntimeError("no C++ compiler"))
    loop = RuntimeError("a")
    loop.__context__ = loop  # a cycle ends the walk
    assert not _compile.is_oom(loop)


def test_auto_on_the_real_loss(monkeypatch):
    """The fast loss under "auto": a call at or above the threshold runs compiled (the shared "hybrid-mid" float32
    configuration of tests/conftest.py), one below it eagerly, both with the eager values (to float32 rounding)."""
    S, n = 40, 24
    kernel = uf.HybridKernel(S, S // 2, 0.3)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, S // 2, (n,), generator=g)
    t = torch.rand(n, generator=g) * 0.9 + 0.05
    x_t = kernel.sample(x0, t, generator=g)
    logits = torch.randn(n, S, generator=g) * 3
    eager_calls: list[int] = []
    eager = _x0_driver._eager
    monkeypatch.setattr(_x0_driver, "_eager", lambda *args: (eager_calls.append(1), eager(*args))[1])

    def step():
        L = logits.clone().requires_grad_()
        out = fast.gidd_loss(L, x0, x_t, t, kernel)
        out.sum().backward()
        return out.detach(), L.grad

    with backend.using("eager"):
        reference = step()
    eager_calls.clear()
    backend.set_backend("auto")
    monkeypatch.setattr(_compile, "AUTO_MIN_LOGITS", n * S + 1)
    small = step()
    assert eager_calls == [1, 1]  # forward and backward, eagerly
    torch.testing.assert_close(small, reference, rtol=0, atol=0)
    monkeypatch.setattr(_compile, "AUTO_MIN_LOGITS", n * S)
    large = step()
    assert eager_calls == [1, 1] and backend.get_backend() == "auto"  # compiled, no fallback
    torch.testing.assert_close(large[0], reference[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(large[1], reference[1], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the real default
_FRESH = """
import threading, time
import torch
compiles = []
_compile_fn = torch.compile
def _recording_compile(*args, **kwargs):
    compiles.append(getattr(args[0], "__name__", repr(args[0])) if args else "?")
    return _compile_fn(*args, **kwargs)
torch.compile = _recording_compile
start = time.perf_counter()
"""

_REPORT = """
import json
import unifusion
from unifusion import backend
print("RESULT " + json.dumps({"backend": backend.get_backend(), "stats": backend.compile_stats(), "compiles": compiles,
                              "threads": [t.name for t in threading.enumerate()],
                              "seconds": time.perf_counter() - start}))
"""


def _readme_usage_block() -> str:
    """The first ```python block under '## Usage' in README.md."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    usage = text.split("\n## Usage\n", 1)[1].split("\n## ", 1)[0]
    return usage.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_usage_block_runs_eagerly_on_the_real_default(tmp_path):
    """The README's first example, verbatim, in a fresh process with the library's own default (UNIFUSION_BACKEND
    unset, unlike this session): "auto", nothing compiled (its calls are small), no thread started, seconds."""
    block = _readme_usage_block()
    assert "uf." in block and "backward()" in block  # the block we mean: the Usage example
    env = {k: v for k, v in os.environ.items() if k != "UNIFUSION_BACKEND"}
    script = tmp_path / "fresh.py"
    script.write_text(_FRESH + block + _REPORT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["backend"] == "auto" and out["compiles"] == [] and out["stats"] == {"compiled": 0, "seconds": 0.0}
    assert out["threads"] == ["MainThread"]
    assert out["seconds"] < 60  # a compilation would add a minute on this machine
    assert "unifusion: compiled" not in proc.stderr  # no compilation record
