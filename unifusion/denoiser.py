"""What the losses, samplers and evaluation know of a unifusion model: the :class:`Denoiser` interface.

A denoiser is an x0 predictor x_θ(· | x_t, t): called as ``model(x_t (B, L), t (B,), **options)`` it returns
clean-token logits ``(B, L, S)`` over the kernel's ``S = num_states`` states. Any callable with that signature can be
trained and sampled; a :class:`Denoiser` additionally declares its state space and mask token, so that
:func:`~unifusion.diffusion_loss`, the samplers and the evaluation functions can check the kernel against it and use
the options it understands (attention annealing, padding, the fused loss). :class:`Denoiser` is an abstract base class
(``abc.ABC``): a model class states what it provides by subclassing it, and cannot be instantiated while an abstract
member is missing; mypy checks the signatures. The Hugging Face adapters (:class:`unifusion.hf.DiffusionLM`) and the
native diffusion LMs of :mod:`unifusion.hf.registry` (:class:`~unifusion.hf.diffusion_gemma.model.DiffusionGemmaLM`)
subclass it.

**The prompt rule.** Every function that conditions a model on a clean prompt — :func:`~unifusion.diffusion_loss`,
:func:`~unifusion.eval.nll_bound`, the harness — keeps the prompt clean in ``x_t`` and calls the model with
:func:`prompt_conditioning`'s keyword arguments: nothing for a model that reads its prompt from ``x_t`` (a
:class:`~unifusion.DiffusionLM`, any x0 callable), the prompt mask and the clean tokens for a model that encodes its
prompt separately (:attr:`Denoiser.conditions_on_prompt`, e.g. DiffusionGemma).

**The roles a model plays**, as the package's signatures name them:

* :class:`Denoiser` — the interface below: what a function reads of a model beyond calling it (its states, mask token,
  recorded kernel, block size, decoders, tokenizer, config). A new model kind subclasses it.
* :data:`X0Model` — *any* x0 callable ``(x_t, t, **options) → logits``: a :class:`Denoiser`, a DDP / FSDP /
  DeepSpeed / ``torch.compile`` wrapper around one (:func:`unwrap_model` looks through them, :func:`denoiser_of`
  finds the :class:`Denoiser` inside), an :func:`~unifusion.samplers.x0_model_as` head, a prompt-bound callable, or a
  plain function. Losses, samplers and evaluation take this; they ask :func:`denoiser_of` for the interface.
* :class:`BlockDenoiser` — a model that denoises one block against a clean prefix it keeps itself (a KV cache):
  what :meth:`Denoiser.block_decoder` and :meth:`Denoiser.prefix_decoder` return and
  :class:`~unifusion.samplers.PolicySampler` runs.
* :class:`DecodableModel` — what :func:`unifusion.samplers.generate` reads of a model: a :class:`Denoiser` (every
  one offers it), or a view of a model that decodes in its own units (DiffusionGemma's canvases as blocks).
* :data:`CausalLM` — an autoregressive LM scored or used as a judge (``model(input_ids=...)`` → logits, or an output
  with ``.logits``): the GenPPL judge, the AR baselines.

This module sits below every module that takes a model, so they test ``isinstance(model, Denoiser)`` without
importing the layer that defines the models.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeAlias, overload, runtime_checkable

import torch

__all__ = ["BLOCK_ORIGINS", "BlockDenoiser", "BlockOrigin", "CausalLM", "ConvertedHead", "DecodableModel", "Denoiser",
           "DenoiserModule", "HiddenStateBlockDenoiser", "HiddenStateModel", "X0Model", "denoiser_of",
           "prompt_conditioning", "unwrap_model"]

BlockOrigin: TypeAlias = Literal["prompt_end", "sequence_start"]
"""Where a block model's blocks start (:attr:`Denoiser.block_origin`): at each row's generated start
(``"prompt_end"``) or at column multiples of the block size from its first real token (``"sequence_start"``)."""

BLOCK_ORIGINS: tuple[BlockOrigin, ...] = ("prompt_end", "sequence_start")
"""The values of :attr:`Denoiser.block_origin`."""

X0Model: TypeAlias = Callable[..., torch.Tensor]
"""Any x0 model: a callable ``model(x_t (B, L) int64, t (B,) | None, **options) → logits (B, L, S)``. A
:class:`Denoiser`; a DDP / FSDP / DeepSpeed / ``torch.compile`` wrapper around one, which :func:`unwrap_model` looks
through (:func:`denoiser_of` returns the :class:`Denoiser` inside, ``None`` for a plain callable); any ``nn.Module``
or function with that call. The options a function passes (``attention_mask=``, ``x0=``/``kernel=`` of the fused
loss, ...) are those the model takes: a :class:`Denoiser` takes :meth:`Denoiser.forward`'s."""

