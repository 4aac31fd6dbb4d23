"""An adapted model's checkpoint files: what :class:`~unifusion.hf.DiffusionLM` writes and reads inside the shared
``save_pretrained`` / ``from_pretrained`` of :class:`unifusion.hf.checkpoint.CheckpointMixin`.

A saved folder is a standard Hugging Face checkpoint of the backbone plus unifusion's record:

* ``config.json``: the backbone's own config (``dtype`` set; the vocabulary includes an added mask token) that says
  it is a diffusion model: ``architectures`` is :data:`DIFFUSION_ARCHITECTURE` (no engine's causal-LM class) and
  :data:`DIFFUSION_CONFIG_KEY` holds :func:`diffusion_record` (kind, mask id, block size, shift, the backbone's
  class); ``generation_config.json`` when the backbone has one.
* ``model.safetensors`` (:data:`WEIGHTS_NAME`): the backbone's state dict under transformers' names, tied tensors
  stored once, and :data:`DIFFUSION_MARKER`: ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` opens
  the backbone with identical weights and warns (its load report names the marker); the explicit way to the plain
  backbone is ``DiffusionLM.from_pretrained(folder).hf_model``.
* ``unifusion_config.json`` (``CONFIG_NAME``, :mod:`unifusion.hf.checkpoint`): the library version, the BOS and mask
  token ids, whether the mask token was added, time conditioning, the family, the architecture class, the weights'
  dtype, the wrapped model's own config (``base_config``), the block size of a block model and, when known, the
  training kernel (``"kernel"``, see :func:`unifusion.hf.kernel_config`). Unknown keys are ignored with a warning on
  load.
* ``unifusion_weights.safetensors`` (:data:`EXTRA_WEIGHTS_NAME`): the wrapper's own parameters that are not the
  backbone's (the time embedding of a ``time_conditioning`` model), only when there are any.
* the tokenizer's files, when the model has a tokenizer.

Loading opens the backbone with transformers' ``from_pretrained`` on the weights file without the marker (no load
report) and the wrapper's parameters from their file: bit-identical weights. Folders of the earlier format
(``unifusion_config.json`` and a ``model.safetensors`` holding the wrapper's state dict, names prefixed
``base_model.``, no ``config.json``) keep loading: the backbone is rebuilt from ``base_config`` without initialising
weights and the file is loaded into the wrapper.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CONFIG_NAME, library_version
from .adapted import AdaptedLM

__all__ = ["CONFIG_KEYS", "DIFFUSION_ARCHITECTURE", "DIFFUSION_CONFIG_KEY", "DIFFUSION_MARKER", "EXTRA_WEIGHTS_NAME",
           "WEIGHTS_NAME", "config_stamp", "diffusion_record", "hf_config", "load_model", "parse_dtype", "save_files"]

WEIGHTS_NAME = "model.safetensors"
"""The backbone's weights (transformers' names and file), or the whole wrapper's in a folder of the earlier format."""

EXTRA_WEIGHTS_NAME = "unifusion_weights.safetensors"
"""The wrapper's parameters outside the backbone (the time embedding), when there are any."""

_BACKBONE_PREFIX = "base_model."  # the backbone's parameters inside the wrapper's state dict

DIFFUSION_ARCHITECTURE = "UnifusionDiffusionLM"
"""``config.json``'s ``architectures`` entry of a saved model: no causal-LM class of transformers or of a serving
engine has this name, so an engine that picks its implementation by ``architectures`` does not take the weights for
an autoregressive model of the backbone's family (the backbone's class is recorded under
:data:`DIFFUSION_CONFIG_KEY`)."""

DIFFUSION_CONFIG_KEY = "unifusion"
"""The key of ``config.json`` that says the weights are a diffusion model (:func:`diffusion_record`): a nested
dict, which ``PretrainedConfig`` keeps as an attribute and writes back on every save, so it survives
``AutoConfig`` / ``from_pretrained`` / ``save_pretrained`` round trips."""

DIFFUSION_MARKER = "unifusion.diffusion_model.load_with.unifusion.DiffusionLM.from_pretrained"
"""A one-element tensor stored beside the backbone's weights in :data:`WEIGHTS_NAME`. No backbone has a parameter of
that name, so ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` — what a user or a tool that treats the
folder as a plain causal LM calls — still loads the backbone but logs its load report (a warning) naming this key as
UNEXPECTED; unifusion's own loader drops it."""

CONFIG_KEYS = frozenset({"unifusion_version", "bos_token_id", "mask_token_id", "added_mask_token",
                         "time_conditioning", "model_type", "architecture", "dtype", "base_config", "kernel",
                         "block_size"})
"""The keys an adapted model's record (:data:`~unifusion.hf.checkpoint.CONFIG_NAME`) may hold; others are ignored
with a warning."""


