"""transformers' generation vocabulary for :func:`unifusion.samplers.generate`: a ``GenerationConfig`` and the
keywords of transformers' ``generate`` resolved into the options diffusion decoding honours, stop strings, and the
streamer hooks (batch 1).

* :func:`resolve_hf_options`: explicit keywords over a ``GenerationConfig``'s fields (:data:`HF_SUPPORTED`), as
  transformers resolves them: a keyword given (not ``None``) wins whatever its value, even one equal to the default;
  transformers' "off" values mean off (``top_k=0``, ``top_p=1.0``). Fields that only say how transformers runs
  (caches, compilation, bookkeeping) are ignored; every field that would change the tokens or the output and does not
  apply to diffusion decoding (``num_beams > 1``, ``output_attentions=True``, a non-empty ``logits_processor``, ...)
  is a ``ValueError``; unknown names a ``TypeError``.
* :func:`stop_column`: where a row's decoded text first completes a stop string.
* :func:`with_scores`: transformers' ``scores`` / ``logits`` of a decoding run (``output_scores``,
  ``output_logits``), from the logits of the calls that committed each column.
* :class:`Streaming` (built and checked by :func:`streaming`): the hooks :class:`~unifusion.samplers.PolicySampler`
  calls after each block (``stopping``, ``on_block``); :func:`stop_after` applies stop strings to a finished run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .. import _validation as V
from ..denoiser import DecodableModel
from ._draws import x0_weights
from .policy_sampler import PolicyOutput

__all__ = ["HF_SUPPORTED", "HFOptions", "Streaming", "resolve_hf_options", "stop_after", "stop_column", "streaming",
           "with_scores"]



HF_SUPPORTED = ("max_length", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
                "pad_token_id", "stop_strings", "num_return_sequences", "return_dict_in_generate", "output_scores",
                "output_logits")
"""The ``transformers.GenerationConfig`` fields ``generate`` reads (from a config or as keywords)."""

_HF_IGNORED = frozenset({
    "bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation", "cache_config", "max_cache_len",
    "_from_model_config", "transformers_version", "compile_config", "disable_compile", "low_memory",
    "renormalize_logits", "remove_invalid_values", "prefill_chunk_size", "is_assistant", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
    "continuous_batching_config"})
"""Fields and keywords that say how transformers runs (caches, compilation, bookkeeping; the assistant's settings,
which act only with an ``assistant_model``, itself refused), not which tokens come out: ignored. ``scores`` are
always normalised log-probabilities, so ``renormalize_logits`` changes nothing."""

_HF_NEUTRAL: dict[str, Any] = {
    "num_beams": 1, "num_beam_groups": 1, "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0, "length_penalty": 1.0, "early_stopping": False, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "min_length": 0, "min_new_tokens": 0, "diversity_penalty": 0.0, "guidance_scale": 1.0, "penalty_alpha": 0.0,
    "min_p": 0.0, "output_attentions": False, "output_hidden_states": False, "use_mtp": False, "token_healing": False,
    "logits_processor": [], "stopping_criteria": [], "assistant_model": None, "synced_gpus": False,
    "use_model_defaults": False}
"""Fields and ``generate`` keywords that do not apply to diffusion decoding but are accepted at their neutral (HF's
"off") value (``num_beams=1``, ``output_attentions=False``, an empty ``logits_processor``, ...); any other value is a
``ValueError``."""

_HF_KEYWORDS = frozenset({"logits_processor", "stopping_criteria", "assistant_model", "synced_gpus",
                          "use_model_defaults", "prefix_allowed_tokens_fn", "negative_prompt_ids",
                          "negative_prompt_attention_mask", "custom_generate"})
"""transformers ``generate`` keywords that are not ``GenerationConfig`` fields (refused unless neutral or
ignored)."""


@dataclasses.dataclass
class HFOptions:
    """transformers' options resolved for one ``generate`` call (explicit keywords over the config's fields)."""

    max_new_tokens: int | None
    seq_len: int | None
    do_sample: bool
    temperature: Any  # checked by the sampler
    top_k: int | None
    top_p: float | None
    eos_token_id: Any
    pad_token_id: int | None
    stop_strings: tuple[str, ...]
    num_return_sequences: int = 1
    return_dict_in_generate: bool = False
    output_scores: bool = False
    output_logits: bool = False


def resolve_hf_options(generation_config: Any, extra: dict[str, Any], *, max_new_tokens: int | None,
                       seq_len: int | None, max_length: int | None, do_sample: bool | None, temperature: float | None,
                       top_k: int | None, top_p: float | None, eos_token_id: Any, pad_token_id: int | None,
                       stop_strings: Any, num_return_sequences: int | None = None) -> HFOptions:
    """Merge a ``transformers.GenerationConfig`` with ``generate``'s keywords and refuse what diffusion decoding
    cannot honour.

    Precedence is transformers': a keyword given (not ``None``; ``eos_token_id`` other than ``"auto"``) wins over the
    config's field whatever its value (``temperature=1.0`` beats the config's 0.3), the config's field over the
    default. transformers' "off" values mean off: ``top_k=0`` and ``top_p=1.0`` (no truncation); with
    ``do_sample=False`` the temperature does not apply (``temperature=0`` is then accepted, as transformers does).

    ``extra``: keywords ``generate`` does not name. ``return_dict_in_generate``, ``output_scores`` and
    ``output_logits`` are read from there (or the config); a ``GenerationConfig`` field or transformers ``generate``
    keyword is taken at its neutral value (``num_beams=1``, ``logits_processor=[]``) and is a ``ValueError``
    otherwise (``num_beams=4``: no beam search here); any other name is a ``TypeError``, as an unknown keyword is in
    Python.
    """
    fields: dict[str, Any] = {}
    if generation_config is not None:
        to_dict = getattr(generation_config, "to_dict", None)
        if not callable(to_dict) or not hasattr(generation_config, "max_new_tokens"):
            raise TypeError(f"generation_config: expected a transformers.GenerationConfig (e.g. "
                            f"model.generation_config), got {type(generation_config).__name__}")
        fields = {k: v for k, v in to_dict().items() if v is not None}
    known = (_known_hf_fields() | _HF_KEYWORDS) if extra else frozenset()
    for name in extra:
        if name not in known and name not in _HF_NEUTRAL:
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
    for source, items in (("generation_config.", fields.items()), ("", extra.items())):
        for name, value in items:
            if name in HF_SUPPORTED or name in _HF_IGNORED or value is None:
                continue
            if name in _HF_NEUTRAL and _is_neutral(value, _HF_NEUTRAL[name]):
                continue
            neutral = f" (only {_HF_NEUTRAL[name]!r} is accepted)" if name in _HF_NEUTRAL else ""
            raise ValueError(f"{source}{name}: does not apply to diffusion decoding{neutral}, got {value!r}; "
                             f"generate reads {', '.join(HF_SUPPORTED)}")

    def pick(name: str, given: Any) -> Any:
        """The keyword when given, else the config's field (``None`` when neither)."""
        return given if given is not None else extra.get(name, fields.get(name))

    given = [n for n, v in (("max_new_tokens", max_new_tokens), ("seq_len", seq_len), ("max_length", max_length))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"{', '.join(given)}: give one of them (max_length and seq_len are both the total length "
                         "including the prompt), got " + ", ".join(f"{n}={v!r}" for n, v in
                                                             (("max_new_tokens", max_new_tokens),
                                                              ("seq_len", seq_len), ("max_length", max_length))
                                                             if v is not None))
    if max_length is not None:
        seq_len = max_length
    elif not given:
        if fields.get("max_new_tokens") is not None:
            max_new_tokens = fields["max_new_tokens"]
        elif fields.get("max_length") is not None:
            seq_len = fields["max_length"]
    do_sample = pick("do_sample", do_sample)
    do_sample = True if do_sample is None else do_sample
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample: expected a bool, got {type(do_sample).__name__}")
    temperature = pick("temperature", temperature)
    if temperature is None or (not do_sample and temperature == 0):
        temperature = 1.0  # greedy decoding: the temperature does not apply (transformers ignores it too)
    top_k = pick("top_k", top_k)
    if top_k is not None and not isinstance(top_k, bool) and isinstance(top_k, int) and top_k == 0:
        top_k = None  # transformers' "off"
    top_p = pick("top_p", top_p)
    if top_p is not None and not isinstance(top_p, bool) and isinstance(top_p, (int, float)) and top_p == 1.0:
        top_p = None  # the whole distribution: off
    if isinstance(eos_token_id, str) and eos_token_id == "auto" and "eos_token_id" in fields:
        eos_token_id = fields["eos_token_id"]
    pad_token_id = pick("pad_token_id", pad_token_id)
    stop_strings = pick("stop_strings", stop_strings)
    if stop_strings is None:
        strings: tuple[str, ...] = ()
    elif isinstance(stop_strings, str):
        strings = (stop_strings,)
    elif isinstance(stop_strings, (list, tuple)) and all(isinstance(s, str) and s for s in stop_strings):
        strings = tuple(stop_strings)
    else:
        raise TypeError(f"stop_strings: expected a non-empty string or a list of them, got {stop_strings!r}")
    if any(not s for s in strings):
        raise ValueError("stop_strings: expected non-empty strings, got ''")
    num_return_sequences = pick("num_return_sequences", num_return_sequences)
    num_return_sequences = V.check_positive_int("num_return_sequences", 1 if num_return_sequences is None
                                                else num_return_sequences)
    flags = {}
    for name in ("return_dict_in_generate", "output_scores", "output_logits"):
        value = pick(name, None)
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
        flags[name] = bool(value)
    for name in ("output_scores", "output_logits"):
        if flags[name] and not flags["return_dict_in_generate"]:
            raise ValueError(f"{name}: the scores come back in the output record; pass return_dict_in_generate=True "
                             "too (transformers would drop them silently)")
    return HFOptions(max_new_tokens=max_new_tokens, seq_len=seq_len, do_sample=do_sample, temperature=temperature,
                     top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                     stop_strings=strings, num_return_sequences=num_return_sequences, **flags)


