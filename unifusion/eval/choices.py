"""Zero-shot multiple choice with an x0-predicting diffusion model (paper §4.4, App. C.4).

**Standard score.** For a candidate answer ``a = (a_1 .. a_m)`` after a clean context ``c``, with the time grid
``t_k = 1 − (k − 1)/K`` (k = 1..K, K = 32 in the paper), corrupt only the answer span: each answer token is selected
independently with probability ``β_{t_k} = 1 − α_{t_k}`` (= t_k for the linear schedule) and a selected token is
redrawn from the kernel's noise distribution π_{t_k}, so ``z_{t_k} ~ q_{t_k|0}(·|a)`` on the span and ``z = c`` on the
context. With ``I_k(a)`` the selected positions,

    S(a) = (1/K) Σ_k mean_{i ∈ I_k(a)} [−log x_θ^i(a_i | z_{t_k}, t_k)],

predicted answer = argmin_a S(a). The model runs with full bidirectional attention (``model(z, t)``).
*Empty I_k(a)* (no span token selected, likely only at small t_k): the mean is taken over all span positions
(every position is then clean, so the term is small and similar across candidates).
*t_1 = 1* is evaluated at ``1 − 10⁻³`` (the samplers' endpoint ε): kernels and models take t ∈ (0, 1).

**Fair-PMI** (the paper's BBH scoring). ``L̄(a|c) = (1/K) Σ_k Σ_{i ∈ I_k(a)} −log x_θ^i(a_i | z_{t_k}, t_k)``, the
time-averaged x0 cross-entropy summed over the corrupted span (an empty I_k contributes 0), with K = 128 stratified
times ``t_k = t_min + (1 − t_min)(k − u)/K``, u ~ U(0, 1), t_min = 10⁻³. Then

    S_PMI(a | c) = (L̄(a | c) − L̄(a | "Answer:")) / |a|.

The two estimates share their random numbers (same times, same selected positions, same noise tokens), so the
difference has low variance.

**AR baseline** (Table 2's AR column). The causal LM's NLL of the answer tokens given ``[BOS] + context``:
``Σ_i −log p(a_i | c, a_{<i})`` (``ar_reduction="sum"``, lm-eval's ``acc``) or its mean over tokens (``"mean"``).

Sequences are never padded: rows of equal length (same answer length) are batched together, so any callable
``model(x_t (B, L), t (B,)) -> logits (B, L, S)`` works.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .._device import categorical, host_to_device
from .._validation import (
    batched_checks,
    check_generator,
    check_model_kernel,
    check_positive_int,
    check_token_ids,
    unchecked,
)
from ..denoiser import CausalLM, X0Model
from ..kernels import MAX_TIME, InterpolatingKernel, Kernel, check_kernel
from ..rates import x0_log_probs
from ._shared import input_device, logits_of, progress_bar

__all__ = ["score_choices", "fair_pmi_scores", "ar_choice_nll", "run_multiple_choice", "load_task",
           "MultipleChoiceResult"]

_T_MAX = 1.0 - 1e-3  # where t_1 = 1 of the standard grid is evaluated


# ---------------------------------------------------------------------------------------------------------------
# argument checks


def _as_ids(name: str, value: object, num_states: int, *, allow_empty: bool) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        ids = value
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise TypeError(f"{name}: expected a list of int token ids or a 1-D int64 tensor")
        ids = torch.as_tensor(list(value), dtype=torch.long)
    else:
        raise TypeError(f"{name}: expected a list of int token ids or a 1-D int64 tensor, got {type(value).__name__}")
    if ids.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    if not allow_empty and ids.numel() == 0:
        raise ValueError(f"{name}: expected at least one token, got an empty sequence")
    return check_token_ids(name, ids, num_states)


def _as_choices(choices_ids: object, num_states: int) -> list[torch.Tensor]:
    if isinstance(choices_ids, torch.Tensor):
        if choices_ids.dim() != 2:
            raise ValueError(f"choices_ids: expected a list of id sequences or a (C, m) tensor, "
                             f"got shape {tuple(choices_ids.shape)}")
        choices = list(choices_ids)
    elif isinstance(choices_ids, Sequence) and not isinstance(choices_ids, (str, bytes)):
        choices = list(choices_ids)
    else:
        raise TypeError(f"choices_ids: expected a list of id sequences, got {type(choices_ids).__name__}")
    if not choices:
        raise ValueError("choices_ids: expected at least one choice, got none")
    out = []
    for k, c in enumerate(choices):
        ids = _as_ids(f"choices_ids[{k}]", c, num_states, allow_empty=True)
        if ids.numel() == 0:
            raise ValueError(f"choices_ids[{k}]: expected a non-empty choice, got an empty token sequence")
        out.append(ids)
    return out


def _num_states(model: X0Model, kernel: Kernel) -> int:
    """The kernel's state count, after checking that model and kernel agree (states, mask token)."""
    check_model_kernel(model, kernel)
    return kernel.num_states


