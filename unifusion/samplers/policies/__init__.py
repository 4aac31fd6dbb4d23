"""Decoding policies for :class:`~unifusion.samplers.PolicySampler`: which positions of a block to decide at each
step (pure batched functions; :mod:`.protocol` says what a policy sees and returns).

Mask noise (:mod:`.mask`): :class:`RandomOrder`, :class:`LowConfidence` (LLaDA), :class:`TopKMargin`,
:class:`TopKEntropy` (Dream), :class:`ConfidenceThreshold` (Fast-dLLM), each with a transfer schedule
(:mod:`.schedules`: :class:`EvenSplit`, LLaDA's; :class:`TimeGrid`, Dream's; :class:`RoundedSplit`, dllm's MDLM
sampler's). The released models' own samplers, their random draws included (:mod:`.reference`):
:class:`LLaDAOrder`, :class:`DreamOrder`, :class:`SDAROrder`, :class:`FastDLLMv2Order`.
Uniform noise (:mod:`.uniform`): :class:`EntropyBound` (transformers' DiffusionGemma).
"""

from .mask import ConfidenceThreshold, LowConfidence, RandomOrder, TopKEntropy, TopKMargin
from .protocol import BlockStep, DecodingPolicy, MaskPolicy, PolicyStep, RowRandomness, select_top
from .reference import DreamOrder, FastDLLMv2Order, LLaDAOrder, SDAROrder
from .registry import POLICY_NAMES, default_policy, make_policy
from .schedules import EvenSplit, RoundedSplit, TimeGrid, TransferSchedule
from .uniform import EntropyBound, categorical_entropy

__all__ = ["POLICY_NAMES", "BlockStep", "ConfidenceThreshold", "DecodingPolicy", "DreamOrder", "EntropyBound",
           "EvenSplit", "FastDLLMv2Order", "LLaDAOrder", "LowConfidence", "MaskPolicy", "PolicyStep", "RandomOrder",
           "RoundedSplit", "RowRandomness", "SDAROrder", "TimeGrid", "TopKEntropy", "TopKMargin", "TransferSchedule",
           "categorical_entropy", "default_policy", "make_policy", "select_top"]
