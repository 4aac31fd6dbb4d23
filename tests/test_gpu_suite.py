"""benchmarks/gpu.py: the dry run exercises every section on the CPU and writes well-formed JSON; without a GPU and
without --dry-run it refuses with status 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"

ROW_KEYS = {
    "loss_vs_cross_entropy": {"backend", "loss", "validation", "N", "V", "best_ms", "median_ms", "peak_mib",
                              "ratio_vs_ce"},
    "fused_vs_alternatives": {"variant", "backend", "validation", "N", "d", "V", "best_ms", "median_ms", "peak_mib",
                              "status", "time_vs_materialised_ce", "time_vs_liger", "memory_vs_cce"},
    "sampling_vs_ar": {"method", "steps", "validation", "best_ms", "median_ms", "peak_mib", "speedup_vs_ar",
                       "per_step_overhead"},
}
MEASURED_KEYS = {"backend_after", "compile_stats", "warnings", "seconds"}  # every row that ran


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="2", UNIFUSION_BACKEND="eager")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=_env(),
                          cwd=ROOT, timeout=timeout)


def _finite_positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path_factory.mktemp("gpu_suite") / "x.json"
    proc = _run("--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_dry_run_header_and_tables(dry_run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    proc, _ = dry_run
    text = proc.stdout
    assert "device:" in text and f"torch {torch.__version__}" in text
    assert "goals:" in text
    for title in ("(a) loss forward+backward", "(b) output head + loss", "(c) App. C.6"):
        assert title in text
    assert "val: argument checks on" in text


def test_dry_run_json_sections(dry_run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    _, data = dry_run
    assert set(data) >= {"device", *ROW_KEYS}
    assert data["device"]["dry_run"] is True and data["device"]["torch"] == torch.__version__
    assert data["device"]["fused_fp32_accumulation"] is None  # CPU builds: float32-operand GEMMs
    for section, keys in ROW_KEYS.items():
        rows = data[section]
        assert isinstance(rows, list) and rows, section
        for row in rows:
            assert keys <= set(row), (section, keys - set(row))
            if row["best_ms"] is not None:
                assert MEASURED_KEYS <= set(row), (section, MEASURED_KEYS - set(row))
                assert row["backend_after"] == "eager" and row["warnings"] == [], row  # the eager dry run
                assert set(row["compile_stats"]) == {"compiled", "seconds"}
    assert data["device"]["seconds"] > 0 and data["device"]["sections"] == ["loss", "fused", "sampling"]


def test_dry_run_loss_rows(dry_run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    rows = dry_run[1]["loss_vs_cross_entropy"]
    assert {r["V"] for r in rows} == {1000, 2000}
    assert {r["loss"] for r in rows} == {"cross_entropy", "gidd_uniform", "gidd_mask"}
    # one row per V with the defaults (validation on): the first kernel, the last backend
    checked = [(r["V"], r["loss"], r["backend"]) for r in rows if r["validation"]]
    assert checked == [(1000, "gidd_uniform", "eager"), (2000, "gidd_uniform", "eager")]
    for r in rows:
        assert r["N"] == 64 and "error" not in r, r
        assert _finite_positive(r["best_ms"]) and _finite_positive(r["median_ms"]), r
        assert r["best_ms"] <= r["median_ms"]
        assert _finite_positive(r["ratio_vs_ce"]), r
        assert r["peak_mib"] is None  # no memory figure on the CPU
    assert all(r["ratio_vs_ce"] == 1.0 for r in rows if r["loss"] == "cross_entropy")


def test_dry_run_fused_rows(dry_run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    every = dry_run[1]["fused_vs_alternatives"]
    rows = {r["variant"]: r for r in every if not r["validation"]}
    assert {"materialised_ce", "materialised_gidd", "fused_gidd", "liger_flce", "cce"} <= set(rows)
    assert [(r["variant"], r["backend"]) for r in every if r["validation"]] == [("fused_gidd", "eager")]
    for r in every:
        if r["variant"] in ("materialised_ce", "materialised_gidd", "fused_gidd"):
            assert r["status"] == "ok" and (r["N"], r["d"], r["V"]) == (64, 32, 2000), r
            assert _finite_positive(r["best_ms"]) and _finite_positive(r["time_vs_materialised_ce"]), r
    for name in ("liger_flce", "cce"):  # need CUDA/Triton: never timed in a dry run
        r = rows[name]
        assert r["status"] in ("not installed", "skipped: needs CUDA"), r
        assert r["best_ms"] is None


def test_dry_run_sampling_rows(dry_run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    rows = dry_run[1]["sampling_vs_ar"]
    ar = [r for r in rows if "AR" in r["method"]]
    fwd = [r for r in rows if "forward" in r["method"]]
    diff = [r for r in rows if r["method"].startswith("BayesianSampler")]
    assert len(ar) == 1 and len(fwd) == 1
    assert [(r["steps"], r["validation"]) for r in diff] == [(2, False), (4, False), (2, True)]
    assert ar[0]["speedup_vs_ar"] == 1.0
    for r in rows:
        assert _finite_positive(r["best_ms"]) and _finite_positive(r["speedup_vs_ar"]), r
    for r in diff:
        assert _finite_positive(r["per_step_overhead"]), r
        # speed-up and overhead agree with the raw times
        assert math.isclose(r["speedup_vs_ar"], ar[0]["best_ms"] / r["best_ms"], rel_tol=1e-9)
        assert math.isclose(r["per_step_overhead"], r["best_ms"] / r["steps"] / fwd[0]["best_ms"], rel_tol=1e-9)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the full run would start")
def test_without_cuda_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "never.json"
    proc = _run("--out", str(out), timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--dry-run" in proc.stderr
    assert not out.exists()


def test_unknown_section_is_an_error() -> None:
    proc = _run("--dry-run", "--sections", "nope", timeout=120)
    assert proc.returncode == 2 and "unknown section" in proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# the compiled backend once, at the smallest size: one loss configuration (measured on the project's 2-core machine:
# ~30 s with Inductor's on-disk cache cold, ~50 s with its precompiled header cold too; the whole compiled dry run of
# every section is ~140 s cold, so it is not run here)


def test_dry_run_compiled_rows_ran_compiled(tmp_path: Path) -> None:
    out = tmp_path / "compiled.json"
    proc = _run("--dry-run", "--dry-run-compiled", "--backends", "compiled", "--sections", "loss",
                "--loss-kernels", "mask", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["loss_vs_cross_entropy"]
    compiled = [r for r in rows if r["backend"] == "compiled"]
    # each V: the mask kernel with validation off, then again with it on (the defaults row)
    assert [(r["V"], r["validation"]) for r in compiled] == [(1000, False), (1000, True), (2000, False), (2000, True)]
    assert all(r["loss"] == "gidd_mask" for r in compiled)
    for r in compiled:
        assert "error" not in r and _finite_positive(r["best_ms"]), r
        assert r["backend_after"] == "compiled", r  # no compiler failure turned the process eager
        assert not any("torch.compile failed" in w for w in r["warnings"]), r


# ---------------------------------------------------------------------------------------------------------------
# the script's machinery, in process


@pytest.fixture(scope="module")
def gpu():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_suite_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_failed_rows_name_the_error_even_without_a_message(gpu) -> None:
    assert gpu._failed(RuntimeError(""))["error"] == "RuntimeError: RuntimeError('')"
    assert gpu._failed(ValueError("\n\nsecond line"))["error"] == "ValueError: second line"
    assert gpu._failed(torch.OutOfMemoryError("CUDA out of memory. Tried"))["error"].startswith("OOM: CUDA out")
    row = gpu._failed(KeyError("x"))
    assert row["best_ms"] is None and row["backend_after"] == gpu.uf.backend.get_backend()


def test_recorder_keeps_going_saves_every_row_and_honours_the_deadline(gpu, tmp_path: Path) -> None:
    results: dict = {}
    saved: list[int] = []
    rec = gpu.Recorder(results, lambda: saved.append(len(results.get("s", []))), deadline=None)
    rows = rec.section("s")

    def boom() -> dict:
        raise RuntimeError("")

    rec.row({"step": 1}, boom)
    rec.row({"step": 2}, lambda: {"best_ms": 1.0, "median_ms": 1.0, "peak_mib": None})
    assert rows[0]["error"] == "RuntimeError: RuntimeError('')" and rows[1]["best_ms"] == 1.0
    assert saved == [1, 2]  # written after each row
    rec.deadline = 0.0  # in the past
    rec.row({"step": 3}, lambda: pytest.fail("a row past the deadline must not run"))
    assert rows[2]["skipped"] == "time budget" and rows[2]["best_ms"] is None


def test_timer_releases_gradients_before_every_call_and_reports_the_backend(gpu) -> None:
    events: list[str] = []
    timer = gpu.Timer(torch.device("cpu"), reps=3, warmup=2)
    res = timer.measure(lambda: events.append("call"), reset=lambda: events.append("reset"))
    assert events == ["reset", "call"] * 5 + ["reset"]  # warm-up and timed calls each start released
    assert res["backend_after"] == gpu.uf.backend.get_backend() and res["warnings"] == []


def test_a_failing_sampling_row_does_not_end_the_section(gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = gpu.parse_args(["--dry-run"])
    cfg.gpt2_overrides = dict(n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=96, bos_token_id=1,
                              eos_token_id=2)
    cfg.seq_len, cfg.steps = 8, [2, 3, 4]
    real = gpu.uf.BayesianSampler

    def sampler(model, kernel, num_steps, **kwargs):
        if num_steps == 3:
            raise RuntimeError("")  # e.g. an OOM inside one configuration
        return real(model, kernel, num_steps=num_steps, **kwargs)

    monkeypatch.setattr(gpu.uf, "BayesianSampler", sampler)
    results: dict = {}
    rec = gpu.Recorder(results, lambda: None, deadline=None)
    gpu.bench_sampling(cfg, torch.device("cpu"), gpu.Timer(torch.device("cpu"), 1, 0), rec)
    rows = results["sampling_vs_ar"]
    steps = {r["steps"]: r for r in rows if r["method"].startswith("BayesianSampler")}
    assert steps[3]["error"] == "RuntimeError: RuntimeError('')" and steps[3]["speedup_vs_ar"] is None
    for n in (2, 4):
        assert _finite_positive(steps[n]["best_ms"]) and _finite_positive(steps[n]["per_step_overhead"])


def test_quick_mode_and_time_budget_options(gpu) -> None:
    quick = gpu.parse_args(["--quick", "--time-budget", "500"])
    full = gpu.parse_args([])
    assert quick.loss_v == [262144] and set(quick.loss_v) < set(full.loss_v)  # the documented quick pass
    assert quick.steps == [16, 64] and set(quick.steps) < set(full.steps) and quick.reps == 3 < full.reps
    assert quick.time_budget == 500.0 and full.time_budget is None
    for bad in (["--time-budget", "0"], ["--loss-kernels", "hybrid"]):
        with pytest.raises(SystemExit):
            gpu.parse_args(bad)


# ---------------------------------------------------------------------------------------------------------------
# the CUDA-only paths, checked without a GPU: torch.cuda's timing and memory calls through a stand-in module, and the
# third-party kernels through stand-ins with their real call signatures (liger-kernel 0.8.5, cut-cross-entropy
# 25.1.1), so argument order and shapes are checked


class FakeCuda:
    """The ``torch.cuda`` functions the suite calls, on a simulated clock and allocator; records the calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.clock_ms = 0.0
        self.allocated = 7 * 2**20  # inputs and weights, live before every call
        self.peak = self.allocated

    # what a measured call does on the simulated device
    def run(self, ms: float, temporary_bytes: int) -> None:
        self.calls.append("fn")
        self.clock_ms += ms
        self.peak = max(self.peak, self.allocated + temporary_bytes)

    # torch.cuda's API
    def synchronize(self, device) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def reset_peak_memory_stats(self, device) -> None:
        self.calls.append("reset_peak")
        self.peak = self.allocated

    def memory_allocated(self, device) -> int:
        self.calls.append("memory_allocated")
        return self.allocated

    def max_memory_allocated(self, device) -> int:
        self.calls.append("max_memory_allocated")
        return self.peak

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802 - torch.cuda's name
        assert enable_timing, "the suite times with events created with enable_timing=True"
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda, self.t = cuda, None

    def record(self) -> None:
        self.cuda.calls.append("record")
        self.t = self.cuda.clock_ms

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.t is not None and end.t is not None, "elapsed_time of an event that was not recorded"
        return end.t - self.t