# ---------------------------------------------------------------------------------------------------------------
# the core: corrupt the span, score the corrupted positions


def corrupt_span(kernel: Kernel, span: torch.Tensor, t: torch.Tensor,
                 generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """z ~ q_{t|0}(·|span) on a ``(m,)`` span for each time of ``t (K,)``; returns ``(z (K, m), selected (K, m))``.

    Interpolating kernels: a token is selected with probability β_t = 1 − α_t and redrawn from π_t (the normalised
    noise mass m_t / β_t, :meth:`Kernel.prior` at t), which is exactly q_{t|0}; ``selected`` is that selection.
    Other kernels: ``z = kernel.sample(span, t)`` and ``selected = z != span``.
    """
    K, m = t.shape[0], span.shape[0]
    x_0 = span.unsqueeze(0).expand(K, m)
    if isinstance(kernel, InterpolatingKernel):
        alpha_t = kernel.coefficients(t)[0]  # (K,)
        u = torch.rand((K, m), generator=generator, device=span.device, dtype=t.dtype)
        selected = u >= alpha_t.unsqueeze(-1)
        pi_t = kernel.noise_distribution(t, t.dtype, t.device)  # (K, S): π_t (t made by the caller, valid: no check)
        noise = categorical(pi_t, m, generator)  # (K, m), no host sync
        return torch.where(selected, noise, x_0), selected
    with unchecked():  # span and times checked or made by the caller: no per-choice read back
        z = kernel.sample(x_0, t.unsqueeze(-1), generator=generator)
    return z, z != x_0


@torch.no_grad()
def _span_nll(model: X0Model, kernel: Kernel, context: torch.Tensor, targets: torch.Tensor, z_span: torch.Tensor,
              t: torch.Tensor, batch_size: int) -> torch.Tensor:
    """−log x_θ^i(a_i | z, t) on the span for rows z = [context, z_span]: ``targets``, ``z_span`` ``(N, m)``,
    ``t`` ``(N,)`` → float64 ``(N, m)``. Rows are run ``batch_size`` at a time (all have the same length)."""
    device = input_device(model)
    N, m = z_span.shape
    x_t = torch.cat([context.to(z_span.device).unsqueeze(0).expand(N, -1), z_span], dim=1)  # (N, |c| + m)
    # on the model's device once (not once per batch), without making the host wait
    x_t, t, targets = (host_to_device(v, device) for v in (x_t, t.to(torch.float32), targets))
    out = []
    for k in range(0, N, batch_size):
        rows = slice(k, k + batch_size)
        with unchecked():  # rows made here from checked ids: no read back per model call
            logits = logits_of(model(x_t[rows], t[rows]))
        log_x = x0_log_probs(kernel, logits[:, -m:].float())  # (b, m, S)
        out.append(-log_x.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1))
    return torch.cat(out).double()


