"""Teacher trajectories: what a decoder generated and in which order, recorded once and trained on many times.

A trajectory is one row of :func:`unifusion.samplers.generate` with ``return_trace=True``: the prompt, the
completion and, for every completion token, the model call at which the decoder committed it
(:attr:`unifusion.samplers.PolicyOutput.commit_step`). dParallel and d3LLM distil a model on its own (greedy)
answers; d3LLM keeps only the verified ones and masks them along the teacher's order
(:func:`unifusion.distill.pseudo_trajectory_mask`).

**Layout.** Prompts are left-padded to a common length ``P``, a multiple of the block size ``K``, so that the
completion starts at a block boundary in every row: a block model's training forward (``model(x_t, t, clean=x_0)``)
then cuts its blocks exactly where the decoder cut them, and block ``b`` of the completion is columns
``[bK, (b + 1)K)`` of :attr:`Trajectories.completion_ids`. A padded row generates the same tokens as the row alone
(``generate``'s padding rule), so the padding changes no trajectory.

A model kind whose blocks start at the sequence's first token (``Denoiser.block_origin == "sequence_start"``: SDAR,
LLaDA 2, Fast-dLLM v2) decodes the prompt's last ``n mod K`` tokens (n its real length) with the first completion
tokens: the trajectories record that origin (:attr:`Trajectories.block_origin`), and the completion's blocks are
cut after each row's :attr:`Trajectories.block_leads` (the first block of the completion is ``K − lead`` columns,
the masks of :mod:`unifusion.distill.masks` take ``lead=``, and the distillation forward runs each row with its
first real token on a block boundary, :mod:`unifusion.block_partition`).

Example::

    traj = uf.distill.record_trajectories(model, prompts, max_new_tokens=64, reward_fn=is_correct)
    traj.save("teacher.safetensors")
    traj = uf.distill.Trajectories.load("teacher.safetensors")
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import _validation as V
from ..block_partition import block_origin_of, shift_right
from ..denoiser import BLOCK_ORIGINS, BlockOrigin, DecodableModel
from ..samplers.generation import generate, model_pad_token_id

__all__ = ["Trajectories", "record_trajectories", "RewardFn"]

_FORMAT = "unifusion.distill.trajectories/1"
_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "commit_step", "num_forwards")

RewardFn = Callable[[list[list[int]], list[list[int]]], Sequence[Any]]
"""``reward_fn(prompts, completions)``: the unpadded prompt ids and the completion ids (up to and including the first
EOS) of a batch, as lists of ints; one value per row, a row is kept where it is truthy (``True``, a reward > 0)."""


@dataclass(frozen=True)
class Trajectories:
    """Recorded decoder trajectories (rows of one layout; module docstring).

    Attributes:
        prompt_ids: ``(N, P)`` int64, left-padded prompts (``P`` a multiple of ``block_size``).
        prompt_mask: ``(N, P)`` bool, ``True`` at real prompt tokens.
        completion_ids: ``(N, C)`` int64, the generated tokens (EOS fill included).
        commit_step: ``(N, C)`` int64, the model call at which each completion token was committed
            (:attr:`~unifusion.samplers.PolicyOutput.commit_step`), ``-1`` only on the fill after a row's EOS.
        num_forwards: ``(N,)`` int64, model calls the row took (prefill and commit passes included).
        block_size: ``K``, the decoder's block size.
        block_origin: where the decoder's blocks started (``Denoiser.block_origin``): ``"prompt_end"`` (default;
            the completion's blocks from its first column) or ``"sequence_start"`` (from each row's first real
            token: :attr:`block_leads`).

    A step that is not below its row's ``num_forwards``, a ``-1`` before a committed position, a block with a step
    below one of an earlier block (blocks are decoded in order), or shapes that do not match are ``ValueError`` s
    naming the field.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    commit_step: torch.Tensor
    num_forwards: torch.Tensor
    block_size: int
    block_origin: BlockOrigin = "prompt_end"

    def __post_init__(self) -> None:
        K = V.check_positive_int("block_size", self.block_size)
        if self.block_origin not in BLOCK_ORIGINS:
            raise ValueError(f"block_origin: expected one of {BLOCK_ORIGINS}, got {self.block_origin!r}")
        for name in _KEYS:
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor, got {type(value).__name__}")
        N, P = self.prompt_ids.shape if self.prompt_ids.dim() == 2 else (-1, -1)
        if N < 0 or P % K:
            raise ValueError(f"prompt_ids: expected (N, P) with P a multiple of block_size={K} (left-padded), got "
                             f"{tuple(self.prompt_ids.shape)}")
        if tuple(self.prompt_mask.shape) != (N, P) or self.prompt_mask.dtype != torch.bool:
            raise ValueError(f"prompt_mask: expected a ({N}, {P}) bool tensor like prompt_ids, got "
                             f"{tuple(self.prompt_mask.shape)} {self.prompt_mask.dtype}")
        if self.completion_ids.dim() != 2 or self.completion_ids.shape[0] != N:
            raise ValueError(f"completion_ids: expected ({N}, C), got {tuple(self.completion_ids.shape)}")
        C = self.completion_ids.shape[1]
        for name in ("prompt_ids", "completion_ids", "commit_step", "num_forwards"):
            if not V.is_integer_dtype(getattr(self, name).dtype):
                raise TypeError(f"{name}: expected an integer tensor, got {getattr(self, name).dtype}")
        if tuple(self.commit_step.shape) != (N, C):
            raise ValueError(f"commit_step: expected ({N}, {C}) like completion_ids, got "
                             f"{tuple(self.commit_step.shape)}")
        if tuple(self.num_forwards.shape) != (N,):
            raise ValueError(f"num_forwards: expected ({N},), got {tuple(self.num_forwards.shape)}")
        step = self.commit_step
        bad_range = (step < -1) | (step >= self.num_forwards[:, None])
        V.fail_if(bad_range.any(), lambda: (
            f"commit_step: expected steps in [-1, num_forwards) (the row's model calls), got rows "
            f"{bad_range.any(-1).nonzero().flatten().tolist()[:8]} outside"))
        uncommitted = step < 0
        hole = uncommitted[:, :-1] & ~uncommitted[:, 1:]  # a -1 followed by a committed token
        V.fail_if(hole.any(), lambda: (
            f"commit_step: -1 (not committed) is only the fill after EOS, a suffix of the row; rows "
            f"{hole.any(-1).nonzero().flatten().tolist()[:8]} have committed tokens after one"))
        lead = self.block_leads
        width = C + int(lead.max()) if N else C
        nb = -(-width // K)
        if nb > 1:
            padded = shift_right(step, lead, nb * K, -1).unflatten(-1, (nb, K))
            big = torch.iinfo(torch.int64).max
            lo = torch.where(padded >= 0, padded, big).amin(-1)  # (N, nb)
            hi = padded.amax(-1)
            running = torch.cummax(hi, -1).values
            order = (lo[:, 1:] != big) & (lo[:, 1:] <= running[:, :-1])
            V.fail_if(order.any(), lambda: (
                f"commit_step: a block's steps must all follow the earlier blocks' (blocks of {K} are decoded in "
                f"order); rows {order.any(-1).nonzero().flatten().tolist()[:8]} do not: a trace of another block "
                "size or of other tokens?"))

    def __len__(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def block_leads(self) -> torch.Tensor:
        """``(N,)`` int64: the prompt tokens in the block holding each row's first completion column — 0 with
        ``block_origin="prompt_end"``, the real prompt length mod K with ``"sequence_start"``. Completion column c is
        in the row's block ``⌊(c + lead) / K⌋``."""
        if self.block_origin == "prompt_end":
            return torch.zeros(self.prompt_mask.shape[0], dtype=torch.long, device=self.prompt_mask.device)
        return self.prompt_mask.sum(-1) % self.block_size

    @property
    def prompt_length(self) -> int:
        """``P``, the padded prompt length (a multiple of :attr:`block_size`)."""
        return int(self.prompt_ids.shape[1])

    @property
    def sequences(self) -> torch.Tensor:
        """``(N, P + C)`` prompt and completion: the clean ``x_0`` of training."""
        return torch.cat([self.prompt_ids, self.completion_ids], 1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """``(N, P + C)`` bool, ``False`` at the prompt's left padding."""
        return torch.cat([self.prompt_mask, torch.ones_like(self.completion_ids, dtype=torch.bool)], 1)

    @property
    def tokens_per_forward(self) -> torch.Tensor:
        """``(N,)`` float32: committed completion tokens / model calls."""
        return (self.commit_step >= 0).sum(-1).float() / self.num_forwards.clamp_min(1).float()

    def select(self, rows: torch.Tensor | Sequence[int] | slice) -> Trajectories:
        """The trajectories of ``rows`` (indices, a bool mask or a slice), as a new :class:`Trajectories`."""
        index = rows if isinstance(rows, (torch.Tensor, slice)) else torch.as_tensor(list(rows), dtype=torch.long)
        return Trajectories(**{k: getattr(self, k)[index] for k in _KEYS}, block_size=self.block_size,
                            block_origin=self.block_origin)

    def to(self, device: torch.device | str) -> Trajectories:
        """The same trajectories on ``device``."""
        return Trajectories(**{k: getattr(self, k).to(device) for k in _KEYS}, block_size=self.block_size,
                            block_origin=self.block_origin)

    @staticmethod
    def concatenate(parts: Sequence[Trajectories]) -> Trajectories:
        """Rows of several recordings of one layout (same ``P``, ``C`` and block size), in order."""
        if not parts:
            raise ValueError("parts: expected at least one Trajectories, got none")
        first = parts[0]

        def layout(t: Trajectories) -> tuple[int, str, int, int]:
            return t.block_size, t.block_origin, t.prompt_length, int(t.completion_ids.shape[1])

        for p in parts[1:]:
            if layout(p) != layout(first):
                raise ValueError("parts: expected one layout (block size and origin, prompt and completion lengths), "
                                 f"got {layout(first)} and {layout(p)}")
        return Trajectories(**{k: torch.cat([getattr(p, k) for p in parts]) for k in _KEYS},
                            block_size=first.block_size, block_origin=first.block_origin)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the tensors, the block size and the block origin to one safetensors file."""
        from safetensors.torch import save_file

        save_file({k: getattr(self, k).detach().cpu().contiguous() for k in _KEYS}, os.fspath(path),
                  metadata={"format": _FORMAT, "block_size": json.dumps(self.block_size),
                            "block_origin": self.block_origin})

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, device: torch.device | str = "cpu") -> Trajectories:
        """Read what :meth:`save` wrote (validated as the constructor validates)."""
        from safetensors import safe_open

        with safe_open(os.fspath(path), framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            if meta.get("format") != _FORMAT:
                raise ValueError(f"path: {os.fspath(path)!r} is not a trajectories file (format "
                                 f"{meta.get('format')!r}, "
                                 f"expected {_FORMAT!r})")
            tensors = {k: f.get_tensor(k) for k in _KEYS}
        return cls(**tensors, block_size=int(json.loads(meta["block_size"])),
                   block_origin=meta.get("block_origin", "prompt_end"))


def _prompt_rows(prompts: object, prompt_mask: object) -> list[list[int]]:
    """Prompts as lists of ids: a ``(N, P)`` tensor (left padding given by ``prompt_mask``) or a sequence of id
    sequences."""
    if isinstance(prompts, torch.Tensor):
        ids = V.check_token_batch("prompts", prompts)
        if prompt_mask is None:
            return [row.tolist() for row in ids]
        if not isinstance(prompt_mask, torch.Tensor) or tuple(prompt_mask.shape) != tuple(ids.shape):
            raise ValueError(f"prompt_mask: expected a {tuple(ids.shape)} tensor like prompts (1 = real token)")
        return [row[m.bool()].tolist() for row, m in zip(ids, prompt_mask.to(ids.device))]
    if prompt_mask is not None:
        raise ValueError("prompt_mask: only with prompts given as one padded (N, P) tensor")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts: expected a (N, P) tensor or a sequence of token-id sequences, got "
                        f"{type(prompts).__name__}")
    rows = []
    for i, p in enumerate(prompts):
        row = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        if any(isinstance(x, bool) or not isinstance(x, int) for x in row):
            raise TypeError(f"prompts: row {i} is not a sequence of ints")
        rows.append(row)
    return rows


def _kept(reward_fn: RewardFn, prompts: list[list[int]], completions: list[list[int]]) -> list[bool]:
    verdicts = reward_fn(prompts, completions)
    if isinstance(verdicts, torch.Tensor):
        verdicts = verdicts.tolist()
    if isinstance(verdicts, (str, bytes)) or not isinstance(verdicts, Sequence) or \
            len(verdicts) != len(completions):
        got = len(verdicts) if isinstance(verdicts, Sequence) else type(verdicts).__name__
        raise ValueError(f"reward_fn: expected one value per row ({len(completions)}), got {got}")
    return [bool(v > 0) if isinstance(v, (int, float)) and not isinstance(v, bool) else bool(v) for v in verdicts]


def record_trajectories(model: DecodableModel, prompts: torch.Tensor | Sequence[Sequence[int]], *,
                        max_new_tokens: int, policy: Any = None, temperature: float = 0.0,
                        reward_fn: RewardFn | None = None, batch_size: int = 8, block_size: int | None = None,
                        prompt_mask: torch.Tensor | None = None, progress: bool = True,
                        generator: torch.Generator | None = None, **generate_kwargs: Any) -> Trajectories:
    """Decode ``prompts`` with ``model`` in batches and record each row's trajectory (module docstring).

    Args:
        model: any model :func:`unifusion.samplers.generate` decodes with a mask policy and a trace (a block
            :class:`~unifusion.hf.DiffusionLM` or released kind; a plain one or a bidirectional kind, LLaDA, Dream,
            LLaDA-MoE, with ``block_size``). DiffusionGemma decodes with
            uniform noise (``EntropyBound``, renoising at every step): no commit order exists, and ``generate``
            refuses ``return_trace`` for it (``ValueError``).
        prompts: a ``(N, P)`` int64 tensor (left padding marked by ``prompt_mask``) or ``N`` sequences of ids.
        max_new_tokens: completion length ``C``.
        policy: the decoding policy (``None``: ``generate``'s default, one token per step).
        temperature: ``0`` (default): greedy, the committed token is the argmax, as dParallel and d3LLM record;
            ``T > 0``: sampled from softmax(logits / T).
        reward_fn: keeps the rows it accepts (:data:`RewardFn`), e.g. verified-correct answers; ``None``: all.
            A result of another length than the batch is a ``ValueError``.
        batch_size: rows per ``generate`` call.
        block_size: the decoder's block size; a block model's own by default (a plain model needs it).
        progress: a progress bar over the batches.
        generator: the draws of sampling (``temperature > 0``) and of random policies.
        **generate_kwargs: further options of ``generate`` (``eos_token_id``, ``merge_commits``, ...).

    Returns:
        :class:`Trajectories` of the kept rows, in prompt order, on the CPU.
    """
    rows = _prompt_rows(prompts, prompt_mask)
    if not rows:
        raise ValueError("prompts: expected at least one prompt, got none")
    V.check_positive_int("max_new_tokens", max_new_tokens)
    V.check_positive_int("batch_size", batch_size)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature: expected a float >= 0 (0: greedy), got {temperature!r}")
    if "return_trace" in generate_kwargs or "do_sample" in generate_kwargs:
        raise TypeError("generate_kwargs: record_trajectories sets return_trace and do_sample (from temperature)")
    K = model.block_size if block_size is None else V.check_positive_int("block_size", block_size)
    if K is None:
        raise ValueError("block_size: this model has no blocks; pass the block size the decoder should use")
    if model.block_size is not None and K != model.block_size:
        raise ValueError(f"block_size: the model decodes blocks of {model.block_size}, got {K}")
    P = -(-max(len(r) for r in rows) // K) * K
    origin = block_origin_of(model) if model.block_size is not None else "prompt_end"
    pad = model_pad_token_id(model)
    pad = 0 if pad is None else pad
    greedy = temperature == 0
    starts: Iterable[int] = range(0, len(rows), batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="record", unit="batch")
    parts = []
    for lo in starts:
        batch = rows[lo:lo + batch_size]
        ids = torch.full((len(batch), P), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), P), dtype=torch.bool)
        for i, r in enumerate(batch):
            if r:
                ids[i, P - len(r):] = torch.tensor(r, dtype=torch.long)
                mask[i, P - len(r):] = True
        out = generate(model, ids, max_new_tokens=max_new_tokens, policy=policy, attention_mask=mask,
                       block_size=None if model.block_size is not None else K, return_trace=True,
                       do_sample=not greedy, temperature=1.0 if greedy else float(temperature), generator=generator,
                       **generate_kwargs)
        completion, step = out.sequences[:, P:].cpu(), out.commit_step[:, P:].cpu()
        traj = Trajectories(prompt_ids=ids, prompt_mask=mask, completion_ids=completion, commit_step=step,
                            num_forwards=out.num_forwards.cpu(), block_size=K, block_origin=origin)
        if reward_fn is not None:
            ends = (step >= 0).sum(-1).tolist()
            keep = _kept(reward_fn, batch, [c[:e].tolist() for c, e in zip(completion, ends)])
            traj = traj.select(torch.tensor(keep, dtype=torch.bool))
        parts.append(traj)
    return Trajectories.concatenate(parts)
