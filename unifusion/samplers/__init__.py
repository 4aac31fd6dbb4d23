"""Samplers: generate token sequences from a trained model (paper App. C.5, Algorithm 2; §2 for the native rates).

* :class:`BayesianSampler` — Algorithm 2's posterior (ancestral) steps under an x0 model, for any kernel.
* :class:`EulerSampler` — τ-leaping on the reverse rates of an x0, SEDD, M2S or Neural-CTMC head, with the matching
  denoising final step; :func:`x0_model_as` turns an x0 model into any of those heads (Theorem 3.5).
* :class:`PolicySampler` — block decoding with a decoding policy (:mod:`unifusion.samplers.policies`: LLaDA, Dream,
  Fast-dLLM, DiffusionGemma), EOS stopping, tokens per forward.
* :func:`generate` — prompt continuation with a model, the one path behind the models' ``generate``
  (:mod:`unifusion.samplers.generation`; transformers' options in :mod:`unifusion.samplers.generation_options`).

Prompts and infilling: pass ``prompt=`` a ``(B, L)`` tensor with :data:`PROMPT_FILL` (−1) at the positions to
generate, or a pair ``(ids, keep_mask)``. :func:`resolve_attention_mask` (a tokenizer's left-padding mask, checked) and
:func:`eos_stop` (the EOS rule) are the pieces of the policy sampler's run that a model's own ``generate`` shares.
"""

from ._policy_run import eos_stop, resolve_attention_mask
from ._setup import PROMPT_FILL
from .bayesian import BayesianSampler
from .euler import PARAMETERIZATIONS, ConvertedModel, EulerSampler, x0_model_as
from .generation import generate
from .policy_sampler import BlockDenoiser, PolicyOutput, PolicySampler

__all__ = ["PARAMETERIZATIONS", "PROMPT_FILL", "BayesianSampler", "BlockDenoiser", "ConvertedModel", "EulerSampler",
           "PolicyOutput", "PolicySampler", "eos_stop", "generate", "resolve_attention_mask", "x0_model_as"]
