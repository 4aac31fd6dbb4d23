"""Runs examples/verify_identities.py (the paper's App. B table) in a subprocess with a few instances."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_verify_identities_script_passes_and_prints_the_table() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "verify_identities.py"), "--instances", "3",
                           "--seed", "1"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for row in ("Formula values", "Formula gradients", "Formula optima", "Checkpoint-style rates",
                "Checkpoint-style loss", "ELBO bound margin", "Kolmogorov"):
        assert row in out
        line = next(line for line in out.splitlines() if line.startswith(row))
        assert line.rstrip().endswith("ok"), line
    assert "FAIL" not in out
