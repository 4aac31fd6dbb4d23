"""The request types for a native diffusion LM of :mod:`unifusion.hf.registry` (DiffusionGemma): a model that
conditions on a clean prefix read by its own encoder, so a continuation is scored by the *conditional* bound.

* ``loglikelihood(context, continuation)`` = −(the bound on −log p_θ(continuation | context)) in nats:
  :func:`~unifusion.eval.nll_bound` of the model with ``prompt_mask`` on ``[BOS, context]`` (the one prompt rule,
  :func:`unifusion.denoiser.prompt_conditioning`) with ``num_times`` stratified times,
  ``x0 = [BOS, context, continuation]`` (the prompt is not scored, so only the continuation counts);
  ``is_greedy``: every continuation token is the argmax of x_θ with the continuation replaced by uniform noise.
* ``loglikelihood_rolling(text)``: the same bound of each window of ``max_length − 1`` tokens given BOS.
* ``generate_until``: the model's own ``generate`` (DiffusionGemma: the entropy-bound sampler of its generation
  config, ``num_steps`` denoising steps per canvas) on ``[BOS, context]``, one generator per row.

BOS is the tokenizer's, else the model config's; the harness's contexts are tokenized without special tokens and the
model was trained on sequences that start with it. Each request's generator is seeded with :func:`request_seed` as
for the other models (``"loglikelihood"`` with the pair, ``"is_greedy"``, ``"loglikelihood_rolling"`` with the text).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from ..._device import host_to_device
from ..._validation import unwrap_model
from ...denoiser import Denoiser, prompt_conditioning
from ...hf.ar.model import DiffusionLM
from ..likelihood import nll_bound
from ._common import Cuts, HarnessBase, request_seed, seeded_generator


def is_prefix_conditioned(model: object) -> bool:
    """Whether ``model`` is a wrapped native diffusion LM (a :class:`~unifusion.denoiser.Denoiser` with
    ``conditioned_on``, not a :class:`~unifusion.DiffusionLM`)."""
    inner = unwrap_model(model)
    return isinstance(inner, Denoiser) and not isinstance(inner, DiffusionLM) and callable(
        getattr(inner, "conditioned_on", None))


def _prompt_mask(x0: torch.Tensor, length: int) -> torch.Tensor:
    """``(B, L)`` bool, True on the first ``length`` columns of ``x0``."""
    return (torch.arange(x0.shape[1], device=x0.device) < length)[None].expand(x0.shape[0], -1)


class ConditionalRequests(HarnessBase):
    """The request types for a prefix-conditioned model (used by :class:`~unifusion.eval.harness.UnifusionLM` when
    ``model`` is one)."""

    @property
    def _wrapped(self) -> Any:
        return self.model

    def _bos(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if not isinstance(bos, int):
            config: Any = getattr(self.model, "config", None)
            text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
            bos = getattr(text, "bos_token_id", None)
        if not isinstance(bos, int):
            raise ValueError("tokenizer: the model conditions on a clean prefix that starts with BOS, but neither the "
                             "tokenizer nor the model config names a bos_token_id")
        return bos

    def _conditional_bound(self, prompt: list[int], continuation: list[int], generator: torch.Generator
                           ) -> torch.Tensor:
        """The bound on −log p(continuation | prompt) in nats, a 0-d float64 tensor on the model's device."""
        device = self.model.device
        x0 = host_to_device(torch.tensor([prompt + continuation], dtype=torch.long), device)
        return nll_bound(self._wrapped, x0, self.kernel, num_times=self.num_times, generator=generator,
                         prompt_mask=_prompt_mask(x0, len(prompt)),
                         per_token=False)[0]

    def _conditional_loglikelihood(self, requests: list[Any], disable_tqdm: bool) -> list[tuple[float, bool]]:
        bos, device = self._bos(), self.model.device
        cuts = Cuts()
        bounds, greedy = [], []
        bar = self._progress(len(requests), "loglikelihood", disable_tqdm)
        for request in requests:
            context, continuation = str(request.args[0]), str(request.args[1])
            answer = self._encode(continuation)
            if not answer:
                raise ValueError(f"continuation: {continuation!r} tokenizes to nothing")
            if len(answer) > self.max_length - 1:
                cuts.continuations += 1
                cuts.lost = max(cuts.lost, len(answer) - self.max_length + 1)
                answer = answer[-(self.max_length - 1):]
            budget = self.max_length - 1 - len(answer)
            ids = self._encode(context)
            if len(ids) > budget:
                cuts.contexts += 1
                cuts.lost = max(cuts.lost, len(ids) - budget)
                ids = ids[len(ids) - budget:] if budget > 0 else []
            prompt = [bos] + ids
            pair = [[context, continuation]]
            g = seeded_generator(request_seed(self.seed, "loglikelihood", pair), device)
            bounds.append(self._conditional_bound(prompt, answer, g))
            if self.check_greedy:
                g = seeded_generator(request_seed(self.seed, "is_greedy", pair), device)
                x0 = host_to_device(torch.tensor([prompt + answer], dtype=torch.long), device)
                noise = torch.randint(0, self.model.num_states, (1, len(answer)), generator=g, device=device)
                x_t = torch.cat([x0[:, : len(prompt)], noise], dim=1)
                logits = self._wrapped(x_t, None, **prompt_conditioning(self._wrapped, x0,
                                                                        _prompt_mask(x0, len(prompt))))
                greedy.append((logits[0, len(prompt):].argmax(-1) == x0[0, len(prompt):]).all())
            bar.update(1)
        bar.close()
        cuts.warn("loglikelihood", len(requests), self.max_length)
        values = torch.stack(bounds).tolist() if bounds else []
        flags = torch.stack(greedy).tolist() if greedy else [False] * len(values)
        return [(-v, bool(f)) for v, f in zip(values, flags)]

    def _conditional_rolling(self, requests: list[Any], disable_tqdm: bool) -> list[float]:
        bos, device = self._bos(), self.model.device
        totals: list[torch.Tensor | None] = []
        width = self.max_length - 1
        bar = self._progress(len(requests), "loglikelihood_rolling", disable_tqdm)
        for request in requests:
            text = str(request.args[0])
            ids = self._encode(text)
            g = seeded_generator(request_seed(self.seed, "loglikelihood_rolling", text), device)
            total: torch.Tensor | None = None
            for lo in range(0, len(ids), width):
                bound = self._conditional_bound([bos], ids[lo: lo + width], g)
                total = bound if total is None else total + bound
            totals.append(total)
            bar.update(1)
        bar.close()
        present = [v for v in totals if v is not None]
        values = iter(torch.stack(present).tolist() if present else [])
        return [0.0 if v is None else -next(values) for v in totals]

    def _conditional_sample(self, prompts: torch.Tensor, max_new: int, generators: Sequence[torch.Generator]
                            ) -> torch.Tensor:
        """``model.generate`` on ``[BOS, prompt]`` with ``max_new`` new tokens and ``num_steps`` denoising steps per
        canvas, one generator per row; returns ``(B, P + max_new)`` (rows that stopped early filled with EOS)."""
        B, P = prompts.shape
        bos = prompts.new_full((B, 1), self._bos())
        settings = SimpleNamespace(max_new_tokens=max_new, max_denoising_steps=self.num_steps)
        out = self._wrapped.generate(torch.cat([bos, prompts], dim=1), settings, generator=list(generators))[:, 1:]
        if out.shape[1] < P + max_new:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            fill = eos if isinstance(eos, int) else 0
            out = torch.cat([out, out.new_full((B, P + max_new - out.shape[1]), fill)], dim=1)
        return out
