"""unifusion.denoiser: the Denoiser interface is an abstract base class (a model class missing a member cannot be
built), the package's models implement it, and the one prompt rule (``prompt_conditioning``)."""

from __future__ import annotations

import inspect

import pytest
import torch
from _hf_tiny import tiny_model

import unifusion as uf
from unifusion.denoiser import BlockDenoiser, Denoiser, denoiser_of, prompt_conditioning, unwrap_model


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


class _Minimal(Denoiser):
    """The abstract members only: every optional attribute and capability at the interface's default."""

    mask_token_id = None

    @property
    def num_states(self) -> int:
        return 3

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, x_t, t=None, **options):  # type: ignore[no-untyped-def, override]
        return torch.nn.functional.one_hot(x_t, 3).float()

    def logits_from_hidden(self, h):  # type: ignore[no-untyped-def]
        return h

    def generate(self, prompt_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        return uf.samplers.generate(self, prompt_ids, *args, **kwargs)

    def save_pretrained(self, save_directory, tokenizer=None, *, kernel=None):  # type: ignore[no-untyped-def]
        pass

    @classmethod
    def from_pretrained(cls, directory, **kwargs):  # type: ignore[no-untyped-def, override]
        return cls()


def test_a_complete_denoiser_is_called_through_forward_and_gets_loss() -> None:
    class Tiny(_Minimal):
        def forward(self, x_t, t=None, **options):  # type: ignore[no-untyped-def, override]
            if options.get("kernel") is not None:
                return torch.zeros(x_t.shape)
            return super().forward(x_t, t, **options)

    model = Tiny()
    x = torch.tensor([[0, 1, 2]])
    assert model(x, None).shape == (1, 3, 3) and torch.equal(model.loss(x, None, x, uf.UniformKernel(3)),
                                                               torch.zeros(1, 3))
    assert unwrap_model(model) is model and prompt_conditioning(model, x, None) == {}
    assert uf.diffusion_loss(model, x, uf.UniformKernel(3)).loss.shape == (1, 3)  # a Denoiser, trained as one


def test_the_package_models_implement_it() -> None:
    from unifusion.hf.diffusion_gemma.model import DiffusionGemmaLM

    for cls in (uf.DiffusionLM, DiffusionGemmaLM):
        assert issubclass(cls, Denoiser) and not inspect.isabstract(cls), cls
    model = uf.adapt_ar_model(tiny_model("llama"))
    assert isinstance(model, Denoiser) and model.loss.__func__ is Denoiser.loss  # one fused-loss entry, shared


def test_the_optional_members_default_to_not_offered() -> None:
    model = _Minimal()
    assert (model.block_size, model.kernel, model.tokenizer, model.config, model.conditions_on_prompt) == (
        None, None, None, None, False)
    assert model.block_decoder() is None and model.block_decoder(merge_commits=True) is None
    assert model.prefix_decoder(8, 2) is None and model.block_forward() is None
    # the defaults are what generate decodes a plain model with (the BayesianSampler, the model's own call)
    out = model.generate(torch.tensor([[0, 1]]), max_new_tokens=3, num_steps=2,
                         generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 5) and out[0, :2].tolist() == [0, 1]


def test_generate_names_the_argument_whose_decoder_the_model_does_not_offer() -> None:
    model, prompt = _Minimal(), torch.tensor([[0, 1]])
    policy = uf.samplers.policies.EntropyBound(1.0)
    with pytest.raises(TypeError, match=r"cache_refresh: this path needs the model's prefix_decoder\(\), which "
                                        "_Minimal does not offer"):
        model.generate(prompt, max_new_tokens=4, policy=policy, cache_refresh=2)
    model.block_size = 2  # a block model that offers neither block path
    with pytest.raises(TypeError, match=r"use_cache: this path needs the model's block_decoder\(\)"):
        model.generate(prompt, max_new_tokens=4)
    with pytest.raises(TypeError, match=r"use_cache: this path needs the model's block_forward\(\)"):
        model.generate(prompt, max_new_tokens=4, use_cache=False)


def test_denoiser_of_finds_the_interface_inside_wrappers() -> None:
    model = uf.adapt_ar_model(tiny_model("llama"))

    class Wrapper(torch.nn.Module):  # DDP's and DeepSpeed's .module
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    wrapped = Wrapper(Wrapper(model))
    assert unwrap_model(wrapped) is model and denoiser_of(wrapped) is model and denoiser_of(model) is model
    assert denoiser_of(lambda x_t, t: x_t) is None and denoiser_of(torch.nn.Linear(2, 2)) is None
    # the package's model offers its decoders through the interface (BlockDenoisers, an x0 callable)
    block = uf.adapt_ar_model(tiny_model("llama"), block_size=4)
    decoder, prefix = block.block_decoder(), model.prefix_decoder(8, 2)
    assert isinstance(decoder, BlockDenoiser) and isinstance(prefix, BlockDenoiser)
    assert callable(block.block_forward()) and block.block_size == 4 and model.block_size is None
