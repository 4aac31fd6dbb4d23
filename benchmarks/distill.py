"""A distillation step (certainty forcing on a complementary pair) against a ``diffusion_loss`` step, and the memory
of the model-level certainty-forcing path against materialised logits.

    python benchmarks/distill.py [--layers 2] [--batch 4] [--length 128] [--block 8] [--reps 3]
                                 [--mem-vocab 49152 262144] [--mem-batch 2]

**Time** (forward + backward, best of ``--reps`` interleaved runs after a warm-up), on a block model (K = ``--block``)
with SmolLM2-135M's shapes and ``--layers`` layers, float32, V = 49,152, ``B × L`` tokens:

* ``diffusion_loss`` — the baseline: ``uf.diffusion_loss(model, x0, kernel, fused=True).mean().backward()`` (one
  block-causal forward, the fused x0-head loss on every position);
* ``diffusion_loss_unfused`` — the same with materialised logits (``fused=False``, the function's default);
* ``pair_block`` — :func:`unifusion.distill.complementary_pair_loss` of dParallel's view (one active block per row,
  half of it masked) and its complement: two views in one forward of ``2B`` rows, the fused certainty forcing;
* ``pair_all_blocks`` — the pair with every block active (one state per block, the most positions scored: each
  position once over the two views).

**Memory** (the allocator's live peak of one forward + backward above what was live before,
``benchmarks/loss_memory.py``'s :func:`allocator_peak_bytes`, one thread), at each ``--mem-vocab``:

* head: :func:`unifusion.distill.fused_certainty_forcing_loss` on hidden states ``(--mem-rows, --hidden)`` and a
  head ``(V, --hidden)`` (both leaves, half the rows masked, as ``benchmarks/fused_linear.py`` measures the fused
  diffusion loss) against :func:`~unifusion.distill.certainty_forcing_loss` of the materialised ``h Wᵀ``;
* model: :func:`unifusion.distill.view_loss` on the block model, one view with every block active, through the fused
  head (``fused=True``) against materialised logits (``fused=False``: ``model.logits_from_hidden`` on all
  ``B × L`` positions), parameter gradients included (the ``(V, d)`` gradients of the tied embedding, which both
  paths hold, dominate at small ``B × L``); "frozen": the same with the tied embedding and head frozen, as in LoRA
  distillation (:func:`unifusion.distill.add_lora`).

Validation off.

Measured on a loaded 2-core AVX2 CPU (float32, 2 threads; time best of 3, other jobs running):

* time, B × L = 4 × 128: ``diffusion_loss`` 7.75 s; ``diffusion_loss_unfused`` 1.11×; ``pair_block`` 0.89×;
  ``pair_all_blocks`` 1.57× (target ≤ 2.2×).
* memory, head (512 × 576 hidden): fused / materialised 0.29 at V = 49,152, 0.19 at V = 262,144. Model, B × L =
  2 × 128: 0.61 and 0.62 with the tied embedding trained (its two ``(V, d)`` gradients, held by both paths, are most
  of the fused path's 244 / 1,180 MiB), 0.31 and 0.09 with it frozen; B × L = 8 × 128 at V = 49,152: 0.28 trained,
  0.21 frozen (target ≤ 0.5).

On a quiet 2-core AVX512 Xeon (2026-11-30, float32, 2 threads): ``diffusion_loss`` 0.634 s; ``diffusion_loss_unfused``
1.02×; ``pair_block`` 0.97×; ``pair_all_blocks`` 1.86× (target ≤ 2.2×); the memory ratios the same as above.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_memory import allocator_peak_bytes, smollm2_shaped  # noqa: E402

import unifusion as uf  # noqa: E402
from unifusion.distill import (  # noqa: E402
    DistillMask,
    certainty_forcing_loss,
    complementary_pair_loss,
    fused_certainty_forcing_loss,
    random_block_mask,
    view_loss,
)

MASK_ID = 0


def block_model(layers: int, vocab: int, block: int) -> uf.DiffusionLM:
    base = smollm2_shaped(layers, vocab_size=vocab)
    return uf.adapt_ar_model(base, mask_token_id=MASK_ID, block_size=block)


def tokens(B: int, L: int, V: int) -> torch.Tensor:
    return torch.randint(1, V, (B, L), generator=torch.Generator().manual_seed(0))


def views(B: int, L: int, block: int) -> tuple[DistillMask, DistillMask]:
    """dParallel's view (one active block per row, ratio 0.5) and the every-block view."""
    g = torch.Generator().manual_seed(1)
    completion = torch.ones(B, L, dtype=torch.bool)
    one = random_block_mask(completion, 0.5, block_size=block, generator=g)
    masked = torch.rand(B, L, generator=g) < 0.5
    return one, DistillMask(masked=masked, active=completion)


