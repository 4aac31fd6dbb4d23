"""What the harness model's request types share: the per-request seeds (:func:`request_seed`), the state the request
methods read (:class:`HarnessBase`), eval mode around a request call, progress bars and the truncation warning."""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from ...denoiser import DenoiserModule
from ...kernels import Kernel

_F = TypeVar("_F", bound=Callable[..., Any])


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
    .manual_seed(request_seed(seed, "loglikelihood", pairs)))``; a generated text: ``model.generate(prompt_ids,
    ..., generator=torch.Generator(device).manual_seed(request_seed(seed, "generate_until", ...)))``.
    """
    text = json.dumps([int(seed), kind, *parts], ensure_ascii=False, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") >> 1


def seeded_generator(seed: int, device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


class HarnessBase:
    """The state :class:`~unifusion.eval.harness.UnifusionLM` sets up in its constructor and its request methods
    (the mixins of ``_loglikelihood`` and ``_generation``) read: the model, its tokenizer and kernel, and the parsed
    model arguments (:data:`~unifusion.eval.harness.MODEL_ARGS`)."""

    model: DenoiserModule  # a DiffusionLM, or a registered diffusion LM's wrapper (DiffusionGemmaLM)
    tokenizer: Any
    kernel: Kernel
    method: str  # "score" or "fair_pmi"
    num_times: int
    null_context: str
    check_greedy: bool
    nll_times: int
    max_length: int
    max_gen_toks: int | None
    num_steps: int
    decoding: Any  # _generation.DecodingOptions
    do_sample: bool
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int
    seeding: str  # "request" or "task"
    batch_size_per_forward: int
    _rank: int

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _progress(self, total: int, desc: str, disable_tqdm: bool) -> Any:
        """A tqdm bar over ``total`` requests, on rank 0 only, unless the harness passed ``disable_tqdm``."""
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, disable=bool(disable_tqdm) or self._rank != 0)


def evaluating(method: _F) -> _F:
    """Run a request method with the model in eval mode and without autograd, then restore every module's mode (a
    live model in the middle of training goes back to training)."""

    @functools.wraps(method)
    def wrapper(self: HarnessBase, *args: Any, **kwargs: Any) -> Any:
        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        try:
            with torch.no_grad():
                return method(self, *args, **kwargs)
        finally:
            for module, training in modes:
                module.training = training

    return cast(_F, wrapper)


@dataclass
class Cuts:
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
