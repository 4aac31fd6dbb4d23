"""Algorithm 1 with Hugging Face Accelerate: ``accelerator.prepare``, ``accelerator.backward``, ``no_sync``.

The recipe, the data and the random streams are those of ``train_torchrun.py`` (imported from it), so with the same
flags the two scripts train the same model. Accelerate wraps the model (DDP on several processes), handles bf16
(``--dtype bfloat16`` → ``mixed_precision="bf16"``; the default ``--dtype auto`` takes it where the device computes
bf16 natively) and device placement; the loop keeps the global token-count normaliser
``loss.sum() · num_processes / n_global`` and skips the gradient all-reduce on all but the last micro-batch of an
update with ``accelerator.no_sync``. (Accelerate's own ``gradient_accumulation_steps`` would divide the loss once
more, so it stays at 1 here.)

Checkpoints: ``--out/checkpoint-N`` is a ``save_pretrained`` export with the training kernel recorded (read it with
:meth:`unifusion.DiffusionLM.from_pretrained`) plus ``accelerate_state/`` written by ``accelerator.save_state``
(model, optimizer, RNG), which ``--resume`` restores.

CPU smoke run: Accelerate runs on the processes ``torchrun`` starts (``Accelerator(cpu=True)``; note that
``accelerate launch --cpu --num_processes 2`` starts only one process on a machine without GPUs)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/train_accelerate.py --cpu --tiny --steps 3 \\
        --micro-batch 2 --global-batch 8 --warmup 1 --out /tmp/uf-acc

Multi-GPU::

    accelerate launch --num_processes 8 examples/train_accelerate.py --model gpt2-folder \\
        --data fineweb.txt --micro-batch 12 --global-batch 864 --seq-len 512 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_torchrun import (  # noqa: E402
    PAPER_SEQ_LEN,
    accumulation_steps,
    add_dtype_argument,
    add_model_arguments,
    build_diffusion_model,
    cosine_lr,
    global_batch_indices,
    latest_checkpoint,
    load_text,
    make_kernel,
    stream_generator,
    token_blocks,
    training_dtype,
)

import unifusion as uf  # noqa: E402

STATE_DIR = "accelerate_state"
STEP_FILE = f"{STATE_DIR}/step.txt"  # written last: marks a complete checkpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--cpu", action="store_true", help="Accelerator(cpu=True): run on CPU even with GPUs")
    parser.add_argument("--steps", type=int, default=240_000, help="optimizer updates K (paper: 240,000)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per process per forward")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per update (paper: 864); default micro-batch × number of processes")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=3000)
    parser.add_argument("--min-lr-ratio", type=float, default=0.0)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0 = off)")
    parser.add_argument("--anneal-steps", type=int, default=10_000)
    parser.add_argument("--kernel", choices=["uniform", "mask", "hybrid"], default="uniform")
    parser.add_argument("--p-uniform", type=float, default=0.1)
    parser.add_argument("--objective", choices=list(uf.training.OBJECTIVES), default="gidd")
    add_dtype_argument(parser, bf16_means="Accelerate's mixed_precision='bf16'")
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--save-every", type=int, default=1000)
    parser.add_argument("--out", default="unifusion-acc-run")
    parser.add_argument("--resume", default=None, help="checkpoint folder, or 'latest' under --out")
    args = parser.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 32 if (args.tiny or args.model is None) else PAPER_SEQ_LEN
    return args


def main(argv: list[str] | None = None) -> int:
    from accelerate import Accelerator

    args = parse_args(argv)
    # resolved before the Accelerator exists (it takes the precision), for the device type it will pick
    planned = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    dtype, dtype_line = training_dtype(args.dtype, planned, bf16_means="mixed_precision='bf16'")
    accelerator = Accelerator(cpu=args.cpu, mixed_precision="bf16" if dtype == torch.bfloat16 else "no")
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    global_batch = args.global_batch or args.micro_batch * world
    try:
        accum = accumulation_steps(global_batch, args.micro_batch, world)
    except ValueError as err:
        raise SystemExit(f"--global-batch/--micro-batch: {err}") from None
    L = args.seq_len
    accelerator.print(f"world_size {world} | accelerate {accelerator.distributed_type} | device {device} | "
                      f"micro_batch {args.micro_batch} | grad_accum {accum} | global_batch {global_batch} seq x {L} "
                      f"tok = {global_batch * L:,} tok/update")
    accelerator.print(dtype_line)

    model, tokenizer = build_diffusion_model(args)
    model.train()
    kernel = make_kernel(args.kernel, model, args.p_uniform)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    wrapped, optimizer = accelerator.prepare(model, optimizer)
    out_dir = Path(args.out)
    start_step = 0
    resume = Path(args.resume) if args.resume not in (None, "latest") else None
    if args.resume == "latest":
        resume = latest_checkpoint(out_dir, STEP_FILE)
    if resume is not None:
        accelerator.load_state(str(resume / STATE_DIR))
        start_step = int((resume / STEP_FILE).read_text())
        accelerator.print(f"resumed from {resume} at step {start_step}")
    accelerator.print(f"model {type(model.base_model).__name__} {sum(p.numel() for p in model.parameters()) / 1e6:.2f}"
                      f"M params, num_states {kernel.num_states}, kernel {kernel!r}, objective {args.objective}")

    blocks = token_blocks(load_text(args.data), tokenizer, L)
    t_start, tokens_seen = time.perf_counter(), 0
    loss = torch.zeros((), device=device)
    for step in range(start_step, args.steps):
        lr = cosine_lr(step, peak_lr=args.lr, warmup_steps=args.warmup, total_steps=args.steps,
                       min_lr_ratio=args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        indices = global_batch_indices(blocks.shape[0], global_batch, args.seed, step)
        micro_ids = [m * world + rank for m in range(accum)]
        batches = [blocks[indices[i * args.micro_batch:(i + 1) * args.micro_batch]].to(device) for i in micro_ids]
        n_global = accelerator.reduce(torch.tensor(float(sum(x0.numel() for x0 in batches)), device=device), "sum")
        loss_sum = torch.zeros((), device=device)
        for m, (i, x0) in enumerate(zip(micro_ids, batches)):
            sync = nullcontext() if m == accum - 1 else accelerator.no_sync(wrapped)
            t = uf.sample_times(args.micro_batch, generator=stream_generator(args.seed, step, 1, device), rank=i,
                                world_size=accum * world, device=device)
            with sync:
                out = uf.diffusion_loss(wrapped, x0, kernel, objective=args.objective, step=step,
                                        anneal_steps=args.anneal_steps, t=t,
                                        generator=stream_generator(args.seed, step, 2 + i, device))
                accelerator.backward(out.loss.sum() * world / n_global)
            loss_sum += out.loss.detach().sum()
        grad_norm = accelerator.clip_grad_norm_(wrapped.parameters(), args.clip if args.clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += global_batch * L
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            loss = accelerator.reduce(loss_sum, "sum") / n_global
            rate = tokens_seen / (time.perf_counter() - t_start)
            accelerator.print(f"step {done:>6d} | loss {loss.item():.6f} | lr {lr:.3e} | "
                              f"gamma {out.bidirectional_prob:.3f} | grad_norm {float(grad_norm):.3f} | "
                              f"{rate:,.0f} tok/s")
        if (args.save_every and done % args.save_every == 0) or done == args.steps:
            folder = out_dir / f"checkpoint-{done}"
            accelerator.save_state(str(folder / STATE_DIR))  # collective; writes on the main process
            if accelerator.is_main_process:
                accelerator.unwrap_model(wrapped).save_pretrained(folder, kernel=kernel)
                if tokenizer is not None:
                    tokenizer.save_pretrained(folder)
                (folder / STEP_FILE).write_text(str(done))
                print(f"saved checkpoint {folder}", flush=True)
            accelerator.wait_for_everyone()
    accelerator.print(f"final loss {loss.item():.6f}")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
