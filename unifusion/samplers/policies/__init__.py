"""Decoding policies for :class:`~unifusion.samplers.PolicySampler`: which positions of a block to decide at each
step (pure batched functions; :mod:`.protocol` says what a policy sees and returns).

Mask noise (:mod:`.mask`): :class:`RandomOrder`, :class:`LowConfidence` (LLaDA), :class:`TopKMargin`,
:class:`TopKEntropy` (Dream), :class:`ConfidenceThreshold` (Fast-dLLM). Uniform noise (:mod:`.uniform`):
:class:`EntropyBound` (transformers' DiffusionGemma).
"""

from .mask import ConfidenceThreshold, LowConfidence, RandomOrder, TopKEntropy, TopKMargin
from .protocol import DecodingPolicy, MaskPolicy, PolicyStep, RowRandomness, select_top
from .registry import POLICY_NAMES, default_policy, make_policy
from .uniform import EntropyBound, categorical_entropy

__all__ = ["POLICY_NAMES", "ConfidenceThreshold", "DecodingPolicy", "EntropyBound", "LowConfidence", "MaskPolicy",
           "PolicyStep", "RandomOrder", "RowRandomness", "TopKEntropy", "TopKMargin", "categorical_entropy",
           "default_policy", "make_policy", "select_top"]
