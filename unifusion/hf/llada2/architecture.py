"""LLaDA 2.x's network (``model_type="llada2_moe"``, a Bailing/Ling MoE) as a transformers model in its own weight
layout, built on transformers' GLM-4.5 MoE (``Glm4MoeForCausalLM``).

No transformers architecture holds LLaDA 2's weights as they are, but GLM-4.5's computes the same function:

* attention: per-head RMSNorm of queries and keys (``use_qk_norm``), RoPE on the first ``head_dim ·
  partial_rotary_factor`` dimensions of each head (Llama's half rotation there, the rest passed through), grouped
  KV heads, scale ``head_dim^{-1/2}``;
* the router: ``s = σ(W_g h)`` in float32, the experts chosen by ``s + b`` (the expert bias) restricted to the
  ``topk_group`` best of ``n_group`` groups (a group scores the sum of its two best), the gate weights
  ``λ s_e / Σ_{e'∈top-k} s_{e'}`` (``λ`` = ``routed_scaling_factor``; no renormalisation with one expert);
* the block: ``h + Σ_{e∈top-k} w_e FFN_e(h) + FFN_shared(h)``, SwiGLU experts, dense SwiGLU in the first
  ``first_k_dense_replace`` layers; pre-norm RMSNorm everywhere.

What differs is the layout: LLaDA 2 fuses the query, key and value projections into one ``query_key_value`` (rows
``[q; k; v]``), may give it and the output projection ``dense`` biases (``use_qkv_bias``, ``use_bias``), keeps one
module per expert (``experts.{j}.gate_proj`` …) where transformers stacks them, and calls the expert bias
``gate.expert_bias``. :class:`LLaDA2MoeForCausalLM` subclasses GLM-4.5's model with exactly those modules, so the
checkpoint's tensors load one to one (only the top-level names differ: ``word_embeddings`` → ``embed_tokens``,
``attention`` → ``self_attn``, ``dense`` → ``o_proj``, ``query_layernorm``/``key_layernorm`` → ``q_norm``/``k_norm``)
and everything else — masks (``is_causal=False``, 4D boolean or additive, flex ``BlockMask``), the KV cache, SDPA /
eager / flex attention, gradient checkpointing — is transformers' own.

The expert bias is a frozen parameter (``requires_grad=False``) rather than LLaDA 2's buffer: it is loaded and saved
with the weights and no gradient reaches it (it only chooses the experts).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Glm4MoeConfig
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.glm4_moe import modeling_glm4_moe as glm

__all__ = ["LLaDA2MoeAttention", "LLaDA2MoeConfig", "LLaDA2MoeDecoderLayer", "LLaDA2MoeForCausalLM",
           "LLaDA2MoeModel", "LLaDA2MoeRouter", "LLaDA2MoeSparseBlock"]


class LLaDA2MoeConfig(Glm4MoeConfig):
    """GLM-4.5 MoE's config with LLaDA 2's switches: ``use_qkv_bias`` (a bias on ``query_key_value``), ``use_bias`` (a
    bias on the output projection ``dense``) and ``shared_experts`` (False: the MoE blocks have no shared expert,
    their ``num_shared_experts = None``). Built by :meth:`unifusion.hf.llada2.LLaDA2LM.backbone_config` from LLaDA
    2's own ``config.json``."""

    use_qkv_bias: bool = False
    use_bias: bool = False
    shared_experts: bool = True


