"""Prompt continuation, one path for every model: what ``generate`` of :class:`unifusion.hf.DiffusionLM` (and of any
model that offers the interface below) does — argument checks, padding and attention masks, EOS and stop strings, the
choice of sampler and decoder.

The prompt is a fixed prefix of the sequence: it stays in ``z_t`` at every step and never changes. Two samplers:

* ``policy=None`` (default) on a fully bidirectional model: :class:`~unifusion.BayesianSampler` (Algorithm 2)
  generates the positions after it, bidirectionally (``γ = 1``), ``num_steps`` (default 64) full-sequence model calls.
  On a block model ``policy=None`` means :func:`~unifusion.samplers.policies.default_policy` (``LowConfidence`` for
  a mask kernel, ``EntropyBound`` for a uniform one, ``block_size`` steps per block unless ``num_steps`` says
  otherwise), decoded as below.
* a decoding policy (:mod:`unifusion.samplers.policies`): :class:`~unifusion.samplers.PolicySampler`, block by block.
  On a block model with ``use_cache=True`` the exact cached decoder the model offers (``model.block_decoder()``, for
  :class:`~unifusion.hf.DiffusionLM` the KV cache of :class:`~unifusion.hf.ar.decoding.BlockCacheDecoder`); on a fully
  bidirectional model ``cache_refresh=N`` opts into the *approximate* prefix cache it offers
  (``model.prefix_decoder()``: Fast-dLLM's dual cache, :class:`~unifusion.hf.ar.decoding.PrefixCacheDecoder`); otherwise
  every step runs the whole sequence (a block model through ``model.block_forward()``).

**What the model offers** (a :class:`~unifusion.denoiser.Denoiser`: the decoders are its optional capabilities,
``None`` where it offers none). ``device``, ``num_states`` and ``config`` (its ``eos_token_id``/``pad_token_id`` and
``max_position_embeddings``); optionally ``tokenizer`` (EOS and pad ids, stop strings), ``kernel`` (the recorded
training kernel), ``mask_token_id``, ``block_size`` (``None``: fully bidirectional); for a block model
``block_decoder(merge_commits=...)`` (a cached :class:`~unifusion.samplers.BlockDenoiser`) and ``block_forward()`` (an
x0 callable whose blocks see only earlier blocks' tokens); for a bidirectional model that has one,
``prefix_decoder(seq_len, refresh)`` (an approximate cached :class:`~unifusion.samplers.BlockDenoiser`). A decoder
that also has ``on_block(b, tokens, cols)`` gets the sampler's hook of that name: every row's tokens after each block
is decided, the rows stopped at EOS included (DiffusionGemma's canvas cache commits their fill with the running rows'
canvases). This module imports no model: the model layer (:mod:`unifusion.hf`) sits above it.

**Padding.** Prompts of different lengths are left-padded by the tokenizer (``padding_side="left"``) and come with its
``attention_mask`` (1 = real token), which ``generate`` takes: a padded row then equals the row alone (token for token
with a policy and per-row generators). Without ``attention_mask`` a batch whose *first or last prompt column* holds the
pad id in some rows but not in all — the signature of padding — is refused (``ValueError`` naming
``attention_mask``): pass the tokenizer's mask, or ``attention_mask=torch.ones_like(prompt_ids)`` to say the pad
tokens are text. The pad id is ``pad_token_id``, else the tokenizer's, else the model config's.

**EOS.** ``eos_token_id="auto"`` (default) is the tokenizer's EOS id (else the config's) when a policy decodes —
rows then stop there, cost no further forwards, and every later position is EOS (or ``pad_token_id``) — and no EOS
for the Bayesian sampler (whose tokens stay as they were). ``None``: never stop. An int: that id (with the Bayesian
sampler the positions after a row's first generated EOS are filled afterwards; the sampler's steps are the same).

transformers' vocabulary (a ``GenerationConfig``, ``max_length``, ``do_sample``, stop strings, streamers) is resolved
by :mod:`unifusion.samplers.generation_options`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import torch

from .. import _validation as V
from .._kernel_config import default_kernel, warn_if_not_recorded_kernel
from ..denoiser import BlockDenoiser, DecodableModel, X0Model
from ._policy_run import eos_stop, resolve_attention_mask
from ._row_groups import block_leads, by_block_lead
from ._setup import PROMPT_FILL
from .bayesian import BayesianSampler
from .generation_options import resolve_hf_options, stop_after, streaming, with_scores
from .guidance import check_cfg_scale, guided_x0_model
from .policies import default_policy
from .policy_sampler import PolicyOutput, PolicySampler

__all__ = ["generate", "model_eos_token_id", "model_pad_token_id"]

_Offered = TypeVar("_Offered")


def _first_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return None if value is None else int(value)


def model_eos_token_id(model: DecodableModel) -> int | None:
    """The EOS id ``generate`` stops at by default: the tokenizer's ``eos_token_id``, else the wrapped config's (the
    first of a list), else ``None``."""
    tok = model.tokenizer
    eos = _first_id(getattr(tok, "eos_token_id", None)) if tok is not None else None
    return eos if eos is not None else _first_id(getattr(model.config, "eos_token_id", None))


def model_pad_token_id(model: DecodableModel) -> int | None:
    """The pad id of the model's tokenizer, else of its config, else ``None``."""
    tok = model.tokenizer
    pad = _first_id(getattr(tok, "pad_token_id", None)) if tok is not None else None
    return pad if pad is not None else _first_id(getattr(model.config, "pad_token_id", None))


