"""Fast-dLLM v2 (``model_type="Fast_dLLM_Qwen"``) as a unifusion denoiser on transformers' Qwen2: one model kind.

* :mod:`~unifusion.hf.fast_dllm.model`: :class:`FastDLLMv2LM` (its conventions — shifted, block-causal over
  ``bd_size`` columns — and its weight names, Qwen2's own) and :func:`~unifusion.hf.fast_dllm.model.wrap`, what the
  registry calls;
* :mod:`~unifusion.hf.fast_dllm.generation`: Fast-dLLM v2's own decoder (:meth:`FastDLLMv2LM.generate_reference`).

Importing it registers ``model_type="Fast_dLLM_Qwen"`` with :mod:`unifusion.hf.registry`, so
:func:`unifusion.load_diffusion_lm` reads Fast-dLLM v2's checkpoint folders (no ``trust_remote_code``) and
:func:`unifusion.hf.wrap_diffusion_lm` converts its own ``Fast_dLLM_QwenForCausalLM``.
"""

from ..registry import register_diffusion_lm
from .model import FastDLLMv2LM, wrap

__all__ = ["FastDLLMv2LM"]

register_diffusion_lm("Fast_dLLM_Qwen", wrap, loader=FastDLLMv2LM.from_pretrained)
