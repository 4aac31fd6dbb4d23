"""Adapting a pretrained autoregressive (AR) causal LM into an x0-predicting diffusion model.

Implements paper §3.2 ("AR as the x0 model", "Causal-to-bidirectional annealing") and App. C.5 (Algorithm 1).

**AR as the x0 model.** After a one-position shift, the AR next-token distribution for ``x^i`` given
``x^{<i}`` is used as the clean-token prediction ``x_θ^i(· | x_t, t)``. :class:`DiffusionLM` prepends a BOS
token, runs the network on ``[BOS, x_t^1, ..., x_t^L]`` (length ``L + 1``) and keeps outputs ``0 .. L − 1``:
the prediction for position ``i`` is the network output at position ``i − 1`` (BOS for ``i = 1``). With causal
attention and a clean input, the logits are exactly the base model's next-token logits after
``[BOS, x^1 .. x^{i−1}]``.

**Causal-to-bidirectional annealing.** At update ``k`` the attention mask over the ``L + 1`` network positions
is

    γ_k = min(1, k / K_ann),    A_ij = 1{j ≤ i} ∨ B_ij,    B_ij ~ Bernoulli(γ_k),

drawn independently for every sequence of the batch and shared by all heads and layers. The BOS row is an
ordinary row (its output predicts ``x^1``, so it must see the sequence when bidirectional); the BOS column is
visible to every real query, since ``0 ≤ i``. Inference uses ``γ = 1``.

**Padding** (``attention_mask``, 1 = real token) must be contiguous: right padding or left padding. Padded
keys are blocked; padded queries see only themselves (so no row is empty and nothing is NaN). For left
padding, BOS is placed just before the first real token and position ids count real tokens only, so a padded
row equals the unpadded one on its real positions.

**Sliding-window layers** (mistral, gemma2/3, ...) keep their window: in a windowed layer key ``j`` is visible
from query ``i`` only if also ``|i − j| < w`` (symmetrised when bidirectional; with causal attention this is
exactly the pretrained window, so the γ = 0 wrapper equals the AR model at any length).

**No dense mask at γ = 1.** A fully bidirectional call without padding or an active window (``w ≥ L + 1``) builds no
mask: it passes transformers' ``is_causal=False`` keyword instead, so SDPA runs with ``attn_mask=None,
is_causal=False`` (flash kernels stay eligible; flash-attention-2 and flex attention work too) and nothing quadratic
in ``L`` is allocated outside the attention kernel. The outputs equal the dense-mask path's.
:meth:`DiffusionLM.attention_path` tells which path a call takes.

**Attention implementations.** SDPA gets the mask as booleans, eager attention in additive form, flex attention
(``attn_implementation="flex_attention"``) as a ``BlockMask`` of the same pattern (same draws, same outputs).
Flash attention takes no mask: it runs the causal and the mask-free bidirectional calls, and a call that needs a mask
(annealing, padding, an active window) is a ``ValueError`` naming ``attn_implementation`` and the fix.

Example::

    import unifusion as uf
    model = uf.adapt_ar_model(hf_model)                   # wraps, does not copy
    logits = model(x_t, t, bidirectional_prob=uf.anneal_schedule(step, 5000))   # (B, L, V)
"""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from . import _validation as V
from ._families import Family, family_for, supported_model_types
from .denoiser import Denoiser

__all__ = ["DiffusionLM", "adapt_ar_model", "anneal_schedule", "annealed_attention_mask"]

CONFIG_NAME = "unifusion_config.json"
WEIGHTS_NAME = "model.safetensors"
_CONFIG_KEYS = {"unifusion_version", "bos_token_id", "mask_token_id", "added_mask_token", "time_conditioning",
                "model_type", "architecture", "dtype", "base_config", "kernel", "block_size"}


# ----------------------------------------------------------------------------------------------------------
# schedule and mask (pure functions)


