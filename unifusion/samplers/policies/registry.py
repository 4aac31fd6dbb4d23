"""Decoding policies by name: what the command line (``unifusion sample --policy``), the lm-eval model
(``policy=...``) and the frontier take.

====================  ==============================================  ====================
name                  policy                                          option
====================  ==============================================  ====================
``low_confidence``    :class:`~.mask.LowConfidence` (LLaDA)
``random``            :class:`~.mask.RandomOrder`
``margin``            :class:`~.mask.TopKMargin` (Dream)
``entropy``           :class:`~.mask.TopKEntropy` (Dream)
``threshold``         :class:`~.mask.ConfidenceThreshold` (Fast-dLLM) ``threshold`` (default 0.9)
``entropy_bound``     :class:`~.uniform.EntropyBound` (DiffusionGemma) ``bound`` (default 1.0)
``llada``             :class:`~.reference.LLaDAOrder` (LLaDA's
                      ``generate.py``, low-confidence remasking)
``llada_random``      :class:`~.reference.LLaDAOrder` (``"random"``)
``dream_<alg>``       :class:`~.reference.DreamOrder` (Dream's ``alg``:
                      ``origin``, ``maskgit_plus``, ``topk_margin``,
                      ``entropy``)
``sdar``              :class:`~.reference.SDAROrder` (SDAR's dynamic    ``threshold`` (default 0.85)
                      low-confidence remasking)
``sdar_static``,      :class:`~.reference.SDAROrder`
``sdar_sequential``
``fast_dllm_v2``      :class:`~.reference.FastDLLMv2Order` (sub-blocks  ``threshold`` (default 0.9)
                      of 8)
====================  ==============================================  ====================

The reference policies (:mod:`.reference`) reproduce the released models' own samplers token for token, their random
draws included.

:func:`default_policy` is what a block model decodes with when no policy is given.
"""

from __future__ import annotations

from ...kernels import InterpolatingKernel, Kernel
from .mask import ConfidenceThreshold, LowConfidence, RandomOrder, TopKEntropy, TopKMargin
from .protocol import DecodingPolicy
from .reference import DreamOrder, FastDLLMv2Order, LLaDAOrder, SDAROrder
from .uniform import EntropyBound

__all__ = ["DEFAULT_BOUND", "DEFAULT_SDAR_THRESHOLD", "DEFAULT_THRESHOLD", "POLICY_NAMES", "default_policy",
           "make_policy"]

POLICY_NAMES = ("low_confidence", "random", "margin", "entropy", "threshold", "entropy_bound", "llada", "llada_random",
                "dream_origin", "dream_maskgit_plus", "dream_topk_margin", "dream_entropy", "sdar", "sdar_static",
                "sdar_sequential", "fast_dllm_v2")
"""The names :func:`make_policy` takes."""

DEFAULT_THRESHOLD = 0.9
"""``threshold``'s confidence τ when none is given."""

DEFAULT_SDAR_THRESHOLD = 0.85
"""``sdar``'s confidence threshold when none is given (SDAR's ``confidence_threshold``)."""

DEFAULT_BOUND = 1.0
"""``entropy_bound``'s entropy bound when none is given."""


def make_policy(name: str, *, threshold: float | None = None, bound: float | None = None,
                arg: str = "policy") -> DecodingPolicy:
    """The policy called ``name`` (:data:`POLICY_NAMES`), with ``threshold`` (``threshold``, ``sdar`` and
    ``fast_dllm_v2`` only) or ``bound`` (``entropy_bound`` only); ``arg`` names the argument in errors."""
    if not isinstance(name, str) or name not in POLICY_NAMES:
        raise ValueError(f"{arg}: expected one of {', '.join(POLICY_NAMES)}, got {name!r}")
    if threshold is not None and name not in ("threshold", "sdar", "fast_dllm_v2"):
        raise ValueError(f"threshold: only the threshold, sdar and fast_dllm_v2 policies take one (got "
                         f"{arg}={name!r})")
    if bound is not None and name != "entropy_bound":
        raise ValueError(f"bound: only the entropy_bound policy takes one (got {arg}={name!r})")
    if name == "threshold":
        return ConfidenceThreshold(DEFAULT_THRESHOLD if threshold is None else threshold)
    if name == "entropy_bound":
        return EntropyBound(DEFAULT_BOUND if bound is None else bound)
    if name.startswith("llada"):
        return LLaDAOrder("random" if name == "llada_random" else "low_confidence")
    if name.startswith("dream_"):
        return DreamOrder(name[len("dream_"):])
    if name == "fast_dllm_v2":
        return FastDLLMv2Order(DEFAULT_THRESHOLD if threshold is None else threshold)
    if name.startswith("sdar"):
        strategy = {"sdar": "low_confidence_dynamic", "sdar_static": "low_confidence_static",
                    "sdar_sequential": "sequential"}[name]
        return SDAROrder(strategy, DEFAULT_SDAR_THRESHOLD if threshold is None else threshold)
    return {"low_confidence": LowConfidence, "random": RandomOrder, "margin": TopKMargin,
            "entropy": TopKEntropy}[name]()


def default_policy(kernel: Kernel) -> DecodingPolicy:
    """The policy a block model decodes with when none is given (``DiffusionLM.generate(policy=None)``, ``unifusion
    sample``, the harness's ``generate_until``): :class:`~.mask.LowConfidence` (LLaDA's order) for a mask kernel,
    :class:`~.uniform.EntropyBound` with bound :data:`DEFAULT_BOUND` for a uniform one. With the sampler's default of
    ``block_size`` steps per block, a fixed-count policy commits one token per step: the slowest and most careful
    setting; pass ``num_steps`` (fewer steps per block) or ``ConfidenceThreshold`` for more tokens per forward.
    A kernel with both mask and uniform noise has no decoding policy: a ``ValueError`` naming ``policy``."""
    if isinstance(kernel, InterpolatingKernel) and not kernel.has_uniform_noise and kernel.mask_id is not None:
        return LowConfidence()
    if isinstance(kernel, InterpolatingKernel) and kernel.mask_id is None:
        return EntropyBound(DEFAULT_BOUND)
    raise ValueError(f"policy: no decoding policy decodes {type(kernel).__name__} noise (mask policies need a "
                     "MaskKernel, EntropyBound a UniformKernel), so a block model trained with it has no default; "
                     "decode with a kernel a policy takes")
