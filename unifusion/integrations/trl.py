"""TRL's ``SFTTrainer`` with the diffusion loss: supervised fine-tuning of a block :class:`~unifusion.DiffusionLM`
through TRL's dataset handling (conversational or prompt-completion datasets, chat templates, its collator).

TRL tokenises the data and its collator right-pads the batch and writes ``labels`` with ``-100`` on what is not
trained on (the prompt of a prompt-completion dataset, everything but the assistant turns with
``assistant_only_loss=True``); :class:`DiffusionSFTTrainer` reads those positions as the prompt (``prompt_mask``:
clean, never scored) and trains with :func:`~unifusion.diffusion_loss` (:mod:`unifusion.integrations`). Padding-free
batches (``padding_free=True``, ``position_ids``) are refused; TRL's ``packing=True`` needs ``padding_free=False``.

Recipe (``pip install "unifusion[trl]"``)::

    from trl import SFTConfig
    from unifusion.integrations.trl import DiffusionSFTTrainer

    model = uf.adapt_ar_model(AutoModelForCausalLM.from_pretrained(name), tokenizer=tok, block_size=32)
    trainer = DiffusionSFTTrainer(model, SFTConfig("out", max_steps=500), train_dataset=dataset,
                                  processing_class=tok, loss_kwargs={"complementary": True})
    trainer.train()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from trl import SFTTrainer

from ..kernels import Kernel
from . import DiffusionLossMixin

__all__ = ["DiffusionSFTTrainer"]


class DiffusionSFTTrainer(DiffusionLossMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` whose ``compute_loss`` is :func:`~unifusion.diffusion_loss` (TRL's ``labels == -100``
    positions are the prompt). ``kernel`` and ``loss_kwargs`` as in :class:`~unifusion.integrations.DiffusionTrainer`;
    every other argument is ``SFTTrainer``'s; ``model`` is a :class:`~unifusion.DiffusionLM` (a module TRL runs as it
    runs a ``PreTrainedModel``)."""

    def __init__(self, model: torch.nn.Module, args: Any = None, *, kernel: Kernel | None = None,
                 loss_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.set_diffusion_options(kernel, loss_kwargs)
        # TRL types model as str | PreTrainedModel | PeftModel; a DiffusionLM is an nn.Module it trains the same way
        super().__init__(model=cast(Any, model), args=args, **kwargs)
