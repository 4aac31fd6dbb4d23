"""DiffusionGemma (transformers' ``DiffusionGemmaForBlockDiffusion``) as a unifusion x0 denoiser under uniform noise.

DiffusionGemma is one Gemma-4 MoE network used twice with shared weights: a causal **encoder** over the clean prefix
(the prompt and the canvases committed so far) writes the KV cache; a bidirectional **decoder** over a canvas of
``K = canvas_length`` noisy tokens reads it and predicts the clean canvas, unshifted. Logits are soft-capped,
``z = c · tanh((h Wᵀ) / c)`` with ``c = final_logit_softcapping`` (30), ``W`` the tied embedding. A
self-conditioning MLP adds ``softmax(previous logits) · E`` (E the scaled embedding) to the decoder's input.

Read as an x0 model, the decoder's softmax is ``x_θ(· | x_t, t)`` for the canvas positions, and the generation's
renoising (non-accepted positions redrawn uniformly) is :class:`~unifusion.UniformKernel`'s noise, so the GIDD /
uniform ELBO (:func:`unifusion.losses.gidd_loss`) trains and scores it. :class:`DiffusionGemmaLM` wraps the model::

    import unifusion as uf
    from unifusion.hf.registry import wrap_diffusion_lm
    model = wrap_diffusion_lm(DiffusionGemmaForBlockDiffusion.from_pretrained(...))
    logits = model(x_t, t, prompt_mask=prompt_mask, x0=x0)        # (B, L, V); prompt columns carry x0 over
    loss = uf.losses.gidd_loss(logits, x0, x_t, t[:, None], model.kernel)   # 0 on the prompt

Layout (:mod:`unifusion.hf.diffusion_gemma.layout`): each row is ``[prompt | response]`` (with optional padding);
the response is cut into canvases of ``K`` tokens from the end of the prompt, as ``generate`` commits them; canvas c
is predicted from the clean prefix (prompt and canvases < c, read from ``x0`` when given, else from ``x_t``) and its
own noisy tokens. The encoder runs once over the clean prefix of the last canvas; every canvas of the batch runs in
one decoder call. The cached, step-by-step operations a sampler uses (prefill, denoise a canvas, commit it) are in
:mod:`unifusion.hf.diffusion_gemma.cache`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ... import _validation as V
from ...denoiser import DenoiserModule, prompt_conditioning
from ...kernels import UniformKernel, check_kernel
from ...losses.fused_linear import fused_linear_diffusion_loss
from ..backbone import BackboneMethods
from ..checkpoint import CheckpointMixin
from .layout import CanvasLayout, canvas_layout, decoder_masks, prompt_bounds

__all__ = ["CARRY_LOGIT", "DiffusionGemmaLM", "wrap"]

CARRY_LOGIT = -1.0e4
"""Logit of every token but the clean one at the prompt and padding columns: ``x_θ`` there is the point mass on the
known token (``e^{-10⁴}`` is 0 in float32 and float64), so the x0-head losses are exactly 0 there."""


class DiffusionGemmaLM(CheckpointMixin, BackboneMethods, DenoiserModule):
    """``DiffusionGemmaForBlockDiffusion`` as an x0 denoiser over its ``V`` tokens (no mask token).

    Build it with :func:`unifusion.hf.registry.wrap_diffusion_lm`. The model is held, not copied: ``base_model`` is
    the object passed in (training the wrapper trains it).

    Attributes:
        base_model: the ``DiffusionGemmaForBlockDiffusion``.
        canvas_length: ``K``, tokens per canvas (``config.canvas_length``).
        mask_token_id: ``None`` (uniform noise only).
        kernel: the kernel the model is trained and scored with, :class:`~unifusion.UniformKernel` ``(V)`` unless set
            (recorded by :meth:`save_pretrained`).
        tokenizer: a Hugging Face tokenizer or ``None`` (a plain attribute, saved with the model).
    """

    base_model: Any  # the DiffusionGemmaForBlockDiffusion (its methods are not typed through nn.Module)
    config: Any  # its DiffusionGemmaConfig

    conditions_on_prompt = True  # diffusion_loss passes prompt_mask= and x0= (the encoder reads the prefix)
    generate_takes_sampler_options = False  # generate reads DiffusionGemmaGenerationConfig's fields instead

    def __init__(self, base_model: nn.Module, *, tokenizer: Any = None, kernel: Any = None) -> None:
        super().__init__()
        self.base_model = base_model
        self.config = base_model.config
        self.text_config: Any = self.config.get_text_config()
        self.canvas_length = int(self.config.canvas_length)
        self.mask_token_id: int | None = None
        if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
            raise TypeError(f"tokenizer: expected a Hugging Face tokenizer (with save_pretrained), got "
                            f"{type(tokenizer).__name__}")
        self.tokenizer: Any = tokenizer
        if kernel is not None:
            V.check_model_kernel(self, check_kernel(kernel))  # S = V, and no mask kernel (there is no mask token)
        self.kernel: Any = kernel if kernel is not None else UniformKernel(self.vocab_size)

    # -- what the library reads ------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Token ids the model reads and logit columns it writes (``V = S``)."""
        return int(self.base_model.lm_head.out_features)

    @property
    def num_states(self) -> int:
        """The kernels' state-space size ``S`` (equals :attr:`vocab_size`)."""
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
        """The output embedding ``(V, d)`` (tied to the input embedding)."""
        return self.base_model.lm_head.weight

    @property
    def lm_head_bias(self) -> torch.Tensor | None:
        """``None``: the head has no bias."""
        return None

    @property
    def logit_scale(self) -> float:
        """``1``: the head's output is not rescaled before the soft-cap."""
        return 1.0

    @property
    def final_logit_softcap(self) -> float:
        """``c`` of ``z = c · tanh(z / c)`` (``final_logit_softcapping``)."""
        return float(self.text_config.final_logit_softcapping)

    @property
    def sliding_window(self) -> int | None:
        """``W`` of the sliding-window layers (``None`` without any)."""
        has = "sliding_attention" in (self.text_config.layer_types or ())
        return int(self.text_config.sliding_window) if has else None

    def backbone(self) -> Any:
        """The ``DiffusionGemmaForBlockDiffusion`` the trainer-facing methods of
        :class:`~unifusion.hf.backbone.BackboneMethods` act on (:attr:`base_model`)."""
        return self.base_model

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Soft-capped float32 logits ``(..., V)`` of decoder hidden states ``(..., d)``, computed as the reference
        ``forward`` does (head, cast to float32, ``c · tanh(z / c)``)."""
        c = self.final_logit_softcap
        return torch.tanh(F.linear(h, self.lm_head_weight).float() / c) * c

    # -- the forward pass ------------------------------------------------------------------------------------------

    def forward(self, x_t: torch.Tensor, t: Any = None, *, prompt_mask: torch.Tensor | None = None,
                prompt_length: int | torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                x0: torch.Tensor | None = None, self_conditioning_logits: torch.Tensor | None = None,
                self_conditioning_prob: float = 0.0, bidirectional_prob: float = 1.0,
                generator: torch.Generator | None = None, kernel: Any = None,
                objective: Literal["gidd", "mdlm", "sedd", "m2s", "ctmc"] = "gidd",
                weighting: Literal["elbo", "clip", "dynamic"] = "elbo", max_weight: float = 2.0,
                reduction: Literal["none", "sum", "mean"] = "none",
                position_weight: torch.Tensor | None = None) -> torch.Tensor:
        """x0 logits ``(B, L, V)`` of ``x_t``, or — given ``x0`` and ``kernel`` — the fused per-position loss.

        Args:
            x_t: ``(B, L)`` int64 tokens: ``[prompt | response]`` (prompt clean, response noisy).
            t: times, one per row (a float, ``(B,)`` or ``(B, 1)``); checked, not used (the model has no time
                input).
            prompt_mask: ``(B, L)`` bool, True on the prompt: the clean prefix of each row's real tokens, at least
                one token (e.g. BOS), not the whole row. Or give
            prompt_length: the prompt's number of tokens, an int or ``(B,)`` ints.
            attention_mask: optional ``(B, L)``, 1 = real token (contiguous: left or right padding).
            x0: clean tokens ``(B, L)``: the encoder reads the committed canvases (and the prompt) from them. Without
                it they are read from ``x_t`` (right when they are clean there, as in sampling, or when every
                response fits one canvas). With ``kernel`` too, the fused loss is returned.
            self_conditioning_logits: ``(B, L, V)`` logits of the previous step (sampling): the decoder adds
                ``softmax(·) · E`` to its canvas inputs. ``None``: no self-conditioning signal.
            self_conditioning_prob: training: with this probability per row, feed the row the predictions of a
                first (no-grad) pass; ``0`` runs one pass. Drawn with ``generator``.
            bidirectional_prob: ``1`` (the decoder is bidirectional by design); accepted for the Denoiser interface.
            generator: randomness for ``self_conditioning_prob``.
            kernel: with ``x0``: return the fused loss of :func:`unifusion.losses.fused_linear_diffusion_loss` on
                the decoder's hidden states under this kernel; prompt and padding columns get weight 0.
            objective: the fused loss's objective.
            weighting: the fused loss's weighting.
            max_weight: the fused loss's weight clip.
            reduction: the fused loss's reduction.
            position_weight: ``(B, L)`` weights of the fused loss's positions (times the response mask).

        Returns:
            float32 ``(B, L, V)`` logits: the decoder's soft-capped logits on response columns, the point mass on
            the clean token (:data:`CARRY_LOGIT` elsewhere) on prompt and padding columns; or the ``(B, L)`` loss.
        """
        generator = V.check_generator(generator)
        if kernel is not None and x0 is None:
            raise ValueError("x0, kernel: the fused loss needs both (kernel alone is not enough)")
        x_t, context, attention_mask = self._check(x_t, t, x0, attention_mask, bidirectional_prob)
        B, L = x_t.shape
        if kernel is not None:
            V.check_model_kernel(self, check_kernel(kernel))
            if t is None:
                raise ValueError("t: the fused loss needs the times (one per row)")
        layout = self._layout(x_t, prompt_mask, prompt_length, attention_mask)
        h = self._decode(x_t, context, layout, attention_mask, self_conditioning_logits, self_conditioning_prob,
                         generator)  # (B·n_c, width, d)
        if kernel is None:
            logits = self.logits_from_hidden(h)  # (B·n_c, width, V)
            out = logits.new_full((B * L + 1, self.vocab_size), CARRY_LOGIT)
            out[: B * L].scatter_(-1, context.reshape(-1, 1), 0.0)  # the point mass on the clean token
            return layout.unfold(logits, out)
        assert x0 is not None
        hidden = layout.unfold(h, h.new_zeros(B * L + 1, h.shape[-1]))  # (B, L, d), 0 off the canvases
        response = layout.response()
        weight = response if position_weight is None else response * position_weight
        t_pos = _times(t, x_t)[:, None].expand(B, L)
        return fused_linear_diffusion_loss(
            hidden, self.lm_head_weight, x0, x_t, t_pos, kernel, objective=objective, weighting=weighting,
            max_weight=max_weight, final_logit_softcap=self.final_logit_softcap, reduction=reduction,
            position_weight=weight)

    def hidden_states(self, x_t: torch.Tensor, t: Any = None, *, prompt_mask: torch.Tensor | None = None,
                      prompt_length: int | torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                      x0: torch.Tensor | None = None, self_conditioning_logits: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """The decoder's final hidden states ``(B, L, d)`` on response columns (0 on prompt and padding):
        ``logits_from_hidden`` of them equals :meth:`forward`'s logits there (same arguments)."""
        x_t, context, attention_mask = self._check(x_t, t, x0, attention_mask, 1.0)
        layout = self._layout(x_t, prompt_mask, prompt_length, attention_mask)
        h = self._decode(x_t, context, layout, attention_mask, self_conditioning_logits, 0.0, None)
        return layout.unfold(h, h.new_zeros(x_t.numel() + 1, h.shape[-1]))


    def conditioned_on(self, x0: torch.Tensor, *, prompt_mask: torch.Tensor | None = None,
                       prompt_length: int | torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                       self_conditioning_prob: float = 0.0, generator: torch.Generator | None = None
                       ) -> PromptConditioned:
        """An x0 callable ``(x_t, t) → logits`` with the prompt of the clean sequence ``x0 (B, L)`` (prompt and
        response) fixed: it puts the clean prompt back into ``x_t`` and reads each canvas's clean prefix from
        ``x0``. For any function that calls a model as ``model(x_t, t)`` on ``x0`` repeated along the batch (``n·B``
        rows, row r is sequence ``r mod B``), such as :func:`unifusion.eval.nll_bound`: with ``per_token=False``
        that returns the conditional bound on ``−log p(response | prompt)`` (the prompt columns score exactly 0;
        ``C_ELBO`` is 0 for the linear schedule). Fine-tuning: ``uf.diffusion_loss(model.conditioned_on(x0,
        prompt_mask=pm, self_conditioning_prob=p), x0, kernel, prompt_mask=pm)`` is the GIDD loss of the canvas
        factorisation, 0 on the prompt (``attention_mask``, ``self_conditioning_prob`` and ``generator`` are passed to
        every call)."""
        return PromptConditioned(self, x0, prompt_mask=prompt_mask, prompt_length=prompt_length,
                                 attention_mask=attention_mask, self_conditioning_prob=self_conditioning_prob,
                                 generator=generator)

    def with_prompt(self, prompt_length: int) -> PromptFixed:
        """An x0 callable ``(x_t (B, L), t, attention_mask=None) → logits (B, L, V)`` whose first ``prompt_length``
        columns are the prompt (left padding included, where ``attention_mask`` is 0): what samplers that call a model
        as ``model(x_t, t)`` need (:class:`~unifusion.BayesianSampler`, :class:`~unifusion.samplers.PolicySampler`
        with ``use_cache=False``). Every canvas's clean prefix is read from ``x_t`` (exact when the response fits one
        canvas; otherwise the later canvases see the earlier ones as they stand, noisy included)."""
        return PromptFixed(self, prompt_length)

    # -- block decoding (the BlockDenoiser protocol of PolicySampler) -----------------------------------------------

    def start_blocks(self, prefix: torch.Tensor, prefix_mask: torch.Tensor) -> Any:
        """Encode the clean prefix ``(B, P)`` (``prefix_mask`` False at left padding) into a fresh KV cache; returns
        the :class:`~unifusion.hf.diffusion_gemma.cache.CanvasState`. Blocks are canvases: use ``block_size =
        canvas_length``."""
        from .cache import prefill

        return prefill(self, prefix, attention_mask=prefix_mask)

    def denoise_block(self, state: Any, block: torch.Tensor, t: torch.Tensor, rows: torch.Tensor,
                      self_condition: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's soft-capped float32 logits ``(B_a, K, V)`` of the canvas ``block`` of ``rows`` against the
        cache, with ``self_condition`` (the previous step's temperature-scaled logits, cast to the weights' dtype as
        generation does) as the self-conditioning signal; ``t`` is not used (the model has no time input), nor is
        ``positions`` (every position's logits are computed: the next step's self-conditioning reads them all)."""
        from .cache import denoise, select_rows

        view = select_rows(self, state, rows.tolist())
        return denoise(self, view, block, self_conditioning_logits=self_condition)

    def commit_block(self, state: Any, block: torch.Tensor, rows: torch.Tensor) -> Any:
        """Append the finished canvas ``block`` ``(B_a, K)`` of ``rows`` to the cache (one encoder forward); rows not
        in ``rows`` are dropped from the state for good."""
        from .cache import commit, select_rows

        select_rows(self, state, rows.tolist(), copy_cache=False)
        commit(self, state, block)
        return state

    @classmethod
    def can_generate(cls) -> bool:
        """Refuses, with a ``TypeError`` naming :meth:`generate`, what transformers' pipelines ask first: a
        ``text-generation`` pipeline passes sampling options (``temperature``, ``do_sample``) that DiffusionGemma's
        decoding does not take (its ``DiffusionGemmaGenerationConfig`` has ``t_min``/``t_max`` instead), so it fails
        at construction rather than at the first call."""
        raise TypeError("DiffusionGemmaLM: transformers' text-generation pipeline passes sampling options "
                        "(temperature, do_sample) that DiffusionGemma's decoding does not take; call "
                        "model.generate(**tokenizer(texts, return_tensors='pt', padding=True, padding_side='left'), "
                        "max_new_tokens=...) and decode with the tokenizer")

    def generate(self, prompt_ids: torch.Tensor | None = None, generation_config: Any = None, *,
                 input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 generator: Any = None, policy: Any = None, return_dict: bool = False, parity: bool = False,
                 **kwargs: Any) -> Any:
        """Generate canvas by canvas with :class:`~unifusion.samplers.PolicySampler` and (by default)
        :class:`~unifusion.samplers.policies.EntropyBound` built from transformers'
        ``DiffusionGemmaGenerationConfig``; see :func:`unifusion.hf.diffusion_gemma.generation.generate`.

        Called as transformers' ``DiffusionGemmaForBlockDiffusion.generate`` is: the prompt as ``input_ids=`` (so
        ``model.generate(**tokenizer(texts, return_tensors="pt", padding=True))`` works), and the config's fields as
        keywords (``max_new_tokens=64``, ``t_min=...``), which win over ``generation_config`` (default the model's);
        ``return_dict_in_generate=True`` is ``return_dict=True`` (a config's ``return_dict_in_generate``, True by
        default in transformers' class, is not read: the keyword decides). A keyword that is not a field of the config
        is a ``TypeError``; ``output_scores`` / ``output_logits`` (no commit step under EntropyBound) and
        ``streamer`` are ``ValueError``s."""
        import copy

        from .generation import generate

        if (prompt_ids is None) == (input_ids is None):
            raise TypeError("prompt_ids: give the prompt once (prompt_ids, or transformers' input_ids=)")
        prompt = prompt_ids if prompt_ids is not None else input_ids
        assert prompt is not None  # exactly one was given
        token_types = kwargs.pop("token_type_ids", None)
        if token_types is not None and bool(torch.as_tensor(token_types).ne(0).any()):
            raise ValueError("token_type_ids: the model reads one segment; expected all zeros, got other ids")
        as_record = kwargs.pop("return_dict_in_generate", None)
        if as_record is not None:
            if not isinstance(as_record, bool):
                raise TypeError(f"return_dict_in_generate: expected a bool, got {type(as_record).__name__}")
            return_dict = return_dict or as_record
        for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states", "streamer"):
            value = kwargs.pop(name, None)
            if value not in (None, False):
                raise ValueError(f"{name}: not recorded by DiffusionGemma's entropy-bounded decoding (it resamples "
                                 f"whole canvases; no token has a committing step), got {value!r}")
        if kwargs:
            from transformers import DiffusionGemmaGenerationConfig

            base = generation_config if generation_config is not None else getattr(
                self.base_model, "generation_config", None)
            generation_config = copy.deepcopy(base) if base is not None else DiffusionGemmaGenerationConfig()
            unused = generation_config.update(**kwargs)
            if unused:
                raise TypeError(f"generate() got unexpected keyword arguments {sorted(unused)} (not fields of "
                                "DiffusionGemmaGenerationConfig)")
        return generate(self, prompt, generation_config, attention_mask=attention_mask, generator=generator,
                        policy=policy, return_dict=return_dict, parity=parity)

    # -- internals ------------------------------------------------------------------------------------------------

    def _check(self, x_t: Any, t: Any, x0: Any, attention_mask: Any, bidirectional_prob: Any
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x_t = V.check_token_batch("x_t", x_t)
        if bidirectional_prob != 1.0:
            raise ValueError(f"bidirectional_prob: DiffusionGemma's decoder is bidirectional by design; expected 1.0, "
                             f"got {bidirectional_prob!r} (attention annealing does not apply)")
        B, L = x_t.shape
        V.check_model_device(self, "x_t", x_t)
        with V.batched_checks():
            x_t = V.check_token_ids("x_t", x_t, self.vocab_size)
            if x0 is not None:
                if not isinstance(x0, torch.Tensor) or tuple(x0.shape) != (B, L):
                    raise ValueError(f"x0: expected a ({B}, {L}) tensor like x_t")
                x0 = V.check_token_ids("x0", x0, self.vocab_size)
            if t is not None:
                _times(t, x_t)
            if attention_mask is not None:
                if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, L):
                    raise ValueError(f"attention_mask: expected a ({B}, {L}) tensor like x_t")
                attention_mask = attention_mask.to(device=x_t.device, dtype=torch.bool)
                V.check_padding("attention_mask", attention_mask)
        return x_t, (x0 if x0 is not None else x_t), attention_mask

    def _layout(self, x_t: torch.Tensor, prompt_mask: Any, prompt_length: Any,
                attention_mask: torch.Tensor | None) -> CanvasLayout:
        first, start, end = prompt_bounds(x_t, prompt_mask, prompt_length, attention_mask)
        return canvas_layout(first, start, end, x_t.shape[1], self.canvas_length, x_t.device)

    def _encode(self, context: torch.Tensor, layout: CanvasLayout,
                attention_mask: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run the causal encoder over the clean prefix ``context[:, :L_enc]``; the keys and values of every layer,
        ``(B, H_kv, L_enc, D)`` each (sliding layers keep them all here: each canvas is shown its own window)."""
        from transformers import DynamicCache

        n = layout.encoder_length
        cache = DynamicCache(config=self.text_config)
        layers: list[Any] = list(cache.layers)
        for layer in layers:
            if getattr(layer, "is_sliding", False):
                layer.activate_past_recording()  # keep every key: canvases see different windows of them
        kwargs: dict[str, Any] = {}
        if not layout.plain:
            real = (torch.ones_like(context[:, :n], dtype=torch.bool) if attention_mask is None
                    else attention_mask[:, :n])
            kwargs["attention_mask"] = real
            kwargs["position_ids"] = (real.long().cumsum(-1) - 1).clamp_min(0)
        self.base_model.model.encoder(input_ids=context[:, :n], cache=cache, **kwargs)
        return [(layer.keys, layer.values) for layer in layers]

    def _key_window(self, encoder_length: int) -> int | None:
        """Keys a sliding-window layer of the decoder reads before a canvas: ``min(W − 1, L_enc)`` (``None`` without
        sliding layers)."""
        W = self.sliding_window
        return None if W is None else min(W - 1, encoder_length)

    def _decoder_cache(self, kv: list[tuple[torch.Tensor, torch.Tensor]], layout: CanvasLayout) -> Any:
        """A read-only ``DynamicCache`` of the folded batch (canvas ``b · n_c + c`` is a row): full layers get row b's
        keys (masked per canvas), sliding layers the ``min(W − 1, L_enc)`` keys before the canvas, as generation's
        cache holds them (in the plain layout: the last ones, no mask needed)."""
        from transformers import DynamicCache

        B, n_c = layout.columns.shape[0], layout.num_canvases
        window = self._key_window(layout.encoder_length)
        data = []
        for (k, v), kind in zip(kv, self.text_config.layer_types):
            if kind == "sliding_attention" and window is not None:
                if layout.plain:
                    k, v = k[:, :, k.shape[2] - window:], v[:, :, v.shape[2] - window:]
                else:  # (B, H, L_enc, D) → the window of each canvas, (B·n_c, H, window, D)
                    cols = layout.window(window)[0]  # (B, n_c, window)
                    rows = torch.arange(B, device=cols.device)[:, None, None]
                    k, v = (rearrange(x[rows, :, cols], "b c w h d -> (b c) h w d") for x in (k, v))
            elif n_c > 1:
                k, v = k.repeat_interleave(n_c, dim=0), v.repeat_interleave(n_c, dim=0)
            data.append((k, v))
        return DynamicCache(ddp_cache_data=data)

    def _decode(self, x_t: torch.Tensor, context: torch.Tensor, layout: CanvasLayout,
                attention_mask: torch.Tensor | None, self_conditioning_logits: torch.Tensor | None,
                self_conditioning_prob: float, generator: torch.Generator | None) -> torch.Tensor:
        """Encoder once, then every canvas through the decoder: hidden states ``(B · n_c, width, d)``."""
        B, n_c = x_t.shape[0], layout.num_canvases
        impl = str(getattr(self.text_config, "_attn_implementation", None) or "eager")
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"model: attn_implementation={impl!r}; the wrapper builds SDPA or eager attention masks "
                             "(load the model with attn_implementation='sdpa' or 'eager')")
        cache = self._decoder_cache(self._encode(context, layout, attention_mask), layout)
        masks = decoder_masks(layout, self._key_window(layout.encoder_length), additive=impl == "eager",
                              dtype=self.dtype)
        positions = layout.columns.reshape(B * n_c, -1) - layout.first.repeat_interleave(n_c)[:, None]
        canvas = layout.fold(x_t)  # (B·n_c, width)

        def run(sc_logits: torch.Tensor | None, sc_mask: torch.Tensor | None) -> torch.Tensor:
            out = self.base_model.model.decoder(
                decoder_input_ids=canvas, cache=cache, self_conditioning_logits=sc_logits,
                self_conditioning_mask=sc_mask, decoder_attention_mask=masks, decoder_position_ids=positions)
            return out.last_hidden_state

        sc = None if self_conditioning_logits is None else layout.fold(self._check_sc(self_conditioning_logits, x_t))
        p = _check_probability("self_conditioning_prob", self_conditioning_prob)
        if p == 0.0:
            return run(sc, None)
        if sc is not None:
            raise ValueError("self_conditioning_logits, self_conditioning_prob: give one (the first is the previous "
                             "sampling step's logits, the second draws a training pass's own)")
        with torch.no_grad():
            first = self.logits_from_hidden(run(None, None))
        use = torch.rand(B, generator=generator, device=generator.device if generator is not None else x_t.device)
        use = (use < p).to(x_t.device).repeat_interleave(n_c)  # (B·n_c,)
        return run(first, use)

    def _check_sc(self, logits: Any, x_t: torch.Tensor) -> torch.Tensor:
        shape = (*x_t.shape, self.vocab_size)
        if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != shape or not logits.is_floating_point():
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"self_conditioning_logits: expected float logits of shape {shape}, got {got}")
        return logits

    # -- save / load ----------------------------------------------------------------------------------------------

    checkpoint_keys = frozenset({"wrapper", "model_type", "architecture"})

    def checkpoint_record(self) -> dict[str, Any]:
        """The record's entries of DiffusionGemma: the wrapper, the model type and the architecture class."""
        return {"wrapper": "diffusion_gemma", "model_type": self.config.model_type,
                "architecture": type(self.base_model).__name__}

    def save_checkpoint_files(self, path: Path) -> None:
        """The model as transformers saves it (``config.json``, ``model.safetensors``: tied weights once), so plain
        transformers loads the folder with identical weights."""
        self.base_model.save_pretrained(str(path), safe_serialization=True)

    @classmethod
    def load_checkpoint(cls, path: Path, record: dict[str, Any] | None,
                        dtype: torch.dtype | str | None) -> DiffusionGemmaLM:
        """A folder written by :meth:`save_pretrained`, or a plain DiffusionGemma checkpoint folder (``config.json``
        with ``model_type: diffusion_gemma``; no record: ``UniformKernel(V)`` as the kernel)."""
        from transformers import DiffusionGemmaForBlockDiffusion

        if not (path / "config.json").is_file():
            raise ValueError(f"directory: expected a DiffusionGemma checkpoint folder (with config.json), got "
                             f"{str(path)!r}")
        kwargs: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
        return cls(DiffusionGemmaForBlockDiffusion.from_pretrained(str(path), **kwargs))

    def extra_repr(self) -> str:
        return f"canvas_length={self.canvas_length}, num_states={self.num_states}, kernel={self.kernel!r}"


