"""The checkpoint folders of the released diffusion LMs, read lazily and written back in their own layout.

A released checkpoint folder holds the kind's ``config.json`` (its own keys and ``model_type``) and its weights as
safetensors — one ``model.safetensors``, or shards listed by ``model.safetensors.index.json`` — under its own names.
:func:`load_weights` builds the transformers backbone on the ``meta`` device (no memory), then reads the shards one
tensor at a time, renames each (the kind's ``weight_names``), casts it to the dtype asked and puts it in place: the
peak is the weights in that dtype plus one tensor. A weight the mapping does not know, or one it expects and no
shard holds, is a ``ValueError`` naming them. A checkpoint tensor may also be one part of a backbone parameter (a
:class:`ParameterPart`: one expert's projection inside transformers' fused ``(E, ·, ·)`` expert tensors); the
parameter is then allocated once, in the dtype asked, and each part read into its place. A tensor kept as it is
stays on the shard's memory map (no copy); one that is cast is read with plain file reads at its offset, and so is
every tensor of a shard that holds parts (a part straight into the fused parameter): none of the file's pages are
mapped into the process beside the copies. (A tensor kept on the map beside copied ones would pull their pages in
too: the kernel maps the cached pages around a faulted one, whole large folios on recent kernels.)
:func:`save_weights` writes the kind's ``config.json`` and the weights under its names (sharded past
``max_shard_bytes``, with the index), which the kind's own modeling code (``trust_remote_code``) loads with
identical weights.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["INDEX_NAME", "WEIGHTS_FILE", "ParameterPart", "WeightTarget", "build_backbone", "load_weights",
           "read_source_config", "resolve_dtype", "save_weights", "transformers_layout_settings",
           "transformers_layout_weight_names"]

WEIGHTS_FILE = "model.safetensors"
"""The single-file weights of a checkpoint folder."""

INDEX_NAME = "model.safetensors.index.json"
"""The index of a sharded checkpoint (``weight_map``: weight name → shard file)."""



@dataclass(frozen=True)
class ParameterPart:
    """A checkpoint tensor that is one part of the backbone parameter ``name``: ``parameter[index, start:stop]``
    (``start``/``stop`` ``None``: all of ``parameter[index]``) — e.g. expert ``e``'s ``gate_proj`` ``(I, d)`` is
    ``ParameterPart("…experts.gate_up_proj", e, 0, I)`` of the fused ``(E, 2I, d)`` tensor."""

    name: str
    index: int
    start: int | None = None
    stop: int | None = None

    def of(self, parameter: torch.Tensor) -> torch.Tensor:
        """The part's view of ``parameter``."""
        return parameter[self.index, self.start:self.stop]


WeightTarget = str | ParameterPart
"""Where a checkpoint tensor goes in the backbone: a parameter name, or a :class:`ParameterPart` of one."""


def _parameter_name(target: WeightTarget) -> str:
    return target.name if isinstance(target, ParameterPart) else target


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a floating ``torch.dtype`` (``"bfloat16"`` or ``torch.bfloat16``), or ``None`` (the saved one)."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype: expected a floating torch.dtype or one of {sorted(_DTYPES)}, got {dtype!r}")


def read_source_config(path: Path, model_type: str) -> dict[str, Any]:
    """The folder's ``config.json`` as a dict; ``ValueError`` when there is none or it names another model type."""
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"directory: {str(path)!r} holds no config.json (a {model_type!r} checkpoint folder has one)")
    source = json.loads(config.read_text(encoding="utf-8"))
    if not isinstance(source, dict) or source.get("model_type") != model_type:
        found = source.get("model_type") if isinstance(source, dict) else type(source).__name__
        raise ValueError(f"directory: {str(path)!r} is not a {model_type!r} checkpoint (config.json model_type = "
                         f"{found!r})")
    return source