def _is_neutral(value: Any, neutral: Any) -> bool:
    """Whether ``value`` is the neutral ``neutral`` (an empty list for the processor lists)."""
    if isinstance(neutral, list):
        return isinstance(value, (list, tuple)) and not value
    if isinstance(neutral, bool):
        return value is neutral
    return not isinstance(value, bool) and bool(value == neutral)


def _known_hf_fields() -> frozenset[str]:
    """The field names of ``transformers.GenerationConfig`` (read from an instance of this release)."""
    from transformers import GenerationConfig

    return frozenset(GenerationConfig().to_dict())


def stop_column(tokenizer: Any, stop_strings: Sequence[str], tokens: Sequence[int], checked: int = 0) -> int | None:
    """The index ``e`` of the token that completes the first stop string of ``tokens`` (generated ids): the
    smallest ``e`` whose decoded prefix ``tokens[:e + 1]`` contains one; ``None`` if none does. The prefixes up to
    ``checked`` tokens are known to hold none (they are not decoded again)."""
    def found(n: int) -> bool:
        text = tokenizer.decode(list(tokens[:n]))
        return any(s in text for s in stop_strings)

    if not tokens or not found(len(tokens)):
        return None
    for n in range(max(checked, 0) + 1, len(tokens) + 1):
        if found(n):
            return n - 1
    return len(tokens) - 1