CausalLM: TypeAlias = Callable[..., Any]
"""An autoregressive LM that is scored, not denoised (the GenPPL judge, the AR baselines of the evaluation): a
Hugging Face ``*ForCausalLM`` called as ``model(input_ids=(B, L), attention_mask=...)`` whose output has ``.logits``
``(B, L, V)`` (next-token logits), or any callable returning those logits."""


@runtime_checkable
class BlockDenoiser(Protocol):
    """A model that denoises one block against a clean prefix it keeps itself (a KV cache, an encoder), which
    :class:`~unifusion.samplers.PolicySampler` uses instead of calling the model on the whole sequence (public as
    ``unifusion.samplers.BlockDenoiser``; :meth:`Denoiser.block_decoder` and :meth:`Denoiser.prefix_decoder` return
    one).

    Every row's generated region must start at the same column P (left-pad prompts of different lengths). The
    sampler calls :meth:`start_blocks` once, then for each block :meth:`denoise_block` at every step and, except
    after the last block, :meth:`commit_block`. ``rows`` are indices into the batch given to :meth:`start_blocks`:
    the rows still running (finished rows are dropped, and never come back once a row has stopped at EOS).

    The sampler counts one model call per row and denoising step. A denoiser that also calls its network elsewhere
    (a prefill in :meth:`start_blocks`, a commit pass) gives its state an ``extra_forwards`` attribute: ``(B,)``
    int64, those calls per row, which :attr:`~unifusion.samplers.PolicyOutput.num_forwards` then includes.
    """

    def start_blocks(self, prefix: torch.Tensor, prefix_mask: torch.Tensor) -> Any:
        """Take the clean prefix ``(B, P)`` (``prefix_mask`` ``(B, P)`` bool: False at left padding; P may be 0);
        return the state the other methods get."""

    def denoise_block(self, state: Any, block: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                      self_condition: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x0 logits ``(B_a, K, S)`` of the current block ``block`` ``(B_a, K)`` of ``rows`` ``(B_a,)``, which follows
        the prefix and every committed block, at times ``t`` ``(B_a,)``. ``self_condition`` is ``None`` at a block's
        first step, else the previous step's logits divided by its temperature ``(B_a, K, S)`` float32 (what
        DiffusionGemma's decoder takes as self-conditioning). ``positions`` ``(B_a, m)`` int64, when given, lists the
        block positions whose logits the sampler reads (a mask policy's masked ones, ascending, padded with decided
        ones); the output elsewhere may be any finite value, so the head may run at those positions only."""

    def commit_block(self, state: Any, block: torch.Tensor, rows: torch.Tensor) -> Any:
        """Append the finished block ``(B_a, K)`` of ``rows`` to the prefix; return the new state."""



class HiddenStateBlockDenoiser(BlockDenoiser, Protocol):
    """A :class:`BlockDenoiser` that also gives a step's final hidden states and its output head apart — what a
    decoding policy that reads hidden states (``DecodingPolicy.reads_hidden``, a learned commit rule) needs on the
    cached path (:class:`~unifusion.hf.ar.decoding.BlockCacheDecoder`, ``PrefixCacheDecoder``).
    ``logits_from_hidden(denoise_block_hidden(...))`` is :meth:`~BlockDenoiser.denoise_block`'s output (no
    ``positions``), with the same cache update."""

    def denoise_block_hidden(self, state: Any, block: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                             self_condition: torch.Tensor | None) -> torch.Tensor:
        """The final hidden states ``(B_a, K, d)`` at the block's positions (the output head's input)."""

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The output head ``(..., d)`` → x0 logits ``(..., S)``."""


