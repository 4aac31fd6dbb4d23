"""What :meth:`DiffusionGemmaLM.generate <unifusion.hf.diffusion_gemma.model.DiffusionGemmaLM.generate>` does:
transformers' ``DiffusionGemmaForBlockDiffusion.generate`` on the package's one generate path,
:func:`unifusion.samplers.generate` (its argument checks, left padding, EOS rule, choice of decoder and block loop).
What is DiffusionGemma's own is here: transformers' ``DiffusionGemmaGenerationConfig`` read into that path's options
(:func:`resolve_settings`; unset fields: the model's ``generation_config``, then the reference's defaults), among them
the :class:`~unifusion.samplers.policies.EntropyBound` it describes (uniform-noise renoising at every step,
entropy-bounded acceptance, linear temperature schedule, stable-and-confident stopping); and the model as that path
reads one: canvases of ``K = canvas_length`` tokens as its blocks, and the encoder cache as its block decoder (the
prompt encoded once, each canvas decoded against the cache, then committed to it in one encoder pass).

Two modes:

* ``parity=True`` reproduces the reference token for token under the same global seed (or one shared generator):
  the reference's canvas loop, one :func:`~unifusion.samplers.generate` call per canvas, with its rules — the same
  random draws in the same order with the whole batch's shapes, EOS-finished rows kept running on their pad canvases,
  its temperature schedule, output rounded up to whole canvases, the last canvas not committed to the returned cache,
  EOS and pad from the generation config only.
* the default fixes what the reference gets wrong: one :func:`~unifusion.samplers.generate` call over every canvas
  (the sampler's block loop and EOS rule); the output is cut at ``max_new_tokens``; the returned cache holds every
  returned token (the last canvas committed); the temperature goes from ``t_max`` at the first step to ``t_min`` at
  the last; each row draws from its own generator (seeded from the global generator, or from ``generator``, in row
  order), so a row's tokens do not depend on the rows beside it; a finished row takes no further decoder passes and
  no draws (its fill canvases are still committed, in the batch's encoder pass, so the returned cache covers every
  row); its positions after EOS hold ``pad_token_id`` (EOS without one); EOS and pad fall back to the text config's;
  bad settings raise ``ValueError`` naming them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ... import _validation as V
from ...samplers.generation import generate as generate_tokens
from ...samplers.policies import EntropyBound
from .cache import CanvasState, commit, prefill
from .wrapped import WrappedDiffusionGemma

__all__ = ["DEFAULTS", "DiffusionGemmaOutput", "GenerationSettings", "generate", "resolve_settings"]

DEFAULTS: dict[str, Any] = {"max_new_tokens": 256, "max_denoising_steps": 48, "entropy_bound": 0.1, "t_min": 0.4,
                            "t_max": 0.8, "stability_threshold": 1, "confidence_threshold": 0.005}
"""The reference's defaults for unset fields (``DiffusionGemmaGenerationConfig._get_default_generation_params``)."""


@dataclass(frozen=True)
class GenerationSettings:
    """The resolved, checked settings of one :func:`generate` call."""

    max_new_tokens: int
    max_length: int | None  # the reference's MaxLengthCriteria (set only from the config's max_length)
    max_denoising_steps: int
    entropy_bound: float
    t_min: float
    t_max: float
    stability_threshold: int
    confidence_threshold: float
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None


@dataclass
class DiffusionGemmaOutput:
    """What :func:`generate` returns with ``return_dict=True``.

    Attributes:
        sequences: ``(B, P + n)`` int64, prompt included.
        tokens_per_forward: ``(B,)`` float32, generated tokens / the decoder passes the row took part in (default:
            tokens up to and including the first EOS; parity: the reference's count, every non-pad new token).
        num_forwards: ``(B,)`` int64, decoder passes per row.
        cache: the transformers ``DynamicCache`` (default: every column of ``sequences``; parity: all but the last
            canvas, as the reference returns it).
    """

    sequences: torch.Tensor
    tokens_per_forward: torch.Tensor
    num_forwards: torch.Tensor
    cache: Any


def _field(config: Any, model_config: Any, name: str) -> Any:
    for source in (config, model_config):
        value = getattr(source, name, None) if source is not None else None
        if value is not None:
            return value
    return None


def _token_ids(value: Any, name: str, vocab_size: int) -> tuple[int, ...]:
    values = [] if value is None else [value] if isinstance(value, int) else list(value)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size:
            raise ValueError(f"{name}: expected token ids in [0, {vocab_size}), got {value!r}")
    return tuple(values)