def wrap(model: nn.Module, **kwargs: Any) -> DiffusionGemmaLM:
    """The wrapper :func:`unifusion.hf.registry.wrap_diffusion_lm` calls for ``model_type="diffusion_gemma"``: checks
    that ``model`` is a ``DiffusionGemmaForBlockDiffusion`` with a causal encoder, then ``DiffusionGemmaLM(model,
    **kwargs)`` (``tokenizer=``, ``kernel=``)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    if not isinstance(model, DiffusionGemmaForBlockDiffusion):
        raise TypeError(f"model: expected a DiffusionGemmaForBlockDiffusion (the model with its output head), got "
                        f"{type(model).__name__}")
    if getattr(model.config.get_text_config(), "use_bidirectional_attention", None) == "all":
        raise ValueError("model: use_bidirectional_attention='all' makes the encoder bidirectional, so a canvas's "
                         "clean prefix depends on how it was split into encoder calls; only causal encoders "
                         "(None or 'vision') are supported")
    return DiffusionGemmaLM(model, **kwargs)


class PromptConditioned:
    """``model`` with the prompt of ``x0`` fixed: ``(x_t (n·B, L), t) → logits`` (see
    :meth:`DiffusionGemmaLM.conditioned_on`)."""

    def __init__(self, model: DiffusionGemmaLM, x0: torch.Tensor, *, prompt_mask: torch.Tensor | None,
                 prompt_length: int | torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                 self_conditioning_prob: float = 0.0, generator: torch.Generator | None = None) -> None:
        x0 = V.check_token_batch("x0", x0)
        self.model, self.x0 = model, x0
        self.attention_mask, self.generator = attention_mask, generator
        self.self_conditioning_prob = _check_probability("self_conditioning_prob", self_conditioning_prob)
        self.num_states = model.num_states
        B, L = x0.shape
        if prompt_mask is None:
            lengths = prompt_length if isinstance(prompt_length, torch.Tensor) else torch.full((B,), prompt_length or 0)
            prompt_mask = torch.arange(L)[None, :] < lengths.to("cpu")[:, None]
        self.prompt_mask = prompt_mask.to(x0.device)

    def __call__(self, x_t: torch.Tensor, t: Any = None) -> torch.Tensor:
        n = x_t.shape[0] // self.x0.shape[0]
        x0, prompt = self.x0.repeat(n, 1), self.prompt_mask.repeat(n, 1)
        mask = None if self.attention_mask is None else self.attention_mask.repeat(n, 1)
        return self.model(torch.where(prompt, x0, x_t), t, **prompt_conditioning(self.model, x0, prompt),
                          attention_mask=mask, self_conditioning_prob=self.self_conditioning_prob,
                          generator=self.generator)


class PromptFixed:
    """``model`` with the first ``prompt_length`` columns as the prompt: ``(x_t (B, L), t, attention_mask=None) →
    logits`` (see :meth:`DiffusionGemmaLM.with_prompt`)."""

    def __init__(self, model: DiffusionGemmaLM, prompt_length: int) -> None:
        if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or prompt_length < 1:
            raise ValueError(f"prompt_length: expected an int >= 1 (the prompt's columns), got {prompt_length!r}")
        self.model, self.prompt_length = model, prompt_length
        self.num_states, self.mask_token_id, self.kernel = model.num_states, None, model.kernel

    def __call__(self, x_t: torch.Tensor, t: Any = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, L = x_t.shape
        prompt = (torch.arange(L, device=x_t.device) < self.prompt_length)[None].expand(B, L)
        if attention_mask is not None:
            prompt = prompt & attention_mask.to(device=x_t.device, dtype=torch.bool)
        return self.model(x_t, t, prompt_mask=prompt, attention_mask=attention_mask)


def _times(t: Any, x_t: torch.Tensor) -> torch.Tensor:
    """One time per row ``(B,)`` (a float, 0-d, ``(B,)`` or ``(B, 1)``), checked by the package's time rule."""
    B, L = x_t.shape
    t_ = V.check_time("t", t, device=x_t.device, shape=(B, L))
    if t_.dim() > 2 or (t_.dim() == 2 and t_.shape[1] != 1) or t_.numel() not in (1, B):
        raise ValueError(f"t: the model takes one time per sequence: a float, shape ({B},) or ({B}, 1), got shape "
                         f"{tuple(t_.shape)}")
    return t_.reshape(-1).expand(B) if t_.numel() == 1 else t_.reshape(B)


def _check_probability(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}: expected a float in [0, 1], got {value!r}")
    return float(value)