class HiddenStateModel(Protocol):
    """An x0 model that also gives its final hidden states and its output head apart (``DiffusionLM``, a block
    model's ``block_forward()``): ``logits_from_hidden(hidden_states(x_t, t, attention_mask=m))`` is the model's
    logits — what a policy that reads hidden states needs on the uncached path."""

    def hidden_states(self, x_t: torch.Tensor, t: torch.Tensor, *, attention_mask: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """The final hidden states ``(B, L, d)``, row i predicting ``x^i`` as the logits' row i."""

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The output head ``(..., d)`` → x0 logits ``(..., S)``."""


class DecodableModel(Protocol):
    """What :func:`unifusion.samplers.generate` reads of a model (a structural type: every :class:`Denoiser` is one).

    Its token space (:attr:`device`, :attr:`num_states`, :attr:`mask_token_id`, the recorded :attr:`kernel`), its
    blocks (:attr:`block_size`, ``None`` without blocks), where its EOS and pad ids come from (:attr:`config`,
    :attr:`tokenizer`) and the decoders it offers (each ``None`` when it offers none: :meth:`Denoiser.block_decoder`,
    :meth:`Denoiser.prefix_decoder`, :meth:`Denoiser.block_forward` describe them). The full-sequence paths call the
    model itself as an x0 model, so an object that is not callable must offer a decoder for every path it allows."""

    @property
    def device(self) -> torch.device: ...
    @property
    def num_states(self) -> int: ...
    @property
    def mask_token_id(self) -> int | None: ...
    @property
    def kernel(self) -> Any: ...
    @property
    def block_size(self) -> int | None: ...
    @property
    def config(self) -> Any: ...
    @property
    def tokenizer(self) -> Any: ...
    def block_decoder(self, *, merge_commits: bool = False) -> BlockDenoiser | None: ...
    def prefix_decoder(self, seq_len: int, refresh: int) -> BlockDenoiser | None: ...
    def block_forward(self) -> X0Model | None: ...

class Denoiser(ABC):
    """The interface of unifusion's x0 denoisers (an abstract base class; it holds no state).

    What a model kind implements (abstract: a subclass missing one cannot be instantiated; mypy checks the
    signatures):

    * :attr:`num_states` (int): the state-space size S of the kernels the model is trained with (its logit columns);
    * :attr:`device`: where ``x_t`` must live;
    * :meth:`forward` ``(x_t, t, *, bidirectional_prob=1.0, attention_mask=None, generator=None, ...)`` → x0 logits
      ``(B, L, S)``, and with ``x0=``, ``kernel=`` (and the loss options of
      :func:`~unifusion.losses.fused_linear_diffusion_loss`) the fused per-position loss ``(B, L)`` (:meth:`loss`
      names that call); the model is called as ``model(x_t, t, ...)`` (``torch.nn.Module.__call__``);
    * :meth:`logits_from_hidden`: the output head on final hidden states (the fused loss runs it chunk by chunk);
    * :meth:`generate`: continue prompts (each model's own options and result);
    * :meth:`save_pretrained` / :meth:`from_pretrained`: a checkpoint folder with the kernel recorded.

    The attributes it sets (instance or class attributes; the defaults here hold for a model that sets none):

    * :attr:`mask_token_id` (required): the absorbing state of mask and hybrid kernels, ``None`` for a model that
      knows only uniform noise;
    * :attr:`kernel`, :attr:`tokenizer`, :attr:`config`: the training kernel, the tokenizer, the backbone's
      configuration, each ``None`` when not known;
    * :attr:`block_size`: ``K`` for a block model (trained block-causally, decoded block by block), ``None`` for a
      model that sees the whole sequence at once; a block model also implements :meth:`block_conditioning` (how its
      block-causal forward takes the clean stream) and says where its blocks start (:attr:`block_origin`: at the
      prompt's end, the default, or from the sequence's first token);
    * :attr:`conditions_on_prompt`: whether calls must be told where the clean prompt is (see
      :func:`prompt_conditioning`);
    * :attr:`generate_takes_sampler_options`: whether ``generate`` takes :func:`unifusion.samplers.generate`'s
      options (what RL rollouts pass).

    And the optional capabilities: decoders :func:`unifusion.samplers.generate` asks the model for. Each returns
    ``None`` here (the model does not offer it; ``generate`` then raises a ``TypeError`` naming the argument that
    asked for it); a model kind that has one overrides the method:

    * :meth:`block_decoder`: the exact cached :class:`BlockDenoiser` of a block model (``use_cache=True``);
    * :meth:`prefix_decoder`: an approximate prefix cache for a fully bidirectional model (``cache_refresh=N``);
    * :meth:`block_forward`: a block model as an x0 callable whose blocks see only earlier blocks' tokens
      (``use_cache=False``).

    A model whose prediction needs to be told where the clean prompt ends and which clean tokens precede the noisy
    ones (an encoder-decoder such as DiffusionGemma, which encodes the clean prefix into a cache) sets
    :attr:`conditions_on_prompt`; :func:`prompt_conditioning` then gives it ``prompt_mask=`` and ``x0=``.

    What the losses, estimators and trainers pass besides ``x_t`` and ``t`` comes from these declarations only
    (:attr:`block_size`, :attr:`block_origin`, :meth:`block_conditioning`, :attr:`conditions_on_prompt`): a kind
    registered from outside the package trains, scores and samples as the built-in ones do.
    """

    conditions_on_prompt: bool = False
    """Whether calls take ``prompt_mask=`` (``(B, L)`` bool) and the clean tokens ``x0=`` besides ``x_t``."""

    generate_takes_sampler_options: bool = True
    """Whether :meth:`generate` takes :func:`unifusion.samplers.generate`'s options (``policy``, ``num_steps``,
    ``block_size``, ``use_cache``, ``temperature``, ...), as a trainer's rollouts pass them. ``False`` for a kind
    whose ``generate`` reads its own generation config instead (DiffusionGemma); its ``**kwargs`` then do not say
    otherwise."""

    mask_token_id: int | None
    """The absorbing (mask) state of mask and hybrid kernels, ``None`` for a model that knows only uniform noise."""

    kernel: Any = None
    """The forward kernel the model was trained with, when known (``None`` otherwise; a
    :class:`~unifusion.kernels.Kernel`: typed ``Any`` because the kernels sit in a layer above this module).
    :func:`unifusion.hf.default_kernel` reads it."""

    block_size: int | None = None
    """Tokens per block ``K`` of a block model: trained block-causally (block ``b`` sees the clean tokens of blocks
    ``< b`` and its own noisy ones, :mod:`unifusion.hf.ar.blocks`), sampled block by block with a decoding policy.
    ``None``: not a block model (one bidirectional block over the whole sequence)."""

    block_origin: BlockOrigin = "prompt_end"
    """Where a block model's blocks start, as it was trained and as its own decoder cuts them
    (:mod:`unifusion.block_partition`); read only when :attr:`block_size` is set.

    * ``"prompt_end"`` (this default): at each row's generated start — the prompt is a clean prefix of any length and
      the first block holds the first K generated tokens (unifusion's adapted :class:`~unifusion.DiffusionLM`,
      trained with its blocks cut at the prompt's end; DiffusionGemma's canvases).
    * ``"sequence_start"``: at column multiples of K from each row's first real token — the block holding the
      prompt's last ``P mod K`` tokens is decoded with the first generated ones, those prompt tokens fixed (SDAR /
      TraDo, LLaDA 2.x and Fast-dLLM v2, trained on sequences cut into blocks from their start, whose reference
      decoders cut blocks from column 0).

    :func:`unifusion.samplers.generate`, :func:`unifusion.rl.sequence_logprob`, the trainers and the distillation
    recorder all cut blocks where this says, so a completion is scored under the blocks it was sampled from."""

    tokenizer: Any = None
    """The Hugging Face tokenizer saved with the model, or ``None`` (``generate`` reads its EOS and pad ids and
    decodes stop strings with it)."""

    config: Any = None
    """The backbone's configuration (a transformers ``PretrainedConfig``: ``eos_token_id``, ``pad_token_id``,
    ``max_position_embeddings``, ...), or ``None``. Typed ``Any``: transformers' configs set their fields
    dynamically."""

    @property
    @abstractmethod
    def num_states(self) -> int:
        """The kernels' state-space size S (the logit columns)."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where ``x_t`` must live (the weights' device)."""

    @abstractmethod
    def forward(self, x_t: torch.Tensor, t: Any = None, *, bidirectional_prob: float = 1.0,
                attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
                x0: torch.Tensor | None = None, kernel: Any = None,
                objective: Literal["gidd", "mdlm", "sedd", "m2s", "ctmc"] = "gidd",
                weighting: Literal["elbo", "clip", "dynamic"] = "elbo", max_weight: float = 2.0,
                reduction: Literal["none", "sum", "mean"] = "none",
                position_weight: torch.Tensor | None = None) -> torch.Tensor:
        """x0 logits ``(B, L, S)`` of ``x_t`` at times ``t`` (``(B,)``, or what the model takes), attention annealed
        to ``bidirectional_prob`` where the model anneals, padding per ``attention_mask``; with ``x0`` and ``kernel``
        the fused loss ``(B, L)`` (``objective``, ``weighting``, ``max_weight``, ``reduction``, ``position_weight``
        as :func:`~unifusion.losses.fused_linear_diffusion_loss` takes them). Subclasses add their own options."""

    @abstractmethod
    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The output head on final hidden states ``(..., d)`` → logits ``(..., S)``."""

    @abstractmethod
    def generate(self, prompt_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Continue ``prompt_ids`` ``(B, P)``: ``(B, P + new)`` token ids (or the model's output record)."""

    @abstractmethod
    def save_pretrained(self, save_directory: str | os.PathLike[str], tokenizer: Any = None, *,
                        kernel: Any = None) -> None:
        """Write a checkpoint folder that :meth:`from_pretrained` reads back, with the kernel recorded."""

    @classmethod
    @abstractmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None, load_tokenizer: bool = True) -> Denoiser:
        """Load a folder written by :meth:`save_pretrained` (in ``dtype``, on ``device``, with the tokenizer saved
        beside it unless ``load_tokenizer=False``), in eval mode, the recorded kernel as :attr:`kernel`."""

    def loss(self, x_t: torch.Tensor, t: Any, x0: torch.Tensor, kernel: Any, **kwargs: Any) -> torch.Tensor:
        """The fused per-position loss ``(B, L)``: ``self(x_t, t, x0=x0, kernel=kernel, **kwargs)`` (under DDP/FSDP
        call the wrapper that way instead, so its hooks fire)."""
        return self(x_t, t, x0=x0, kernel=kernel, **kwargs)

    # -- optional capabilities: the decoders generate asks for (None: not offered) -----------------------------------

    def block_decoder(self, *, merge_commits: bool = False) -> BlockDenoiser | None:
        """The exact cached decoder of a block model (:attr:`block_size` set): a :class:`BlockDenoiser` whose
        :meth:`~BlockDenoiser.denoise_block` runs one block of ``K`` positions against the cached clean prefix and
        committed blocks, giving the same tokens as :meth:`block_forward`. ``merge_commits``: commit each finished
        block within the next block's first step (fewer calls, the same tokens), where the model can. ``None`` (this
        default): the model offers none."""
        return None

    def prefix_decoder(self, seq_len: int, refresh: int) -> BlockDenoiser | None:
        """An **approximate** cached decoder for a model without blocks (Fast-dLLM's dual cache) over sequences of
        ``seq_len`` tokens: a full forward at each block's first step and every ``refresh`` steps of a block, the
        cached context in between (``refresh=1`` is exact). ``None`` (this default): the model offers none."""
        return None

    def block_forward(self) -> X0Model | None:
        """A block model as an x0 callable ``(x_t (B, L), t (B,), attention_mask=None) → logits (B, L, S)`` in which
        each block sees only the tokens of earlier blocks as they stand (the uncached block path of
        :func:`unifusion.samplers.generate`, ``use_cache=False``). ``None`` (this default): the model offers none."""
        return None

    def block_conditioning(self, x0: torch.Tensor) -> dict[str, Any]:
        """The keyword arguments that give a block model's block-causal forward its **clean stream**, for a call
        ``model(x_t, t, **model.block_conditioning(x0))`` over rows of several blocks (``L > block_size``).

        The block forward this declares: ``t`` is one time per block ``(B, ⌈L/K⌉)`` (or per row ``(B,)``); blocks are
        cut at column multiples of K from column 0; block ``b``'s prediction sees the clean tokens ``x0`` of the
        blocks before it and the noisy ``x_t`` of its own block, nothing of later blocks; columns where
        ``attention_mask`` is 0 are invisible. So a row moved right by ``(−o) mod K`` padded columns has its blocks
        cut from column o — its generated start, or its first real token for a ``"sequence_start"`` kind
        (:attr:`block_origin`) — as the decoders cut them (:mod:`unifusion.block_partition`, what
        :func:`unifusion.rl.sequence_logprob` does). :func:`unifusion.diffusion_loss`, :func:`unifusion.eval.nll_bound`
        and the estimators call it; a row of one block takes the plain call (no clean stream).

        Args:
            x0: the clean tokens ``(B, L)`` of the call's rows (aligned with ``x_t``).

        Returns:
            ``{}`` for a model without blocks (this default, :attr:`block_size` ``None``); a block model returns what
            its ``forward`` takes (a :class:`~unifusion.DiffusionLM`: ``{"clean": x0}``).

        Raises:
            TypeError: a block model (:attr:`block_size` set) that does not override this method: the interface cannot
                know how its forward takes the clean tokens.
        """
        if self.block_size is None:
            return {}
        raise TypeError(f"model: {type(self).__name__} is a block model (block_size={self.block_size}) but does not "
                        "declare how its block-causal forward takes the clean tokens; override "
                        "Denoiser.block_conditioning(x0) to return its forward's keyword arguments")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``forward`` (a ``torch.nn.Module`` subclass listed before :class:`Denoiser` calls it through its hooks)."""
        return self.forward(*args, **kwargs)


class DenoiserModule(torch.nn.Module, Denoiser):
    """A :class:`Denoiser` that is a ``torch.nn.Module`` (parameters, ``to``, ``eval``, ``state_dict``, hooks): the
    base class of the package's models (:class:`~unifusion.DiffusionLM`,
    :class:`~unifusion.hf.diffusion_gemma.model.DiffusionGemmaLM`) and the type of a function that needs both faces (the
    evaluation harness moves, evaluates and calls its model). Calling it runs ``torch.nn.Module.__call__`` (hooks,
    then :meth:`~Denoiser.forward`). Abstract: a subclass implements :class:`Denoiser`'s members."""


