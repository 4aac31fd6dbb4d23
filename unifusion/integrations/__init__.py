"""Training through transformers' ``Trainer`` and TRL's ``SFTTrainer``: ``compute_loss`` is :func:`diffusion_loss`.

* :class:`DiffusionTrainer` — a ``transformers.Trainer`` whose loss is :func:`~unifusion.diffusion_loss` on the
  batch (needs ``accelerate``, as ``Trainer`` does).
* :class:`DiffusionLossMixin` — the same ``compute_loss`` for any ``Trainer`` subclass; TRL's recipe is
  ``unifusion.integrations.trl.DiffusionSFTTrainer`` (``pip install "unifusion[trl]"``).
* :class:`ChatDataCollator` — :class:`~unifusion.ChatCollator` returning the dict a ``Trainer`` expects.

A batch is a mapping with ``input_ids`` ``(B, L)`` and, optionally, ``attention_mask`` (right padding),
``prompt_mask`` (True = prompt: clean, never scored), ``labels`` (transformers' convention, TRL's collators: ``-100``
marks what is not scored; it becomes ``prompt_mask = (labels == -100) & attention_mask`` when no ``prompt_mask`` is
given) and ``document_ids`` (packed rows of a block model). The loss is the token mean
``out.loss.sum() / out.num_tokens`` of the batch — what :meth:`DiffusionLossOutput.mean
<unifusion.training.DiffusionLossOutput.mean>` gives — drawn from the global random generator (``Trainer`` seeds it
with ``args.seed``), so ``torch.manual_seed(s); trainer.compute_loss(model, batch)`` equals
``torch.manual_seed(s); diffusion_loss(model, batch["input_ids"], kernel, ...).mean()``.

Example::

    trainer = DiffusionTrainer(model, TrainingArguments("out", max_steps=100), train_dataset=chats,
                               data_collator=ChatDataCollator(tokenizer, max_length=256),
                               loss_kwargs={"complementary": True})
    trainer.train()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import Trainer

from .._kernel_config import default_kernel
from ..chat import ChatCollator
from ..denoiser import X0Model, denoiser_of
from ..kernels import Kernel
from ..training import diffusion_loss
from .checkpoints import TrainerCheckpoints

__all__ = ["BATCH_KEYS", "ChatDataCollator", "DiffusionLossMixin", "DiffusionTrainer", "compute_diffusion_loss"]

BATCH_KEYS = ("input_ids", "attention_mask", "prompt_mask", "labels", "document_ids")
"""The batch columns the loss reads (``Trainer`` keeps exactly these when it removes unused columns)."""

_ANNEALED = "anneal_steps"


def compute_diffusion_loss(model: X0Model, inputs: Mapping[str, Any], kernel: Kernel, *, step: int | None = None,
                           **loss_kwargs: Any) -> Any:
    """:func:`~unifusion.diffusion_loss` of a ``Trainer`` batch (module docstring): the
    :class:`~unifusion.training.DiffusionLossOutput`. ``step`` anneals the attention when ``loss_kwargs`` holds
    ``anneal_steps``."""
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        got = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
        raise ValueError(f"inputs: expected a batch mapping with 'input_ids' (B, L), got {got}")
    unknown = sorted(set(inputs) - set(BATCH_KEYS))
    if "position_ids" in unknown:
        raise ValueError("inputs: position_ids (padding-free packing) is not supported; pad the batch (TRL: "
                         "padding_free=False) or pack with document_ids on a block model")
    x0 = inputs["input_ids"]
    attention_mask = inputs.get("attention_mask")
    prompt_mask = inputs.get("prompt_mask")
    labels = inputs.get("labels")
    if prompt_mask is None and labels is not None:
        if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != tuple(x0.shape):
            raise ValueError(f"labels: expected a tensor of shape {tuple(x0.shape)} like input_ids, got "
                             f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__}")
        real = torch.ones_like(x0, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        prompt_mask = (labels == -100) & real
        if not bool(prompt_mask.any()):
            prompt_mask = None  # every real token scored: plain training
    kwargs = dict(loss_kwargs)
    if _ANNEALED in kwargs and step is not None:
        kwargs["step"] = int(step)
    return diffusion_loss(model, x0, kernel, attention_mask=attention_mask, prompt_mask=prompt_mask,
                          document_ids=inputs.get("document_ids"), **kwargs)


class DiffusionLossMixin(TrainerCheckpoints):
    """``compute_loss``, ``prediction_step`` and the kept columns of a ``transformers.Trainer`` subclass, for a
    :class:`~unifusion.DiffusionLM` trained with :func:`~unifusion.diffusion_loss`; checkpoints the model's own
    ``save_pretrained`` folder (:class:`~unifusion.integrations.checkpoints.TrainerCheckpoints`).

    Set ``self.diffusion_kernel`` (``None``: the model's :func:`~unifusion.hf.default_kernel`) and
    ``self.diffusion_loss_kwargs`` (keywords of :func:`~unifusion.diffusion_loss`: ``objective``,
    ``complementary``, ``anneal_steps`` — then ``step`` is the trainer's global step —, ``block_times``, ...).
    """

    diffusion_kernel: Kernel | None = None
    diffusion_loss_kwargs: dict[str, Any] = {}
    _signature_columns: Any  # Trainer's cache of the kept columns

    def set_diffusion_options(self, kernel: Kernel | None = None,
                              loss_kwargs: Mapping[str, Any] | None = None) -> None:
        """Check and set the kernel (``None``: the model's default) and the :func:`~unifusion.diffusion_loss`
        keywords (not those that come from the batch or the trainer: ``attention_mask``, ``prompt_mask``,
        ``document_ids``, ``step``, ...)."""
        self.diffusion_kernel = _check_kernel(kernel)
        self.diffusion_loss_kwargs = _check_loss_kwargs(loss_kwargs)

    def _kernel(self, model: torch.nn.Module) -> Kernel:
        """The kernel set, else the default of the :class:`~unifusion.denoiser.Denoiser` inside ``model`` (the
        trainer's model, wrapped by accelerate/DDP/compile or not)."""
        if self.diffusion_kernel is None:
            inner = denoiser_of(model)
            if inner is None:
                raise TypeError(f"kernel: the model ({type(model).__name__}) is not a unifusion Denoiser, so it has no "
                                "default kernel; pass kernel= (set_diffusion_options) or train a DiffusionLM")
            self.diffusion_kernel = default_kernel(inner)[0]
        return self.diffusion_kernel

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The batch's token-mean diffusion loss (and the :class:`~unifusion.training.DiffusionLossOutput` with
        ``return_outputs=True``)."""
        state = getattr(self, "state", None)
        out = compute_diffusion_loss(model, inputs, self._kernel(model),
                                     step=getattr(state, "global_step", None), **self.diffusion_loss_kwargs)
        loss = out.mean()
        return (loss, out) if return_outputs else loss

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: Sequence[str] | None = None) -> tuple[torch.Tensor, None, None]:
        """Evaluation: the loss only (no logits or labels to compare)."""
        inputs = self._prepare_inputs(inputs)  # type: ignore[attr-defined]
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _set_signature_columns_if_needed(self) -> None:
        """The columns ``Trainer`` keeps when it removes unused ones: the batch keys (the model's ``forward`` takes
        ``x_t``, not ``input_ids``)."""
        if getattr(self, "_signature_columns", None) is None:
            self._signature_columns = list(BATCH_KEYS)


class DiffusionTrainer(DiffusionLossMixin, Trainer):
    """A ``transformers.Trainer`` whose ``compute_loss`` is :func:`~unifusion.diffusion_loss` (module docstring).

    Args:
        model: a unifusion model: a :class:`~unifusion.denoiser.DenoiserModule` of any kind (a
            :class:`~unifusion.DiffusionLM`, ...).
        args: ``transformers.TrainingArguments``; the other ``Trainer`` arguments by keyword.
        kernel: the forward kernel (default: the model's recorded one, else the mask kernel on its mask token, else
            uniform — :func:`~unifusion.hf.default_kernel`).
        loss_kwargs: keywords of :func:`~unifusion.diffusion_loss` (``objective``, ``complementary``,
            ``anneal_steps``, ``block_times``, ``fused``, ...); with ``anneal_steps`` the attention is annealed by
            the trainer's global step.
    """

    def __init__(self, model: torch.nn.Module | None = None, args: Any = None, *, kernel: Kernel | None = None,
                 loss_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.set_diffusion_options(kernel, loss_kwargs)
        super().__init__(model=model, args=args, **kwargs)


def _check_kernel(kernel: object) -> Kernel | None:
    if kernel is not None and not isinstance(kernel, Kernel):
        raise TypeError(f"kernel: expected a unifusion Kernel or None, got {type(kernel).__name__}")
    return kernel


def _check_loss_kwargs(loss_kwargs: object) -> dict[str, Any]:
    if loss_kwargs is None:
        return {}
    if not isinstance(loss_kwargs, Mapping):
        raise TypeError(f"loss_kwargs: expected a mapping of diffusion_loss keywords, got {type(loss_kwargs).__name__}")
    reserved = sorted(set(loss_kwargs) & {"model", "x0", "kernel", "attention_mask", "prompt_mask", "document_ids",
                                          "step"})
    if reserved:
        raise ValueError(f"loss_kwargs: {reserved} come from the batch, the trainer or kernel=, got them in "
                         "loss_kwargs")
    return dict(loss_kwargs)


class ChatDataCollator(ChatCollator):
    """:class:`~unifusion.ChatCollator` for a ``Trainer``: the batch as a dict ``input_ids``, ``attention_mask``,
    ``prompt_mask`` and, with ``packing=True``, ``document_ids`` (the conversation ids; for a block model)."""

    def __call__(self, conversations: Sequence[object]) -> dict[str, torch.Tensor]:  # type: ignore[override]
        batch = super().__call__(conversations)
        out = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
               "prompt_mask": batch.prompt_mask}
        if getattr(self, "packing", False):
            out["document_ids"] = batch.conversation_ids
        return out
