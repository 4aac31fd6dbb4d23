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
    "loss_vs_cross_entropy": {"backend", "loss", "N", "V", "best_ms", "median_ms", "peak_mib", "ratio_vs_ce"},
    "fused_vs_alternatives": {"variant", "backend", "N", "d", "V", "best_ms", "median_ms", "peak_mib", "status",
                              "time_vs_materialised_ce", "time_vs_liger", "memory_vs_cce"},
    "sampling_vs_ar": {"method", "steps", "best_ms", "median_ms", "peak_mib", "speedup_vs_ar", "per_step_overhead"},
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
                assert set(row["compile_stats"]) == {"compiled", "pending", "seconds"}
    assert data["device"]["seconds"] > 0 and data["device"]["sections"] == ["loss", "fused", "sampling"]


def test_dry_run_loss_rows(dry_run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    rows = dry_run[1]["loss_vs_cross_entropy"]
    assert {r["V"] for r in rows} == {1000, 2000}
    assert {r["loss"] for r in rows} == {"cross_entropy", "gidd_uniform", "gidd_mask"}
    for r in rows:
        assert r["N"] == 64 and "error" not in r, r
        assert _finite_positive(r["best_ms"]) and _finite_positive(r["median_ms"]), r
        assert r["best_ms"] <= r["median_ms"]
        assert _finite_positive(r["ratio_vs_ce"]), r
        assert r["peak_mib"] is None  # no memory figure on the CPU
    assert all(r["ratio_vs_ce"] == 1.0 for r in rows if r["loss"] == "cross_entropy")


def test_dry_run_fused_rows(dry_run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    rows = {r["variant"]: r for r in dry_run[1]["fused_vs_alternatives"]}
    assert {"materialised_ce", "materialised_gidd", "fused_gidd", "liger_flce", "cce"} <= set(rows)
    for name in ("materialised_ce", "materialised_gidd", "fused_gidd"):
        r = rows[name]
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
    assert [r["steps"] for r in diff] == [2, 4]
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
    assert [r["V"] for r in compiled] == [1000, 2000] and all(r["loss"] == "gidd_mask" for r in compiled)
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
    assert row["best_ms"] is None and row["backend_after"] == gpu.uf.get_backend()


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
    assert res["backend_after"] == gpu.uf.get_backend() and res["warnings"] == []


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