class LLaDA2MoeAttention(glm.Glm4MoeAttention):
    """Self-attention with LLaDA 2's fused ``query_key_value`` ``(H + 2 H_kv) d_h × d`` and output projection
    ``o_proj`` (their ``dense``, biased when ``use_bias``); per-head query/key RMSNorm, partial RoPE (module
    docstring)."""

    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = int(config.head_dim)
        self.num_heads = int(config.num_attention_heads)
        self.num_key_value_heads = int(config.num_key_value_heads)
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.rope_parameters = config.rope_parameters
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.query_key_value = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_key_value_heads)
                                         * self.head_dim, bias=bool(config.use_qkv_bias))
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bool(config.use_bias))
        self.use_qk_norm = bool(config.use_qk_norm)
        if self.use_qk_norm:
            self.q_norm = glm.Glm4MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = glm.Glm4MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: Any, cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(B, L, d)`` → the attention output ``(B, L, d)`` and the weights (eager attention only), attending by
        ``attention_mask`` (whatever transformers' mask builder made) and extending ``cache`` when given."""
        input_shape = hidden_states.shape[:-1]
        qkv = self.query_key_value(hidden_states).view(*input_shape, -1, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_key_value_heads, self.num_key_value_heads], dim=-2)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = position_embeddings
        q, k = glm.apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          glm.eager_attention_forward)
        out, weights = attention(self, q, k, v, attention_mask, scaling=self.scaling,
                                 dropout=0.0 if not self.training else self.attention_dropout, **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


class LLaDA2MoeRouter(nn.Module):
    """LLaDA 2's gate: ``weight`` ``(E, d)`` and the expert bias ``expert_bias`` ``(E,)`` (a frozen parameter).

    For hidden states ``h`` it returns the chosen experts and their weights (module docstring): ``s = σ(W_g h)``
    (float32), experts = top-``k`` of ``s + b`` within the ``topk_group`` best groups, ``w_e = λ s_e / (Σ s + 10⁻²⁰)``
    (``w_e = λ s_e`` when ``k = 1``)."""

    def __init__(self, config: LLaDA2MoeConfig) -> None:
        super().__init__()
        self.top_k = int(config.num_experts_per_tok)
        self.num_experts = int(config.n_routed_experts)
        self.n_group = int(config.n_group)
        self.topk_group = int(config.topk_group)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.expert_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(N, d)`` → expert indices ``(N, k)`` int64 and their weights ``(N, k)`` float32."""
        s = torch.sigmoid(F.linear(hidden_states.float(), self.weight.float()))
        choice = s + self.expert_bias.float()
        N = choice.shape[0]
        groups = choice.view(N, self.n_group, -1)
        group_score = groups.topk(2, dim=-1).values.sum(-1)
        best = group_score.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(groups).reshape(N, -1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices
        w = s.gather(1, experts)
        if self.top_k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return experts, w * self.routed_scaling_factor


class LLaDA2MoeSparseBlock(nn.Module):
    """The MoE feed-forward block: ``Σ_{e∈top-k} w_e FFN_e(h) + FFN_shared(h)`` with one SwiGLU module per expert
    (``experts.{j}``) and ``shared_experts`` of width ``moe_intermediate_size · n_shared_experts`` (none when the
    config says ``num_shared_experts = None``). The experts' outputs are weighted and summed in float32, then cast
    to the hidden states' dtype (as LLaDA 2 does); tokens are grouped by expert with one host read of the counts."""

    def __init__(self, config: LLaDA2MoeConfig) -> None:
        super().__init__()
        self.gate = LLaDA2MoeRouter(config)
        self.experts = nn.ModuleList([glm.Glm4MoeMLP(config, intermediate_size=config.moe_intermediate_size)
                                      for _ in range(int(config.n_routed_experts))])
        self.shared_experts = glm.Glm4MoeMLP(config, intermediate_size=config.moe_intermediate_size
                                             * config.n_shared_experts) if config.shared_experts else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        h = hidden_states.reshape(-1, shape[-1])
        experts, w = self.gate(h)
        k = experts.shape[1]
        order = experts.reshape(-1).argsort()
        counts = torch.bincount(experts.reshape(-1), minlength=len(self.experts)).tolist()
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start:start + n]
            tokens = slots // k
            y = self.experts[e](h[tokens]).float() * w.reshape(-1)[slots, None]
            out.index_add_(0, tokens, y)
            start += n
        y = out.to(hidden_states.dtype).view(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(hidden_states)
        return y


class LLaDA2MoeDecoderLayer(glm.Glm4MoeDecoderLayer):
    """Pre-norm block: ``h + Attn(RMSNorm(h))``, then ``+ FFN(RMSNorm(·))`` with the MoE block from layer
    ``first_k_dense_replace`` on (a dense SwiGLU of ``intermediate_size`` before); GLM-4.5's ``forward``."""

    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int) -> None:
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = LLaDA2MoeAttention(config, layer_idx)
        mlp: nn.Module = LLaDA2MoeSparseBlock(config) if layer_idx >= config.first_k_dense_replace else \
            glm.Glm4MoeMLP(config)
        setattr(self, "mlp", mlp)  # noqa: B010  (GLM-4.5's class declares its MoE type here)
        self.input_layernorm = glm.Glm4MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = glm.Glm4MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def _init_router(module: nn.Module, std: float) -> None:
    if isinstance(module, LLaDA2MoeRouter):
        with torch.no_grad():
            module.weight.normal_(0.0, std)
            module.expert_bias.zero_()


class LLaDA2MoeModel(glm.Glm4MoeModel):
    """The decoder: ``embed_tokens`` (their ``word_embeddings``), the layers, the final ``norm``; GLM-4.5's
    ``forward`` (masks, cache, rotary embedding)."""

    config_class = LLaDA2MoeConfig

    def __init__(self, config: LLaDA2MoeConfig) -> None:
        glm.Glm4MoePreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([LLaDA2MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = glm.Glm4MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = glm.Glm4MoeRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        _init_router(module, self.config.initializer_range)


class LLaDA2MoeForCausalLM(glm.Glm4MoeForCausalLM):
    """LLaDA 2's network with its ``lm_head`` (untied unless ``tie_word_embeddings``); GLM-4.5's ``forward``."""

    config_class = LLaDA2MoeConfig

    def __init__(self, config: LLaDA2MoeConfig) -> None:
        glm.Glm4MoePreTrainedModel.__init__(self, config)
        self.model = LLaDA2MoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        _init_router(module, self.config.initializer_range)
