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
====================  ==============================================  ====================
"""

from __future__ import annotations

from .mask import ConfidenceThreshold, LowConfidence, RandomOrder, TopKEntropy, TopKMargin
from .protocol import DecodingPolicy
from .uniform import EntropyBound

__all__ = ["DEFAULT_BOUND", "DEFAULT_THRESHOLD", "POLICY_NAMES", "make_policy"]

POLICY_NAMES = ("low_confidence", "random", "margin", "entropy", "threshold", "entropy_bound")
"""The names :func:`make_policy` takes."""

DEFAULT_THRESHOLD = 0.9
"""``threshold``'s confidence τ when none is given."""

DEFAULT_BOUND = 1.0
"""``entropy_bound``'s entropy bound when none is given."""


def make_policy(name: str, *, threshold: float | None = None, bound: float | None = None,
                arg: str = "policy") -> DecodingPolicy:
    """The policy called ``name`` (:data:`POLICY_NAMES`), with ``threshold`` (``threshold`` only) or ``bound``
    (``entropy_bound`` only); ``arg`` names the argument in errors."""
    if not isinstance(name, str) or name not in POLICY_NAMES:
        raise ValueError(f"{arg}: expected one of {', '.join(POLICY_NAMES)}, got {name!r}")
    if threshold is not None and name != "threshold":
        raise ValueError(f"threshold: only the threshold policy takes one (got {arg}={name!r})")
    if bound is not None and name != "entropy_bound":
        raise ValueError(f"bound: only the entropy_bound policy takes one (got {arg}={name!r})")
    if name == "threshold":
        return ConfidenceThreshold(DEFAULT_THRESHOLD if threshold is None else threshold)
    if name == "entropy_bound":
        return EntropyBound(DEFAULT_BOUND if bound is None else bound)
    return {"low_confidence": LowConfidence, "random": RandomOrder, "margin": TopKMargin,
            "entropy": TopKEntropy}[name]()