def resolve_settings(model: WrappedDiffusionGemma, generation_config: Any, prompt_length: int, *,
                     parity: bool = False) -> GenerationSettings:
    """The settings of a call: each field from ``generation_config``, else the model's ``generation_config``, else
    :data:`DEFAULTS` (``entropy_bound`` from ``sampler_config``); ``max_length`` replaces ``max_new_tokens`` when the
    latter is the default 256 (the reference's rule). Outside parity mode EOS and pad fall back to the text config's
    ids. Raises ``ValueError`` naming the field (the reference raises ``AttributeError`` for bad thresholds)."""
    own = getattr(model.base_model, "generation_config", None)
    get: dict[str, Any] = {name: _field(generation_config, own, name) for name in (
        "max_new_tokens", "max_length", "max_denoising_steps", "t_min", "t_max", "stability_threshold",
        "confidence_threshold", "eos_token_id", "pad_token_id")}
    sampler = _field(generation_config, own, "sampler_config")
    bound = sampler.get("entropy_bound") if isinstance(sampler, dict) else getattr(sampler, "entropy_bound", None)
    get["entropy_bound"] = bound
    for name, value in DEFAULTS.items():
        if get[name] is None:
            get[name] = value
    for name in ("max_new_tokens", "max_denoising_steps"):
        if isinstance(get[name], bool) or not isinstance(get[name], int) or get[name] < 1:
            raise ValueError(f"generation_config.{name}: expected an int >= 1, got {get[name]!r}")
    max_length = get["max_length"]
    if max_length is not None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= prompt_length:
            raise ValueError(f"generation_config.max_length: expected an int > the prompt's length {prompt_length}, "
                             f"got {max_length!r}")
        if get["max_new_tokens"] == DEFAULTS["max_new_tokens"]:
            get["max_new_tokens"] = max_length - prompt_length
    for name in ("entropy_bound", "t_min", "t_max", "confidence_threshold"):
        value = get[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"generation_config.{name}: expected a finite float >= 0, got {value!r}")
    if get["confidence_threshold"] <= 0:
        raise ValueError(f"generation_config.confidence_threshold: expected a float > 0, got "
                         f"{get['confidence_threshold']!r}")
    if get["t_max"] < get["t_min"] or get["t_max"] <= 0 or (parity and get["t_max"] == get["t_min"]):
        raise ValueError(f"generation_config.t_max: expected t_max > 0 and t_max {'>' if parity else '>='} t_min = "
                         f"{get['t_min']}, got {get['t_max']!r}")
    stability = get["stability_threshold"]
    if isinstance(stability, bool) or not isinstance(stability, int) or stability < 0:
        raise ValueError(f"generation_config.stability_threshold: expected an int >= 0, got {stability!r}")
    eos, pad = get["eos_token_id"], get["pad_token_id"]
    if not parity:
        text = model.text_config
        eos = eos if eos is not None else getattr(text, "eos_token_id", None)
        pad = pad if pad is not None else getattr(text, "pad_token_id", None)
    V = model.vocab_size
    pad_ids = _token_ids(pad, "generation_config.pad_token_id", V)
    if len(pad_ids) > 1:
        raise ValueError(f"generation_config.pad_token_id: expected one token id, got {pad!r}")
    return GenerationSettings(
        max_new_tokens=get["max_new_tokens"], max_length=max_length, max_denoising_steps=get["max_denoising_steps"],
        entropy_bound=float(get["entropy_bound"]), t_min=float(get["t_min"]), t_max=float(get["t_max"]),
        stability_threshold=stability, confidence_threshold=float(get["confidence_threshold"]),
        eos_token_ids=_token_ids(eos, "generation_config.eos_token_id", V),
        pad_token_id=pad_ids[0] if pad_ids else None)