def transformers_layout_settings(source: dict[str, Any], kind: str) -> dict[str, Any]:
    """The backbone-config settings of a released ``config.json`` already keyed as transformers' Qwen2/Qwen3 configs
    (Dream, SDAR, Fast-dLLM v2): sizes, RMSNorm ε, RoPE θ, special tokens; SwiGLU, no sliding window, no KV cache,
    SDPA. A kind adds its own keys (``head_dim``, biases) and checks its windows itself.

    Raises:
        ValueError: ``rope_scaling`` set (only the default RoPE is reproduced) or an MLP other than SwiGLU, naming
            ``kind``.
    """
    if source.get("rope_scaling"):
        raise ValueError(f"config.json: rope_scaling = {source['rope_scaling']!r}; only the default RoPE is supported")
    if source.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act = {source['hidden_act']!r}; {kind}'s MLP is SwiGLU ('silu')")
    heads = int(source["num_attention_heads"])
    return dict(  # **: rope_theta and attn_implementation are keywords transformers reads
        vocab_size=int(source["vocab_size"]), hidden_size=int(source["hidden_size"]),
        intermediate_size=int(source["intermediate_size"]), num_hidden_layers=int(source["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=int(source.get("num_key_value_heads") or heads),
        hidden_act="silu", max_position_embeddings=int(source["max_position_embeddings"]),
        rms_norm_eps=float(source.get("rms_norm_eps", 1e-6)), rope_theta=float(source.get("rope_theta", 10000.0)),
        use_sliding_window=False, sliding_window=None, tie_word_embeddings=bool(source.get("tie_word_embeddings")),
        eos_token_id=source.get("eos_token_id"), pad_token_id=source.get("pad_token_id"),
        bos_token_id=source.get("bos_token_id"), use_cache=False, attn_implementation="sdpa")


def transformers_layout_weight_names(source: dict[str, Any], layer: list[str]) -> dict[str, str]:
    """``{name: name}`` for a checkpoint stored under transformers' own names: the embedding, the final norm, each
    of ``num_hidden_layers`` layers' ``layer`` weights (``model.layers.{i}.<name>``) and the head unless
    ``tie_word_embeddings``."""
    names = {"model.embed_tokens.weight": "model.embed_tokens.weight", "model.norm.weight": "model.norm.weight"}
    for i in range(int(source["num_hidden_layers"])):
        for name in layer:
            names[f"model.layers.{i}.{name}"] = f"model.layers.{i}.{name}"
    if not source.get("tie_word_embeddings"):
        names["lm_head.weight"] = "lm_head.weight"
    return names


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not (path / f).is_file()]
        if absent:
            raise ValueError(f"directory: {INDEX_NAME} lists shards that are not in {str(path)!r}: {absent[:4]}")
        return [path / f for f in files]
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    raise ValueError(f"directory: {str(path)!r} holds neither {WEIGHTS_FILE} nor {INDEX_NAME} (safetensors weights; "
                     "convert a pytorch_model.bin checkpoint with transformers' save_pretrained first)")


def _rebuild_meta_buffers(module: nn.Module, config: Any) -> None:
    """Recompute the non-persistent buffers left on ``meta`` (the rotary embeddings' ``inv_freq``) on the CPU by
    building their modules again from ``config``; ``ValueError`` if some other tensor is still on ``meta``."""
    for name, sub in list(module.named_modules()):
        if any(b.is_meta for b in sub.buffers(recurse=False)) and hasattr(sub, "inv_freq"):
            module.set_submodule(name, type(sub)(config=config))
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"checkpoint: no weights for {left[:8]}")