def generate(model: DecodableModel, prompt_ids: torch.Tensor | None = None, *, max_new_tokens: int | None = None,
             seq_len: int | None = None, policy: Any = None, num_steps: int | None = None,
             block_size: int | None = None, use_cache: bool = True,
             cache_refresh: int | None = None, merge_commits: bool = False, attention_mask: torch.Tensor | None = None,
             eos_token_id: int | Sequence[int] | str | None = "auto", pad_token_id: int | None = None,
             return_dict: bool = False, return_trace: bool = False, num_return_sequences: int | None = None,
             kernel: Any = None, temperature: float | None = None, top_p: float | None = None,
             top_k: int | None = None, eps: float = 1e-3, cfg_scale: float = 0.0,
             generator: torch.Generator | Sequence[torch.Generator] | None = None, progress: bool = False,
             generation_config: Any = None, max_length: int | None = None,
             do_sample: bool | None = None, stop_strings: str | Sequence[str] | None = None, tokenizer: Any = None,
             streamer: Any = None, **kwargs: Any) -> Any:
    """Continue ``prompt_ids`` with ``model`` (a :class:`~unifusion.hf.DiffusionLM`, or any model that offers what the
    module docstring lists): ancestral sampling (:class:`~unifusion.BayesianSampler`, Algorithm 2) by default, block
    decoding with a decoding policy (:class:`~unifusion.samplers.PolicySampler`) when ``policy`` is given or the model
    is a block model (default :func:`~unifusion.samplers.policies.default_policy`).

    Args:
        model: the model (a :class:`~unifusion.hf.DiffusionLM`; the module docstring lists what another must offer).
        prompt_ids: ``(B, P)`` or ``(P,)`` int64 token ids (``P = 0`` samples unconditionally; a ``(P,)`` prompt
            gives ``B = 1``). Padded batches need ``attention_mask``. transformers' names for it, ``input_ids=`` and
            ``inputs=``, are accepted too, so ``generate(model, **tokenizer(texts, return_tensors="pt",
            padding=True))`` works (a one-segment ``token_type_ids`` is accepted and dropped).
        max_new_tokens: number of tokens to generate after the prompt; or give
        seq_len: the total length ``P + max_new_tokens`` (exactly one of the two). ``seq_len + 1`` (bos) above the
            config's ``max_position_embeddings`` is a ``ValueError``.
        policy: ``None`` (the BayesianSampler; on a block model the default policy:
            :func:`~unifusion.samplers.policies.default_policy`, ``LowConfidence()`` for a mask kernel and
            ``EntropyBound(1.0)`` for a uniform one, one token per step unless ``num_steps`` is given), or a
            :class:`~unifusion.samplers.policies.DecodingPolicy` (``LowConfidence()``, ``ConfidenceThreshold(0.9)``,
            ``EntropyBound(bound)`` with a uniform kernel, ...).
        num_steps: ``policy=None``: ``N ≥ 1`` model calls (default 64). With a policy: steps per block (default
            the block size; adaptive policies may take fewer).
        block_size: positions per block with a policy (default: one block over the generated region; a block
            model's own ``block_size``, which is the only one it takes).
        use_cache: with a policy on a block model, the exact KV cache (prefill the prompt once, each step runs one
            block's ``K + 1`` positions, one forward per committed block): the same tokens as ``False``.
        merge_commits: with that cache, run each committed block within the next block's first step (one call of
            ``2K + 1`` positions instead of two; Fast-dLLM v2's way) and the prompt's prefill within the first step:
            the same tokens, one call fewer per block.
        cache_refresh: with a policy on a fully bidirectional model, Fast-dLLM's **approximate** dual cache: a
            full forward at each block's first step and every ``cache_refresh`` steps, ``K + 1`` positions in
            between (the tokens drift from uncached decoding; ``1`` is exact). ``None``: no cache.
        attention_mask: the tokenizer's ``(B, P)`` mask (1 = real token), left or right padding: a right-padded
            row is decoded with its text moved to the end of the prompt columns (the generated tokens follow the
            text, not the pads) and returned with its prompt columns as given, so ``out[:, P:]`` holds every row's
            new tokens either way. Real tokens that are not one run at an end of the row are a ``ValueError``.
        eos_token_id: ``"auto"`` (the tokenizer's EOS, else the config's, when a policy decodes; none for
            the BayesianSampler), ``None`` (never stop), an id or a list of ids (any of them): a row stops at its
            first EOS, every later position becomes EOS (the first id; or ``pad_token_id``); with a policy it costs
            no further forwards.
        pad_token_id: the fill after EOS; also the pad id of the padding check (default the tokenizer's).
        return_dict: return a :class:`~unifusion.samplers.PolicyOutput` (``sequences``, ``num_forwards``,
            ``tokens_per_forward`` per row) instead of the tokens.
        return_trace: with a policy, also the rollout trace (implies ``return_dict``):
            :attr:`~unifusion.samplers.PolicyOutput.commit_step` ``(B, L)``, the model call at which each
            generated position was committed (counted as ``num_forwards`` counts, the cache's prefill as call 0),
            and :attr:`~unifusion.samplers.PolicyOutput.commit_logprob`, the log-probability it was committed
            with; what ``uf.rl.sequence_logprob(..., estimator="trace", trace=out.commit_step)`` replays. Mask
            kernels; ``policy=None`` on a model without blocks (the BayesianSampler) is a ``ValueError``.
        num_return_sequences: completions per prompt (default 1, or ``generation_config``'s): the prompts are
            repeated ``n`` times in place (rows ``b·n … b·n + n − 1`` continue prompt ``b``) and decoded in one
            batch of ``B·n`` rows; a list of generators then has ``B·n`` entries, one per returned row.
        kernel: the forward kernel the model was trained with; default the model's ``kernel`` when recorded, else
            :class:`~unifusion.MaskKernel` on the model's mask token, else :class:`~unifusion.UniformKernel`
            (:func:`unifusion.hf.default_kernel`, the rule ``unifusion sample`` follows too).
        temperature: ``T > 0``; ``x_θ = softmax(logits / T)`` (``None``: ``generation_config``'s, else 1; with
            ``do_sample=False`` it does not apply and ``0`` is accepted).
        top_p: nucleus truncation of ``x_θ`` in ``(0, 1]`` (``None``: ``generation_config``'s, else off; ``1.0``:
            off).
        top_k: keep the ``k`` most likely tokens (``None``: ``generation_config``'s, else off; ``0``: off, as in
            transformers).
        eps: ``ε``; sampling starts at ``t_0 = 1 − ε`` (``policy=None``).
        cfg_scale: classifier-free guidance w ≥ 0 (LLaDA's ``cfg_scale``; 0: none), with a policy on a fully
            bidirectional model through full-sequence calls: every call runs the rows twice in one batch, as they
            are and with every prompt column masked (padding included), and the policy reads
            z = z_u + (w + 1)(z − z_u). A trace then records the guided distribution's log-probabilities. Not with a
            block model, ``cache_refresh``, a policy that reads hidden states or ``policy=None`` (``ValueError``).
        generator: random generator on the model's device, for reproducible samples; or a list of ``B``
            generators there, one per row: row b is then ``generate(prompt_ids[b:b + 1], ...,
            generator=generator[b])`` whatever rows are beside it.
        progress: show a progress bar.
        generation_config: a ``transformers.GenerationConfig`` (e.g. ``model.generation_config``, the backbone's
            saved one). Its ``max_new_tokens``/``max_length``, ``do_sample``, ``temperature``, ``top_k``,
            ``top_p``, ``eos_token_id`` (an int or a list), ``pad_token_id``, ``stop_strings``,
            ``num_return_sequences``, ``return_dict_in_generate``, ``output_scores`` and ``output_logits`` are read;
            a keyword given here (not ``None``) wins whatever its value, as in transformers. Fields that only say how
            transformers runs (``use_cache``, ``cache_implementation``, ...) are ignored; any field that would change
            the tokens or the output and does not apply to diffusion decoding (``num_beams`` > 1,
            ``repetition_penalty`` ≠ 1, ``output_attentions=True``, ...) is a ``ValueError``
            (:func:`~unifusion.samplers.generation_options.resolve_hf_options`).
        max_length: transformers' name for ``seq_len`` (the total length, prompt included).
        do_sample: ``False``: greedy decoding — each committed token is the argmax of x_θ (the policy still
            ranks positions by x_θ; mask kernels; ``policy=None`` then means the default policy, block by
            block). ``None`` (default): sample, unless ``generation_config`` says otherwise.
        stop_strings: a string or a list: a row stops after the token that completes one of them in its decoded
            generated text (checked after each block; the later positions become ``pad_token_id``, else EOS).
            Needs ``tokenizer=`` (or the model's ``tokenizer``).
        tokenizer: decodes for ``stop_strings`` (default the model's ``tokenizer``).
        streamer: a ``transformers`` streamer (``TextStreamer``, ``TextIteratorStreamer``, any ``BaseStreamer``),
            batch size 1: ``put`` gets the prompt ``(1, P)`` first, as transformers' ``generate`` does, then each
            block's generated tokens ``(k,)`` as soon as the block is decided (stop strings and EOS applied, so
            the fill after EOS is pushed too: what is pushed after the prompt is exactly the returned row's
            generated tokens), and ``end()`` last. The full-sequence sampler pushes the whole completion once.
        **kwargs: ``return_dict_in_generate=True``: return a :class:`~unifusion.samplers.PolicyOutput` (as
            ``return_dict``); with it ``output_scores=True`` / ``output_logits=True`` add its ``scores`` / ``logits``,
            transformers' layout (a tuple of one ``(B, S)`` tensor per generated column) in the diffusion sense: the
            distribution of the model call that committed that column's token (decoding policies with a mask kernel;
            the full-sequence sampler, which commits no token at a step, refuses them). Other
            ``transformers.GenerationConfig`` fields and ``generate`` keywords (``logits_processor``, ...) are
            accepted at their neutral value only (``num_beams=1``; ``num_beams=4`` is a ``ValueError``); any other
            name is a ``TypeError``.

    Returns:
        ``(B, P + max_new_tokens)`` int64 token ids, the prompt unchanged in the first ``P`` columns (or a
        :class:`~unifusion.samplers.PolicyOutput`).

    ``prompt_ids`` on another device than the model is moved to the model's. A model or prompt on the meta
    device, prompt ids outside ``[0, num_states)`` or equal to the kernel's mask id, a generator on another
    device type than the model (or a number of per-row generators other than ``B``), a padded batch without
    ``attention_mask`` and a length beyond the model's positions are ``ValueError``s naming the argument.
    """
    prompt_ids = _prompt_argument(prompt_ids, kwargs)
    hf = resolve_hf_options(generation_config, kwargs, max_new_tokens=max_new_tokens, seq_len=seq_len,
                            max_length=max_length, do_sample=do_sample, temperature=temperature, top_k=top_k,
                            top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                            stop_strings=stop_strings, num_return_sequences=num_return_sequences)
    max_new_tokens, seq_len, temperature, top_k, top_p = (hf.max_new_tokens, hf.seq_len, hf.temperature, hf.top_k,
                                                          hf.top_p)
    eos_token_id, pad_token_id = hf.eos_token_id, hf.pad_token_id
    if not isinstance(prompt_ids, torch.Tensor):
        raise TypeError(f"prompt_ids: expected a (B, P) int64 tensor of token ids, got {type(prompt_ids).__name__}")
    if prompt_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"prompt_ids: expected integer token ids, got dtype {prompt_ids.dtype}")
    device = model.device
    V.check_model_device(model, "prompt_ids", device)  # a meta model: "model: ..." (metadata only)
    V.check_not_meta("prompt_ids", prompt_ids)
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids[None]
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] == 0:
        raise ValueError(f"prompt_ids: expected shape (B, P) with B >= 1, got {tuple(prompt_ids.shape)}")
    B, P = prompt_ids.shape
    given_prompt = None  # the prompt as given, when right-padded rows were moved to the left
    if attention_mask is not None:
        attention_mask = _check_attention_mask(attention_mask, B, P)
        if attention_mask is not None:
            flushed, attention_mask = _flush_left(prompt_ids, attention_mask)
            if flushed is not prompt_ids:
                given_prompt, prompt_ids = prompt_ids, flushed
    n = hf.num_return_sequences
    if n > 1:  # a group of n completions per prompt, rows b·n … b·n + n − 1, in one batch
        prompt_ids = prompt_ids.repeat_interleave(n, dim=0)
        attention_mask = None if attention_mask is None else attention_mask.repeat_interleave(n, dim=0)
        given_prompt = None if given_prompt is None else given_prompt.repeat_interleave(n, dim=0)
        B = B * n
    if return_trace or hf.return_dict_in_generate:
        return_dict = True
    scores_asked = hf.output_scores or hf.output_logits
    generator = V.check_generators(generator, B)  # None, one generator, or one per row
    for g in (generator,) if isinstance(generator, torch.Generator) else generator or ():
        if g.device.type != device.type:
            raise ValueError(f"generator: is on {g.device} but the model is on {device}; create it there, "
                             f"e.g. torch.Generator(device={str(device)!r})")
    for name, v in (("max_new_tokens", max_new_tokens), ("seq_len", seq_len)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if (max_new_tokens is None) == (seq_len is None):
        raise ValueError("max_new_tokens, seq_len: give exactly one (the number of new tokens, or the total "
                         f"length including the {P} prompt tokens)")
    L = P + max_new_tokens if max_new_tokens is not None else seq_len
    if L is None or L <= P:
        raise ValueError(f"{'max_new_tokens' if seq_len is None else 'seq_len'}: expected at least one new token "
                         f"after the {P} prompt tokens, got a total length of {L}")
    if callable(model):  # a model view that is not an x0 callable (DiffusionGemma's canvases) checks its own length
        V.check_model_length(model, L, "seq_len" if seq_len is not None else "max_new_tokens")
    for name, flag in (("use_cache", use_cache), ("merge_commits", merge_commits), ("return_dict", return_dict),
                       ("return_trace", return_trace)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    if kernel is None:
        kernel = default_kernel(model)[0]
    else:
        warn_if_not_recorded_kernel(model, kernel)
    prompt_ids = prompt_ids.to(device, torch.int64)
    num_states = model.num_states
    if V.validation_enabled() and prompt_ids.numel():  # one host sync, named for generate's argument
        bad = (prompt_ids < 0) | (prompt_ids >= num_states)
        if kernel.mask_id is not None:
            bad |= prompt_ids == kernel.mask_id
        V.fail_if(bad.any(), lambda: (
            f"prompt_ids: expected clean token ids in [0, {num_states})"
            + (f" other than the mask id {kernel.mask_id}" if kernel.mask_id is not None else "")
            + f", got values in [{int(prompt_ids.min())}, {int(prompt_ids.max())}]"))
    if isinstance(attention_mask, torch.Tensor) and attention_mask.numel() and bool(attention_mask.ne(0).all()):
        attention_mask = None  # nothing is padded: the unpadded path (no mask for the model to apply)
    elif attention_mask is None:
        _refuse_ambiguous_padding(prompt_ids, pad_token_id if pad_token_id is not None else model_pad_token_id(model))
    if policy is None and (model.block_size is not None or not hf.do_sample):
        policy = default_policy(kernel)  # a block model decodes block by block; greedy decoding needs a policy
    if scores_asked and policy is not None and getattr(policy, "family", None) != "mask":
        name = "output_scores" if hf.output_scores else "output_logits"
        raise ValueError(f"{name}: records the distribution of the call that commits each masked position, which "
                         f"the mask policies do; {type(policy).__name__} resamples whole blocks (a uniform kernel's "
                         "decoding), so no token has a committing call")
    eos = _resolve_eos(model, eos_token_id, policy)
    stream = streaming(model, streamer, tokenizer, hf.stop_strings, B, P, L, eos, pad_token_id)
    prompt = torch.full((B, L), PROMPT_FILL, dtype=torch.int64, device=device)  # generated positions
    prompt[:, :P] = prompt_ids
    if streamer is not None:  # the prompt first, as transformers' generate does
        streamer.put((prompt_ids if given_prompt is None else given_prompt).cpu())
    guidance = check_cfg_scale(cfg_scale)
    if policy is None:
        if guidance:
            raise ValueError("cfg_scale: classifier-free guidance runs with a decoding policy (LLaDA's: "
                             "policy=uf.samplers.policies.LLaDAOrder()); policy=None runs the BayesianSampler")
        for name, asked in (("return_trace", return_trace), ("output_scores", hf.output_scores),
                            ("output_logits", hf.output_logits)):
            if asked:
                raise ValueError(f"{name}: records the distribution (and step) at which a decoding policy commits "
                                 "each position; the full-sequence BayesianSampler (policy=None on a model without "
                                 "blocks) commits none: pass a policy (policy=uf.samplers.policies.LowConfidence(), "
                                 "...)")
        out = _bayesian(model, kernel, prompt, attention_mask, generator, num_steps, temperature, top_p, top_k,
                        eps, eos, pad_token_id, return_dict, progress, block_size, cache_refresh, merge_commits)
        if stream is not None:  # one "block": the whole generated region, decided at the end
            out = stop_after(out, stream, P, L, pad_token_id, eos)
            seqs = out if isinstance(out, torch.Tensor) else out.sequences
            stream.on_block(0, seqs, torch.arange(P, L, device=seqs.device).expand(B, -1))
            if streamer is not None:
                streamer.end()
        return _as_given(out, given_prompt)
    decoder = _decoder(model, L, block_size, use_cache, cache_refresh, merge_commits)
    model_block = model.block_size
    leads = block_leads(model, attention_mask, B, P)
    if len(set(leads)) > 1:  # rows of one batch whose first blocks hold different numbers of prompt tokens
        options = dict(max_new_tokens=L - P, policy=policy, num_steps=num_steps, block_size=block_size,
                       use_cache=use_cache, merge_commits=merge_commits, pad_token_id=pad_token_id,
                       eos_token_id=list(eos) if isinstance(eos, tuple) else eos, return_dict=return_dict,
                       return_trace=return_trace, kernel=kernel, temperature=temperature, top_p=top_p, top_k=top_k,
                       eps=eps, cfg_scale=cfg_scale, progress=progress, do_sample=hf.do_sample,
                       stop_strings=hf.stop_strings or None, tokenizer=tokenizer, output_scores=hf.output_scores,
                       output_logits=hf.output_logits, return_dict_in_generate=hf.return_dict_in_generate)
        return _as_given(by_block_lead(generate, model, prompt_ids, attention_mask, leads, generator, options),
                         given_prompt)
    lead = leads[0] if leads else 0
    x0_model = None if decoder is not None else _x0_callable(model)
    if guidance:
        x0_model = guided_x0_model(model, x0_model, kernel, policy, guidance, P)
    runner: X0Model | BlockDenoiser = decoder if decoder is not None else cast(X0Model, x0_model)
    sampler = PolicySampler(runner, kernel, policy,
                            num_steps=num_steps, block_size=block_size if model_block is None else model_block,
                            temperature=temperature, top_k=top_k, top_p=top_p, use_cache=decoder is not None,
                            do_sample=hf.do_sample)
    shift = -(P - lead) % model_block if decoder is None and model_block is not None else 0
    if shift:  # the uncached block forward cuts at multiples of K: invisible pads put a cut at the first block
        prompt, attention_mask = _pad_left(prompt, attention_mask, P, shift)
    if stream is not None:
        stream.start, stream.length = P + shift, L + shift
    hooks = [hook for hook in (getattr(decoder, "on_block", None),
                               stream.on_block if stream is not None and streamer is not None else None)
             if callable(hook)]
    out = sampler.sample(B, L + shift, prompt=prompt, attention_mask=attention_mask, generator=generator,
                         eos_token_id=eos, pad_token_id=pad_token_id, return_dict=return_dict,
                         return_trace=return_trace, return_logits=scores_asked, progress=progress,
                         stopping=stream.stopping if stream is not None and stream.stop_strings else None,
                         on_block=_chain(hooks), block_start=P + shift - lead if lead else None)
    if streamer is not None:
        streamer.end()
    if isinstance(out, torch.Tensor):
        return _as_given(out[:, shift:], given_prompt)
    cut = {name: getattr(out, name)[:, shift:] for name in ("commit_step", "commit_logprob", "commit_logits")
           if getattr(out, name) is not None}
    out = dataclasses.replace(out, sequences=out.sequences[:, shift:], **cut)
    if scores_asked:
        out = with_scores(out, P, kernel.mask_id, temperature, top_k, top_p, hf.output_scores, hf.output_logits)
    return _as_given(out, given_prompt)


def _prompt_argument(prompt_ids: Any, kwargs: dict[str, Any]) -> Any:
    """The prompt, from ``prompt_ids`` or transformers' names for it (``input_ids=``, ``inputs=``: what
    ``generate(**tokenizer(texts, return_tensors="pt"))`` passes), popped from ``kwargs``; a tokenizer's
    ``token_type_ids`` (one segment: all zeros) is accepted and dropped."""
    given = {name: kwargs.pop(name) for name in ("input_ids", "inputs") if kwargs.get(name) is not None}
    kwargs.pop("input_ids", None), kwargs.pop("inputs", None)
    if prompt_ids is not None:
        given = {"prompt_ids": prompt_ids, **given}
    if len(given) != 1:
        raise TypeError(f"prompt_ids: give the prompt once (prompt_ids, or transformers' input_ids= / inputs=), got "
                        f"{sorted(given) or 'none'}")
    token_types = kwargs.pop("token_type_ids", None)
    if token_types is not None and (not isinstance(token_types, torch.Tensor) or bool(token_types.ne(0).any())):
        raise ValueError("token_type_ids: the model reads one segment; expected all zeros (what a tokenizer gives "
                         "for one text), got other segment ids")
    return next(iter(given.values()))


def _flush_left(prompt_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows of ``prompt_ids`` ``(B, P)`` moved to the left (their real tokens last, the pads first), so
    that the generated tokens follow the text; left-padded and unpadded rows unchanged (``prompt_ids`` itself comes
    back when no row was right-padded). A mask whose real tokens are not one run touching an end of the row is a
    ``ValueError``. One host sync."""
    real = attention_mask.to(prompt_ids.device).ne(0)
    B, P = real.shape
    count = real.sum(-1)
    runs = (real[:, 1:] & ~real[:, :-1]).sum(-1) + real[:, 0].long()
    right = real[:, 0] & ~real[:, -1]
    bad = (runs > 1) | ((count > 0) & ~real[:, 0] & ~real[:, -1])
    flags = torch.stack([bad.any(), right.any()]).tolist()
    if flags[0]:
        raise ValueError("attention_mask: expected each row's real tokens in one run, with the padding on the left "
                         "or on the right (what a tokenizer gives), got a row with padding between or around them")
    if not flags[1]:
        return prompt_ids, real
    shift = torch.where(right, P - count, 0)
    index = (torch.arange(P, device=real.device) - shift[:, None]) % P
    return prompt_ids.gather(1, index), real.gather(1, index)


def _as_given(out: Any, given_prompt: torch.Tensor | None) -> Any:
    """``out`` with its prompt columns as the caller gave them (right-padded rows were decoded moved left: the
    generated columns are the same either way)."""
    if given_prompt is None:
        return out
    seqs = out if isinstance(out, torch.Tensor) else out.sequences
    seqs = torch.cat([given_prompt.to(seqs.device, seqs.dtype), seqs[:, given_prompt.shape[1]:]], 1)
    return seqs if isinstance(out, torch.Tensor) else dataclasses.replace(out, sequences=seqs)


def _chain(hooks: list[Any]) -> Any:
    """One ``on_block`` hook calling ``hooks`` in order (``None`` for none)."""
    if len(hooks) < 2:
        return hooks[0] if hooks else None

    def on_block(b: int, tokens: torch.Tensor, cols: torch.Tensor) -> None:
        for hook in hooks:
            hook(b, tokens, cols)

    return on_block


def _pad_left(prompt: torch.Tensor, attention_mask: torch.Tensor | None, P: int, shift: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``shift`` more left-padding columns (masked out: the rows compute as before, position ids count real tokens)
    before ``prompt`` ``(B, L)`` and its ``(B, P)`` (or ``(B, L)``) ``attention_mask``."""
    B = prompt.shape[0]
    pads = prompt[:, :1].expand(B, shift)  # any valid id: no query sees them
    mask = torch.ones((B, P), dtype=torch.bool, device=prompt.device) if attention_mask is None else attention_mask
    return torch.cat([pads, prompt], 1), torch.cat([mask.new_zeros((B, shift)), mask], 1)


def _check_attention_mask(attention_mask: object, B: int, P: int) -> torch.Tensor | None:
    """The tokenizer's mask over the prompt: a tensor of shape ``(B, P)`` exactly, like ``prompt_ids`` (``(P,)`` for
    one row); anything narrower or wider would pair the mask's columns with the wrong tokens. ``None`` for an empty
    prompt (nothing to mask)."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask: expected a ({B}, {P}) tensor like prompt_ids (1 = real token), got "
                        f"{type(attention_mask).__name__}")
    mask = attention_mask[None] if attention_mask.dim() == 1 and B == 1 else attention_mask
    if tuple(mask.shape) != (B, P):
        raise ValueError(f"attention_mask: expected shape ({B}, {P}) like prompt_ids (the tokenizer's mask over the "
                         f"prompt), got {tuple(attention_mask.shape)}")
    return mask if P else None


def _refuse_ambiguous_padding(prompt_ids: torch.Tensor, pad: int | None) -> None:
    """Without an attention mask, pad ids in the first or last prompt column of some rows but not all (what a
    tokenizer's padding leaves) are refused: they would be read as prompt text. One host sync."""
    if pad is None or prompt_ids.shape[0] < 2 or prompt_ids.shape[1] == 0:
        return
    edges = prompt_ids[:, [0, -1]] == pad  # (B, 2)
    mixed = (edges.any(0) & ~edges.all(0)).tolist()
    if mixed[0] or mixed[1]:
        side = "left" if mixed[0] else "right"
        raise ValueError(
            f"attention_mask: prompt_ids looks {side}-padded (some rows {'start' if mixed[0] else 'end'} with the pad "
            f"id {pad}, others do not) and no attention_mask was given, so the pads would be read as prompt text; "
            "pass the tokenizer's attention_mask (tokenize with padding_side='left'), or "
            "attention_mask=torch.ones_like(prompt_ids) if those tokens are text")


def _resolve_eos(model: DecodableModel, eos_token_id: object, policy: object) -> int | tuple[int, ...] | None:
    if isinstance(eos_token_id, str):
        if eos_token_id != "auto":
            raise ValueError(f"eos_token_id: expected an int, a list of ints, None or 'auto', got {eos_token_id!r}")
        return model_eos_token_id(model) if policy is not None else None
    if isinstance(eos_token_id, (list, tuple)):
        if not eos_token_id or any(isinstance(e, bool) or not isinstance(e, int) for e in eos_token_id):
            raise TypeError(f"eos_token_id: expected an int, a non-empty list of ints, None or 'auto', got "
                            f"{eos_token_id!r}")
        return tuple(eos_token_id) if len(eos_token_id) > 1 else int(eos_token_id[0])
    if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)):
        raise TypeError(f"eos_token_id: expected an int, a list of ints, None or 'auto', got "
                        f"{type(eos_token_id).__name__}")
    return eos_token_id


def _decoder(model: DecodableModel, L: int, block_size: int | None, use_cache: bool, cache_refresh: int | None,
             merge_commits: bool) -> BlockDenoiser | None:
    """The :class:`~unifusion.samplers.BlockDenoiser` a policy decodes through, or ``None`` (full-sequence calls):
    the model's ``block_decoder`` (block models) or ``prefix_decoder`` (``cache_refresh``)."""
    model_block = model.block_size
    if merge_commits and (model_block is None or not use_cache):
        raise ValueError("merge_commits: merges commits into the exact block cache, which needs a block model "
                         "(adapt_ar_model(..., block_size=K)) and use_cache=True")
    if cache_refresh is not None:
        if isinstance(cache_refresh, bool) or not isinstance(cache_refresh, int) or cache_refresh < 1:
            raise ValueError(f"cache_refresh: expected a positive int (a full forward every N steps of a block), got "
                             f"{cache_refresh!r}")
        if model_block is not None:
            raise ValueError("cache_refresh: this is a block model, whose cache is exact; the approximate prefix cache "
                             "is for fully bidirectional models (leave cache_refresh=None)")
        if not use_cache:
            raise ValueError("cache_refresh: needs use_cache=True")
    if model_block is not None:
        if block_size is not None and block_size != model_block:
            raise ValueError(f"block_size: the model was trained with blocks of {model_block}, got {block_size}; "
                             "leave it None (the model's) or pass the same size")
        if not use_cache:
            return None
        return _offered(model.block_decoder(merge_commits=merge_commits), model, "block_decoder", "use_cache")
    if cache_refresh is not None:
        return _offered(model.prefix_decoder(L, cache_refresh), model, "prefix_decoder", "cache_refresh")
    return None


def _offered(decoder: _Offered | None, model: DecodableModel, method: str, argument: str) -> _Offered:
    """What the model's ``method`` returned (a decoder it offers); a ``TypeError`` naming ``argument`` when it offers
    none (:class:`~unifusion.denoiser.Denoiser`'s default ``None``)."""
    if decoder is None:
        raise TypeError(f"{argument}: this path needs the model's {method}(), which {type(model).__name__} does not "
                        "offer")
    return decoder


def _x0_callable(model: DecodableModel) -> X0Model:
    """What the uncached policy path calls: the model itself, or for a block model its block-causal forward
    (``model.block_forward()``: the tokens decided so far as the clean stream, a block sees only committed blocks)."""
    if model.block_size is None:
        return _itself(model)
    return _offered(model.block_forward(), model, "block_forward", "use_cache")


def _itself(model: DecodableModel) -> X0Model:
    """The model as the x0 callable of a full-sequence path; a ``TypeError`` for a model view that is not callable
    (it decodes only through the decoders it offers)."""
    if not callable(model):
        raise TypeError(f"use_cache: {type(model).__name__} decodes only through the decoders it offers; this "
                        "full-sequence path calls the model itself")
    return model


def _bayesian(model: DecodableModel, kernel: Any, prompt: torch.Tensor, attention_mask: Any, generator: Any,
              num_steps: int | None, temperature: float, top_p: float | None, top_k: int | None, eps: float,
              eos: int | tuple[int, ...] | None, pad: int | None, return_dict: bool, progress: bool,
              block_size: int | None,
              cache_refresh: int | None, merge_commits: bool) -> Any:
    """``policy=None``: today's :class:`~unifusion.BayesianSampler` path (full-sequence steps)."""
    named = [n for n, v in (("block_size", block_size), ("cache_refresh", cache_refresh),
                            ("merge_commits", merge_commits or None)) if v is not None]
    if named:
        raise ValueError(f"{named[0]}: block decoding needs a "
                         "decoding policy (policy=uf.samplers.policies.LowConfidence(), ...); policy=None runs the "
                         "full-sequence BayesianSampler")
    steps = 64 if num_steps is None else num_steps
    B, L = prompt.shape
    x0_model = _itself(model)
    if attention_mask is not None:
        keep = prompt != -1
        with V.batched_checks():
            mask = resolve_attention_mask(attention_mask, B, L, keep, prompt.device)
        if mask is not None and not bool(mask.all()):
            x0_model = _Padded(x0_model, mask, model.num_states)
    sampler = BayesianSampler(x0_model, kernel, steps, eps=eps, temperature=temperature, top_p=top_p, top_k=top_k)
    out = sampler.sample(B, L, prompt=prompt, generator=generator, progress=progress, device=prompt.device)
    generated = prompt == -1
    if eos is not None:
        undecided = torch.zeros_like(generated)
        fill = pad if pad is not None else (eos if isinstance(eos, int) else eos[0])
        done, first, out, _ = eos_stop(out, undecided, generated, eos, fill)
    if not return_dict:
        return out
    end = first if eos is not None else torch.full((B,), L, device=out.device)
    end = torch.where(done, end, L) if eos is not None else end
    tokens = (generated & (torch.arange(L, device=out.device) <= end[:, None])).sum(-1)
    forwards = torch.full((B,), steps, dtype=torch.long, device=out.device)
    return PolicyOutput(sequences=out, num_forwards=forwards, tokens_per_forward=tokens.float() / steps)


class _Padded:
    """The model with a fixed ``attention_mask`` (left-padded prompts on the full-sequence sampler)."""

    def __init__(self, model: X0Model, mask: torch.Tensor, num_states: int) -> None:
        self.model, self.mask, self.num_states = model, mask, num_states

    def __call__(self, x_t: torch.Tensor, t: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        return self.model(x_t, t, attention_mask=self.mask, **kwargs)


