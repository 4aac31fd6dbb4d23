"""The setup and bookkeeping of :class:`~unifusion.samplers.PolicySampler` runs (private): token-id and attention-mask
checks, the block grid, the time passed to the model, EOS stopping, and the run's per-row state.

Nothing here reads a value back to the host except :func:`row_starts` (once per run) and the sampler's loop itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from .. import _validation as V
from .._device import host_to_device
from ..kernels import InterpolatingKernel, Kernel
from ..schedules import LinearSchedule
from .policies.protocol import RowRandomness

TIME_EPS = 1e-3
"""The times passed to the model are clamped to [ε, 1 − ε] (the samplers' default ε: t_0 = 1 − ε)."""


def check_token_id(name: str, value: object, kernel: Kernel) -> int | None:
    """``None`` or a clean token id: an int in ``[0, num_states)`` that is not the mask state."""
    if value is None:
        return None
    value = V.check_token_id(name, value, kernel.num_states)
    if kernel.mask_id is not None and value == kernel.mask_id:
        raise ValueError(f"{name}: is the kernel's mask id {value}; a generated token is never the mask state")
    return value


def check_eos_ids(name: str, value: object, kernel: Kernel) -> int | tuple[int, ...] | None:
    """``None``, one EOS id (an int) or several (a non-empty list or tuple of ints, kept as a tuple; one id becomes
    an int): each a clean token id as :func:`check_token_id` says."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) == 0:
            raise ValueError(f"{name}: expected an int or a non-empty list of ints, got an empty "
                             f"{type(value).__name__}")
        ids = tuple(check_token_id(name, v, kernel) for v in value)
        return cast(tuple[int, ...], ids) if len(ids) > 1 else ids[0]
    return check_token_id(name, value, kernel)


def first_id(eos_id: int | Sequence[int]) -> int:
    """The first of several EOS ids (the default fill), or the one id."""
    return eos_id if isinstance(eos_id, int) else int(eos_id[0])


def takes_attention_mask(model: object) -> bool:
    """Whether the model's ``forward`` (or the callable itself) accepts an ``attention_mask=`` keyword."""
    fn = getattr(model, "forward", model)
    try:
        parameters = inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True  # no signature to read: let the call decide
    return "attention_mask" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def resolve_attention_mask(attention_mask: object, batch_size: int, seq_len: int, keep: torch.Tensor,
                           device: torch.device) -> torch.Tensor | None:
    """``attention_mask`` as ``(B, L)`` bool on ``device`` (True = a real token), or ``None``.

    Accepted: bool or 0/1 integers of shape ``(B, P)``, ``(1, P)`` or ``(P,)`` with P ≤ L (a tokenizer's mask over
    the prompt columns; the columns after P are real). Padding must be on the left (``0 … 0 1 … 1``) and only at
    kept prompt positions. Value checks are queued (:func:`unifusion._validation.fail_if`).
    """
    if attention_mask is None:
        return None
    mask = V.check_tensor("attention_mask", attention_mask)
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"attention_mask: expected a bool or 0/1 integer tensor, got dtype {mask.dtype}")
    given = tuple(mask.shape)
    if mask.dim() == 1:
        mask = mask[None]
    if mask.dim() != 2 or mask.shape[0] not in (1, batch_size) or not 0 < mask.shape[1] <= seq_len:
        raise ValueError(f"attention_mask: expected shape ({batch_size}, P) with P <= seq_len = {seq_len} (the "
                         f"prompt columns; later columns are real tokens), got {given}")
    mask = host_to_device(mask, device).ne(0).expand(batch_size, -1)
    mask = torch.cat([mask, mask.new_ones((batch_size, seq_len - mask.shape[1]))], dim=1)
    if V.validation_enabled():
        V.fail_if((mask[:, 1:] < mask[:, :-1]).any(), lambda: (
            "attention_mask: expected left padding (0 ... 0 1 ... 1 per row), got a row with a real token before a "
            "pad"))
        V.fail_if((~mask & ~keep).any(), lambda: (
            "attention_mask: marks a position as padding where the prompt generates (-1 / keep_mask False); pads "
            "are kept prompt positions holding the pad id"))
    return mask