# safetensors' dtype names (its header's "dtype")
_STORED_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
                  "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                  "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class _ShardRead:
    """A shard tensor, read when asked: ``()`` gives a tensor over the shard's memory map (kept as a parameter: no
    copy), or, when the shard is not mapped (``kept`` ``None``), :meth:`read_copy`; :meth:`copy_into` and
    :meth:`read_copy` read its bytes with plain file reads (``readinto`` at its offset), which map none of the file
    into the process (its pages stay in the page cache, which the process's resident memory does not count)."""

    kept: Callable[[], torch.Tensor] | None  # None: the shard is not mapped, () reads a copy
    file: Any  # the shard opened for reading, unbuffered
    offset: int  # of the tensor's bytes in the file
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __call__(self) -> torch.Tensor:
        return self.kept() if self.kept is not None else self.read_copy()

    def copy_into(self, out: torch.Tensor) -> None:
        """Write the tensor into ``out`` (its shape), converting to ``out``'s dtype; no copy in between when ``out``
        is contiguous in the stored dtype."""
        if out.dtype == self.dtype and out.is_contiguous():
            _read_bytes(self.file, self.offset, out)
        else:
            out.copy_(self.read_copy())

    def read_copy(self) -> torch.Tensor:
        """The tensor in its own memory, in its stored dtype."""
        out = torch.empty(self.shape, dtype=self.dtype)
        _read_bytes(self.file, self.offset, out)
        return out


@dataclass(frozen=True)
class _Loaded:
    """A tensor already in memory, read as a :class:`_ShardRead` is."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def __call__(self) -> torch.Tensor:
        return self.tensor

    def copy_into(self, out: torch.Tensor) -> None:
        out.copy_(self.tensor)

    def read_copy(self) -> torch.Tensor:
        return self.tensor


def _read_bytes(file: Any, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous ``out`` with the file's bytes from ``offset`` on (a ``ValueError`` when the file ends
    first)."""
    view = out.reshape(-1).view(torch.uint8).numpy()  # out's own memory (out is contiguous)
    file.seek(offset)
    done = 0
    while done < len(view):
        n = file.readinto(view[done:])
        if not n:
            raise ValueError(f"checkpoint: {file.name!r} ends inside a tensor (truncated file)")
        done += n


def _stored_tensors(file: Any) -> dict[str, tuple[int, torch.dtype, tuple[int, ...]]]:
    """``{name: (offset in the file, dtype, shape)}`` of the safetensors file ``file`` (its header: an 8-byte
    little-endian length, then that many bytes of JSON giving each tensor's ``dtype``, ``shape`` and
    ``data_offsets`` from the end of the header), leaving out tensors of a dtype torch does not have."""
    file.seek(0)
    size = int.from_bytes(file.read(8), "little")
    header = json.loads(file.read(size))
    return {name: (8 + size + int(entry["data_offsets"][0]), _STORED_DTYPES[entry["dtype"]],
                   tuple(int(n) for n in entry["shape"]))
            for name, entry in header.items() if name != "__metadata__" and entry["dtype"] in _STORED_DTYPES}


