"""SDAR / TraDo (``model_type="sdar"``) as a unifusion denoiser on transformers' Qwen3: one model kind.

* :mod:`~unifusion.hf.sdar.model`: :class:`SDARLM` (its conventions, its weight names on Qwen3's) and
  :func:`~unifusion.hf.sdar.model.wrap`, what the registry calls;
* :mod:`~unifusion.hf.sdar.generation`: SDAR's own block decoder (:meth:`SDARLM.block_diffusion_generate`).

Importing it registers ``model_type="sdar"`` with :mod:`unifusion.hf.registry`, so :func:`unifusion.load_diffusion_lm`
reads SDAR's checkpoint folders (no ``trust_remote_code``) and :func:`unifusion.hf.wrap_diffusion_lm` converts its
own ``SDARForCausalLM``.
"""

from ..registry import register_diffusion_lm
from .model import SDARLM, wrap

__all__ = ["SDARLM"]

register_diffusion_lm("sdar", wrap, loader=SDARLM.from_pretrained)
