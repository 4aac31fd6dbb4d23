"""Algorithm 1 with DeepSpeed ZeRO (the paper trains in bf16 with ZeRO-2): ``engine.backward`` / ``engine.step``.

The recipe and the data/time/corruption streams are those of ``train_torchrun.py`` (imported from it), so with the
same flags both scripts train the same model. DeepSpeed owns the optimizer (AdamW), bf16, gradient clipping and the
ZeRO partitioning, read from a JSON config (``ds_zero2.json`` or ``ds_zero3.json``); the warmup + cosine learning
rate is the script's (``--lr``, ``--warmup``, ``--steps``), handed to ``deepspeed.initialize`` as ``lr_scheduler``
unless the config has its own ``"scheduler"``. The command line overrides the batch fields (``--micro-batch`` /
``--global-batch`` → ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``train_batch_size``).

Normalisation: every micro-batch's loss is ``loss.sum() · world_size / n_global`` with ``n_global`` the all-reduced
token count of the whole update, and ``engine.backward(loss, scale_wrt_gas=False)`` (the global count already
accounts for accumulation; DeepSpeed averages gradients over ranks).

Checkpoints: ``--out/deepspeed/`` holds DeepSpeed's own (sharded, resumable: ``--resume``) checkpoints;
``--out/checkpoint-N`` holds a ``save_pretrained`` export that :meth:`unifusion.DiffusionLM.from_pretrained` reads
(ZeRO-3 gathers the partitioned parameters for it), with the training kernel recorded.

CPU smoke run (2 processes; DeepSpeed picks its CPU accelerator and gloo)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/train_deepspeed.py --tiny --steps 3 \\
        --micro-batch 2 --global-batch 8 --warmup 1 --fp32 --out /tmp/uf-ds

Multi-GPU (8 GPUs, paper batch 864 = 12 × 9 × 8)::

    deepspeed --num_gpus 8 examples/train_deepspeed.py --model gpt2-folder --data fineweb.txt \\
        --deepspeed-config examples/ds_zero2.json --micro-batch 12 --global-batch 864 --seq-len 512
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_torchrun import (  # noqa: E402
    PAPER_SEQ_LEN,
    accumulation_steps,
    add_model_arguments,
    build_diffusion_model,
    cosine_lr,
    global_batch_indices,
    load_text,
    make_kernel,
    save_pretrained_from_state_dict,
    stream_generator,
    token_blocks,
)

import unifusion as uf  # noqa: E402

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--deepspeed-config", default=str(HERE / "ds_zero2.json"),
                        help="DeepSpeed JSON config (default: examples/ds_zero2.json)")
    parser.add_argument("--steps", type=int, default=240_000, help="optimizer updates K (paper: 240,000)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per process per forward (default: the config's)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per update (default: the config's train_batch_size, paper 864)")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (paper: 3e-4)")
    parser.add_argument("--warmup", type=int, default=3000, help="linear warmup updates (paper: 3,000)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.0, help="cosine floor as a fraction of --lr")
    parser.add_argument("--anneal-steps", type=int, default=10_000, help="causal → bidirectional horizon K_ann")
    parser.add_argument("--kernel", choices=["uniform", "mask", "hybrid"], default="uniform")
    parser.add_argument("--p-uniform", type=float, default=0.1)
    parser.add_argument("--objective", choices=list(uf.training.OBJECTIVES), default="gidd")
    parser.add_argument("--fp32", action="store_true", help="turn the config's bf16 off (e.g. for CPU smoke runs)")
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--save-every", type=int, default=1000, help="checkpoint period in updates (0 = only at end)")
    parser.add_argument("--out", default="unifusion-ds-run")
    parser.add_argument("--resume", nargs="?", const="latest", default=None,
                        help="resume from a DeepSpeed checkpoint tag in --out/deepspeed (e.g. step-2; default latest)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    args = parser.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 32 if (args.tiny or args.model is None) else PAPER_SEQ_LEN
    return args


def resolve_config(args: argparse.Namespace, world: int) -> dict:
    """The JSON config with the command-line batch, learning-rate and schedule overrides applied."""
    config = json.loads(Path(args.deepspeed_config).read_text())
    micro = args.micro_batch or int(config["train_micro_batch_size_per_gpu"])
    global_batch = args.global_batch or int(config["train_batch_size"])
    try:
        accum = accumulation_steps(global_batch, micro, world)
    except ValueError as err:
        raise SystemExit(f"--global-batch/--micro-batch: {err}") from None
    config.update(train_batch_size=global_batch, train_micro_batch_size_per_gpu=micro,
                  gradient_accumulation_steps=accum)
    config["optimizer"]["params"]["lr"] = args.lr
    if args.fp32:
        config["bf16"] = {"enabled": False}
    return config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before importing DeepSpeed (seconds): --help and argument errors answer at once
    import deepspeed

    deepspeed.init_distributed()  # NCCL on GPUs, gloo on CPU (DeepSpeed's accelerator decides)
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    config = resolve_config(args, world)
    micro, accum, global_batch = (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
                                  config["train_batch_size"])
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    L = args.seq_len
    if is_main:
        print(f"world_size {world} | deepspeed ZeRO-{stage} | bf16 {config.get('bf16', {}).get('enabled', False)} | "
              f"micro_batch {micro} | grad_accum {accum} | global_batch {global_batch} seq x {L} tok = "
              f"{global_batch * L:,} tok/update", flush=True)

    model, tokenizer = build_diffusion_model(args)
    model.train()
    kernel = make_kernel(args.kernel, model, args.p_uniform)  # before ZeRO-3 partitions the embedding matrices
    if stage == 3:
        # ZeRO-3 leaves a 0-row placeholder where the output matrix was, so DiffusionLM.vocab_size reads 0 outside the
        # lm_head's own forward; skip the (host-syncing) token-id range checks that would compare against it.
        uf.validation.set_validation(False)
    skeleton = copy.deepcopy(model).to("meta") if is_main else None  # receives the weights at export time
    if is_main:
        print(f"model {type(model.base_model).__name__} {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
              f"params, num_states {kernel.num_states}, kernel {kernel!r}, objective {args.objective}", flush=True)

    def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        # the same warmup + cosine as train_torchrun.py, stepped by DeepSpeed once per update
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: cosine_lr(
            k, peak_lr=1.0, warmup_steps=args.warmup, total_steps=args.steps, min_lr_ratio=args.min_lr_ratio))

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           lr_scheduler=None if "scheduler" in config else schedule)
    device = engine.device
    out_dir = Path(args.out)
    start_step = 0
    if args.resume:
        tag = None if args.resume == "latest" else args.resume
        path, client_state = engine.load_checkpoint(str(out_dir / "deepspeed"), tag=tag)
        if path is None:
            raise SystemExit(f"--resume: no DeepSpeed checkpoint under {out_dir / 'deepspeed'}")
        start_step = int(client_state["step"])
        if is_main:
            print(f"resumed from {path} at step {start_step}", flush=True)

    blocks = token_blocks(load_text(args.data), tokenizer, L)
    bf16 = bool(config.get("bf16", {}).get("enabled", False))
    # DeepSpeed casts the parameters to bf16 itself; autocast still runs softmax and norms in float32 (the losses
    # upcast the logits to float32 on their own)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    t_start, tokens_seen = time.perf_counter(), 0
    loss = torch.zeros((), device=device)
    for step in range(start_step, args.steps):
        lr = engine.get_lr()[0]  # the rate this update uses (the scheduler steps at the accumulation boundary)
        indices = global_batch_indices(blocks.shape[0], global_batch, args.seed, step)
        micro_ids = [m * world + rank for m in range(accum)]
        batches = [blocks[indices[i * micro:(i + 1) * micro]].to(device) for i in micro_ids]
        n_global = torch.tensor(float(sum(x0.numel() for x0 in batches)), device=device)
        dist.all_reduce(n_global)  # global token count of the update
        loss_sum = torch.zeros((), device=device)
        for i, x0 in zip(micro_ids, batches):
            t = uf.sample_times(micro, generator=stream_generator(args.seed, step, 1, device), rank=i,
                                world_size=accum * world, device=device)
            with autocast:
                out = uf.diffusion_loss(engine, x0, kernel, objective=args.objective, step=step,
                                        anneal_steps=args.anneal_steps, t=t,
                                        generator=stream_generator(args.seed, step, 2 + i, device))
            engine.backward(out.loss.sum() * world / n_global, scale_wrt_gas=False)
            engine.step()  # updates only at the accumulation boundary (every `accum` calls)
            loss_sum += out.loss.detach().sum()
        tokens_seen += global_batch * L
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            dist.all_reduce(loss_sum)
            loss = loss_sum / n_global
            if is_main:
                rate = tokens_seen / (time.perf_counter() - t_start)
                print(f"step {done:>6d} | loss {loss.item():.6f} | lr {lr:.3e} | gamma {out.bidirectional_prob:.3f} | "
                      f"grad_norm {float(engine.get_global_grad_norm() or 0.0):.3f} | {rate:,.0f} tok/s", flush=True)
        if (args.save_every and done % args.save_every == 0) or done == args.steps:
            engine.save_checkpoint(str(out_dir / "deepspeed"), tag=f"step-{done}", client_state={"step": done})
            export_pretrained(engine, skeleton, out_dir / f"checkpoint-{done}", stage, is_main, tokenizer, kernel)
    if is_main:
        print(f"final loss {loss.item():.6f}", flush=True)
    dist.barrier()
    return 0


def export_pretrained(engine: Any, skeleton: uf.DiffusionLM | None, folder: Path, stage: int, is_main: bool,
                      tokenizer: Any, kernel: uf.Kernel) -> None:
    """``save_pretrained`` on rank 0 (the training ``kernel`` recorded); under ZeRO-3 every rank joins the gather of
    the partitioned parameters.

    With bf16 the module holds bf16 weights, so the export is bf16; the float32 master weights live in the DeepSpeed
    checkpoint (``zero_to_fp32.py`` in that folder consolidates them).
    """
    import deepspeed

    module: uf.DiffusionLM = engine.module
    gather = (deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None) if stage == 3
              else nullcontext())
    with gather:
        if is_main:
            assert skeleton is not None
            save_pretrained_from_state_dict(skeleton, module.state_dict(), folder, kernel=kernel)
            if tokenizer is not None:
                tokenizer.save_pretrained(folder)
            print(f"saved checkpoint {folder}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    raise SystemExit(main())
