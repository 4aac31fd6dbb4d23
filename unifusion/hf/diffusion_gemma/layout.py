"""Where the prompt and the canvases of a DiffusionGemma batch lie, and what each canvas position may attend to.

A row of ``x_t (B, L)`` is ``[left padding | prompt | response | right padding]``. The prompt is the clean prefix the
encoder reads; the response is cut into canvases of ``K = canvas_length`` tokens from the end of the prompt on, the
way ``DiffusionGemmaForBlockDiffusion.generate`` commits them:

    canvas c of row b = columns [s_b + cK, s_b + (c + 1)K) ∩ [s_b, e_b),    s_b = end of the prompt, e_b = end of the
                                                                             real tokens (the last canvas may be short)

The prediction for a position of canvas c sees, through the decoder:

* the clean prefix, columns [f_b, s_b + cK) (f_b = first real column), as keys and values the causal encoder wrote:
  every one of them in full-attention layers, the last ``W − 1`` of them in sliding-window layers (a
  ``DynamicCache`` keeps ``W − 1`` tokens of a sliding layer; ``W = config.sliding_window``);
* every real position of canvas c itself (bidirectionally), nothing of later canvases and nothing noisy of earlier
  ones.

Position ids count real tokens (``column − f_b``), so a left-padded row equals the unpadded one.

All canvases of a batch run in one decoder call: canvas c of row b is row ``b · n_c + c`` of a folded batch of
``B · n_c`` canvases, each with its own view of the encoder's keys: in full-attention layers all ``L_enc`` of them
with a mask that keeps the canvas's prefix, in sliding-window layers only the ``W − 1`` columns before the canvas
(gathered per canvas, so these layers cost ``W − 1`` keys per canvas, not ``L_enc``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange

__all__ = ["CanvasLayout", "canvas_layout", "decoder_masks", "prompt_bounds"]


@dataclass(frozen=True)
class CanvasLayout:
    """The canvases of a batch (built by :func:`canvas_layout`).

    Attributes:
        length: ``L``, the columns of ``x_t``.
        canvas_length: ``K``.
        num_canvases: ``n_c``, canvases of the longest response (shorter rows have empty canvases at the end).
        width: positions per canvas in the decoder call: ``K``, or the longest response when it fits one canvas.
        encoder_length: columns ``[0, L_enc)`` the encoder reads: the clean prefix of the last canvas.
        columns: ``(B, n_c, width)`` int64 column of each canvas slot (clipped into ``[0, L)`` where ``valid`` is
            False).
        valid: ``(B, n_c, width)`` bool, True where the slot holds a real response token.
        first, start, end: ``(B,)`` int64 first real column ``f_b``, first response column ``s_b`` and end of the
            real tokens ``e_b``.
        plain: one canvas per row, no padding, one prompt length: the decoder needs no mask (the computation is
            then exactly the reference model's own forward).
    """

    length: int
    canvas_length: int
    num_canvases: int
    width: int
    encoder_length: int
    columns: torch.Tensor
    valid: torch.Tensor
    first: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    plain: bool

    def prefix_end(self) -> torch.Tensor:
        """``(B, n_c)`` end (exclusive) of the clean prefix of each canvas: ``s_b + cK``."""
        c = torch.arange(self.num_canvases, device=self.start.device)
        return self.start[:, None] + self.canvas_length * c[None, :]

    def window(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``size`` encoder columns before each canvas: ``(B, n_c, size)`` columns (clipped into
        ``[0, L_enc)``) and whether each is a real prefix column (``≥ f_b`` and ``< L_enc``)."""
        cols = self.prefix_end()[..., None] - size + torch.arange(size, device=self.start.device)
        valid = (cols >= self.first[:, None, None]) & (cols < self.encoder_length)
        return cols.clamp(0, self.encoder_length - 1), valid

    def canvas_keys(self) -> torch.Tensor:
        """``(B, n_c, width)`` bool: the canvas slots a canvas attends to: its real ones; every slot of a canvas
        with none (past a short response: its outputs are dropped, and no attention row may be empty)."""
        return self.valid | ~self.valid.any(-1, keepdim=True)

    def response(self) -> torch.Tensor:
        """``(B, L)`` bool, True on the response columns ``[s_b, e_b)`` (the positions the decoder predicts)."""
        j = torch.arange(self.length, device=self.start.device)
        return (j >= self.start[:, None]) & (j < self.end[:, None])

    def fold(self, x: torch.Tensor) -> torch.Tensor:
        """Gather the canvas slots of ``x (B, L, ...)`` → ``(B · n_c, width, ...)``."""
        B = x.shape[0]
        idx = self.columns.reshape(B, -1)  # (B, n_c · width)
        idx = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:])
        return rearrange(x.gather(1, idx), "b (c w) ... -> (b c) w ...", c=self.num_canvases)

    def flat_rows(self) -> torch.Tensor:
        """``(B · n_c · width,)`` row of each canvas slot in ``x.reshape(B · L + 1, ...)``: ``b · L + column`` for a
        real slot, the spare last row ``B · L`` for the others (so they can be written and dropped)."""
        B = self.columns.shape[0]
        rows = self.columns + self.length * torch.arange(B, device=self.columns.device)[:, None, None]
        return torch.where(self.valid, rows, B * self.length).reshape(-1)

    def unfold(self, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write folded canvas values ``(B · n_c, width, ...)`` into ``out (B · L + 1, ...)`` (in place, rows of
        :meth:`flat_rows`; the other rows keep their contents, the last one is spare) and return ``(B, L, ...)``, a
        view of ``out``. Differentiable in ``values``."""
        B, L = self.columns.shape[0], self.length
        out.index_copy_(0, self.flat_rows(), values.reshape(-1, *values.shape[2:]).to(out.dtype))
        return out[: B * L].view(B, L, *out.shape[1:])


def prompt_bounds(x_t: torch.Tensor, prompt_mask: Any, prompt_length: Any,
                  attention_mask: torch.Tensor | None) -> tuple[list[int], list[int], list[int]]:
    """Host lists ``(f, s, e)``: per row the first real column, the first response column and the end of the real
    tokens, from ``prompt_mask (B, L)`` bool or ``prompt_length`` (an int or ``(B,)`` ints: the prompt's tokens,
    counted from the first real one), and ``attention_mask`` (contiguous real tokens, checked by the caller).

    One read of the masks to the host (the shapes of the decoder call depend on them), none for an int
    ``prompt_length`` without ``attention_mask``.
    """
    B, L = x_t.shape
    if (prompt_mask is None) == (prompt_length is None):
        raise ValueError("prompt_mask, prompt_length: give exactly one: DiffusionGemma's decoder reads the clean "
                         "prefix (the prompt, at least one token such as BOS) from its encoder")
    if attention_mask is None:
        first, end = [0] * B, [L] * B
    else:
        real = attention_mask.to("cpu", torch.bool)
        n_real = real.sum(-1)
        lead = (real.long().cumsum(-1) == 0).sum(-1)
        first, end = lead.tolist(), (lead + n_real).tolist()
    if prompt_mask is not None:
        if not isinstance(prompt_mask, torch.Tensor) or prompt_mask.dtype != torch.bool:
            what = prompt_mask.dtype if isinstance(prompt_mask, torch.Tensor) else type(prompt_mask).__name__
            raise TypeError(f"prompt_mask: expected a ({B}, {L}) bool tensor (True on prompt tokens), got {what}")
        if tuple(prompt_mask.shape) != (B, L):
            raise ValueError(f"prompt_mask: expected shape ({B}, {L}) like x_t, got {tuple(prompt_mask.shape)}")
        pm = prompt_mask.to("cpu")
        lengths = pm.sum(-1).tolist()
        cols = torch.arange(L)
        f_, n_ = torch.tensor(first), torch.tensor(lengths)
        expected = (cols[None, :] >= f_[:, None]) & (cols[None, :] < (f_ + n_)[:, None])
        bad = (pm != expected).any(-1).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"prompt_mask: row {bad[0]} is not a prefix of the row's real tokens (the prompt is the "
                             "clean prefix: True from the first real token on, then False)")
    elif isinstance(prompt_length, int) and not isinstance(prompt_length, bool):
        lengths = [prompt_length] * B
    elif isinstance(prompt_length, torch.Tensor) and prompt_length.dim() == 1 and prompt_length.shape[0] == B \
            and not prompt_length.dtype.is_floating_point and prompt_length.dtype != torch.bool:
        lengths = prompt_length.tolist()
    else:
        what = (f"a tensor of shape {tuple(prompt_length.shape)} and dtype {prompt_length.dtype}"
                if isinstance(prompt_length, torch.Tensor) else repr(prompt_length))
        raise TypeError(f"prompt_length: expected an int or a ({B},) integer tensor, got {what}")
    start = [f + n for f, n in zip(first, lengths)]
    for b, (n, s, e) in enumerate(zip(lengths, start, end)):
        if n < 1:
            raise ValueError(f"prompt_{'mask' if prompt_mask is not None else 'length'}: row {b} has no prompt token; "
                             "DiffusionGemma conditions every canvas on a clean prefix (at least one token, e.g. BOS)")
        if s >= e:
            raise ValueError(f"prompt_{'mask' if prompt_mask is not None else 'length'}: the prompt covers the whole "
                             f"of row {b} ({n} of its {e - (s - n)} real tokens); nothing is left to predict")
    return first, start, end


def canvas_layout(first: list[int], start: list[int], end: list[int], length: int, canvas_length: int,
                  device: torch.device) -> CanvasLayout:
    """The :class:`CanvasLayout` of rows with first real column ``first``, response start ``start`` and end ``end``
    (host ints, as :func:`prompt_bounds` returns them) in sequences of ``length`` columns."""
    K = canvas_length
    responses = [e - s for s, e in zip(start, end)]
    n_c = max(math.ceil(r / K) for r in responses)
    width = K if n_c > 1 else max(responses)
    encoder_length = min(length, max(start) + (n_c - 1) * K)
    f = torch.tensor(first, device=device)
    s = torch.tensor(start, device=device)
    e = torch.tensor(end, device=device)
    slot = K * torch.arange(n_c, device=device)[:, None] + torch.arange(width, device=device)[None, :]  # (n_c, w)
    columns = s[:, None, None] + slot[None]  # (B, n_c, width)
    valid = columns < e[:, None, None]
    plain = n_c == 1 and len(set(start)) == 1 and not any(first) and all(x == length for x in end)
    return CanvasLayout(length=length, canvas_length=K, num_canvases=n_c, width=width,
                        encoder_length=encoder_length, columns=columns.clamp_max(length - 1), valid=valid,
                        first=f, start=s, end=e, plain=plain)


def decoder_masks(layout: CanvasLayout, window: int | None, *, additive: bool, dtype: torch.dtype
                  ) -> dict[str, Any]:
    """The decoder's attention masks ``{"full_attention", "sliding_attention"}``, one row per canvas (every query of
    a canvas sees the same keys): ``(B · n_c, 1, 1, L_enc + width)`` for full layers (the encoder's columns, then the
    canvas's slots), ``(B · n_c, 1, 1, window + width)`` for sliding layers, whose keys are the ``window`` columns of
    :meth:`CanvasLayout.window` (``window = min(W − 1, L_enc)``). True = attend (SDPA); with ``additive``,
    0 / ``finfo(dtype).min`` (eager attention adds the mask to the scores). ``None`` masks when ``layout.plain``."""
    if layout.plain:
        return {"full_attention": None, "sliding_attention": None}
    B, n_c = layout.columns.shape[0], layout.num_canvases
    j = torch.arange(layout.encoder_length, device=layout.columns.device)  # (L_enc,)
    seen = (j >= layout.first[:, None, None]) & (j < layout.prefix_end()[..., None])  # (B, n_c, L_enc)
    masks = {"full_attention": seen}
    if window is not None:
        masks["sliding_attention"] = layout.window(window)[1]
    canvas = layout.canvas_keys()
    out: dict[str, Any] = {}
    for name, m in masks.items():
        m = torch.cat([m, canvas], dim=-1).reshape(B * n_c, 1, 1, -1)
        if additive:
            m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)
        out[name] = m
    return out