class Streaming:
    """Feeds a transformers streamer as HF's ``generate`` does (batch 1): the prompt first, then each decided block
    (its generated columns), then ``end()``; and applies stop strings after each block."""

    def __init__(self, streamer: Any, tokenizer: Any, stop_strings: tuple[str, ...], start: int, length: int
                 ) -> None:
        self.streamer, self.tokenizer, self.stop_strings = streamer, tokenizer, stop_strings
        self.start, self.length = start, length  # the first generated column, the sequence length
        self.checked = 0  # generated tokens known to hold no stop string

    def stopping(self, b: int, tokens: torch.Tensor, cols: torch.Tensor) -> torch.Tensor | None:
        end = int(cols[:, -1].clamp_max(self.length - 1).max()) + 1  # the generated region decided so far
        stops = []
        for row in tokens[:, self.start:end].tolist():
            e = stop_column(self.tokenizer, self.stop_strings, row, self.checked)
            stops.append(-1 if e is None else self.start + e)
        self.checked = end - self.start
        return torch.tensor(stops, dtype=torch.long, device=tokens.device)

    def on_block(self, b: int, tokens: torch.Tensor, cols: torch.Tensor) -> None:
        if self.streamer is None:
            return
        c = cols[0]
        c = c[(c < self.length) & (c >= self.start)]
        if c.numel():
            self.streamer.put(tokens[0, c].cpu())