def _grouped_span_nll(model: X0Model, kernel: Kernel, contexts: Sequence[torch.Tensor], choices: list[torch.Tensor],
                      draws: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                      batch_size: int) -> list[list[torch.Tensor]]:
    """Batch all (choice, time) rows of equal answer length; returns ``nll[context][choice]`` of shape ``(K, m)``."""
    out: list[list[torch.Tensor | None]] = [[None] * len(choices) for _ in contexts]
    by_length: dict[int, list[int]] = {}
    for j, a in enumerate(choices):
        by_length.setdefault(a.numel(), []).append(j)
    for members in by_length.values():
        K = [draws[j][0].shape[0] for j in members]
        targets = torch.cat([choices[j].unsqueeze(0).expand(draws[j][0].shape[0], -1) for j in members])
        z_span = torch.cat([draws[j][0] for j in members])
        t = torch.cat([draws[j][2] for j in members])
        for ci, context in enumerate(contexts):
            nll = _span_nll(model, kernel, context, targets, z_span, t, batch_size).split(K)
            for j, v in zip(members, nll):
                out[ci][j] = v
    return out  # type: ignore[return-value]


def _selections_on(draws: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                   device: torch.device) -> list[torch.Tensor]:
    """The draws' selection masks I_k(a) ``(K, m)`` on ``device``, moved in one copy (not one per choice)."""
    sel = [d[1] for d in draws]
    if all(s.device == device for s in sel):
        return sel
    flat = host_to_device(torch.cat([s.reshape(-1).to(sel[0].device) for s in sel]), device)
    return [f.view(s.shape) for f, s in zip(flat.split([s.numel() for s in sel]), sel)]


def standard_times(num_times: int, device: torch.device | None = None) -> torch.Tensor:
    """The standard score's grid t_k = 1 − (k − 1)/K, k = 1..K, ``(K,)`` float64 (t_1 = 1 evaluated at 1 − 10⁻³)."""
    k = torch.arange(1, num_times + 1, dtype=torch.float64, device=device)
    return (1.0 - (k - 1.0) / num_times).clamp(max=_T_MAX)


def stratified_times(num_times: int, t_min: float, generator: torch.Generator | None,
                     device: torch.device) -> torch.Tensor:
    """Fair-PMI's stratified times t_k = t_min + (1 − t_min)(k − u)/K with one u ~ U(0, 1), ``(K,)`` float64."""
    k = torch.arange(1, num_times + 1, dtype=torch.float64, device=device)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=device)
    return (t_min + (1.0 - t_min) * (k - u) / num_times).clamp(t_min, MAX_TIME)


def score_choices(model: X0Model, kernel: Kernel, context_ids: Sequence[int] | torch.Tensor,
                  choices_ids: Sequence[Sequence[int] | torch.Tensor], *, num_times: int = 32,
                  generator: torch.Generator | None = None, batch_size: int = 64) -> torch.Tensor:
    """Standard diffusion score S(a) of each candidate answer (App. C.4); lower is better.

    S(a) = (1/K) Σ_{k=1}^{K} mean_{i ∈ I_k(a)} [−log x_θ^i(a_i | z_{t_k}, t_k)],   t_k = 1 − (k − 1)/K,

    with the context clean and only the answer span corrupted (see the module docstring for I_k and t_1).

    Args:
        model: x0 predictor ``model(x_t (B, L), t (B,)) -> logits (B, L, S)`` (e.g. a :class:`~unifusion.DiffusionLM`,
            which attends bidirectionally by default).
        kernel: the model's forward kernel (its ``num_states`` must equal the model's).
        context_ids: ``(Lc,)`` context token ids (may be empty).
        choices_ids: ``C`` non-empty answer id sequences.
        num_times: K ≥ 1.
        generator: randomness of the corruption (on the model's device or CPU).
        batch_size: rows per forward pass.

    Returns:
        float64 ``(C,)`` scores.
    """
    kernel = check_kernel(kernel)
    num_times = check_positive_int("num_times", num_times)
    batch_size = check_positive_int("batch_size", batch_size)
    generator = check_generator(generator)
    S = _num_states(model, kernel)
    with batched_checks():  # every id range read back in one transfer
        context = _as_ids("context_ids", context_ids, S, allow_empty=True)
        choices = _as_choices(choices_ids, S)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    t = standard_times(num_times, gen_device)
    choices = [host_to_device(a, gen_device) for a in choices]
    draws = [(*corrupt_span(kernel, a, t, generator), t) for a in choices]
    (nll,) = _grouped_span_nll(model, kernel, [host_to_device(context, gen_device)], choices, draws, batch_size)
    scores = []
    for j, sel in enumerate(_selections_on(draws, nll[0].device)):  # (K, m): I_k(a)
        sel = sel | ~sel.any(-1, keepdim=True)  # empty I_k: fall back to every span position
        per_time = (nll[j] * sel).sum(-1) / sel.sum(-1)  # (K,)
        scores.append(per_time.mean())
    return torch.stack(scores).cpu()