def test_cuda_timing_and_memory_path_with_a_stand_in_device(gpu) -> None:
    cuda = FakeCuda()
    timer = gpu.Timer(torch.device("cpu"), reps=3, warmup=1, ops=gpu.CudaOps(cuda))
    assert timer.ops.memory_stats
    released: list[int] = []
    res = timer.measure(lambda: cuda.run(2.5, 3 * 2**20), reset=lambda: released.append(1))
    assert res["best_ms"] == res["median_ms"] == 2.5
    assert res["peak_mib"] == 3.0  # the call's own 3 MiB; the 7 MiB live before it are not counted
    # the memory call: released, synchronized, cache emptied, peak reset and "before" read before it runs; the peak
    # read after a synchronize
    first_fn = cuda.calls.index("fn", cuda.calls.index("reset_peak"))
    assert cuda.calls[first_fn - 4:first_fn + 3] == ["synchronize", "empty_cache", "reset_peak", "memory_allocated",
                                                     "fn", "synchronize", "max_memory_allocated"]
    # every timed call: synchronize, record, the call, record, synchronize
    timed = cuda.calls[first_fn + 3:]
    assert timed == ["synchronize", "record", "fn", "record", "synchronize"] * 3
    assert len(released) == 1 + 1 + 3 + 1  # warm-up, memory call, timed calls, and after the last
    # the CPU stand-in runs the same timing code on the host clock, without memory statistics
    cpu = gpu.Timer(torch.device("cpu"), reps=2, warmup=0)
    assert isinstance(cpu.ops, gpu.CpuOps) and not cpu.ops.memory_stats
    res = cpu.measure(lambda: sum(range(1000)))
    assert _finite_positive(res["best_ms"]) and res["peak_mib"] is None
    with pytest.raises(RuntimeError, match="recorded"):
        gpu.HostEvent().elapsed_time(gpu.HostEvent())


