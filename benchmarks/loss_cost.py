"""Cost of the x0-head losses against F.cross_entropy on the same logits (forward + backward).

    python benchmarks/loss_cost.py [--n 2048] [--v 49152] [--dtype float32|bfloat16] [--reps 5] [--cold]
                                   [--backend auto|compiled|eager] [--fresh]

Default mode. Time: best of ``--reps`` interleaved runs in this process. Memory: peak RSS increase of one run in a
fresh process per variant (benchmarks/_memory.py), after a warm-up call on small inputs that compiles the fast losses
(``--cold``: without it, so the one-off memory of compiling counts too). The fast losses run on ``--backend``
(default: the library's ``"auto"``, which compiles calls of at least ``unifusion.backend.AUTO_MIN_LOGITS`` logits,
as the default N = 2048, V = 49,152 is); the header says which implementation each call ran.

``--fresh``: what a new user meets. Every variant runs in its own fresh process on the library's default setting (or
``--backend``), without a warm-up: the first call (which may compile) is reported apart, time is the median of calls
2-4, memory the peak RSS increase of call 2 over the resident size before it (Linux: the peak is reset through
``/proc/self/clear_refs``). Targets (issue 22): at most 1.5× the time and memory of ``F.cross_entropy``.

Both: 2 threads (torch.set_num_threads(2)), validation off for every variant. Baseline:
``F.cross_entropy(logits, x0, reduction="none").sum().backward()``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _memory  # noqa: E402

import unifusion as uf  # noqa: E402
from unifusion import backend  # noqa: E402
from unifusion.losses import fast, native  # noqa: E402

VARIANTS = ["cross_entropy", "fast_uniform", "fast_mask", "fast_hybrid", "fast_uniform_dynamic",
            "native_uniform"]
_FRESH_MARK = "FRESH_JSON "


def _kernel(name: str, V: int):
    if "uniform" in name:
        return uf.UniformKernel(V)
    if "mask" in name:
        return uf.MaskKernel(V, V - 1)
    return uf.HybridKernel(V, V - 1, 0.2)


def make_inputs(N: int, V: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.empty(N, V, dtype=dtype)
    for i in range(0, N, 64):  # in row blocks: no N×V float32 temporary that would raise the baseline peak
        logits[i:i + 64].normal_(0.0, 2.0, generator=g)
    x0 = torch.randint(0, V - 1, (N,), generator=g)
    t = torch.rand(N, generator=g) * 0.98 + 0.01
    return logits, x0, t, g


def make_variant(name: str, logits, x0, t, g):
    V = logits.shape[-1]
    if name == "cross_entropy":
        def run():
            z = logits.detach().requires_grad_()
            F.cross_entropy(z, x0, reduction="none").sum().backward()
        return run
    kernel = _kernel(name, V)
    x_t = kernel.sample(x0, t, generator=g)
    weighting = "dynamic" if name.endswith("dynamic") else "elbo"
    loss_fn = fast.gidd_loss if name.startswith("fast") else native.reference_gidd_loss

    def run():
        z = logits.detach().requires_grad_()
        loss_fn(z, x0, x_t, t, kernel, weighting).sum().backward()
    return run


def _status_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process from /proc/self/status, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def fresh_child(name: str, N: int, V: int, dtype: torch.dtype) -> None:
    """One variant in this (fresh) process: first call, then calls 2-4 timed and call 2's peak memory."""
    logits, x0, t, g = make_inputs(N, V, dtype)
    run = make_variant(name, logits, x0, t, g)
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    with open("/proc/self/clear_refs", "w") as refs:  # reset the peak (VmHWM) to the current RSS
        refs.write("5")
    before = _status_bytes("VmRSS")
    times = []
    for i in range(3):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        if i == 0:
            peak = _status_bytes("VmHWM") - before
    print(_FRESH_MARK + json.dumps({"first_s": first, "steady_s": statistics.median(times), "peak_bytes": peak,
                                    "backend": backend.get_backend(), "compile_stats": backend.compile_stats()}))


