"""Test-session defaults.

Most tests run the fused hot paths eagerly: compiling every configuration the suite touches (dtypes, kernel
families, subprocess launchers under torchrun) would add minutes, and the library's default, ``"auto"``, compiles in
background threads whose timing would vary from run to run. ``"auto"`` is tested in tests/test_compile.py; the
compiled backend is exercised explicitly where it matters: tests/test_losses_fast.py and tests/test_samplers.py
run their accuracy tests on both backends, tests/test_fused_linear.py compares them.
``UNIFUSION_BACKEND=compiled python -m pytest`` runs the whole suite compiled.
"""

import os

os.environ.setdefault("UNIFUSION_BACKEND", "eager")
