"""unifusion.denoiser: the Denoiser interface is an abstract base class (a model class missing a member cannot be
built), the package's models implement it, and the one prompt rule (``prompt_conditioning``)."""

from __future__ import annotations

import inspect

import pytest
import torch
from _hf_tiny import tiny_model

import unifusion as uf
from unifusion.denoiser import Denoiser, prompt_conditioning, unwrap_model


def test_a_class_missing_an_abstract_member_cannot_be_built() -> None:
    class Partial(Denoiser):
        mask_token_id = None

        @property
        def num_states(self) -> int:
            return 5

    with pytest.raises(TypeError, match="abstract"):
        Partial()  # type: ignore[abstract]
    assert {"num_states", "device", "forward", "logits_from_hidden", "generate", "save_pretrained",
            "from_pretrained"} == set(Denoiser.__abstractmethods__)


def test_a_complete_denoiser_is_called_through_forward_and_gets_loss() -> None:
    class Tiny(Denoiser):
        mask_token_id, kernel = None, None

        @property
        def num_states(self) -> int:
            return 3

        @property
        def device(self) -> torch.device:
            return torch.device("cpu")

        def forward(self, x_t, t=None, **options):  # type: ignore[no-untyped-def, override]
            if options.get("kernel") is not None:
                return torch.zeros(x_t.shape)
            return torch.nn.functional.one_hot(x_t, 3).float()

        def logits_from_hidden(self, h):  # type: ignore[no-untyped-def]
            return h

        def generate(self, prompt_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
            return prompt_ids

        def save_pretrained(self, save_directory, tokenizer=None, *, kernel=None):  # type: ignore[no-untyped-def]
            pass

        @classmethod
        def from_pretrained(cls, directory, **kwargs):  # type: ignore[no-untyped-def, override]
            return cls()

    model = Tiny()
    x = torch.tensor([[0, 1, 2]])
    assert model(x, None).shape == (1, 3, 3) and torch.equal(model.loss(x, None, x, uf.UniformKernel(3)),
                                                               torch.zeros(1, 3))
    assert unwrap_model(model) is model and prompt_conditioning(model, x, None) == {}
    assert uf.diffusion_loss(model, x, uf.UniformKernel(3)).loss.shape == (1, 3)  # a Denoiser, trained as one


def test_the_package_models_implement_it() -> None:
    from unifusion.hf.diffusion_gemma import DiffusionGemmaLM

    for cls in (uf.DiffusionLM, DiffusionGemmaLM):
        assert issubclass(cls, Denoiser) and not inspect.isabstract(cls), cls
    model = uf.adapt_ar_model(tiny_model("llama"))
    assert isinstance(model, Denoiser) and model.loss.__func__ is Denoiser.loss  # one fused-loss entry, shared
