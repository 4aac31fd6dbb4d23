"""What every model kind's checkpoint folder shares, and the one ``save_pretrained`` / ``from_pretrained`` built on it.

A folder written by ``model.save_pretrained(folder)`` holds

* the model kind's own files — a standard Hugging Face checkpoint (``config.json``, ``model.safetensors``, ...), so
  transformers and serving engines open it (:meth:`CheckpointMixin.save_checkpoint_files`);
* unifusion's record :data:`CONFIG_NAME` (``unifusion_config.json``): the library version, the kernel the model was
  trained with (``"kernel"``, :func:`unifusion.hf.kernel_config`; left out when none is known or it cannot be
  recorded) and the kind's own keys (:meth:`CheckpointMixin.checkpoint_record`);
* the tokenizer's files, when the model has a tokenizer (:data:`TOKENIZER_FILES` tell that one is there).

``Model.from_pretrained(folder)`` reads the record (unknown keys are ignored with a warning), lets the kind build the
model from its files (:meth:`CheckpointMixin.load_checkpoint`), then restores what every kind restores the same way:
the recorded kernel as ``model.kernel``, the tokenizer as ``model.tokenizer``, the device, eval mode.

:class:`CheckpointMixin` is that shared implementation: :class:`~unifusion.hf.DiffusionLM` and
:class:`~unifusion.hf.DiffusionGemmaLM` inherit it and provide its hooks (two of them required, checked when the class
is defined); a new model kind does the same.
"""

from __future__ import annotations

import json
import os
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from .. import _validation as V
from .._kernel_config import kernel_config, kernel_from_config
from ..denoiser import Denoiser
from ..kernels import Kernel

__all__ = ["CONFIG_NAME", "TOKENIZER_FILES", "CheckpointMixin", "library_version"]

CONFIG_NAME = "unifusion_config.json"
"""unifusion's record in a checkpoint folder (the file that marks a folder written by ``save_pretrained``)."""

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "tokenizer.model")
"""Files whose presence means a tokenizer was saved in the folder."""

_Model = TypeVar("_Model", bound="CheckpointMixin")


def library_version() -> str:
    """``unifusion.__version__``, read where the package reads it (no import of the package from inside it)."""
    try:
        return metadata.version("unifusion")
    except metadata.PackageNotFoundError:  # a source tree without install, as unifusion.__version__ says
        return "0.0.0+local"


# the hooks of CheckpointMixin every model kind defines (checked when the class is defined)
_HOOKS = ("save_checkpoint_files", "load_checkpoint")


