"""The harness model's arguments (``--model_args name=value,...``): their table (:data:`MODEL_ARGS`, printed by
``unifusion harness --help``), defaults, and the parsers that accept them as command-line strings (``"32"``,
``"True"``) or as Python values (``simple_evaluate(model_args={...})``), raising ``ValueError``/``TypeError`` that name
the argument."""

from __future__ import annotations

from typing import Any

METHODS = ("score", "fair_pmi")
SEEDINGS = ("request", "task")
DEFAULT_MAX_GEN_TOKS = 256
"""New tokens of a ``generate_until`` request whose task sets no ``max_gen_toks`` (the harness's own default)."""
FALLBACK_MAX_LENGTH = 2048
"""``max_length`` of a model whose config names no position limit (the harness's hf model uses the same)."""
FAIR_PMI_T_MIN = 1e-3  # fair_pmi_scores' default t_min
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")
GEN_KEYS = {"until", "do_sample", "temperature", "top_p", "top_k", "policy", "block_size", "threshold", "num_steps"}
MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # priority order
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}

MODEL_ARGS: tuple[tuple[str, str, str], ...] = (
    ("pretrained", "-", "folder written by DiffusionLM.save_pretrained (its saved tokenizer is used)"),
    ("tokenizer", "the saved one", "tokenizer folder (in Python also an object; with model= a live model)"),
    ("kernel", "the saved one", "forward kernel the model was trained with: mask or uniform (default: the one saved "
     "with it, else mask if it has a mask token, else uniform)"),
    ("method", "score", "loglikelihood scorer: score (span score, K = 32) or fair_pmi (Fair-PMI, K = 128)"),
    ("fair_pmi", "false", "true is method=fair_pmi"),
    ("num_times", "32 / 128", "K, the time points of the loglikelihood scorer (score / fair_pmi)"),
    ("null_context", "Answer:", "Fair-PMI's answer-only context"),
    ("check_greedy", "true", "compute loglikelihood's is_greedy (one extra row per answer); false: always False"),
    ("nll_times", "128", "stratified times of loglikelihood_rolling's bound"),
    ("max_length", "model's positions - 1", "context + answer / prompt + new tokens; rolling window length"),
    ("max_gen_toks", "none", "cap on generate_until's new tokens (the task's max_gen_toks, else 256)"),
    ("num_steps", "64 / block", "policy=none: sampler steps (forward passes) per generate_until batch; with a "
     "policy: steps per block (default: the block size; adaptive policies may take fewer)"),
    ("policy", "none", "generate_until's decoder: none (the Bayesian sampler over the whole sequence) or a decoding "
     "policy (block decoding, EOS stops a row): low_confidence, random, margin, entropy, threshold, entropy_bound"),
    ("block_size", "none", "with a policy: positions per block (a block model: its own; default: one block)"),
    ("threshold", "0.9", "the threshold policy's confidence (implies policy=threshold when no policy is named)"),
    ("cache_refresh", "none", "with a policy on a bidirectional model: the approximate dual cache, a full forward "
     "every N steps of a block"),
    ("merge_commits", "false", "with a policy on a block model: each finished block runs within the next block's "
     "first step (one forward fewer per block, the same tokens)"),
    ("do_sample", "false", "sample when a task sets neither do_sample nor temperature (else argmax x0)"),
    ("temperature", "1.0", "sampling temperature unless the task's gen_kwargs set one"),
    ("top_p", "off", "nucleus mass of sampling unless the task's gen_kwargs set one"),
    ("top_k", "off", "top-k of sampling unless the task's gen_kwargs set one"),
    ("seed", "0", "seeds every request's random numbers (with seeding=request: seed and request content)"),
    ("seeding", "request", "request: a generator per request; task: one stream per task (run_multiple_choice's)"),
    ("batch_size", "64", "rows per forward pass / prompts per sampler batch (--batch_size; auto means 64)"),
    ("dtype", "the saved one", "weights' dtype: float32, bfloat16, float64 (auto: the saved one)"),
    ("device", "cuda if available", "cpu, cuda, cuda:1, ...; under torchrun each process takes cuda:LOCAL_RANK"),
)
"""``(name, default, meaning)`` of every model argument (``--model_args name=value,...``), printed by
``unifusion harness --help``."""


def model_args_help() -> str:
    """The preamble ``unifusion harness --help`` prints before the harness's own options: what the model does, two
    example command lines and the table of :data:`MODEL_ARGS`."""
    width = max(len(name) for name, _, _ in MODEL_ARGS)
    dwidth = max(len(default) for _, default, _ in MODEL_ARGS)
    rows = "\n".join(f"  {name:<{width}}  {default:<{dwidth}}  {meaning}" for name, default, meaning in MODEL_ARGS)
    return (
        "unifusion harness: EleutherAI's lm-evaluation-harness ('lm-eval run') with the unifusion diffusion model\n"
        "registered as 'unifusion', the default --model. loglikelihood is the paper's span score (or Fair-PMI),\n"
        "loglikelihood_rolling the NLL bound of Proposition 3.2, generate_until the Bayesian sampler.\n\n"
        "  unifusion harness --model_args pretrained=DIR,num_steps=64 --tasks piqa,hellaswag --batch_size 64\n"
        "  torchrun --nproc_per_node=8 -m unifusion harness --model_args pretrained=DIR --tasks piqa\n\n"
        f"model arguments (--model_args name=value,...):\n  {'name':<{width}}  {'default':<{dwidth}}  meaning\n"
        f"{rows}\n\n"
        "The harness's own options follow (docs/guides/evaluation.md has the details).\n"
        + "=" * 100 + "\n"
    )


def as_int(name: str, value: Any, *, minimum: int = 1) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got {value!r}")
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected an integer, got {value!r}") from None
    if out != float(value) or out < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return out


def as_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number, got {value!r}") from None


def as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise ValueError(f"{name}: expected true or false, got {value!r}")


def as_top_p(value: Any) -> float | None:
    if value is None or str(value).strip().lower() in ("none", "off"):
        return None
    top_p = as_float("top_p", value)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: expected a float in (0, 1] or None, got {value!r}")
    return None if top_p == 1.0 else top_p


def as_top_k(value: Any) -> int | None:
    if value is None or str(value).strip().lower() in ("none", "off"):
        return None
    top_k = as_int("top_k", value, minimum=0)
    return None if top_k == 0 else top_k  # 0 is "off", as in transformers


def as_temperature(value: Any) -> float:
    temperature = as_float("temperature", value)
    if not temperature >= 0.0 or temperature == float("inf"):
        raise ValueError(f"temperature: expected a finite float >= 0, got {value!r}")
    return temperature


def as_batch_size(value: Any) -> int:
    if value is None or str(value).startswith("auto"):  # the harness's "auto[:N]": our scorers batch by rows
        return 64
    return as_int("batch_size", value)
