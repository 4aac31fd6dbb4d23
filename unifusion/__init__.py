"""unifusion: discrete-diffusion primitives in one reverse-rate view.

Kernels corrupt tokens; every parameterization (x0 prediction, SEDD's concrete score, M2S's posterior mean, Neural
CTMC's exit rate and jump distribution) induces reverse rates; all five published losses are one Bregman objective on
those rates; an x0 head converts exactly into the other three (Theorem 3.5). The main workflow — a pretrained causal
LM adapted into a (block) diffusion LM, trained with any objective, then sampled::

    import unifusion as uf
    model = uf.adapt_ar_model(hf_model, tokenizer=tok, block_size=32)    # shifted x0 denoiser, KV-cacheable blocks
    kernel = uf.MaskKernel(model.num_states, model.mask_token_id)
    out = uf.diffusion_loss(model, x0, kernel, step=step, prompt_mask=prompt_mask)   # per-position loss (B, L)
    (out.loss.sum() / out.num_tokens).backward()
    ids = model.generate(prompt_ids, max_new_tokens=64, policy=uf.samplers.policies.LowConfidence())

The front door holds the paper's objects and the everyday entry points; specialised helpers live in their
subpackages (:mod:`unifusion.losses`, :mod:`unifusion.samplers`, :mod:`unifusion.hf`, :mod:`unifusion.eval`,
:mod:`unifusion.schedules`) and the runtime switches in :mod:`unifusion.backend` and :mod:`unifusion.validation`.
"""

from importlib import metadata as _metadata

from . import backend, cpu_linears, distill, eval, hf, losses, precision, rl, samplers, schedules, validation
from .conversions import convert_x0_to
from .hf import DiffusionLM, adapt_ar_model, load_diffusion_lm, wrap_diffusion_lm
from .kernels import GeneratorKernel, HybridKernel, Kernel, MaskKernel, UniformKernel
from .losses import bregman_rate_loss
from .rates import ReverseRate
from .samplers import BayesianSampler, EulerSampler, PolicySampler
from .training import diffusion_loss, sample_times

try:
    __version__ = _metadata.version("unifusion")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0+local"

__all__ = [
    "BayesianSampler",
    "DiffusionLM",
    "EulerSampler",
    "GeneratorKernel",
    "HybridKernel",
    "Kernel",
    "MaskKernel",
    "PolicySampler",
    "ReverseRate",
    "UniformKernel",
    "__version__",
    "adapt_ar_model",
    "backend",
    "bregman_rate_loss",
    "convert_x0_to",
    "cpu_linears",
    "diffusion_loss",
    "distill",
    "eval",
    "hf",
    "load_diffusion_lm",
    "losses",
    "precision",
    "sample_times",
    "rl",
    "samplers",
    "schedules",
    "validation",
    "wrap_diffusion_lm",
]
