"""Deprecated: the Hugging Face adapter lives in :mod:`unifusion.hf` (kept for one release).

``from unifusion.adapters import DiffusionLM`` still works and warns (``DeprecationWarning``) with the new path:
``from unifusion.hf import DiffusionLM``.
"""

from __future__ import annotations

from ._deprecation import moved_names

__getattr__, __dir__ = moved_names(__name__, dict.fromkeys(
    ["DiffusionLM", "adapt_ar_model", "anneal_schedule", "annealed_attention_mask", "TimeEmbedding", "CONFIG_NAME",
     "WEIGHTS_NAME"], "unifusion.hf"))
