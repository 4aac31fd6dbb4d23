"""LLaDA (``model_type="llada"``: LLaDA-8B Base/Instruct, LLaDA 1.5, and the models fine-tuned from them) on
transformers' Llama.

LLaDA's network (its ``modeling_llada.py``, an OLMo derivative with ``block_type="llama"``) is Llama's: RMSNorm,
SwiGLU, RoPE (the same half-rotation), no biases, untied head — with full bidirectional attention, padded keys
masked. Its head is **unshifted** (column ``i`` predicts token ``i``), position ids are the column index (padding
included), and the mask token is ``mask_token_id`` of its ``config.json`` (126336 for the released models, whose
vocabulary has 126464 entries; EOS and pad 126081). Its weights map one to one onto ``LlamaForCausalLM``'s:

==========================================  =========================================================
LLaDA (``model.transformer.``…)              Llama (``model.layers.{i}.`` for the blocks)
==========================================  =========================================================
``wte.weight``                              ``model.embed_tokens.weight``
``blocks.{i}.attn_norm`` / ``ff_norm``      ``input_layernorm`` / ``post_attention_layernorm``
``blocks.{i}.q_proj`` / ``k_proj`` / ...    ``self_attn.q_proj`` / ``k_proj`` / ``v_proj``
``blocks.{i}.attn_out``                     ``self_attn.o_proj``
``blocks.{i}.ff_proj`` / ``up_proj``        ``mlp.gate_proj`` / ``mlp.up_proj``
``blocks.{i}.ff_out``                       ``mlp.down_proj``
``ln_f.weight``                             ``model.norm.weight``
``ff_out.weight`` (none with weight_tying)  ``lm_head.weight``
==========================================  =========================================================

Its training loss is the MDLM ELBO: ``t ~ U(ε, 1)``, each token masked with probability ``t``, cross-entropy on the
masked tokens weighted ``1/t`` — ``uf.diffusion_loss(model, x0, model.kernel, objective="mdlm")`` (its SFT keeps
the prompt clean: ``prompt_mask=``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from ..native import NativeDiffusionLM

__all__ = ["LLaDALM", "UNSUPPORTED_SETTINGS", "wrap"]

UNSUPPORTED_SETTINGS: dict[str, Any] = {
    "block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu", "rope": True, "alibi": False,
    "include_bias": False, "include_qkv_bias": False, "attention_layer_norm": False, "input_emb_norm": False,
    "scale_logits": False, "block_group_size": 1, "layer_norm_with_affine": True,
}
"""The ``config.json`` settings a Llama backbone reproduces, with the only value it takes (the released models' own;
absent keys take LLaDA's defaults, a falsy ``bias_for_layer_norm`` is also required)."""

_DEFAULTS = {"include_qkv_bias": False, "attention_layer_norm": False, "input_emb_norm": False,
             "scale_logits": False, "block_group_size": 1, "layer_norm_with_affine": True, "alibi": False}


class LLaDALM(NativeDiffusionLM):
    """LLaDA as an x0 denoiser: unshifted, bidirectional, positions = columns (module docstring).

    Load a checkpoint folder (theirs, or one :meth:`save_pretrained` wrote) with ``LLaDALM.from_pretrained(folder,
    dtype=torch.bfloat16)`` or ``uf.load_diffusion_lm(folder)``; no ``trust_remote_code``.
    """

    model_type = "llada"
    default_mask_token_id = 126336
    shifted = False
    positions_count_real_tokens = False
    backbone_family = "llama"

    @classmethod
    def backbone_config(cls, source: dict[str, Any]) -> Any:
        from transformers import LlamaConfig

        if "d_model" not in source and "num_experts" in source:
            raise ValueError("config.json: a LLaDA-MoE config (num_experts, no d_model) under model_type 'llada', as "
                             "the released LLaDA-MoE folders say; set its model_type to 'lladamoe' (as dllm does) to "
                             "load it as unifusion.hf.LLaDAMoELM")
        wrong = {k: source.get(k, _DEFAULTS.get(k)) for k, v in UNSUPPORTED_SETTINGS.items()
                 if source.get(k, _DEFAULTS.get(k)) != v}
        if source.get("bias_for_layer_norm"):
            wrong["bias_for_layer_norm"] = source["bias_for_layer_norm"]
        if wrong:
            raise ValueError(f"config.json: LLaDA settings a Llama backbone does not reproduce: {wrong} (supported: "
                             f"{ {k: UNSUPPORTED_SETTINGS[k] for k in wrong if k in UNSUPPORTED_SETTINGS} })")
        d, heads = int(source["d_model"]), int(source["n_heads"])
        kv = 1 if source.get("multi_query_attention") else int(source.get("n_kv_heads") or heads)
        hidden = source.get("mlp_hidden_size") or int(source.get("mlp_ratio", 4)) * d
        settings: dict[str, Any] = dict(  # **: rope_theta and attn_implementation are keywords transformers reads
            vocab_size=int(source.get("embedding_size") or source["vocab_size"]), hidden_size=d,
            intermediate_size=int(hidden), num_hidden_layers=int(source["n_layers"]), num_attention_heads=heads,
            num_key_value_heads=kv, hidden_act="silu", max_position_embeddings=int(source["max_sequence_length"]),
            rms_norm_eps=float(source.get("rms_norm_eps", 1e-5)), rope_theta=float(source.get("rope_theta", 10000.0)),
            attention_bias=False, mlp_bias=False, tie_word_embeddings=bool(source.get("weight_tying", False)),
            eos_token_id=source.get("eos_token_id"), pad_token_id=source.get("pad_token_id"), bos_token_id=None,
            use_cache=False, attn_implementation="sdpa")
        return LlamaConfig(**settings)

    @classmethod
    def backbone_class(cls) -> type[nn.Module]:
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM

    @classmethod
    def weight_names(cls, source: dict[str, Any]) -> dict[str, str]:
        names = {"model.transformer.wte.weight": "model.embed_tokens.weight",
                 "model.transformer.ln_f.weight": "model.norm.weight"}
        block = {"attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm",
                 "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                 "attn_out": "self_attn.o_proj", "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                 "ff_out": "mlp.down_proj"}
        for i in range(int(source["n_layers"])):
            for theirs, ours in block.items():
                names[f"model.transformer.blocks.{i}.{theirs}.weight"] = f"model.layers.{i}.{ours}.weight"
        if not source.get("weight_tying", False):
            names["model.transformer.ff_out.weight"] = "lm_head.weight"
        return names

    def generate_reference(self, prompt_ids: torch.Tensor, *, steps: int = 128, gen_length: int = 128,
                           block_length: int = 128, temperature: float = 0.0, cfg_scale: float = 0.0,
                           remasking: Literal["low_confidence", "random"] = "low_confidence",
                           attention_mask: torch.Tensor | None = None,
                           generator: torch.Generator | None = None) -> torch.Tensor:
        """LLaDA's own sampler (its ``generate.py``, :func:`unifusion.hf.llada.generation.llada_generate`): Gumbel-max
        sampling with the confidence at temperature 1, classifier-free guidance (``cfg_scale``), ``remasking``
        ``"low_confidence"`` or ``"random"``; ``(B, P + gen_length)`` token ids, LLaDA's tokens for the same
        random stream. :meth:`generate` with ``policy=LLaDAOrder(remasking)`` (and ``cfg_scale``) gives the same
        tokens (:class:`~unifusion.samplers.policies.LLaDAOrder`); greedy low-confidence decoding is also
        ``LowConfidence()``."""
        from .generation import llada_generate

        return llada_generate(self, prompt_ids, attention_mask=attention_mask, steps=steps, gen_length=gen_length,
                              block_length=block_length, temperature=temperature, cfg_scale=cfg_scale,
                              remasking=remasking, generator=generator)


def wrap(model: nn.Module, **kwargs: Any) -> NativeDiffusionLM:
    """LLaDA's own ``LLaDAModelLM`` (loaded with ``trust_remote_code``) as an :class:`LLaDALM`
    (:meth:`~unifusion.hf.native.NativeDiffusionLM.from_reference`: its tensors moved onto a Llama backbone, not
    copied)."""
    return LLaDALM.from_reference(model, **kwargs)
