"""The decoding-policy protocol: what a policy sees at one step of one block, and what it returns.

A policy is a pure batched function over the ``K`` positions of the block being decoded (no host syncs, no Python
loop over rows). Two families, by the noise the model was trained with:

* **mask** policies (:class:`MaskPolicy`: absorbing noise, a :class:`~unifusion.MaskKernel`) see a
  :class:`PolicyStep` — x_θ after temperature/top-k/top-p ``(B, K, V)``, the candidate tokens drawn from it
  ``(B, K)``, which positions are still masked ``(B, K)``, how many to commit ``(B,)`` — and return the positions to
  commit, ``(B, K)`` bool. A committed position keeps its token for the rest of the run.
* **uniform** policies (:class:`~unifusion.samplers.policies.EntropyBound`: uniform noise, a
  :class:`~unifusion.UniformKernel`) return, at every step, the accepted/renoised split of the whole block: nothing is
  final until the block stops.

Randomness goes through :class:`RowRandomness`: one shared ``torch.Generator`` (or the global one, ``None``) draws
for the whole batch at once, with the batch's full shape ``(batch_size, ...)``, rows that no longer run included (as a
batched reference implementation does); a list of per-row generators draws row by row, so a row's tokens never
depend on its neighbours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...kernels import InterpolatingKernel, Kernel
from .._draws import Generators, sample_weights, x0_weights
from .schedules import EvenSplit, TransferSchedule

__all__ = ["BlockStep", "DecodingPolicy", "MaskPolicy", "PolicyStep", "RowRandomness", "select_top"]


@dataclass(frozen=True)
class RowRandomness:
    """The randomness of the rows a step runs on.

    Attributes:
        generator: ``None`` (the global generator) or one ``torch.Generator``, shared by the batch; or a tuple with one
            generator per row of ``rows`` (in that order).
        rows: ``(B_a,)`` int64 indices of the running rows in the batch of ``batch_size``; ``None``: all of them.
        batch_size: the number of rows of the whole batch (the shape shared draws take).
    """

    generator: Generators
    rows: torch.Tensor | None
    batch_size: int

    @property
    def per_row(self) -> bool:
        return not (self.generator is None or isinstance(self.generator, torch.Generator))

    def draw(self, make: Callable[[tuple[int, ...], torch.Generator | None], torch.Tensor],
             shape: tuple[int, ...]) -> torch.Tensor:
        """``(B_a, *shape)``: ``make((1, *shape), g)`` per row with per-row generators; else one draw
        ``make((batch_size, *shape), generator)`` whose running rows are kept."""
        gen = self.generator
        if gen is None or isinstance(gen, torch.Generator):
            full = make((self.batch_size, *shape), gen)
            return full if self.rows is None else full[self.rows]
        return torch.cat([make((1, *shape), g) for g in gen])

    def rand(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """U[0, 1) draws ``(B_a, *shape)``."""
        return self.draw(lambda s, g: torch.rand(s, generator=g, device=device, dtype=dtype), shape)

    def randint(self, high: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Uniform ids in ``[0, high)`` ``(B_a, *shape)``, int64 (``torch.randint(0, high, ...)``)."""
        return self.draw(lambda s, g: torch.randint(0, high, s, generator=g, device=device), shape)

    def exponential(self, shape: tuple[int, ...], device: torch.device,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exp(1) draws ``(B_a, *shape)`` (``torch.empty(...).exponential_(1)``)."""
        return self.draw(lambda s, g: torch.empty(s, device=device, dtype=dtype).exponential_(1, generator=g), shape)


@dataclass(frozen=True)
class BlockStep:
    """Where a step of a mask policy is: what a policy that reproduces a reference sampler's draws reads.

    Attributes:
        index: the step's index i in the block (0 first).
        num_steps: the block's step budget N.
        columns: ``(B, K)`` int64, the column of each block position in the sequence (the rows of the step), or
            ``None`` where the caller does not say; a row whose block ends early repeats ``seq_len``.
        seq_len: the sequence's length L (the draws of a reference sampler that draws over the whole sequence take
            ``(B, L, ...)``), or ``None``.
    """

    index: int = 0
    num_steps: int = 1
    columns: torch.Tensor | None = None
    seq_len: int | None = None


@dataclass(frozen=True)
class PolicyStep:
    """What a mask policy sees at one step: the ``B`` running rows of the block being decoded, ``K`` positions each.

    Attributes:
        probs: x_θ after temperature, top-k and top-p ``(B, K, V)`` float32, each row summing to 1 (0 at the mask
            state): the distribution ``tokens`` were drawn from.
        tokens: the candidate token of every position ``(B, K)`` int64, one draw from ``probs``.
        undecided: ``(B, K)`` bool, the positions still masked (the only ones a policy may commit).
        num_commit: ``(B,)`` int64, how many positions a fixed-count policy commits this step (the sampler's
            schedule, ≥ 1 while a row has undecided positions); adaptive policies treat it as a minimum.
        randomness: the rows' randomness (:class:`RowRandomness`).
        hidden: ``(B, K, d)``, the model's final hidden states at the block's positions (the output head's input,
            of the call ``probs`` come from), for a policy that reads them (:attr:`DecodingPolicy.reads_hidden`);
            ``None`` for the others.
    """

    probs: torch.Tensor
    tokens: torch.Tensor
    undecided: torch.Tensor
    num_commit: torch.Tensor
    randomness: RowRandomness
    hidden: torch.Tensor | None = None


def select_top(score: torch.Tensor, eligible: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The ``count[b]`` eligible positions of row b with the highest ``score``, ``(B, K)`` bool.

    Args:
        score: ``(B, K)`` floating, higher first.
        eligible: ``(B, K)`` bool; a row with fewer eligible positions than its count takes all of them.
        count: ``(B,)`` integer.

    Ties go to the lower position (a stable sort), so the choice is deterministic; LLaDA's ``torch.topk`` leaves
    their order unspecified.
    """
    B, K = score.shape
    key = score.masked_fill(~eligible, -torch.inf)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # (B, K): positions, best first
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(K, device=score.device).expand(B, K))
    return eligible & (rank < count.unsqueeze(-1))


