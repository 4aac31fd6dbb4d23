"""What the released diffusion LMs (LLaDA, Dream, ...) share: a transformers backbone run bidirectionally, a mask
token, and their checkpoint folders read and written in their own layout.

A released diffusion LM is a decoder-only transformer trained as an x0 predictor under absorbing noise: the input is
``x_t`` with masked positions set to the mask token ``m``, the output the clean-token logits. Its architecture is one
transformers already has (LLaDA's is Llama's, Dream's is Qwen2's) with two changes: attention is bidirectional, and
the logits may be **shifted** (Dream keeps the AR head: the logits at column ``i − 1`` predict token ``i``) or not
(LLaDA: column ``i`` predicts token ``i``). :class:`NativeDiffusionLM` is that model as a unifusion
:class:`~unifusion.denoiser.Denoiser`: it holds the transformers ``*ForCausalLM`` (``hf_model``) and reads

    x_θ(· | x_t)_i = softmax(W h_{s(i)}),   s(i) = i (unshifted),   s(i) = max(i − 1, first_i) (shifted),

where ``h`` are the backbone's final hidden states with full attention over the real tokens (padded keys masked,
every query sees every real key) and ``first_i`` the row's first real column (the first token has no predecessor;
Dream's own generate reads column 0 for column 0). Position ids are the column index, or — for a kind that says so
(Dream, :attr:`NativeDiffusionLM.positions_count_real_tokens`) — the count of real tokens before the column, which
is what its own generate passes for left-padded prompts.

The kind's folder (``unifusion/hf/<kind>/``) subclasses it with its conventions (``model_type``, mask id, shift,
positions) and its mapping onto the transformers architecture (:meth:`NativeDiffusionLM.backbone_config`,
:meth:`NativeDiffusionLM.weight_names`); the checkpoint folder is read lazily from its safetensors shards and
written back in the kind's own layout (:mod:`unifusion.hf.native_checkpoint`).

**Training objective.** Under :class:`~unifusion.MaskKernel` with the linear schedule (α_t = 1 − t, the default
kernel), the ELBO is ``E_t E_{x_t} [(1/t) Σ_{i masked} −log x_θ(x0_i | x_t)_i]`` — the MDLM loss, LLaDA's
pre-training and SFT loss (``uf.diffusion_loss(model, x0, model.kernel, objective="mdlm")``; ``"gidd"`` with ELBO
weights gives the same value, Corollary 3.4; Dream's own fine-tuning reweights it, :mod:`unifusion.hf.dream.model`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from .. import _validation as V
from ..block_partition import expand_block_times, num_blocks
from ..denoiser import DenoiserModule
from ..kernels import MaskKernel, check_kernel
from ..losses.fused_linear import fused_linear_diffusion_loss
from ..samplers import generation
from .ar.attention import AttentionPattern, select_strategy
from .ar.blocks import block_times
from .ar.families import family_for
from .backbone import BackboneMethods
from .checkpoint import CheckpointMixin
from .native_block import BlockCausalPattern, DoubledStreamPattern, NativeBlockCache
from .native_checkpoint import WeightTarget, build_backbone, load_weights, read_source_config, save_weights
from .native_decoding import NativePrefixCache

__all__ = ["GENERATION_CONFIG_NAME", "KeyPaddingPattern", "NativeDiffusionLM"]

GENERATION_CONFIG_NAME = "generation_config.json"
"""The generation defaults of a checkpoint folder (Dream's loader requires the file)."""


class KeyPaddingPattern(AttentionPattern):
    """Full attention over the real tokens: query ``i`` may attend key ``j`` iff ``j`` is real (``key_valid``), for
    every ``i`` — padded queries too, so no row is empty (LLaDA adds ``finfo.min`` at padded keys, which is this).
    Without padding the pattern is full and needs no mask."""

    def __init__(self, batch_size: int, length: int, key_valid: torch.Tensor | None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(batch_size, length, device)
        self.key_valid = key_valid

    @property
    def is_full(self) -> bool:
        return self.key_valid is None

    def mask_reason(self) -> str | None:
        return None if self.key_valid is None else "padding: attention_mask"

    def allowed(self) -> torch.Tensor:
        n = self.length
        if self.key_valid is None:
            return torch.ones((self.batch_size, 1, n, n), dtype=torch.bool, device=self.device)
        return self.key_valid[:, None, None, :].expand(self.batch_size, 1, n, n)


def _row_times(t: Any, x_t: torch.Tensor) -> torch.Tensor:
    """One time per row ``(B,)`` (a float, 0-d, ``(B,)`` or ``(B, 1)``), checked by the package's time rule."""
    B, L = x_t.shape
    t_ = V.check_time("t", t, device=x_t.device, shape=(B, L))
    if t_.dim() > 2 or (t_.dim() == 2 and t_.shape[1] != 1) or t_.numel() not in (1, B):
        raise ValueError(f"t: the model takes one time per sequence: a float, shape ({B},) or ({B}, 1), got shape "
                         f"{tuple(t_.shape)}")
    return t_.reshape(-1).expand(B) if t_.numel() == 1 else t_.reshape(B)


class NativeDiffusionLM(CheckpointMixin, BackboneMethods, DenoiserModule, abstract=True):
    """A released diffusion LM on a transformers backbone, as an x0 denoiser over its ``V`` tokens (module docstring).

    A kind subclasses it with its class attributes and the two mapping hooks; build one with the kind's
    ``from_pretrained(folder)`` (their checkpoint folder, or one :meth:`save_pretrained` wrote) or
    ``from_source(config, backbone)``.

    Attributes:
        hf_model: the transformers ``*ForCausalLM`` (``.model`` the decoder, ``.lm_head`` the head).
        source_config: the kind's own ``config.json`` as a dict (what :meth:`save_pretrained` writes back).
        mask_token_id: the mask token ``m`` (the config's ``mask_token_id``).
        kernel: :class:`~unifusion.MaskKernel` ``(V, m)`` with the linear schedule unless set.
        tokenizer: a Hugging Face tokenizer or ``None``.
    """

    model_type: ClassVar[str] = ""
    """The kind's ``config.json`` ``model_type``."""
    default_mask_token_id: ClassVar[int] = -1
    """The released checkpoints' mask id (used when the config names none)."""
    shifted: ClassVar[bool] = False
    """Whether column ``i − 1``'s logits predict token ``i`` (Dream) rather than column ``i``'s (LLaDA)."""
    positions_count_real_tokens: ClassVar[bool] = False
    """Whether position ids count the real tokens before a column (Dream's generate) rather than the columns."""
    backbone_family: ClassVar[str] = "llama"
    """The transformers family of the backbone (:func:`unifusion.hf.family_for`: how it takes attention masks)."""
    default_block_size: ClassVar[int | None] = None
    """A block kind's block size when its config names none (``None``: a bidirectional kind, no blocks)."""

    hf_model: Any  # a transformers *ForCausalLM (its methods are not typed through nn.Module)
    config: Any  # the backbone's PretrainedConfig

    def __init__(self, backbone: nn.Module, source_config: dict[str, Any], *, tokenizer: Any = None,
                 kernel: Any = None) -> None:
        super().__init__()
        self.hf_model = backbone
        self.config = backbone.config
        self.source_config = dict(source_config)
        self.generation_source: dict[str, Any] | None = None  # the folder's generation_config.json, written back
        self.mask_token_id: int | None = self.mask_id_of(self.source_config, self.vocab_size)
        self.block_size: int | None = self.block_size_of(self.source_config)
        if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
            raise TypeError(f"tokenizer: expected a Hugging Face tokenizer (with save_pretrained), got "
                            f"{type(tokenizer).__name__}")
        tokenizer_mask = getattr(tokenizer, "mask_token_id", None)
        if tokenizer_mask is not None and tokenizer_mask != self.mask_token_id:
            raise ValueError(f"tokenizer: its mask token is id {tokenizer_mask}, the checkpoint's config says mask "
                             f"id {self.mask_token_id}; pass the tokenizer saved with this checkpoint")
        self.tokenizer: Any = tokenizer
        if kernel is not None:
            V.check_model_kernel(self, check_kernel(kernel))
        self.kernel: Any = kernel if kernel is not None else MaskKernel(self.vocab_size, self.mask_token_id)

    # -- the kind's hooks -------------------------------------------------------------------------------------------

    @property
    def generation_config(self) -> Any:
        """The backbone's ``transformers.GenerationConfig`` (what TRL's trainers read of a model, and
        ``generate(..., generation_config=model.generation_config)`` takes)."""
        return getattr(self.hf_model, "generation_config", None)

    def backbone(self) -> Any:
        """The transformers ``*ForCausalLM`` (:attr:`hf_model`) that the trainer-facing methods of
        :class:`~unifusion.hf.backbone.BackboneMethods` (gradient checkpointing, input embeddings, ...) act on."""
        return self.hf_model

    @classmethod
    def backbone_config(cls, source: dict[str, Any]) -> Any:
        """The transformers ``PretrainedConfig`` of the backbone for the kind's ``config.json`` ``source``;
        ``ValueError`` naming any setting the backbone cannot reproduce."""
        raise NotImplementedError(f"{cls.__name__} does not say how its config maps onto transformers")

    @classmethod
    def backbone_class(cls) -> type[nn.Module]:
        """The transformers ``*ForCausalLM`` class of the backbone."""
        raise NotImplementedError(f"{cls.__name__} does not name its backbone class")

    @classmethod
    def weight_names(cls, source: dict[str, Any]) -> Mapping[str, WeightTarget]:
        """Every weight of a checkpoint of config ``source``: ``{their name: the backbone's parameter name}`` (or a
        :class:`~unifusion.hf.native_checkpoint.ParameterPart` of one, for fused expert tensors)."""
        raise NotImplementedError(f"{cls.__name__} does not map its weight names")

    @classmethod
    def mask_id_of(cls, source: dict[str, Any], vocab_size: int) -> int:
        """The mask id the config ``source`` names (else :attr:`default_mask_token_id`), checked against the
        vocabulary."""
        mask = source.get("mask_token_id", cls.default_mask_token_id)
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab_size:
            raise ValueError(f"config.json: mask_token_id = {mask!r} is not a token id of the {vocab_size}-token "
                             f"vocabulary ({cls.model_type})")
        return mask

    @classmethod
    def block_size_of(cls, source: dict[str, Any]) -> int | None:
        """A block kind's block size K (the config's ``block_size``, else :attr:`default_block_size`); ``None`` for a
        bidirectional kind. ``ValueError`` for a value that is not a positive int."""
        if cls.default_block_size is None:
            return None
        K = source.get("block_size", cls.default_block_size)
        if isinstance(K, bool) or not isinstance(K, int) or K < 1:
            raise ValueError(f"config.json: block_size = {K!r} is not a positive int ({cls.model_type})")
        return K

    # -- what the library reads ------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Token ids the model reads and logit columns it writes (``V = S``)."""
        return int(self.hf_model.lm_head.out_features)

    @property
    def num_states(self) -> int:
        """The kernels' state-space size ``S`` (equals :attr:`vocab_size`; the mask token is one of them)."""
        return self.vocab_size

    @property
    def device(self) -> torch.device:
        """Device of the weights (where ``x_t`` must live)."""
        return self.lm_head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Floating dtype of the weights."""
        return self.lm_head_weight.dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output embedding ``W`` ``(V, d)``."""
        return self.hf_model.lm_head.weight

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """``W h``: logits ``(..., V)`` of final hidden states ``(..., d)`` (in the weights' dtype, as the reference
        ``forward``)."""
        return F.linear(h, self.lm_head_weight)

    # -- the forward pass ------------------------------------------------------------------------------------------

    def position_ids(self, valid: torch.Tensor | None) -> torch.Tensor | None:
        """The backbone's position ids ``(B, L)`` for the real-token mask ``valid`` ``(B, L)`` (``None``: the column
        index, transformers' default): the count of real tokens before each column for a kind that says so (Dream's
        ``tok_idx``; pads at 1), else ``None``."""
        if valid is None or not self.positions_count_real_tokens:
            return None
        return (valid.long().cumsum(-1) - 1).masked_fill(~valid, 1)

    def x0_sources(self, valid: torch.Tensor | None, batch_size: int, length: int,
                   device: torch.device) -> torch.Tensor | None:
        """The column whose hidden state predicts each column ``(B, L)`` int64: ``max(i − 1, first real column)`` for
        a shifted kind, ``None`` (column i itself) for an unshifted one."""
        if not self.shifted:
            return None
        source = (torch.arange(length, device=device) - 1).expand(batch_size, length)
        first = torch.zeros(batch_size, 1, dtype=torch.long, device=device) if valid is None else \
            valid.long().argmax(-1, keepdim=True)
        return torch.maximum(source, first)

    def backbone_hidden(self, x_t: torch.Tensor, valid: torch.Tensor | None, *, use_cache: bool = False,
                        clean: torch.Tensor | None = None) -> Any:
        """The backbone's output on ``x_t`` ``(B, L)`` with the kind's attention over the real tokens ``valid``
        ``(B, L)`` (``None``: all real) and its position ids: ``last_hidden_state`` ``(B, L, d)`` and, with
        ``use_cache``, ``cache`` (a transformers ``DynamicCache``). A bidirectional kind attends fully; a block kind
        block-causally (:class:`~unifusion.hf.native_block.BlockCausalPattern`), or — given the clean tokens
        ``clean`` ``(B, L)`` — over the ``[x_t | clean]`` training stream
        (:class:`~unifusion.hf.native_block.DoubledStreamPattern`): ``last_hidden_state`` ``(B, 2L, d)``, the noisy
        half then the clean one."""
        B, L = x_t.shape
        pattern: AttentionPattern
        position_ids = self.position_ids(valid)
        if self.block_size is None:
            if clean is not None:
                raise ValueError(f"clean: {type(self).__name__} is bidirectional (no blocks); clean= is the block "
                                 "kinds' training stream")
            pattern = KeyPaddingPattern(B, L, valid, device=x_t.device)
        elif clean is None:
            pattern = BlockCausalPattern(B, L, self.block_size, valid, device=x_t.device)
        else:
            pattern = DoubledStreamPattern(B, L, self.block_size, valid, device=x_t.device)
            x_t = torch.cat([x_t, clean], 1)
            base = torch.arange(L, device=x_t.device).expand(B, L) if position_ids is None else position_ids
            position_ids = base.repeat(1, 2)
        strategy = select_strategy(family_for(self.backbone_family), self.config, pattern, dtype=self.dtype)
        return self.hf_model.model(input_ids=x_t, position_ids=position_ids, use_cache=use_cache,
                                   **strategy.kwargs(pattern))

    def hidden_states(self, x_t: torch.Tensor, t: Any = None, *, attention_mask: torch.Tensor | None = None,
                      clean: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states read by each column's x0 prediction ``(B, L, d)``: the backbone's
        (:meth:`backbone_hidden`; ``clean``: a block kind's training stream), shifted one column right for a shifted
        kind (module docstring). In the training stream a shifted block kind reads a block's first column at the
        **clean** stream's previous column (the prediction then sees only the clean blocks before it, as at decoding),
        every other column at the noisy stream's. ``t`` is not read (the models take no time)."""
        B, L = x_t.shape
        valid = None if attention_mask is None else attention_mask.to(x_t.device, torch.bool)
        h = self.backbone_hidden(x_t, valid, clean=clean).last_hidden_state
        source = self.x0_sources(valid, B, L, x_t.device)
        if clean is not None and source is not None and self.block_size is not None:
            cols = torch.arange(L, device=x_t.device)
            starts = (cols % self.block_size == 0) & (source < cols)  # a block's first column, not a row's first
            source = torch.where(starts, source + L, source)
        if source is None:
            return h[:, :L]
        return h.gather(1, source.unsqueeze(-1).expand(B, L, h.shape[-1]))

    def prefix_decoder(self, seq_len: int, refresh: int) -> NativePrefixCache | None:
        """Fast-dLLM's approximate dual cache (:class:`~unifusion.hf.native_decoding.NativePrefixCache`):
        ``generate(..., policy=..., cache_refresh=refresh)``; ``refresh=1`` gives the uncached tokens. ``None`` for a
        block kind (its cache is exact: :meth:`block_decoder`)."""
        return None if self.block_size is not None else NativePrefixCache(self, seq_len, refresh)

    def block_conditioning(self, x0: torch.Tensor) -> dict[str, Any]:
        """``{"clean": x0}`` on a block kind (:meth:`forward`'s ``clean``: the ``[x_t | x_0]`` block-causal stream of
        :class:`~unifusion.hf.native_block.DoubledStreamPattern`), ``{}`` on a bidirectional one
        (:meth:`Denoiser.block_conditioning <unifusion.denoiser.Denoiser.block_conditioning>`)."""
        return {} if self.block_size is None else {"clean": x0}

    def block_decoder(self, *, merge_commits: bool = False) -> NativeBlockCache | None:
        """A block kind's exact block KV cache (:class:`~unifusion.hf.native_block.NativeBlockCache`), what
        ``generate(..., use_cache=True)`` decodes through; ``None`` for a bidirectional kind."""
        return None if self.block_size is None else NativeBlockCache(self, merge_commits=merge_commits)

    def block_forward(self) -> NativeDiffusionLM | None:
        """A block kind as the uncached block decoder's x0 callable: the model itself (its one-stream block-causal
        forward over the tokens decided so far; a block sees the committed blocks before it). ``None`` for a
        bidirectional kind."""
        return None if self.block_size is None else self

    def forward(self, x_t: torch.Tensor, t: Any = None, *, attention_mask: torch.Tensor | None = None,
                bidirectional_prob: float = 1.0, generator: torch.Generator | None = None,
                x0: torch.Tensor | None = None, kernel: Any = None,
                objective: Literal["gidd", "mdlm", "sedd", "m2s", "ctmc"] = "gidd",
                weighting: Literal["elbo", "clip", "dynamic"] = "elbo", max_weight: float = 2.0,
                reduction: Literal["none", "sum", "mean"] = "none",
                position_weight: torch.Tensor | None = None, clean: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None,
                head_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """x0 logits ``(B, L, V)`` of ``x_t``, or — given ``x0`` and ``kernel`` — the fused per-position loss, or —
        given ``head_fn`` — ``head_fn(h)`` of the final hidden states.

        Args:
            x_t: ``(B, L)`` int64 tokens, masked positions holding :attr:`mask_token_id`.
            t: times, one per row (a float, ``(B,)`` or ``(B, 1)``), or for a block kind one per block ``(B, nb)``:
                checked, read only by the fused loss (the model has no time input).
            attention_mask: optional ``(B, L)``, 1 = real token (left or right padding): padded keys are masked.
            bidirectional_prob: ``1`` (these models are bidirectional by training; annealing does not apply).
            generator: accepted for the interface (the forward draws nothing).
            x0: clean tokens ``(B, L)``; with ``kernel`` the fused loss is returned.
            kernel: the fused loss's kernel (:func:`unifusion.losses.fused_linear_diffusion_loss`).
            objective: the fused loss's objective.
            weighting: the fused loss's weighting.
            max_weight: the fused loss's weight clip.
            reduction: the fused loss's reduction.
            position_weight: ``(B, L)`` weights of the fused loss (times the attention mask).
            clean: a block kind's clean tokens ``(B, L)``: the ``[x_t | clean]`` training stream (each block's
                prediction sees the clean blocks before it), what ``diffusion_loss`` and ``sequence_logprob`` pass.
            document_ids: refused (``ValueError``): packed documents are not supported by the released kinds yet
                (train one document per row, right-padded).
            head_fn: in place of the output head: the call returns ``head_fn(h)``, ``h`` the ``(B, L, d)`` final
                hidden states :meth:`hidden_states` gives for the same arguments. A loss that reads hidden states and
                the head's weights (the fused certainty forcing of :mod:`unifusion.distill`) runs this way inside the
                module's call, so that DDP / FSDP2 / DeepSpeed hooks fire. Not with ``x0`` / ``kernel``.

        Returns:
            ``(B, L, V)`` logits in the weights' dtype, the ``(B, L)`` float32 loss (0 at padding), or what
            ``head_fn`` returns.
        """
        V.check_generator(generator)
        V.check_head_fn(head_fn, x0, kernel)
        if document_ids is not None:
            raise ValueError(f"document_ids: {type(self).__name__} does not take packed documents (its attention "
                             "would have to be cut per document); train one document per row, right-padded")
        if bidirectional_prob != 1.0:
            raise ValueError(f"bidirectional_prob: {type(self).__name__} is bidirectional by training; expected 1.0, "
                             f"got {bidirectional_prob!r} (attention annealing does not apply)")
        if kernel is not None and x0 is None:
            raise ValueError("x0, kernel: the fused loss needs both (kernel alone is not enough)")
        x_t = V.check_token_batch("x_t", x_t)
        B, L = x_t.shape
        V.check_model_device(self, "x_t", x_t)
        with V.batched_checks():
            x_t = V.check_token_ids("x_t", x_t, self.vocab_size)
            if attention_mask is not None:
                attention_mask = V.check_tensor("attention_mask", attention_mask)
                if tuple(attention_mask.shape) != (B, L):
                    raise ValueError(f"attention_mask: expected shape {(B, L)} like x_t, got "
                                     f"{tuple(attention_mask.shape)}")
            if x0 is not None:
                if not isinstance(x0, torch.Tensor) or tuple(x0.shape) != (B, L):
                    got = tuple(x0.shape) if isinstance(x0, torch.Tensor) else type(x0).__name__
                    raise ValueError(f"x0: expected clean tokens of shape {(B, L)} like x_t, got {got}")
                x0 = V.check_token_ids("x0", x0, self.vocab_size)
            if clean is not None:
                if not isinstance(clean, torch.Tensor) or tuple(clean.shape) != (B, L):
                    got = tuple(clean.shape) if isinstance(clean, torch.Tensor) else type(clean).__name__
                    raise ValueError(f"clean: expected clean tokens of shape {(B, L)} like x_t, got {got}")
                clean = V.check_token_ids("clean", clean, self.vocab_size)
        t_pos = None
        if t is not None:
            if self.block_size is None:
                t_pos = _row_times(t, x_t)[:, None].expand(B, L)
            else:
                t_pos = expand_block_times(block_times(t, B, num_blocks(L, self.block_size), x_t.device), L,
                                           self.block_size)
        h = self.hidden_states(x_t, attention_mask=attention_mask, clean=clean)
        if head_fn is not None:
            return head_fn(h)
        if kernel is None:
            return self.logits_from_hidden(h)
        V.check_model_kernel(self, check_kernel(kernel))
        if t_pos is None:
            raise ValueError("t: the fused loss needs the times (one per row)")
        assert x0 is not None
        weight = position_weight
        if attention_mask is not None:
            valid = attention_mask.to(h.device, torch.bool)
            weight = valid.float() if weight is None else weight * valid
        return fused_linear_diffusion_loss(
            h, self.lm_head_weight, x0, x_t, t_pos, kernel, objective=objective,
            weighting=weighting, max_weight=max_weight, reduction=reduction, position_weight=weight)

    def generate(self, prompt_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Continue ``prompt_ids`` ``(B, P)`` with :func:`unifusion.samplers.generate` (every policy; keyword
        arguments as there). LLaDA's ``generate.py`` (``block_length`` blocks of ``steps / num_blocks`` steps) is
        ``policy=LLaDAOrder(remasking), block_size=block_length, num_steps=steps // num_blocks, eos_token_id=None``
        with ``do_sample=False`` (its ``temperature=0``) or ``temperature=T``, and ``cfg_scale=w``; the released
        models' other samplers are the policies of :mod:`unifusion.samplers.policies.reference`."""
        return generation.generate(self, prompt_ids, *args, **kwargs)

    # -- checkpoints -----------------------------------------------------------------------------------------------

    checkpoint_keys: ClassVar[frozenset[str]] = frozenset({"model_type", "mask_token_id", "block_size"})

    def checkpoint_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"model_type": self.model_type, "mask_token_id": self.mask_token_id}
        if self.block_size is not None:
            record["block_size"] = self.block_size
        return record

    def save_checkpoint_files(self, path: Path) -> None:
        """Write the kind's own folder: its ``config.json`` (:attr:`source_config`, ``torch_dtype`` the weights'
        dtype), the weights under its names, and ``generation_config.json`` (the folder's own when loaded from one, else
        its special token ids), so that its own modeling code loads them."""
        save_weights(self.hf_model, self.source_config, self.weight_names(self.source_config), path)
        generation = self.generation_source or {
            "_from_model_config": True,
            **{k: self.source_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if self.source_config.get(k) is not None}}
        (path / GENERATION_CONFIG_NAME).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n",
                                                   encoding="utf-8")

    @classmethod
    def load_checkpoint(cls, path: Path, record: dict[str, Any] | None,
                        dtype: torch.dtype | str | None) -> NativeDiffusionLM:
        source = read_source_config(path, cls.model_type)
        config = cls.backbone_config(source)
        mask = cls.mask_id_of(source, int(config.vocab_size))
        if record is not None:
            for key, expected in (("model_type", cls.model_type), ("mask_token_id", mask),
                                  ("block_size", cls.block_size_of(source))):
                if key in record and record[key] != expected:
                    raise ValueError(f"directory: {str(path)!r} contradicts itself: unifusion_config.json has "
                                     f"{key} = {record[key]!r}, config.json {expected!r}")
        backbone = load_weights(cls.backbone_class(), config, cls.weight_names(source), path, dtype)
        model = cls(backbone, source)
        generation = path / GENERATION_CONFIG_NAME
        if generation.is_file():
            model.generation_source = json.loads(generation.read_text(encoding="utf-8"))
        return model

    @classmethod
    def from_source(cls, source: dict[str, Any], backbone: nn.Module | None = None, **kwargs: Any
                    ) -> NativeDiffusionLM:
        """The model of the kind's config ``source`` (a ``config.json`` dict) on ``backbone`` (default a new one with
        transformers' random initialisation); ``kwargs`` (``tokenizer=``, ``kernel=``) go to the constructor."""
        if source.get("model_type") != cls.model_type:
            raise ValueError(f"source: expected a {cls.model_type!r} config (model_type), got "
                             f"{source.get('model_type')!r}")
        if backbone is None:
            backbone = cls.backbone_class()(cls.backbone_config(source))
        return cls(backbone, source, **kwargs)

    @classmethod
    def from_reference(cls, model: nn.Module, **kwargs: Any) -> NativeDiffusionLM:
        """The kind's own ``trust_remote_code`` model (its ``config.model_type`` is :attr:`model_type`) as this class:
        a backbone built from its config whose parameters are its tensors (shared, not copied); ``kwargs``
        (``tokenizer=``, ``kernel=``) go to the constructor. What :func:`unifusion.hf.wrap_diffusion_lm` calls.

        Raises:
            ValueError: another model type, or weights that do not match the config (naming them).
        """
        config = getattr(model, "config", None)
        if config is None or getattr(config, "model_type", None) != cls.model_type:
            raise ValueError(f"model: expected a {cls.model_type!r} model (config.model_type), got "
                             f"{type(model).__name__} with model_type {getattr(config, 'model_type', None)!r}")
        source = config.to_dict()
        source["model_type"] = cls.model_type
        state = model.state_dict()
        names = cls.weight_names(source)
        mapped = {state[k].data_ptr() for k in state if k in names}
        aliases = {k for k in state if k not in names and state[k].data_ptr() in mapped}  # tied weights' second name
        backbone = build_backbone(cls.backbone_class(), cls.backbone_config(source), names,
                                  ((k, functools.partial(state.__getitem__, k)) for k in state if k not in aliases),
                                  None, type(model).__name__)
        return cls(backbone, source, **kwargs)