@dataclass
class BlockGrid:
    """The blocks of a run: block b of row r covers columns ``starts[r] + b·width … + width − 1`` (clipped at L),
    where ``starts[r]`` is the row's first generated column."""

    starts: torch.Tensor  # (B,) int64 on the device
    starts_host: list[int]
    width: int  # K
    num_blocks: int
    seq_len: int

    def columns(self, b: int) -> tuple[torch.Tensor, int]:
        """``(cols (B, K_b), K_b)``: the columns of block ``b`` (K_b = its widest row), ``seq_len`` (a scratch
        column) where a row's block ends before the others'."""
        K_b = min(self.width, self.seq_len - min(self.starts_host) - b * self.width)
        cols = self.starts.unsqueeze(-1) + b * self.width + torch.arange(K_b, device=self.starts.device)
        return cols.clamp_max(self.seq_len), K_b


def row_starts(generated: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Each row's first generated column (L for a row with none), on the device and on the host (one sync)."""
    L = generated.shape[1]
    first = torch.where(generated.any(-1), generated.int().argmax(-1), torch.full_like(generated[:, 0], L,
                                                                                    dtype=torch.long))
    starts = first.long()
    return starts, starts.tolist()


def block_starts(block_start: object, block_size: int | None, starts_host: list[int], device: torch.device
                 ) -> tuple[torch.Tensor, list[int]]:
    """Every row's first block starting at ``block_start`` (``PolicySampler.sample``'s argument, checked against the
    rows' generated starts ``starts_host`` and ``block_size``): ``(B,)`` on ``device`` and on the host."""
    if block_size is None:
        raise ValueError("block_start: places the first block of a block decoder; pass block_size too")
    if isinstance(block_start, bool) or not isinstance(block_start, int):
        raise TypeError(f"block_start: expected an int column or None, got {type(block_start).__name__}")
    lead = [s - block_start for s in starts_host]
    if min(lead) < 0 or max(lead) >= block_size:
        raise ValueError(f"block_start: expected a column at most block_size - 1 = {block_size - 1} before "
                         f"every row's generated start {sorted(set(starts_host))[:4]}, got {block_start}")
    return torch.full((len(starts_host),), block_start, dtype=torch.long, device=device), [block_start] * len(lead)


@dataclass
class PolicyRun:
    """The state of one :meth:`~unifusion.samplers.PolicySampler.sample` call; tensors over all B rows, tokens with
    one scratch column (index L) where rows whose block ends early read and write."""

    x: torch.Tensor  # (B, L + 1) int64
    undecided: torch.Tensor  # (B, L + 1) bool: generated positions not final yet
    generated: torch.Tensor  # (B, L) bool: positions the prompt does not keep
    num_generated: torch.Tensor  # (B,) float
    finished: torch.Tensor  # (B,) bool: stopped at EOS
    eos_at: torch.Tensor  # (B,) int64: first EOS column of a finished row, else L
    forwards: torch.Tensor  # (B,) int64
    attention_mask: torch.Tensor | None
    grid: BlockGrid
    generator: Any  # None, one generator, or a tuple of B
    block_state: Any = None  # the BlockDenoiser's state (None on the x0 path)
    checked: bool = False  # the first model output has been checked
    commit_step: torch.Tensor | None = None  # (B, L + 1) int64, -1 where nothing was committed (return_trace)
    commit_logprob: torch.Tensor | None = None  # (B, L + 1) float32, 0 where nothing was committed (return_trace)
    commit_logits: torch.Tensor | None = None  # (B, L + 1, S) float32, 0 where nothing was committed (return_logits)

    def forget_commits(self, rows: torch.Tensor | None, after: torch.Tensor) -> None:
        """Drop the trace at the positions ``after`` ``(B_a, L)`` of ``rows`` (all rows for ``None``): their tokens
        became the fill."""
        if self.commit_step is None or self.commit_logprob is None:
            return
        L = after.shape[1]
        step = self.commit_step[:, :L] if rows is None else self.commit_step[rows, :L]
        logp = self.commit_logprob[:, :L] if rows is None else self.commit_logprob[rows, :L]
        step, logp = step.masked_fill(after, -1), logp.masked_fill(after, 0.0)
        if rows is None:
            self.commit_step[:, :L], self.commit_logprob[:, :L] = step, logp
        else:
            self.commit_step[rows, :L], self.commit_logprob[rows, :L] = step, logp
        if self.commit_logits is not None:
            full = torch.zeros_like(self.commit_step, dtype=torch.bool)
            if rows is None:
                full[:, :L] = after
            else:
                full[rows, :L] = after
            self.commit_logits.masked_fill_(full.unsqueeze(-1), 0.0)

    def randomness(self, rows: torch.Tensor, rows_host: list[int]) -> RowRandomness:
        g = self.generator
        if g is None or isinstance(g, torch.Generator):
            return RowRandomness(g, rows, self.x.shape[0])
        return RowRandomness(tuple(g[r] for r in rows_host), rows, self.x.shape[0])

    def running(self, active: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The running rows (``active`` ``(B,)`` bool), on the device and the host (the step's one host sync)."""
        rows, rows_host, _ = self.running_counts(active.long())
        return rows, rows_host

    def running_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, list[int], int]:
        """The rows with ``counts`` ``(B,)`` above 0, on the device and the host, and the largest count (the step's
        one host sync)."""
        host = counts.tolist()
        rows_host = [i for i, c in enumerate(host) if c > 0]
        most = max(host, default=0)
        return host_to_device(torch.tensor(rows_host, dtype=torch.long), self.x.device), rows_host, int(most)


def noise_time(kernel: Kernel, fraction: torch.Tensor) -> torch.Tensor:
    """The time t at which the kernel has noised the given fraction of positions, 1 − α_t = fraction, clamped to
    [ε, 1 − ε] (:data:`TIME_EPS`), float32 ``(B,)``: what the model is told about the noise level of x_t.

    Closed form for the linear schedule (t = fraction); otherwise 40 bisection steps on α_t (non-increasing)."""
    fraction = fraction.double() if fraction.device.type != "mps" else fraction.float()
    if isinstance(getattr(kernel, "schedule", None), LinearSchedule) or not isinstance(kernel, InterpolatingKernel):
        t = fraction
    else:
        lo, hi = torch.zeros_like(fraction), torch.ones_like(fraction)
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            too_clean = 1.0 - kernel.coefficients(mid)[0] < fraction
            lo, hi = torch.where(too_clean, mid, lo), torch.where(too_clean, hi, mid)
        t = 0.5 * (lo + hi)
    return t.clamp(TIME_EPS, 1.0 - TIME_EPS).float()


def first_eos(tokens: torch.Tensor, generated: torch.Tensor, eos_id: int | Sequence[int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(has (B,), index (B,))``: whether each row has EOS (any of the ids, when several) at a generated position,
    and the first such column."""
    ids = (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
    is_eos = tokens == ids[0]
    for other in ids[1:]:
        is_eos = is_eos | (tokens == other)
    is_eos = is_eos & generated
    return is_eos.any(-1), is_eos.int().argmax(-1)


def eos_stop(tokens: torch.Tensor, undecided: torch.Tensor, generated: torch.Tensor, eos_id: int | Sequence[int],
             fill_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """EOS stopping for the rows given ``(B, L)`` (``eos_id``: one id or several, any of which stops a row): a row is
    done when a generated position holds a decided EOS and
    every generated position before it is decided. Returns ``(done (B,), first EOS column (B,), tokens,
    undecided)`` with every generated position after the first EOS of a done row set to ``fill_id`` and decided
    (kept prompt positions stay as they are)."""
    L = tokens.shape[1]
    has, first = first_eos(torch.where(undecided, -1, tokens), generated, eos_id)
    col = torch.arange(L, device=tokens.device)
    open_before = (undecided & (col < first.unsqueeze(-1))).any(-1)
    done = has & ~open_before
    after = done.unsqueeze(-1) & generated & (col > first.unsqueeze(-1))
    return done, first, torch.where(after, fill_id, tokens), undecided & ~after
