"""LLaDA 2.x (``model_type="llada2_moe"``) as a unifusion denoiser: one model kind.

* :mod:`~unifusion.hf.llada2.architecture`: its network as a transformers model in its own weight layout
  (:class:`LLaDA2MoeForCausalLM`, on transformers' GLM-4.5 MoE);
* :mod:`~unifusion.hf.llada2.model`: :class:`LLaDA2LM` (its conventions and its weight names) and
  :func:`~unifusion.hf.llada2.model.wrap`, what the registry calls;
* :mod:`~unifusion.hf.llada2.generation`: LLaDA 2.0's and 2.1's own samplers (:meth:`LLaDA2LM.generate_reference`).

Importing it registers ``model_type="llada2_moe"`` with :mod:`unifusion.hf.registry`, so
:func:`unifusion.load_diffusion_lm` reads LLaDA 2's checkpoint folders (no ``trust_remote_code``) and
:func:`unifusion.hf.wrap_diffusion_lm` converts its own ``LLaDA2MoeModelLM``.
"""

from ..registry import register_diffusion_lm
from .architecture import LLaDA2MoeForCausalLM
from .model import LLaDA2LM, wrap

__all__ = ["LLaDA2LM", "LLaDA2MoeForCausalLM"]

register_diffusion_lm("llada2_moe", wrap, loader=LLaDA2LM.from_pretrained)
