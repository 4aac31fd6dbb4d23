"""The adapted model's output head: its hidden states made into x0 logits exactly as the family's ``*ForCausalLM``
makes its next-token logits.

The family's ``forward`` computes ``z = (h Wᵀ + b) · κ``, then ``c · tanh(z / c)`` when it soft-caps
(:class:`~unifusion.hf.ar.families.Family`: ``κ = logit_scale``, granite's ``1 / logits_scaling``, cohere's
``logit_scale``; ``c = final_logit_softcapping``, gemma2/3). :func:`logits_from_hidden` applies it to any hidden
states (the fused loss runs it chunk by chunk, the decoders on the positions they read).

The forward keeps ``L`` of the network's ``L + 1`` positions (``[BOS, x_t]``, :mod:`unifusion.hf.ar.layout`): the
prediction for ``x^i`` is the output at position ``i − 1``, the last position predicts nothing. :func:`kept_logits`
runs the head on those ``L`` positions only — the hidden states are sliced before it, not the logits after it (a
``(B, L, V)`` view with row stride ``(L + 1) V`` would be copied whole by a loss reading rows, and its backward would
allocate a ``(B, L + 1, V)`` gradient) — through transformers' ``logits_to_keep`` where the family's ``forward``
takes it (its own head, post-processing and hooks run), else through the backbone, the head module and the
post-processing above.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .adapted import AdaptedLM

__all__ = ["kept_logits", "logits_from_hidden", "post_head", "takes_logits_to_keep"]


def post_head(model: AdaptedLM, z: torch.Tensor) -> torch.Tensor:
    """The family's post-processing of the head's output ``z (..., V)``: ``z · κ``, then ``c · tanh(z / c)``."""
    scale = model.logit_scale
    if scale != 1.0:
        z = z * scale
    c = model.final_logit_softcap
    if c is not None:
        z = torch.tanh(z / c) * c
    return z


def logits_from_hidden(model: AdaptedLM, h: torch.Tensor) -> torch.Tensor:
    """Logits ``(..., V)`` of final hidden states ``h (..., d)``: ``post_head(h Wᵀ + b)``, through the output-embedding
    module when it is an ``nn.Linear`` (so what wraps its calls sees this one too: hooks, and
    :func:`unifusion.cpu_linears.packed_linears`, which ``generate`` opens on the CPU), else ``F.linear``."""
    out = model.hf_model.get_output_embeddings()
    if isinstance(out, nn.Linear):
        return post_head(model, out(h))
    return post_head(model, F.linear(h, model.lm_head_weight, model.lm_head_bias))


def kept_logits(model: AdaptedLM, inputs: dict[str, Any], length: int) -> torch.Tensor:
    """Contiguous ``(B, L, V)`` logits of the first ``L = length`` of the ``L + 1`` network positions, for the
    network's keyword arguments ``inputs`` (``model.network_inputs``): through ``logits_to_keep=slice(0, L)`` where
    :func:`takes_logits_to_keep`, else the backbone, then the head module and :func:`post_head` on ``h[:, :-1]``."""
    hf = model.hf_model
    if takes_logits_to_keep(hf.__class__):
        logits = hf(**inputs, logits_to_keep=slice(0, length)).logits  # (B, L, V)
        if logits.shape[1] == length:
            return logits
        return logits[:, :length].contiguous()  # pragma: no cover - a family that ignores logits_to_keep
    h = hf.base_model(**inputs).last_hidden_state[:, :-1]  # (B, L, d)
    return post_head(model, hf.get_output_embeddings()(h))


_LOGITS_TO_KEEP: dict[Any, bool] = {}  # takes_logits_to_keep's answer per class


@torch.compiler.assume_constant_result  # a traced step takes the answer as a constant: no guard on the cache's state
def takes_logits_to_keep(model_cls: Any) -> bool:
    """Whether ``model_cls.forward`` names a ``logits_to_keep`` parameter: transformers' ``*ForCausalLM`` index the
    hidden states with it before ``lm_head`` (every supported family in transformers 5). Older releases (an int-only
    ``num_logits_to_keep``, or none) take :func:`kept_logits`'s backbone-then-head path."""
    known = _LOGITS_TO_KEEP.get(model_cls)
    if known is None:
        try:
            known = "logits_to_keep" in inspect.signature(model_cls.forward).parameters
        except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
            known = False
        _LOGITS_TO_KEEP[model_cls] = known
    return known