def time_steps(args: argparse.Namespace) -> None:
    V = 49152
    model = block_model(args.layers, V, args.block)
    B, L = args.batch, args.length
    x0 = tokens(B, L, V)
    kernel = uf.MaskKernel(V, MASK_ID)
    one, every = views(B, L, args.block)
    g = torch.Generator().manual_seed(2)

    def step(loss_fn):
        def run():
            model.zero_grad(set_to_none=True)
            loss_fn().backward()
        return run

    runs = {
        "diffusion_loss": step(lambda: uf.diffusion_loss(model, x0, kernel, fused=True, generator=g).mean()),
        "diffusion_loss_unfused": step(lambda: uf.diffusion_loss(model, x0, kernel, generator=g).mean()),
        "pair_block": step(lambda: complementary_pair_loss(model, x0, one)),
        "pair_all_blocks": step(lambda: complementary_pair_loss(model, x0, every)),
    }
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    base = min(times["diffusion_loss"])
    print(f"# time: SmolLM2-shaped block model, {args.layers} layers, V = {V}, K = {args.block}, B x L = {B} x {L}, "
          f"float32, {torch.get_num_threads()} threads, best of {args.reps}")
    print(f"{'variant':<24} {'seconds':>9} {'x diffusion_loss':>17}")
    for name, ts in times.items():
        print(f"{name:<24} {min(ts):>9.3f} {min(ts) / base:>17.2f}")


def _peak(model: uf.DiffusionLM, x0: torch.Tensor, masked: torch.Tensor, fused: bool) -> int:
    """Live peak of one forward + backward of :func:`view_loss`, parameter gradients included (cleared before)."""
    def run() -> None:
        view_loss(model, x0, masked, fused=fused).backward()

    run()  # warm-up
    model.zero_grad(set_to_none=True)
    return allocator_peak_bytes(run)


def head_peaks(N: int, d: int, V: int) -> tuple[int, int]:
    """Live peaks of forward + backward of the loss on hidden states ``(N, d)`` and a head ``(V, d)`` (both leaves,
    half of the rows masked): through the fused head, and on materialised logits ``h Wᵀ``."""
    g = torch.Generator().manual_seed(3)
    h = torch.empty(N, d).normal_(0.0, 1.0, generator=g)
    W = torch.empty(V, d).normal_(0.0, 0.05, generator=g)
    y = torch.randint(1, V, (N,), generator=g)
    masked = torch.rand(N, generator=g) < 0.5

    def fused() -> None:
        hh, WW = h.detach().requires_grad_(), W.detach().requires_grad_()
        fused_certainty_forcing_loss(hh, WW, y, masked, mask_id=MASK_ID).backward()

    def materialised() -> None:
        hh, WW = h.detach().requires_grad_(), W.detach().requires_grad_()
        certainty_forcing_loss(hh @ WW.T, y, masked, mask_id=MASK_ID).backward()

    fused()
    materialised()
    return allocator_peak_bytes(fused), allocator_peak_bytes(materialised)


def memory(args: argparse.Namespace) -> None:
    print(f"# memory: allocator live peak of one forward + backward (MiB); head: hidden ({args.mem_rows}, "
          f"{args.hidden}) and W (V, {args.hidden}) as leaves, half the rows masked; model: view_loss on the block "
          f"model ({args.layers} layers), every block active, B x L = {args.mem_batch} x {args.length}")
    print(f"{'V':>8} {'head fused':>11} {'head mat.':>10} {'ratio':>6} {'model fused':>12} {'model mat.':>11} "
          f"{'ratio':>6} {'frozen fused':>13} {'frozen mat.':>12} {'ratio':>6}")
    mib = 2 ** 20
    for V in args.mem_vocab:
        hf, hm = head_peaks(args.mem_rows, args.hidden, V)
        model = block_model(args.layers, V, args.block)
        x0 = tokens(args.mem_batch, args.length, V)
        _, every = views(args.mem_batch, args.length, args.block)
        mf, mm = (_peak(model, x0, every.masked, fused) for fused in (True, False))
        model.lm_head_weight.requires_grad_(False)  # the tied embedding and head frozen (LoRA-style distillation)
        ff, fm = (_peak(model, x0, every.masked, fused) for fused in (True, False))
        del model
        print(f"{V:>8} {hf / mib:>11.1f} {hm / mib:>10.1f} {hf / hm:>6.2f} {mf / mib:>12.1f} {mm / mib:>11.1f} "
              f"{mf / mm:>6.2f} {ff / mib:>13.1f} {fm / mib:>12.1f} {ff / fm:>6.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--mem-vocab", type=int, nargs="*", default=[49152, 262144])
    p.add_argument("--mem-batch", type=int, default=2)
    p.add_argument("--mem-rows", type=int, default=512)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--skip-time", action="store_true")
    args = p.parse_args(argv)
    uf.validation.set_validation(False)
    if not args.skip_time:
        time_steps(args)
    if args.mem_vocab:
        memory(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
