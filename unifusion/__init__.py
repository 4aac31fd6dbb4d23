"""unifusion: discrete-diffusion primitives in one reverse-rate view.

Kernels corrupt tokens; every parameterization (x0 prediction, SEDD's concrete score, M2S's posterior mean, Neural
CTMC's exit rate and jump distribution) induces reverse rates; all five published losses are one Bregman objective on
those rates; an x0 head converts exactly into the other three (Theorem 3.5).

    import unifusion as uf
    kernel = uf.UniformKernel(num_states=50257)
    x_t = kernel.sample(x0, t, generator=g)
    loss = uf.losses.gidd_loss(model(x_t), x0, x_t, t, kernel)      # (B, L), reduce as you like
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from . import eval, losses, models, samplers
from ._validation import set_validation, validation, validation_enabled
from .adapters import DiffusionLM, adapt_ar_model, anneal_schedule
from .backend import compile_stats, get_backend, set_backend, wait_for_compilation
from .conversions import convert_x0_to
from .kernels import GeneratorKernel, HybridKernel, InterpolatingKernel, Kernel, MaskKernel, UniformKernel
from .losses import bregman_rate_loss
from .rates import ReverseRate
from .samplers import BayesianSampler, EulerSampler
from .schedules import (
    CosineSchedule,
    DUOCosineSchedule,
    GeometricSchedule,
    LinearSchedule,
    LogLinearSchedule,
    MDLMCosineSchedule,
    Schedule,
)
from .training import DiffusionLossOutput, diffusion_loss, sample_times

try:
    __version__ = _version("unifusion")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0+local"

__all__ = [
    "BayesianSampler",
    "CosineSchedule",
    "DUOCosineSchedule",
    "DiffusionLM",
    "DiffusionLossOutput",
    "EulerSampler",
    "GeneratorKernel",
    "GeometricSchedule",
    "HybridKernel",
    "InterpolatingKernel",
    "Kernel",
    "LinearSchedule",
    "LogLinearSchedule",
    "MDLMCosineSchedule",
    "MaskKernel",
    "ReverseRate",
    "Schedule",
    "UniformKernel",
    "__version__",
    "adapt_ar_model",
    "anneal_schedule",
    "bregman_rate_loss",
    "compile_stats",
    "convert_x0_to",
    "diffusion_loss",
    "eval",
    "get_backend",
    "losses",
    "models",
    "samplers",
    "sample_times",
    "set_backend",
    "set_validation",
    "validation",
    "validation_enabled",
    "wait_for_compilation",
]