class _Canvases:
    """DiffusionGemma as :func:`~unifusion.samplers.generate` reads a model — its blocks are the canvases
    (``block_size = canvas_length``), its token ids, kernel and tokenizer the model's, its EOS and pad ids the text
    config's — and the block decoder it offers (:meth:`block_decoder`: itself), the model's cached canvas operations
    over a state that keeps every row of the batch: :meth:`start_blocks` encodes the prompt (once: the state of an
    earlier call is reused); :meth:`denoise_block` runs the decoder for the sampler's running rows (a copy of the cache
    restricted to them); :meth:`commit_block` commits the whole batch's last canvas — the running rows' tokens and the
    finished rows' fill, which :meth:`on_block` keeps — in one encoder pass, so the cache (:attr:`state`, read after
    the run) covers every row."""

    mask_token_id = None

    def __init__(self, model: WrappedDiffusionGemma) -> None:
        self.model = model
        self.device, self.num_states, self.kernel = model.device, model.num_states, model.kernel
        self.config, self.tokenizer, self.block_size = model.text_config, model.tokenizer, model.canvas_length
        self.state: CanvasState | None = None
        self.canvas: torch.Tensor | None = None  # (B, K): the last decided canvas of every row

    def block_decoder(self, *, merge_commits: bool = False) -> _Canvases:
        if merge_commits:
            raise ValueError("merge_commits: DiffusionGemma commits each canvas in its own encoder pass")
        return self

    def prefix_decoder(self, seq_len: int, refresh: int) -> None:
        """None: the canvases are decoded against the exact encoder cache only (no approximate prefix cache)."""
        return None

    def block_forward(self) -> None:
        """None: every canvas is decoded against the encoder cache (no uncached path, ``use_cache=True`` only)."""
        return None

    def start_blocks(self, prefix: torch.Tensor, prefix_mask: torch.Tensor) -> CanvasState:
        if self.state is None:
            self.state = prefill(self.model, prefix, attention_mask=prefix_mask)
        return self.state

    def denoise_block(self, state: CanvasState, block: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                      self_condition: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.denoise_block(state, block, t, rows, self_condition)

    def commit_block(self, state: CanvasState, block: torch.Tensor, rows: torch.Tensor) -> CanvasState:
        assert self.canvas is not None  # on_block ran after the block was decided
        commit(self.model, state, self.canvas)
        return state

    def on_block(self, b: int, tokens: torch.Tensor, cols: torch.Tensor) -> None:
        self.canvas = tokens.gather(1, cols)


def _row_generators(generator: Any, batch_size: int, device: torch.device) -> list[torch.Generator]:
    """One generator per row: the given list, or seeds drawn in row order from ``generator`` (``None``: the global
    CPU generator)."""
    if isinstance(generator, (list, tuple)):
        return list(generator)  # checked by the generate path
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected None, a torch.Generator or a list of them, got "
                        f"{type(generator).__name__}")
    seeds = [int(torch.randint(2**62, (1,), generator=generator, device=generator.device if generator is not None
                               else "cpu")) for _ in range(batch_size)]
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


@torch.no_grad()
def generate(model: WrappedDiffusionGemma, prompt_ids: torch.Tensor, generation_config: Any = None, *,
             attention_mask: torch.Tensor | None = None, generator: Any = None, policy: Any = None,
             return_dict: bool = False, parity: bool = False) -> torch.Tensor | DiffusionGemmaOutput:
    """Generate after ``prompt_ids`` ``(B, P)`` canvas by canvas (see the module docstring for the two modes).

    Args:
        model: the :class:`~unifusion.hf.diffusion_gemma.model.DiffusionGemmaLM`.
        prompt_ids: ``(B, P)`` token ids (left-padded where ``attention_mask`` is 0).
        generation_config: a transformers ``DiffusionGemmaGenerationConfig`` (or any object with its fields);
            ``None``: the model's ``generation_config``, then the reference's defaults.
        attention_mask: ``(B, P)``, 1 = real token, 0 = left padding (checked, as every other argument, by
            :func:`unifusion.samplers.generate`: a batch that looks padded needs it).
        generator: parity: ``None`` (the global generator of the prompt's device) or one ``torch.Generator`` drawn
            with the whole batch's shapes; default: per-row generators seeded in row order from this one (``None``:
            the global CPU generator), or a list of ``B`` generators used as they are.
        policy: a uniform-noise :class:`~unifusion.samplers.policies.DecodingPolicy` to use instead of the
            :class:`~unifusion.samplers.policies.EntropyBound` built from the config (not with ``parity``).
        return_dict: return a :class:`DiffusionGemmaOutput`.
        parity: reproduce the reference, defects included.
    """
    if not isinstance(parity, bool) or not isinstance(return_dict, bool):
        raise TypeError("parity, return_dict: expected bools")
    prompt_ids = V.check_token_batch("prompt_ids", prompt_ids, ("B", "P"))
    B, P = prompt_ids.shape
    s = resolve_settings(model, generation_config, P, parity=parity)
    if policy is None:
        policy = EntropyBound(s.entropy_bound, t_max=s.t_max, t_min=s.t_min,
                              stability_threshold=s.stability_threshold,
                              confidence_threshold=s.confidence_threshold, reach_t_min=not parity)
    elif parity:
        raise ValueError("policy, parity: parity mode reproduces the reference's own sampler; give one or the other")
    if parity:
        if isinstance(generator, (list, tuple)):
            raise ValueError("generator: parity mode draws from one stream with the whole batch's shapes, as the "
                             "reference does; pass None or one torch.Generator")
        return _reference_loop(model, prompt_ids, attention_mask, s, policy, generator, return_dict)
    return _decode(model, prompt_ids, attention_mask, s, policy, _row_generators(generator, B, model.device),
                   return_dict)


