"""LLaDA (``model_type="llada"``) as a unifusion denoiser on transformers' Llama: one model kind.

* :mod:`~unifusion.hf.llada.model`: :class:`LLaDALM` (its conventions and its weight names on Llama's) and
  :func:`~unifusion.hf.llada.model.wrap`, what the registry calls;
* :mod:`~unifusion.hf.llada.generation`: LLaDA's own sampler (:meth:`LLaDALM.generate_reference`).

Importing it registers ``model_type="llada"`` with :mod:`unifusion.hf.registry`, so :func:`unifusion.load_diffusion_lm`
reads LLaDA's checkpoint folders (no ``trust_remote_code``) and :func:`unifusion.hf.wrap_diffusion_lm` converts its
own ``LLaDAModelLM``.
"""

from ..registry import register_diffusion_lm
from .model import LLaDALM, wrap

__all__ = ["LLaDALM"]

register_diffusion_lm("llada", wrap, loader=LLaDALM.from_pretrained)
