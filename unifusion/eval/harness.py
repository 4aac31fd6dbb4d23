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
  value) picks exactly the answer :func:`~unifusion.eval.run_multiple_choice` picks; ``acc_norm`` (divided by the
  answer's length in bytes) has no counterpart in the paper. The requests of one question (consecutive requests
  with the same ``task_name`` and ``doc_id``, as the harness emits them) are scored together with shared randomness,
  as ``run_multiple_choice`` does; options with their own contexts (WinoGrande) are scored from the same generator
  state. Fair-PMI therefore always sees all choices of a question; a request on its own (a ``loglikelihood`` task
  such as LAMBADA) is a question with one choice. The corruption generator is seeded with ``seed`` at the start of
  every call, so a task scored alone gives the numbers ``run_multiple_choice(..., seed=seed)`` gives. Because the
  value is a per-token mean, metrics that sum or exponentiate log-likelihoods over documents (LAMBADA's
  ``perplexity``) are per-token-normalised, not sequence log-likelihoods. ``is_greedy`` is True when every
  answer token is the argmax of the model's x0 prediction with the whole answer span replaced by noise at
  t = 1 − 10⁻³ (one extra forward pass per request).
* ``loglikelihood_rolling(text)`` returns −(Proposition 3.2's upper bound on −log p_θ(text)) in nats: a lower bound
  on the log-likelihood, from :func:`~unifusion.eval.nll_bound` with ``nll_times`` stratified times, over disjoint
  windows of ``max_length`` tokens (each window scored without the previous one as context). Its generator lives on
  the model's device, where ``nll_bound`` draws (the CPU numbers are ``nll_bound``'s with a CPU generator seeded
  with ``seed``; on a GPU the same estimator with the device's random stream).
* ``generate_until(context, gen_kwargs)``: :meth:`~unifusion.DiffusionLM.generate` (the Bayesian sampler, Algorithm 2)
  with the context as a fixed prefix, ``max_gen_toks`` new tokens, ``num_steps`` steps, ``temperature``/``top_p``
  (from ``gen_kwargs`` when the task sets them, else the model arguments), ended at the tokenizer's EOS token and
  truncated at the first ``until`` string. Requests with equal prompt length and settings are sampled
  ``batch_size`` at a time from one generator seeded with ``seed``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("unifusion.eval.harness needs EleutherAI's lm-evaluation-harness: "
                      "pip install \"unifusion[eval]\" (or pip install lm-eval)") from err

from ..kernels import Kernel, MaskKernel, UniformKernel
from .choices import _standard_times, fair_pmi_scores, score_choices
from .likelihood import nll_bound
from .quality import _logits_of

__all__ = ["UnifusionLM", "cli_main"]

METHODS = ("score", "fair_pmi")
_F = TypeVar("_F", bound=Callable[..., Any])
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


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


def _as_batch_size(value: Any) -> int:
    if value is None or str(value).startswith("auto"):  # the harness's "auto[:N]": our scorers batch by rows
        return 64
    return _as_int("batch_size", value)


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


@register_model("unifusion")
class UnifusionLM(LM):
    """lm-evaluation-harness model for a :class:`~unifusion.DiffusionLM` (see the module docstring).

    Args:
        pretrained: a folder written by ``DiffusionLM.save_pretrained`` (its tokenizer is loaded from the same folder
            unless ``tokenizer`` is given).
        model: a live ``DiffusionLM`` instead of ``pretrained`` (periodic evaluation in a training script).
        tokenizer: a tokenizer object, or a folder to load one from.
        kernel: ``"mask"`` or ``"uniform"``, or a :class:`~unifusion.Kernel`; default: mask when the model has a mask
            token, else uniform.
        method: ``"score"`` (K = 32, the paper's protocol; the default) or ``"fair_pmi"`` (K = 128) for
            ``loglikelihood``.
        fair_pmi: ``True`` is ``method="fair_pmi"``, ``False`` is ``method="score"`` (strings ``"True"``/``"false"``
            from the command line work too).
        num_times: K of ``method`` (default: 32 for score, 128 for fair_pmi).
        null_context: Fair-PMI's answer-only context.
        nll_times: stratified times of ``loglikelihood_rolling``'s bound (default 128).
        max_length: longest context + answer in tokens (contexts are cut from the left); default 512, at most the
            model's ``max_position_embeddings`` − 1.
        num_steps: sampler steps of ``generate_until`` (default 64).
        temperature: sampling temperature of ``generate_until`` unless the task's ``gen_kwargs`` set one.
        top_p: nucleus mass of ``generate_until`` (``None``: off) unless the task's ``gen_kwargs`` set one.
        seed: seeds the scorers' corruption and the sampler at every call.
        batch_size: rows per forward pass of the scorers and prompts per sampler batch (the harness's
            ``--batch_size``; ``auto`` means 64).
        max_batch_size: accepted for the harness's ``--max_batch_size`` (unused: the scorers batch by rows).
        device: where to run (``"cuda"``, ``"cpu"``, ...); default: where the model is (a live model is moved).
        dtype: weights' dtype (``"bfloat16"``, ``torch.float32``, ...); default (or ``"auto"``): the saved one (a
            live model is converted in place, so leave it unset for a model that is still training).
    """

    def __init__(self, pretrained: str | None = None, *, model: Any = None, tokenizer: Any = None,
                 kernel: str | Kernel | None = None, method: str | None = None, fair_pmi: Any = None,
                 num_times: Any = None,
                 null_context: str = "Answer:", nll_times: Any = 128, max_length: Any = 512, num_steps: Any = 64,
                 temperature: Any = 1.0, top_p: Any = None, seed: Any = 0, batch_size: Any = 64,
                 max_batch_size: Any = None, device: str | None = None, dtype: str | torch.dtype | None = None,
                 **unused: Any) -> None:
        super().__init__()
        from ..adapters import DiffusionLM
        from ..models import dtype_from_name

        if unused:
            raise TypeError(f"model_args: unknown argument(s) {sorted(unused)}; see help(unifusion.eval.harness."
                            "UnifusionLM)")
        if (pretrained is None) == (model is None):
            raise ValueError("pretrained: give exactly one of pretrained=DIR (a saved DiffusionLM) and model= (a live "
                             "DiffusionLM)")
        if dtype == "auto":  # the harness's hf-model habit: keep the saved dtype
            dtype = None
        if dtype is not None and not isinstance(dtype, (str, torch.dtype)):
            raise TypeError(f"dtype: expected a name such as 'bfloat16' or a torch.dtype, got {type(dtype).__name__}")
        torch_dtype = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} but CUDA is not available here; pass device=cpu (--device cpu)")
        if pretrained is not None:
            model = DiffusionLM.from_pretrained(pretrained, dtype=torch_dtype, device=device)
        elif not isinstance(model, DiffusionLM):
            raise TypeError(f"model: expected a unifusion DiffusionLM, got {type(model).__name__}")
        else:
            if device is not None:
                model = model.to(device)
            if torch_dtype is not None:
                model = model.to(torch_dtype)
        self.model: DiffusionLM = model
        self.tokenizer = self._tokenizer(tokenizer, pretrained)
        self.kernel = self._kernel(kernel)
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
        self.nll_times = _as_int("nll_times", nll_times)
        limit = getattr(getattr(model.base_model, "config", None), "max_position_embeddings", None)
        self.max_length = _as_int("max_length", max_length, minimum=2)
        if isinstance(limit, int):
            self.max_length = min(self.max_length, limit - 1)  # the adapter prepends one BOS position
        self.num_steps = _as_int("num_steps", num_steps)
        self.temperature = _as_float("temperature", temperature)
        self.top_p = None if top_p is None else _as_float("top_p", top_p)
        self.seed = _as_int("seed", seed, minimum=0)
        self.batch_size_per_forward = _as_batch_size(batch_size)

    # ------------------------------------------------------------------------------------------------ setup
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

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded with ``seed`` on ``device``: where the draws it feeds are made (torch refuses a CPU
        generator for draws on an accelerator)."""
        return _seeded_generator(self.seed, device)

    # ------------------------------------------------------------------------------------------------ requests
    @_evaluating
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(−score, is_greedy)`` per ``(context, continuation)`` request (module docstring).

        Requests are grouped as the harness emits them: consecutive requests of one document (same ``task_name`` and
        ``doc_id``; requests without a ``doc_id`` group by equal context) form one question. Within a question, the
        continuations that share a context are scored together by one scorer call (shared corruption draws, as in
        ``run_multiple_choice``); when the question's requests have different contexts (WinoGrande's partial
        scoring: one context per option, the same continuation), every context is scored from the same generator
        state, so all options see the same times, selected positions and noise tokens.
        """
        pairs = [(str(r.args[0]), str(r.args[1])) for r in requests]
        keys = [(getattr(r, "task_name", None), getattr(r, "doc_id", None)) for r in requests]
        # CPU generators on every device: the scorers draw the corruption where their generator lives and move the
        # rows to the model, so a task gives run_multiple_choice(..., seed=seed)'s numbers on any device
        generator = self._generator()
        greedy_generator = _seeded_generator(self.seed + 1, "cpu")  # keeps the scorers' stream untouched
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        start = 0
        while start < len(pairs):
            end = start + 1
            if keys[start][1] is None:  # no document id: one question = consecutive requests with one context
                while end < len(pairs) and keys[end][1] is None and pairs[end][0] == pairs[start][0]:
                    end += 1
            else:
                while end < len(pairs) and keys[end] == keys[start]:
                    end += 1
            by_context: dict[str, list[int]] = {}
            for i in range(start, end):
                by_context.setdefault(pairs[i][0], []).append(i)
            state = generator.get_state()
            for context_text, members in by_context.items():
                generator.set_state(state)  # common random numbers across the question's contexts
                scored = self._score_group(context_text, [pairs[i][1] for i in members], generator, greedy_generator)
                for i, value in zip(members, scored):
                    out[i] = value
            start = end
        return [value for value in out if value is not None]

    def _score_group(self, context_text: str, continuations: Sequence[str], generator: torch.Generator,
                     greedy_generator: torch.Generator) -> list[tuple[float, bool]]:
        choices = [self._encode(c) for c in continuations]
        for text, ids in zip(continuations, choices):
            if not ids:
                raise ValueError(f"continuation: {text!r} tokenizes to nothing")
        budget = self.max_length - max(len(c) for c in choices)
        context = self._encode(context_text)
        context = context[-budget:] if budget > 0 else []
        if self.method == "score":
            scores = score_choices(self.model, self.kernel, context, choices, num_times=self.num_times,
                                   generator=generator, batch_size=self.batch_size_per_forward)
        else:
            scores = fair_pmi_scores(self.model, self.kernel, context, choices, self._encode(self.null_context),
                                     num_times=self.num_times, generator=generator,
                                     batch_size=self.batch_size_per_forward)
        return [(-float(s), self._is_greedy(context, a, greedy_generator)) for s, a in zip(scores.tolist(), choices)]

    @torch.no_grad()
    def _is_greedy(self, context: list[int], answer: list[int], generator: torch.Generator) -> bool:
        """Whether argmax x_θ reproduces the whole answer from a fully corrupted span at t = 1 − 10⁻³."""
        t = _standard_times(1).float()  # (1,) = 1 − 10⁻³
        span = torch.tensor(answer)
        noise = torch.multinomial(self.kernel.prior(t.double()), span.numel(), replacement=True,
                                  generator=generator)[0]
        x_t = torch.tensor(context + noise.tolist()).unsqueeze(0).to(self.model.device)
        logits = _logits_of(self.model(x_t, t.to(self.model.device)))[0, len(context):]
        if self.model.mask_token_id is not None:
            logits[..., self.model.mask_token_id] = float("-inf")
        return bool((logits.argmax(-1).cpu() == span).all())

    @_evaluating
    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """−(upper bound on −log p_θ(text)) in nats per request (module docstring).

        ``nll_bound`` draws its times and corruption on the windows' device, the model's, so the generator lives
        there too (seeded with ``seed``): on the CPU the numbers are ``nll_bound``'s with
        ``torch.Generator().manual_seed(seed)``; on an accelerator the same estimator with that device's stream.
        """
        device = self.model.device
        generator = self._generator(device)
        out = []
        for request in requests:
            ids = self._encode(str(request.args[0]))
            if not ids:
                out.append(0.0)
                continue
            total = 0.0
            for lo in range(0, len(ids), self.max_length):
                window = torch.tensor(ids[lo: lo + self.max_length], device=device).unsqueeze(0)
                bound = nll_bound(self.model, window, self.kernel, num_times=self.nll_times, generator=generator,
                                  per_token=False)
                total += float(bound.sum())
            out.append(-total)
        return out

    @_evaluating
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Bayesian-sampler continuations of each context, cut at the first stop string (module docstring).

        Requests with the same prompt length and sampling settings are sampled together, ``batch_size`` rows at a
        time, with a generator seeded with ``seed`` per batch: a request's text depends on its batch companions
        (``batch_size=1`` makes every request reproducible on its own). A continuation ends at the tokenizer's EOS
        token, if it has one, then at the earliest of the ``until`` strings.
        """
        settings = [self._generation_settings(request) for request in requests]
        groups: dict[tuple[int, int, float, float | None], list[int]] = {}
        for i, (prompt, max_new, temperature, top_p, _) in enumerate(settings):
            groups.setdefault((len(prompt), max_new, temperature, top_p), []).append(i)
        out = [""] * len(requests)
        device = self.model.device
        for (P, max_new, temperature, top_p), members in groups.items():
            for lo in range(0, len(members), self.batch_size_per_forward):
                chunk = members[lo: lo + self.batch_size_per_forward]
                prompts = torch.tensor([settings[i][0] for i in chunk], dtype=torch.long).reshape(len(chunk), P)
                generator = self._generator(device)  # the sampler draws on the model's device
                ids = self.model.generate(prompts.to(device), max_new_tokens=max_new, num_steps=self.num_steps,
                                          kernel=self.kernel, temperature=temperature, top_p=top_p,
                                          generator=generator)  # (B, P + max_new)
                for i, row in zip(chunk, ids[:, P:].tolist()):
                    out[i] = self._finish(row, settings[i][4])
        return out

    def _generation_settings(self, request: Any) -> tuple[list[int], int, float, float | None, list[str]]:
        """``(prompt ids, max_new_tokens, temperature, top_p, stop strings)`` of one ``generate_until`` request."""
        context, gen_kwargs = str(request.args[0]), dict(request.args[1] or {})
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else [str(u) for u in until]
        max_new = min(_as_int("max_gen_toks", gen_kwargs.get("max_gen_toks", 256)), self.max_length - 1)
        temperature = _as_float("temperature", gen_kwargs.get("temperature", self.temperature))
        if temperature <= 0.0 or not _as_bool("do_sample", gen_kwargs.get("do_sample", True)):
            temperature = 1e-4  # greedy requests: the sampler needs T > 0; 1e-4 is argmax to float precision
        top_p = gen_kwargs.get("top_p", self.top_p)
        top_p = None if top_p is None else _as_float("top_p", top_p)
        prompt = self._encode(context)[-(self.max_length - max_new):]
        return prompt, max_new, temperature, top_p, until

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


def _seeded_generator(seed: int, device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def cli_main(argv: Sequence[str] | None = None) -> int:
    """The harness's own command line (``lm-eval run ...``) with the ``unifusion`` model registered.

    ``unifusion harness ARGS`` calls this. ``argv`` (default ``sys.argv[1:]``) are the harness's arguments, with or
    without the ``run`` subcommand (``ls``/``validate`` pass through); ``--model`` defaults to ``unifusion`` and
    ``--device`` to ``cuda`` when available, else ``cpu``; no arguments or ``--help`` print the options of a run.

    Returns:
        the exit status (0 on success; the harness's own status when it exits, e.g. 2 for a bad option).
    """
    try:
        from lm_eval._cli import HarnessCLI
    except ImportError as err:  # pragma: no cover - older lm-eval releases have a different command line
        raise ImportError("unifusion harness needs an lm-eval with the lm_eval._cli command line (tested with "
                          f"0.4.13): pip install -U \"unifusion[eval]\" ({err})") from None
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
    if args[:1] == ["run"] and not any(a in ("--model", "-M") or a.startswith("--model=") for a in args):
        args += ["--model", "unifusion"]
    if args[:1] == ["run"] and not any(a == "--device" or a.startswith("--device=") for a in args):
        args += ["--device", "cuda" if torch.cuda.is_available() else "cpu"]  # the harness would assume cuda
    saved = sys.argv
    sys.argv = ["unifusion harness", *args]
    try:
        if setup_logging is not None:
            setup_logging()  # as lm-eval's own entry point does: the harness's INFO lines on stderr
        cli = HarnessCLI()
        cli.execute(cli.parse_args())
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0
