"""Dream (``model_type="Dream"``: Dream-v0 7B Base/Instruct, Dream-Coder, DiffuCoder) on transformers' Qwen2.

Dream's network (its ``modeling_dream.py``) is Qwen2's — biased q/k/v projections, RMSNorm, SwiGLU, RoPE — with full
bidirectional attention. It keeps the autoregressive head: its logits are **shifted**, column ``i − 1`` predicting
token ``i`` (its ``diffusion_generate`` reads ``cat([logits[:, :1], logits[:, :-1]])``). For left-padded prompts its
generate passes position ids that count the real tokens (``cumsum(mask) − 1``), which this kind uses whenever an
``attention_mask`` is given. The mask token is ``mask_token_id`` of its ``config.json`` (151666 for the released
models; pad 151643, EOS 151643). Its weight names are Qwen2's own (``model.layers.{i}.self_attn.q_proj.weight``,
...), so the mapping is the identity.

Its training loss here is the MDLM ELBO with ``1/t`` weights, ``uf.diffusion_loss(model, x0, model.kernel,
objective="mdlm")``. Dream's own fine-tuning (dllm's Dream trainer) weights the masked tokens by CART instead (a
geometric kernel over the masked neighbours, ``p = 0.3``), which is not an ELBO weighting and which unifusion does not
reproduce; it also prepends BOS to every row so that the first token has a predecessor column (here the first token
reads its own column: keep it in the prompt, or start rows with BOS).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from ..native import NativeDiffusionLM
from ..native_checkpoint import transformers_layout_settings, transformers_layout_weight_names

__all__ = ["DreamLM", "wrap"]


class DreamLM(NativeDiffusionLM):
    """Dream as an x0 denoiser: shifted, bidirectional, positions counting the real tokens (module docstring).

    Load a checkpoint folder (theirs, or one :meth:`save_pretrained` wrote) with ``DreamLM.from_pretrained(folder,
    dtype=torch.bfloat16)`` or ``uf.load_diffusion_lm(folder)``; no ``trust_remote_code``.
    """

    model_type = "Dream"
    default_mask_token_id = 151666
    shifted = True
    positions_count_real_tokens = True
    backbone_family = "qwen2"

    @classmethod
    def backbone_config(cls, source: dict[str, Any]) -> Any:
        from transformers import Qwen2Config

        if source.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window = true; Dream's own attention never windows (its SDPA "
                             "layers ignore the setting), so a windowed Qwen2 backbone would not reproduce it")
        return Qwen2Config(**transformers_layout_settings(source, "Dream"))

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

    def diffusion_generate(self, prompt_ids: torch.Tensor, *, max_new_tokens: int, steps: int = 512,
                           alg: Literal["origin", "maskgit_plus", "topk_margin", "entropy"] = "origin",
                           **kwargs: Any) -> torch.Tensor:
        """Dream's own sampler (its ``diffusion_generate``: ``alg`` ``"origin"``, ``"maskgit_plus"``,
        ``"topk_margin"``, ``"entropy"`` on its time grid); ``(B, P + max_new_tokens)`` token ids. :meth:`generate`
        with ``policy=DreamOrder(alg, alg_temp=..., eps=...)``, ``num_steps=steps`` gives the same tokens
        (:class:`~unifusion.samplers.policies.DreamOrder`). Keyword arguments as
        :func:`unifusion.hf.dream.generation.diffusion_generate` (``attention_mask``, ``eps``, ``temperature``,
        ``top_p``, ``top_k``, ``alg_temp``, ``generator``)."""
        from .generation import diffusion_generate

        return diffusion_generate(self, prompt_ids, max_new_tokens=max_new_tokens, steps=steps, alg=alg, **kwargs)


def wrap(model: nn.Module, **kwargs: Any) -> NativeDiffusionLM:
    """Dream's own ``DreamModel`` (loaded with ``trust_remote_code``) as a :class:`DreamLM`
    (:meth:`~unifusion.hf.native.NativeDiffusionLM.from_reference`: its tensors moved onto a Qwen2 backbone, not
    copied)."""
    return DreamLM.from_reference(model, **kwargs)
