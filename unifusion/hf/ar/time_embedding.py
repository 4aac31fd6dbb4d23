"""A learned embedding of the diffusion time ``t``, added to the input embeddings of an adapted model
(``adapt_ar_model(..., time_conditioning=True)``; the paper trains without one)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TimeEmbedding"]


class TimeEmbedding(nn.Module):
    """Learned embedding of the diffusion time ``t`` added to the input embeddings.

    ``e(t) = W_2 · SiLU(W_1 · [sin(ω t), cos(ω t)])`` with geometric frequencies ``ω``; ``W_2`` (and its bias) start at
    zero, so an adapted model equals its AR initialisation at step 0.

    Shapes: ``t`` ``(B,)`` → ``(B, d)``.
    """

    def __init__(self, hidden_size: int, num_frequencies: int = 64, max_period: float = 10_000.0) -> None:
        super().__init__()
        self.num_frequencies = num_frequencies
        self.max_period = max_period
        self.proj_in = nn.Linear(2 * num_frequencies, hidden_size)
        self.proj_out = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.proj_out.weight)
        nn.init.zeros_(self.proj_out.bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        k = torch.arange(self.num_frequencies, device=t.device, dtype=torch.float32)
        omega = torch.exp(-math.log(self.max_period) * k / self.num_frequencies)  # (F,)
        phase = 1000.0 * t.float()[:, None] * omega  # (B, F); t in (0, 1) spread over many periods
        features = torch.cat([phase.sin(), phase.cos()], dim=-1).to(self.proj_in.weight.dtype)  # (B, 2F)
        return self.proj_out(F.silu(self.proj_in(features)))  # (B, d)
