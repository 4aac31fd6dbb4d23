"""SDAR and TraDo (``model_type="sdar"``: SDAR-1.7B/4B/8B/30B-A3B-Chat's dense models, TraDo-4B/8B, and the models
fine-tuned from them) on transformers' Qwen3.

SDAR's network (its ``modeling_sdar.py``, a copy of transformers' Qwen3) is Qwen3's: RMSNorm, SwiGLU, RoPE, the
per-head ``q_norm``/``k_norm``, no biases — with **block-causal** attention over blocks of ``block_size`` columns
(4 for the released models; :mod:`unifusion.hf.native_block`): bidirectional inside a block, causal across blocks.
Its head is **unshifted** (column ``i`` predicts token ``i``: its generate reads the logits of the block's own
columns, its training scores ``labels`` at the noisy positions), position ids count from the row's first token, and
the mask token is ``mask_token_id`` of its ``config.json`` (151669, ``<|MASK|>``). Its weights carry Qwen3's names,
so they map one to one onto ``Qwen3ForCausalLM``.

**Training objective.** SDAR's training (``SDARForCausalLM.forward`` in train mode) runs the ``[x_t | x_0]`` stream
(:class:`~unifusion.hf.native_block.DoubledStreamPattern`) with one time ``t ~ U(ε, 1)`` per sequence
(``p_mask = (1 − ε) t + ε``, ε = 10⁻³), the answer's tokens masked with probability ``p_mask`` (the prompt clean), and
the loss ``Σ_{masked} CE / p_mask`` over the answer's token count: the block MDLM ELBO with one time for all blocks —
``uf.diffusion_loss(model, x0, model.kernel, objective="mdlm", block_times="sequence", t_min=1e-3,
prompt_mask=...)`` (``block_times="block"``, one time per block, is the same ELBO with less variance).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from ..native import NativeDiffusionLM
from ..native_checkpoint import transformers_layout_settings, transformers_layout_weight_names

__all__ = ["SDARLM", "wrap"]


class SDARLM(NativeDiffusionLM):
    """SDAR as an x0 denoiser: unshifted, block-causal (``block_size`` from its config), positions counting the real
    tokens (module docstring).

    Load a checkpoint folder (theirs, or one :meth:`save_pretrained` wrote) with ``SDARLM.from_pretrained(folder,
    dtype=torch.bfloat16)`` or ``uf.load_diffusion_lm(folder)``; no ``trust_remote_code``. ``generate`` decodes block
    by block through the exact KV cache (``use_cache=True``, the default).
    """

    model_type = "sdar"
    default_mask_token_id = 151669
    default_block_size = 4
    block_origin = "sequence_start"  # trained on blocks cut from the sequence start; so are its decoder's
    shifted = False
    positions_count_real_tokens = True
    backbone_family = "qwen3"

    @classmethod
    def backbone_config(cls, source: dict[str, Any]) -> Any:
        from transformers import Qwen3Config

        if source.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window = true; SDAR's released models never window (and its "
                             "SDPA path ignores windows), so a windowed Qwen3 backbone would not reproduce it")
        settings = transformers_layout_settings(source, "SDAR")
        if source.get("attention_bias"):
            raise ValueError("config.json: attention_bias = true; SDAR's released models have no attention biases")
        heads = int(source["num_attention_heads"])
        return Qwen3Config(**settings, head_dim=int(source.get("head_dim") or int(source["hidden_size"]) // heads),
                           attention_bias=False)

    @classmethod
    def backbone_class(cls) -> type[nn.Module]:
        from transformers import Qwen3ForCausalLM

        return Qwen3ForCausalLM

    @classmethod
    def weight_names(cls, source: dict[str, Any]) -> dict[str, str]:
        layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight"]
        return transformers_layout_weight_names(source, layer)

    def block_diffusion_generate(
            self, prompt_ids: torch.Tensor, *, gen_length: int = 128, denoising_steps: int | None = None,
            temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
            remasking_strategy: Literal["low_confidence_dynamic", "low_confidence_static", "sequential"]
            = "low_confidence_dynamic", confidence_threshold: float = 0.85,
            stopping_criteria_idx: list[int] | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """SDAR's own block decoder (its ``generate.py`` ``block_diffusion_generate``,
        :func:`unifusion.hf.sdar.generation.block_diffusion_generate`): blocks at column multiples of the model's
        block size, ``denoising_steps`` steps per block (default the block size), the remasking strategies
        ``"low_confidence_dynamic"`` (its default), ``"low_confidence_static"`` and ``"sequential"``; ``(B, n_b K)``
        token ids. Greedy is ``top_k=1``."""
        from .generation import block_diffusion_generate

        return block_diffusion_generate(
            self, prompt_ids, gen_length=gen_length, denoising_steps=denoising_steps, temperature=temperature,
            top_k=top_k, top_p=top_p, remasking_strategy=remasking_strategy,
            confidence_threshold=confidence_threshold, stopping_criteria_idx=stopping_criteria_idx,
            generator=generator)


def wrap(model: nn.Module, **kwargs: Any) -> NativeDiffusionLM:
    """SDAR's own ``SDARForCausalLM`` (loaded with ``trust_remote_code``) as an :class:`SDARLM`
    (:meth:`~unifusion.hf.native.NativeDiffusionLM.from_reference`: its tensors moved onto a Qwen3 backbone, not
    copied)."""
    return SDARLM.from_reference(model, **kwargs)