class CheckpointMixin:
    """``save_pretrained`` / ``from_pretrained`` for a :class:`~unifusion.denoiser.Denoiser` model kind (module
    docstring). A subclass (listed before its ``nn.Module`` base) provides:

    * :attr:`checkpoint_keys`: the keys its record may hold (others are warned about on load);
    * :meth:`checkpoint_record`: its keys of the record (and a ``TypeError`` when the model cannot be saved);
    * :meth:`save_checkpoint_files`: writes its own files into the folder;
    * :meth:`load_checkpoint`: builds the model from a folder (its record, or ``None`` when the folder has none).

    The last two are required: a class that leaves one to this mixin is a ``TypeError`` naming the class and the hook
    when it is defined (:meth:`__init_subclass__`), not when a checkpoint is first saved or loaded. An intermediate
    base that leaves them to its subclasses says so: ``class Base(CheckpointMixin, DenoiserModule, abstract=True)``.
    The check runs without a metaclass (an ``ABC`` here would make FSDP2's ``fully_shard`` fail: it swaps the
    model's ``__class__`` for a subclass made on the fly, which inherits the hooks and passes the check).
    """

    checkpoint_keys: ClassVar[frozenset[str]] = frozenset()
    """The record's keys the kind writes or reads, besides ``unifusion_version`` and ``kernel``."""

    def __init_subclass__(cls, *, abstract: bool = False, **kwargs: Any) -> None:
        """Check that ``cls`` defines (or inherits from a class other than this mixin) every hook of ``_HOOKS``;
        ``abstract=True`` skips the check for ``cls`` itself (not for its subclasses)."""
        super().__init_subclass__(**kwargs)
        if not isinstance(abstract, bool):
            raise TypeError(f"abstract: expected a bool, got {type(abstract).__name__}")
        if abstract:
            return
        missing = [name for name in _HOOKS
                   if next(k for k in cls.__mro__ if name in vars(k)) is CheckpointMixin]
        if missing:
            raise TypeError(f"{cls.__name__}: a model kind built on CheckpointMixin must define "
                            f"{' and '.join(missing)} (how it writes and reads its own files); an intermediate base "
                            f"class that leaves them to its subclasses is declared with abstract=True")

    def checkpoint_record(self) -> dict[str, Any]:
        """The kind's entries of :data:`CONFIG_NAME` (JSON-serialisable; ``str`` is applied to anything else).
        Called before anything is written: raise here when the model cannot be saved as it is."""
        return {}

    def save_checkpoint_files(self, path: Path) -> None:
        """Write the kind's own files into the existing folder ``path`` (required: the body here is only reached on an
        ``abstract=True`` base)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to write its files")

    @classmethod
    def load_checkpoint(cls: type[_Model], path: Path, record: dict[str, Any] | None,
                        dtype: torch.dtype | str | None) -> _Model:
        """The model built from the folder ``path`` (weights in ``dtype``, default the saved one; on the CPU), given
        its record (``None`` when the folder holds no :data:`CONFIG_NAME`: a kind that can open its plain Hugging
        Face folders does, another raises a ``ValueError`` naming ``directory``); required, like
        :meth:`save_checkpoint_files`."""
        raise NotImplementedError(f"{cls.__name__} does not say how to read its files")

    def save_pretrained(self, save_directory: str | os.PathLike[str], tokenizer: Any = None, *,
                        kernel: Any = None) -> None:
        """Write a checkpoint folder (module docstring) that :meth:`from_pretrained` reads back and whose model files
        transformers opens. Everything is checked before anything is written.

        Args:
            save_directory: the folder (created if missing).
            tokenizer: a Hugging Face tokenizer to save with the model (``tokenizer.save_pretrained``); default the
                model's own (``model.tokenizer``). With a tokenizer in the folder, ``unifusion sample --model DIR``
                and :meth:`from_pretrained` find it; without one (and none already there) a warning says so.
            kernel: the forward kernel the model was trained with (default ``model.kernel``), recorded as
                ``"kernel"`` (:func:`unifusion.hf.kernel_config`) so that :meth:`from_pretrained` restores it and
                ``generate``, ``unifusion sample`` and ``unifusion eval`` use it by default. Uniform, mask and hybrid
                kernels with a built-in schedule can be recorded; another kernel warns and is not.
        """
        assert isinstance(self, Denoiser)
        kernel = kernel if kernel is not None else self.kernel
        kernel_entry = None
        if kernel is not None:
            if not isinstance(kernel, Kernel):
                raise TypeError(f"kernel: expected a unifusion Kernel or None, got {type(kernel).__name__}")
            V.check_model_kernel(self, kernel, who="save_pretrained")  # a Kernel that fits the model (mask id, S)
            kernel_entry = kernel_config(kernel)
            if kernel_entry is None:
                warnings.warn(f"kernel: {kernel!r} cannot be recorded in {CONFIG_NAME} (only uniform, mask and hybrid "
                              "kernels with a built-in schedule can); the saved model names no kernel", stacklevel=2)
        tok = tokenizer if tokenizer is not None else self.tokenizer
        if tok is not None and not callable(getattr(tok, "save_pretrained", None)):
            raise TypeError(f"tokenizer: expected a Hugging Face tokenizer (with save_pretrained), got "
                            f"{type(tok).__name__}")
        record = {"unifusion_version": library_version(), **self.checkpoint_record()}
        if kernel_entry is not None:
            record["kernel"] = kernel_entry
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        with open(path / CONFIG_NAME, "w") as f:
            json.dump(record, f, indent=2, sort_keys=True, default=str)
        self.save_checkpoint_files(path)
        if tok is not None:
            tok.save_pretrained(str(path))
        elif not any((path / name).exists() for name in TOKENIZER_FILES):
            warnings.warn(f"save_pretrained: no tokenizer given and none in the model (model.tokenizer), so {path} "
                          "holds none; `unifusion sample --model DIR` and text generation need one: pass tokenizer=, "
                          "or save it there yourself (tokenizer.save_pretrained(DIR))", stacklevel=2)

    @classmethod
    def from_pretrained(cls: type[_Model], directory: str | os.PathLike[str], *,
                        dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
                        load_tokenizer: bool = True, torch_dtype: torch.dtype | str | None = None,
                        device_map: Any = None, revision: str | None = None,
                        cache_dir: str | os.PathLike[str] | None = None, token: str | bool | None = None,
                        local_files_only: bool = False, force_download: bool = False) -> _Model:
        """Load a folder written by :meth:`save_pretrained` (or, for a kind that opens them, its plain Hugging Face
        folder), or a Hub repository holding one: bit-identical weights, in eval mode, the recorded kernel as
        ``model.kernel`` (else the kind's default), the saved tokenizer as ``model.tokenizer``.

        Args:
            directory: the folder, or a Hub repository id (``"owner/name"``) when no such folder exists: it is
                resolved with ``huggingface_hub.snapshot_download`` (the cache first; offline with
                ``HF_HUB_OFFLINE=1`` or ``local_files_only=True``).
            dtype: floating dtype of the weights (``torch.bfloat16`` or ``"bfloat16"``, ...); default the saved one.
            device: where to put the model; default CPU.
            load_tokenizer: load the tokenizer saved in the folder, if any (a tokenizer that fails to load warns and
                leaves ``model.tokenizer`` as it was).
            torch_dtype: transformers' older name for ``dtype`` (both given with different values: ``ValueError``).
            device_map: transformers' placement, for one device: a device (``"cuda:0"``, ``0``, ``torch.device``),
                ``{"": device}``, or ``"auto"`` (the one GPU, else the CPU); a map over several devices is a
                ``ValueError`` (the model is not split across devices; use FSDP/DeepSpeed for that). With ``device``
                too they must agree.
            revision: for a Hub id, the branch, tag or commit (``snapshot_download``'s); a local folder has none: with
                one it is a ``ValueError``, as ``cache_dir``, ``token`` and ``force_download`` are.
            cache_dir: for a Hub id, the Hub cache folder (default ``HF_HUB_CACHE``).
            token: for a Hub id, the access token.
            local_files_only: for a Hub id, use the cache only (true of a local folder anyway).
            force_download: for a Hub id, download again.

        Raises:
            ValueError: ``directory`` is neither a folder nor a Hub repository found, is a file, or is not a
                checkpoint of this model kind.
        """
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory: expected a path, got {type(directory).__name__}")
        dtype = _one_dtype(dtype, torch_dtype)
        device = _one_device(device, device_map)
        hub: dict[str, Any] = {"revision": revision, "cache_dir": cache_dir, "token": token,
                               "force_download": force_download or None}
        path = Path(directory)
        if path.exists():
            given = sorted(name for name, value in hub.items() if value is not None)
            if given:
                raise ValueError(f"{given[0]}: {str(path)!r} is a local folder, which has no Hub revision, cache or "
                                 f"token; drop {', '.join(given)} (they apply to a Hub repository id)")
        else:
            path = _from_hub(str(directory), cls.__name__, local_files_only=local_files_only, **hub)
        if not path.is_dir():
            raise ValueError(f"directory: expected a folder written by {cls.__name__}.save_pretrained, got the file "
                             f"{str(path)!r}")
        record = None
        if (path / CONFIG_NAME).is_file():
            with open(path / CONFIG_NAME) as f:
                record = json.load(f)
            unknown = sorted(set(record) - cls.checkpoint_keys - {"unifusion_version", "kernel"})
            if unknown:
                warnings.warn(f"{CONFIG_NAME}: ignoring unknown keys {unknown} (written by unifusion "
                              f"{record.get('unifusion_version', '?')})", stacklevel=2)
        model = cls.load_checkpoint(path, record, dtype)
        assert isinstance(model, Denoiser)
        if device is not None:
            model.to(device)
        if record is not None and record.get("kernel") is not None:  # the training kernel, recorded on save
            model.kernel = kernel_from_config(record["kernel"], model.num_states, model.mask_token_id,
                                              name=f"{CONFIG_NAME}: kernel")
        if load_tokenizer and any((path / name).is_file() for name in TOKENIZER_FILES):
            from transformers import AutoTokenizer

            try:
                model.tokenizer = AutoTokenizer.from_pretrained(str(path))
            except (OSError, ValueError) as err:
                warnings.warn(f"{str(path)!r}: the tokenizer files could not be loaded ({err}); model.tokenizer is "
                              "left as it was", stacklevel=2)
        return model.eval()


def _one_dtype(dtype: torch.dtype | str | None, torch_dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    """``dtype``, or transformers' older name ``torch_dtype`` for it (both given: they must agree)."""
    if torch_dtype is None:
        return dtype
    if dtype is not None and str(dtype).removeprefix("torch.") != str(torch_dtype).removeprefix("torch."):
        raise ValueError(f"dtype, torch_dtype: two names for one setting, got {dtype} and {torch_dtype}")
    return torch_dtype


def _one_device(device: torch.device | str | None, device_map: Any) -> torch.device | str | None:
    """The device of ``device`` and transformers' ``device_map`` (one device only: a device, ``{"": device}`` or
    ``"auto"``); both given: they must agree."""
    if device_map is None:
        return device
    target: Any = device_map
    if isinstance(device_map, dict):
        placed = {str(torch.device(v) if isinstance(v, int) else v) for v in device_map.values()}
        if len(placed) != 1:
            raise ValueError(f"device_map: places the model on one device here (it is not split across devices; "
                             f"use FSDP or DeepSpeed for that), got a map over {sorted(placed) or 'no device'}")
        target = next(iter(device_map.values()))
    if target in ("auto", "balanced", "balanced_low_0", "sequential"):
        gpus = torch.cuda.device_count()
        if gpus > 1:
            raise ValueError(f"device_map: {target!r} would split the model over the {gpus} GPUs; this model is "
                             "placed on one device: pass device_map='cuda:0' (or device=)")
        target = "cuda:0" if gpus == 1 else "cpu"
    if isinstance(target, int) and not isinstance(target, bool):
        target = f"cuda:{target}"
    if not isinstance(target, (str, torch.device)):
        raise TypeError(f"device_map: expected a device, {{'': device}} or 'auto', got {type(device_map).__name__}")
    resolved = torch.device(target)
    if device is not None and torch.device(device) != resolved:
        raise ValueError(f"device, device_map: two places for one model, got {device} and {device_map!r}")
    return resolved


def _from_hub(repo_id: str, who: str, *, revision: str | None, cache_dir: Any, token: Any,
              local_files_only: bool, force_download: bool | None) -> Path:
    """The local snapshot of the Hub repository ``repo_id`` (``huggingface_hub.snapshot_download``: the cache,
    offline under ``HF_HUB_OFFLINE=1``); a ``ValueError`` naming ``directory`` when it is not a repository id or is
    not found."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", repo_id) or ".." in repo_id:
        raise ValueError(f"directory: no such folder {repo_id!r}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, token=token,
                                      local_files_only=local_files_only, force_download=bool(force_download)))
    except (HFValidationError, LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        raise ValueError(f"directory: no such folder {repo_id!r}, and as a Hub repository id it could not be "
                         f"resolved ({type(err).__name__}: {err}); {who}.from_pretrained takes a folder written by "
                         "save_pretrained or the id of a Hub repository holding one") from None