def parse_dtype(dtype: object) -> torch.dtype | None:
    """``None``, a floating ``torch.dtype`` or its name (``"bfloat16"``, ``"torch.float16"``) → the dtype."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"dtype: expected a floating torch dtype or its name, got {dtype!r}")
        dtype = value
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype (e.g. torch.bfloat16) or its name, got {type(dtype).__name__}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating dtype, got {dtype}")
    return dtype


def config_stamp(model: AdaptedLM, kernel: dict[str, Any] | None = None) -> dict[str, Any]:
    """The content of :data:`CONFIG_NAME` for ``model`` (a :class:`~unifusion.hf.DiffusionLM`), with the training
    kernel's record ``kernel`` (:func:`~unifusion.hf.kernel_config`) when known."""
    hf = model.hf_model
    base_config = model.config.to_dict()
    base_config.pop("quantization_config", None)  # GGUF-loaded models: store the dequantised weights plainly
    dtype = hf.get_input_embeddings().weight.dtype
    stamp = {
        "unifusion_version": library_version(),
        "bos_token_id": model.bos_token_id,
        "mask_token_id": model.mask_token_id,
        "added_mask_token": model.added_mask_token,
        "time_conditioning": model.time_conditioning,
        "model_type": model.config.model_type,
        "architecture": type(hf).__name__,
        "dtype": str(dtype).removeprefix("torch."),
        "base_config": base_config,
    }
    if kernel is not None:  # only when known: a folder without it reads in older versions without a warning
        stamp["kernel"] = kernel
    if model.block_size is not None:  # block models only: a plain model's folder is unchanged
        stamp["block_size"] = model.block_size
    return stamp


def diffusion_record(model: AdaptedLM) -> dict[str, Any]:
    """What ``config.json`` records under :data:`DIFFUSION_CONFIG_KEY`: that the weights are a diffusion model
    (``kind``: ``"block_diffusion"`` with ``block_size`` K, else ``"diffusion"``), its ``mask_token_id`` (``None``
    without one), its ``bos_token_id``, the ``shift`` (1: the logits that predict position ``i`` are read at
    position ``i − 1``, as in AR decoding; docs/guides/serving.md), whether the mask token was added and time
    conditioning, the backbone's class and how to load it."""
    return {"kind": "block_diffusion" if model.block_size is not None else "diffusion",
            "mask_token_id": model.mask_token_id, "block_size": model.block_size, "shift": 1,
            "bos_token_id": model.bos_token_id, "added_mask_token": model.added_mask_token,
            "time_conditioning": model.time_conditioning, "backbone_architecture": type(model.hf_model).__name__,
            "load_with": "unifusion.DiffusionLM.from_pretrained", "unifusion_version": library_version()}


def hf_config(model: AdaptedLM) -> Any:
    """The backbone's config as ``config.json`` gets it: a copy of ``model.config`` without a GGUF
    ``quantization_config`` (the weights are stored dequantised), with ``architectures`` :data:`DIFFUSION_ARCHITECTURE`,
    :func:`diffusion_record` under :data:`DIFFUSION_CONFIG_KEY` and ``dtype`` the weights' dtype. ``vocab_size``
    already counts an added mask token (the embeddings were resized when it was added)."""
    hf = model.hf_model
    config = copy.deepcopy(hf.config)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    config.architectures = [DIFFUSION_ARCHITECTURE]
    setattr(config, DIFFUSION_CONFIG_KEY, diffusion_record(model))
    config.dtype = hf.get_input_embeddings().weight.dtype
    return config


