"""What :class:`~unifusion.hf.DiffusionGemmaLM`'s own helper modules read of it: the :class:`WrappedDiffusionGemma`
protocol.

:mod:`unifusion.hf.diffusion_gemma.cache` (the cached canvas operations) and
:mod:`unifusion.hf.diffusion_gemma.generation` (``generate``) run transformers' model inside the wrapper, so they see
more of it than the :class:`~unifusion.denoiser.Denoiser` interface: its encoder and decoder, its text config, its
canvas length, the weights' dtype. :mod:`unifusion.hf.diffusion_gemma.model` imports them, so they cannot import it
back; they type their ``model`` argument with this protocol instead, and mypy checks that
:class:`~unifusion.hf.DiffusionGemmaLM` satisfies it wherever the model passes itself to them (and in
``tests/_protocol_checks.py``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["WrappedDiffusionGemma"]


class WrappedDiffusionGemma(Protocol):
    """DiffusionGemma wrapped as an x0 denoiser, as its helper modules see it (:class:`~unifusion.hf.DiffusionGemmaLM`
    is the implementation; see its attributes for their meaning)."""

    base_model: Any
    """transformers' ``DiffusionGemmaForBlockDiffusion``: :mod:`~unifusion.hf.diffusion_gemma.cache` calls it and its
    ``model.encoder`` / ``model.decoder`` (reached through ``nn.Module.__getattr__``, which types them ``Tensor |
    Module``: hence ``Any``), ``generation`` reads its ``generation_config``."""
    text_config: Any
    """The text model's config (``DynamicCache`` layout, EOS and pad ids)."""
    canvas_length: int
    """``K``, tokens per canvas: the blocks of the generate path."""
    tokenizer: Any
    kernel: Any

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_states(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def denoise_block(self, state: Any, block: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                      self_condition: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's logits ``(B_a, K, V)`` of the canvas ``block`` of ``rows`` against the
        :class:`~unifusion.hf.diffusion_gemma.cache.CanvasState` ``state`` (typed ``Any`` here: that module imports
        this one)."""