def _install_third_party(monkeypatch: pytest.MonkeyPatch, calls: list[tuple], scale: float = 1.0) -> None:
    """Stand-ins for liger_kernel and cut_cross_entropy with the released signatures and the real input checks;
    each computes the float32 cross-entropy of (input @ weight.T) (times ``scale``: a wrong result)."""
    import types

    import torch.nn.functional as F

    class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):  # liger_kernel/transformers/fused_linear_cross_entropy
        def __init__(self, ce_weight=None, ignore_index: int = -100, lse_square_scale: float = 0.0,
                     label_smoothing: float = 0.0, reduction: str = "mean", softcap=None, return_z_loss: bool = False,
                     accum_dtype=None, use_token_scaling: bool = False, return_token_accuracy: bool = False,
                     return_predicted_tokens: bool = False) -> None:
            super().__init__()
            assert reduction in {"mean", "sum", "none"}
            self.reduction = reduction

        def forward(self, lin_weight, _input, target, bias=None):
            BT, H = _input.shape  # (B*T, H) hidden states, (V, H) weight, (B*T,) targets
            assert lin_weight.dim() == 2 and lin_weight.shape[1] == H, (lin_weight.shape, _input.shape)
            assert target.shape == (BT,) and target.dtype == torch.int64, (target.shape, BT)
            assert lin_weight.dtype == _input.dtype
            calls.append(("liger", tuple(lin_weight.shape), tuple(_input.shape), tuple(target.shape)))
            logits = _input.float() @ lin_weight.float().T
            return scale * F.cross_entropy(logits, target, reduction=self.reduction)

    def linear_cross_entropy(e, c, targets, ignore_index: int = -100, softcap=None, reduction: str = "mean",
                             shift: bool = False, filter_eps="high", impl="cce"):  # cut_cross_entropy
        assert e.size()[0:-1] == targets.size(), (e.shape, targets.shape)
        assert e.size(-1) == c.size(1), (e.shape, c.shape)
        calls.append(("cce", tuple(e.shape), tuple(c.shape), tuple(targets.shape)))
        logits = e.flatten(0, -2).float() @ c.float().T
        return scale * F.cross_entropy(logits, targets.flatten(), reduction=reduction)

    liger = types.ModuleType("liger_kernel")
    liger_tf = types.ModuleType("liger_kernel.transformers")
    flce = types.ModuleType("liger_kernel.transformers.fused_linear_cross_entropy")
    flce.LigerFusedLinearCrossEntropyLoss = LigerFusedLinearCrossEntropyLoss
    cce = types.ModuleType("cut_cross_entropy")
    cce.linear_cross_entropy = linear_cross_entropy
    for name, module in (("liger_kernel", liger), ("liger_kernel.transformers", liger_tf),
                         ("liger_kernel.transformers.fused_linear_cross_entropy", flce), ("cut_cross_entropy", cce)):
        monkeypatch.setitem(sys.modules, name, module)