def fresh(names: list[str], args: argparse.Namespace) -> None:
    """Each variant in its own fresh process (default setting unless --backend); the ratios to cross-entropy."""
    env = dict(os.environ)
    env.pop("UNIFUSION_BACKEND", None)
    if args.backend is not None:
        env["UNIFUSION_BACKEND"] = args.backend
    rows, failed = {}, {}
    for name in names:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--fresh-child", name, "--n", str(args.n),
                               "--v", str(args.v), "--dtype", args.dtype], env=env, capture_output=True, text=True)
        if proc.returncode != 0:  # a row of its own (the reference loss can run out of memory at this size)
            killed = proc.returncode in (-9, 137)
            failed[name] = "killed (out of memory?)" if killed else f"exit {proc.returncode}: {proc.stderr[-300:]}"
            continue
        line = next(line for line in proc.stdout.splitlines() if line.startswith(_FRESH_MARK))
        rows[name] = json.loads(line[len(_FRESH_MARK):])
    if "cross_entropy" not in rows:
        raise SystemExit(f"cross_entropy (the baseline) failed: {failed.get('cross_entropy')}")
    base = rows["cross_entropy"]
    print(f"N={args.n} V={args.v} dtype={args.dtype} threads=2, a fresh process per variant, setting "
          f"{args.backend or 'default'}; steady: median of calls 2-4; memory: call 2's peak RSS increase")
    print(f"{'variant':24s} {'first s':>8s} {'steady s':>9s} {'x CE':>6s} {'peak MiB':>9s} {'x CE':>6s}  compiled")
    for name, row in rows.items():
        print(f"{name:24s} {row['first_s']:8.3f} {row['steady_s']:9.3f} {row['steady_s'] / base['steady_s']:6.2f} "
              f"{row['peak_bytes'] / 2**20:9.1f} {row['peak_bytes'] / max(base['peak_bytes'], 1):6.2f}  "
              f"{row['compile_stats']['compiled']} in {row['compile_stats']['seconds']:.0f} s")
    for name, why in failed.items():
        print(f"{name:24s} failed: {why}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--v", type=int, default=49152)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--backend", default=None, choices=["auto", "compiled", "eager"],
                    help="how the fast losses run (default: the library's default, 'auto')")
    ap.add_argument("--cold", action="store_true", help="count the one-off memory of compiling (no warm-up)")
    ap.add_argument("--fresh", action="store_true", help="a fresh process per variant, no warm-up (see above)")
    ap.add_argument("--child", default=None)
    ap.add_argument("--fresh-child", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    uf.validation.set_validation(False)
    dtype = getattr(torch, args.dtype)
    if args.fresh_child is not None:
        fresh_child(args.fresh_child, args.n, args.v, dtype)
        return
    names = args.variants.split(",")
    if args.fresh:
        fresh(names, args)
        return
    if args.backend is not None:
        backend.set_backend(args.backend)
    if args.child is not None and not args.cold:  # compile on small inputs, below the peak the real inputs set
        with backend.using("compiled" if backend.runs_compiled(args.n * args.v) else "eager"):
            make_variant(args.child, *make_inputs(16, 1024, dtype))()
    logits, x0, t, g = make_inputs(args.n, args.v, dtype)
    if args.child is not None:
        run = make_variant(args.child, logits, x0, t, g)
        _memory.baseline()
        run()
        _memory.report()
        return
    # memory first: a child inherits the parent's ru_maxrss at fork, so the parent must still be small
    child_args = ["--n", str(args.n), "--v", str(args.v), "--dtype", args.dtype] + (["--cold"] if args.cold else [])
    if args.backend is not None:
        child_args += ["--backend", args.backend]
    mem = {name: _memory.measure(os.path.abspath(__file__), name, *child_args) for name in names}
    runs = {name: make_variant(name, logits, x0, t, g) for name in names}
    ran = "compiled" if backend.runs_compiled(args.n * args.v) else "eager"
    _memory.time_and_print(runs, mem, "cross_entropy", args.reps,
                           f"N={args.n} V={args.v} dtype={args.dtype} threads=2 reps={args.reps} setting "
                           f"{backend.get_backend()} (the fast losses ran {ran}) (time: best of reps; memory: peak "
                           f"RSS increase, own process, {'cold' if args.cold else 'after a warm-up'})", warmup=True)


if __name__ == "__main__":
    main()
