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
