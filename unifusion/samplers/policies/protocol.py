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
from .._draws import Generators

__all__ = ["DecodingPolicy", "MaskPolicy", "PolicyStep", "RowRandomness", "select_top"]


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

    def check_kernel(self, kernel: Kernel) -> None:
        """``ValueError`` naming ``policy`` when this policy cannot decode ``kernel``'s noise."""
        raise NotImplementedError  # abstractmethod

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class MaskPolicy(DecodingPolicy):
    """A policy for absorbing (mask) noise: commit masked positions, most confident first.

    Subclasses define :meth:`confidence`; :meth:`select` commits the ``num_commit`` undecided positions of highest
    confidence (:func:`select_top`). Adaptive subclasses override :meth:`select`.
    """

    family = "mask"

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
