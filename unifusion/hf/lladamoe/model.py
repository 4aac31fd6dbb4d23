"""LLaDA-MoE (``model_type="lladamoe"``: LLaDA-MoE-7B-A1B Base/Instruct and the models fine-tuned from them) on
transformers' Qwen3-MoE.

LLaDA-MoE's network (its ``modeling_lladamoe.py``, an OLMoE derivative) is a decoder of RMSNorm, RoPE attention with
**per-head** q/k RMSNorm (over ``head_dim``) and a sparse MoE feed-forward: router probabilities
``p = softmax(W_r h)`` in float32, the top-``k`` experts ``E(h)`` kept **unrenormalised**,

    y = Σ_{e ∈ top_k(p)} p_e · W_down,e (silu(W_gate,e h) ⊙ W_up,e h),

with the layers whose ``moe_layer_freq`` entry is 0 a dense SwiGLU MLP instead. Attention is bidirectional (padded
keys masked), the head **unshifted** (column ``i`` predicts token ``i``), position ids the column index, and the mask
token ``mask_token_id`` of its ``config.json`` (156895 for the released models).

That is transformers' ``Qwen3MoeForCausalLM`` (per-head q/k norm; ``norm_topk_prob=False``; ``mlp_only_layers`` the
dense layers), not its ``OlmoeForCausalLM``: OLMoE's q/k RMSNorm runs over the whole projection (``hidden_size``
wide), a different normalisation that no weight mapping reproduces, and OLMoE has no dense layers. Their modeling code
ignores ``norm_topk_prob``, ``moe_router_score_function``, ``routed_scaling_factor`` and the router groups (the
top-k probabilities are never renormalised or scaled), and so does this kind. Settings their code reads and Qwen3-MoE
has no equal of — a shared expert, an expert bias, ``clip_qkv``, no q/k norm, partial rotary, RoPE scaling, attention
biases — are a ``ValueError`` naming them. The weights map one to one, except the experts, which transformers fuses:

=============================================  ==========================================================
LLaDA-MoE (``model.layers.{i}.``…)             Qwen3-MoE (``model.layers.{i}.``…)
=============================================  ==========================================================
``self_attn.{q,k,v,o}_proj``, ``q_norm``, …    the same names
``mlp.gate`` (router)                          ``mlp.gate`` (its ``weight`` ``(E, d)``)
``mlp.experts.{e}.gate_proj`` / ``up_proj``    ``mlp.experts.gate_up_proj[e, :I]`` / ``[e, I:]``
``mlp.experts.{e}.down_proj``                  ``mlp.experts.down_proj[e]``
``mlp.{gate,up,down}_proj`` (dense layers)     the same names
=============================================  ==========================================================

Its training loss is LLaDA's MDLM ELBO (``uf.diffusion_loss(model, x0, model.kernel, objective="mdlm")``, SFT with
``prompt_mask=``). dllm trains it with that objective on the logits alone (no router auxiliary loss), so the
backbone's ``router_aux_loss_coef`` is 0 (TRL's trainers then add none; ``config.json``'s value is saved back as is).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ..native import NativeDiffusionLM
from ..native_checkpoint import ParameterPart, WeightTarget

__all__ = ["LLaDAMoELM", "wrap"]


def _moe_layers(source: dict[str, Any]) -> list[bool]:
    """Which layers are sparse (``moe_layer_freq[i] != 0``), checked against ``num_hidden_layers``."""
    n = int(source["num_hidden_layers"])
    freq = source.get("moe_layer_freq")
    if not isinstance(freq, list) or len(freq) != n:
        raise ValueError(f"config.json: moe_layer_freq must list one entry per layer ({n}), got {freq!r}")
    return [bool(f) for f in freq]


class LLaDAMoELM(NativeDiffusionLM):
    """LLaDA-MoE as an x0 denoiser: unshifted, bidirectional, positions = columns (module docstring).

    Load a checkpoint folder (theirs, or one :meth:`save_pretrained` wrote) with ``LLaDAMoELM.from_pretrained(folder,
    dtype=torch.bfloat16)`` or ``uf.load_diffusion_lm(folder)``; no ``trust_remote_code``. (The released folders'
    ``config.json`` says ``"model_type": "llada"``; their code, as dllm documents, reads them as ``"lladamoe"``.)
    """

    model_type = "lladamoe"
    default_mask_token_id = 156895
    shifted = False
    positions_count_real_tokens = False
    backbone_family = "qwen3_moe"

    @classmethod
    def backbone_config(cls, source: dict[str, Any]) -> Any:
        from transformers import Qwen3MoeConfig

        wrong: dict[str, Any] = {}
        for key, ok in (("qk_layernorm", lambda v: v is True), ("shared_expert_intermediate_size", lambda v: v is None),
                        ("moe_router_enable_expert_bias", lambda v: not v), ("clip_qkv", lambda v: v is None),
                        ("rope_scaling", lambda v: v is None), ("attention_bias", lambda v: not v),
                        ("partial_rotary_factor", lambda v: v in (1, 1.0)),
                        ("moe_router_score_function", lambda v: v in (None, "softmax"))):
            default = -1 if key in ("shared_expert_intermediate_size", "partial_rotary_factor") else None
            value = source.get(key, default)
            if not ok(value):
                wrong[key] = value
        if wrong:
            raise ValueError(f"config.json: LLaDA-MoE settings a Qwen3-MoE backbone does not reproduce: {wrong} "
                             "(supported: qk_layernorm true, shared_expert_intermediate_size null, no expert bias, "
                             "clip_qkv null, rope_scaling null, attention_bias false, partial_rotary_factor 1, "
                             "softmax routing)")
        sparse = _moe_layers(source)
        d, heads = int(source["hidden_size"]), int(source["num_attention_heads"])
        dense = int(source.get("dense_intermediate_size") or -1)
        settings: dict[str, Any] = dict(  # **: rope_theta and attn_implementation are keywords transformers reads
            vocab_size=int(source["vocab_size"]), hidden_size=d, num_hidden_layers=len(sparse),
            num_attention_heads=heads, num_key_value_heads=int(source.get("num_key_value_heads") or heads),
            head_dim=d // heads, hidden_act=source.get("hidden_act", "silu"),
            intermediate_size=dense if dense > 0 else d, moe_intermediate_size=int(source["expert_intermediate_size"]),
            num_experts=int(source["num_experts"]), num_experts_per_tok=int(source["num_experts_per_tok"]),
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[i for i, s in enumerate(sparse) if not s],
            router_aux_loss_coef=0.0,  # no router loss: dllm's MDLM training reads the logits only (the config's
            # coefficient, which their forward adds only with output_router_logits, stays in source_config)
            max_position_embeddings=int(source.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(source.get("rms_norm_eps", 1e-5)), rope_theta=float(source["rope_theta"]),
            attention_bias=False, use_sliding_window=False, sliding_window=None,
            tie_word_embeddings=bool(source.get("tie_word_embeddings", False)),
            eos_token_id=source.get("eos_token_id"), pad_token_id=source.get("pad_token_id"),
            bos_token_id=source.get("bos_token_id"), use_cache=False, attn_implementation="sdpa")
        if settings["num_attention_heads"] * settings["head_dim"] != d:
            raise ValueError(f"config.json: hidden_size = {d} is not a multiple of num_attention_heads = {heads}")
        return Qwen3MoeConfig(**settings)

    @classmethod
    def backbone_class(cls) -> type[nn.Module]:
        from transformers import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM

    @classmethod
    def weight_names(cls, source: dict[str, Any]) -> Mapping[str, WeightTarget]:
        names: dict[str, WeightTarget] = {"model.embed_tokens.weight": "model.embed_tokens.weight",
                                          "model.norm.weight": "model.norm.weight"}
        shared = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm"]
        I, E = int(source["expert_intermediate_size"]), int(source["num_experts"])
        for i, sparse in enumerate(_moe_layers(source)):
            layer = f"model.layers.{i}."
            mlp = ["mlp.gate"] if sparse else ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
            for name in shared + mlp:
                names[f"{layer}{name}.weight"] = f"{layer}{name}.weight"
            if sparse:
                gate_up, down = f"{layer}mlp.experts.gate_up_proj", f"{layer}mlp.experts.down_proj"
                for e in range(E):
                    names[f"{layer}mlp.experts.{e}.gate_proj.weight"] = ParameterPart(gate_up, e, 0, I)
                    names[f"{layer}mlp.experts.{e}.up_proj.weight"] = ParameterPart(gate_up, e, I, 2 * I)
                    names[f"{layer}mlp.experts.{e}.down_proj.weight"] = ParameterPart(down, e)
        if not source.get("tie_word_embeddings", False):
            names["lm_head.weight"] = "lm_head.weight"
        return names


def wrap(model: nn.Module, **kwargs: Any) -> NativeDiffusionLM:
    """LLaDA-MoE's own ``LLaDAMoEModelLM`` (loaded with ``trust_remote_code``) as an :class:`LLaDAMoELM`
    (:meth:`~unifusion.hf.native.NativeDiffusionLM.from_reference`: its tensors on a Qwen3-MoE backbone — the
    dense ones moved, not copied; the experts' copied into transformers' fused expert tensors)."""
    return LLaDAMoELM.from_reference(model, **kwargs)
