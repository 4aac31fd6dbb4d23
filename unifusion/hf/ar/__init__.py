"""Pretrained autoregressive (AR) causal LMs adapted as x0 denoisers (paper §3.2, App. C.5): one model kind.

One concept per module:

* :mod:`~unifusion.hf.ar.families`: the supported ``config.model_type`` values of causal LMs and what each needs;
* :mod:`~unifusion.hf.ar.attention`: attention patterns (causal → bidirectional annealing, padding, sliding windows)
  and the strategies that hand them to the model (its own causal mask, ``is_causal=False``, a dense or additive mask,
  a flex-attention ``BlockMask``);
* :mod:`~unifusion.hf.ar.layout`: the network's input layout (the shift ``[BOS, x_t]``, padding, position ids);
* :mod:`~unifusion.hf.ar.blocks`: block diffusion, the ``[clean | noisy]`` layout in one forward and the KV-cache
  helpers;
* :mod:`~unifusion.hf.ar.time_embedding`: the optional learned time embedding;
* :mod:`~unifusion.hf.ar.head`: the output head, hidden states to logits as the family computes them, on the kept
  positions only;
* :mod:`~unifusion.hf.ar.model`: :class:`DiffusionLM`, the wrapper (forward, hidden states, fused loss);
* :mod:`~unifusion.hf.ar.adapted`: :class:`~unifusion.hf.ar.adapted.AdaptedLM`, what the helper modules read of
  the wrapper (they cannot import ``model``, which imports them);
* :mod:`~unifusion.hf.ar.decoding`: the decoders :class:`DiffusionLM` offers :func:`unifusion.samplers.generate`;
* :mod:`~unifusion.hf.ar.io`: ``save_pretrained`` / ``from_pretrained`` (safetensors, config, kernel, tokenizer);
* :mod:`~unifusion.hf.ar.adapt`: :func:`adapt_ar_model`, the entry point.

An AR model is adapted by :func:`adapt_ar_model`, not wrapped by ``config.model_type`` through
:mod:`unifusion.hf.registry`: any causal LM of a supported family is adapted, and its ``model_type`` names the
network, not a diffusion LM. Its registry is :mod:`~unifusion.hf.ar.families`; its saved folders are read by
:func:`unifusion.hf.load_diffusion_model`.
"""

from .adapt import adapt_ar_model
from .attention import anneal_schedule, annealed_attention_mask
from .families import Family, family_for, supported_model_types
from .io import WEIGHTS_NAME
from .model import DiffusionLM
from .time_embedding import TimeEmbedding

__all__ = ["WEIGHTS_NAME", "DiffusionLM", "Family", "TimeEmbedding", "adapt_ar_model",
           "anneal_schedule", "annealed_attention_mask", "family_for", "supported_model_types"]
