"""LLaDA-MoE (``model_type="lladamoe"``) as a unifusion denoiser on transformers' Qwen3-MoE: one model kind.

* :mod:`~unifusion.hf.lladamoe.model`: :class:`LLaDAMoELM` (its conventions and its weight names on Qwen3-MoE's fused
  experts) and :func:`~unifusion.hf.lladamoe.model.wrap`, what the registry calls.

Importing it registers ``model_type="lladamoe"`` with :mod:`unifusion.hf.registry`, so
:func:`unifusion.load_diffusion_lm` reads LLaDA-MoE's checkpoint folders (no ``trust_remote_code``) and
:func:`unifusion.hf.wrap_diffusion_lm` converts its own ``LLaDAMoEModelLM``. Its sampler (dllm's ``MDLMSampler``,
LLaDA's low-confidence remasking) is :meth:`~unifusion.hf.native.NativeDiffusionLM.generate` with ``LowConfidence()``.
"""

from ..registry import register_diffusion_lm
from .model import LLaDAMoELM, wrap

__all__ = ["LLaDAMoELM"]

register_diffusion_lm("lladamoe", wrap, loader=LLaDAMoELM.from_pretrained)
