"""LLaDA 2.x (``model_type="llada2_moe"``: LLaDA2.0-mini/flash, LLaDA 2.1, and the models fine-tuned from them) on
:class:`~unifusion.hf.llada2.architecture.LLaDA2MoeForCausalLM` (transformers' GLM-4.5 MoE in LLaDA 2's layout).

LLaDA 2 is a block diffusion LM: attention is **block-causal** — query ``i`` sees key ``j`` iff ``⌊j/b⌋ ≤ ⌊i/b⌋``
(blocks of ``b = 32`` columns counted from column 0 of the canvas, bidirectional inside a block), padded keys
masked — its head is **unshifted** (column ``i`` predicts token ``i``), position ids are the column index, and the
mask token is 156895 (``mask_token_id`` of the ``config.json`` when it names one; its vocabulary has 157184
entries, EOS 156892). Its ``config.json`` keeps the Bailing/Ling keys; they map onto the backbone's config one to
one (:meth:`LLaDA2LM.backbone_config`), and its weights onto the backbone's parameters by name:

==============================================  ====================================================
LLaDA 2 (``model.``…)                           the backbone (``model.``…)
==============================================  ====================================================
``word_embeddings.weight``                      ``embed_tokens.weight``
``layers.{i}.attention.query_key_value``        ``layers.{i}.self_attn.query_key_value``
``layers.{i}.attention.query_layernorm``        ``layers.{i}.self_attn.q_norm`` (``k_norm`` for keys)
``layers.{i}.attention.dense``                  ``layers.{i}.self_attn.o_proj``
``layers.{i}.mlp.…`` (``gate``, ``experts.{j}``,  the same names
``shared_experts``, or the dense MLP)
``norm.weight``, ``lm_head.weight``              the same names
==============================================  ====================================================

Its training loss (dllm's BD3-LM trainer) is the block MDLM ELBO over the ``[x_t | x_0]`` stream: one time ``t`` per
sequence, each token masked with probability ``t`` and predicted from its noisy block and the *clean* blocks before it,
weighted ``1/t`` — ``uf.diffusion_loss(model, x0, model.kernel, objective="mdlm", block_times="sequence",
t_min=1e-3, prompt_mask=...)`` (``block_times="block"``, one time per block, is the same ELBO with less variance).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..native import NativeDiffusionLM
from .architecture import LLaDA2MoeConfig, LLaDA2MoeForCausalLM, LLaDA2MoeRouter
from .generation import llada2_generate, llada21_generate

__all__ = ["BLOCK_SIZE", "LLaDA2LM", "wrap"]

BLOCK_SIZE = 32
"""The block size LLaDA 2 was trained and decodes with (its samplers' ``block_length``/``block_size``)."""

_REQUIRED = {"hidden_act": "silu", "norm_head": False, "use_sliding_window": False, "rope_scaling": None,
             "score_function": "sigmoid", "norm_topk_prob": True, "moe_router_enable_expert_bias": True}
"""Settings of LLaDA 2's ``config.json`` that the released models have and the backbone takes only with this value
(absent keys are fine): their modeling code does not implement a normalised head (``norm_head``), a sliding window
or RoPE scaling, and always routes by sigmoid scores plus the expert bias with renormalised weights, whatever
``score_function``, ``norm_topk_prob`` and ``moe_router_enable_expert_bias`` say."""


class LLaDA2LM(NativeDiffusionLM):
    """LLaDA 2.x as an x0 denoiser: unshifted, block-causal with blocks of :data:`BLOCK_SIZE`, positions = columns
    (module docstring).

    Load a checkpoint folder (theirs, or one :meth:`save_pretrained` wrote) with ``LLaDA2LM.from_pretrained(folder,
    dtype=torch.bfloat16)`` or ``uf.load_diffusion_lm(folder)``; no ``trust_remote_code``.
    """

    model_type = "llada2_moe"
    default_mask_token_id = 156895
    shifted = False
    positions_count_real_tokens = False
    backbone_family = "llama"  # transformers' mask builder: boolean 4D masks under SDPA, is_causal=False, no window
    default_block_size = BLOCK_SIZE
    block_origin = "sequence_start"  # trained on blocks cut from the sequence start; so are its decoder's

    def __init__(self, backbone: nn.Module, source_config: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(backbone, source_config, **kwargs)
        for module in backbone.modules():  # the expert bias only chooses experts: never trained by a gradient
            if isinstance(module, LLaDA2MoeRouter):
                module.expert_bias.requires_grad_(False)

    @classmethod
    def backbone_config(cls, source: dict[str, Any]) -> Any:
        wrong = {k: source[k] for k, v in _REQUIRED.items() if k in source and source[k] != v}
        if wrong:
            raise ValueError(f"config.json: LLaDA 2 settings the backbone does not reproduce: {wrong} (supported: "
                             f"{ {k: _REQUIRED[k] for k in wrong} })")
        d, heads = int(source["hidden_size"]), int(source["num_attention_heads"])
        layers = int(source["num_hidden_layers"])
        experts, shared = source.get("num_experts", 16), source.get("num_shared_experts", 0)
        settings: dict[str, Any] = dict(  # **: head_dim and attn_implementation are keywords transformers reads
            vocab_size=int(source["vocab_size"]), hidden_size=d,
            intermediate_size=int(source.get("intermediate_size") or 0), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=int(source.get("num_key_value_heads") or heads),
            head_dim=int(source.get("head_dim") or d // heads), hidden_act="silu",
            max_position_embeddings=int(source.get("max_position_embeddings", 16384)),
            rms_norm_eps=float(source.get("rms_norm_eps", 1e-5)),
            rope_parameters={"rope_type": "default", "rope_theta": float(source.get("rope_theta", 10000.0)),
                             "partial_rotary_factor": float(source.get("partial_rotary_factor", 0.5))},
            attention_bias=False, use_qkv_bias=bool(source.get("use_qkv_bias", False)),
            use_bias=bool(source.get("use_bias", True)), use_qk_norm=bool(source.get("use_qk_norm", True)),
            attention_dropout=float(source.get("attention_dropout", 0.1)),
            # no experts (their num_experts = None): every layer dense
            n_routed_experts=int(experts or 0), shared_experts=shared is not None, n_shared_experts=int(shared or 0),
            first_k_dense_replace=layers if experts is None else int(source.get("first_k_dense_replace", 0)),
            num_experts_per_tok=int(source.get("num_experts_per_tok", 2)), n_group=int(source.get("n_group", 8)),
            topk_group=int(source.get("topk_group", 4)),
            routed_scaling_factor=float(source.get("routed_scaling_factor", 2.5)),
            moe_intermediate_size=int(source.get("moe_intermediate_size") or 0), norm_topk_prob=True,
            initializer_range=float(source.get("initializer_range", 0.02)),
            tie_word_embeddings=bool(source.get("tie_word_embeddings", False)),
            eos_token_id=source.get("eos_token_id"), pad_token_id=source.get("pad_token_id", 126081),
            bos_token_id=None, use_cache=False, attn_implementation="sdpa")
        return LLaDA2MoeConfig(**settings)

    @classmethod
    def backbone_class(cls) -> type[nn.Module]:
        return LLaDA2MoeForCausalLM

    @classmethod
    def weight_names(cls, source: dict[str, Any]) -> dict[str, str]:
        names = {"model.word_embeddings.weight": "model.embed_tokens.weight", "model.norm.weight": "model.norm.weight"}
        mlp = ("gate_proj", "up_proj", "down_proj")
        experts = source.get("num_experts", 16)
        shared = source.get("num_shared_experts", 0)
        for i in range(int(source["num_hidden_layers"])):
            theirs, ours = f"model.layers.{i}.", f"model.layers.{i}."
            attention = {"query_key_value.weight": "query_key_value.weight", "dense.weight": "o_proj.weight"}
            if source.get("use_qkv_bias", False):
                attention["query_key_value.bias"] = "query_key_value.bias"
            if source.get("use_bias", True):
                attention["dense.bias"] = "o_proj.bias"
            if source.get("use_qk_norm", True):
                attention |= {"query_layernorm.weight": "q_norm.weight", "key_layernorm.weight": "k_norm.weight"}
            names |= {f"{theirs}attention.{a}": f"{ours}self_attn.{b}" for a, b in attention.items()}
            block = ["input_layernorm.weight", "post_attention_layernorm.weight"]
            if experts is not None and i >= int(source.get("first_k_dense_replace", 0)):
                block += ["mlp.gate.weight", "mlp.gate.expert_bias"]
                block += [f"mlp.experts.{j}.{p}.weight" for j in range(int(experts)) for p in mlp]
                if shared is not None:
                    block += [f"mlp.shared_experts.{p}.weight" for p in mlp]
            else:
                block += [f"mlp.{p}.weight" for p in mlp]
            names |= {theirs + name: ours + name for name in block}
        if not source.get("tie_word_embeddings", False):
            names["lm_head.weight"] = "lm_head.weight"
        return names

    def generate_reference(self, prompt_ids: torch.Tensor, *, max_new_tokens: int = 128, steps_per_block: int = 32,
                           threshold: float = 0.95, editing_threshold: float | None = None, max_post_steps: int = 16,
                           num_to_transfer: int = 1, minimal_topk: int = 1, temperature: float = 0.0,
                           top_k: int | None = None, top_p: float | None = None, eos_early_stop: bool = False,
                           generator: torch.Generator | None = None) -> torch.Tensor:
        """LLaDA 2's own samplers (:mod:`unifusion.hf.llada2.generation`), blocks of :attr:`block_size`: LLaDA 2.0's
        (``steps_per_block``, ``threshold``, ``minimal_topk``) or, given ``editing_threshold``, LLaDA 2.1's with
        token editing (``threshold``, ``editing_threshold``, ``max_post_steps``, ``num_to_transfer``). Returns
        their canvas ``(B, ⌈(P + N)/K⌉ K)`` — their tokens for the same prompts (greedy at ``temperature=0``; their
        global seed = ``generator``'s seed when sampling). On a block-aligned prompt, LLaDA 2.0's greedy sampler
        is also :meth:`generate` with ``policy=ConfidenceThreshold(threshold), num_steps=steps_per_block,
        do_sample=False`` when no step commits beyond its count."""
        common: dict[str, Any] = dict(max_new_tokens=max_new_tokens, threshold=threshold, temperature=temperature,
                                      top_k=top_k, top_p=top_p, eos_early_stop=eos_early_stop, generator=generator)
        if editing_threshold is None:
            return llada2_generate(self, prompt_ids, steps_per_block=steps_per_block, minimal_topk=minimal_topk,
                                   **common)
        return llada21_generate(self, prompt_ids, editing_threshold=editing_threshold,
                                max_post_steps=max_post_steps, num_to_transfer=num_to_transfer, **common)


def wrap(model: nn.Module, **kwargs: Any) -> NativeDiffusionLM:
    """LLaDA 2's own ``LLaDA2MoeModelLM`` (loaded with ``trust_remote_code``) as an :class:`LLaDA2LM`
    (:meth:`~unifusion.hf.native.NativeDiffusionLM.from_reference`: its tensors moved onto the backbone, not
    copied)."""
    return LLaDA2LM.from_reference(model, **kwargs)
