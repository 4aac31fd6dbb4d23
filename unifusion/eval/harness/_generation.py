"""``generate_until`` of the harness model: each request resolved into prompt ids and sampler settings (the
harness's gen_kwargs conventions), sampled by :meth:`DiffusionLM.generate <unifusion.DiffusionLM.generate>` with one
generator per request, and cut at EOS and the first stop string.

**Decoding.** ``policy=None`` (the default) is the Bayesian sampler over the whole sequence (``num_steps`` forwards)
on a fully bidirectional model; a block model decodes with :func:`~unifusion.samplers.policies.default_policy`
(``low_confidence`` for a mask kernel, ``entropy_bound`` for a uniform one) as ``DiffusionLM.generate`` does. A
decoding policy (model argument ``policy=``, or per task in ``gen_kwargs``: ``policy``, ``block_size``,
``threshold``, ``num_steps``) decodes block by block with :class:`~unifusion.samplers.PolicySampler`: rows stop at the
tokenizer's EOS (no further forwards), a block model decodes through its exact KV cache, a bidirectional one through
the approximate dual cache when ``cache_refresh`` is set. Names: :data:`unifusion.samplers.policies.POLICY_NAMES`;
``threshold=τ`` alone means ``policy=threshold``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..._device import host_to_device
from ...denoiser import Denoiser
from ...samplers.policies import default_policy, make_policy
from ._args import (
    DEFAULT_MAX_GEN_TOKS,
    GEN_KEYS,
    MAX_TOKEN_KEYS,
    as_bool,
    as_float,
    as_int,
    as_temperature,
    as_top_k,
    as_top_p,
)
from ._common import Cuts, HarnessBase, evaluating, request_seed, seeded_generator


@dataclass(frozen=True)
class DecodingOptions:
    """How ``generate_until`` decodes (module docstring): ``policy`` ``None`` (the Bayesian sampler) or a name of
    :data:`~unifusion.samplers.policies.POLICY_NAMES`; ``steps`` the steps per block (``None``: the default);
    ``merge_commits`` runs a block model's commits within the next block's first step (the same tokens, so it is not
    part of :meth:`key`, which seeds requests)."""

    policy: str | None = None
    block_size: int | None = None
    threshold: float | None = None
    cache_refresh: int | None = None
    steps: int | None = None
    merge_commits: bool = False

    def key(self) -> tuple[Any, ...]:
        return (self.policy, self.block_size, self.threshold, self.cache_refresh, self.steps)


def decoding_options(policy: Any, block_size: Any, threshold: Any, cache_refresh: Any, steps: Any,
                     base: DecodingOptions | None = None, merge_commits: Any = None) -> DecodingOptions:
    """Checked :class:`DecodingOptions` from model arguments or ``gen_kwargs`` (strings as the command line gives
    them; ``None`` keeps ``base``'s value). A policy is checked by building it once."""
    base = base if base is not None else DecodingOptions()
    if isinstance(policy, str) and policy.lower() in ("none", ""):
        name: str | None = None
    else:
        name = base.policy if policy is None else str(policy)
    thr = base.threshold if threshold is None else as_float("threshold", threshold)
    if name is None and threshold is not None:
        name = "threshold"
    options = DecodingOptions(
        policy=name, block_size=base.block_size if block_size is None else as_int("block_size", block_size),
        threshold=thr if name == "threshold" else None,
        cache_refresh=base.cache_refresh if cache_refresh is None else as_int("cache_refresh", cache_refresh),
        steps=base.steps if steps is None else as_int("num_steps", steps),
        merge_commits=base.merge_commits if merge_commits is None else as_bool("merge_commits", merge_commits))
    if options.policy is not None:
        make_policy(options.policy, threshold=options.threshold)
    elif options.block_size is not None or options.cache_refresh is not None or options.merge_commits:
        raise ValueError("policy: block_size, cache_refresh and merge_commits need a decoding policy "
                         "(policy=low_confidence, threshold, ...); policy=none runs the full-sequence Bayesian sampler")
    return options


def check_decoding_for_model(options: DecodingOptions, model: Denoiser, kernel: Any) -> None:
    """What ``generate_until`` would refuse with these options on this model and kernel, raised before any task runs:
    a policy of the other noise family, a block size other than a block model's own, the approximate cache on a block
    model (or without a mask kernel), and a block model whose kernel has no default policy."""
    K = model.block_size
    if options.policy is not None:
        make_policy(options.policy, threshold=options.threshold).check_kernel(kernel)
    elif K is not None:
        default_policy(kernel)
    if K is not None and options.block_size is not None and options.block_size != K:
        raise ValueError(f"block_size: the model was trained with blocks of {K}, got {options.block_size}; leave it "
                         "unset (the model's) or pass the same size")
    if options.cache_refresh is not None:
        if K is not None:
            raise ValueError("cache_refresh: this is a block model, whose cache is exact; the approximate prefix cache "
                             "is for fully bidirectional models (leave cache_refresh unset)")
        if getattr(kernel, "mask_id", None) is None:
            raise ValueError("cache_refresh: the approximate prefix cache fills later blocks with the mask token; "
                             "the kernel has none")


@dataclass
class Job:
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
    decoding: DecodingOptions
    seed: int | None = None

    def settings(self) -> list[Any]:
        """What decides the sample (the stop strings only cut it afterwards); the Bayesian sampler's list is as it
        always was, so its seeds do not change."""
        base = [self.max_new, self.sampled, self.temperature, self.top_k, self.top_p]
        return base if self.decoding.policy is None else base + list(self.decoding.key())


class GenerationRequests(HarnessBase):
    """The harness's ``generate_until`` (a mixin of :class:`~unifusion.eval.harness.UnifusionLM`)."""

    @evaluating
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Bayesian-sampler continuations of each context, cut at the first stop string (see
        :mod:`unifusion.eval.harness`).

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
        cuts = Cuts()
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
            groups.setdefault((len(job.prompt), job.max_new, job.temperature, job.top_k, job.top_p, job.decoding),
                              []).append(i)
        out = [""] * len(requests)
        device = self.model.device
        bar = self._progress(len(requests), "generate_until", disable_tqdm)
        for (P, max_new, temperature, top_k, top_p, decoding), members in groups.items():
            for lo in range(0, len(members), self.batch_size_per_forward):
                chunk = members[lo: lo + self.batch_size_per_forward]
                prompts = torch.tensor([jobs[i].prompt for i in chunk], dtype=torch.long).reshape(len(chunk), P)
                generators = [seeded_generator(cast(int, jobs[i].seed), device) for i in chunk]
                ids = self._sample(host_to_device(prompts, device), max_new, generators, temperature=temperature,
                                   top_k=top_k, top_p=top_p, decoding=decoding)  # (B, P + max_new)
                for i, row in zip(chunk, ids[:, P:].tolist()):
                    out[i] = self._finish(row, jobs[i].until)
                bar.update(len(chunk))
        bar.close()
        return out

    def _generation_job(self, request: Any) -> Job:
        """One ``generate_until`` request's prompt ids and sampler settings (the harness's gen_kwargs conventions:
        ``do_sample`` unset means sampling iff the task sets a temperature > 0, else the model's ``do_sample``)."""
        context, gen_kwargs = str(request.args[0]), request.args[1]
        if gen_kwargs is None:
            gen_kwargs = {}
        if not isinstance(gen_kwargs, dict):
            raise TypeError(f"gen_kwargs: expected a dict, got {type(gen_kwargs).__name__}")
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else [str(u) for u in until]
        max_new = next((as_int(k, gen_kwargs[k]) for k in MAX_TOKEN_KEYS if gen_kwargs.get(k) is not None),
                       DEFAULT_MAX_GEN_TOKS)
        if self.max_gen_toks is not None:
            max_new = min(max_new, self.max_gen_toks)
        max_new = min(max_new, self.max_length - 1)
        temperature = self.temperature
        if gen_kwargs.get("temperature") is not None:
            temperature = as_temperature(gen_kwargs["temperature"])
        do_sample = gen_kwargs.get("do_sample")
        if do_sample is None:
            sampled = temperature > 0.0 if gen_kwargs.get("temperature") is not None else self.do_sample
        else:
            sampled = as_bool("do_sample", do_sample) and temperature > 0.0
        top_p = as_top_p(gen_kwargs["top_p"]) if "top_p" in gen_kwargs else self.top_p
        top_k = as_top_k(gen_kwargs["top_k"]) if "top_k" in gen_kwargs else self.top_k
        if top_k is not None:
            top_k = min(top_k, self.kernel.num_states)
        if not sampled:  # argmax decoding: x_θ one-hot at its argmax
            temperature, top_k, top_p = 1.0, 1, None
        ids = self._encode(context)
        budget = self.max_length - max_new
        unknown = sorted(k for k in gen_kwargs if k not in GEN_KEYS and k not in MAX_TOKEN_KEYS)
        decoding = decoding_options(gen_kwargs.get("policy"), gen_kwargs.get("block_size"),
                                    gen_kwargs.get("threshold"), None, gen_kwargs.get("num_steps"), base=self.decoding)
        return Job(prompt=ids[-budget:] if len(ids) > budget else ids, lost=max(0, len(ids) - budget),
                   max_new=max_new, temperature=temperature, top_k=top_k, top_p=top_p, sampled=sampled, until=until,
                   unknown=unknown, decoding=decoding)

    def _sample(self, prompts: torch.Tensor, max_new: int, generators: Sequence[torch.Generator], *,
                temperature: float, top_k: int | None, top_p: float | None,
                decoding: DecodingOptions | None = None) -> torch.Tensor:
        """:meth:`DiffusionLM.generate <unifusion.DiffusionLM.generate>` (Algorithm 2, ``num_steps`` steps from
        t_0 = 1 − 10⁻³) on ``prompts`` ``(B, P)`` with one generator per row: row b equals
        ``model.generate(prompts[b:b + 1], ..., generator=generators[b])`` whatever rows are beside it (up to the
        model's arithmetic, which on some devices differs with the batch shape). Returns ``(B, P + max_new)``."""
        block_model = getattr(self.model, "block_size", None) is not None
        if decoding is None or (decoding.policy is None and not block_model):
            return self.model.generate(prompts, max_new_tokens=max_new, num_steps=self.num_steps, kernel=self.kernel,
                                       temperature=temperature, top_k=top_k, top_p=top_p, generator=list(generators))
        eos = getattr(self.tokenizer, "eos_token_id", None)
        policy = (default_policy(self.kernel) if decoding.policy is None
                  else make_policy(decoding.policy, threshold=decoding.threshold))
        return self.model.generate(
            prompts, max_new_tokens=max_new, policy=policy, num_steps=decoding.steps, block_size=decoding.block_size,
            cache_refresh=decoding.cache_refresh, merge_commits=decoding.merge_commits,
            kernel=self.kernel, temperature=temperature, top_k=top_k, top_p=top_p, generator=list(generators),
            eos_token_id=eos if isinstance(eos, int) else None, attention_mask=torch.ones_like(prompts))

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