class CountingCuda(FakeCuda):
    """A stand-in device on which the k-th measured row's call peaks at k MiB and takes k ms (distinct, known
    figures per row)."""

    def __init__(self) -> None:
        super().__init__()
        self.k = 0

    def reset_peak_memory_stats(self, device) -> None:
        super().reset_peak_memory_stats(device)
        self.k += 1
        self.peak = self.allocated + self.k * 2**20

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802 - torch.cuda's name
        cuda = self

        class Ticking(FakeEvent):
            def record(self) -> None:
                cuda.clock_ms += cuda.k  # start and end record: k ms apart
                super().record()

        assert enable_timing
        return Ticking(self)


def _fused_rows(gpu, monkeypatch: pytest.MonkeyPatch, ops=None) -> list[dict]:
    cfg = gpu.parse_args(["--dry-run"])
    cfg.fused_n, cfg.fused_d, cfg.fused_v = 24, 16, 300
    results: dict = {}
    rec = gpu.Recorder(results, lambda: None, deadline=None)
    with gpu.uf.validation.validation(False):
        gpu.bench_fused(cfg, torch.device("cpu"), gpu.Timer(torch.device("cpu"), 1, 0, ops=ops), rec)
    return results["fused_vs_alternatives"]


def test_liger_and_cce_wrappers_run_with_their_signatures(gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    _install_third_party(monkeypatch, calls)
    monkeypatch.setattr(gpu, "THIRD_PARTY_DEVICE_TYPES", ("cuda", "cpu"))  # the stand-ins run on the CPU
    cuda = CountingCuda()
    rows = _fused_rows(gpu, monkeypatch, ops=gpu.CudaOps(cuda))
    by = {r["variant"]: r for r in rows if not r["validation"]}
    N, d, V = 24, 16, 300
    # the wrappers passed (weight, input, target) to Liger and (e, c, targets) to CCE: every call had the shapes
    assert {c for c in calls if c[0] == "liger"} == {("liger", (V, d), (N, d), (N,))}
    assert {c for c in calls if c[0] == "cce"} == {("cce", (N, d), (V, d), (N,))}
    for name in ("liger_flce", "cce"):
        r = by[name]
        assert r["status"] == "ok" and "error" not in r, r
        assert _finite_positive(r["best_ms"]) and r["rel_err_vs_ce"] < 1e-5, r
    # the ratios read the right rows: every measured row peaked at a distinct, known amount on the stand-in device
    for r in rows:
        if r["best_ms"] is not None:
            assert r["peak_mib"] == int(r["peak_mib"]) >= 1 and r["best_ms"] == r["peak_mib"], r
            assert math.isclose(r["time_vs_liger"], r["best_ms"] / by["liger_flce"]["best_ms"])
            assert math.isclose(r["memory_vs_cce"], r["peak_mib"] / by["cce"]["peak_mib"])
    assert by["cce"]["memory_vs_cce"] == 1.0 and by["liger_flce"]["time_vs_liger"] == 1.0


def test_a_third_party_loss_that_disagrees_with_cross_entropy_is_an_error_row(gpu, monkeypatch) -> None:
    _install_third_party(monkeypatch, [], scale=1.5)  # e.g. a wrapper that passed the wrong arguments
    monkeypatch.setattr(gpu, "THIRD_PARTY_DEVICE_TYPES", ("cuda", "cpu"))
    by = {r["variant"]: r for r in _fused_rows(gpu, monkeypatch)}
    for name in ("liger_flce", "cce"):
        assert "differs from cross-entropy" in by[name]["error"] and by[name]["best_ms"] is None, by[name]
    assert by["fused_gidd"]["status"] == "ok"  # the section went on


def test_installed_third_party_kernels_are_skipped_off_cuda(gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    _install_third_party(monkeypatch, calls)
    by = {r["variant"]: r for r in _fused_rows(gpu, monkeypatch)}
    assert by["liger_flce"]["status"] == by["cce"]["status"] == "skipped: needs CUDA"
    assert not calls
