"""DiffusionGemma (transformers' ``DiffusionGemmaForBlockDiffusion``) as a unifusion denoiser: one model kind.

* :mod:`~unifusion.hf.diffusion_gemma.model`: :class:`DiffusionGemmaLM`, the wrapper (forward, fused loss, save and
  load), and :func:`~unifusion.hf.diffusion_gemma.model.wrap`, what the registry calls;
* :mod:`~unifusion.hf.diffusion_gemma.layout`: where a batch's prompt and canvases lie, and what each canvas attends
  to;
* :mod:`~unifusion.hf.diffusion_gemma.cache`: the cached canvas operations (prefill, denoise, commit);
* :mod:`~unifusion.hf.diffusion_gemma.generation`: what :meth:`DiffusionGemmaLM.generate` does;
* :mod:`~unifusion.hf.diffusion_gemma.wrapped`: :class:`~unifusion.hf.diffusion_gemma.wrapped.WrappedDiffusionGemma`,
  what the cache and generation modules read of the wrapper (they cannot import the model module: it imports them).

Importing it registers ``model_type="diffusion_gemma"`` with :mod:`unifusion.hf.registry`, so
:func:`unifusion.hf.wrap_diffusion_lm` wraps the model and :func:`unifusion.hf.load_diffusion_model` reads its
checkpoint folders.
"""

from ..registry import register_diffusion_lm
from .generation import DiffusionGemmaOutput
from .model import DiffusionGemmaLM, wrap

__all__ = ["DiffusionGemmaLM", "DiffusionGemmaOutput"]

register_diffusion_lm("diffusion_gemma", wrap, loader=DiffusionGemmaLM.from_pretrained)