def _shard_tensors(files: list[Path], copied: frozenset[str] = frozenset()
                   ) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """``(name, read)`` for every tensor of the shards, each read only when asked for (one shard open at a time;
    ``read`` a :class:`_ShardRead`, or a plain read of the memory map for a dtype torch does not have). A shard
    holding one of the ``copied`` tensors is not mapped: each of its tensors is read with file reads."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f, open(file, "rb", buffering=0) as raw:
            stored = _stored_tensors(raw)
            mapped = stored.keys().isdisjoint(copied)
            for key in f.keys():
                kept = functools.partial(f.get_tensor, key)
                yield key, _ShardRead(kept if mapped else None, raw, *stored[key]) if key in stored else kept


def build_backbone(backbone_class: type[nn.Module], config: Any, names: Mapping[str, WeightTarget],
                   tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]], dtype: torch.dtype | str | None,
                   where: str) -> Any:
    """``backbone_class(config)`` built on the ``meta`` device, its parameters the ``tensors`` renamed by ``names``.

    Args:
        backbone_class: a transformers ``*ForCausalLM`` class.
        config: its config.
        names: ``{name in the checkpoint: parameter name in the backbone, or a ParameterPart of one}``, every
            weight the checkpoint must hold.
        tensors: ``(name in the checkpoint, read)`` pairs; ``read()`` gives the tensor (called once, for known
            names only).
        dtype: the floating dtype of the weights, or ``None`` (each tensor's own).
        where: what the tensors are, for the messages (a folder, a model).

    Raises:
        ValueError: a tensor the mapping does not know (unexpected), a weight it expects that is not among the
            tensors (missing), or a tensor of the wrong shape.
    """
    want = resolve_dtype(dtype)
    with torch.device("meta"):
        backbone: Any = backbone_class(config)
    params = dict(backbone.named_parameters())
    seen: set[str] = set()
    unexpected: list[str] = []
    for key, read in tensors:
        if key not in names:
            unexpected.append(key)
            continue
        target = names[key]
        name = _parameter_name(target)
        if name not in params:
            raise ValueError(f"checkpoint: {key!r} maps to {name!r}, which the backbone does not have")
        source = read if isinstance(read, _ShardRead) else _Loaded(read())  # a shard's tensor: read below
        expected = params[name] if isinstance(target, str) else target.of(params[name])
        if source.shape != tuple(expected.shape):
            raise ValueError(f"checkpoint: {key!r} has shape {source.shape} in {where}, its config says "
                             f"{tuple(expected.shape)}")
        owner, _, leaf = name.rpartition(".")
        module = backbone.get_submodule(owner)
        if isinstance(target, ParameterPart):
            if module._parameters[leaf].is_meta:  # the fused parameter, allocated at its first part
                module._parameters[leaf] = nn.Parameter(torch.empty(params[name].shape, dtype=want or source.dtype))
            source.copy_into(target.of(module._parameters[leaf].data))
        else:
            kept = want is None or source.dtype == want
            module._parameters[leaf] = nn.Parameter(source() if kept else source.read_copy().to(want))
        seen.add(key)
    missing = sorted(set(names) - seen)
    if missing or unexpected:
        raise ValueError(f"checkpoint: {where} does not match its config: missing weights "
                         f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected weights "
                         f"{sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if getattr(config, "tie_word_embeddings", False):
        backbone.tie_weights()
    _rebuild_meta_buffers(backbone, config)
    backbone.config.dtype = backbone.lm_head.weight.dtype
    return backbone


def load_weights(backbone_class: type[nn.Module], config: Any, names: Mapping[str, WeightTarget], path: Path,
                 dtype: torch.dtype | str | None) -> Any:
    """The backbone ``backbone_class(config)`` with the folder's weights (module docstring), in ``dtype`` (default
    the saved one), on the CPU: :func:`build_backbone` over the folder's shards, read one tensor at a time.

    Raises:
        ValueError: no safetensors weights, or what :func:`build_backbone` raises.
    """
    files = _weight_files(path)
    copied = frozenset(key for key, target in names.items() if isinstance(target, ParameterPart))
    return build_backbone(backbone_class, config, names, _shard_tensors(files, copied), dtype, repr(str(path)))


def save_weights(backbone: nn.Module, source: dict[str, Any], names: Mapping[str, WeightTarget], path: Path, *,
                 max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``source`` (the kind's ``config.json``, its dtype entry set to the weights') and the backbone's weights
    under the kind's names ``names`` (``{their name: parameter name or ParameterPart}``) into the folder ``path``: one
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``. Weight
    files of an earlier save in the folder are replaced."""
    from safetensors.torch import save_file

    params = dict(backbone.named_parameters(remove_duplicate=False))
    absent = sorted({_parameter_name(ours) for ours in names.values()} - set(params))
    if absent:
        raise ValueError(f"model: the backbone lacks the weights {absent[:8]} its checkpoint layout names")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for theirs, ours in names.items():
        parameter = params[_parameter_name(ours)].detach()
        tensor = parameter.to("cpu").contiguous() if isinstance(ours, str) else \
            ours.of(parameter).to("cpu").clone()  # a part: its own storage (safetensors refuses shared tensors)
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][theirs] = tensor
        size += nbytes
    for old in [*path.glob("model*.safetensors"), path / INDEX_NAME]:
        if old.is_file():
            old.unlink()
    if len(shards) == 1:
        save_file(shards[0], str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
        (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                  indent=2, sort_keys=True) + "\n", encoding="utf-8")
    config = dict(source)
    dtype = str(next(iter(params.values())).dtype).removeprefix("torch.")
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = dtype
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
