"""A pretrained autoregressive (AR) causal LM as an x0-predicting diffusion model: :class:`DiffusionLM`.

Implements paper §3.2 ("AR as the x0 model") and App. C.5 (Algorithm 1).

**AR as the x0 model.** After a one-position shift, the AR next-token distribution for ``x^i`` given
``x^{<i}`` is used as the clean-token prediction ``x_θ^i(· | x_t, t)``. :class:`DiffusionLM` prepends a BOS
token, runs the network on ``[BOS, x_t^1, ..., x_t^L]`` (length ``L + 1``, :mod:`unifusion.hf.ar.layout`) and keeps
outputs ``0 .. L − 1``: the prediction for position ``i`` is the network output at position ``i − 1`` (BOS for
``i = 1``). With causal attention and a clean input, the logits are exactly the base model's next-token logits after
``[BOS, x^1 .. x^{i−1}]``. The output head runs on the ``L`` kept positions only, as the family's own ``forward``
computes it (:mod:`unifusion.hf.ar.head`).

**Attention** follows the annealed pattern of :mod:`unifusion.hf.ar.attention` (``bidirectional_prob = γ``; inference
uses ``γ = 1``). The BOS row is an ordinary row (its output predicts ``x^1``, so it must see the sequence when
bidirectional); the BOS column is visible to every real query, since ``0 ≤ i``. A fully bidirectional call without
padding or an active sliding window builds no mask (``is_causal=False``); :meth:`DiffusionLM.attention_path` tells
which path a call takes.

**Padding** (``attention_mask``, 1 = real token) must be contiguous: right padding or left padding; a padded row
equals the unpadded one on its real positions (:mod:`unifusion.hf.ar.layout`).

Example::

    import unifusion as uf
    model = uf.adapt_ar_model(hf_model)                   # wraps, does not copy
    logits = model(x_t, t, bidirectional_prob=uf.hf.anneal_schedule(step, 5000))   # (B, L, V)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ... import _validation as V
from ...denoiser import DenoiserModule
from ...kernels import check_kernel
from ...losses.fused_linear import fused_linear_diffusion_loss
from ..backbone import BackboneMethods
from ..checkpoint import CheckpointMixin
from . import attention, blocks, head, io
from .attention import AnnealedPattern, AttentionPath, AttentionPattern, AttentionStrategy, select_strategy
from .decoding import DecodingMethods
from .families import Family, family_for, unwrap_peft
from .layout import shifted_layout
from .time_embedding import TimeEmbedding

__all__ = ["DiffusionLM", "unwrap_peft"]


class DiffusionLM(CheckpointMixin, BackboneMethods, DecodingMethods, DenoiserModule):
    """An AR causal LM used as a shifted x0 predictor ``x_θ(· | x_t, t)`` with annealable bidirectional attention.

    Build it with :func:`~unifusion.hf.adapt_ar_model`. The wrapped model is held, not copied: ``model.base_model`` is
    the object you passed in (training the wrapper trains it).

    Attributes:
        base_model: the wrapped Hugging Face model (or peft model).
        bos_token_id: the token prepended internally.
        mask_token_id: the absorbing-state token for mask/hybrid kernels (``None`` when the model was adapted with
            ``add_mask_token=False`` for uniform noise only).
        vocab_size: number of input ids / logit columns (including an added mask token).
        num_states: same as ``vocab_size`` (the state-space size ``S`` of the kernels).
        family: the :class:`unifusion.hf.ar.families.Family` entry used.
        tokenizer: the tokenizer given to :func:`~unifusion.hf.adapt_ar_model` (or found by :meth:`from_pretrained`),
            or ``None``; a plain attribute (not part of the state dict), written by :meth:`save_pretrained`.
        kernel: the forward kernel the model was trained with, when known (set it, or pass ``kernel=`` to
            :meth:`save_pretrained`), else ``None``; recorded in the saved config and restored by
            :meth:`from_pretrained`. :meth:`generate` and ``unifusion sample``/``eval`` default to it
            (:func:`unifusion.hf.default_kernel`: else mask on the mask token, else uniform).
        dense_bidirectional_mask: ``False`` (default): fully bidirectional calls (``γ = 1``) without padding or an
            active sliding window pass no mask and run the attention with ``is_causal=False`` (see
            :meth:`attention_path`). ``True``: always pass the dense ``(B, 1, L + 1, L + 1)`` mask (the same
            outputs; for comparisons and debugging).
    """

    _hf: Any  # the Hugging Face *ForCausalLM (peft unwrapped); Any: its methods are not typed through nn.Module
    config: Any  # its PretrainedConfig

    def __init__(self, base_model: nn.Module, *, bos_token_id: int, mask_token_id: int | None,
                 time_conditioning: bool = False, added_mask_token: bool = False, tokenizer: Any = None,
                 block_size: int | None = None) -> None:
        super().__init__()
        # block diffusion (unifusion.hf.ar.blocks): None = one bidirectional block over the whole sequence
        self.block_size: int | None = blocks.check_block_size(block_size)
        self.tokenizer: Any = tokenizer
        self.kernel: Any = None  # the training kernel, when known (save_pretrained records it)
        self.dense_bidirectional_mask: bool = False
        self.base_model = base_model
        hf = unwrap_peft(base_model)
        object.__setattr__(self, "_hf", hf)  # not registered twice as a submodule
        self.config = hf.config
        self.family: Family = family_for(getattr(hf.config, "model_type", None))
        self.bos_token_id = int(bos_token_id)
        self.mask_token_id = None if mask_token_id is None else int(mask_token_id)
        self.added_mask_token = bool(added_mask_token)
        self.time_conditioning = bool(time_conditioning)
        if self.time_conditioning:
            emb = hf.get_input_embeddings().weight
            self.time_embedding: TimeEmbedding | None = TimeEmbedding(emb.shape[1]).to(emb.device, emb.dtype)
        else:
            self.time_embedding = None

    # -- properties ---------------------------------------------------------------------------------------------

    @property
    def hf_model(self) -> Any:
        """The Hugging Face ``*ForCausalLM`` the wrapper runs: :attr:`base_model`, or the model inside it when that is
        a peft model (its LoRA layers are injected in place). Typed ``Any``, as transformers' models type poorly."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model reads and logit columns it writes (``S``).

        Read from the output layer's declared size (``out_features`` / ``num_embeddings``), which stays right when
        the weight itself is a partitioned placeholder (DeepSpeed ZeRO-3).
        """
        head = self._hf.get_output_embeddings()
        declared = getattr(head, "out_features", None) or getattr(head, "num_embeddings", None)
        weight_rows = int(head.weight.shape[0])
        return int(declared) if declared and weight_rows in (0, declared) else weight_rows

    @property
    def generation_config(self) -> Any:
        """The backbone's ``transformers.GenerationConfig`` (``generation_config.json`` of a saved folder, else the
        one transformers derived from the config), for ``generate(..., generation_config=model.generation_config)``;
        ``None`` if the backbone has none."""
        return getattr(self._hf, "generation_config", None)

    @property
    def device(self) -> torch.device:
        """Device of the input embeddings (where ``x_t`` must live)."""
        return self._hf.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Floating dtype of the input embeddings (the weights' dtype)."""
        return self._hf.get_input_embeddings().weight.dtype

    @property
    def num_states(self) -> int:
        """The kernels' state-space size ``S`` (equals :attr:`vocab_size`)."""
        return self.vocab_size

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output embedding matrix ``(V, d)``; logits = :meth:`logits_from_hidden` of :meth:`hidden_states`."""
        return self._hf.get_output_embeddings().weight

    @property
    def lm_head_bias(self) -> torch.Tensor | None:
        """The output bias ``(V,)`` or ``None`` (phi has one)."""
        return getattr(self._hf.get_output_embeddings(), "bias", None)

    @property
    def logit_scale(self) -> float:
        """Multiplier the family applies to ``lm_head`` output (granite: 1/logits_scaling, cohere: logit_scale)."""
        return self.family.logit_scale(self.config)

    @property
    def final_logit_softcap(self) -> float | None:
        """Final logit soft-cap ``c`` (gemma2/3): logits = ``c · tanh(z / c)``; ``None`` when absent."""
        return self.family.softcap(self.config)

    # -- checks and the network's inputs ------------------------------------------------------------------------

    def _check(self, x_t: Any, t: Any, bidirectional_prob: Any, attention_mask: Any
               ) -> tuple[torch.Tensor, torch.Tensor | None, float | torch.Tensor, torch.Tensor | None]:
        x_t = V.check_token_batch("x_t", x_t)
        B, L = x_t.shape
        V.check_model_device(self, "x_t", x_t)
        # every value check in one host sync (none with validation off)
        with V.batched_checks():
            gamma = attention.check_bidirectional_prob(bidirectional_prob)  # a float, or a 0-d tensor (range queued)
            x_t = V.check_token_ids("x_t", x_t, self.vocab_size)
            if t is not None:
                t = V.check_sequence_times("t", t, (B, L), device=x_t.device)  # (B,)
            elif self.time_conditioning:
                raise ValueError("t: this model was adapted with time_conditioning=True and needs t of shape (B,), "
                                 "got None")
            if attention_mask is not None:
                if not isinstance(attention_mask, torch.Tensor):
                    raise TypeError(f"attention_mask: expected a ({B}, {L}) tensor, got "
                                    f"{type(attention_mask).__name__}")
                if attention_mask.shape != (B, L):
                    raise ValueError(f"attention_mask: expected shape ({B}, {L}) matching x_t, "
                                     f"got {tuple(attention_mask.shape)}")
                attention_mask = attention_mask.to(device=x_t.device, dtype=torch.bool)
                V.check_padding("attention_mask", attention_mask)
        return x_t, t, gamma, attention_mask

    def _strategy(self, pattern: AttentionPattern) -> AttentionStrategy:
        return select_strategy(self.family, self.config, pattern, force_dense=self.dense_bidirectional_mask,
                               dtype=self.dtype)

    def attention_path(self, length: int, bidirectional_prob: float | torch.Tensor = 1.0, *,
                       padded: bool = False) -> AttentionPath:
        """How a call on ``length`` tokens attends: ``"causal"``, ``"non_causal"``, ``"mask"`` or ``"block_mask"``.

        * ``"causal"``: γ = 0 without padding; the model's own causal (and windowed) attention, no mask from us.
        * ``"non_causal"``: γ = 1 without padding or an active sliding window, on a family that honours
          ``is_causal=False``; no mask tensor from us (SDPA ``attn_mask=None, is_causal=False``; flash-attention
          ``causal=False``; flex attention gets transformers' own all-visible block mask, which has no partial
          blocks).
        * ``"mask"``: everything else with SDPA or eager attention; the dense boolean/additive ``(B, 1, L + 1, L + 1)``
          mask of :func:`~unifusion.hf.annealed_attention_mask`.
        * ``"block_mask"``: everything else with flex attention (``attn_implementation="flex_attention"``): the same
          pattern as a ``torch.nn.attention.flex_attention.BlockMask`` (one per layer type with sliding windows).

        A 0-d tensor ``γ`` (the form for ``torch.compile``, :func:`~unifusion.hf.anneal_schedule`) always takes the
        mask path, whatever its value: its value is not read on the host.

        Args:
            length: ``L``, the number of tokens in ``x_t`` (the network runs ``L + 1`` positions).
            bidirectional_prob: ``γ`` in ``[0, 1]``, a float or a 0-d tensor.
            padded: whether an ``attention_mask`` is passed.

        Raises:
            ValueError: where the call itself would: the model runs flash attention (or another kernel that takes no
                mask) and the call needs a mask (annealing, padding, an active sliding window).
        """
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"length: expected a positive int, got {length!r}")
        if isinstance(bidirectional_prob, bool) or not isinstance(bidirectional_prob, (int, float, torch.Tensor)) \
                or (not isinstance(bidirectional_prob, torch.Tensor) and not 0.0 <= bidirectional_prob <= 1.0):
            raise ValueError(f"bidirectional_prob: expected a float in [0, 1], got {bidirectional_prob!r}")
        gamma = attention.check_bidirectional_prob(bidirectional_prob)
        key_valid = torch.ones((1, length + 1), dtype=torch.bool) if padded else None  # only "padded" is read
        pattern = AnnealedPattern(1, length + 1, gamma, key_valid=key_valid)
        return self._strategy(pattern).path

    def network_inputs(self, x_t: torch.Tensor, t: torch.Tensor | None = None, *,
                       bidirectional_prob: float | torch.Tensor = 1.0,
                       attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None
                       ) -> dict[str, Any]:
        """The keyword arguments :attr:`hf_model` gets for a call of :meth:`forward` with these arguments: the ids of
        ``[BOS, x_t]`` (``L + 1`` positions; ``inputs_embeds`` with the time embedding added when the model is time
        conditioned), ``position_ids`` with padding, ``use_cache=False`` and what :meth:`attention_path` passes
        (nothing, ``is_causal=False``, or ``attention_mask``). ``hf_model(**network_inputs(...)).logits[:, :-1]``
        equals ``forward(...)`` (same generator state)."""
        generator = V.check_generator(generator)
        x_t, t, gamma, attention_mask = self._check(x_t, t, bidirectional_prob, attention_mask)
        return self._network_inputs(x_t, t, gamma, attention_mask, generator)

    def _network_inputs(self, x_t: torch.Tensor, t: torch.Tensor | None, gamma: float | torch.Tensor,
                        attention_mask: torch.Tensor | None, generator: torch.Generator | None,
                        document_ids: torch.Tensor | None = None) -> dict[str, Any]:
        """:meth:`network_inputs` of checked arguments."""
        if document_ids is not None:
            raise ValueError(
                f"document_ids: packed documents need the block-causal forward (a block model, adapt_ar_model(..., "
                f"block_size=K), on rows longer than one block), got block_size={self.block_size} and length "
                f"{x_t.shape[1]}; a fully bidirectional model shares one BOS between the documents of a row")
        layout = shifted_layout(x_t, self.bos_token_id, gamma, attention_mask=attention_mask, generator=generator)
        kwargs: dict[str, Any] = {"use_cache": False}
        if layout.position_ids is not None:
            kwargs["position_ids"] = layout.position_ids
        if self.time_embedding is not None:
            assert t is not None
            h = self._hf.get_input_embeddings()(layout.input_ids)  # (B, L+1, d)
            kwargs["inputs_embeds"] = h + self.time_embedding(t)[:, None, :].to(h.dtype)
        else:
            kwargs["input_ids"] = layout.input_ids
        kwargs.update(self._strategy(layout.pattern).kwargs(layout.pattern))
        return kwargs

    # -- the forward pass ---------------------------------------------------------------------------------------

    def forward(self, x_t: torch.Tensor, t: torch.Tensor | None = None, *,
                bidirectional_prob: float | torch.Tensor = 1.0,
                attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
                x0: torch.Tensor | None = None, kernel: Any = None,
                objective: Literal["gidd", "mdlm", "sedd", "m2s", "ctmc"] = "gidd",
                weighting: Literal["elbo", "clip", "dynamic"] = "elbo", max_weight: float = 2.0,
                reduction: Literal["none", "sum", "mean"] = "none",
                position_weight: torch.Tensor | None = None, clean: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None,
                head_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """x0 logits ``x_θ(· | x_t, t)``, or — given ``x0`` and ``kernel`` — the fused per-position loss, or —
        given ``head_fn`` — ``head_fn(h)`` of the final hidden states.

        Args:
            x_t: ``(B, L)`` int64 noisy token ids.
            t: ``(B,)`` float times in ``(0, 1)``; required with time conditioning or a loss.
            bidirectional_prob: ``γ`` in ``[0, 1]`` (0 causal, 1 fully bidirectional; see
                :func:`~unifusion.hf.anneal_schedule`): a float, or a 0-d floating tensor, which is never read on the
                host (every call then draws the Bernoulli mask, exactly causal at 0 and full at 1): the form for a
                step under ``torch.compile``, where each new float would recompile the graph.
            attention_mask: optional ``(B, L)`` padding mask, 1 = real token (right or left padding).
            generator: random generator for the Bernoulli mask entries when ``0 < γ < 1``.
            x0: clean tokens ``(B, L)``; with ``kernel``, return the loss instead of the logits.
            kernel: the forward kernel of the loss.
            objective: x0-head objective (see :func:`unifusion.losses.x0_head_loss`).
            weighting: GIDD weighting of the loss.
            max_weight: clip of the GIDD weights.
            reduction: ``"none"`` (per-position loss times ``position_weight``), or ``"sum"``/``"mean"`` of the
                weighted loss (see :func:`unifusion.losses.fused_linear_diffusion_loss`).
            position_weight: ``(B, L)`` weights of the loss (e.g. the padding mask: padded positions then cost no
                gradient work); ones when ``None``.
            clean: block models only (:attr:`block_size`): the clean tokens x_0 ``(B, L)`` of the block-causal
                layout (:mod:`unifusion.hf.ar.blocks`); ``t`` may then be one time per block ``(B, nb)``. Required over
                more than one block unless ``γ = 0`` (the causal AR forward); with one block (``block_size >= L``)
                unused: the plain bidirectional forward.
            document_ids: block models with ``clean`` only: ``(B, L)`` int64, the document each token belongs to, for
                right-padded rows that pack several documents (:class:`~unifusion.ChatCollator` with
                ``packing=True`` gives them as ``conversation_ids``). A position then attends only to positions of
                its own document, each document gets its own BOS (in the clean-stream slot and anchor of its first
                column, :func:`unifusion.hf.ar.blocks.block_hidden_states`) and position ids restart at each document,
                so a document that starts at a block boundary is computed exactly as it would be alone; one that
                starts inside a block has its first token predicted at the previous document's last position (that
                token should be unscored). Anything else (a plain model, one block) is a ``ValueError``.
            head_fn: in place of the output head: the call returns ``head_fn(h)``, ``h`` the ``(B, L, d)`` final
                hidden states :meth:`hidden_states` gives for the same arguments (row ``i`` what the head reads for
                token ``i``). A loss that reads hidden states and the head's weights (the fused certainty forcing of
                :mod:`unifusion.distill`) runs this way inside the module's call, so that DDP / FSDP2 / DeepSpeed
                hooks fire and FSDP2's gathered weights are what it reads. Not with ``x0`` / ``kernel``.

        Returns:
            contiguous ``(B, L, V)`` logits (row ``i`` is the network output at position ``i − 1`` of
            ``[BOS, x_t]``; the output head runs on those ``L`` positions only), or with
            ``x0``/``kernel`` the ``(B, L)`` float32 loss of
            :func:`unifusion.losses.fused_linear_diffusion_loss`, computed from the hidden states without ever
            holding the ``(B, L, V)`` logits; with ``head_fn`` what it returns. Going through ``forward`` keeps
            DDP/FSDP/DeepSpeed hooks working.
        """
        generator = V.check_generator(generator)
        V.check_head_fn(head_fn, x0, kernel)
        if clean is None and self.block_size is not None and isinstance(x_t, torch.Tensor) and x_t.dim() == 2 \
                and x_t.shape[1] > self.block_size and not (isinstance(bidirectional_prob, float | int)
                                                            and bidirectional_prob == 0):  # causal: the AR model
            raise ValueError(f"clean: this block model (block_size={self.block_size}) predicts a block from the clean "
                             f"tokens before it; pass clean=x_0 ({tuple(x_t.shape)}, as diffusion_loss does), or "
                             "decode block by block (generate(policy=...), PolicySampler)")
        if document_ids is not None:
            document_ids = self._check_documents(document_ids, x_t)
        if clean is not None:  # block diffusion: the [clean | noisy] forward of unifusion.hf.ar.blocks
            routed = self._block_forward(x_t, t, bidirectional_prob, attention_mask, generator, clean, x0, kernel,
                                         objective, weighting, max_weight, reduction, position_weight, document_ids,
                                         head_fn)
            if routed is not None:
                return routed
        if x0 is not None or kernel is not None:
            if x0 is None or kernel is None or t is None:
                raise ValueError("x0, kernel, t: the fused loss needs all three (or none of x0/kernel for logits)")
            V.check_model_kernel(self, check_kernel(kernel))  # states and mask token (host metadata, no sync)
            x_t, t, gamma, attention_mask = self._check(x_t, t, bidirectional_prob, attention_mask)
            assert t is not None
            h = self._hidden(x_t, t, gamma, attention_mask, generator, document_ids)
            return fused_linear_diffusion_loss(
                h, self.lm_head_weight, x0, x_t, t[:, None].expand(x_t.shape), kernel, objective=objective,
                weighting=weighting, max_weight=max_weight, lm_head_bias=self.lm_head_bias,
                logit_scale=self.logit_scale, final_logit_softcap=self.final_logit_softcap, reduction=reduction,
                position_weight=position_weight)
        x_t, t, gamma, attention_mask = self._check(x_t, t, bidirectional_prob, attention_mask)
        if head_fn is not None:
            return head_fn(self._hidden(x_t, t, gamma, attention_mask, generator, document_ids))
        return head.kept_logits(self, self._network_inputs(x_t, t, gamma, attention_mask, generator, document_ids),
                                x_t.shape[1])

    @staticmethod
    def _check_documents(document_ids: object, x_t: object) -> torch.Tensor:
        """``document_ids`` as an int64 tensor of ``x_t``'s shape ``(B, L)`` on its device."""
        if not isinstance(document_ids, torch.Tensor) or document_ids.dtype.is_floating_point:
            got = document_ids.dtype if isinstance(document_ids, torch.Tensor) else type(document_ids).__name__
            raise TypeError(f"document_ids: expected a (B, L) integer tensor (one document id per token), got {got}")
        shape = tuple(x_t.shape) if isinstance(x_t, torch.Tensor) else None
        if tuple(document_ids.shape) != shape:
            raise ValueError(f"document_ids: expected shape {shape} like x_t, got {tuple(document_ids.shape)}")
        assert isinstance(x_t, torch.Tensor)
        return document_ids.to(device=x_t.device, dtype=torch.long)

    def _block_forward(self, x_t: Any, t: Any, bidirectional_prob: Any, attention_mask: Any,
                       generator: torch.Generator | None, clean: Any, x0: Any, kernel: Any, objective: Any,
                       weighting: Any, max_weight: float, reduction: Any, position_weight: Any,
                       document_ids: torch.Tensor | None = None,
                       head_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
        """The block-causal forward (logits, the fused loss on the noisy stream's predictions, or ``head_fn`` of its
        hidden states); ``None`` when the call is the plain one (one block)."""
        inputs = self._block_inputs(x_t, t, bidirectional_prob, attention_mask, clean)
        if inputs is None:
            return None
        x_t, t_blocks, gamma, attention_mask, clean = inputs
        L = x_t.shape[1]
        assert self.block_size is not None  # _block_inputs checked it
        if t_blocks is None and (x0 is not None or kernel is not None):
            raise ValueError("t: needed with time conditioning and for the fused loss, got None")
        if head_fn is not None:
            return head_fn(blocks.block_hidden_states(self, self.hf_model, x_t, t_blocks, clean, gamma, attention_mask,
                                                      generator, document_ids))
        if x0 is None and kernel is None:
            return blocks.block_logits(self, self.hf_model, x_t, t_blocks, clean, gamma, attention_mask, generator,
                                       document_ids)
        if x0 is None or kernel is None:
            raise ValueError("x0, kernel, t: the fused loss needs all three (or none of x0/kernel for logits)")
        V.check_model_kernel(self, check_kernel(kernel))
        assert t_blocks is not None
        h = blocks.block_hidden_states(self, self.hf_model, x_t, t_blocks, clean, gamma, attention_mask, generator,
                                       document_ids)
        return fused_linear_diffusion_loss(
            h, self.lm_head_weight, x0, x_t, blocks.expand_block_times(t_blocks, L, self.block_size), kernel,
            objective=objective, weighting=weighting, max_weight=max_weight, lm_head_bias=self.lm_head_bias,
            logit_scale=self.logit_scale, final_logit_softcap=self.final_logit_softcap, reduction=reduction,
            position_weight=position_weight)

    def _block_inputs(self, x_t: Any, t: Any, bidirectional_prob: Any, attention_mask: Any, clean: Any
                      ) -> tuple[torch.Tensor, torch.Tensor | None, float | torch.Tensor, torch.Tensor | None,
                                 torch.Tensor] | None:
        """The checked inputs of the block-causal forward ``(x_t, t_blocks (B, nb) or None, γ, attention_mask,
        clean)``; ``None`` when the call is the plain one (one block)."""
        if self.block_size is None:
            raise ValueError("clean: only a block model (adapt_ar_model(..., block_size=K)) takes clean tokens")
        if t is None and self.time_conditioning:
            raise ValueError("t: this model was adapted with time_conditioning=True and needs t, got None")
        # t is checked by blocks.block_times below (it may be one time per block): _check gets a placeholder
        x_t, _, gamma, attention_mask = self._check(x_t, None if t is None else 0.5, bidirectional_prob,
                                                    attention_mask)
        B, L = x_t.shape
        if self.block_size >= L:
            return None
        nb = blocks.num_blocks(L, self.block_size)
        with V.batched_checks():
            clean = V.check_token_ids("clean", clean, self.vocab_size)
            if tuple(clean.shape) != (B, L):
                raise ValueError(f"clean: expected shape {(B, L)} like x_t, got {tuple(clean.shape)}")
            t_blocks = None if t is None else blocks.block_times(t, B, nb, x_t.device)
        return x_t, t_blocks, gamma, attention_mask, clean

    def hidden_states(self, x_t: torch.Tensor, t: torch.Tensor | None = None, *,
                      bidirectional_prob: float | torch.Tensor = 1.0,
                      attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
                      clean: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states ``(B, L, d)``, shifted like :meth:`forward`, before the output head.

        ``logits_from_hidden(hidden_states(...))`` equals ``forward(...)`` (same arguments and generator state);
        ``clean`` (block models) is :meth:`forward`'s: the block-causal forward's hidden states
        (:func:`unifusion.hf.ar.blocks.block_hidden_states`).
        """
        generator = V.check_generator(generator)
        if clean is not None:
            inputs = self._block_inputs(x_t, t, bidirectional_prob, attention_mask, clean)
            if inputs is not None:
                x_b, t_blocks, gamma, mask, clean_b = inputs
                return blocks.block_hidden_states(self, self.hf_model, x_b, t_blocks, clean_b, gamma, mask, generator)
        x_t, t, gamma, attention_mask = self._check(x_t, t, bidirectional_prob, attention_mask)
        return self._hidden(x_t, t, gamma, attention_mask, generator)

    def _hidden(self, x_t: torch.Tensor, t: torch.Tensor | None, gamma: float | torch.Tensor,
                attention_mask: torch.Tensor | None, generator: torch.Generator | None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        kwargs = self._network_inputs(x_t, t, gamma, attention_mask, generator, document_ids)
        h = self._hf.base_model(**kwargs).last_hidden_state  # (B, L+1, d)
        return h[:, :-1]

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The family's output head on hidden states ``(..., d)`` → logits ``(..., V)``
        (:func:`unifusion.hf.ar.head.logits_from_hidden`).

        ``z = (h W^T + b) · logit_scale``, then ``c · tanh(z / c)`` when the family soft-caps (gemma2/3).
        """
        return head.logits_from_hidden(self, h)

    def block_conditioning(self, x0: torch.Tensor) -> dict[str, Any]:
        """``{"clean": x0}`` for a block model (:meth:`forward`'s ``clean``: the ``[clean | noisy]`` block-causal
        forward of :mod:`unifusion.hf.ar.blocks`), ``{}`` without blocks
        (:meth:`Denoiser.block_conditioning <unifusion.denoiser.Denoiser.block_conditioning>`)."""
        return {} if self.block_size is None else {"clean": x0}

    def backbone(self) -> Any:
        """The Hugging Face ``*ForCausalLM`` the trainer-facing methods of
        :class:`~unifusion.hf.backbone.BackboneMethods` act on (:attr:`hf_model`)."""
        return self._hf

    # -- save / load --------------------------------------------------------------------------------------------

    checkpoint_keys = io.CONFIG_KEYS

    def checkpoint_record(self) -> dict[str, Any]:
        """The record's entries of an adapted model (:func:`unifusion.hf.ar.io.config_stamp`). A peft backbone
        cannot be saved this way (merge its adapters first): a ``TypeError``."""
        if self.hf_model is not self.base_model:
            raise TypeError(
                "save_pretrained: the base model is a peft model; merge the adapters first "
                "(adapt_ar_model(model.base_model.merge_and_unload(), ...)) or save them with peft")
        return io.config_stamp(self)

    def save_checkpoint_files(self, path: Path) -> None:
        """A standard Hugging Face folder of the backbone that says it is a diffusion model: its ``config.json`` (the
        vocabulary includes an added mask token; ``architectures`` and the ``"unifusion"`` entry name the diffusion
        model), ``generation_config.json`` and ``model.safetensors`` (transformers' names, tied weights stored once,
        a marker tensor beside them), so ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads the
        backbone with identical weights and warns; for a time-conditioned model ``unifusion_weights.safetensors``
        (the time embedding) beside them (:mod:`unifusion.hf.ar.io`). What a serving engine needs is in
        docs/guides/serving.md."""
        io.save_files(self, path)

    @classmethod
    def load_checkpoint(cls, path: Path, record: dict[str, Any] | None,
                        dtype: torch.dtype | str | None) -> DiffusionLM:
        """The model of a folder written by :meth:`save_pretrained`, in today's format or the earlier one (the
        wrapper's state dict in ``model.safetensors``, no ``config.json``); a plain Hugging Face folder is a
        ``ValueError`` saying to wrap it with :func:`~unifusion.hf.adapt_ar_model`
        (:func:`unifusion.hf.ar.io.load_model`)."""
        model: DiffusionLM = io.load_model(cls, path, record, dtype)
        return model

    def extra_repr(self) -> str:
        return (f"family={self.family.model_type}, bos_token_id={self.bos_token_id}, "
                f"mask_token_id={self.mask_token_id}, num_states={self.num_states}, "
                f"time_conditioning={self.time_conditioning}"
                + (f", block_size={self.block_size}" if self.block_size is not None else ""))