def fair_pmi_scores(model: X0Model, kernel: Kernel, context_ids: Sequence[int] | torch.Tensor,
                    choices_ids: Sequence[Sequence[int] | torch.Tensor],
                    null_context_ids: Sequence[int] | torch.Tensor, *, num_times: int = 128, t_min: float = 1e-3,
                    generator: torch.Generator | None = None, batch_size: int = 64) -> torch.Tensor:
    """Fair-PMI scores S_PMI(a|c) = (L̄(a|c) − L̄(a|null)) / |a| (App. C.4, the paper's BBH scoring); lower is better.

    L̄(a|·) = (1/K) Σ_k Σ_{i ∈ I_k(a)} −log x_θ^i(a_i | z_{t_k}, t_k) with K stratified times
    t_k = t_min + (1 − t_min)(k − u)/K (one u ~ U(0, 1) per answer); both L̄ share the same corruption draws.

    The other arguments are as in :func:`score_choices`.

    Args:
        null_context_ids: the answer-only context, the tokens of ``"Answer:"`` in the paper.
        t_min: minimum time (10⁻³ in the paper), in [0, 1).

    Returns:
        float64 ``(C,)`` scores.
    """
    kernel = check_kernel(kernel)
    num_times = check_positive_int("num_times", num_times)
    batch_size = check_positive_int("batch_size", batch_size)
    if isinstance(t_min, bool) or not isinstance(t_min, (int, float)) or not 0.0 <= t_min < 1.0:
        raise ValueError(f"t_min: expected a float in [0, 1), got {t_min!r}")
    generator = check_generator(generator)
    S = _num_states(model, kernel)
    with batched_checks():  # every id range read back in one transfer
        context = _as_ids("context_ids", context_ids, S, allow_empty=True)
        null = _as_ids("null_context_ids", null_context_ids, S, allow_empty=True)
        choices = _as_choices(choices_ids, S)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    choices = [host_to_device(a, gen_device) for a in choices]
    draws = []
    for a in choices:
        t = stratified_times(num_times, float(t_min), generator, gen_device)
        draws.append((*corrupt_span(kernel, a, t, generator), t))
    contexts = [host_to_device(context, gen_device), host_to_device(null, gen_device)]
    nll_c, nll_null = _grouped_span_nll(model, kernel, contexts, choices, draws, batch_size)
    scores = []
    for j, (a, sel) in enumerate(zip(choices, _selections_on(draws, nll_c[0].device))):  # I_k(a): both contexts
        L_c = (nll_c[j] * sel).sum(-1).mean()  # L̄(a|c)
        L_null = (nll_null[j] * sel).sum(-1).mean()  # L̄(a|null)
        scores.append((L_c - L_null) / a.numel())
    return torch.stack(scores).cpu()


# ---------------------------------------------------------------------------------------------------------------
# AR baseline


