"""Shared benchmark helpers: peak resident memory of one variant in its own process, timing, the ratio table.

A parent script calls :func:`measure` with its own path and a variant name; the child (the same script run with
``--child VARIANT ...``) builds its inputs, calls :func:`baseline`, runs the variant once and calls :func:`report`.
The reported number is peak RSS (``resource.getrusage(...).ru_maxrss``) after the run minus peak RSS after the
inputs were allocated, so inputs and the interpreter are excluded and each variant starts from a fresh heap.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

_MARK = "PEAK_RSS_JSON "


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


_BASE = {"bytes": 0}


def baseline() -> None:
    """Call in the child once the inputs exist (and nothing else big has been allocated)."""
    _BASE["bytes"] = _peak_bytes()


def report(**extra: object) -> None:
    """Call in the child after the variant ran: prints the peak RSS increase for the parent."""
    print(_MARK + json.dumps({"peak_delta_bytes": _peak_bytes() - _BASE["bytes"], **extra}), flush=True)


def measure(script: str, variant: str, *args: str) -> int | None:
    """Run ``python SCRIPT --child VARIANT ARGS...`` and return its peak RSS increase in bytes (``None`` when the
    child died, e.g. killed for memory)."""
    out = subprocess.run([sys.executable, script, "--child", variant, *args], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"# {variant}: child exited with {out.returncode} (killed for memory?)", file=sys.stderr)
        return None
    for line in out.stdout.splitlines():
        if line.startswith(_MARK):
            return int(json.loads(line[len(_MARK):])["peak_delta_bytes"])
    raise RuntimeError(f"{script} --child {variant}: no measurement in its output:\n{out.stdout}\n{out.stderr}")


def time_calls(fn: Callable[[], object], repeats: int, *, warmup: int = 1,
               reduce: Callable[[list[float]], float] = statistics.median) -> float:
    """``reduce`` (median by default; ``min`` is the estimate least hurt by other jobs) of ``repeats`` timed calls of
    ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return reduce(times)


def time_and_print(runs: dict, mem: dict, baseline: str, reps: int, header: str, *, warmup: bool = False,
                   width: int = 24) -> None:
    """Time each ``runs[name]()`` ``reps`` times, interleaved (best of reps), and print time and peak memory as
    ratios to the ``baseline`` variant measured in the same run."""
    if warmup:
        for run in runs.values():
            run()
    times: dict = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    base_t, base_m = min(times[baseline]), mem[baseline]
    print(header)
    print(f"{'variant':{width}s} {'time s':>8s} {'x CE':>6s} {'peak MiB':>9s} {'x CE':>6s}")
    for name in runs:
        tb, mb = min(times[name]), mem[name]
        mem_cols = f"{mb / 2**20:9.1f} {mb / base_m:6.2f}" if mb is not None and base_m else f"{'n/a':>9s} {'':>6s}"
        print(f"{name:{width}s} {tb:8.3f} {tb / base_t:6.2f} {mem_cols}")
