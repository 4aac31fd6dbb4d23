"""The entry point: :func:`adapt_ar_model` wraps a pretrained Hugging Face causal LM as a :class:`DiffusionLM`
(paper §3.2), adding a mask token to its vocabulary unless one is given or none is wanted."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from .blocks import check_block_size
from .families import family_for, supported_model_types, unwrap_peft
from .model import DiffusionLM

__all__ = ["adapt_ar_model"]


def adapt_ar_model(model: nn.Module, *, bos_token_id: int | None = None, mask_token_id: int | None = None,
                   time_conditioning: bool = False, add_mask_token: bool = True, tokenizer: Any = None,
                   block_size: int | None = None) -> DiffusionLM:
    """Wrap a pretrained Hugging Face causal LM as a shifted x0 predictor (paper §3.2).

    Args:
        model: a ``*ForCausalLM`` of a supported family (``config.model_type``), possibly peft/LoRA-wrapped. It is
            wrapped, not copied.
        bos_token_id: token prepended internally; default ``config.bos_token_id``, else ``config.eos_token_id``.
        mask_token_id: absorbing-state token for mask/hybrid kernels. If ``None``, one token is **added**: the
            embeddings are resized in place to ``V + 1`` (``resize_token_embeddings``) and the new input (and untied
            output) row is set to the mean of the existing rows; the new id is ``V``.
        time_conditioning: add a learned, zero-initialised embedding of ``t`` to the input embeddings (the paper
            trains without one).
        add_mask_token: with ``mask_token_id=None``, whether to add the mask token. Pass ``False`` for uniform-noise
            training (the paper's setting): the vocabulary, and hence the AR model's logits, stay exactly as they
            are, and ``model.mask_token_id`` is ``None``.
        tokenizer: the model's Hugging Face tokenizer, kept as ``result.tokenizer`` (a plain attribute, not state)
            and written by :meth:`DiffusionLM.save_pretrained`, so the saved folder works with
            ``unifusion sample --model DIR``. It is not changed: an added mask token has no text form.
        block_size: ``K`` for block diffusion (:mod:`unifusion.hf.ar.blocks`): :func:`~unifusion.diffusion_loss` then
            trains every block of K tokens at once, each seeing the clean blocks before it and its own noisy tokens;
            saved and restored with the model. ``None`` (default): one bidirectional block over the whole sequence.

    Returns:
        A :class:`DiffusionLM`; ``result.base_model`` is ``model``.
    """
    block_size = check_block_size(block_size)
    if isinstance(model, DiffusionLM):
        warnings.warn("adapt_ar_model: the model is already a DiffusionLM; returning it unchanged", stacklevel=2)
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a Hugging Face causal LM (nn.Module), got {type(model).__name__}")
    hf = unwrap_peft(model)
    config = getattr(hf, "config", None)
    if config is None or not hasattr(hf, "get_output_embeddings"):
        raise TypeError(f"model: expected a Hugging Face causal LM (a *ForCausalLM with a config), got "
                        f"{type(hf).__name__}; supported model types: {', '.join(supported_model_types())}")
    family_for(getattr(config, "model_type", None))  # ValueError listing the supported families
    head = hf.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise TypeError(f"model: expected a causal LM with an output head (e.g. LlamaForCausalLM), got "
                        f"{type(hf).__name__}, which has none")
    if not isinstance(time_conditioning, bool):
        raise TypeError(f"time_conditioning: expected a bool, got {type(time_conditioning).__name__}")
    V = int(hf.get_input_embeddings().weight.shape[0])

    if bos_token_id is None:
        bos_token_id = _first_id(getattr(config, "bos_token_id", None))
        if bos_token_id is None:
            bos_token_id = _first_id(getattr(config, "eos_token_id", None))
        if bos_token_id is None:
            raise ValueError("bos_token_id: the model config has neither bos_token_id nor eos_token_id; pass "
                             "bos_token_id= explicitly (the token prepended so position 1 has a predictor)")
    _check_id("bos_token_id", bos_token_id, V)

    if not isinstance(add_mask_token, bool):
        raise TypeError(f"add_mask_token: expected a bool, got {type(add_mask_token).__name__}")
    added = False
    if mask_token_id is None and not add_mask_token:
        pass  # uniform noise only: no absorbing state
    elif mask_token_id is None:
        _add_token(hf)
        mask_token_id, added = V, True
    else:
        _check_id("mask_token_id", mask_token_id, V)
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"tokenizer: expected a Hugging Face tokenizer (with save_pretrained), got "
                        f"{type(tokenizer).__name__}")
    return DiffusionLM(model, bos_token_id=bos_token_id, mask_token_id=mask_token_id,
                       time_conditioning=time_conditioning, added_mask_token=added, tokenizer=tokenizer,
                       block_size=block_size)


def _first_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return None if value is None else int(value)


def _check_id(name: str, value: Any, vocab_size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int token id, got {type(value).__name__}")
    if not 0 <= value < vocab_size:
        raise ValueError(f"{name}: expected a token id in [0, {vocab_size}), got {value}")


@torch.no_grad()
def _add_token(hf: Any) -> None:
    """Grow the vocabulary by one row; the new row is the mean of the existing ones (input and untied output)."""
    V = int(hf.get_input_embeddings().weight.shape[0])
    hf.resize_token_embeddings(V + 1, mean_resizing=False)
    w_in = hf.get_input_embeddings().weight
    w_in[V] = w_in[:V].mean(0)
    head = hf.get_output_embeddings()
    if head.weight is not w_in:
        head.weight[V] = head.weight[:V].mean(0)
    if getattr(head, "bias", None) is not None:
        head.bias[V] = head.bias[:V].mean()
