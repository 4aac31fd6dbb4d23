"""Deprecated: the model loaders live in :mod:`unifusion.hf` (kept for one release).

``from unifusion.models import load_smollm2`` still works and warns (``DeprecationWarning``) with the new path:
``from unifusion.hf import load_smollm2``.
"""

from __future__ import annotations

from ._deprecation import moved_names

__getattr__, __dir__ = moved_names(__name__, {
    **dict.fromkeys(["load_smollm2", "load_smollm2_tokenizer", "smollm2_gguf_path", "load_causal_lm",
                     "load_diffusion_model", "dtype_from_name", "KERNEL_NAMES", "kernel_config",
                     "kernel_from_config", "default_kernel"], "unifusion.hf"),
    **dict.fromkeys(["SMOLLM2_PACKAGE", "SMOLLM2_GGUF"], "unifusion.hf.embedded"),
})
