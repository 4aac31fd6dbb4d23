"""Trainability of rate-equivalent losses (paper §4.1): one x0 head trained with each of the five objectives.

Every run starts from a fresh copy of the same AR-initialised :class:`unifusion.DiffusionLM` and sees the same
batches, times and corruptions (the random streams are keyed by the update index). The x0 head's logits are
converted exactly into each loss's coordinates (Theorem 3.5): SEDD's concrete score, M2S's posterior mean μ, Neural
CTMC's exit rate and jump distribution. With ELBO weights the five losses are the same function of the logits
(Corollary 3.4), so their training curves coincide up to float rounding; the column ``max |Δ| vs gidd`` shows it.
MDLM is defined for the mask kernel only, so it runs under the mask kernel next to GIDD under the same kernel.

What does change the trajectory is the parameterization and the weighting:

* ``m2s (μ head)``: the network output used directly as M2S's μ (``head="mu"``) instead of converting the x0 head;
  the AR softmax is then a poor initial μ (the paper's Fig. 2 comparison: mean loss over the first updates).
* ``gidd (clip)``: GIDD's clipped weights (``weighting="clip"``, max 2), the setting the paper trains with.

CPU smoke run::

    python examples/objectives.py --tiny --steps 3

A real model (SmolLM2-135M, slow on CPU)::

    python examples/objectives.py --model smollm2 --steps 100 --seq-len 128 --batch-size 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_torchrun import (  # noqa: E402
    add_dtype_argument,
    add_model_arguments,
    build_diffusion_model,
    cosine_lr,
    eval_loss,
    format_table,
    load_text,
    stream_generator,
    token_blocks,
    training_autocast,
    training_dtype,
)

import unifusion as uf  # noqa: E402

# (label, objective, kernel, diffusion_loss keyword arguments)
RUNS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("gidd", "gidd", "uniform", {}),
    ("sedd", "sedd", "uniform", {}),
    ("m2s", "m2s", "uniform", {}),
    ("ctmc", "ctmc", "uniform", {}),
    ("m2s (μ head)", "m2s", "uniform", {"head": "mu"}),
    ("gidd (clip)", "gidd", "uniform", {"weighting": "clip"}),
    ("gidd", "gidd", "mask", {}),
    ("mdlm", "mdlm", "mask", {}),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=50, help="updates per objective")
    parser.add_argument("--first-steps", type=int, default=10,
                        help="window for the 'mean of the first updates' column (Fig. 2)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--anneal-steps", type=int, default=None, help="default: half of --steps")
    parser.add_argument("--eval-t", type=float, default=0.5, help="fixed time of the held-out ELBO")
    parser.add_argument("--eval-blocks", type=int, default=64)
    parser.add_argument("--max-blocks", type=int, default=4096)
    add_dtype_argument(parser)
    args = parser.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 32 if (args.tiny or args.model is None) else 128
    if args.anneal_steps is None:
        args.anneal_steps = max(1, args.steps // 2)
    return args


def train(model: uf.DiffusionLM, kernel: uf.Kernel, blocks: torch.Tensor, objective: str, extra: dict[str, Any],
          args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[float]:
    """``--steps`` AdamW updates on ``objective`` (bf16 autocast when ``dtype`` is bfloat16); per-update token-mean
    losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    autocast = training_autocast(dtype, device)
    losses = []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, peak_lr=args.lr, warmup_steps=min(args.warmup, args.steps),
                                    total_steps=args.steps)
        idx = torch.randint(0, blocks.shape[0], (args.batch_size,), generator=stream_generator(args.seed, step, 0))
        with autocast:
            out = uf.diffusion_loss(model, blocks[idx].to(device), kernel, objective=objective, step=step,
                                    anneal_steps=args.anneal_steps,
                                    generator=stream_generator(args.seed, step, 1, device), **extra)
        loss = out.mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(v) for v in torch.stack(losses)]  # one host sync per run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype, dtype_line = training_dtype(args.dtype, device)
    print(dtype_line, flush=True)
    torch.manual_seed(args.seed)
    base, tokenizer = build_diffusion_model(args)
    base.to(device).train()
    kernels = {"uniform": uf.UniformKernel(base.num_states), "mask": uf.MaskKernel(base.num_states, base.mask_token_id)}
    blocks = token_blocks(load_text(args.data), tokenizer, args.seq_len, max_blocks=args.max_blocks + args.eval_blocks)
    if blocks.shape[0] < 2:
        raise SystemExit("--data: need at least two sequences of --seq-len tokens")
    n_eval = min(args.eval_blocks, blocks.shape[0] // 2)
    train_blocks, held_out = blocks[:-n_eval], blocks[-n_eval:]
    print(f"model {type(base.base_model).__name__}, num_states {base.num_states}, {args.steps} updates per "
          f"objective, batch {args.batch_size} x {args.seq_len}, eval ELBO at t = {args.eval_t}")

    k = max(1, min(args.first_steps, args.steps))
    rows, curves = [], {}
    for label, objective, kernel_name, extra in RUNS:
        model = copy.deepcopy(base)
        curve = train(model, kernels[kernel_name], train_blocks, objective, extra, args, device, dtype)
        curves[(label, kernel_name)] = curve
        reference = curves.get(("gidd", kernel_name))
        delta = max(abs(a - b) for a, b in zip(curve, reference)) if reference is not None else 0.0
        held = eval_loss(model, held_out, kernels[kernel_name], t_value=args.eval_t, seed=args.seed + 1)
        head = extra.get("head", "x0")
        rows.append([label, kernel_name, head, f"{curve[0]:.4f}", f"{sum(curve[:k]) / k:.4f}", f"{curve[-1]:.4f}",
                     f"{min(curve):.4f}", f"{delta:.1e}", f"{held:.4f}"])
        print(f"{label:<13} ({kernel_name:<7}, {head} head) loss {curve[0]:.4f} → {curve[-1]:.4f}", flush=True)

    print()
    print(format_table(rows, ["objective", "kernel", "head", "loss@1", f"mean first {k}", f"loss@{args.steps}",
                              "min", "max |Δ| vs gidd", f"eval ELBO@{args.eval_t}"]))
    x0_head = sum(curves[("m2s", "uniform")][:k]) / k
    mu_head = sum(curves[("m2s (μ head)", "uniform")][:k]) / k
    print(f"\nM2S, mean loss over the first {k} updates: x0 head {x0_head:.4f}, μ head {mu_head:.4f} (Fig. 2)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
