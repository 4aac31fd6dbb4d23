"""What a new user meets first: latency of first calls in a fresh process with an empty compile cache.

    python benchmarks/first_call.py [--v 49152] [--n 256] [--json out.json]

Every measurement runs in its own fresh Python process whose ``TORCHINDUCTOR_CACHE_DIR`` points at a new, empty
folder (so nothing compiled by an earlier run or by the test suite is reused), with 2 threads.

1. The README's Usage block (extracted from README.md), end to end: interpreter start, ``import torch``, every line.
   Default backend (``"auto"``) against ``UNIFUSION_BACKEND=compiled`` (what 0.1 did: compile on the first call)
   and ``UNIFUSION_BACKEND=eager`` (the floor). Target: ≤ 5 s with the default.
2. The first ``uf.losses.gidd_loss`` forward + backward on ``(n, v)`` float32 logits, uniform kernel, divided by a
   steady-state eager call (the baseline: the median of later calls in a fresh ``UNIFUSION_BACKEND=eager`` process).
   Target: ≤ 2× with the default backend, for a call below ``unifusion.backend.AUTO_MIN_LOGITS`` (the default
   256 × 49,152 is: it runs eagerly); a call above it compiles on its first call, as under ``compiled``. Each
   process reports whether its calls ran compiled, the steady call and ``compile_stats``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GIDD_CHILD = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(2)
import unifusion as uf
from unifusion import backend
from unifusion.losses import gidd_loss

N, V = int(sys.argv[1]), int(sys.argv[2])
g = torch.Generator().manual_seed(0)
kernel = uf.UniformKernel(V)
x0 = torch.randint(0, V, (N,), generator=g)
t = torch.rand(N, generator=g, dtype=torch.float64).clamp(1e-3, 1 - 1e-3).float()
x_t = kernel.sample(x0, t, generator=g)
logits = torch.randn(N, V, generator=g).requires_grad_()

def call():
    logits.grad = None
    start = time.perf_counter()
    gidd_loss(logits, x0, x_t, t, kernel).sum().backward()
    return time.perf_counter() - start

out = {"backend": backend.get_backend(), "runs_compiled": backend.runs_compiled(N * V), "first_s": call(),
       "second_s": call()}
out["steady_s"] = statistics.median(call() for _ in range(3))
out["compile_stats"] = backend.compile_stats()
print("RESULT " + json.dumps(out))
"""


def readme_usage_block() -> str:
    """The first ```python block under the README's "## Usage" heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    usage = text[text.index("## Usage"):]
    match = re.search(r"```python\n(.*?)```", usage, re.S)
    if match is None:
        raise SystemExit("README.md: no ```python block under ## Usage")
    return match.group(1)


def _env(backend: str | None, cache: str) -> dict[str, str]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="2")
    env.pop("UNIFUSION_BACKEND", None)
    if backend is not None:
        env["UNIFUSION_BACKEND"] = backend
    return env


def run_fresh(args: list[str], backend: str | None) -> tuple[float, str]:
    """Wall time and stdout of ``python args`` in a fresh process with an empty Inductor cache."""
    with tempfile.TemporaryDirectory(prefix="inductor-cold-") as cache:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, *args], env=_env(backend, cache), capture_output=True, text=True,
                              cwd=ROOT)
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({backend}):\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--v", type=int, default=49_152, help="vocabulary size of the loss call (default 49152)")
    parser.add_argument("--n", type=int, default=256, help="rows (positions) of the loss call (default 256)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)

    results: dict[str, object] = {"readme_usage_block_s": {}, "gidd_loss": {}}
    code = readme_usage_block()
    print("1. README Usage block, fresh process, empty Inductor cache (wall seconds, end to end)")
    readme: dict[str, float] = {}
    for backend in (None, "compiled", "eager"):
        seconds, _ = run_fresh(["-c", code], backend)
        name = backend or "auto (default)"
        readme[name] = round(seconds, 2)
        print(f"   {name:<16} {seconds:7.2f} s")
    print(f"   default / eager: {readme['auto (default)'] / readme['eager']:.2f}x; target: default <= 5 s "
          f"({'met' if readme['auto (default)'] <= 5 else 'NOT met'})")
    results["readme_usage_block_s"] = readme

    print(f"\n2. first gidd_loss fwd+bwd, N = {args.n}, V = {args.v}, float32, uniform kernel, fresh process")
    gidd: dict[str, dict[str, object]] = {}
    ratios: dict[str, float] = {}
    for backend in ("eager", None, "compiled"):
        _, out = run_fresh(["-c", GIDD_CHILD, str(args.n), str(args.v)], backend)
        row = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        name = backend or "auto (default)"
        gidd[name] = row
        if backend == "eager":
            print(f"   {name:<16} first {row['first_s'] * 1e3:8.0f} ms, steady {row['steady_s'] * 1e3:6.0f} ms "
                  "(the baseline)")
            continue
        ratios[name] = row["first_s"] / float(gidd["eager"]["steady_s"])  # type: ignore[arg-type]
        row["first_over_steady_eager"] = round(ratios[name], 2)
        seconds = row["compile_stats"]["seconds"]  # type: ignore[index]
        extra = (f"; steady {row['steady_s'] * 1e3:.0f} ms, "
                 + (f"compiled ({seconds:.0f} s of compiling in the first call)" if row["runs_compiled"] else "eager"))
        print(f"   {name:<16} first {row['first_s'] * 1e3:8.0f} ms, second {row['second_s'] * 1e3:6.0f} ms -> "
              f"first / steady eager {ratios[name]:.2f}x{extra}")
    met = ratios["auto (default)"] <= 2
    print(f"   target: default first call <= 2x steady eager ({'met' if met else 'NOT met'})")
    results["gidd_loss"] = gidd
    results["settings"] = {"n": args.n, "v": args.v, "threads": 2, "python": sys.version.split()[0]}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
