"""A unifusion model inside EleutherAI's lm-evaluation-harness (``lm-eval`` on PyPI; ``pip install "unifusion[eval]"``).

Importing this module registers the harness model ``"unifusion"`` (:class:`UnifusionLM`), so both ways in work:

    unifusion harness --model_args pretrained=DIR --tasks piqa --batch_size 16      # the harness's own CLI
    lm_eval.simple_evaluate(model="unifusion", model_args="pretrained=DIR", tasks=["piqa"])
    lm_eval.simple_evaluate(model=UnifusionLM(model=model, tokenizer=tok), tasks=[...])   # a live model, in training

The three request types, with the paper's protocols (App. C.4, Proposition 3.2):

* ``loglikelihood(context, continuation)`` returns ``(−score, is_greedy)``. ``score`` is the paper's diffusion span
  score S(a) over the K-point time grid (:func:`~unifusion.eval.score_choices`, ``method="score"``, K = 32), or the
  Fair-PMI score (:func:`~unifusion.eval.fair_pmi_scores`, ``method="fair_pmi"``, K = 128, null context
  ``"Answer:"``). Both are *per-token* scores, lower is better, so the harness's ``acc`` (argmax of the returned
  value) is the protocol of :func:`~unifusion.eval.run_multiple_choice` (with ``seeding="task"``, its very numbers);
  ``acc_norm`` (divided by the answer's length in bytes) has no counterpart in the paper. The requests of one
  question (consecutive requests with the same ``task_name`` and ``doc_id``, as the harness emits them) are scored
  with shared randomness, as ``run_multiple_choice`` does; options with their own contexts (WinoGrande) are scored
  from the same generator state. The rows of all questions are pooled: rows of equal length go through the model
  ``batch_size`` at a time, whichever question they belong to (the draws are made per question first, so the pooling
  changes no number).
  ``is_greedy`` is True when every answer token is the argmax of the model's x0 prediction with the whole answer
  span replaced by noise at t = 1 − 10⁻³ (one extra row per answer, pooled the same way; ``check_greedy=False``
  skips it and returns False). Because the value is a per-token mean, metrics that sum or exponentiate
  log-likelihoods over documents (LAMBADA's ``perplexity``) are per-token-normalised, not sequence log-likelihoods.
* ``loglikelihood_rolling(text)`` returns −(Proposition 3.2's upper bound on −log p_θ(text)) in nats: a lower bound
  on the log-likelihood, from :func:`~unifusion.eval.nll_bound` with ``nll_times`` stratified times, over disjoint
  windows of ``max_length`` tokens (each window scored without the previous one as context).
* ``generate_until(context, gen_kwargs)``: the Bayesian sampler of :meth:`~unifusion.DiffusionLM.generate`
  (Algorithm 2) with the context as a fixed prefix, ``max_gen_toks`` new tokens, ``num_steps`` steps, ended at the
  tokenizer's EOS token and truncated at the first ``until`` string. ``do_sample=False`` (the harness's default when
  a task sets neither ``do_sample`` nor a temperature > 0) replaces x_θ by its argmax (a one-hot x_θ, ``top_k = 1``);
  the sampler's other random choices (which positions are revealed at each step; the noise tokens of a uniform
  kernel) stay, drawn from the request's own generator. Diffusion sampling has no unique greedy decoder: this is
  *deterministic* decoding (the same request gives the same text), not a search for the most likely sequence.

**Random numbers.** With ``seeding="request"`` (the default) every question of ``loglikelihood``, every text of
``loglikelihood_rolling`` and every ``generate_until`` request draws from its own generator, seeded with
:func:`request_seed` of the model's ``seed`` and the request's content. A request's numbers therefore do not depend on
the batch it is in, on the requests or tasks before it, or on the process that evaluates it (data-parallel runs give
the single-process numbers). Repeats of one request object (the harness's ``repeats``) get successive seeds, so
sampled repeats differ; greedy repeats are identical. ``seeding="task"`` instead streams one generator per task
through its questions in order, seeded with ``seed`` at the task's first request: the numbers of
``run_multiple_choice(..., seed=seed)`` and of ``nll_bound`` with one generator over the documents (one process only).

**Data-parallel evaluation.** Under ``torchrun`` / ``accelerate launch`` (``WORLD_SIZE`` > 1) the model joins the
process group (initialising it when the launcher has not: NCCL on CUDA, gloo on the CPU), runs on
``cuda:LOCAL_RANK`` (or the CPU), and gives the harness's evaluator ``rank``, ``world_size``, ``all_gather``,
``gather_object`` and ``barrier``: each process evaluates every ``world_size``-th document and rank 0 reports.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("unifusion.eval.harness needs EleutherAI's lm-evaluation-harness: "
                      "pip install \"unifusion[eval]\" (or pip install lm-eval)") from err

from .. import _validation as V
from ..kernels import InterpolatingKernel, Kernel, MaskKernel, UniformKernel
from ..rates import x0_log_probs
from ..samplers._draws import (
    BLOCK_SIZE,
    COMPILE_MIN_STATES,
    compiled_block_log_mass,
    draw_from_logits,
    sample_weights,
    x0_weights,
)
from ..samplers._setup import apply_prompt, time_grid
from ..samplers._step import mix_step, noise_tokens
from .choices import _corrupt_span, _standard_times, _stratified_times
from .likelihood import nll_bound
from .quality import _logits_of

__all__ = ["UnifusionLM", "cli_main", "request_seed", "MODEL_ARGS"]

METHODS = ("score", "fair_pmi")
SEEDINGS = ("request", "task")
DEFAULT_MAX_GEN_TOKS = 256
"""New tokens of a ``generate_until`` request whose task sets no ``max_gen_toks`` (the harness's own default)."""
FALLBACK_MAX_LENGTH = 2048
"""``max_length`` of a model whose config names no position limit (the harness's hf model uses the same)."""
_EPS = 1e-3  # the sampler's ε (DiffusionLM.generate's default): sampling starts at t_0 = 1 − ε
_FAIR_PMI_T_MIN = 1e-3  # fair_pmi_scores' default t_min
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")
_GEN_KEYS = {"until", "do_sample", "temperature", "top_p", "top_k"}
_MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # priority order
_F = TypeVar("_F", bound=Callable[..., Any])
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}

