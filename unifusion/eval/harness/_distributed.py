"""Data-parallel evaluation: joining the process group a launcher (``torchrun``, ``accelerate launch``) set up, the
device each process takes, and the collectives the harness's evaluator calls (``all_gather``, ``gather_object``,
``barrier``, and ``lm.accelerator``'s ``gather``/``wait_for_everyone``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ...denoiser import DenoiserModule


def join_processes(device: object, model: DenoiserModule | None) -> tuple[str | None, int, int]:
    """``(device, rank, world_size)`` of this process.

    Rank and world size come from torch.distributed, initialising the process group when a launcher set
    ``WORLD_SIZE`` > 1 and nobody has (NCCL for CUDA, gloo for the CPU). The device is the given one, a live
    ``model``'s own, else ``cuda`` (``cuda:LOCAL_RANK`` under a launcher) when available, else the CPU; ``None``
    leaves a live model where it is.
    """
    import torch.distributed as dist

    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(f"device: expected a name such as 'cuda' or 'cpu', got {type(device).__name__}")
    device = None if device is None else str(device)
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} but CUDA is not available here; pass device=cpu (--device cpu)")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    initialised = dist.is_available() and dist.is_initialized()
    if not initialised and launched <= 1:
        if device is None and model is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return device, 0, 1
    if device is None and model is not None:  # a live model: the training script placed it
        on_cuda = model.device.type == "cuda"
        if on_cuda:
            torch.cuda.set_device(model.device)
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device in (None, "cuda") and torch.cuda.is_available():
            device = f"cuda:{local_rank}"
        elif device is None:
            device = "cpu"
        elif device.startswith("cuda:") and launched > 1:
            raise ValueError(f"device: {device!r} would put all {launched} processes on one GPU; pass "
                             "device=cuda (each process then takes cuda:LOCAL_RANK)")
        on_cuda = device.startswith("cuda")
        if on_cuda:
            torch.cuda.set_device(torch.device(device))
    if not initialised:
        if not dist.is_available():
            raise ValueError(f"WORLD_SIZE={launched}: this torch has no torch.distributed")
        dist.init_process_group("nccl" if on_cuda else "gloo")
    return device, dist.get_rank(), dist.get_world_size()


def all_gather(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every process's ``tensor``, concatenated along dim 0 (0-d tensors stacked)."""
    if world_size <= 1:
        return tensor
    import torch.distributed as dist

    flat = tensor.reshape(1) if tensor.dim() == 0 else tensor
    parts = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(parts, flat.contiguous())
    return torch.cat(parts)


def gather_object(obj: Any, rank: int, world_size: int, dst: int = 0) -> list[Any] | None:
    """Every process's ``obj`` on rank ``dst`` (``None`` elsewhere)."""
    if world_size <= 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] | None = [None] * world_size if rank == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


class Collectives:
    """What the harness's evaluators call on ``lm.accelerator`` (lm-eval 0.4.10–0.4.12): ``gather`` and
    ``wait_for_everyone``, over torch.distributed."""

    def __init__(self, gather: Callable[[torch.Tensor], torch.Tensor], wait: Callable[[], None]) -> None:
        self.gather, self.wait_for_everyone = gather, wait