def anneal_schedule(step: int, anneal_steps: int) -> float:
    """Bidirectional probability ``γ_k = min(1, k / K_ann)`` at update ``k = step`` (App. C.5).

    Args:
        step: the update index ``k ≥ 0``.
        anneal_steps: the annealing horizon ``K_ann ≥ 0``; ``0`` means fully bidirectional from the start.

    Returns:
        ``γ_k`` in ``[0, 1]``, to pass as ``bidirectional_prob``.
    """
    for name, v in (("step", step), ("anneal_steps", anneal_steps)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {v}")
    if anneal_steps == 0:
        return 1.0
    return min(1.0, step / anneal_steps)


def annealed_attention_mask(
    batch_size: int,
    length: int,
    gamma: float,
    *,
    key_valid: torch.Tensor | None = None,
    window: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean attention mask ``A`` of shape ``(B, 1, L, L)``, True = query ``i`` may attend key ``j``.

    ``A_ij = (1{j ≤ i} ∨ B_ij) ∧ valid_j ∨ 1{i = j}``, ``B_ij ~ Bernoulli(γ)`` drawn with ``generator``;
    with ``window = w`` additionally ``∧ |i − j| < w``.

    Args:
        batch_size: ``B``.
        length: ``L`` (the network's sequence length, BOS included).
        gamma: ``γ`` in ``[0, 1]``; 0 gives the causal mask, 1 the full one.
        key_valid: optional ``(B, L)`` bool, False for padded keys (blocked for every query but themselves).
        window: optional sliding-window size ``w``.
        generator: random generator for ``B_ij`` (on ``device``).
        device: device of the result.
    """
    i = torch.arange(length, device=device)
    causal = i[None, :] <= i[:, None]  # (L, L), j ≤ i
    if gamma <= 0.0:
        A = causal.expand(batch_size, 1, length, length)
    elif gamma >= 1.0:
        A = torch.ones((), dtype=torch.bool, device=device).expand(batch_size, 1, length, length)
    else:
        B_ij = torch.rand((batch_size, 1, length, length), generator=generator, device=device) < gamma
        A = causal | B_ij
    if key_valid is not None:
        eye = i[None, :] == i[:, None]
        A = (A & key_valid[:, None, None, :]) | eye
    if window is not None:
        band = (i[None, :] - i[:, None]).abs() < window
        A = A & band
    return A


def _block_mask(A: torch.Tensor) -> Any:
    """flex attention's ``BlockMask`` of a boolean ``(B, 1, n, n)`` pattern (True = attend): its ``mask_mod`` reads
    ``A[b, 0, q, kv]``, so flex attention sees exactly the pattern SDPA gets as a dense mask. Blocks that are all True
    are marked full (no ``mask_mod`` evaluation inside them), all-False blocks are skipped. Built without compiling
    (the pattern exists already; the ``(B, 1, n, n)`` bool copy it evaluates is the size of ``A``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    pattern = A[:, 0].contiguous()  # (B, n, n); an expanded (stride-0) pattern trips Inductor's CPU template
    if pattern.device.type == "cpu" and not torch.compiler.is_compiling():
        # Inductor's CPU flex-attention template fails to build (C++ "cur_kvSplitSize5 was not declared", torch 2.15)
        # when this captured tensor is traced with symbolic sizes, which automatic dynamic shapes pick on the
        # recompile after another mask (e.g. the causal one): keep it static there.
        torch._dynamo.mark_static(pattern)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return pattern[b, q_idx, kv_idx]

    n = int(pattern.shape[-1])
    return create_block_mask(mask_mod, int(pattern.shape[0]), None, n, n, device=pattern.device)


# ----------------------------------------------------------------------------------------------------------
# time conditioning


class TimeEmbedding(nn.Module):
    """Learned embedding of the diffusion time ``t`` added to the input embeddings.

    ``e(t) = W_2 · SiLU(W_1 · [sin(ω t), cos(ω t)])`` with geometric frequencies ``ω``; ``W_2`` (and its bias) start at
    zero, so an adapted model equals its AR initialisation at step 0.

    Shapes: ``t`` ``(B,)`` → ``(B, d)``.
    """

    def __init__(self, hidden_size: int, num_frequencies: int = 64, max_period: float = 10_000.0) -> None:
        super().__init__()
        self.num_frequencies = num_frequencies
        self.max_period = max_period
        self.proj_in = nn.Linear(2 * num_frequencies, hidden_size)
        self.proj_out = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.proj_out.weight)
        nn.init.zeros_(self.proj_out.bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        k = torch.arange(self.num_frequencies, device=t.device, dtype=torch.float32)
        omega = torch.exp(-math.log(self.max_period) * k / self.num_frequencies)  # (F,)
        phase = 1000.0 * t.float()[:, None] * omega  # (B, F); t in (0, 1) spread over many periods
        features = torch.cat([phase.sin(), phase.cos()], dim=-1).to(self.proj_in.weight.dtype)  # (B, 2F)
        return self.proj_out(F.silu(self.proj_in(features)))  # (B, d)


# ----------------------------------------------------------------------------------------------------------
# the wrapper


def _unwrap_peft(model: nn.Module) -> Any:
    """The Hugging Face model inside a peft ``PeftModel`` (LoRA layers are injected in place), else ``model``.

    Typed ``Any``: a ``PreTrainedModel``'s methods (``get_input_embeddings``, ``config``, ...) are reached through
    ``nn.Module.__getattr__`` for peft models and plain attributes otherwise; neither types usefully."""
    get_base_model = getattr(model, "get_base_model", None)
    if hasattr(model, "peft_config") and callable(get_base_model):
        return get_base_model()
    return model


def _first_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return None if value is None else int(value)


class DiffusionLM(nn.Module, Denoiser):
    """An AR causal LM used as a shifted x0 predictor ``x_θ(· | x_t, t)`` with annealable bidirectional attention.

    Build it with :func:`adapt_ar_model`. The wrapped model is held, not copied: ``model.base_model`` is the object you
    passed in (training the wrapper trains it).

    Attributes:
        base_model: the wrapped Hugging Face model (or peft model).
        bos_token_id: the token prepended internally.
        mask_token_id: the absorbing-state token for mask/hybrid kernels (``None`` when the model was adapted with
            ``add_mask_token=False`` for uniform noise only).
        vocab_size: number of input ids / logit columns (including an added mask token).
        num_states: same as ``vocab_size`` (the state-space size ``S`` of the kernels).
        family: the :class:`unifusion._families.Family` entry used.
        tokenizer: the tokenizer given to :func:`adapt_ar_model` (or found by :meth:`from_pretrained`), or ``None``;
            a plain attribute (not part of the state dict), written by :meth:`save_pretrained`.
        kernel: the forward kernel the model was trained with, when known (set it, or pass ``kernel=`` to
            :meth:`save_pretrained`), else ``None``; recorded in the saved config and restored by
            :meth:`from_pretrained`. :meth:`generate` and ``unifusion sample``/``eval`` default to it
            (:func:`unifusion.models.default_kernel`: else mask on the mask token, else uniform).
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
        # block diffusion (unifusion.hf.blocks): None = one bidirectional block over the whole sequence
        self.block_size: int | None = _blocks().check_block_size(block_size)
        self.tokenizer: Any = tokenizer
        self.kernel: Any = None  # the training kernel, when known (save_pretrained records it)
        self.dense_bidirectional_mask: bool = False
        self.base_model = base_model
        hf = _unwrap_peft(base_model)
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
        """The wrapped Hugging Face ``*ForCausalLM`` (the peft model's base when :attr:`base_model` is a peft model)."""
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
    def device(self) -> torch.device:
        """Device of the input embeddings (where ``x_t`` must live)."""
        return self._hf.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Floating dtype of the input embeddings (the weights' dtype)."""
        return self._hf.get_input_embeddings().weight.dtype

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Number of parameters (tied tensors counted once), or only those with ``requires_grad``; with
        ``exclude_embeddings``, without the weights of ``nn.Embedding`` layers (the token embeddings, and an output
        head tied to them), as Hugging Face's ``num_parameters`` counts."""
        for name, value in (("only_trainable", only_trainable), ("exclude_embeddings", exclude_embeddings)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
        skip = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)} if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters()
                   if (p.requires_grad or not only_trainable) and id(p) not in skip)

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

    # -- the forward pass ---------------------------------------------------------------------------------------

    def _check(self, x_t: Any, t: Any, bidirectional_prob: Any, attention_mask: Any
               ) -> tuple[torch.Tensor, torch.Tensor | None, float, torch.Tensor | None]:
        if not isinstance(x_t, torch.Tensor):
            raise TypeError(f"x_t: expected a (B, L) int64 tensor of token ids, got {type(x_t).__name__}")
        if x_t.dim() != 2:
            raise ValueError(f"x_t: expected shape (B, L), got {tuple(x_t.shape)}")
        B, L = x_t.shape
        if B == 0 or L == 0:
            raise ValueError(f"x_t: expected a non-empty batch (B, L) with B, L >= 1, got {(B, L)}")
        V.check_model_device(self, "x_t", x_t)
        if isinstance(bidirectional_prob, bool) or not isinstance(bidirectional_prob, (int, float)):
            raise TypeError(f"bidirectional_prob: expected a float in [0, 1], got {type(bidirectional_prob).__name__}")
        gamma = float(bidirectional_prob)
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"bidirectional_prob: expected a float in [0, 1], got {bidirectional_prob}")
        # every value check in one host sync (none with validation off)
        with V.batched_checks():
            x_t = V.check_token_ids("x_t", x_t, self.vocab_size)
            if t is not None:
                # the package's time rule: a float, 0-d, (B,) or (B, 1) — one time per sequence, returned as (B,)
                t = V.check_time("t", t, device=x_t.device, shape=(B, L))
                if t.dim() > 2 or (t.dim() == 2 and t.shape[1] != 1) or t.numel() not in (1, B):
                    raise ValueError(f"t: the model takes one time per sequence: a float, shape ({B},) or ({B}, 1), "
                                     f"got shape {tuple(t.shape)}")
                t = t.reshape(-1).expand(B) if t.numel() == 1 else t.reshape(B)
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

    def _attn_implementation(self) -> str:
        """The wrapped model's attention implementation (``config._attn_implementation``; ``"eager"`` when unset)."""
        return str(getattr(self.config, "_attn_implementation", None) or "eager")

    def _mask_style(self, reason: str = "annealing, padding or a sliding window") -> str:
        """How this model takes the annealed mask: ``"additive"`` (eager), ``"bool"`` (SDPA, or the family's own style),
        ``"block"`` (flex attention: a ``BlockMask``); flash attention and other kernels cannot take one (``reason``
        says why this call needs it)."""
        impl = self._attn_implementation()
        if impl == "eager":
            return "additive"
        if impl == "sdpa":
            return self.family.mask_style
        if impl == "flex_attention":
            return "block"
        raise ValueError(
            f"model: attn_implementation={impl!r} cannot take the attention mask this call needs ({reason}); with it "
            "only the causal call (bidirectional_prob=0, no padding) and the mask-free bidirectional call "
            "(bidirectional_prob=1, no padding, no sliding window shorter than the sequence) run. Load the model "
            "with attn_implementation='sdpa', 'eager' or 'flex_attention' (or switch it in place: "
            "model.base_model.set_attn_implementation('sdpa')) for annealing, padding and sliding windows")

    def _mask_reason(self, n: int, gamma: float, padded: bool, window: int | None) -> str:
        """Why a call on ``n`` network positions needs a mask (for the flash-attention error)."""
        if padded:
            return "padding: attention_mask"
        if 0.0 < gamma < 1.0:
            return f"annealing: 0 < bidirectional_prob={gamma} < 1"
        if window is not None and window < n:
            return f"a sliding window of {window} < {n} positions"
        if self.dense_bidirectional_mask:
            return "dense_bidirectional_mask=True"
        if not _has_is_causal_kwarg():
            return "the installed transformers has no is_causal keyword"
        return f"the {self.family.model_type} family does not run bidirectionally without a mask"

    def _maskless(self, n: int, window: int | None) -> bool:
        """Whether full attention over ``n`` network positions can run with no mask (``is_causal=False``).

        True when the family honours the ``is_causal`` keyword, the installed transformers has it, the dense mask is
        not forced (:attr:`dense_bidirectional_mask`) and no sliding window bites (``w ≥ n``: then ``|i − j| ≤ n − 1
        < w`` for every pair, so the window is vacuous).
        """
        return (not self.dense_bidirectional_mask and self.family.is_causal_kwarg and _has_is_causal_kwarg()
                and (window is None or window >= n))

    def attention_path(self, length: int, bidirectional_prob: float = 1.0, *, padded: bool = False) -> str:
        """How a call on ``length`` tokens attends: ``"causal"``, ``"non_causal"``, ``"mask"`` or ``"block_mask"``.

        * ``"causal"``: γ = 0 without padding; the model's own causal (and windowed) attention, no mask from us.
        * ``"non_causal"``: γ = 1 without padding or an active sliding window, on a family that honours
          ``is_causal=False``; no mask tensor from us (SDPA ``attn_mask=None, is_causal=False``; flash-attention
          ``causal=False``; flex attention gets transformers' own all-visible block mask, which has no partial
          blocks).
        * ``"mask"``: everything else with SDPA or eager attention; the dense boolean/additive ``(B, 1, L + 1, L + 1)``
          mask of :func:`annealed_attention_mask`.
        * ``"block_mask"``: everything else with flex attention (``attn_implementation="flex_attention"``): the same
          pattern as a ``torch.nn.attention.flex_attention.BlockMask`` (one per layer type with sliding windows).

        Args:
            length: ``L``, the number of tokens in ``x_t`` (the network runs ``L + 1`` positions).
            bidirectional_prob: ``γ`` in ``[0, 1]``.
            padded: whether an ``attention_mask`` is passed.

        Raises:
            ValueError: where the call itself would: the model runs flash attention (or another kernel that takes no
                mask) and the call needs a mask (annealing, padding, an active sliding window).
        """
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"length: expected a positive int, got {length!r}")
        if isinstance(bidirectional_prob, bool) or not isinstance(bidirectional_prob, (int, float)) \
                or not 0.0 <= bidirectional_prob <= 1.0:
            raise ValueError(f"bidirectional_prob: expected a float in [0, 1], got {bidirectional_prob!r}")
        window = self.family.sliding_window(self.config)
        if not padded:
            if bidirectional_prob == 0.0:
                return "causal"
            if bidirectional_prob == 1.0 and self._maskless(length + 1, window):
                return "non_causal"
        style = self._mask_style(self._mask_reason(length + 1, float(bidirectional_prob), padded, window))
        return "block_mask" if style == "block" else "mask"

    def _net_inputs(self, x_t: torch.Tensor, t: torch.Tensor | None, gamma: float,
                    attention_mask: torch.Tensor | None, generator: torch.Generator | None) -> dict[str, Any]:
        """Keyword arguments for the HF model on the ``L + 1`` network positions ``[BOS, x_t]``."""
        B, L = x_t.shape
        device = x_t.device
        bos = torch.full((B, 1), self.bos_token_id, dtype=x_t.dtype, device=device)
        kwargs: dict[str, Any] = {"use_cache": False}
        key_valid = None
        if attention_mask is None:
            ids = torch.cat([bos, x_t], dim=1)  # (B, L+1)
        else:
            # p = number of leading pads; BOS goes at index p, real tokens follow, pads stay where they are.
            p = (attention_mask.long().cumsum(-1) == 0).sum(-1, keepdim=True)  # (B, 1)
            j = torch.arange(L + 1, device=device)[None, :]  # (1, L+1)
            shifted = torch.cat([bos, x_t], dim=1)
            unshifted = torch.cat([x_t, bos], dim=1)
            ids = torch.where(j < p, unshifted, torch.where(j == p, bos, shifted))
            ones = torch.ones((B, 1), dtype=torch.bool, device=device)
            valid_shifted = torch.cat([ones, attention_mask], dim=1)
            key_valid = torch.where(j < p, False, torch.where(j == p, True, valid_shifted))  # (B, L+1)
            kwargs["position_ids"] = (key_valid.long().cumsum(-1) - 1).clamp_min(0)

        if self.time_embedding is not None:
            assert t is not None
            h = self._hf.get_input_embeddings()(ids)  # (B, L+1, d)
            kwargs["inputs_embeds"] = h + self.time_embedding(t)[:, None, :].to(h.dtype)
        else:
            kwargs["input_ids"] = ids

        window = self.family.sliding_window(self.config)
        if key_valid is None and gamma == 0.0:
            return kwargs  # the model's own causal (and windowed) mask: exactly the AR model
        if key_valid is None and gamma == 1.0 and self._maskless(L + 1, window):
            # A = all ones: no mask at all, every attention module non-causal (SDPA is_causal=False, so flash
            # kernels stay eligible and nothing quadratic in L is allocated)
            kwargs["is_causal"] = False
            return kwargs
        style = self._mask_style(self._mask_reason(L + 1, gamma, key_valid is not None, window))
        if generator is not None and 0.0 < gamma < 1.0 and generator.device.type != device.type:
            raise ValueError(f"generator: is on {generator.device} but x_t is on {device}; the annealed mask is drawn "
                             f"on x_t's device, so pass torch.Generator(device={str(device)!r})")
        A = annealed_attention_mask(B, L + 1, gamma, key_valid=key_valid, generator=generator, device=device)
        masks = {"full_attention": A}
        if window is not None:  # windowed layers: A ∧ |i − j| < w (the diagonal stays, so no row is empty)
            i = torch.arange(L + 1, device=device)
            masks["sliding_attention"] = A & ((i[None, :] - i[:, None]).abs() < window)
        if style == "additive":  # eager attention adds the mask to the scores: 0 = attend, finfo.min = blocked
            dtype = self._hf.get_input_embeddings().weight.dtype
            blocked = torch.finfo(dtype).min
            masks = {k: torch.zeros(m.shape, dtype=dtype, device=device).masked_fill_(~m, blocked)
                     for k, m in masks.items()}
        elif style == "block":  # flex attention: the same pattern as a BlockMask (its mask_mod reads it)
            masks = {k: _block_mask(m) for k, m in masks.items()}
        if window is None:
            kwargs["attention_mask"] = masks["full_attention"]
        elif self.family.window == "all_layers":
            kwargs["attention_mask"] = masks["sliding_attention"]
        else:
            kwargs["attention_mask"] = masks
        return kwargs

    def forward(self, x_t: torch.Tensor, t: torch.Tensor | None = None, *, bidirectional_prob: float = 1.0,
                attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
                x0: torch.Tensor | None = None, kernel: Any = None,
                objective: Literal["gidd", "mdlm", "sedd", "m2s", "ctmc"] = "gidd",
                weighting: Literal["elbo", "clip", "dynamic"] = "elbo", max_weight: float = 2.0,
                reduction: Literal["none", "sum", "mean"] = "none",
                position_weight: torch.Tensor | None = None, clean: torch.Tensor | None = None) -> torch.Tensor:
        """x0 logits ``x_θ(· | x_t, t)``, or — given ``x0`` and ``kernel`` — the fused per-position loss.

        Args:
            x_t: ``(B, L)`` int64 noisy token ids.
            t: ``(B,)`` float times in ``(0, 1)``; required with time conditioning or a loss.
            bidirectional_prob: ``γ`` in ``[0, 1]`` (0 causal, 1 fully bidirectional; see :func:`anneal_schedule`).
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
                layout (:mod:`unifusion.hf.blocks`); ``t`` may then be one time per block ``(B, nb)``. With one block
                (``block_size >= L``) it is unused: the plain bidirectional forward.

        Returns:
            contiguous ``(B, L, V)`` logits (row ``i`` is the network output at position ``i − 1`` of
            ``[BOS, x_t]``; the output head runs on those ``L`` positions only), or with
            ``x0``/``kernel`` the ``(B, L)`` float32 loss of
            :func:`unifusion.losses.fused_linear_diffusion_loss`, computed from the hidden states without ever
            holding the ``(B, L, V)`` logits. Going through ``forward`` keeps DDP/FSDP/DeepSpeed hooks working.
        """
        generator = V.check_generator(generator)
        if clean is not None:  # block diffusion: the [clean | noisy] forward of unifusion.hf.blocks
            routed = self._block_forward(x_t, t, bidirectional_prob, attention_mask, generator, clean, x0, kernel,
                                         objective, weighting, max_weight, reduction, position_weight)
            if routed is not None:
                return routed
        if x0 is not None or kernel is not None:
            if x0 is None or kernel is None or t is None:
                raise ValueError("x0, kernel, t: the fused loss needs all three (or none of x0/kernel for logits)")
            from .kernels import check_kernel
            from .losses.fused_linear import fused_linear_diffusion_loss

            V.check_model_kernel(self, check_kernel(kernel))  # states and mask token (host metadata, no sync)
            x_t, t, gamma, attention_mask = self._check(x_t, t, bidirectional_prob, attention_mask)
            assert t is not None
            h = self._hidden(x_t, t, gamma, attention_mask, generator)
            return fused_linear_diffusion_loss(
                h, self.lm_head_weight, x0, x_t, t[:, None].expand(x_t.shape), kernel, objective=objective,
                weighting=weighting, max_weight=max_weight, lm_head_bias=self.lm_head_bias,
                logit_scale=self.logit_scale, final_logit_softcap=self.final_logit_softcap, reduction=reduction,
                position_weight=position_weight)
        x_t, t, gamma, attention_mask = self._check(x_t, t, bidirectional_prob, attention_mask)
        return self._logits(self._net_inputs(x_t, t, gamma, attention_mask, generator), x_t.shape[1])

    def _block_forward(self, x_t: Any, t: Any, bidirectional_prob: Any, attention_mask: Any,
                       generator: torch.Generator | None, clean: Any, x0: Any, kernel: Any, objective: Any,
                       weighting: Any, max_weight: float, reduction: Any, position_weight: Any) -> torch.Tensor | None:
        """The block-causal forward (logits, or the fused loss on the noisy stream's predictions); ``None`` when the
        call is the plain one (one block)."""
        blocks = _blocks()
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
        if t_blocks is None and (self.time_conditioning or x0 is not None or kernel is not None):
            raise ValueError("t: needed with time conditioning and for the fused loss, got None")
        if x0 is None and kernel is None:
            return blocks.block_logits(self, self._hf, x_t, t_blocks, clean, gamma, attention_mask, generator)
        if x0 is None or kernel is None:
            raise ValueError("x0, kernel, t: the fused loss needs all three (or none of x0/kernel for logits)")
        from .kernels import check_kernel
        from .losses.fused_linear import fused_linear_diffusion_loss

        V.check_model_kernel(self, check_kernel(kernel))
        assert t_blocks is not None
        h = blocks.block_hidden_states(self, self._hf, x_t, t_blocks, clean, gamma, attention_mask, generator)
        return fused_linear_diffusion_loss(
            h, self.lm_head_weight, x0, x_t, blocks.expand_block_times(t_blocks, L, self.block_size), kernel,
            objective=objective, weighting=weighting, max_weight=max_weight, lm_head_bias=self.lm_head_bias,
            logit_scale=self.logit_scale, final_logit_softcap=self.final_logit_softcap, reduction=reduction,
            position_weight=position_weight)

    def _logits(self, kwargs: dict[str, Any], L: int) -> torch.Tensor:
        """Contiguous ``(B, L, V)`` logits of the first ``L`` of the ``L + 1`` network positions: the output head runs
        on those positions only, so no ``(B, L + 1, V)`` tensor exists and no ``(B, L, V)`` copy is made downstream.

        The prediction after the last token is never needed. Slicing the *hidden states* (``(B, L + 1, d)`` →
        ``(B, L, d)``) before the head, rather than the logits after it, keeps the logits contiguous: slicing the
        logits gave a ``(B, L, V)`` view with row stride ``(L + 1) V``, which a loss reading rows ``(B·L, V)`` had to
        copy whole, and whose backward allocated a ``(B, L + 1, V)`` gradient. Families whose ``forward`` takes
        transformers' ``logits_to_keep`` get ``slice(0, L)`` (their own head, post-processing and module hooks run,
        so the values are the model's; a slice is a view on whatever device the hidden states live, unlike an index
        tensor); others run the backbone and apply the output head module, the family's logit scale and soft-cap
        to ``h[:, :-1]`` (:meth:`logits_from_hidden`'s post-processing).
        """
        if _takes_logits_to_keep(self._hf.__class__):
            logits = self._hf(**kwargs, logits_to_keep=slice(0, L)).logits  # (B, L, V)
            if logits.shape[1] == L:
                return logits
            return logits[:, :L].contiguous()  # pragma: no cover - a family that ignores logits_to_keep
        h = self._hf.base_model(**kwargs).last_hidden_state[:, :-1]  # (B, L, d)
        return self._post_head(self._hf.get_output_embeddings()(h))

    def hidden_states(self, x_t: torch.Tensor, t: torch.Tensor | None = None, *, bidirectional_prob: float = 1.0,
                      attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None
                      ) -> torch.Tensor:
        """Final hidden states ``(B, L, d)``, shifted like :meth:`forward`, before the output head.

        ``logits_from_hidden(hidden_states(...))`` equals ``forward(...)`` (same arguments and generator state).
        """
        generator = V.check_generator(generator)
        x_t, t, gamma, attention_mask = self._check(x_t, t, bidirectional_prob, attention_mask)
        return self._hidden(x_t, t, gamma, attention_mask, generator)

    def _hidden(self, x_t: torch.Tensor, t: torch.Tensor | None, gamma: float, attention_mask: torch.Tensor | None,
                generator: torch.Generator | None) -> torch.Tensor:
        kwargs = self._net_inputs(x_t, t, gamma, attention_mask, generator)
        h = self._hf.base_model(**kwargs).last_hidden_state  # (B, L+1, d)
        return h[:, :-1]

    def loss(self, x_t: torch.Tensor, t: torch.Tensor, x0: torch.Tensor, kernel: Any, **kwargs: Any) -> torch.Tensor:
        """Per-position ``(B, L)`` x0-head loss without materialising the logits (fused linear + loss), or its
        weighted sum / mean with ``reduction=``, ``position_weight=``.

        Same as ``self(x_t, t, x0=x0, kernel=kernel, **kwargs)``; under DDP/FSDP call the wrapper that way instead.
        """
        return self(x_t, t, x0=x0, kernel=kernel, **kwargs)

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The family's output head on hidden states ``(..., d)`` → logits ``(..., V)``.

        ``z = (h W^T + b) · logit_scale``, then ``c · tanh(z / c)`` when the family soft-caps (gemma2/3).
        """
        return self._post_head(F.linear(h, self.lm_head_weight, self.lm_head_bias))

    def _post_head(self, z: torch.Tensor) -> torch.Tensor:
        """The family's post-processing of the head's output ``z``: the logit scale, then the soft-cap."""
        scale = self.logit_scale
        if scale != 1.0:
            z = z * scale
        c = self.final_logit_softcap
        if c is not None:
            z = torch.tanh(z / c) * c
        return z

    # -- generation ---------------------------------------------------------------------------------------------

    def generate(self, prompt_ids: torch.Tensor, *, max_new_tokens: int | None = None, seq_len: int | None = None,
                 num_steps: int = 64, kernel: Any = None, temperature: float = 1.0, top_p: float | None = None,
                 top_k: int | None = None, eps: float = 1e-3,
                 generator: torch.Generator | Sequence[torch.Generator] | None = None,
                 progress: bool = False) -> torch.Tensor:
        """Continue ``prompt_ids`` by ancestral sampling (:class:`~unifusion.BayesianSampler`, Algorithm 2).

        The prompt is a fixed prefix: it is in ``z_t`` at every step and never changes; the ``N = num_steps`` posterior
        steps generate the positions after it, bidirectionally (``γ = 1``).

        Args:
            prompt_ids: ``(B, P)`` or ``(P,)`` int64 token ids (``P = 0`` samples unconditionally; a ``(P,)`` prompt
                gives ``B = 1``).
            max_new_tokens: number of tokens to generate after the prompt; or give
            seq_len: the total length ``P + max_new_tokens`` (exactly one of the two).
            num_steps: ``N ≥ 1`` model calls.
            kernel: the forward kernel the model was trained with; default :attr:`kernel` when recorded, else
                :class:`~unifusion.MaskKernel` on the model's mask token, else :class:`~unifusion.UniformKernel`
                (:func:`unifusion.models.default_kernel`, the rule ``unifusion sample`` follows too).
            temperature: ``T > 0``; ``x_θ = softmax(logits / T)``.
            top_p: nucleus truncation of ``x_θ`` in ``(0, 1]`` (``None``: off).
            top_k: keep the ``k`` most likely tokens (``None``: off).
            eps: ``ε``; sampling starts at ``t_0 = 1 − ε``.
            generator: random generator on the model's device, for reproducible samples; or a list of ``B``
                generators there, one per row: row b is then ``generate(prompt_ids[b:b + 1], ...,
                generator=generator[b])`` whatever rows are beside it (:meth:`BayesianSampler.sample`).
            progress: show a progress bar over the steps.

        Returns:
            ``(B, P + max_new_tokens)`` int64 token ids, the prompt unchanged in the first ``P`` columns.

        ``prompt_ids`` on another device than the model is moved to the model's. A model or prompt on the meta
        device, prompt ids outside ``[0, num_states)`` or equal to the kernel's mask id, and a generator on another
        device type than the model (or a number of per-row generators other than ``B``) are ``ValueError``s naming
        the argument (``model``, ``prompt_ids``, ``generator``).
        """
        from ._kernel_config import default_kernel
        from .samplers._setup import PROMPT_FILL, check_generators
        from .samplers.bayesian import BayesianSampler

        if not isinstance(prompt_ids, torch.Tensor):
            raise TypeError(f"prompt_ids: expected a (B, P) int64 tensor of token ids, got {type(prompt_ids).__name__}")
        if prompt_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"prompt_ids: expected integer token ids, got dtype {prompt_ids.dtype}")
        V.check_model_device(self, "prompt_ids", self.device)  # a meta model: "model: ..." (metadata only)
        V.check_not_meta("prompt_ids", prompt_ids)
        if prompt_ids.dim() == 1:
            prompt_ids = prompt_ids[None]
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] == 0:
            raise ValueError(f"prompt_ids: expected shape (B, P) with B >= 1, got {tuple(prompt_ids.shape)}")
        B, P = prompt_ids.shape
        generator = check_generators(generator, B)  # None, one generator, or one per row
        for g in (generator,) if isinstance(generator, torch.Generator) else generator or ():
            if g.device.type != self.device.type:
                raise ValueError(f"generator: is on {g.device} but the model is on {self.device}; create it there, "
                                 f"e.g. torch.Generator(device={str(self.device)!r})")
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
        if kernel is None:
            kernel = default_kernel(self)[0]
        sampler = BayesianSampler(self, kernel, num_steps, eps=eps, temperature=temperature, top_p=top_p,
                                  top_k=top_k)
        prompt_ids = prompt_ids.to(self.device, torch.int64)
        if V.validation_enabled() and prompt_ids.numel():  # one host sync, named for generate's argument
            bad = (prompt_ids < 0) | (prompt_ids >= self.num_states)
            if kernel.mask_id is not None:
                bad |= prompt_ids == kernel.mask_id
            V.fail_if(bad.any(), lambda: (
                f"prompt_ids: expected clean token ids in [0, {self.num_states})"
                + (f" other than the mask id {kernel.mask_id}" if kernel.mask_id is not None else "")
                + f", got values in [{int(prompt_ids.min())}, {int(prompt_ids.max())}]"))
        prompt = torch.full((B, L), PROMPT_FILL, dtype=torch.int64, device=self.device)  # generated positions
        prompt[:, :P] = prompt_ids
        return sampler.sample(B, L, prompt=prompt, generator=generator, progress=progress, device=self.device)

    # -- passthroughs -------------------------------------------------------------------------------------------

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        """Turn on the wrapped model's gradient (activation) checkpointing; it acts in ``train()`` mode."""
        enable = getattr(self._hf, "activation_checkpointing_enable", None)  # transformers >= 5 name
        (enable or self._hf.gradient_checkpointing_enable)(**kwargs)

    def gradient_checkpointing_disable(self) -> None:
        """Turn the wrapped model's gradient checkpointing off."""
        disable = getattr(self._hf, "activation_checkpointing_disable", None)
        (disable or self._hf.gradient_checkpointing_disable)()

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether the wrapped model checkpoints activations."""
        hf = self._hf
        flag = getattr(type(hf), "is_activation_checkpointing", None)
        return bool(hf.is_activation_checkpointing if flag is not None else hf.is_gradient_checkpointing)

    # -- save / load --------------------------------------------------------------------------------------------

    def _stamp(self, kernel: dict[str, Any] | None = None) -> dict[str, Any]:
        base_config = self.config.to_dict()
        base_config.pop("quantization_config", None)  # GGUF-loaded models: store the dequantised weights plainly
        dtype = self._hf.get_input_embeddings().weight.dtype
        stamp = {
            "unifusion_version": _library_version(),
            "bos_token_id": self.bos_token_id,
            "mask_token_id": self.mask_token_id,
            "added_mask_token": self.added_mask_token,
            "time_conditioning": self.time_conditioning,
            "model_type": self.config.model_type,
            "architecture": type(self._hf).__name__,
            "dtype": str(dtype).removeprefix("torch."),
            "base_config": base_config,
        }
        if kernel is not None:  # only when known: a folder without it reads in older versions without a warning
            stamp["kernel"] = kernel
        if self.block_size is not None:  # block models only: a plain model's folder is unchanged
            stamp["block_size"] = self.block_size
        return stamp

    def save_pretrained(self, save_directory: str | os.PathLike[str], tokenizer: Any = None, *,
                        kernel: Any = None) -> None:
        """Write ``unifusion_config.json`` and ``model.safetensors`` (tied weights stored once) to a directory, and
        the tokenizer's files next to them.

        Args:
            save_directory: the folder (created if missing).
            tokenizer: a Hugging Face tokenizer to save with the model (``tokenizer.save_pretrained``); default the
                one :func:`adapt_ar_model` was given (:attr:`tokenizer`). With a tokenizer in the folder,
                ``unifusion sample --model DIR`` and :meth:`from_pretrained` find it.
            kernel: the forward kernel the model was trained with (default :attr:`kernel`), recorded in the config
                as ``"kernel"`` (:func:`unifusion.models.kernel_config`) so that :meth:`from_pretrained` restores
                :attr:`kernel` and :meth:`generate` and ``unifusion sample``/``eval`` use it by default. Uniform,
                mask and hybrid kernels with a built-in schedule can be recorded; another kernel warns and is not.
        """
        from safetensors.torch import save_file

        from ._kernel_config import kernel_config
        from .kernels import Kernel

        kernel = kernel if kernel is not None else self.kernel
        kernel_entry = None
        if kernel is not None:
            if not isinstance(kernel, Kernel):
                raise TypeError(f"kernel: expected a unifusion Kernel or None, got {type(kernel).__name__}")
            V.check_model_kernel(self, kernel, who="save_pretrained")  # a Kernel that fits the model (mask id, S)
            kernel_entry = kernel_config(kernel)
            if kernel_entry is None:
                warnings.warn(f"kernel: {kernel!r} cannot be recorded in {CONFIG_NAME} (only uniform, mask and hybrid "
                              "kernels with a built-in schedule can); the saved model names no kernel", stacklevel=2)
        tok = tokenizer if tokenizer is not None else self.tokenizer
        if tok is not None and not callable(getattr(tok, "save_pretrained", None)):
            raise TypeError(f"tokenizer: expected a Hugging Face tokenizer (with save_pretrained), got "
                            f"{type(tok).__name__}")
        if self._hf is not self.base_model:
            raise TypeError(
                "save_pretrained: the base model is a peft model; merge the adapters first "
                "(adapt_ar_model(model.base_model.merge_and_unload(), ...)) or save them with peft")
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        with open(path / CONFIG_NAME, "w") as f:
            json.dump(self._stamp(kernel_entry), f, indent=2, sort_keys=True, default=str)
        # Tied tensors (same storage, shape and stride) are stored once; every tensor is copied out contiguously, so
        # parameters that are views into one flat buffer (DeepSpeed ZeRO-2, FSDP-gathered) save too.
        state: dict[str, torch.Tensor] = {}
        seen: set[tuple[Any, ...]] = set()
        for name, tensor in self.state_dict().items():
            key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
            if tensor.numel() and key in seen:
                continue
            seen.add(key)
            state[name] = tensor.detach().to("cpu", copy=True).contiguous()
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        if tok is not None:
            tok.save_pretrained(str(path))

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None, load_tokenizer: bool = True) -> DiffusionLM:
        """Rebuild a model written by :meth:`save_pretrained` (bit-identical weights), in eval mode, with its
        recorded training kernel as :attr:`kernel` (``None`` when none was recorded).

        Args:
            directory: a folder written by :meth:`save_pretrained` (it holds ``unifusion_config.json``).
            dtype: floating dtype of the weights (``torch.bfloat16`` or ``"bfloat16"``, ...); default: the dtype they
                were saved in.
            device: where to put the model; default CPU.
            load_tokenizer: load the tokenizer saved in the folder, if any, as :attr:`tokenizer`.

        Raises:
            ValueError: ``directory`` does not exist, is a plain Hugging Face model folder (load it with
                transformers and wrap it with :func:`adapt_ar_model`), is not a saved model at all, or its weights do
                not match its config.
        """
        import transformers
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory: expected a path, got {type(directory).__name__}")
        path = Path(directory)
        weights_dtype = _parse_dtype(dtype)
        if not path.exists():
            raise ValueError(f"directory: no such folder {str(path)!r}")
        if not path.is_dir():
            raise ValueError(f"directory: expected a folder written by DiffusionLM.save_pretrained, got the file "
                             f"{str(path)!r}")
        if not (path / CONFIG_NAME).is_file():
            if (path / "config.json").is_file():
                raise ValueError(
                    f"directory: {str(path)!r} is a plain Hugging Face model folder (config.json, no {CONFIG_NAME}); "
                    "load it with transformers and wrap it: adapt_ar_model(AutoModelForCausalLM.from_pretrained("
                    f"{str(path)!r}))")
            raise ValueError(f"directory: expected a folder written by DiffusionLM.save_pretrained (holding "
                             f"{CONFIG_NAME}), got {str(path)!r}")
        with open(path / CONFIG_NAME) as f:
            stamp = json.load(f)
        unknown = sorted(set(stamp) - _CONFIG_KEYS)
        if unknown:
            warnings.warn(f"{CONFIG_NAME}: ignoring unknown keys {unknown} (written by unifusion "
                          f"{stamp.get('unifusion_version', '?')})", stacklevel=2)
        base_config = dict(stamp["base_config"])
        model_type = base_config.pop("model_type", stamp.get("model_type"))
        config = AutoConfig.for_model(model_type, **base_config)
        saved_dtype = _parse_dtype(stamp.get("dtype", "float32"))
        build_dtype = weights_dtype if weights_dtype is not None else saved_dtype
        model_cls = getattr(transformers, stamp.get("architecture", ""), None)
        with _no_init():
            hf = (model_cls._from_config(config, dtype=build_dtype) if model_cls is not None
                  else AutoModelForCausalLM.from_config(config, dtype=build_dtype))
        hf.tie_weights()  # skipped under no_init_weights; the saved file holds tied tensors once
        model = cls(hf, bos_token_id=stamp["bos_token_id"], mask_token_id=stamp["mask_token_id"],
                    time_conditioning=stamp.get("time_conditioning", False),
                    added_mask_token=stamp.get("added_mask_token", False), block_size=stamp.get("block_size"))
        state = load_file(str(path / WEIGHTS_NAME), device=str(device) if device is not None else "cpu")
        missing, unexpected = model.load_state_dict(state, strict=False)
        # names left out of the file must be tied to a tensor that was loaded
        params = dict(model.state_dict(keep_vars=True))
        loaded_ptrs = {params[n].data_ptr() for n in state if n in params}
        untied = [n for n in missing if params[n].data_ptr() not in loaded_ptrs]
        if untied or unexpected:
            raise ValueError(f"directory: {WEIGHTS_NAME} does not match the model (missing {untied[:5]}, "
                             f"unexpected {list(unexpected)[:5]})")
        if device is not None:
            model.to(device)
        if stamp.get("kernel") is not None:  # the training kernel, recorded by save_pretrained
            from ._kernel_config import kernel_from_config

            model.kernel = kernel_from_config(stamp["kernel"], model.num_states, model.mask_token_id,
                                              name=f"{CONFIG_NAME}: kernel")
        if load_tokenizer and any((path / name).is_file() for name in _TOKENIZER_FILES):
            from transformers import AutoTokenizer

            try:
                model.tokenizer = AutoTokenizer.from_pretrained(str(path))
            except (OSError, ValueError) as err:
                warnings.warn(f"{str(path)!r}: the tokenizer files could not be loaded ({err}); model.tokenizer is "
                              "None", stacklevel=2)
        return model.eval()

    def extra_repr(self) -> str:
        return (f"family={self.family.model_type}, bos_token_id={self.bos_token_id}, "
                f"mask_token_id={self.mask_token_id}, num_states={self.num_states}, "
                f"time_conditioning={self.time_conditioning}"
                + (f", block_size={self.block_size}" if self.block_size is not None else ""))


_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "tokenizer.model")


def _parse_dtype(dtype: object) -> torch.dtype | None:
    """``None``, a floating ``torch.dtype`` or its name (``"bfloat16"``, ``"torch.float16"``) → the dtype."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"dtype: expected a floating torch dtype or its name, got {dtype!r}")
        dtype = value
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype (e.g. torch.bfloat16) or its name, got {type(dtype).__name__}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating dtype, got {dtype}")
    return dtype


@functools.cache
def _takes_logits_to_keep(model_cls: Any) -> bool:
    """Whether ``model_cls.forward`` names a ``logits_to_keep`` parameter: transformers' ``*ForCausalLM`` index the
    hidden states with it before ``lm_head`` (every supported family in transformers 5). Older releases (an int-only
    ``num_logits_to_keep``, or none) take :meth:`DiffusionLM._logits`'s backbone-then-head path."""
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(model_cls.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return False


@functools.lru_cache(maxsize=1)
def _has_is_causal_kwarg() -> bool:
    """Whether the installed transformers takes ``is_causal`` as a model keyword (``TransformersKwargs``, 5.x):
    its ``merge_with_config_defaults`` then switches the mask builders and attention modules to non-causal."""
    try:
        from transformers.utils import generic
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    kwargs = getattr(generic, "TransformersKwargs", None)
    return (kwargs is not None and "is_causal" in getattr(kwargs, "__annotations__", {})
            and hasattr(generic, "merge_with_config_defaults"))


def _no_init() -> Any:
    try:
        from transformers.initialization import no_init_weights
        return no_init_weights()
    except ImportError:  # pragma: no cover - older transformers
        import contextlib
        return contextlib.nullcontext()


def _library_version() -> str:
    try:
        from . import __version__
        return str(__version__)
    except ImportError:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("unifusion")
        except PackageNotFoundError:
            return "unknown"


# ----------------------------------------------------------------------------------------------------------
# entry point


def adapt_ar_model(model: nn.Module, *, bos_token_id: int | None = None, mask_token_id: int | None = None,
                   time_conditioning: bool = False, add_mask_token: bool = True, tokenizer: Any = None,
                   block_size: int | None = None) -> DiffusionLM:
    """Wrap a pretrained Hugging Face causal LM as a shifted x0 predictor (paper §3.2).

    Args:
        model: a ``*ForCausalLM`` of a supported family (``config.model_type``), possibly peft/LoRA-wrapped. It is
            wrapped, not copied.
        bos_token_id: token prepended internally; default ``config.bos_token_id``, else ``config.eos_token_id``.
        mask_token_id: absorbing-state token for mask/hybrid kernels. If ``None``, one token is **added**: the
            embeddings are resized in place to ``V + 1`` (``resize_token_embeddings``) and the new input (and untied
            output) row is set to the mean of the existing rows; the new id is ``V``.
        time_conditioning: add a learned, zero-initialised embedding of ``t`` to the input embeddings (the paper
            trains without one).
        add_mask_token: with ``mask_token_id=None``, whether to add the mask token. Pass ``False`` for uniform-noise
            training (the paper's setting): the vocabulary, and hence the AR model's logits, stay exactly as they
            are, and ``model.mask_token_id`` is ``None``.
        tokenizer: the model's Hugging Face tokenizer, kept as ``result.tokenizer`` (a plain attribute, not state)
            and written by :meth:`DiffusionLM.save_pretrained`, so the saved folder works with
            ``unifusion sample --model DIR``. It is not changed: an added mask token has no text form.
        block_size: ``K`` for block diffusion (:mod:`unifusion.hf.blocks`): :func:`~unifusion.diffusion_loss` then
            trains every block of K tokens at once, each seeing the clean blocks before it and its own noisy tokens;
            saved and restored with the model. ``None`` (default): one bidirectional block over the whole sequence.

    Returns:
        A :class:`DiffusionLM`; ``result.base_model`` is ``model``.
    """
    block_size = _blocks().check_block_size(block_size)
    if isinstance(model, DiffusionLM):
        warnings.warn("adapt_ar_model: the model is already a DiffusionLM; returning it unchanged", stacklevel=2)
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a Hugging Face causal LM (nn.Module), got {type(model).__name__}")
    hf = _unwrap_peft(model)
    config = getattr(hf, "config", None)
    if config is None or not hasattr(hf, "get_output_embeddings"):
        raise TypeError(f"model: expected a Hugging Face causal LM (a *ForCausalLM with a config), got "
                        f"{type(hf).__name__}; supported model types: {', '.join(supported_model_types())}")
    family_for(getattr(config, "model_type", None))  # ValueError listing the supported families
    head = hf.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise TypeError(f"model: expected a causal LM with an output head (e.g. LlamaForCausalLM), got "
                        f"{type(hf).__name__}, which has none")
    if not isinstance(time_conditioning, bool):
        raise TypeError(f"time_conditioning: expected a bool, got {type(time_conditioning).__name__}")
    V = int(hf.get_input_embeddings().weight.shape[0])

    if bos_token_id is None:
        bos_token_id = _first_id(getattr(config, "bos_token_id", None))
        if bos_token_id is None:
            bos_token_id = _first_id(getattr(config, "eos_token_id", None))
        if bos_token_id is None:
            raise ValueError("bos_token_id: the model config has neither bos_token_id nor eos_token_id; pass "
                             "bos_token_id= explicitly (the token prepended so position 1 has a predictor)")
    _check_id("bos_token_id", bos_token_id, V)

    if not isinstance(add_mask_token, bool):
        raise TypeError(f"add_mask_token: expected a bool, got {type(add_mask_token).__name__}")
    added = False
    if mask_token_id is None and not add_mask_token:
        pass  # uniform noise only: no absorbing state
    elif mask_token_id is None:
        _add_token(hf)
        mask_token_id, added = V, True
    else:
        _check_id("mask_token_id", mask_token_id, V)
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"tokenizer: expected a Hugging Face tokenizer (with save_pretrained), got "
                        f"{type(tokenizer).__name__}")
    return DiffusionLM(model, bos_token_id=bos_token_id, mask_token_id=mask_token_id,
                       time_conditioning=time_conditioning, added_mask_token=added, tokenizer=tokenizer,
                       block_size=block_size)


def _blocks() -> Any:
    """The block-diffusion module (imported lazily: it is a layer above this one)."""
    from .hf import blocks
    return blocks


def _check_id(name: str, value: Any, vocab_size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int token id, got {type(value).__name__}")
    if not 0 <= value < vocab_size:
        raise ValueError(f"{name}: expected a token id in [0, {vocab_size}), got {value}")


@torch.no_grad()
def _add_token(hf: Any) -> None:
    """Grow the vocabulary by one row; the new row is the mean of the existing ones (input and untied output)."""
    V = int(hf.get_input_embeddings().weight.shape[0])
    hf.resize_token_embeddings(V + 1, mean_resizing=False)
    w_in = hf.get_input_embeddings().weight
    w_in[V] = w_in[:V].mean(0)
    head = hf.get_output_embeddings()
    if head.weight is not w_in:
        head.weight[V] = head.weight[:V].mean(0)
    if getattr(head, "bias", None) is not None:
        head.bias[V] = head.bias[:V].mean()
