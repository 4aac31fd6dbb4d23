"""What the evaluators share about the models they call (private module; public names inside the package).

The evaluators take Hugging Face models and plain callables alike: :func:`input_device` says where to put their
inputs, :func:`logits_of` reads the logits from either kind of output, :func:`progress_bar` wraps a loop in a tqdm
bar when asked.
"""

from __future__ import annotations

from typing import Any

import torch

from ..denoiser import CausalLM, X0Model

__all__ = ["input_device", "logits_of", "progress_bar"]


def input_device(model: X0Model | CausalLM) -> torch.device:
    """Where ``model``'s inputs go: the device of its first parameter, the CPU for callables without parameters."""
    if isinstance(model, torch.nn.Module):
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


def logits_of(output: Any) -> torch.Tensor:
    """Logits from a Hugging Face model output (``.logits``) or a callable returning a tensor."""
    logits = output.logits if hasattr(output, "logits") else output
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"model: expected logits (a tensor or an output with .logits), got {type(logits).__name__}")
    return logits


def progress_bar(iterable: Any, *, enabled: bool, desc: str, total: int | None = None) -> Any:
    """``iterable`` in a tqdm progress bar when ``enabled`` (tqdm is imported only then), else unchanged."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False)
