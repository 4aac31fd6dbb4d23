"""Facts about Hugging Face causal-LM families that the AR→diffusion adapter relies on.

One registry, keyed by ``config.model_type``. Every fact the adapter (:class:`unifusion.hf.DiffusionLM`) needs
about an architecture lives here and nowhere else:

* ``mask_style``: how the family's attention reads a custom 4D mask ``(B, 1, L, L)``. ``"bool"`` (True =
  attend) is what ``sdpa`` honours; ``"additive"`` (0 = attend, ``finfo.min`` = blocked) is what ``eager``
  attention honours (it *adds* the mask to the scores, so a boolean mask is silently misread: +1/+0). The
  adapter uses ``"additive"`` whenever the model runs ``eager`` attention, whatever the family says; gemma2
  defaults to ``eager`` (attention logit soft-capping) and is registered ``"additive"``.
* ``window``: how sliding-window layers are fed a custom mask. ``"none"``: no sliding-window layers.
  ``"all_layers"``: one mask for every layer, every layer is windowed when ``config.sliding_window`` is set
  (mistral, mixtral, phi3, starcoder2, qwen3_moe). ``"per_layer_type"``: the model accepts a dict
  ``{"full_attention": mask, "sliding_attention": mask}`` and windows the layers whose ``config.layer_types``
  entry is ``"sliding_attention"`` (gemma2, gemma3_text, qwen2, qwen3, smollm3, ministral, ...).
* ``is_causal_kwarg``: whether the family's ``forward`` honours transformers' ``is_causal=False`` keyword argument
  (``TransformersKwargs``, transformers ≥ 5): the mask builders then fall back to the bidirectional mask (``None``
  when nothing is masked) and every attention module runs non-causally (SDPA ``is_causal=False``, flash-attention
  ``causal=False``). The adapter uses it for fully bidirectional calls without padding or an active window, so no
  dense ``(B, 1, L, L)`` mask is built. Falcon (its mask builder always materialises a causal mask) and StableLM
  (its attention modules do not receive the keyword) do not honour it and keep the dense mask.
* ``logit_scale`` / ``softcap_attr``: the post-processing the family's ``forward`` applies after ``lm_head``
  (granite divides by ``logits_scaling``, cohere multiplies by ``logit_scale``, gemma2/3 soft-cap with
  ``final_logit_softcapping``), so ``DiffusionLM.logits_from_hidden`` can reproduce ``forward`` exactly.

Input embeddings and the output head are reached through the generic ``get_input_embeddings()`` /
``get_output_embeddings()`` of every ``PreTrainedModel``; the backbone through ``model.base_model``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

__all__ = ["Family", "FAMILIES", "UNSUPPORTED", "family_for", "supported_model_types", "unwrap_peft"]

MaskStyle = Literal["bool", "additive"]
WindowStyle = Literal["none", "all_layers", "per_layer_type"]


def unwrap_peft(model: nn.Module) -> Any:
    """The Hugging Face model inside a peft ``PeftModel`` (LoRA layers are injected in place), else ``model``.

    The result is typed ``Any``: a ``PreTrainedModel``'s methods (``get_input_embeddings``, ``config``, ...) are
    reached through ``nn.Module.__getattr__`` for peft models and plain attributes otherwise; neither types
    usefully."""
    get_base_model = getattr(model, "get_base_model", None)
    if hasattr(model, "peft_config") and callable(get_base_model):
        return get_base_model()
    return model


def _one(_config: Any) -> float:
    return 1.0


@dataclass(frozen=True)
class Family:
    """How one ``config.model_type`` takes custom attention masks and turns hidden states into logits.

    Attributes:
        model_type: the ``config.model_type`` key.
        mask_style: ``"bool"`` or ``"additive"`` (see the module docstring); ``eager`` attention always forces
            ``"additive"``.
        window: ``"none"``, ``"all_layers"`` or ``"per_layer_type"`` sliding-window handling.
        is_causal_kwarg: whether ``forward(..., is_causal=False)`` runs the model bidirectionally without a mask.
        logit_scale: ``config -> float`` multiplier applied to ``lm_head`` output by the family's ``forward``.
        softcap_attr: name of the config attribute holding the final logit soft-cap (``None`` if the family has
            none); logits = ``c * tanh(logits / c)`` when the value is set.
    """

    model_type: str
    mask_style: MaskStyle = "bool"
    window: WindowStyle = "none"
    is_causal_kwarg: bool = True
    logit_scale: Callable[[Any], float] = _one
    softcap_attr: str | None = None

    def __post_init__(self) -> None:
        if self.mask_style not in ("bool", "additive"):
            raise ValueError(f"mask_style: expected 'bool' or 'additive', got {self.mask_style!r}")
        if self.window not in ("none", "all_layers", "per_layer_type"):
            raise ValueError(f"window: expected 'none', 'all_layers' or 'per_layer_type', got {self.window!r}")

    # -- helpers reading a concrete config ------------------------------------------------------------------

    def sliding_window(self, config: Any) -> int | None:
        """The window size ``w`` the model's sliding layers use (key j visible from query i iff |i − j| < w)."""
        w = getattr(config, "sliding_window", None)
        if self.window == "none" or not w:
            return None
        if self.window == "per_layer_type":
            layer_types = getattr(config, "layer_types", None) or ()
            if "sliding_attention" not in layer_types:
                return None
        return int(w)

    def softcap(self, config: Any) -> float | None:
        if self.softcap_attr is None:
            return None
        c = getattr(config, self.softcap_attr, None)
        return None if c is None else float(c)


