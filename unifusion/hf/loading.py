"""Models named by a string, as the command line and scripts name them: ``smollm2`` (the embedded default, see
:mod:`unifusion.hf.embedded`), a Hugging Face folder, a ``.gguf`` file, or a folder written by
:meth:`DiffusionLM.save_pretrained <unifusion.hf.DiffusionLM.save_pretrained>`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

from ..denoiser import DenoiserModule
from .ar.adapt import adapt_ar_model
from .ar.model import DiffusionLM
from .checkpoint import CONFIG_NAME
from .embedded import load_smollm2, load_smollm2_tokenizer
from .registry import load_registered, registered_model_type

__all__ = ["dtype_from_name", "load_causal_lm", "load_diffusion_model"]

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
                         tokenizer: str | None = None, dtype: str = "float32", device: str = "cpu"
                         ) -> tuple[DenoiserModule, Any]:
    """``(DiffusionLM, tokenizer)``: a saved DiffusionLM folder, or a causal LM adapted on the fly; or ``(wrapper,
    tokenizer)`` for a checkpoint folder of a native diffusion LM in :mod:`unifusion.hf.registry` (DiffusionGemma).

    On-the-fly adaptation adds a mask token for ``mask``/``hybrid`` kernels; for ``uniform`` or ``None`` (no kernel
    named) it keeps the vocabulary (``add_mask_token=False``: no absorbing state, ``model.mask_token_id is None``).
    """
    from transformers import AutoTokenizer

    path = Path(spec)
    if registered_model_type(path) is not None:
        # a registered family's wrapper: a Denoiser that is a module (DiffusionGemmaLM)
        native = cast(DenoiserModule, load_registered(path, dtype=dtype_from_name(dtype), device=device))
        tok = AutoTokenizer.from_pretrained(tokenizer) if tokenizer is not None else native.tokenizer
        if tok is None:
            raise ValueError(f"--tokenizer: no tokenizer saved in {spec!r}; pass --tokenizer PATH")
        return native, tok
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
