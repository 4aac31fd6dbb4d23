"""The documentation site builds in strict mode (broken links, missing pages and docstring errors fail)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mkdocs_build_strict(tmp_path):
    if shutil.which("mkdocs") is None and subprocess.run([sys.executable, "-m", "mkdocs", "--version"],
                                                         capture_output=True).returncode != 0:
        pytest.fail("mkdocs is not installed: `pip install -e .[dev]` installs it")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").exists()
