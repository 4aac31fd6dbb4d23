"""Dream (``model_type="Dream"``: Dream 7B, Dream-Coder, DiffuCoder) as a unifusion denoiser on transformers' Qwen2:
one model kind.

* :mod:`~unifusion.hf.dream.model`: :class:`DreamLM` (its conventions and its weight names, Qwen2's own) and
  :func:`~unifusion.hf.dream.model.wrap`, what the registry calls;
* :mod:`~unifusion.hf.dream.generation`: Dream's own sampler (:meth:`DreamLM.diffusion_generate`).

Importing it registers ``model_type="Dream"`` with :mod:`unifusion.hf.registry`, so :func:`unifusion.load_diffusion_lm`
reads Dream's checkpoint folders (no ``trust_remote_code``) and :func:`unifusion.hf.wrap_diffusion_lm` converts its
own ``DreamModel``.
"""

from ..registry import register_diffusion_lm
from .model import DreamLM, wrap

__all__ = ["DreamLM"]

register_diffusion_lm("Dream", wrap, loader=DreamLM.from_pretrained)