MODEL_ARGS: tuple[tuple[str, str, str], ...] = (
    ("pretrained", "-", "folder written by DiffusionLM.save_pretrained (its saved tokenizer is used)"),
    ("tokenizer", "the saved one", "tokenizer folder (in Python also an object; with model= a live model)"),
    ("kernel", "mask if the model has one", "forward kernel the model was trained with: mask or uniform"),
    ("method", "score", "loglikelihood scorer: score (span score, K = 32) or fair_pmi (Fair-PMI, K = 128)"),
    ("fair_pmi", "false", "true is method=fair_pmi"),
    ("num_times", "32 / 128", "K, the time points of the loglikelihood scorer (score / fair_pmi)"),
    ("null_context", "Answer:", "Fair-PMI's answer-only context"),
    ("check_greedy", "true", "compute loglikelihood's is_greedy (one extra row per answer); false: always False"),
    ("nll_times", "128", "stratified times of loglikelihood_rolling's bound"),
    ("max_length", "model's positions - 1", "context + answer / prompt + new tokens; rolling window length"),
    ("max_gen_toks", "none", "cap on generate_until's new tokens (the task's max_gen_toks, else 256)"),
    ("num_steps", "64", "sampler steps (forward passes) per generate_until batch"),
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


# ---------------------------------------------------------------------------------------------------------------
# model_args arrive as strings from the command line ("32", "True"), as Python values from simple_evaluate


def _as_int(name: str, value: Any, *, minimum: int = 1) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got {value!r}")
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected an integer, got {value!r}") from None
    if out != float(value) or out < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return out


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number, got {value!r}") from None


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise ValueError(f"{name}: expected true or false, got {value!r}")


def _as_top_p(value: Any) -> float | None:
    if value is None or str(value).strip().lower() in ("none", "off"):
        return None
    top_p = _as_float("top_p", value)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: expected a float in (0, 1] or None, got {value!r}")
    return None if top_p == 1.0 else top_p


def _as_top_k(value: Any) -> int | None:
    if value is None or str(value).strip().lower() in ("none", "off"):
        return None
    top_k = _as_int("top_k", value, minimum=0)
    return None if top_k == 0 else top_k  # 0 is "off", as in transformers


def _as_temperature(value: Any) -> float:
    temperature = _as_float("temperature", value)
    if not temperature >= 0.0 or temperature == float("inf"):
        raise ValueError(f"temperature: expected a finite float >= 0, got {value!r}")
    return temperature


def _as_batch_size(value: Any) -> int:
    if value is None or str(value).startswith("auto"):  # the harness's "auto[:N]": our scorers batch by rows
        return 64
    return _as_int("batch_size", value)


def request_seed(seed: int, kind: str, *parts: Any) -> int:
    """The seed of one request's generator under ``seeding="request"``: the first 63 bits of the SHA-256 of
    ``json.dumps([seed, kind, *parts])`` (compact separators, UTF-8).

    ``kind`` and ``parts`` per request type:

    * a ``loglikelihood`` question: ``"loglikelihood"`` (``"is_greedy"`` for its greedy rows) and the list of its
      ``[context, continuation]`` pairs, in request order;
    * a ``loglikelihood_rolling`` text: ``"loglikelihood_rolling"`` and the text;
    * a ``generate_until`` request: ``"generate_until"``, the context, ``[max_new_tokens, sampled, temperature, top_k,
      top_p]`` as resolved from the gen_kwargs and model arguments (argmax decoding: ``[n, False, 1.0, 1, None]``) and
      the repeat index (0 for argmax decoding).

    To reproduce a question's scores outside the harness: ``score_choices(..., generator=torch.Generator()
    .manual_seed(request_seed(seed, "loglikelihood", pairs)))``.
    """
    text = json.dumps([int(seed), kind, *parts], ensure_ascii=False, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") >> 1


def _evaluating(method: _F) -> _F:
    """Run a request method with the model in eval mode and without autograd, then restore every module's mode (a
    live model in the middle of training goes back to training)."""

    @functools.wraps(method)
    def wrapper(self: UnifusionLM, *args: Any, **kwargs: Any) -> Any:
        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        try:
            with torch.no_grad():
                return method(self, *args, **kwargs)
        finally:
            for module, training in modes:
                module.training = training

    return cast(_F, wrapper)


def _progress(total: int, desc: str, disable: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=disable)


class _Collectives:
    """What the harness's evaluators call on ``lm.accelerator`` (lm-eval 0.4.10–0.4.12): ``gather`` and
    ``wait_for_everyone``, over torch.distributed."""

    def __init__(self, lm: UnifusionLM) -> None:
        self._lm = lm

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._lm.all_gather(tensor)

    def wait_for_everyone(self) -> None:
        self._lm.barrier()


@register_model("unifusion")
class UnifusionLM(LM):
    """lm-evaluation-harness model for a :class:`~unifusion.DiffusionLM` (see the module docstring).

    Args:
        pretrained: a folder written by ``DiffusionLM.save_pretrained`` (its tokenizer is loaded from the same folder
            unless ``tokenizer`` is given).
        model: a live ``DiffusionLM`` instead of ``pretrained`` (periodic evaluation in a training script).
        tokenizer: a tokenizer object, or a folder to load one from.
        kernel: ``"mask"`` or ``"uniform"``, or a :class:`~unifusion.Kernel`; default: mask when the model has a mask
            token, else uniform. Checked against the model (states, mask token) here.
        method: ``"score"`` (K = 32, the paper's protocol; the default) or ``"fair_pmi"`` (K = 128) for
            ``loglikelihood``.
        fair_pmi: ``True`` is ``method="fair_pmi"``, ``False`` is ``method="score"`` (strings ``"True"``/``"false"``
            from the command line work too).
        num_times: K of ``method`` (default: 32 for score, 128 for fair_pmi).
        null_context: Fair-PMI's answer-only context.
        check_greedy: compute ``is_greedy`` of ``loglikelihood`` (one extra model row per answer); ``False`` returns
            ``False`` without it.
        nll_times: stratified times of ``loglikelihood_rolling``'s bound (default 128).
        max_length: longest context + answer (``loglikelihood``), prompt + new tokens (``generate_until``) and
            rolling window, in tokens; default and maximum: the model's position limit (``max_position_embeddings``
            or the like in its config) − 1 for the BOS position the adapter prepends (2048 when the config names
            none). Contexts and prompts are cut from the left, with a warning that counts them.
        max_gen_toks: cap on the new tokens of a ``generate_until`` request (default: none, so the task's
            ``max_gen_toks``, else 256). The sampler fills the whole canvas at every step, so its cost grows with it.
        num_steps: sampler steps of ``generate_until`` (default 64).
        do_sample: sample (at ``temperature``) when a task's ``gen_kwargs`` set neither ``do_sample`` nor a
            temperature; default ``False`` (argmax x_θ, the harness's convention).
        temperature: sampling temperature when the task's ``gen_kwargs`` set none.
        top_p: nucleus mass of sampling (``None``: off) when the task's ``gen_kwargs`` set none.
        top_k: top-k of sampling (``None`` or 0: off) when the task's ``gen_kwargs`` set none.
        seed: seeds every request's random numbers (module docstring).
        seeding: ``"request"`` (default: a generator per request from :func:`request_seed`) or ``"task"`` (one
            stream per task, ``run_multiple_choice``'s numbers; one process only).
        batch_size: rows per forward pass of the scorers and prompts per sampler batch (the harness's
            ``--batch_size``; ``auto`` means 64).
        max_batch_size: accepted for the harness's ``--max_batch_size`` (unused: the scorers batch by rows).
        device: where to run (``"cuda"``, ``"cpu"``, ...); default: a live model stays where it is, a checkpoint
            goes to ``cuda`` when available, else the CPU. Under ``torchrun`` each process takes
            ``cuda:LOCAL_RANK``.
        dtype: weights' dtype (``"bfloat16"``, ``torch.float32``, ...); default (or ``"auto"``): the saved one (a
            live model is converted in place, so leave it unset for a model that is still training).
    """

    def __init__(self, pretrained: str | None = None, *, model: Any = None, tokenizer: Any = None,
                 kernel: str | Kernel | None = None, method: str | None = None, fair_pmi: Any = None,
                 num_times: Any = None, null_context: str = "Answer:", check_greedy: Any = True,
                 nll_times: Any = 128, max_length: Any = None, max_gen_toks: Any = None, num_steps: Any = 64,
                 do_sample: Any = False, temperature: Any = 1.0, top_p: Any = None, top_k: Any = None,
                 seed: Any = 0, seeding: str = "request", batch_size: Any = 64, max_batch_size: Any = None,
                 device: str | None = None, dtype: str | torch.dtype | None = None, **unused: Any) -> None:
        super().__init__()
        from ..adapters import DiffusionLM
        from ..models import dtype_from_name

        if unused:
            raise TypeError(f"model_args: unknown argument(s) {sorted(unused)}; the arguments are "
                            f"{[name for name, _, _ in MODEL_ARGS] + ['model']}")
        if (pretrained is None) == (model is None):
            raise ValueError("pretrained: give exactly one of pretrained=DIR (a saved DiffusionLM) and model= (a live "
                             "DiffusionLM)")
        if model is not None and not isinstance(model, DiffusionLM):
            raise TypeError(f"model: expected a unifusion DiffusionLM, got {type(model).__name__}")
        if dtype == "auto":  # the harness's hf-model habit: keep the saved dtype
            dtype = None
        if dtype is not None and not isinstance(dtype, (str, torch.dtype)):
            raise TypeError(f"dtype: expected a name such as 'bfloat16' or a torch.dtype, got {type(dtype).__name__}")
        torch_dtype = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
        if seeding not in SEEDINGS:
            raise ValueError(f"seeding: expected one of {SEEDINGS}, got {seeding!r}")
        self.seeding: str = seeding
        device = self._join_processes(device, model)
        if pretrained is not None:
            model = DiffusionLM.from_pretrained(pretrained, dtype=torch_dtype, device=device)
        elif model is not None:
            if device is not None:
                model = model.to(device)
            if torch_dtype is not None:
                model = model.to(torch_dtype)
        self.model: DiffusionLM = model
        self.tokenizer = self._tokenizer(tokenizer, pretrained)
        self.kernel = self._kernel(kernel)
        V.check_model_kernel(self.model, self.kernel)  # a wrong mask id fails here, not at the first request
        if method is not None and method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
        if fair_pmi is not None:
            wanted = "fair_pmi" if _as_bool("fair_pmi", fair_pmi) else "score"
            if method is not None and method != wanted:
                raise ValueError(f"fair_pmi: {fair_pmi!r} contradicts method={method!r}; give one of the two")
            method = wanted
        self.method: str = method if method is not None else "score"
        self.num_times = _as_int("num_times", num_times if num_times is not None else
                                 (32 if self.method == "score" else 128))
        self.null_context = str(null_context)
        self.check_greedy = _as_bool("check_greedy", check_greedy)
        self.nll_times = _as_int("nll_times", nll_times)
        self.model_max_length = self._position_limit()
        self.max_length = self.model_max_length if max_length is None else _as_int("max_length", max_length,
                                                                                   minimum=2)
        if self.max_length > self.model_max_length:
            raise ValueError(f"max_length: {self.max_length} exceeds what the model takes: "
                             f"{self.model_max_length} tokens (its position limit minus the BOS position the adapter "
                             "prepends)")
        self.max_gen_toks = None if max_gen_toks is None else _as_int("max_gen_toks", max_gen_toks)
        self.num_steps = _as_int("num_steps", num_steps)
        self.do_sample = _as_bool("do_sample", do_sample)
        self.temperature = _as_temperature(temperature)
        if self.temperature == 0.0:
            raise ValueError("temperature: expected > 0 (the model's sampling temperature); for argmax decoding "
                             "use do_sample=false")
        self.top_p = _as_top_p(top_p)
        self.top_k = _as_top_k(top_k)
        self.seed = _as_int("seed", seed, minimum=0)
        self.batch_size_per_forward = _as_batch_size(batch_size)
        if self.seeding == "task" and self._world_size > 1:
            raise ValueError(f"seeding: 'task' streams one generator through a task's documents in order, which needs "
                             f"all of them in one process; with {self._world_size} processes use seeding=request "
                             "(the default)")

    # ------------------------------------------------------------------------------------------------ setup
    def _join_processes(self, device: str | None, model: Any) -> str | None:
        """Rank and world size from torch.distributed (initialising the process group when a launcher set
        ``WORLD_SIZE`` > 1 and nobody has: NCCL for CUDA, gloo for the CPU), and the device this process uses: the
        given one, a live ``model``'s own, else ``cuda`` (``cuda:LOCAL_RANK`` under a launcher) when available."""
        import torch.distributed as dist

        if device is not None and not isinstance(device, (str, torch.device)):
            raise TypeError(f"device: expected a name such as 'cuda' or 'cpu', got {type(device).__name__}")
        device = None if device is None else str(device)
        if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} but CUDA is not available here; pass device=cpu (--device cpu)")
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        initialised = dist.is_available() and dist.is_initialized()
        if not initialised and launched <= 1:
            if device is None and model is None:
                device = "cuda" if torch.cuda.is_available() else "cpu"
            return device
        if device is None and model is not None:  # a live model: the training script placed it
            on_cuda = model.device.type == "cuda"
            if on_cuda:
                torch.cuda.set_device(model.device)
        else:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            if device in (None, "cuda") and torch.cuda.is_available():
                device = f"cuda:{local_rank}"
            elif device is None:
                device = "cpu"
            elif device.startswith("cuda:") and launched > 1:
                raise ValueError(f"device: {device!r} would put all {launched} processes on one GPU; pass "
                                 "device=cuda (each process then takes cuda:LOCAL_RANK)")
            on_cuda = device.startswith("cuda")
            if on_cuda:
                torch.cuda.set_device(torch.device(device))
        if not initialised:
            if not dist.is_available():
                raise ValueError(f"WORLD_SIZE={launched}: this torch has no torch.distributed")
            dist.init_process_group("nccl" if on_cuda else "gloo")
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        if self._world_size > 1:
            self.accelerator = _Collectives(self)
        return device

    def _tokenizer(self, tokenizer: Any, pretrained: str | None) -> Any:
        from transformers import AutoTokenizer

        if tokenizer is None:
            tokenizer = getattr(self.model, "tokenizer", None)
        if tokenizer is None and pretrained is not None:
            tokenizer = pretrained
        if isinstance(tokenizer, (str, Path)):
            try:
                return AutoTokenizer.from_pretrained(str(tokenizer))
            except (OSError, ValueError) as err:
                raise ValueError(f"tokenizer: no tokenizer found in {str(tokenizer)!r} (save it with "
                                 f"model.save_pretrained(dir, tokenizer=tok) or pass tokenizer=PATH): {err}") from None
        if tokenizer is None or not callable(tokenizer):
            raise ValueError("tokenizer: none given and none saved with the model; pass tokenizer= (an object or a "
                             "folder)")
        return tokenizer

    def _kernel(self, kernel: str | Kernel | None) -> Kernel:
        S, mask_id = self.model.num_states, self.model.mask_token_id
        if isinstance(kernel, Kernel):
            return kernel
        if kernel is None:
            kernel = "mask" if mask_id is not None else "uniform"
        if kernel == "uniform":
            return UniformKernel(S)
        if kernel == "mask":
            if mask_id is None:
                raise ValueError("kernel: 'mask' needs a model with a mask token (adapt_ar_model(..., "
                                 "add_mask_token=True)); this one has none, use kernel=uniform")
            return MaskKernel(S, mask_id)
        raise ValueError(f"kernel: expected 'mask', 'uniform' or a unifusion Kernel, got {kernel!r}")

    def _position_limit(self) -> int:
        """Tokens the model takes after the BOS the adapter prepends: its config's position limit − 1."""
        config = getattr(self.model, "config", None)
        for key in _POSITION_KEYS:
            limit = getattr(config, key, None)
            if isinstance(limit, int) and not isinstance(limit, bool) and limit > 1:
                return limit - 1
        return FALLBACK_MAX_LENGTH

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _progress_disabled(self, disable_tqdm: bool) -> bool:
        return bool(disable_tqdm) or self._rank != 0

    # ------------------------------------------------------------------------------------------------ harness API
    @property
    def device(self) -> torch.device:
        """Where the model runs (the harness's evaluator puts its collective tensors here)."""
        return self.model.device

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor``, concatenated along dim 0 (0-d tensors stacked)."""
        if self._world_size <= 1:
            return tensor
        import torch.distributed as dist

        flat = tensor.reshape(1) if tensor.dim() == 0 else tensor
        parts = [torch.empty_like(flat) for _ in range(self._world_size)]
        dist.all_gather(parts, flat.contiguous())
        return torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every process's ``obj`` on rank ``dst`` (``None`` elsewhere)."""
        if self._world_size <= 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's name (the harness keys its request cache by it when chat templates are applied)."""
        return str(getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The tokenizer's chat template (``chat_template`` names one of several), ``None`` when not applied."""
        if chat_template is False or chat_template is None:
            return None
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"apply_chat_template: the tokenizer ({self.tokenizer_name!r}) has no chat template; "
                             "evaluate without --apply_chat_template, or give a tokenizer that has one "
                             "(tokenizer=PATH)")
        if isinstance(template, dict):
            name = "default" if chat_template is True else str(chat_template)
            if name not in template:
                raise ValueError(f"apply_chat_template: no template {name!r} in the tokenizer's "
                                 f"{sorted(template)}")
            return str(template[name])
        return str(template)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the tokenizer's chat template renders it (text, special tokens included; the requests'
        text is then tokenized without adding special tokens). ``add_generation_prompt=False`` continues the last
        (assistant) message instead of opening a new one."""
        self.chat_template(True)  # a clear error when there is no template
        try:
            return str(self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt,
                                                          continue_final_message=not add_generation_prompt))
        except Exception as err:  # jinja's TemplateError: templates that reject a system message
            if not any(m.get("role") == "system" for m in chat_history) or "system" not in str(err).lower():
                raise
            warnings.warn(f"apply_chat_template: the chat template rejected the system message ({err}); applying it "
                          "without", stacklevel=2)
            history = [m for m in chat_history if m.get("role") != "system"]
            return str(self.tokenizer.apply_chat_template(history, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt,
                                                          continue_final_message=not add_generation_prompt))

    # ------------------------------------------------------------------------------------------------ loglikelihood
    @_evaluating
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(−score, is_greedy)`` per ``(context, continuation)`` request (module docstring).

        Requests are grouped as the harness emits them: consecutive requests of one document (same ``task_name`` and
        ``doc_id``; requests without a ``doc_id`` group by equal context) form one question; a request object that
        occurs twice in a question (the evaluator's padding under data parallelism) is scored once. Within a
        question, the continuations that share a context are scored together with the draws ``score_choices`` /
        ``fair_pmi_scores`` make from the question's generator; when the question's requests have different contexts
        (WinoGrande's partial scoring: one context per option, the same continuation), every context is scored from
        the same generator state, so all options see the same times, selected positions and noise tokens. The rows
        of all questions are then pooled by length into forward passes of ``batch_size`` rows.

        A context is cut from the left so that context + longest continuation of its question fits ``max_length``; a
        continuation longer than ``max_length`` keeps its last ``max_length`` tokens (scored without context). Both
        are counted in one warning per call.
        """
        pairs = [(str(r.args[0]), str(r.args[1])) for r in requests]
        questions: list[_Question] = []
        pool = _RowPool(self.model, self.kernel, self.batch_size_per_forward)
        cuts = _Cuts()
        streams: dict[Any, tuple[torch.Generator, torch.Generator]] = {}  # seeding="task": per task
        bar = _progress(len(requests), "loglikelihood", self._progress_disabled(disable_tqdm))
        for members in _questions(requests, pairs):
            unique: list[int] = []
            seen: dict[int, int] = {}
            for i in members:
                if id(requests[i]) not in seen:
                    seen[id(requests[i])] = i
                    unique.append(i)
            question = _Question(members=members, first={i: seen[id(requests[i])] for i in members}, bar=bar)
            questions.append(question)
            generator, greedy_generator = self._question_generators(requests[members[0]],
                                                                    [list(pairs[i]) for i in unique], streams)
            by_context: dict[str, list[int]] = {}
            for i in unique:
                by_context.setdefault(pairs[i][0], []).append(i)
            state = generator.get_state()
            for context_text, group in by_context.items():
                generator.set_state(state)  # common random numbers across the question's contexts
                self._add_group(question, pool, context_text, group, [pairs[i][1] for i in group], generator,
                                greedy_generator, cuts)
            question.sealed = True
            question.maybe_finish()
        pool.flush()
        bar.close()
        cuts.warn("loglikelihood", len(requests), self.max_length)
        answers = [answer for question in questions for answer in question.answers]
        if any(answer.score is None for answer in answers):  # every row ran at the flush
            raise RuntimeError("loglikelihood: an answer was left unscored (a bug in unifusion.eval.harness)")
        # one read-back for the whole call (the scores live on the model's device)
        scores = torch.stack([cast(torch.Tensor, a.score) for a in answers]).tolist() if answers else []
        greedy = torch.stack([cast(torch.Tensor, a.greedy) for a in answers]).tolist() if answers and \
            self.check_greedy else [False] * len(answers)
        value = {answer.index: (-s, bool(g)) for answer, s, g in zip(answers, scores, greedy)}
        return [value[question.first[i]] for question in questions for i in question.members]

    def _question_generators(self, first: Any, content: list[list[str]],
                             streams: dict[Any, tuple[torch.Generator, torch.Generator]]
                             ) -> tuple[torch.Generator, torch.Generator]:
        """(scorer generator, is_greedy generator) of a question, on the CPU: the scorers draw the corruption there
        and move the rows to the model, so the numbers do not depend on the device."""
        if self.seeding == "request":
            return (_seeded_generator(request_seed(self.seed, "loglikelihood", content), "cpu"),
                    _seeded_generator(request_seed(self.seed, "is_greedy", content), "cpu"))
        task = getattr(first, "task_name", None)
        if task not in streams:
            streams[task] = (_seeded_generator(self.seed, "cpu"), _seeded_generator(self.seed + 1, "cpu"))
        return streams[task]

    def _add_group(self, question: _Question, pool: _RowPool, context_text: str, members: list[int],
                   continuations: Sequence[str], generator: torch.Generator, greedy_generator: torch.Generator,
                   cuts: _Cuts) -> None:
        """Draw one context's corruption as ``score_choices`` / ``fair_pmi_scores`` would and queue its rows."""
        choices = []
        for text in continuations:
            ids = self._encode(text)
            if not ids:
                raise ValueError(f"continuation: {text!r} tokenizes to nothing")
            if len(ids) > self.max_length:
                cuts.continuations += 1
                cuts.lost = max(cuts.lost, len(ids) - self.max_length)
                ids = ids[-self.max_length:]
            choices.append(torch.tensor(ids, dtype=torch.long))
        budget = self.max_length - max(a.numel() for a in choices)
        context = self._encode(context_text)
        if len(context) > budget:
            cuts.contexts += 1
            cuts.lost = max(cuts.lost, len(context) - budget)
            context = context[-budget:] if budget > 0 else []
        context_t = torch.tensor(context, dtype=torch.long)
        null_t = torch.tensor(self._encode(self.null_context), dtype=torch.long)
        K = self.num_times
        for i, a in zip(members, choices):
            if self.method == "score":
                t = _standard_times(K)
            else:
                t = _stratified_times(K, _FAIR_PMI_T_MIN, generator, torch.device("cpu"))
            z, selected = _corrupt_span(self.kernel, a, t, generator)  # (K, m) each
            answer = _Answer(question, i, a, selected, self.method)
            blocks = [_Block(torch.cat([context_t.expand(K, -1), z], 1), t, a, answer, "context")]
            if self.method == "fair_pmi":
                blocks.append(_Block(torch.cat([null_t.expand(K, -1), z], 1), t, a, answer, "null"))
            if self.check_greedy:
                t_1 = _standard_times(1)  # (1,) = 1 − 10⁻³
                noise = torch.multinomial(self.kernel.prior(t_1), a.numel(), replacement=True,
                                          generator=greedy_generator)  # (1, m)
                blocks.append(_Block(torch.cat([context_t.unsqueeze(0), noise], 1), t_1, a, answer, "greedy"))
            answer.pending = len(blocks)  # counted before any block can finish inside pool.add
            question.pending += 1
            question.answers.append(answer)
            for block in blocks:
                pool.add(block)

    # ------------------------------------------------------------------------------------------------ rolling
    @_evaluating
    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """−(upper bound on −log p_θ(text)) in nats per request (module docstring).

        ``nll_bound`` draws its times and corruption on the windows' device, the model's, so the generator lives
        there too: seeded with :func:`request_seed` ``(seed, "loglikelihood_rolling", text)`` per text
        (``seeding="request"``), or with ``seed`` at each task's first text (``seeding="task"``). On the CPU the
        numbers are ``nll_bound``'s with ``torch.Generator().manual_seed(...)``; on an accelerator the same estimator
        with that device's stream.
        """
        device = self.model.device
        streams: dict[Any, torch.Generator] = {}
        out = []
        bar = _progress(len(requests), "loglikelihood_rolling", self._progress_disabled(disable_tqdm))
        for request in requests:
            text = str(request.args[0])
            ids = self._encode(text)
            if self.seeding == "request":
                generator = _seeded_generator(request_seed(self.seed, "loglikelihood_rolling", text), device)
            else:
                task = getattr(request, "task_name", None)
                if task not in streams:
                    streams[task] = _seeded_generator(self.seed, device)
                generator = streams[task]
            total = 0.0
            for lo in range(0, len(ids), self.max_length):
                window = torch.tensor(ids[lo: lo + self.max_length], device=device).unsqueeze(0)
                bound = nll_bound(self.model, window, self.kernel, num_times=self.nll_times, generator=generator,
                                  per_token=False)
                total += float(bound.sum())
            out.append(-total)
            bar.update(1)
        bar.close()
        return out

    # ------------------------------------------------------------------------------------------------ generation
    @_evaluating
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Bayesian-sampler continuations of each context, cut at the first stop string (module docstring).

        Every request draws from its own generator on the model's device, seeded with :func:`request_seed`
        ``(seed, "generate_until", context, settings, repeat)`` (``repeat`` counts earlier occurrences of the same
        request object in the call when sampling, and is 0 for argmax decoding): its text does not depend on the
        requests sampled beside it. Requests with the same prompt length and settings are sampled together,
        ``batch_size`` rows at a time. A continuation ends at the tokenizer's EOS token, if it has one, then at the
        earliest of the ``until`` strings. ``gen_kwargs`` the sampler has no counterpart for (``num_beams``,
        ``repetition_penalty``, ...) are ignored with one warning per call.
        """
        jobs = [self._generation_job(request) for request in requests]
        unknown: dict[str, int] = {}
        cuts = _Cuts()
        repeats: dict[int, int] = {}
        for request, job in zip(requests, jobs):
            for key in job.unknown:
                unknown[key] = unknown.get(key, 0) + 1
            if job.lost:
                cuts.contexts += 1
                cuts.lost = max(cuts.lost, job.lost)
            repeat = repeats.get(id(request), 0)
            repeats[id(request)] = repeat + 1
            job.seed = request_seed(self.seed, "generate_until", str(request.args[0]), job.settings(),
                                    repeat if job.sampled else 0)
        if unknown:
            warnings.warn("generate_until: ignoring gen_kwargs the diffusion sampler has no counterpart for: " +
                          ", ".join(f"{k} ({n} request{'s' if n > 1 else ''})" for k, n in sorted(unknown.items())),
                          stacklevel=2)
        if cuts.contexts:
            warnings.warn(f"generate_until: {cuts.contexts} of {len(requests)} prompts were cut from the left to fit "
                          f"max_length={self.max_length} with their new tokens (the longest cut: {cuts.lost} "
                          "tokens)", stacklevel=2)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault((len(job.prompt), job.max_new, job.temperature, job.top_k, job.top_p), []).append(i)
        out = [""] * len(requests)
        device = self.model.device
        bar = _progress(len(requests), "generate_until", self._progress_disabled(disable_tqdm))
        for (P, max_new, temperature, top_k, top_p), members in groups.items():
            for lo in range(0, len(members), self.batch_size_per_forward):
                chunk = members[lo: lo + self.batch_size_per_forward]
                prompts = torch.tensor([jobs[i].prompt for i in chunk], dtype=torch.long).reshape(len(chunk), P)
                generators = [_seeded_generator(cast(int, jobs[i].seed), device) for i in chunk]
                ids = self._sample(prompts.to(device), max_new, generators, temperature=temperature, top_k=top_k,
                                   top_p=top_p)  # (B, P + max_new)
                for i, row in zip(chunk, ids[:, P:].tolist()):
                    out[i] = self._finish(row, jobs[i].until)
                bar.update(len(chunk))
        bar.close()
        return out

    def _generation_job(self, request: Any) -> _Job:
        """One ``generate_until`` request's prompt ids and sampler settings (the harness's gen_kwargs conventions:
        ``do_sample`` unset means sampling iff the task sets a temperature > 0, else the model's ``do_sample``)."""
        context, gen_kwargs = str(request.args[0]), request.args[1]
        if gen_kwargs is None:
            gen_kwargs = {}
        if not isinstance(gen_kwargs, dict):
            raise TypeError(f"gen_kwargs: expected a dict, got {type(gen_kwargs).__name__}")
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else [str(u) for u in until]
        max_new = next((_as_int(k, gen_kwargs[k]) for k in _MAX_TOKEN_KEYS if gen_kwargs.get(k) is not None),
                       DEFAULT_MAX_GEN_TOKS)
        if self.max_gen_toks is not None:
            max_new = min(max_new, self.max_gen_toks)
        max_new = min(max_new, self.max_length - 1)
        temperature = self.temperature
        if gen_kwargs.get("temperature") is not None:
            temperature = _as_temperature(gen_kwargs["temperature"])
        do_sample = gen_kwargs.get("do_sample")
        if do_sample is None:
            sampled = temperature > 0.0 if gen_kwargs.get("temperature") is not None else self.do_sample
        else:
            sampled = _as_bool("do_sample", do_sample) and temperature > 0.0
        top_p = _as_top_p(gen_kwargs["top_p"]) if "top_p" in gen_kwargs else self.top_p
        top_k = _as_top_k(gen_kwargs["top_k"]) if "top_k" in gen_kwargs else self.top_k
        if top_k is not None:
            top_k = min(top_k, self.kernel.num_states)
        if not sampled:  # argmax decoding: x_θ one-hot at its argmax
            temperature, top_k, top_p = 1.0, 1, None
        ids = self._encode(context)
        budget = self.max_length - max_new
        unknown = sorted(k for k in gen_kwargs if k not in _GEN_KEYS and k not in _MAX_TOKEN_KEYS)
        return _Job(prompt=ids[-budget:] if len(ids) > budget else ids, lost=max(0, len(ids) - budget),
                    max_new=max_new, temperature=temperature, top_k=top_k, top_p=top_p, sampled=sampled, until=until,
                    unknown=unknown)

    def _sample(self, prompts: torch.Tensor, max_new: int, generators: Sequence[torch.Generator], *,
                temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
        """:meth:`DiffusionLM.generate` (``BayesianSampler``, Algorithm 2) on ``prompts`` ``(B, P)`` with one
        generator per row: row b's prior draw and its per-step uniforms and noise tokens come from ``generators[b]``
        in the order the sampler draws them for a batch of one, so a row equals
        ``model.generate(prompts[b:b + 1], ..., generator=generators[b])`` whatever rows are beside it (up to the
        model's arithmetic, which on some devices differs by batch shape). Returns ``(B, P + max_new)``."""
        kernel, model = self.kernel, self.model
        B, P = prompts.shape
        L, N, dev, dtype = P + max_new, self.num_steps, prompts.device, torch.float32
        S = kernel.num_states
        keep = torch.zeros((B, L), dtype=torch.bool, device=dev)
        keep[:, :P] = True
        kept = (torch.cat([prompts, prompts.new_zeros((B, max_new))], 1), keep)
        ts = time_grid(N, _EPS, dtype, dev)
        with V.validation(False):  # t_0 = 1 − ε and the sampler's own tokens: valid by construction
            x = apply_prompt(torch.cat([kernel.sample_prior((1, L), t=1.0 - _EPS, generator=g, device=dev)
                                        for g in generators]), kept)  # z_{t_0}, (B, L)
            workspace: torch.Tensor | None = None
            for n in range(N):
                t, s = ts[n], ts[n + 1]
                head = _logits_of(model(x, t.expand(B)))  # (B, L, S)
                if n == 0:  # the model's output, checked once (as the sampler does)
                    V.check_finite("model output", head)
                # each row's draws from its own generator, in BayesianSampler's order: u (1, L, 4), then the noise
                u = torch.cat([torch.rand((1, L, 4), generator=g, device=dev, dtype=dtype) for g in generators])
                if not isinstance(kernel, InterpolatingKernel):  # dense kernels: the posterior through the hooks
                    w = x0_weights(head, torch.empty((B, L, S), dtype=dtype, device=dev), mask_id=kernel.mask_id,
                                   temperature=temperature, top_k=top_k, top_p=top_p)
                    w.div_(w.sum(-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny))
                    x = apply_prompt(sample_weights(kernel._posterior(w, x, s, t), u[..., 2:],
                                                    block_size=BLOCK_SIZE)[0], kept)
                    continue
                noise = torch.cat([noise_tokens(kernel, (1, L), g, dev) for g in generators])  # (B, L)
                if top_k is None and top_p is None and (S < COMPILE_MIN_STATES or compiled_block_log_mass(
                        head, kernel.mask_id, temperature, BLOCK_SIZE, dtype) is not None):
                    draw, p_b = draw_from_logits(head, x, u[..., 2:], mask_id=kernel.mask_id, temperature=temperature,
                                                 dtype=dtype, block_size=BLOCK_SIZE)  # x_θ straight from the logits
                else:
                    if workspace is None:
                        workspace = torch.empty((B, L, S), dtype=dtype, device=dev)
                    w = x0_weights(head, workspace, mask_id=kernel.mask_id, temperature=temperature, top_k=top_k,
                                   top_p=top_p)
                    draw, total = sample_weights(w, u[..., 2:], block_size=BLOCK_SIZE)
                    p_b = w.gather(-1, x.unsqueeze(-1)).squeeze(-1) / total.clamp_min(torch.finfo(total.dtype).tiny)
                x = apply_prompt(mix_step(kernel, draw, p_b, x, noise, u, t, s), kept)
        return x

    def _finish(self, new_ids: list[int], until: Sequence[str]) -> str:
        """Generated ids → text: mask ids dropped, cut at the first EOS id, decoded, cut at the earliest stop."""
        if self.model.mask_token_id is not None:
            new_ids = [i for i in new_ids if i != self.model.mask_token_id]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and eos in new_ids:
            new_ids = new_ids[: new_ids.index(eos)]
        text = str(self.tokenizer.decode(new_ids, skip_special_tokens=True))
        cuts = [text.index(stop) for stop in until if stop and stop in text]
        return text[: min(cuts)] if cuts else text


# ---------------------------------------------------------------------------------------------------------------
# loglikelihood's bookkeeping: questions, answers, and the pool of rows


def _seeded_generator(seed: int, device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _questions(requests: Sequence[Any], pairs: Sequence[tuple[str, str]]) -> Iterator[list[int]]:
    """Consecutive requests of one document (same task_name and doc_id); without a doc_id, consecutive requests with
    one context."""
    keys = [(getattr(r, "task_name", None), getattr(r, "doc_id", None)) for r in requests]
    start = 0
    while start < len(requests):
        end = start + 1
        if keys[start][1] is None:
            while end < len(requests) and keys[end][1] is None and pairs[end][0] == pairs[start][0]:
                end += 1
        else:
            while end < len(requests) and keys[end] == keys[start]:
                end += 1
        yield list(range(start, end))
        start = end


@dataclass
class _Cuts:
    """What truncation did in one call, for one warning."""

    contexts: int = 0
    continuations: int = 0
    lost: int = 0  # the most tokens cut from one context, prompt or continuation

    def warn(self, where: str, total: int, max_length: int) -> None:
        if not self.contexts and not self.continuations:
            return
        parts = []
        if self.contexts:
            parts.append(f"{self.contexts} context{' was' if self.contexts == 1 else 's were'} cut from the left")
        if self.continuations:
            parts.append(f"{self.continuations} continuation{'' if self.continuations == 1 else 's'} longer than "
                         f"max_length kept {'its' if self.continuations == 1 else 'their'} last {max_length} tokens")
        warnings.warn(f"{where}: of {total} requests, {' and '.join(parts)} to fit max_length={max_length} (the "
                      f"longest cut: {self.lost} tokens)", stacklevel=3)


@dataclass
class _Job:
    """One generate_until request, resolved."""

    prompt: list[int]
    lost: int
    max_new: int
    temperature: float
    top_k: int | None
    top_p: float | None
    sampled: bool
    until: list[str]
    unknown: list[str]
    seed: int | None = None

    def settings(self) -> list[Any]:
        """What decides the sample (the stop strings only cut it afterwards)."""
        return [self.max_new, self.sampled, self.temperature, self.top_k, self.top_p]


@dataclass(eq=False)
class _Question:
    """A question's answers; counts on the progress bar once every row of every answer has run."""

    members: list[int]
    first: dict[int, int]  # request index -> the index of the first occurrence of the same request object
    bar: Any
    answers: list[_Answer] = field(default_factory=list)
    pending: int = 0
    sealed: bool = False

    def maybe_finish(self) -> None:
        if self.sealed and not self.pending:
            self.bar.update(len(self.members))


@dataclass(eq=False)
class _Answer:
    """One request's rows: the scorer's ``(K, m)`` NLLs (context, and null for Fair-PMI) and is_greedy. Its score
    stays a tensor on the model's device (no host sync per answer); the call reads all scores back at once."""

    question: _Question
    index: int
    answer: torch.Tensor  # (m,)
    selected: torch.Tensor  # (K, m): I_k(a)
    method: str
    pending: int = 0
    nll: dict[str, torch.Tensor] = field(default_factory=dict)
    greedy: torch.Tensor | None = None  # 0-d bool
    score: torch.Tensor | None = None  # 0-d float64

    def done(self, kind: str, value: torch.Tensor) -> None:
        if kind == "greedy":
            self.greedy = value
        else:
            self.nll[kind] = value
        self.pending -= 1
        if not self.pending:
            self.score = self._score()
            self.nll.clear()
            self.question.pending -= 1
            self.question.maybe_finish()

    def _score(self) -> torch.Tensor:
        """``score_choices``' S(a) or ``fair_pmi_scores``' S_PMI(a), from the same terms in the same order."""
        nll = self.nll["context"]  # (K, m) float64
        sel = self.selected.to(nll.device)
        if self.method == "score":
            sel = sel | ~sel.any(-1, keepdim=True)  # empty I_k: fall back to every span position
            per_time = (nll * sel).sum(-1) / sel.sum(-1)  # (K,)
            return per_time.mean()
        L_c = (nll * sel).sum(-1).mean()  # L̄(a|c)
        L_null = (self.nll["null"] * sel).sum(-1).mean()  # L̄(a|null)
        return (L_c - L_null) / self.answer.numel()


@dataclass(eq=False)
class _Block:
    """Rows of one answer that share a length: ``x_t`` ``(R, L)`` (context, then the span), times ``(R,)``."""

    x_t: torch.Tensor
    t: torch.Tensor
    answer_ids: torch.Tensor  # (m,)
    owner: _Answer
    kind: str  # "context", "null" or "greedy"
    results: list[torch.Tensor] = field(default_factory=list)
    filled: int = 0


class _RowPool:
    """Rows of equal length, from any question, go through the model ``batch_size`` at a time. A row's result (the
    span's −log x_θ(a_i), float64, or the argmax check) does not depend on the rows beside it, so pooling changes no
    number; it only fills the forward passes. Nothing is read back to the host here."""

    def __init__(self, model: Any, kernel: Kernel, batch_size: int) -> None:
        self.model, self.kernel, self.batch_size = model, kernel, batch_size
        self.waiting: dict[int, list[tuple[_Block, int]]] = {}  # length -> (block, first row not yet run)
        self.count: dict[int, int] = {}

    def add(self, block: _Block) -> None:
        L = block.x_t.shape[1]
        self.waiting.setdefault(L, []).append((block, 0))
        self.count[L] = self.count.get(L, 0) + block.x_t.shape[0]
        while self.count[L] >= self.batch_size:
            self._run(L, self.batch_size)

    def flush(self) -> None:
        for L in list(self.waiting):
            while self.count[L]:
                self._run(L, min(self.count[L], self.batch_size))

    def _run(self, L: int, rows: int) -> None:
        taken: list[tuple[_Block, int, int]] = []  # (block, first row, number of rows)
        need, queue = rows, self.waiting[L]
        while need:
            block, start = queue[0]
            n = min(need, block.x_t.shape[0] - start)
            taken.append((block, start, n))
            need -= n
            if start + n == block.x_t.shape[0]:
                queue.pop(0)
            else:
                queue[0] = (block, start + n)
        self.count[L] -= rows
        device = self.model.device
        x_t = torch.cat([b.x_t[s: s + n] for b, s, n in taken]).to(device)
        t = torch.cat([b.t[s: s + n] for b, s, n in taken]).to(device=device, dtype=torch.float32)
        logits = _logits_of(self.model(x_t, t))  # (rows, L, S)
        row = 0
        for block, _start, n in taken:
            m = block.answer_ids.numel()
            span = logits[row: row + n, -m:].float()  # (n, m, S)
            targets = block.answer_ids.to(device)
            if block.kind == "greedy":
                if self.kernel.mask_id is not None:
                    span[..., self.kernel.mask_id] = float("-inf")
                block.results.append((span.argmax(-1) == targets).all(-1))
            else:
                log_x = x0_log_probs(self.kernel, span)
                block.results.append(-log_x.gather(-1, targets.expand(n, m).unsqueeze(-1)).squeeze(-1))
            block.filled += n
            row += n
            if block.filled == block.x_t.shape[0]:  # results stay on the device: no host sync per forward
                value = torch.cat(block.results)
                block.owner.done(block.kind, value.all() if block.kind == "greedy" else value.double())


# ---------------------------------------------------------------------------------------------------------------
# the command line


def _model_args_help() -> str:
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


def _config_sets(args: Sequence[str], key: str) -> bool:
    """Whether a ``--config`` YAML among ``args`` sets ``key`` (so the command line must not override it)."""
    for i, arg in enumerate(args):
        path = args[i + 1] if arg in ("--config", "-C") and i + 1 < len(args) else (
            arg.split("=", 1)[1] if arg.startswith("--config=") else None)
        if path is None:
            continue
        try:
            yaml = importlib.import_module("yaml")  # lm-eval's own dependency
            data = yaml.safe_load(Path(path).read_text())
        except Exception:  # the harness reports an unreadable config itself
            return False
        return isinstance(data, dict) and data.get(key) is not None
    return False


def _unifusion_help(cli: Any) -> None:
    """The run parser's usage, --model default and examples say unifusion (cosmetic; skipped if lm-eval's private
    parser layout changes)."""
    run = getattr(getattr(cli, "_subparsers", None), "choices", {}).get("run")
    if run is None:
        return
    run.prog = "unifusion harness"
    run.usage = "unifusion harness --model_args pretrained=DIR[,name=value ...] --tasks <task> [<task> ...] [options]"
    run.epilog = ("examples:\n  unifusion harness --model_args pretrained=DIR --tasks piqa --batch_size 64\n"
                  "  unifusion harness --model_args pretrained=DIR,fair_pmi=True --tasks hellaswag --limit 100\n"
                  "  unifusion harness --model_args pretrained=DIR,num_steps=128,max_gen_toks=64 --tasks bbh_zeroshot")
    for action in run._actions:
        if action.dest == "model":
            action.help = "Model name (default: unifusion; hf, vllm, ... are the harness's own)"
        elif action.dest == "device":
            action.help = "Device to use (default: cuda when available, else cpu; cuda:LOCAL_RANK under torchrun)"


def cli_main(argv: Sequence[str] | None = None) -> int:
    """The harness's own command line (``lm-eval run ...``) with the ``unifusion`` model registered.

    ``unifusion harness ARGS`` calls this. ``argv`` (default ``sys.argv[1:]``) are the harness's arguments, with or
    without the ``run`` subcommand (``ls``/``validate`` pass through); ``--model`` defaults to ``unifusion`` and
    ``--device`` to ``cuda`` when available, else ``cpu`` (unless a ``--config`` YAML sets them); no arguments or
    ``--help`` print the model arguments (:data:`MODEL_ARGS`) and then the options of a run.

    Returns:
        the exit status (0 on success; the harness's own status when it exits, e.g. 2 for a bad option).
    """
    try:
        from lm_eval._cli import HarnessCLI
    except ImportError as err:  # pragma: no cover - lm-eval < 0.4.10 has another command line
        raise ImportError("unifusion harness needs lm-eval >= 0.4.10 (the lm_eval._cli command line): pip install -U "
                          f"\"unifusion[eval]\" ({err})") from None
    try:
        from lm_eval.utils import setup_logging
    except ImportError:  # pragma: no cover
        setup_logging = None
    args = list(sys.argv[1:] if argv is None else argv)
    commands = ("run", "ls", "validate")
    if not args or args[0] in ("-h", "--help"):
        args = ["run", "--help"]  # the options of a run (--model_args, --tasks, ...), not the command list
    elif args[0] not in commands:
        args = ["run", *args]
    is_run = args[:1] == ["run"]
    if is_run and ("-h" in args or "--help" in args):
        print(_model_args_help(), end="")
    if is_run and not any(a in ("--model", "-M") or a.startswith("--model=") for a in args) \
            and not _config_sets(args, "model"):
        args += ["--model", "unifusion"]
    if is_run and not any(a == "--device" or a.startswith("--device=") for a in args) \
            and not _config_sets(args, "device"):
        args += ["--device", "cuda" if torch.cuda.is_available() else "cpu"]  # the harness would assume cuda
    saved = sys.argv
    sys.argv = ["unifusion harness", *args]
    try:
        if setup_logging is not None:
            setup_logging()  # as lm-eval's own entry point does: the harness's INFO lines on stderr
        cli = HarnessCLI()
        _unifusion_help(cli)
        cli.execute(cli.parse_args())
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0
