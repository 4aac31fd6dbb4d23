"""Worker for tests/test_distributed.py, launched with `torchrun --nproc_per_node=2` (gloo, CPU).

Computes the gradient of one global batch's token-mean diffusion loss (a) on one process without any wrapper and
(b) split across ranks under DDP or FSDP2, normalising by the all-reduced global token count exactly as the docs
show, and prints the largest gradient difference on rank 0 — for each case named on the command line (``ddp``,
``fsdp2``; ``ddp:4`` for a block-diffusion model with blocks of 4), all in one launch: ``MAXDIFF <case> <value>``.
``distill-ddp:4`` / ``distill-fsdp2:4``: the same for a distillation step (:func:`unifusion.distill.distillation_loss`
on the wrapped model, each rank its own trajectories and draws) against the mean of the ranks' losses on one process;
``distill-zero2:4`` / ``distill-zero3:4``: the weights after one SGD step through a DeepSpeed ZeRO engine.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _hf_tiny import tiny_model  # noqa: E402

import unifusion as uf  # noqa: E402

GLOBAL_BATCH, L = 4, 12


def local_loss(model, x0, mask, times, kernel, indices):
    total = torch.zeros(())
    count = torch.zeros(())
    for i in indices:  # per-sample generators: the corruption of sample i does not depend on who computes it
        out = uf.diffusion_loss(model, x0[i:i + 1], kernel, t=times[i:i + 1], step=500, anneal_steps=1000,
                                attention_mask=mask[i:i + 1], generator=torch.Generator().manual_seed(1000 + i))
        total = total + out.loss.sum()
        count = count + out.num_tokens
    return total, count


def wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """``model`` under DDP, or under FSDP2 (each decoder layer and the root sharded)."""
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model.base_model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    raise SystemExit(f"unknown mode {mode}")


def worst_difference(model: torch.nn.Module, ref_grads: dict[str, torch.Tensor]) -> float:
    """The largest |Δ| between ``model``'s gradients (FSDP2's gathered) and the single-process ``ref_grads``."""
    worst = 0.0
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        key = n.replace("module.", "").replace("_fsdp_wrapped_module.", "")
        worst = max(worst, float((grad - ref_grads[key]).abs().max()))
    return worst


def max_gradient_difference(mode: str, block_size: int | None) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = uf.adapt_ar_model(tiny_model("llama"), mask_token_id=3, block_size=block_size).train()
    kernel = uf.UniformKernel(model.num_states)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(4, model.num_states, (GLOBAL_BATCH, L), generator=g)
    mask = torch.ones(GLOBAL_BATCH, L, dtype=torch.long)
    mask[1, 9:] = 0
    mask[2, 5:] = 0
    times = uf.sample_times(GLOBAL_BATCH, generator=g)

    reference = copy.deepcopy(model)
    total, count = local_loss(reference, x0, mask, times, kernel, range(GLOBAL_BATCH))
    (total / count).backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}

    per_rank = GLOBAL_BATCH // world
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    wrapped = wrap(model, mode)  # held until backward: DDP's reducer lives with it
    total, count = local_loss(wrapped, x0, mask, times, kernel, mine)
    dist.all_reduce(count)                      # global token count
    (total * world / count).backward()          # DDP / FSDP average gradients over ranks
    worst = worst_difference(model, ref_grads)
    if mode == "fsdp2":  # and one optimizer step trains
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.step()
    return worst


def distillation_step(block_size: int) -> tuple[torch.nn.Module, Callable[[torch.nn.Module, int], torch.Tensor],
                                                torch.nn.Module]:
    """A tiny block model in training mode, ``loss_of(model, r)`` — rank r's distillation loss, on its two of the
    model's own recorded trajectories, with its own draws (a state per block) — and the reference: a copy of the
    model holding the gradients of the mean of the ranks' losses, computed on this one process."""
    from unifusion.distill import distillation_loss, record_trajectories

    torch.manual_seed(0)
    model = uf.adapt_ar_model(tiny_model("llama"), mask_token_id=3, block_size=block_size).eval()
    prompts = torch.randint(4, model.num_states, (2 * dist.get_world_size(), 3),
                            generator=torch.Generator().manual_seed(0))
    traj = record_trajectories(model, prompts, max_new_tokens=8, progress=False, eos_token_id=None)

    def loss_of(m: torch.nn.Module, r: int) -> torch.Tensor:
        return distillation_loss(m, traj.select([2 * r, 2 * r + 1]), per_block=True,
                                 generator=torch.Generator().manual_seed(100 + r))

    model.train()
    reference = copy.deepcopy(model)
    world = dist.get_world_size()
    (sum(loss_of(reference, r) for r in range(world)) / world).backward()
    return model, loss_of, reference


def distillation_gradient_difference(mode: str, block_size: int) -> float:
    model, loss_of, reference = distillation_step(block_size)
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}
    wrapped = wrap(model, mode)  # held until backward: DDP's reducer lives with it
    loss_of(wrapped, dist.get_rank()).backward()  # the wrappers average the ranks' gradients
    return worst_difference(model, ref_grads)


def deepspeed_distillation_difference(stage: int, block_size: int) -> float:
    """One SGD step (lr 0.1, no clipping) of the distillation loss through a DeepSpeed ZeRO-``stage`` engine, every
    parameter partitioned at stage 3, against the same step on the mean of the ranks' losses on one process: the
    largest weight difference after it."""
    import deepspeed

    model, loss_of, reference = distillation_step(block_size)
    world, lr = dist.get_world_size(), 0.1
    with torch.no_grad():
        for p in reference.parameters():
            p -= lr * p.grad
    want = dict(reference.named_parameters())
    if stage == 3:  # ZeRO-3's 0-row placeholders would fail the token-id range checks outside a forward
        uf.validation.set_validation(False)
    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                                           config=config)
    engine.backward(loss_of(engine, dist.get_rank()))
    engine.step()
    uf.validation.set_validation(True)
    worst = 0.0
    for n, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=stage == 3):
            worst = max(worst, float((p.detach() - want[n].detach()).abs().max()))
    return worst


def main() -> None:
    dist.init_process_group("gloo")
    for case in sys.argv[1:]:
        mode, _, block = case.partition(":")  # ":4": a block-diffusion model (unifusion.hf.ar.blocks)
        if mode.startswith("distill-zero"):
            worst = deepspeed_distillation_difference(int(mode.removeprefix("distill-zero")), int(block))
        elif mode.startswith("distill-"):
            worst = distillation_gradient_difference(mode.removeprefix("distill-"), int(block))
        else:
            worst = max_gradient_difference(mode, int(block) if block else None)
        if dist.get_rank() == 0:
            print(f"MAXDIFF {case} {worst:.3e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    # skip interpreter teardown: gloo's background threads can abort ("terminate called without an active
    # exception") while Python finalises, after all the work above has finished
    os._exit(0)


if __name__ == "__main__":
    main()
