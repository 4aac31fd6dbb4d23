"""Fused output head + x0-head loss against materialised logits (forward + backward, grads for hidden and W).

    python benchmarks/fused_linear.py [--n 1024] [--d 640] [--v 262144] [--reps 2] [--cold]

Variants: ``materialised_ce`` (baseline: logits = h Wᵀ, F.cross_entropy(reduction="none").sum().backward()),
``materialised_fast`` (logits = h Wᵀ, fast gidd_loss), ``fused`` (fused_linear_diffusion_loss, uniform kernel,
per-position losses, ``.sum().backward()``), ``fused_mask`` (mask kernel), ``fused_padded`` (10 % of the positions
padded, the mask as ``position_weight``, ``.sum() / n``), ``fused_any_grad`` (per-position losses times arbitrary
per-position weights, every position a different incoming gradient: the worst case, corrected position by
position), ``fused_sum`` (``reduction="sum"``). float32, 2 threads, validation off. Time: best of ``--reps``
interleaved runs after a warm-up; memory: peak RSS increase of one run in its own process after a warm-up call on
small inputs (so the one-off memory of compiling is not counted; ``--cold`` counts it).
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
from unifusion.losses import fast  # noqa: E402
from unifusion.losses.fused_linear import fused_linear_diffusion_loss  # noqa: E402

VARIANTS = ["materialised_ce", "materialised_fast", "fused", "fused_mask", "fused_padded", "fused_any_grad",
            "fused_sum"]


def make_inputs(N: int, d: int, V: int):
    g = torch.Generator().manual_seed(0)
    h = torch.empty(N, d).normal_(0.0, 1.0, generator=g)
    W = torch.empty(V, d).normal_(0.0, 0.05, generator=g)
    x0 = torch.randint(0, V - 1, (N,), generator=g)
    t = torch.rand(N, generator=g) * 0.98 + 0.01
    return h, W, x0, t, g


def make_variant(name: str, h, W, x0, t, g):
    V = W.shape[0]
    kernel = uf.MaskKernel(V, V - 1) if name.endswith("mask") else uf.UniformKernel(V)
    x_t = kernel.sample(x0, t, generator=g)

    def leaves():
        return h.detach().requires_grad_(), W.detach().requires_grad_()

    if name == "materialised_ce":
        def run():
            hh, WW = leaves()
            F.cross_entropy(hh @ WW.T, x0, reduction="none").sum().backward()
    elif name == "materialised_fast":
        def run():
            hh, WW = leaves()
            fast.gidd_loss(hh @ WW.T, x0, x_t, t, kernel).sum().backward()
    elif name == "fused_sum":  # reduced inside: gradients in forward, three matmuls per block
        def run():
            hh, WW = leaves()
            fused_linear_diffusion_loss(hh, WW, x0, x_t, t, kernel, reduction="sum").backward()
    elif name == "fused_padded":  # right padding of 10 % of the positions, the mask as position_weight
        mask = (torch.arange(x0.shape[0]) < x0.shape[0] * 9 // 10).float()

        def run():
            hh, WW = leaves()
            fused_linear_diffusion_loss(hh, WW, x0, x_t, t, kernel, position_weight=mask).sum().div(
                mask.sum()).backward()
    elif name == "fused_any_grad":  # a different incoming gradient at every position
        weight = torch.rand(x0.shape[0], generator=g) + 0.5

        def run():
            hh, WW = leaves()
            (fused_linear_diffusion_loss(hh, WW, x0, x_t, t, kernel) * weight).sum().backward()
    else:
        def run():
            hh, WW = leaves()
            fused_linear_diffusion_loss(hh, WW, x0, x_t, t, kernel).sum().backward()
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--d", type=int, default=640)
    ap.add_argument("--v", type=int, default=262144)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cold", action="store_true", help="count the one-off memory of compiling (no warm-up)")
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    uf.validation.set_validation(False)
    if args.child is not None and not args.cold:  # compile on small inputs, below the peak the real inputs set
        make_variant(args.child, *make_inputs(16, args.d, 1024))()
    h, W, x0, t, g = make_inputs(args.n, args.d, args.v)
    if args.child is not None:
        run = make_variant(args.child, h, W, x0, t, g)
        _memory.baseline()
        run()
        _memory.report()
        return
    names = args.variants.split(",")
    # memory first: a child inherits the parent's ru_maxrss at fork, so the parent must still be small
    child_args = ["--n", str(args.n), "--d", str(args.d), "--v", str(args.v)] + (["--cold"] if args.cold else [])
    mem = {name: _memory.measure(os.path.abspath(__file__), name, *child_args) for name in names}
    runs = {name: make_variant(name, h, W, x0, t, g) for name in names}
    _memory.time_and_print(runs, mem, "materialised_ce", args.reps,
                           f"N={args.n} d={args.d} V={args.v} float32 threads=2 reps={args.reps} (time: best of reps; "
                           f"memory: peak RSS increase, own process, {'cold' if args.cold else 'after a warm-up'})",
                           width=20, warmup=True)

if __name__ == "__main__":
    main()
