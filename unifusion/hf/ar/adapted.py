"""What :class:`~unifusion.hf.DiffusionLM`'s own helper modules read of it: the :class:`AdaptedLM` protocol.

:mod:`unifusion.hf.ar.blocks` (block diffusion), :mod:`unifusion.hf.ar.decoding` (the cached decoders),
:mod:`unifusion.hf.ar.head` (the output head) and :mod:`unifusion.hf.ar.io` (save and load) run the adapter's
backbone, so they see more of it than the :class:`~unifusion.denoiser.Denoiser` interface: the BOS token it prepends,
its time embedding, its family's attention rules and output head, the Hugging Face model inside.
:mod:`unifusion.hf.ar.model` imports them, so they cannot import it back; they type their ``model`` argument with this
protocol instead, and mypy checks that :class:`~unifusion.hf.DiffusionLM` satisfies it wherever the model passes
itself to them (and in ``tests/_protocol_checks.py``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .families import Family
from .time_embedding import TimeEmbedding

__all__ = ["AdaptedLM"]


class AdaptedLM(Protocol):
    """An AR causal LM adapted as an x0 denoiser, as its helper modules see it (:class:`~unifusion.hf.DiffusionLM`
    is the implementation; see its attributes for their meaning)."""

    bos_token_id: int
    """The token prepended internally (``[BOS, x_t]``, :mod:`unifusion.hf.ar.layout`)."""
    mask_token_id: int | None
    added_mask_token: bool
    time_conditioning: bool
    time_embedding: TimeEmbedding | None
    """The per-position time embedding added to the input embeddings, ``None`` without time conditioning."""
    family: Family
    block_size: int | None
    base_model: torch.nn.Module
    config: Any
    tokenizer: Any
    kernel: Any

    @property
    def hf_model(self) -> Any:
        """The Hugging Face ``*ForCausalLM`` the adapter runs (peft unwrapped; typed ``Any`` as transformers' models
        type poorly through ``nn.Module``)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_states(self) -> int: ...

    @property
    def lm_head_weight(self) -> torch.Tensor: ...

    @property
    def lm_head_bias(self) -> torch.Tensor | None: ...

    @property
    def logit_scale(self) -> float: ...

    @property
    def final_logit_softcap(self) -> float | None: ...

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor: ...

    def hidden_states(self, x_t: torch.Tensor, t: torch.Tensor | None = None, *,
                      bidirectional_prob: float | torch.Tensor = 1.0, attention_mask: torch.Tensor | None = None,
                      generator: torch.Generator | None = None, clean: torch.Tensor | None = None
                      ) -> torch.Tensor: ...

    def network_inputs(self, x_t: torch.Tensor, t: torch.Tensor | None = None, *,
                       bidirectional_prob: float | torch.Tensor = 1.0, attention_mask: torch.Tensor | None = None,
                       generator: torch.Generator | None = None) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The x0 forward (``DiffusionLM.forward`` through ``nn.Module.__call__``)."""