def _reference_loop(model: WrappedDiffusionGemma, prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    s: GenerationSettings, policy: Any, generator: Any, return_dict: bool
                    ) -> torch.Tensor | DiffusionGemmaOutput:
    """Parity mode: the reference's canvas loop, one :func:`~unifusion.samplers.generate` call (without EOS) per
    canvas against the cache, the reference's EOS and pad arithmetic after each: every row runs every canvas until
    all have finished, a finished row's canvases become ``pad_token_id`` (when the config has one), the canvas is
    committed before the next one."""
    B, P = prompt_ids.shape
    K = model.canvas_length
    canvases = _Canvases(model)
    eos = torch.tensor(s.eos_token_ids, dtype=torch.long, device=model.device)
    seq, mask = prompt_ids, attention_mask
    finished = torch.zeros(B, dtype=torch.bool, device=model.device)
    forwards = torch.zeros(B, dtype=torch.long, device=model.device)
    for c in range(math.ceil(s.max_new_tokens / K)):
        if c:  # the prefix and its padding are in the cache: the pad canvases are text
            state = canvases.state
            assert state is not None
            commit(model, state, seq[:, -K:])
            mask = torch.ones_like(seq)
        out = generate_tokens(canvases, seq, max_new_tokens=K, policy=policy, num_steps=s.max_denoising_steps,
                              attention_mask=mask, generator=generator, eos_token_id=None, return_dict=True)
        seq = out.sequences
        new = seq[:, -K:]
        forwards += torch.where(~finished, out.num_forwards, 0)
        now = torch.isin(new, eos).any(-1)
        if s.max_length is not None and seq.shape[1] >= s.max_length:
            now = torch.ones_like(now)
        if s.pad_token_id is not None and bool((finished | now).any()):
            new[finished] = s.pad_token_id  # rows finished before: the whole canvas
            if bool(now.any()):  # every row: the tokens after its first EOS (EOS read after the line above)
                e = torch.isin(new, eos)
                new[(e.cumsum(-1) > 0) & ~((e.cumsum(-1) == 1) & e)] = s.pad_token_id
        finished |= now
        if bool(finished.all()):
            break
    if not return_dict:
        return seq
    state = canvases.state
    assert state is not None
    # the reference's arithmetic (integer counts over int32 passes)
    count: Any = ((seq[:, P:] != s.pad_token_id).sum(-1) if s.pad_token_id is not None else seq.shape[1] - P)
    rate = (count / forwards.int()).float()
    return DiffusionGemmaOutput(sequences=seq, tokens_per_forward=rate, num_forwards=forwards, cache=state.cache)


def _decode(model: WrappedDiffusionGemma, prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            s: GenerationSettings, policy: Any, generators: list[torch.Generator], return_dict: bool
            ) -> torch.Tensor | DiffusionGemmaOutput:
    """The default mode: one :func:`~unifusion.samplers.generate` call over every canvas — the sampler's block loop
    and EOS rule (a row stops at its first EOS once its canvas is decided, takes no further passes and draws, its
    later positions hold ``pad_token_id``, else the first EOS id) — against the model's cache (:class:`_Canvases`,
    which commits every row's canvas, fill included). The output is cut at ``max_new_tokens`` (or after the canvas in
    which the last row stopped) and every returned column is committed."""
    P, K = prompt_ids.shape[1], model.canvas_length
    canvases = _Canvases(model)
    eos = list(s.eos_token_ids) or None
    out = generate_tokens(canvases, prompt_ids, max_new_tokens=math.ceil(s.max_new_tokens / K) * K, policy=policy,
                          num_steps=s.max_denoising_steps, attention_mask=attention_mask, generator=generators,
                          eos_token_id=eos, pad_token_id=s.pad_token_id if eos is not None else None,
                          return_dict=True)
    seq = out.sequences
    is_eos = torch.isin(seq[:, P:], torch.tensor(s.eos_token_ids, dtype=torch.long, device=seq.device))
    stopped, first = is_eos.any(-1), is_eos.int().argmax(-1)  # a generated EOS stopped its row there
    if bool(stopped.all()):  # no canvas ran after the one in which the last row stopped
        seq = seq[:, : P + (int(first.max()) // K + 1) * K]
    seq = seq[:, : P + s.max_new_tokens]
    state = canvases.state
    assert state is not None
    if seq.shape[1] > state.length:
        commit(model, state, seq[:, state.length:])
    if not return_dict:
        return seq
    col = torch.arange(P, seq.shape[1], device=seq.device)
    count = (~stopped[:, None] | (col[None] <= P + first[:, None])).sum(-1)
    rate = count.float() / out.num_forwards.clamp_min(1).float()
    return DiffusionGemmaOutput(sequences=seq, tokens_per_forward=rate, num_forwards=out.num_forwards,
                                cache=state.cache)
