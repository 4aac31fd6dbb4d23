"""The package ships ``py.typed``: ``mypy`` (configured in pyproject.toml, no blanket ignores) must agree with it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_config_has_no_blanket_ignores():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["files"] == ["unifusion"]
    assert not config.get("ignore_errors") and not config.get("ignore_missing_imports")
    for override in config.get("overrides", []):
        assert not override.get("ignore_errors"), override
        modules = override["module"] if isinstance(override["module"], list) else [override["module"]]
        assert not any(m.startswith("unifusion") for m in modules), "unifusion's own modules must be checked"


def test_mypy_is_clean(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout
