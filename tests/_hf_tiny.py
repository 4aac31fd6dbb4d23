"""Tiny random Hugging Face causal LMs, one per family, for fast adapter tests (hidden 32, 2 layers, vocab 128)."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 128
BOS = 1

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, max_position_embeddings=128, head_dim=8,
    bos_token_id=BOS, eos_token_id=2, pad_token_id=0,
)

_OVERRIDES: dict[str, dict[str, Any]] = {
    "gpt2": dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=BOS,
                 eos_token_id=2),
    "gpt_neox": dict(_COMMON, rotary_pct=0.5),
    "falcon": {k: v for k, v in _COMMON.items() if k not in ("head_dim", "num_key_value_heads")},
    "phi": {k: v for k, v in _COMMON.items() if k != "head_dim"},
    "stablelm": {k: v for k, v in _COMMON.items() if k != "head_dim"},
    # sliding-window families get a window shorter than the test sequences, so windows are actually exercised
    "mistral": dict(_COMMON, sliding_window=4),
    "gemma2": dict(_COMMON, sliding_window=4),
    "gemma3_text": dict(_COMMON, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
}

FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gpt_neox", "phi3", "olmo2",
            "granite", "smollm3", "falcon", "gemma", "olmo", "phi", "stablelm", "starcoder2", "cohere"]
"""Families crossed with the shared checker (the spec's list plus a few cheap extras)."""


def tiny_config(model_type: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    kwargs = dict(_OVERRIDES.get(model_type, _COMMON))
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised ``*ForCausalLM`` in eval mode, fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    # granite/cohere scale logits: make the scales non-trivial so the head post-processing is tested
    if model_type == "granite":
        model.config.logits_scaling = 2.0
    return model.eval()


def random_ids(B: int = 2, length: int = 8, seed: int = 0) -> torch.Tensor:
    """``(B, length)`` token ids in ``[4, VOCAB)`` (clear of the special ids 0–3) from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (B, length), generator=g)


def with_bos(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, n)`` with BOS prepended: what the wrapped causal LM sees."""
    return torch.cat([torch.full((x.shape[0], 1), BOS), x], dim=1)


def tiny_diffusion_gemma_config(canvas_length: int = 4, vocab_size: int = VOCAB, **text: Any) -> Any:
    """A tiny random ``DiffusionGemmaConfig``: 2 layers (sliding window 8, then full attention), MoE with 4 experts,
    top-2 (so the router gets gradients), hidden 32, 256 positions, pad/eos/bos ids 0/1/2 and the image, begin- and
    end-of-image ids the vocabulary's last three; ``text`` overrides entries of the text config."""
    import transformers

    text_config: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=16, num_experts=4, top_k_experts=2,
        moe_intermediate_size=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    text_config.update(text)
    vision_config = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=64)
    return transformers.DiffusionGemmaConfig(text_config=text_config, vision_config=vision_config,
                                             canvas_length=canvas_length, image_token_id=vocab_size - 1,
                                             boi_token_id=vocab_size - 2, eoi_token_id=vocab_size - 3)


def tiny_diffusion_gemma(canvas_length: int = 4, seed: int = 0, vocab_size: int = VOCAB, **text: Any) -> Any:
    """A random ``DiffusionGemmaForBlockDiffusion`` of :func:`tiny_diffusion_gemma_config` (initialised after
    ``torch.manual_seed(seed)``), in eval mode."""
    import transformers

    config = tiny_diffusion_gemma_config(canvas_length, vocab_size, **text)
    torch.manual_seed(seed)
    return transformers.DiffusionGemmaForBlockDiffusion(config).eval()


def tiny_native(kind: str, tokenizer: Any, seed: int = 0) -> Any:
    """A released diffusion LM kind (``"llada"``, ``"dream"``, ``"sdar"``, ``"lladamoe"``, ``"fast_dllm"`` or
    ``"llada2"``) with its tiny fixture config (tests/hf/<kind>/fixtures/checkpoint/config.json) at ``tokenizer``'s
    vocabulary plus a mask token (the last id), its EOS and pad ids, random weights from ``seed``."""
    import json
    from pathlib import Path

    import unifusion as uf

    folder = Path(__file__).resolve().parent / "hf" / kind / "fixtures" / "checkpoint"
    source = json.loads((folder / "config.json").read_text())
    V = len(tokenizer) + 1
    source.update(vocab_size=V, mask_token_id=V - 1, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if kind == "llada":
        source["embedding_size"] = V
    cls = {"llada": uf.hf.LLaDALM, "dream": uf.hf.DreamLM, "sdar": uf.hf.SDARLM, "lladamoe": uf.hf.LLaDAMoELM,
           "fast_dllm": uf.hf.FastDLLMv2LM, "llada2": uf.hf.LLaDA2LM}[kind]
    torch.manual_seed(seed)
    return cls.from_source(source, tokenizer=tokenizer)
