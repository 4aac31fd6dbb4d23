"""The README's test command and CI agree: the command leaves out the ``ci_only`` marker (pyproject's ``addopts``),
and ``.ci/run`` runs the README Quickstart's test command, then the ``ci_only`` tests, failing if either fails."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_command_leaves_out_ci_only_and_ci_runs_it() -> None:
    tomllib = pytest.importorskip("tomllib")
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    args = shlex.split(options["addopts"])
    assert args[args.index("-m") + 1] == "not ci_only"
    assert any(marker.startswith("ci_only:") for marker in options["markers"])
    script = (ROOT / ".ci" / "run").read_text()
    readme_run, ci_only_run = script.index('bash -c "$cmd"'), script.index("python -m pytest -q -m ci_only")
    assert readme_run < ci_only_run and "exit $rc_ci" in script
    # the command .ci/run extracts is the README's test command
    extract = script[script.index("cmd=$("):script.index("\nif [ -z")]
    cmd = subprocess.run(["bash", "-c", f"{extract}\necho \"$cmd\""], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert cmd.endswith("python -m pytest -q") and "pip install -e \".[dev]\"" in cmd, cmd
