"""The transformers model methods that trainers call on a model, for unifusion's wrappers of a Hugging Face backbone.

``transformers.Trainer`` and TRL's trainers treat the model they train as a ``PreTrainedModel``: they turn gradient
(activation) checkpointing on and off around rollouts, make the input embeddings' output require grad for adapters,
count parameters for the FLOP estimate, add tags to the model card. :class:`BackboneMethods` gives a wrapper those
methods with the signatures of ``transformers.PreTrainedModel`` (``tests/hf/test_backbone.py`` checks them against
``inspect.signature`` of transformers' own methods), each acting on the wrapped backbone (:meth:`backbone`), so that
the diffusion forward, which runs the backbone's decoder layers, is checkpointed exactly as the backbone's own would
be. TRL calls ``gradient_checkpointing_enable(kwargs)`` positionally; transformers' ``Trainer`` calls
``activation_checkpointing_enable(activation_checkpointing_kwargs=..., every_n_layers=..., offload=...)``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["BackboneMethods"]


class BackboneMethods:
    """``PreTrainedModel``'s trainer-facing methods, passed to :meth:`backbone` (a mixin of ``nn.Module`` wrappers,
    listed before the module base). A subclass overrides :meth:`backbone`."""

    def backbone(self) -> Any:
        """The Hugging Face ``PreTrainedModel`` the wrapper runs (a peft model's base, where its adapters sit)."""
        raise NotImplementedError(f"{type(self).__name__}.backbone: a wrapper of a Hugging Face model returns it")

    # -- activation (gradient) checkpointing ----------------------------------------------------------------------

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict[str, Any] | None = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Checkpoint the backbone's decoder layers in ``train()`` mode (recompute their activations in the backward
        instead of keeping them): every forward of the wrapper, the block-causal one included, runs through them.
        ``activation_checkpointing_kwargs`` go to ``torch.utils.checkpoint.checkpoint`` (default
        ``{"use_reentrant": False}``); the backbone's input embeddings then output tensors that require grad, so
        a reentrant checkpoint still reaches frozen layers' adapters."""
        hf = self.backbone()
        enable = getattr(hf, "activation_checkpointing_enable", None)  # transformers >= 5
        if enable is not None:
            enable(activation_checkpointing_kwargs=activation_checkpointing_kwargs, every_n_layers=every_n_layers,
                   offload=offload)
            return
        if every_n_layers != 1 or offload:
            raise ValueError(f"every_n_layers, offload: this transformers version checkpoints every layer on the "
                             f"device only, got every_n_layers={every_n_layers!r}, offload={offload!r}")
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=activation_checkpointing_kwargs)

    def activation_checkpointing_disable(self) -> None:
        """Turn the backbone's activation checkpointing off."""
        hf = self.backbone()
        disable = getattr(hf, "activation_checkpointing_disable", None)
        (disable or hf.gradient_checkpointing_disable)()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None,
                                      **kwargs: Any) -> None:
        """transformers' older name of :meth:`activation_checkpointing_enable` (``gradient_checkpointing_kwargs``
        positional or by name, as TRL and ``transformers.Trainer`` pass it; ``every_n_layers=``, ``offload=``)."""
        unknown = set(kwargs) - {"every_n_layers", "offload"}
        if unknown:
            raise TypeError(f"{sorted(unknown)[0]}: not an argument of gradient_checkpointing_enable (takes "
                            "gradient_checkpointing_kwargs, every_n_layers, offload)")
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        """transformers' older name of :meth:`activation_checkpointing_disable`."""
        self.activation_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether the backbone checkpoints activations."""
        hf = self.backbone()
        flag = getattr(type(hf), "is_activation_checkpointing", None)
        return bool(hf.is_activation_checkpointing if flag is not None else hf.is_gradient_checkpointing)

    @property
    def is_activation_checkpointing(self) -> bool:
        """Same as :attr:`is_gradient_checkpointing` (transformers 5's name)."""
        return self.is_gradient_checkpointing

    # -- embeddings ---------------------------------------------------------------------------------------------

    def enable_input_require_grads(self) -> None:
        """Make the backbone's input embeddings output tensors that require grad (adapters under checkpointing)."""
        self.backbone().enable_input_require_grads()

    def disable_input_require_grads(self) -> None:
        """Undo :meth:`enable_input_require_grads`."""
        self.backbone().disable_input_require_grads()

    def get_input_embeddings(self) -> nn.Module:
        """The backbone's token embedding."""
        return self.backbone().get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        """The backbone's output head (``None`` if it has none)."""
        return self.backbone().get_output_embeddings()

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """Resize the backbone's token embedding and output head (transformers' method): the wrapper's
        ``num_states`` follows. Shrinking below a mask token the wrapper uses is a ``ValueError``."""
        mask_id = getattr(self, "mask_token_id", None)
        if new_num_tokens is not None and mask_id is not None and new_num_tokens <= mask_id:
            raise ValueError(f"new_num_tokens: the model's mask token is id {mask_id}; expected more than {mask_id} "
                             f"tokens, got {new_num_tokens}")
        return self.backbone().resize_token_embeddings(
            new_num_tokens, pad_to_multiple_of=pad_to_multiple_of, mean_resizing=mean_resizing)

    def tie_weights(self, missing_keys: set[str] | None = None, recompute_mapping: bool = True) -> None:
        """Re-tie the backbone's output head to its input embedding, where its config ties them."""
        self.backbone().tie_weights(missing_keys=missing_keys, recompute_mapping=recompute_mapping)

    # -- bookkeeping ----------------------------------------------------------------------------------------------

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Number of the wrapper's parameters (tied tensors counted once; a time embedding included), or only those
        with ``requires_grad``; with ``exclude_embeddings``, without the weights of ``nn.Embedding`` layers (the
        token embeddings, and an output head tied to them), as Hugging Face's ``num_parameters`` counts."""
        for name, value in (("only_trainable", only_trainable), ("exclude_embeddings", exclude_embeddings)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
        assert isinstance(self, nn.Module)
        skip = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)} if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters()
                   if (p.requires_grad or not only_trainable) and id(p) not in skip)

    def add_model_tags(self, tags: list[str] | str) -> None:
        """Add tags to the backbone's model card (TRL's trainers call it)."""
        self.backbone().add_model_tags(tags)

    @property
    def main_input_name(self) -> str:
        """``"input_ids"``: the batch key ``transformers.Trainer`` counts tokens by."""
        return "input_ids"
