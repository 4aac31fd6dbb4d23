"""Checkpoints of unifusion's trainers: each one a folder :meth:`from_pretrained` opens, and a resume that continues
the run as if it had not stopped.

``transformers.Trainer`` saves a model that is not a ``PreTrainedModel`` as a bare state dict
(``safetensors.torch.save_file``): on a tied-embedding backbone (SmolLM2) that fails ("tensors share memory"), and
the file is nothing :meth:`DiffusionLM.from_pretrained <unifusion.DiffusionLM.from_pretrained>` opens. With
:class:`TrainerCheckpoints` among a trainer's bases (:class:`~unifusion.integrations.DiffusionTrainer`,
``DiffusionSFTTrainer``, ``DiffusionGRPOTrainer``):

* ``save_model`` and every ``checkpoint-N`` write the model's own ``save_pretrained`` folder (the backbone's standard
  files, tied weights stored once, unifusion's record, the tokenizer), so ``DiffusionLM.from_pretrained(
  "out/checkpoint-N")`` loads it;
* ``resume_from_checkpoint`` loads those weights back into the model being trained, and a trainer's own random state
  (:meth:`TrainerCheckpoints.extra_checkpoint_state`; the GRPO trainer's row-seed generator) is saved beside
  ``Trainer``'s RNG states and restored with them.

Sharded training (FSDP, DeepSpeed) keeps ``Trainer``'s own saving and loading.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..denoiser import denoiser_of
from ..hf.checkpoint import CONFIG_NAME

__all__ = ["EXTRA_STATE_NAME", "TrainerCheckpoints"]

EXTRA_STATE_NAME = "unifusion_trainer_state.pt"
"""The file of a checkpoint folder holding :meth:`TrainerCheckpoints.extra_checkpoint_state`."""


class TrainerCheckpoints:
    """``Trainer._save``, ``_load_from_checkpoint`` and the RNG-state hooks for a unifusion model (module
    docstring); list it before the ``Trainer`` class among the bases."""

    def extra_checkpoint_state(self) -> dict[str, Any]:
        """A trainer's own state to save with each checkpoint (``{}``: none); overridden by trainers that draw from
        their own generators."""
        return {}

    def load_extra_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`extra_checkpoint_state` returned."""

    def _sharded(self) -> bool:
        return bool(getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False))

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        args: Any = getattr(self, "args")  # noqa: B009 - a Trainer attribute the mixin reads
        inner = denoiser_of(getattr(self, "model"))  # noqa: B009
        if inner is None or self._sharded() or not callable(getattr(inner, "save_pretrained", None)):
            super()._save(output_dir, state_dict)  # type: ignore[misc]
            return
        if not args.should_save:
            return
        output_dir = output_dir if output_dir is not None else args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        processing = getattr(self, "processing_class", None)
        inner.save_pretrained(output_dir, tokenizer=processing if callable(getattr(processing, "save_pretrained", None))
                              else None)
        torch.save(args, os.path.join(output_dir, "training_args.bin"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        target = denoiser_of(model if model is not None else getattr(self, "model"))  # noqa: B009
        if not isinstance(target, torch.nn.Module) or self._sharded() or not os.path.isfile(
                os.path.join(resume_from_checkpoint, CONFIG_NAME)):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            return
        saved: Any = type(target).from_pretrained(resume_from_checkpoint, load_tokenizer=False,
                                                  dtype=next(target.parameters()).dtype)
        missing, unexpected = target.load_state_dict(saved.state_dict(), strict=False)
        if unexpected or [k for k in missing if k not in dict(target.named_buffers())]:
            raise ValueError(f"resume_from_checkpoint: {resume_from_checkpoint} holds another model (missing "
                             f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})")

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)  # type: ignore[misc]
        state = self.extra_checkpoint_state()
        if state:
            torch.save(state, os.path.join(output_dir, EXTRA_STATE_NAME))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)  # type: ignore[misc]
        path = None if checkpoint is None else os.path.join(checkpoint, EXTRA_STATE_NAME)
        if path is not None and os.path.isfile(path):
            self.load_extra_checkpoint_state(torch.load(path, weights_only=False))