def _granite_scale(config: Any) -> float:
    return 1.0 / float(config.logits_scaling)


def _cohere_scale(config: Any) -> float:
    return float(config.logit_scale)


_ENTRIES = [
    # the families named in the spec
    Family("gpt2"),
    Family("llama"),
    Family("mistral", window="all_layers"),
    Family("qwen2", window="per_layer_type"),
    Family("qwen3", window="per_layer_type"),
    Family("gemma2", mask_style="additive", window="per_layer_type", softcap_attr="final_logit_softcapping"),
    Family("gemma3_text", window="per_layer_type", softcap_attr="final_logit_softcapping"),
    Family("gpt_neox"),
    Family("phi3", window="all_layers"),
    Family("olmo2"),
    Family("granite", logit_scale=_granite_scale),
    Family("smollm3", window="per_layer_type"),
    # further families checked with the same tests
    Family("falcon", is_causal_kwarg=False),
    Family("gemma"),
    Family("olmo"),
    Family("olmo3", window="per_layer_type"),
    Family("phi"),
    Family("stablelm", is_causal_kwarg=False),
    Family("starcoder2", window="all_layers"),
    Family("cohere", logit_scale=_cohere_scale),
    Family("mixtral", window="all_layers"),
    Family("ministral", window="per_layer_type"),
    Family("qwen3_moe", window="all_layers"),
    Family("helium"),
]

FAMILIES: dict[str, Family] = {f.model_type: f for f in _ENTRIES}
"""The supported ``config.model_type`` values and their facts."""

UNSUPPORTED: dict[str, str] = {
    "opt": "OPT's decoder rejects 4D attention masks in transformers 5, so causal→bidirectional annealing "
    "cannot be expressed",
    "bloom": "BLOOM's ALiBi attention rejects custom 4D attention masks",
    "gptj": "GPT-J rejects custom 4D attention masks",
    "codegen": "CodeGen rejects custom 4D attention masks",
}
"""Families known not to work, with the reason (shown in the error)."""


def supported_model_types() -> list[str]:
    """Sorted list of supported ``config.model_type`` values."""
    return sorted(FAMILIES)


def family_for(model_type: str | None) -> Family:
    """The registry entry for ``model_type``; ``ValueError`` listing the supported families otherwise."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    supported = ", ".join(supported_model_types())
    if model_type in UNSUPPORTED:
        raise ValueError(f"model: model_type {model_type!r} is not supported ({UNSUPPORTED[model_type]}); "
                         f"supported model types: {supported}")
    raise ValueError(f"model: expected a causal LM of a supported family, got model_type {model_type!r}; "
                     f"supported model types: {supported}")
