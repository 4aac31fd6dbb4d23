"""The one save_pretrained / from_pretrained every model kind inherits (unifusion.hf.checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import unifusion as uf
from unifusion.denoiser import DenoiserModule
from unifusion.hf import DiffusionGemmaLM, DiffusionLM
from unifusion.hf.checkpoint import CONFIG_NAME, CheckpointMixin, library_version

S = 7


class Toy(CheckpointMixin, DenoiserModule):
    """A third model kind: one embedding as its x0 logits, its width in the record, its weights in one file."""

    checkpoint_keys = frozenset({"width"})

    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.width, self.mask_token_id = width, S - 1
        self.table = nn.Embedding(S, S)

    @property
    def num_states(self) -> int:
        return S

    @property
    def device(self) -> torch.device:
        return self.table.weight.device

    def forward(self, x_t: torch.Tensor, t: Any = None, **kwargs: Any) -> torch.Tensor:
        return self.table(x_t)

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def generate(self, prompt_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def checkpoint_record(self) -> dict[str, Any]:
        return {"width": self.width}

    def save_checkpoint_files(self, path: Path) -> None:
        save_file(self.state_dict(), str(path / "toy.safetensors"))

    @classmethod
    def load_checkpoint(cls, path: Path, record: dict[str, Any] | None, dtype: Any) -> Toy:
        if record is None:
            raise ValueError(f"directory: no {CONFIG_NAME} in {path}")
        model = cls(record["width"])
        model.load_state_dict(load_file(str(path / "toy.safetensors")))
        return model


def test_both_kinds_inherit_the_one_implementation() -> None:
    for kind in (DiffusionLM, DiffusionGemmaLM):
        assert issubclass(kind, CheckpointMixin)
        assert kind.save_pretrained is CheckpointMixin.save_pretrained
        assert kind.from_pretrained.__func__ is CheckpointMixin.from_pretrained.__func__  # type: ignore[attr-defined]


def test_a_kind_missing_a_hook_fails_when_its_class_is_defined() -> None:
    with pytest.raises(TypeError, match="^NoLoader: a model kind built on CheckpointMixin must define "
                                        "load_checkpoint "):
        class NoLoader(CheckpointMixin, DenoiserModule):
            def save_checkpoint_files(self, path: Path) -> None: ...

    with pytest.raises(TypeError, match="^NoHooks: .* must define save_checkpoint_files and load_checkpoint "):
        class NoHooks(CheckpointMixin, DenoiserModule):
            pass

    with pytest.raises(TypeError, match="^Shadowed: .* must define save_checkpoint_files and load_checkpoint "):
        class Hooks:  # listed after the mixin, its hooks would never run: the mixin's come first in the MRO
            def save_checkpoint_files(self, path: Path) -> None: ...

            @classmethod
            def load_checkpoint(cls, path: Path, record: Any, dtype: Any) -> Any: ...

        class Shadowed(CheckpointMixin, Hooks, DenoiserModule):
            pass


def test_an_abstract_base_opts_out_for_itself_only() -> None:
    class Base(CheckpointMixin, DenoiserModule, abstract=True):
        """Shared by kinds that define the hooks."""

    with pytest.raises(TypeError, match="^Incomplete: .* must define save_checkpoint_files and load_checkpoint "):
        class Incomplete(Base):
            pass

    class Complete(Base):
        save_checkpoint_files = Toy.save_checkpoint_files
        load_checkpoint = Toy.__dict__["load_checkpoint"]

    assert Complete.save_checkpoint_files is Toy.save_checkpoint_files
    with pytest.raises(TypeError, match="abstract: expected a bool, got str"):
        class Odd(CheckpointMixin, DenoiserModule, abstract="yes"):  # type: ignore[call-arg]
            pass


def test_classes_made_on_the_fly_inherit_the_hooks_and_take_the_instance(tmp_path) -> None:
    """FSDP2's ``fully_shard`` swaps a model's ``__class__`` for ``FSDP<Class>(FSDPModule, Class)``, made on the fly
    (no metaclass may stand in the way): such a subclass inherits the hooks, and the instance keeps working."""

    class Sharded:  # stands in for FSDPModule
        pass

    model = Toy(width=4)
    model.__class__ = type(f"FSDP{Toy.__name__}", (Sharded, Toy), {})
    assert isinstance(model, Toy) and type(model).load_checkpoint.__func__ is Toy.load_checkpoint.__func__
    assert torch.equal(model(torch.tensor([[1, 2]])), model.table.weight[[1, 2]][None])
    # the library's kinds: the class made on the fly passes the hook check (a TypeError otherwise), and a swapped
    # DiffusionLM saves and loads as the model it is
    for kind in (DiffusionLM, DiffusionGemmaLM):
        type(f"FSDP{kind.__name__}", (Sharded, kind), {})
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _hf_tiny import tiny_model

    lm = uf.adapt_ar_model(tiny_model("llama"), mask_token_id=127)
    lm.__class__ = type("FSDPDiffusionLM", (Sharded, DiffusionLM), {})
    with pytest.warns(UserWarning, match="no tokenizer given"):
        lm.save_pretrained(tmp_path)
    back = DiffusionLM.from_pretrained(tmp_path)
    assert type(back) is DiffusionLM and all(torch.equal(a, b) for a, b in zip(back.state_dict().values(),
                                                                                lm.state_dict().values()))


def test_a_new_kind_round_trips_with_its_record_kernel_and_device(tmp_path) -> None:
    model = Toy(width=5)
    kernel = uf.MaskKernel(S, S - 1)
    with pytest.warns(UserWarning, match="no tokenizer given"):
        model.save_pretrained(tmp_path, kernel=kernel)
    record = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert record == {"unifusion_version": library_version(), "width": 5, "kernel": uf.hf.kernel_config(kernel)}
    loaded = Toy.from_pretrained(tmp_path, device="cpu")
    assert isinstance(loaded, Toy) and loaded.width == 5 and not loaded.training
    assert repr(loaded.kernel) == repr(kernel) and loaded.tokenizer is None
    assert torch.equal(loaded.table.weight, model.table.weight)


def test_the_record_is_checked_on_the_way_in_and_out(tmp_path) -> None:
    model = Toy()
    with pytest.raises(TypeError, match="kernel: expected a unifusion Kernel"):
        model.save_pretrained(tmp_path / "a", kernel="mask")
    assert not (tmp_path / "a").exists()  # nothing written
    with pytest.raises(ValueError, match="kernel"):  # a kernel of another state space
        model.save_pretrained(tmp_path / "a", kernel=uf.UniformKernel(S + 1))
    with pytest.raises(TypeError, match="tokenizer: expected a Hugging Face tokenizer"):
        model.save_pretrained(tmp_path / "a", tokenizer=object())
    with pytest.warns(UserWarning):
        model.save_pretrained(tmp_path / "b")
    record = json.loads((tmp_path / "b" / CONFIG_NAME).read_text())
    assert "kernel" not in record  # none known: none recorded
    (tmp_path / "b" / CONFIG_NAME).write_text(json.dumps({**record, "from_the_future": 1}))
    with pytest.warns(UserWarning, match=r"ignoring unknown keys \['from_the_future'\]"):
        Toy.from_pretrained(tmp_path / "b")
    for bad, error, match in [(tmp_path / "nowhere", ValueError, "directory: no such folder"),
                              (tmp_path / "b" / CONFIG_NAME, ValueError, "got the file"),
                              (3, TypeError, "directory: expected a path")]:
        with pytest.raises(error, match=match):
            Toy.from_pretrained(bad)
    (tmp_path / "c").mkdir()
    with pytest.raises(ValueError, match="directory: no unifusion_config.json"):
        Toy.from_pretrained(tmp_path / "c")  # the kind decides what a folder without a record means


def test_tokenizer_files_that_do_not_load_warn(tmp_path) -> None:
    with pytest.warns(UserWarning):
        Toy().save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{ not json")
    with pytest.warns(UserWarning, match="tokenizer files could not be loaded"):
        loaded = Toy.from_pretrained(tmp_path)
    assert loaded.tokenizer is None
    assert Toy.from_pretrained(tmp_path, load_tokenizer=False).tokenizer is None