def _kernel_name(kernel: Kernel) -> str:
    return type(kernel).__name__


class DecodingPolicy:
    """Base class of the decoding policies (see the module docstring for the two families).

    Class attributes:
        family: ``"mask"`` or ``"uniform"``: the noise the policy decodes.
        fixed_count: whether the policy commits exactly the sampler's per-step count (then ``num_steps`` may not
            exceed the block size); adaptive policies may finish a block in fewer steps.
        reads_hidden: whether the policy reads the model's hidden states (:attr:`PolicyStep.hidden`, e.g. a learned
            commit rule): the sampler then asks the model for them — a block decoder's ``denoise_block_hidden`` and
            ``logits_from_hidden``, an x0 model's ``hidden_states`` and ``logits_from_hidden`` (what
            :class:`~unifusion.hf.DiffusionLM` and its decoders offer) — and runs the output head on all ``K``
            positions.
    """

    family: ClassVar[str] = ""
    fixed_count: ClassVar[bool] = True
    reads_hidden: ClassVar[bool] = False

    def max_steps(self, positions: int) -> int | None:
        """The most steps a block of ``positions`` positions may be given (``num_steps`` above it is a
        ``ValueError``); ``None``: no bound. A fixed-count policy commits at least one position per step."""
        return positions if self.fixed_count else None

    def check_kernel(self, kernel: Kernel) -> None:
        """``ValueError`` naming ``policy`` when this policy cannot decode ``kernel``'s noise."""
        raise NotImplementedError  # abstractmethod

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class MaskPolicy(DecodingPolicy):
    """A policy for absorbing (mask) noise: commit masked positions, most confident first.

    Subclasses define :meth:`confidence`; :meth:`select` commits the ``num_commit`` undecided positions of highest
    confidence (:func:`select_top`). Adaptive subclasses override :meth:`select`. A step is :meth:`decide`: the
    candidate draw, then :meth:`select`; a policy that reproduces a reference sampler's own draws overrides it.

    Args:
        schedule: how many positions a fixed-count policy commits per step
            (:mod:`~unifusion.samplers.policies.schedules`): :class:`~.schedules.EvenSplit` (default, LLaDA's) or
            :class:`~.schedules.TimeGrid` (Dream's).
    """

    family = "mask"
    schedule: TransferSchedule = EvenSplit()

    def __init__(self, *, schedule: TransferSchedule | None = None) -> None:
        if schedule is not None:
            if not isinstance(schedule, TransferSchedule):
                raise TypeError(f"schedule: expected a TransferSchedule (EvenSplit(), TimeGrid(eps)), got "
                                f"{type(schedule).__name__}")
            self.schedule = schedule

    def __repr__(self) -> str:
        return f"{type(self).__name__}()" if self.schedule == EvenSplit() else \
            f"{type(self).__name__}(schedule={self.schedule!r})"

    def max_steps(self, positions: int) -> int | None:
        return positions if self.fixed_count and self.schedule.bounded_by_block else None

    def commit_counts(self, left: torch.Tensor, step: int, num_steps: int) -> torch.Tensor:
        """``(B,)`` int64: how many of the ``left`` ``(B,)`` undecided positions step ``step`` of ``num_steps``
        commits (the :attr:`schedule`; read for fixed-count policies and whenever ``num_steps`` is given)."""
        return self.schedule.counts(left, step, num_steps)

    def decide(self, logits: torch.Tensor, undecided: torch.Tensor, num_commit: torch.Tensor,
               randomness: RowRandomness, where: BlockStep, *, mask_id: int | None, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, do_sample: bool = True,
               hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step on a block: ``(tokens (B, K) int64, commit (B, K) bool, p (B, K) float32)``, the candidates, the
        positions to set to them (a subset of ``undecided``) and each candidate's probability under the distribution
        it was drawn from (what a rollout trace records).

        The default: x_θ = softmax(logits / T) with the mask state at 0, then top-k and top-p; one candidate per
        position (drawn from x_θ with one ``(B, K, 2)`` uniform draw, two-level inverse CDF; the argmax with
        ``do_sample=False``, the draw still made); then :meth:`select` on a :class:`PolicyStep`.

        Args:
            logits: the model's x0 logits at the block's positions ``(B, K, V)`` (any floating dtype).
            undecided: ``(B, K)`` bool, the masked positions of the block.
            num_commit: ``(B,)`` int64, the step's count (:meth:`commit_counts`).
            randomness: the rows' randomness.
            where: the step's place (:class:`BlockStep`).
            hidden: ``(B, K, d)`` hidden states for a policy that reads them.
        """
        B, K, V = logits.shape
        weights = x0_weights(logits, torch.empty((B, K, V), dtype=torch.float32, device=logits.device),
                             mask_id=mask_id, temperature=temperature, top_k=top_k, top_p=top_p)
        u = randomness.rand((K, 2), logits.device)  # drawn either way: greedy runs consume the same stream
        tokens, total = sample_weights(weights, u)
        if not do_sample:
            tokens = weights.argmax(-1)
        probs = weights.div_(total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(-1))
        if self.reads_hidden and hidden is None:
            raise ValueError(f"hidden: {type(self).__name__} reads the model's hidden states; pass them (B, K, d)")
        step = PolicyStep(probs=probs, tokens=tokens, undecided=undecided, num_commit=num_commit,
                          randomness=randomness, hidden=hidden)
        commit = self.select(step) & undecided
        return tokens, commit, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    def confidence(self, step: PolicyStep) -> torch.Tensor:
        """``(B, K)`` scores, higher commits first (read at undecided positions only)."""
        raise NotImplementedError  # abstractmethod

    def select(self, step: PolicyStep) -> torch.Tensor:
        """The positions to commit this step, ``(B, K)`` bool, a subset of ``step.undecided``."""
        return select_top(self.confidence(step), step.undecided, step.num_commit)

    def check_kernel(self, kernel: Kernel) -> None:
        if not isinstance(kernel, InterpolatingKernel) or kernel.mask_id is None or kernel.has_uniform_noise:
            hint = "use EntropyBound for uniform noise" if isinstance(kernel, InterpolatingKernel) and \
                kernel.mask_id is None else "use BayesianSampler for this kernel"
            raise ValueError(f"policy: {type(self).__name__} commits masked positions and needs a mask kernel "
                             f"(MaskKernel: absorbing noise, no uniform noise), got {_kernel_name(kernel)} ({hint})")
