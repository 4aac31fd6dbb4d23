"""What the lm-evaluation-harness tests share: the repository's tiny task configs and the fixtures they run under
(tests/eval/conftest.py)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TASKS = DATA / "harness"
ALL_TASKS = ["unifusion_tiny_mc", "unifusion_tiny_rolling", "unifusion_tiny_gen"]
