"""Fast-dLLM v2 (``model_type="Fast_dLLM_Qwen"``: Fast_dLLM_v2_1.5B / 7B, and models fine-tuned from them) on
transformers' Qwen2.

Fast-dLLM v2's network (the ``modeling.py`` of its Hub folders) is Qwen2's — biased q/k/v projections, RMSNorm,
SwiGLU, RoPE — with **block-causal** attention over blocks of ``bd_size`` columns (32 for the released models;
:mod:`unifusion.hf.native_block`): bidirectional inside a block, causal across blocks, blocks cut at column multiples
from the row's first token. It keeps the autoregressive head: its logits are **shifted**, column ``i − 1`` predicting
token ``i`` (its decoders read ``cat([logits[:, :1], logits[:, :-1]])`` inside a block, and take a block's first
token from the argmax at the previous block's last column). So x_θ(· | x_t)_i = softmax(W h_{i−1}), ``h`` the
block-causal forward: inside a block the prediction sees the block's noisy tokens, at a block's first column it sees
only the blocks before (an AR prediction). Position ids are the column index; the model takes no attention mask
(its evaluation fills shorter prompts on the right with the mask token), so this kind's padding rule — padded keys
blocked, position ids counting the real tokens — reproduces it on right-padded rows and on rows left-padded by a
multiple of the block size. The mask token is ``|<MASK>|`` of its tokenizer, id 151665 (its ``config.json`` names
none; a config that does — ``mask_token_id`` — is read), EOS 151645 (``<|im_end|>``), pad 151645. Its weights carry
Qwen2's names, so they map one to one onto ``Qwen2ForCausalLM``.

**Training objective.** Fast-dLLM v2's training (``Fast_dLLM_QwenForCausalLM.forward`` in train mode, with
``conplemenrary_mask`` set in its config) cuts each row into blocks of ``bd_size``, draws one time per block
(``p_mask = (1 − ε) t + ε``, ε = 10⁻³), masks the answer's tokens (``labels ≠ −100``) with probability ``p_mask``
and builds the complementary copy (every answer token the first copy kept is masked, and vice versa); each copy runs
as BD3-LM's ``[x_t | x_0]`` stream (:class:`~unifusion.hf.native_block.DoubledStreamPattern`) and the loss is
transformers' causal-LM cross-entropy (shifted labels) **averaged over the masked tokens of both copies, without the
1/p_mask weight**. So the masking is unifusion's ``block_times="block"``, ``complementary=True``; the unweighted
average is not an ELBO (unifusion's complementary pairs keep the ELBO weights): the ELBO version of their objective is
``uf.diffusion_loss(model, x0, model.kernel, objective="mdlm", block_times="block", complementary=True,
prompt_mask=...)``, which this kind trains with. In their stream the first token of a block is read at the previous
block's last **noisy** column; unifusion's block ELBO (and their decoders) read it at the clean previous block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..native import NativeDiffusionLM
from ..native_checkpoint import transformers_layout_settings, transformers_layout_weight_names

__all__ = ["DEFAULT_STOP_TOKEN_ID", "FastDLLMv2LM", "wrap"]

DEFAULT_STOP_TOKEN_ID = 151645
"""The released models' stop token (``<|im_end|>``), their decoders' ``stop_token`` default."""


class FastDLLMv2LM(NativeDiffusionLM):
    """Fast-dLLM v2 as an x0 denoiser: shifted, block-causal (``bd_size`` from its config), position ids counting
    the real tokens (module docstring).

    Load a checkpoint folder (theirs, or one :meth:`save_pretrained` wrote) with ``FastDLLMv2LM.from_pretrained(folder,
    dtype=torch.bfloat16)`` or ``uf.load_diffusion_lm(folder)``; no ``trust_remote_code``. :meth:`generate` decodes
    with unifusion's policies block by block; :meth:`generate_reference` is their own decoder (threshold decoding in
    sub-blocks).
    """

    model_type = "Fast_dLLM_Qwen"
    default_mask_token_id = 151665
    default_block_size = 32
    block_origin = "sequence_start"  # trained on blocks cut from the sequence start; so are its decoder's
    shifted = True
    positions_count_real_tokens = True
    backbone_family = "qwen2"

    @classmethod
    def block_size_of(cls, source: dict[str, Any]) -> int | None:
        """The block size K: the config's ``bd_size`` (32 when it names none); ``ValueError`` for a value that is not
        a positive int."""
        K = source.get("bd_size", cls.default_block_size)
        if isinstance(K, bool) or not isinstance(K, int) or K < 1:
            raise ValueError(f"config.json: bd_size = {K!r} is not a positive int ({cls.model_type})")
        return K

    @classmethod
    def backbone_config(cls, source: dict[str, Any]) -> Any:
        from transformers import Qwen2Config

        cls.block_size_of(source)
        if source.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window = true; Fast-dLLM v2's released models never window, so "
                             "a windowed Qwen2 backbone would not reproduce them")
        layer_types = source.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types):
            raise ValueError(f"config.json: layer_types = {layer_types!r}; only 'full_attention' layers are supported")
        return Qwen2Config(**transformers_layout_settings(source, "Fast-dLLM v2"))

    @classmethod
    def backbone_class(cls) -> type[nn.Module]:
        from transformers import Qwen2ForCausalLM

        return Qwen2ForCausalLM

    @classmethod
    def weight_names(cls, source: dict[str, Any]) -> dict[str, str]:
        layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
                 "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
        return transformers_layout_weight_names(source, layer)

    def generate_reference(self, prompt_ids: torch.Tensor, *, max_new_tokens: int,
                           attention_mask: torch.Tensor | None = None, small_block_size: int = 8,
                           threshold: float = 0.9, stop_token_id: int | None = DEFAULT_STOP_TOKEN_ID,
                           pad_token_id: int | None = None) -> list[torch.Tensor]:
        """Fast-dLLM v2's own decoder (their evaluation's ``batch_sample``,
        :func:`unifusion.hf.fast_dllm.generation.fast_dllm_generate`): greedy threshold decoding in sub-blocks of
        ``small_block_size`` inside each block, a block's first token the argmax at the previous block's last column,
        rows stopping at ``stop_token_id``; one token-id tensor per row (rows stop at different lengths)."""
        from .generation import fast_dllm_generate

        return fast_dllm_generate(self, prompt_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                  small_block_size=small_block_size, threshold=threshold, stop_token_id=stop_token_id,
                                  pad_token_id=pad_token_id)


def wrap(model: nn.Module, **kwargs: Any) -> NativeDiffusionLM:
    """Fast-dLLM v2's own ``Fast_dLLM_QwenForCausalLM`` (loaded with ``trust_remote_code``) as a
    :class:`FastDLLMv2LM` (:meth:`~unifusion.hf.native.NativeDiffusionLM.from_reference`: its tensors moved onto a Qwen2
    backbone, not copied)."""
    return FastDLLMv2LM.from_reference(model, **kwargs)