@overload
def unwrap_model(model: torch.nn.Module) -> torch.nn.Module: ...
@overload
def unwrap_model(model: X0Model) -> X0Model: ...
@overload
def unwrap_model(model: object) -> object: ...
def unwrap_model(model: object) -> object:
    """The module inside DDP / FSDP / DeepSpeed (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers (at
    most four levels), else ``model`` itself: a module for a module, an x0 callable for an x0 callable; any other
    object (a :class:`BlockDenoiser`, say) is returned as it is unless it has such an attribute."""
    inner = model
    for _ in range(4):
        nxt = getattr(inner, "module", None) or getattr(inner, "_orig_mod", None)
        if nxt is None:
            break
        inner = nxt
    return inner


def denoiser_of(model: X0Model) -> Denoiser | None:
    """The :class:`Denoiser` ``model`` is, or holds inside its DDP / FSDP / DeepSpeed / ``torch.compile`` wrappers
    (:func:`unwrap_model`); ``None`` for any other x0 callable (a plain function, an ``x0_model_as`` head)."""
    inner = unwrap_model(model)
    return inner if isinstance(inner, Denoiser) else None


def prompt_conditioning(model: X0Model, x0: torch.Tensor, prompt_mask: torch.Tensor | None) -> dict[str, Any]:
    """The keyword arguments that condition ``model`` on the clean prompt ``x0[prompt_mask]``, for a call
    ``model(x_t, t, **prompt_conditioning(model, x0, prompt_mask))`` whose ``x_t`` holds the prompt clean.

    ``{}`` without a prompt, and for a model that reads its prompt from ``x_t`` (a :class:`~unifusion.DiffusionLM` or
    any x0 callable: the clean prompt tokens are simply there). ``{"prompt_mask": prompt_mask, "x0": x0}`` for a
    model (inside any DDP/FSDP/compile wrapper) that declares :attr:`Denoiser.conditions_on_prompt` — it encodes the
    prompt, and reads the clean prefix of each canvas, separately.

    Args:
        model: the model (or its wrapper) about to be called.
        x0: clean tokens ``(B, L)`` of the call's rows.
        prompt_mask: ``(B, L)`` bool, True on the prompt, or ``None``.

    A model that conditions on a prompt and is given none cannot predict: a ``ValueError`` naming ``prompt_mask``.
    """
    if not getattr(unwrap_model(model), "conditions_on_prompt", False):
        return {}
    if prompt_mask is None:
        raise ValueError(f"prompt_mask: {type(unwrap_model(model)).__name__} conditions on a clean prompt it encodes "
                         "separately; pass prompt_mask ((B, L) bool, True on the prompt)")
    return {"prompt_mask": prompt_mask, "x0": x0}


class ConvertedHead:
    """Base class of wrappers that call an x0 model and return another parameterization's head
    (:func:`unifusion.samplers.x0_model_as` builds them).

    Subclasses hold ``model`` (the x0 model they call), ``kernel`` (the kernel their conversions use) and
    ``parameterization`` (``"x0"``, ``"sedd"``, ``"m2s"`` or ``"ctmc"``), so that the checks of the samplers and
    evaluators can look through them to the model inside.
    """

    model: X0Model
    kernel: Any
    parameterization: str