def streaming(model: DecodableModel, streamer: Any, tokenizer: Any, stop_strings: tuple[str, ...], B: int, P: int,
              L: int, eos: Any, pad: int | None) -> Streaming | None:
    """The streamer and stop-string hooks of one call, checked, or ``None`` when neither is asked for."""
    if streamer is None and not stop_strings:
        return None
    if streamer is not None:
        if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
            raise TypeError(f"streamer: expected a transformers streamer (put() and end(), e.g. TextStreamer), got "
                            f"{type(streamer).__name__}")
        if B != 1:
            raise ValueError(f"streamer: streams one sequence, as transformers' streamers do, got a batch of {B}")
    tok = tokenizer if tokenizer is not None else model.tokenizer
    if stop_strings:
        if tok is None or not callable(getattr(tok, "decode", None)):
            raise ValueError("stop_strings: need a tokenizer to decode the text (pass tokenizer=, or adapt the "
                             "model with one)")
        if pad is None and eos is None:
            raise ValueError("stop_strings: a stopped row's later positions need a fill; pass pad_token_id or "
                             "eos_token_id")
    return Streaming(streamer, tok, stop_strings, P, L)


def stop_after(out: Any, stream: Streaming, P: int, L: int, pad: int | None, eos: Any) -> Any:
    """Stop strings on a finished run (the full-sequence sampler): every position after a row's stop becomes the
    fill (``pad``, else the first EOS id)."""
    if not stream.stop_strings:
        return out
    seqs = out if isinstance(out, torch.Tensor) else out.sequences
    stop = stream.stopping(0, seqs, torch.arange(P, L, device=seqs.device).expand(seqs.shape[0], -1))
    if stop is None:
        return out
    fill = pad if pad is not None else (eos if isinstance(eos, int) else eos[0])
    col = torch.arange(L, device=seqs.device)
    after = (stop[:, None] >= 0) & (col > stop[:, None]) & (col >= P)
    seqs = torch.where(after, fill, seqs)
    return seqs if isinstance(out, torch.Tensor) else dataclasses.replace(out, sequences=seqs)


def with_scores(out: PolicyOutput, P: int, mask_id: int | None, temperature: float, top_k: int | None,
                top_p: float | None, scores: bool, logits: bool) -> PolicyOutput:
    """``out`` with transformers' ``scores`` / ``logits``: one ``(B, S)`` float32 tensor per generated column
    ``P … L − 1``, from the model call that committed the column's token (:attr:`PolicyOutput.commit_logits`).
    ``logits``: that call's raw logits; ``scores``: the log of the distribution the token was drawn from
    (``log softmax(logits / T)``, the mask state and what top-k / top-p cut at ``-inf``). Both are 0 at columns the
    model did not commit (the fill after EOS or a stop string)."""
    assert out.commit_logits is not None and out.commit_step is not None
    raw = out.commit_logits[:, P:]
    committed = (out.commit_step[:, P:] >= 0).unsqueeze(-1)
    record: dict[str, Any] = {}
    if logits:
        record["logits"] = tuple(raw.unbind(1))
    if scores:
        weights = x0_weights(raw, torch.empty_like(raw), mask_id=mask_id, temperature=temperature, top_k=top_k,
                             top_p=top_p)
        logp = (weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)).log()
        record["scores"] = tuple(torch.where(committed, logp, 0.0).unbind(1))
    return dataclasses.replace(out, **record)
