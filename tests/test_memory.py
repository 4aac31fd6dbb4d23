"""``diffusion_loss`` hands a model's bf16 logits to the loss as they are: no second (B, L, V) float32 copy.

Counted on the CPU with a dispatch mode that records every large tensor an op creates: the big allocations of
``diffusion_loss`` (model call included) are exactly those of the loss called directly on the same logits.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import unifusion as uf

B, L, V = 2, 8, 4096


class BigAllocations(TorchDispatchMode):
    """Multiset of (dtype, numel) of op outputs with at least ``min_numel`` elements."""

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel = min_numel
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor) and x.numel() >= self.min_numel and x._base is None:
                self.seen[(x.dtype, x.numel())] += 1
        return out


class FixedLogits(torch.nn.Module):
    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.logits


@pytest.mark.parametrize("kernel_name", ["uniform", "mask"])
def test_diffusion_loss_makes_no_float32_copy_of_bf16_logits(kernel_name):
    g = torch.Generator().manual_seed(0)
    kernel = uf.UniformKernel(V) if kernel_name == "uniform" else uf.MaskKernel(V, V - 1)
    logits = torch.randn(B, L, V, generator=g).to(torch.bfloat16).requires_grad_()
    x0 = torch.randint(0, V - 1, (B, L), generator=g)
    model = FixedLogits(logits)

    with uf.validation(False), BigAllocations(B * L * V // 2) as in_training:
        out = uf.diffusion_loss(model, x0, kernel, generator=torch.Generator().manual_seed(1))
        out.loss.sum().backward()
    x_t, t = out.x_t, out.t
    logits.grad = None
    with uf.validation(False), BigAllocations(B * L * V // 2) as direct:
        loss = uf.losses.x0_head_loss(logits, x0, x_t, t[:, None].float().expand(B, L), kernel)
        loss.sum().backward()
    assert in_training.seen == direct.seen, (in_training.seen, direct.seen)
    assert in_training.seen[(torch.float32, B * L * V)] == direct.seen[(torch.float32, B * L * V)]
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
