"""Static checks, type-checked by mypy with the package (``tests/test_typing.py::test_mypy_is_clean``), never run.

Each model kind's helper modules read the model through a protocol (they cannot import the model's module, which
imports them): the wrapper must satisfy it. A member the wrapper drops or retypes fails mypy here.
"""

from __future__ import annotations

from unifusion.denoiser import HiddenStateBlockDenoiser, HiddenStateModel
from unifusion.hf import DiffusionGemmaLM, DiffusionLM
from unifusion.hf.ar.adapted import AdaptedLM
from unifusion.hf.ar.decoding import BlockCacheDecoder, BlockForward, PrefixCacheDecoder
from unifusion.hf.diffusion_gemma.wrapped import WrappedDiffusionGemma


def diffusion_lm_is_an_adapted_lm(model: DiffusionLM) -> AdaptedLM:
    return model


def diffusion_gemma_lm_is_a_wrapped_diffusion_gemma(model: DiffusionGemmaLM) -> WrappedDiffusionGemma:
    return model


def diffusion_lm_decoders_give_hidden_states(cached: BlockCacheDecoder, prefix: PrefixCacheDecoder
                                             ) -> tuple[HiddenStateBlockDenoiser, HiddenStateBlockDenoiser]:
    return cached, prefix


def diffusion_lm_and_its_block_forward_give_hidden_states(model: DiffusionLM, forward: BlockForward
                                                          ) -> tuple[HiddenStateModel, HiddenStateModel]:
    return model, forward