def _state_once(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` on the CPU, contiguous, each tied tensor (same storage, shape and stride) once (its first name)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[Any, ...]] = set()
    for name, tensor in state.items():
        key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return out


def save_files(model: AdaptedLM, path: Path) -> None:
    """Write ``model``'s backbone (``config.json``, ``model.safetensors``, ``generation_config.json``) and its other
    parameters (:data:`EXTRA_WEIGHTS_NAME`) into the folder ``path``."""
    from safetensors.torch import save_file

    # The backbone as transformers saves it (config.json + model.safetensors under its own names), the wrapper's
    # other parameters beside it. Tied tensors are stored once; every tensor is copied out contiguously, so
    # parameters that are views into one flat buffer (DeepSpeed ZeRO-2, FSDP-gathered) save too.
    hf_config(model).save_pretrained(str(path))
    state = _state_once(model.state_dict())
    backbone = {n[len(_BACKBONE_PREFIX):]: v for n, v in state.items() if n.startswith(_BACKBONE_PREFIX)}
    extra = {n: v for n, v in state.items() if not n.startswith(_BACKBONE_PREFIX)}
    backbone[DIFFUSION_MARKER] = torch.ones(1, dtype=torch.int64)
    kind = diffusion_record(model)["kind"]
    save_file(backbone, str(path / WEIGHTS_NAME), metadata={"format": "pt", DIFFUSION_CONFIG_KEY: kind})
    if extra:
        save_file(extra, str(path / EXTRA_WEIGHTS_NAME), metadata={"format": "pt"})
    elif (path / EXTRA_WEIGHTS_NAME).exists():  # left by an earlier save of another model into the same folder
        (path / EXTRA_WEIGHTS_NAME).unlink()
    generation_config = getattr(model.hf_model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(path))


def load_model(build: Callable[..., Any], path: Path, record: dict[str, Any] | None,
               dtype: torch.dtype | str | None) -> Any:
    """Rebuild the adapted model of the folder ``path`` from its files and its record ``record`` (``None``: the
    folder has no :data:`~unifusion.hf.checkpoint.CONFIG_NAME`, a ``ValueError`` naming ``directory``).

    Args:
        build: the wrapper class (:class:`~unifusion.hf.DiffusionLM`), called as ``build(hf_model, bos_token_id=...,
            mask_token_id=..., time_conditioning=..., added_mask_token=..., block_size=...)``.
        path: the folder.
        record: its :data:`~unifusion.hf.checkpoint.CONFIG_NAME`.
        dtype: floating dtype of the weights; default the saved one.
    """
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    weights_dtype = parse_dtype(dtype)
    if record is None:
        if (path / "config.json").is_file():
            raise ValueError(
                f"directory: {str(path)!r} is a plain Hugging Face model folder (config.json, no {CONFIG_NAME}); "
                "load it with transformers and wrap it: adapt_ar_model(AutoModelForCausalLM.from_pretrained("
                f"{str(path)!r}))")
        raise ValueError(f"directory: expected a folder written by DiffusionLM.save_pretrained (holding "
                         f"{CONFIG_NAME}), got {str(path)!r}")
    saved_dtype = parse_dtype(record.get("dtype", "float32"))
    build_dtype = weights_dtype if weights_dtype is not None else saved_dtype
    model_cls = getattr(transformers, record.get("architecture", ""), None)
    wrapper_kwargs = dict(bos_token_id=record["bos_token_id"], mask_token_id=record["mask_token_id"],
                          time_conditioning=record.get("time_conditioning", False),
                          added_mask_token=record.get("added_mask_token", False), block_size=record.get("block_size"))
    if _is_transformers_folder(path):
        loader = model_cls if model_cls is not None else AutoModelForCausalLM
        weights = load_file(str(path / WEIGHTS_NAME), device="cpu")
        weights.pop(DIFFUSION_MARKER, None)  # the key that makes a plain causal-LM load warn
        # no path: the weights come from state_dict (transformers refuses both); typed str | PathLike there
        hf = loader.from_pretrained(None, config=AutoConfig.from_pretrained(str(path)),  # type: ignore[arg-type]
                                    state_dict=weights, dtype=build_dtype)
        if (path / "generation_config.json").is_file():
            hf.generation_config = GenerationConfig.from_pretrained(str(path))
        model = build(hf, **wrapper_kwargs)
        extra_path = path / EXTRA_WEIGHTS_NAME
        state = load_file(str(extra_path), device="cpu") if extra_path.is_file() else {}
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [n for n in missing if not n.startswith(_BACKBONE_PREFIX)]
        if missing or unexpected:
            raise ValueError(f"directory: {EXTRA_WEIGHTS_NAME} does not match the model (missing {missing[:5]}, "
                             f"unexpected {list(unexpected)[:5]})")
    else:  # the earlier format: the wrapper's state dict, the backbone rebuilt from base_config
        base_config = dict(record["base_config"])
        model_type = base_config.pop("model_type", record.get("model_type"))
        config = AutoConfig.for_model(model_type, **base_config)
        with _no_init():
            hf = (model_cls._from_config(config, dtype=build_dtype) if model_cls is not None
                  else AutoModelForCausalLM.from_config(config, dtype=build_dtype))
        hf.tie_weights()  # skipped under no_init_weights; the saved file holds tied tensors once
        model = build(hf, **wrapper_kwargs)
        state = load_file(str(path / WEIGHTS_NAME), device="cpu")
        missing, unexpected = model.load_state_dict(state, strict=False)
        # names left out of the file must be tied to a tensor that was loaded
        params = dict(model.state_dict(keep_vars=True))
        loaded_ptrs = {params[n].data_ptr() for n in state if n in params}
        untied = [n for n in missing if params[n].data_ptr() not in loaded_ptrs]
        if untied or unexpected:
            raise ValueError(f"directory: {WEIGHTS_NAME} does not match the model (missing {untied[:5]}, "
                             f"unexpected {list(unexpected)[:5]})")
    return model


def _is_transformers_folder(path: Path) -> bool:
    """Whether ``path`` holds the backbone as a transformers checkpoint (``config.json`` and a weights file under
    transformers' names), rather than the earlier format (the wrapper's state dict, names prefixed ``base_model.``)."""
    from safetensors import safe_open

    if not (path / "config.json").is_file():
        return False
    with safe_open(str(path / WEIGHTS_NAME), framework="pt") as f:
        return not any(name.startswith(_BACKBONE_PREFIX) for name in f.keys())


def _no_init() -> Any:
    try:
        from transformers.initialization import no_init_weights
        return no_init_weights()
    except ImportError:  # pragma: no cover - older transformers
        import contextlib
        return contextlib.nullcontext()
