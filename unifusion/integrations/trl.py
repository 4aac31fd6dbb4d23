"""unifusion's TRL trainers: :class:`DiffusionSFTTrainer` (below) and :class:`DiffusionGRPOTrainer` with
:class:`DiffusionGRPOConfig` (TRL's ``GRPOTrainer`` on the diffusion likelihood, its own section below:
:mod:`unifusion.integrations._trl_grpo`). ``pip install "unifusion[trl]"``.

**SFT.** TRL's ``SFTTrainer`` with the diffusion loss: supervised fine-tuning of a block :class:`~unifusion.DiffusionLM`
through TRL's dataset handling (conversational or prompt-completion datasets, chat templates, its collator).

TRL tokenises the data and its collator right-pads the batch and writes ``labels`` with ``-100`` on what is not
trained on (the prompt of a prompt-completion dataset, everything but the assistant turns with
``assistant_only_loss=True``); :class:`DiffusionSFTTrainer` reads those positions as the prompt (``prompt_mask``:
clean, never scored) and trains with :func:`~unifusion.diffusion_loss` (:mod:`unifusion.integrations`).

**Packing** (TRL 1.16's strategies, checked when the trainer is built): ``packing=True`` with
``packing_strategy="bfd"`` (the default) or ``"bfd_split"`` keeps the documents apart on a block model: each row
of the batch is one packed example, right-padded, with ``document_ids`` from TRL's ``seq_lengths`` (no token attends
to another document, positions restart per document, :func:`~unifusion.diffusion_loss`), and the first token of a
document that starts inside a block is not scored (its prediction would be read at the previous document's last
position). TRL forces padding-free batches for these strategies; the trainer replaces that collator with one that
pads the packed rows instead. On a model without blocks packing is refused (one BOS would be shared by the
documents of a row): use a block model or ``packing=False``. ``packing_strategy="wrapped"`` is refused: it cuts
documents mid-way and records no boundaries. ``padding_free=True`` without packing (one flattened row with
``position_ids``) is refused: leave ``padding_free=False``.

Recipe (``pip install "unifusion[trl]"``)::

    from trl import SFTConfig
    from unifusion.integrations.trl import DiffusionSFTTrainer

    model = uf.adapt_ar_model(AutoModelForCausalLM.from_pretrained(name), tokenizer=tok, block_size=32)
    trainer = DiffusionSFTTrainer(model, SFTConfig("out", max_steps=500), train_dataset=dataset,
                                  processing_class=tok, loss_kwargs={"complementary": True})
    trainer.train()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from trl import SFTTrainer

from ..denoiser import denoiser_of
from ..kernels import Kernel
from . import BATCH_KEYS, DiffusionLossMixin
from ._trl_grpo import ROLLOUT_SALT, ROW_SEED, TRL_OVERRIDES, DiffusionGRPOConfig, DiffusionGRPOTrainer, preflight

__all__ = ["ROLLOUT_SALT", "ROW_SEED", "TRL_OVERRIDES", "DiffusionGRPOConfig", "DiffusionGRPOTrainer",
           "DiffusionSFTTrainer", "PackedDocumentsCollator", "packed_block_size", "preflight"]


class DiffusionSFTTrainer(DiffusionLossMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` whose ``compute_loss`` is :func:`~unifusion.diffusion_loss` (TRL's ``labels == -100``
    positions are the prompt). ``kernel`` and ``loss_kwargs`` as in :class:`~unifusion.integrations.DiffusionTrainer`;
    every other argument is ``SFTTrainer``'s; ``model`` is a :class:`~unifusion.denoiser.DenoiserModule` of any kind (a
    :class:`~unifusion.DiffusionLM`, a kind registered from outside the package) that TRL can run as it runs a
    ``PreTrainedModel``: a transformers ``config`` and ``generation_config``, and the trainer-facing methods of
    :class:`~unifusion.hf.backbone.BackboneMethods`."""

    def __init__(self, model: torch.nn.Module, args: Any = None, *, kernel: Kernel | None = None,
                 loss_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.set_diffusion_options(kernel, loss_kwargs)
        block_size = packed_block_size(model, args)  # before TRL tokenises and packs the datasets
        # TRL types model as str | PreTrainedModel | PeftModel; a DiffusionLM is an nn.Module it trains the same way
        super().__init__(model=cast(Any, model), args=args, **kwargs)
        if block_size is not None:  # TRL built a padding-free collator for bfd packing: pad the packed rows instead
            self.padding_free = False
            self.data_collator = PackedDocumentsCollator(self._tokenizer.pad_token_id, block_size,
                                                         pad_to_multiple_of=args.pad_to_multiple_of)

    def _set_signature_columns_if_needed(self) -> None:
        """The batch keys, and TRL's ``seq_lengths`` (the packed documents' lengths) for the packing collator."""
        if getattr(self, "_signature_columns", None) is None:
            self._signature_columns = [*BATCH_KEYS, "seq_lengths"]


def packed_block_size(model: torch.nn.Module, args: Any) -> int | None:
    """The block size packed rows are collated for (:class:`PackedDocumentsCollator`), ``None`` without packing;
    what cannot keep documents apart on TRL 1.16 is a ``ValueError`` with advice that works there (module
    docstring)."""
    if args is None:
        return None
    packing, strategy = bool(getattr(args, "packing", False)), getattr(args, "packing_strategy", "bfd")
    if not packing:
        if getattr(args, "padding_free", False):
            raise ValueError("padding_free: TRL then flattens the batch into one row told apart by position_ids, "
                             "which the diffusion loss does not read; leave padding_free=False (or pack with "
                             "packing=True, packing_strategy='bfd' on a block model)")
        return None
    if strategy == "wrapped":
        raise ValueError("packing_strategy: 'wrapped' cuts documents mid-way and records no boundaries, so packed "
                         "documents would attend to each other; use packing_strategy='bfd' (the documents are kept "
                         "apart with document_ids on a block model) or packing=False")
    if strategy not in ("bfd", "bfd_split"):
        raise ValueError(f"packing_strategy: expected 'bfd' or 'bfd_split' (kept apart with document_ids), got "
                         f"{strategy!r}")
    inner = denoiser_of(model)
    block_size = None if inner is None else inner.block_size
    max_length = getattr(args, "max_length", None)
    if block_size is None:
        raise ValueError("packing: packed documents are kept apart with document_ids, which needs a block model "
                         "(adapt_ar_model(..., block_size=K)); a fully bidirectional model would share one BOS "
                         "between them. Use a block model or packing=False")
    if max_length is not None and max_length <= block_size:
        raise ValueError(f"packing: rows of max_length={max_length} hold one block of the model's {block_size}; "
                         "packed documents need rows of several blocks (a larger max_length) or packing=False")
    return int(block_size)


class PackedDocumentsCollator:
    """TRL's packed examples (``input_ids``, ``labels``, ``seq_lengths``: the lengths of the documents laid end to
    end) as a right-padded batch with ``document_ids`` (``-1`` on padding), one row per packed example; the first
    token of a document that starts inside a block of ``block_size`` gets label ``-100`` (not scored: the shifted
    head reads its prediction at the previous document's last position). A document at a block boundary gets its own
    BOS and is scored whole, as alone."""

    def __init__(self, pad_token_id: int, block_size: int, *, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id, self.block_size, self.pad_to_multiple_of = pad_token_id, block_size, pad_to_multiple_of

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [torch.as_tensor(e["input_ids"], dtype=torch.long) for e in examples]
        L = max(len(r) for r in rows)
        if self.pad_to_multiple_of:
            L = -(-L // self.pad_to_multiple_of) * self.pad_to_multiple_of
        B = len(rows)
        input_ids = torch.full((B, L), self.pad_token_id, dtype=torch.long)
        labels = torch.full((B, L), -100, dtype=torch.long)
        documents = torch.full((B, L), -1, dtype=torch.long)
        attention = torch.zeros((B, L), dtype=torch.long)
        for b, (example, row) in enumerate(zip(examples, rows, strict=True)):
            n = len(row)
            lengths = [int(k) for k in example.get("seq_lengths", [n])]
            if sum(lengths) != n:
                raise ValueError(f"seq_lengths: the packed documents' lengths {lengths} do not add up to the row's "
                                 f"{n} tokens")
            input_ids[b, :n], attention[b, :n] = row, 1
            labels[b, :n] = torch.as_tensor(example.get("labels", row), dtype=torch.long)
            documents[b, :n] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
            start = 0
            for k in lengths[:-1]:
                start += k
                if start % self.block_size:
                    labels[b, start] = -100
        return {"input_ids": input_ids, "attention_mask": attention, "labels": labels, "document_ids": documents}
