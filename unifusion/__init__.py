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

import warnings as _warnings
from importlib import metadata as _metadata
from typing import Any as _Any

from . import backend, eval, hf, losses, rl, samplers, schedules, validation
from .conversions import convert_x0_to
from .hf import DiffusionLM, adapt_ar_model, wrap_diffusion_lm
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
    "diffusion_loss",
    "eval",
    "hf",
    "losses",
    "sample_times",
    "rl",
    "samplers",
    "schedules",
    "validation",
    "wrap_diffusion_lm",
]


class _ValidationModule(type(validation)):  # type: ignore[misc]
    """:mod:`unifusion.validation`, also callable for one release: ``uf.validation(False)`` was the context manager
    (now ``unifusion.validation.validation``)."""

    def __call__(self, enabled: bool) -> _Any:
        _warnings.warn("calling unifusion.validation(...) is deprecated and will be removed in the next release; use "
                      "unifusion.validation.validation(...)", DeprecationWarning, stacklevel=2)
        return self.validation(enabled)


validation.__class__ = _ValidationModule

# Names the front door held before this release: each still resolves, with a DeprecationWarning naming its home.
_MOVED = {
    "set_validation": "unifusion.validation", "validation_enabled": "unifusion.validation",
    "set_backend": "unifusion.backend", "get_backend": "unifusion.backend",
    "compile_stats": "unifusion.backend", "wait_for_compilation": "unifusion.backend",
    "anneal_schedule": "unifusion.hf", "InterpolatingKernel": "unifusion.kernels",
    "DiffusionLossOutput": "unifusion.training",
    "Schedule": "unifusion.schedules", "LinearSchedule": "unifusion.schedules",
    "CosineSchedule": "unifusion.schedules", "LogLinearSchedule": "unifusion.schedules",
    "GeometricSchedule": "unifusion.schedules", "MDLMCosineSchedule": "unifusion.schedules",
    "DUOCosineSchedule": "unifusion.schedules",
}


def __getattr__(name: str) -> _Any:
    import importlib

    if name in ("adapters", "models"):  # deprecated modules kept for one release (their names warn)
        return importlib.import_module(f".{name}", __name__)
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _warnings.warn(f"unifusion.{name} is deprecated and will be removed in the next release; use {home}.{name}",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)