@torch.no_grad()
def ar_choice_nll(ar_model: CausalLM, context_ids: Sequence[int] | torch.Tensor,
                  choices_ids: Sequence[Sequence[int] | torch.Tensor], *, bos_token_id: int | None = None,
                  reduction: Literal["sum", "mean"] = "sum") -> torch.Tensor:
    """NLL of each answer under a causal LM given ``[BOS] + context`` (lower is better), float64 ``(C,)``.

    ``reduction="sum"``: Σ_i −log p(a_i | c, a_{<i}) (lm-eval's ``acc``); ``"mean"``: that sum / |a|.
    ``ar_model(input_ids=(1, L)).logits`` (a Hugging Face causal LM) or a callable returning logits.
    The context must be non-empty unless ``bos_token_id`` is given (the first answer token needs a predictor).
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction: expected 'sum' or 'mean', got {reduction!r}")
    if not callable(ar_model):
        raise TypeError(f"ar_model: expected a causal LM (callable), got {type(ar_model).__name__}")
    big = 1 << 62
    with batched_checks():  # every id range read back in one transfer
        context = _as_ids("context_ids", context_ids, big, allow_empty=True)
        choices = _as_choices(choices_ids, big)
    if bos_token_id is not None:
        bos = torch.full((1,), int(bos_token_id), dtype=torch.long, device=context.device)
        prefix = torch.cat([bos, context])
    else:
        prefix = context
    if prefix.numel() == 0:
        raise ValueError("context_ids: empty and no bos_token_id given, so the first answer token has no predictor")
    device = input_device(ar_model)
    out = []
    for a in choices:
        ids = host_to_device(torch.cat([prefix, a.to(prefix.device)]).unsqueeze(0), device)  # (1, L), no host wait
        logits = logits_of(ar_model(input_ids=ids))[0, prefix.numel() - 1: -1].float()  # (m, V)
        nll = torch.nn.functional.cross_entropy(logits, ids[0, prefix.numel():], reduction="sum").double()
        out.append(nll if reduction == "sum" else nll / a.numel())
    return torch.stack(out).cpu()


# ---------------------------------------------------------------------------------------------------------------
# BIG-bench style task runner


def load_task(task: str | os.PathLike[str] | dict[str, Any]) -> dict[str, Any]:
    """A BIG-bench ``task.json`` (path or dict) with ``{"examples": [{"input": str, "target_scores": {str: 0|1}}]}``."""
    if isinstance(task, (str, os.PathLike)):
        path = Path(task)
        if not path.is_file():
            raise ValueError(f"task: expected a path to a BIG-bench task.json, got {str(path)!r} (no such file)")
        with open(path) as f:
            task = json.load(f)
    if not isinstance(task, dict) or not isinstance(task.get("examples"), list):
        raise ValueError("task: expected a dict with an 'examples' list (BIG-bench task.json format)")
    examples = []
    for k, ex in enumerate(task["examples"]):
        scores = ex.get("target_scores") if isinstance(ex, dict) else None
        if not isinstance(ex, dict) or not isinstance(ex.get("input"), str) or not isinstance(scores, dict):
            raise ValueError(f"task: example {k} needs 'input' (str) and 'target_scores' ({{choice: 0|1}})")
        if not scores:
            raise ValueError(f"task: example {k} has no choices (empty target_scores)")
        examples.append(ex)
    return {**task, "examples": examples}


@dataclass
class MultipleChoiceResult:
    """Accuracy of a multiple-choice run.

    Attributes:
        accuracy: fraction of examples whose lowest-scoring choice has the top target score.
        num_examples, num_correct: counts.
        method: ``"score"``, ``"fair_pmi"`` or ``"ar"``.
        predictions: index of the chosen answer per example.
        scores: per-example list of per-choice scores (lower is better).
    """

    accuracy: float
    num_examples: int
    num_correct: int
    method: str
    predictions: list[int] = field(default_factory=list, repr=False)
    scores: list[list[float]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"accuracy": self.accuracy, "num_examples": self.num_examples, "num_correct": self.num_correct,
                "method": self.method, "predictions": self.predictions, "scores": self.scores}


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def run_multiple_choice(task: str | os.PathLike[str] | dict[str, Any], model: X0Model, kernel: Kernel | None,
                        tokenizer: Any, *, method: Literal["score", "fair_pmi", "ar"] = "score",
                        ar_model: CausalLM | None = None, max_examples: int | None = None, num_times: int | None = None,
                        seed: int = 0, batch_size: int = 64, max_length: int = 512,
                        null_context: str = "Answer:", ar_reduction: Literal["sum", "mean"] = "sum",
                        progress: bool = True) -> MultipleChoiceResult:
    """Zero-shot accuracy on a BIG-bench-style task (e.g. ``social_iqa/task.json``).

    Each example's ``input`` is the context and each key of ``target_scores`` a candidate; the candidate is tokenized
    as ``" " + choice`` unless the input already ends in whitespace. Contexts are cut from the left so
    context + answer fits ``max_length`` tokens. The prediction is the lowest-scoring candidate; it is correct when
    its target score is the example's maximum.

    Args:
        task: path to a ``task.json`` or the loaded dict.
        model: the diffusion x0 model (methods ``"score"``/``"fair_pmi"``); for ``method="ar"`` and no ``ar_model``,
            ``model`` itself is scored as a causal LM (a ``DiffusionLM``'s wrapped ``base_model``, run causally).
        kernel: the model's kernel (unused for ``"ar"``).
        tokenizer: the model's tokenizer.
        method: ``"score"`` (:func:`score_choices`, K = 32), ``"fair_pmi"`` (:func:`fair_pmi_scores`, K = 128,
            null context ``null_context``) or ``"ar"`` (:func:`ar_choice_nll` with ``ar_reduction``).
        ar_model: causal LM for ``method="ar"``.
        max_examples: evaluate only the first ``max_examples`` examples.
        num_times: K (default 32 for ``"score"``, 128 for ``"fair_pmi"``).
        seed: seeds the corruption generator (CPU), so runs are reproducible.
    """
    if method not in ("score", "fair_pmi", "ar"):
        raise ValueError(f"method: expected 'score', 'fair_pmi' or 'ar', got {method!r}")
    data = load_task(task)
    examples = data["examples"]
    if max_examples is not None:
        examples = examples[: check_positive_int("max_examples", max_examples)]
    max_length = check_positive_int("max_length", max_length)
    kernel_: Kernel | None = None
    num_times_ = 0
    if method == "ar":
        scorer = ar_model if ar_model is not None else model
        if hasattr(scorer, "base_model") and hasattr(scorer, "mask_token_id"):  # a DiffusionLM: score its HF model
            scorer = scorer.base_model
        bos = getattr(tokenizer, "bos_token_id", None)
    else:
        kernel_ = check_kernel(kernel)
        check_model_kernel(model, kernel_)  # before the first example: mask token and number of states agree
        num_times_ = check_positive_int("num_times", num_times if num_times is not None else
                                         (32 if method == "score" else 128))
        null_ids = _encode(tokenizer, null_context)
    generator = torch.Generator().manual_seed(int(seed))

    predictions, all_scores, correct = [], [], 0
    for ex in progress_bar(examples, enabled=progress, desc=f"MC ({method})"):
        text = ex["input"]
        prefix = "" if (not text or text[-1].isspace()) else " "
        names = list(ex["target_scores"])
        choices = [_encode(tokenizer, prefix + name) for name in names]
        for name, ids in zip(names, choices):
            if not ids:
                raise ValueError(f"task: choice {name!r} tokenizes to nothing")
        context = _encode(tokenizer, text)
        budget = max_length - max(len(c) for c in choices)
        context = context[-budget:] if budget > 0 else []
        if method == "score" and kernel_ is not None:
            scores = score_choices(model, kernel_, context, choices, num_times=num_times_, generator=generator,
                                   batch_size=batch_size)
        elif method == "fair_pmi" and kernel_ is not None:
            scores = fair_pmi_scores(model, kernel_, context, choices, null_ids, num_times=num_times_,
                                     generator=generator, batch_size=batch_size)
        else:
            scores = ar_choice_nll(scorer, context, choices, bos_token_id=bos, reduction=ar_reduction)
        pred = int(torch.argmin(scores))
        targets = [float(ex["target_scores"][n]) for n in names]
        correct += int(targets[pred] == max(targets))
        predictions.append(pred)
        all_scores.append(scores.tolist())
    n = len(examples)
    return MultipleChoiceResult(accuracy=correct / n if n else float("nan"), num_examples=n, num_correct=correct,
                                method=method, predictions=predictions, scores=all_scores)
