"""Cost of the x0-head losses against F.cross_entropy on the same logits (forward + backward).

    python benchmarks/loss_cost.py [--n 2048] [--v 49152] [--dtype float32|bfloat16] [--reps 5] [--cold]

Time: best of ``--reps`` interleaved runs in this process. Memory: peak RSS increase of one run in a fresh process
per variant (benchmarks/_memory.py), after a warm-up call on small inputs that compiles the fast losses
(``--cold``: without it, so the one-off memory of compiling counts too). 2 threads (torch.set_num_threads(2)),
validation off for every variant. Baseline: ``F.cross_entropy(logits, x0, reduction="none").sum().backward()``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _memory  # noqa: E402

import unifusion as uf  # noqa: E402
from unifusion.losses import fast, native  # noqa: E402

VARIANTS = ["cross_entropy", "fast_uniform", "fast_mask", "fast_hybrid", "fast_uniform_dynamic",
            "native_uniform"]


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--v", type=int, default=49152)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cold", action="store_true", help="count the one-off memory of compiling (no warm-up)")
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    uf.set_validation(False)
    dtype = getattr(torch, args.dtype)
    if args.child is not None and not args.cold:  # compile on small inputs, below the peak the real inputs set
        make_variant(args.child, *make_inputs(16, 1024, dtype))()
    logits, x0, t, g = make_inputs(args.n, args.v, dtype)
    if args.child is not None:
        run = make_variant(args.child, logits, x0, t, g)
        _memory.baseline()
        run()
        _memory.report()
        return
    names = args.variants.split(",")
    # memory first: a child inherits the parent's ru_maxrss at fork, so the parent must still be small
    child_args = ["--n", str(args.n), "--v", str(args.v), "--dtype", args.dtype] + (["--cold"] if args.cold else [])
    mem = {name: _memory.measure(os.path.abspath(__file__), name, *child_args) for name in names}
    runs = {name: make_variant(name, logits, x0, t, g) for name in names}
    _memory.time_and_print(runs, mem, "cross_entropy", args.reps,
                           f"N={args.n} V={args.v} dtype={args.dtype} threads=2 reps={args.reps} (time: best of reps; "
                           f"memory: peak RSS increase, own process, {'cold' if args.cold else 'after a warm-up'})",
                           warmup=True)

if __name__ == "__main__":
    main()
