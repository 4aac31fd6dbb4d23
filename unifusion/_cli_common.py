"""What the ``unifusion`` subcommands share: the help formatter, argument types, the model/judge/sampler options and
their loaders, and small output helpers (:mod:`unifusion.cli` builds the parser; :mod:`unifusion._cli_eval` holds
``unifusion eval``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .denoiser import Denoiser, DenoiserModule

__all__ = ["HelpFormatter", "checked", "positive_int", "non_negative_int", "probability", "resolve_device",
           "resolve_kernel", "read_texts", "write_json", "model_args", "judge_args", "sampler_args", "load_model",
           "load_judge", "entropy_tokenizer", "print_table"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Plain-text help: descriptions keep their line breaks, and every option's help line ends with its default
    (unless it already states one, or the option has none: flags, required options, or no default value)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or action.required or "default" in text.lower()
                or any(action.default is none for none in (None, argparse.SUPPRESS, False))):
            return text
        default = " ".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {default})".lstrip()


# ---------------------------------------------------------------------------------------------------------------
# argument types


def checked(parse: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses with ``parse`` and accepts values with ``ok(value)``."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return convert


positive_int = checked(int, lambda v: v >= 1, "a positive integer")
non_negative_int = checked(int, lambda v: v >= 0, "a non-negative integer")
probability = checked(float, lambda v: 0.0 <= v < 1.0, "a float in [0, 1)")


# ---------------------------------------------------------------------------------------------------------------
# loading (the loaders live in unifusion.hf.loading)


def resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_kernel(kind: str | None, model: Denoiser | None, *, p_uniform: float | None = None) -> tuple[Any, str]:
    """``(kernel, why)``: the kernel ``--kernel`` names on the model's states (mask id ``model.mask_token_id``), or,
    without one, :func:`unifusion.hf.default_kernel`'s rule (the kernel saved with the model, else mask on its mask
    token, else uniform) — the rule ``DiffusionLM.generate`` follows. ``--p-uniform`` is for ``--kernel hybrid``
    only."""
    from ._kernel_config import DEFAULT_P_UNIFORM, default_kernel, make_kernel

    if p_uniform is not None and kind != "hybrid":
        raise ValueError(f"--p-uniform: only used with --kernel hybrid, got --kernel {kind or '(not given)'}")
    assert model is not None  # only the --p-uniform check above runs without a model
    if kind is not None:
        kernel = make_kernel(kind, int(model.num_states), model.mask_token_id, name="--kernel",
                             p_uniform=DEFAULT_P_UNIFORM if p_uniform is None else p_uniform)
        return kernel, "--kernel"
    return default_kernel(model)


def read_texts(path: str, *, arg: str = "--texts") -> list[str]:
    """Texts from a ``.jsonl`` file (field ``text``, as ``unifusion sample --out`` writes) or one per line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{arg}: no such file {path!r}")
    lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if p.suffix == ".jsonl":
        texts = []
        for k, line in enumerate(lines):
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{arg}: line {k + 1} of {path!r} has no string field 'text'")
            texts.append(record["text"])
    else:
        texts = lines
    if not texts:
        raise ValueError(f"{arg}: {path!r} holds no text")
    return texts


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------------------------
# shared argument groups


def model_args(p: argparse.ArgumentParser, *, kernel: bool = True, dtype: str = "float32") -> None:
    """The model options; ``dtype``: the ``--dtype`` default (``"auto"`` for commands that generate, float32 for
    the ones that score, where bf16 rounding would move the numbers)."""
    from ._kernel_config import DEFAULT_P_UNIFORM, KERNEL_NAMES

    g = p.add_argument_group("model")
    g.add_argument("--model", required=True,
                   help="a saved DiffusionLM folder, a Hugging Face causal-LM folder, a .gguf file, or 'smollm2'")
    g.add_argument("--gguf-file", default=None, help="GGUF file name inside the --model folder (default: none)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the one saved with the model)")
    if kernel:
        g.add_argument("--kernel", choices=KERNEL_NAMES, default=None,
                       help="forward corruption kernel (default: the one saved with the model, else mask when the "
                            "model has a mask token, uniform otherwise; the choice is printed)")
        g.add_argument("--p-uniform", type=probability, default=None,
                       help=f"the hybrid kernel's uniform share, with --kernel hybrid (default: {DEFAULT_P_UNIFORM})")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float64"), default=dtype,
                   help="weights' dtype; auto: bfloat16 where the device computes it natively (CUDA with bf16, a CPU "
                        f"with AVX512-BF16 or AMX), float32 elsewhere (default: {dtype})")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")


def judge_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("judge")
    g.add_argument("--judge", required=True, help="judge causal LM: HF folder, .gguf file, or 'smollm2'")
    g.add_argument("--judge-gguf-file", default=None, help="GGUF file name inside the --judge folder (default: none)")
    g.add_argument("--judge-batch-size", type=positive_int, default=8, help="texts per judge forward pass")


def sampler_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--sampler", choices=("bayesian", "euler"), default="bayesian",
                   help="Bayesian (Algorithm 2) or Euler (tau-leaping) sampler")
    g.add_argument("--num-samples", type=positive_int, default=4, help="number of samples")
    g.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sample")
    g.add_argument("--batch-size", type=positive_int, default=16, help="samples per sampler call")
    g.add_argument("--temperature", type=float, default=1.0, help="softmax temperature of the x0 prediction")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: off)")


def load_model(args: argparse.Namespace) -> tuple[DenoiserModule, Any, Any]:
    """``(model, tokenizer, kernel)``; the kernel by :func:`resolve_kernel`, announced on stderr with the reason."""
    from .hf.loading import load_diffusion_model

    device = resolve_device(args.device)
    if getattr(args, "p_uniform", None) is not None and args.kernel != "hybrid":  # before loading anything
        resolve_kernel(args.kernel, None, p_uniform=args.p_uniform)
    model, tok = load_diffusion_model(args.model, kernel=getattr(args, "kernel", None), gguf_file=args.gguf_file,
                                      tokenizer=args.tokenizer, dtype=dtype_name(args.dtype, device), device=device)
    if not hasattr(args, "kernel"):
        return model, tok, None
    kernel, why = resolve_kernel(args.kernel, model, p_uniform=args.p_uniform)
    if why != "--kernel":
        command = " ".join(c for c in (args.command, getattr(args, "eval_command", None)) if c)
        print(f"unifusion {command}: kernel {kernel!r} ({why}; pass --kernel to choose)", file=sys.stderr)
    return model, tok, kernel


def dtype_name(dtype: str, device: str) -> str:
    """A ``--dtype`` value with ``auto`` resolved for ``device`` (:func:`unifusion.precision.auto_dtype`)."""
    from .precision import auto_dtype

    return str(auto_dtype(device)).removeprefix("torch.") if dtype == "auto" else dtype


def load_judge(args: argparse.Namespace) -> tuple[Any, Any]:
    from .hf.loading import load_causal_lm

    return load_causal_lm(args.judge, gguf_file=args.judge_gguf_file, device=resolve_device(args.device),
                          arg="--judge")


def entropy_tokenizer(name: str, model_tokenizer: Any) -> Any:
    from transformers import AutoTokenizer

    from .eval import gpt2_tokenizer

    if name == "gpt2":
        return gpt2_tokenizer()
    if name == "model":
        return model_tokenizer
    return AutoTokenizer.from_pretrained(name)


def print_table(rows: Sequence[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
