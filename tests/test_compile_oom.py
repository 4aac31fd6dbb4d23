"""Out of device memory inside a compiled hot path is not a compiler failure (unifusion._compile): it propagates
like the eager call's would and leaves the backend alone, instead of being served eagerly with the whole process
switched to eager (which hid the OOM and made a benchmark's "compiled" rows run eagerly). A background warm-up that
runs out of memory leaves its configuration eager and compiles it again after AUTO_MIN_CALLS further uses."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from _auto_backend import fresh_auto_backend

import unifusion as uf
from unifusion import _compile

OOM = "CUDA out of memory. Tried to allocate 8.00 GiB"


@pytest.fixture
def auto(monkeypatch):
    """Fresh ``"auto"`` bookkeeping (threshold 100 elements, 2 calls) and a fake compiler whose compiled copies raise
    what ``raises`` holds while it holds something."""
    fresh_auto_backend(monkeypatch)
    raises: list[BaseException] = []
    threads: list[str] = []

    def fake_compile(fn, dynamic=None, options=None):
        def run(*args):
            threads.append(threading.current_thread().name)
            if raises:
                raise raises[0]
            return ("compiled", fn(*args))

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    yield raises, threads
    _compile.wait_for_compilation()


def _double(x):
    return x * 2


def _call(x, eager_calls=None):
    def eager():
        if eager_calls is not None:
            eager_calls.append(1)
        return ("eager", _double(x))

    return _compile.run(_double, ("oom",), lambda fn: fn(x), eager, work=x.numel(),
                        warmup=lambda fn: fn(x[:2].clone()))


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
def test_an_oom_in_the_callers_thread_propagates_and_keeps_the_backend(auto, error):
    raises, _ = auto
    uf.set_backend("compiled")
    x = torch.arange(200.0)
    assert _call(x)[0] == "compiled"
    raises.append(error)
    eager_calls: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "torch.compile failed" warning
        with pytest.raises(RuntimeError) as info:
            _call(x, eager_calls)
    assert info.value is error and _compile._is_oom(info.value)
    assert eager_calls == []  # not rerun eagerly (an eager rerun of a batch that did not fit would hide it)
    assert uf.get_backend() == "compiled"
    raises.clear()
    assert _call(x)[0] == "compiled"  # a smaller batch later still runs compiled


def test_a_compiler_failure_still_falls_back_to_eager(auto):
    raises, _ = auto
    uf.set_backend("compiled")
    raises.append(RuntimeError("no C++ compiler"))
    with pytest.warns(RuntimeWarning, match="torch.compile failed .*no C\\+\\+ compiler"):
        assert _call(torch.arange(200.0))[0] == "eager"
    assert uf.get_backend() == "eager"


def test_an_oom_in_the_background_warmup_keeps_auto_and_compiles_later(auto):
    raises, threads = auto
    x = torch.arange(200.0)
    raises.append(torch.OutOfMemoryError(OOM))
    assert [_call(x)[0] for _ in range(2)] == ["eager", "eager"]  # the second use starts the background warm-up
    assert _compile.wait_for_compilation(10)
    assert threads and threads[0].startswith("unifusion-compile-")  # the warm-up ran, and ran out of memory
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to report: no compiler failure
        assert _call(x)[0] == "eager"
    assert uf.get_backend() == "auto" and _compile._failed == []
    assert uf.compile_stats()["compiled"] == 0
    raises.clear()  # memory is free again: two further uses compile it
    _call(x)
    assert _compile.wait_for_compilation(10)
    assert _call(x)[0] == "compiled" and uf.compile_stats()["compiled"] == 1


def test_is_oom_reads_the_cause_chain():
    assert _compile._is_oom(torch.OutOfMemoryError(OOM))
    assert _compile._is_oom(_wrapped_oom())
    assert not _compile._is_oom(RuntimeError("no C++ compiler"))
    loop = RuntimeError("a")
    loop.__context__ = loop  # a cycle ends the walk
    assert not _compile._is_oom(loop)
