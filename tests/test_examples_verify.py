"""Runs examples/verify_identities.py (the paper's App. B table) with a few instances (its ``main``, in this
process)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_verify_identities_script_passes_and_prints_the_table() -> None:
    spec = importlib.util.spec_from_file_location("_example_verify_identities",
                                                  ROOT / "examples" / "verify_identities.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert module.main(["--instances", "3", "--seed", "1"]) == 0
    out = printed.getvalue()
    for row in ("Formula values", "Formula gradients", "Formula optima", "Checkpoint-style rates",
                "Checkpoint-style loss", "ELBO bound margin", "Kolmogorov"):
        assert row in out
        line = next(line for line in out.splitlines() if line.startswith(row))
        assert line.rstrip().endswith("ok"), line
    assert "FAIL" not in out
