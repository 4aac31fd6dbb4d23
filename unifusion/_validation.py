"""Input checks shared across the package (private module; its names are public inside the package).

Each rule has one function here: argument types (positive ints, compute dtypes, generators), tensors, token ids,
times (:data:`TIME_RULE`), distributions, heads, padding, and whether a model and a kernel fit together. Value checks
(ranges, NaN, sums) run only while :func:`unifusion.validation.validation_enabled` is true and can be queued with
:func:`batched_checks` so one call reads them back in one host sync.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._device import host_to_device
from .denoiser import BlockDenoiser, ConvertedHead, Denoiser, X0Model, denoiser_of, unwrap_model
from .validation import set_validation, unchecked, validation, validation_enabled

__all__ = ["set_validation", "unchecked", "validation", "validation_enabled"]  # re-exported from unifusion.validation


# ----------------------------------------------------------------------------------------------------------
# helpers used across the package (private)


def check_tensor(name: str, value: object) -> torch.Tensor:
    """A ``torch.Tensor`` with data: a meta tensor (no values) is a ``ValueError`` naming ``name`` (the device type is
    host metadata: no sync)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    check_not_meta(name, value)
    return value


# ----------------------------------------------------------------------------------------------------------
# value checks read back together: one host sync for a whole call


_BATCH = threading.local()


@contextlib.contextmanager
def batched_checks() -> Iterator[None]:
    """Within the block, value checks (id ranges, time ranges, NaN, padding) are queued and read back together on
    exit: one host sync for all of them instead of one or two each. The first failing check raises its
    ``ValueError`` then (its message, with the offending values, is computed only on that path). Nested blocks join
    the outermost one. Code inside the block must not rely on a check having passed (flush first: leave the block).
    """
    if torch.compiler.is_compiling() or getattr(_BATCH, "items", None) is not None:
        yield  # while torch.compile traces no value check runs (validation_enabled() is False): nothing to queue
        return
    _BATCH.items = []
    try:
        yield
        items = _BATCH.items
    finally:
        _BATCH.items = None
    if items:
        flags: dict[torch.device, list[torch.Tensor]] = {}
        for bad, _ in items:  # one read per device (no copies between them): the one host sync on a GPU
            flags.setdefault(bad.device, []).append(bad.reshape(()))
        if any(bool(torch.stack(group).any()) for group in flags.values()):
            for bad, message in items:
                if bool(bad):
                    raise ValueError(message())


def fail_if(bad: torch.Tensor, message: Callable[[], str]) -> None:
    """Raise ``ValueError(message())`` if the 0-d bool tensor ``bad`` is true — now (one host sync), or when the
    enclosing :func:`batched_checks` block ends."""
    items = getattr(_BATCH, "items", None)
    if items is not None:
        items.append((bad, message))
    elif bool(bad):
        raise ValueError(message())


def check_token_batch(name: str, value: object, dims: tuple[str, str] = ("B", "L")) -> torch.Tensor:
    """A non-empty batch of token ids: a 2-D integer tensor with data, of shape ``(B, L)`` with ``B, L >= 1`` (``dims``
    names the two sizes in the messages, e.g. ``("B", "P")`` for a prompt). Metadata only (no host sync); the ids'
    range is :func:`check_token_ids`'s.

    Raises:
        TypeError: not a tensor, or not an integer dtype.
        ValueError: not 2-D, an empty batch, or a meta tensor.
    """
    shape = f"({dims[0]}, {dims[1]})"
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a {shape} integer tensor of token ids, got {type(value).__name__}")
    check_not_meta(name, value)
    if value.dim() != 2:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(value.shape)}")
    if 0 in value.shape:
        raise ValueError(f"{name}: expected a non-empty batch of token ids {shape} with {dims[0]}, {dims[1]} >= 1, "
                         f"got {tuple(value.shape)}")
    if not is_integer_dtype(value.dtype):
        raise TypeError(f"{name}: expected integer token ids (int64), got dtype {value.dtype}")
    return value


def check_token_ids(name: str, value: object, num_states: int) -> torch.Tensor:
    """Integer tensor with values in [0, num_states)."""
    ids = check_tensor(name, value)
    if not is_integer_dtype(ids.dtype):
        raise TypeError(f"{name}: expected integer token ids (int64), got dtype {ids.dtype}")
    check_not_meta(name, ids)
    if validation_enabled() and ids.numel() > 0:
        fail_if(((ids < 0) | (ids >= num_states)).any(), lambda: (
            f"{name}: expected token ids in [0, {num_states}), got values in [{int(ids.min())}, {int(ids.max())}]"))
    return ids.long()


TIME_RULE = ("t is a float, a 0-d tensor, a 1-D tensor of one time per row (length B, the leading dim of the tokens), "
             "or a tensor with the tokens' number of dims that broadcasts with their shape (for a grid of times, give "
             "the tokens the grid's leading dims too, e.g. tokens x[None] of shape (1, L) with t of shape (T, 1))")
"""The one rule for the shape of ``t`` in every public function that takes times and tokens (docs/concepts.md,
"Times"). A 1-D ``t`` of length B always means one time per row, also when B equals the sequence length; ``t`` never
has more dims than the tokens (a ``(B, 1, 1)`` t against ``(B, L)`` tokens would otherwise make a silent
``(B, B, L)`` grid)."""


def check_time(name: str, value: object, *, device: torch.device | None = None,
               dtype: torch.dtype | None = None, open_interval: bool = True,
               shape: tuple[int, ...] | torch.Size | None = None) -> torch.Tensor:
    """Float tensor (or Python number) of times in (0, 1) (``[0, 1)`` with ``open_interval=False``).

    With ``shape`` (the tokens' shape, e.g. ``(B, L)``) the one rule for times applies (:data:`TIME_RULE`): a float
    or 0-d tensor is one time for every token; a 1-D tensor is one time per row and must have length B (returned as
    ``(B, 1, ...)``, so it broadcasts along the positions even when B == L); otherwise the tensor must have exactly
    as many dims as the tokens and broadcast with their shape as usual (``(B, 1)``, ``(B, L)``, ``(1, L)``, or a grid
    of times such as ``(T, 1)`` against tokens ``(1, L)``). Fewer dims than the tokens but more than one, or more dims
    than the tokens (``(B, 1, 1)`` against ``(B, L)``, which broadcasting would turn into a ``(B, B, L)`` grid), is a
    ``ValueError`` that states the rule.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected a float or a float tensor, got bool")
    if isinstance(value, (int, float)):
        # filled on the device: torch.tensor(value, device=...) would copy a host tensor there (a host sync on CUDA)
        t = torch.full((), float(value), device=device, dtype=dtype or torch.get_default_dtype())
    elif isinstance(value, torch.Tensor):
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating-point tensor of times, got dtype {value.dtype}")
        check_not_meta(name, value)
        t = value
        if device is not None and t.device != device:
            t = host_to_device(t, device)  # the caller's times on the host: a pinned, non-blocking copy to CUDA
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
    else:
        raise TypeError(f"{name}: expected a float or a float tensor, got {type(value).__name__}")
    if shape is not None:
        t = _times_for(name, t, tuple(shape))
    if validation_enabled() and t.numel() > 0:
        lo_ok = (t > 0.0) if open_interval else (t >= 0.0)
        interval = "the open interval (0, 1)" if open_interval else "[0, 1)"
        fail_if(~(lo_ok & (t < 1.0)).all(), lambda: (
            f"{name}: expected times in {interval}, got values in [{float(t.detach().min())}, "
            f"{float(t.detach().max())}]"))
    return t


def check_sequence_times(name: str, value: object, shape: tuple[int, ...] | torch.Size, *,
                         device: torch.device | None = None, dtype: torch.dtype | None = None,
                         who: str = "the model") -> torch.Tensor:
    """Times of a model call on tokens ``(B, L)``: one per sequence, returned as ``(B,)``.

    :data:`TIME_RULE` with per-position times excluded: a float or 0-d tensor (the same time for every row), ``(B,)``
    or ``(B, 1)``. Anything else (``(B, L)``, a 1-D t of another length) is a ``ValueError`` naming ``name``.
    Values are checked as :func:`check_time` does (queued under :func:`batched_checks`; none with validation off).
    """
    shape = tuple(shape)
    B = shape[0]
    t = check_time(name, value, device=device, dtype=dtype, shape=shape)
    if t.dim() > 2 or (t.dim() == 2 and t.shape[1] != 1) or t.numel() not in (1, B):
        raise ValueError(f"{name}: {who} takes one time per sequence: a float, shape ({B},) or ({B}, 1), got shape "
                         f"{tuple(t.shape)}")
    return t.reshape(-1).expand(B) if t.numel() == 1 else t.reshape(B)


def _times_for(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` shaped to broadcast over tokens of ``shape`` by :data:`TIME_RULE` (a ValueError saying the rule
    otherwise)."""
    if t.dim() == 0:
        return t
    if t.dim() == 1:
        rows = shape[0] if shape else 1
        if t.shape[0] == rows:
            return t.reshape(rows, *([1] * (len(shape) - 1))) if shape else t.reshape(())
        if t.shape[0] == 1:
            return t.reshape([1] * len(shape))
        raise ValueError(f"{name}: a 1-D t holds one time per row, so its length must be {rows} (the leading dim of "
                         f"the tokens' shape {shape}), got {t.shape[0]}; for other layouts give t the tokens' number "
                         f"of dims, e.g. shape {(rows, *([1] * (len(shape) - 1)))}")
    if t.dim() > len(shape):  # the easy slip: (B, 1, 1) against (B, L) would broadcast to a (B, B, L) grid
        grid = (f" (broadcasting would make a {tuple(torch.broadcast_shapes(t.shape, shape))} grid)"
                if _broadcasts(t.shape, shape) else "")
        raise ValueError(f"{name}: got shape {tuple(t.shape)}, more dims than the tokens' shape {shape}{grid}; "
                         f"{TIME_RULE}")
    if t.dim() == len(shape) and _broadcasts(t.shape, shape):  # broadcast as usual (e.g. (B, 1), or a grid (T, 1))
        return t
    raise ValueError(f"{name}: got shape {tuple(t.shape)} for tokens of shape {shape}; {TIME_RULE}")


def _broadcasts(a: tuple[int, ...] | torch.Size, b: tuple[int, ...] | torch.Size) -> bool:
    try:
        torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return True


def check_padding(name: str, attention_mask: torch.Tensor) -> None:
    """Queue the padding rule's value check (no host sync of its own): every row of the ``(B, L)`` bool mask is
    contiguous — all pads on the right or all on the left (``1 1 0 0`` / ``0 0 1 1``), no holes. Joins the enclosing
    :func:`batched_checks` block (one sync for the whole call); nothing runs with validation
    off. :meth:`DiffusionLM.forward` and :func:`~unifusion.diffusion_loss` (which runs the model unchecked) call it.
    """
    if not validation_enabled() or attention_mask.numel() == 0:
        return
    changes = (attention_mask[:, 1:] != attention_mask[:, :-1]).sum(-1)  # 1 0 0 / 0 0 1: at most one change
    fail_if((changes > 1).any(), lambda: (
        f"{name}: expected contiguous padding (all pads on the right or all on the left of each row), got rows with "
        f"holes: {(changes > 1).nonzero().flatten().tolist()[:8]}"))


def check_model_length(model: X0Model, length: int, name: str) -> None:
    """A :class:`~unifusion.DiffusionLM` runs ``length + 1`` positions (bos first): more than its config's
    ``max_position_embeddings`` is a ``ValueError`` naming ``name`` (host metadata only, no sync). ``model``: any x0
    callable (only a :class:`~unifusion.denoiser.Denoiser`, inside its wrappers, is checked)."""
    inner = denoiser_of(model)
    if inner is None:
        return
    limit = getattr(inner.config, "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and length + 1 > limit:
        raise ValueError(f"{name}: the total length {length} (+1 for bos) exceeds the model's max_position_embeddings "
                         f"= {limit}; use at most {limit - 1} tokens in all (prompt included)")


def check_finite(name: str, value: torch.Tensor) -> None:
    if validation_enabled() and value.is_floating_point() and value.numel() > 0:
        fail_if(torch.isnan(value.detach()).any(), lambda: f"{name}: contains NaN")


def check_not_meta(name: str, value: torch.Tensor) -> None:
    """Meta tensors have no values: a clear error instead of a failure deep inside an op."""
    if value.device.type == "meta":
        raise ValueError(f"{name}: is on the meta device (no data); materialise it first (e.g. .to_empty(device=...) "
                         "and load weights for a model, or build the tensor on a real device)")


def _seed_hint(value: object) -> str:
    """How to make a generator from an int seed (a common slip), else nothing."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"; use torch.Generator().manual_seed({value})"
    return ""


def check_generator(value: object, name: str = "generator") -> torch.Generator | None:
    """``None`` or a ``torch.Generator`` (an int seed is a common slip: say how to make one)."""
    if value is None or isinstance(value, torch.Generator):
        return value
    raise TypeError(f"{name}: expected a torch.Generator or None, got {type(value).__name__}{_seed_hint(value)}")


def check_head_fn(head_fn: object, x0: object, kernel: object) -> None:
    """A model forward's ``head_fn``: ``None`` or a callable of the hidden states, and never beside the fused loss's
    ``x0`` / ``kernel`` (each replaces the output head)."""
    if head_fn is None:
        return
    if not callable(head_fn):
        raise TypeError(f"head_fn: expected a callable of the final hidden states (B, L, d), got "
                        f"{type(head_fn).__name__}")
    if x0 is not None or kernel is not None:
        raise ValueError("head_fn: replaces the output head, as the fused loss (x0, kernel) does; pass one of them")


def check_generators(value: object, batch_size: int,
                     name: str = "generator") -> torch.Generator | tuple[torch.Generator, ...] | None:
    """``None``, one ``torch.Generator``, or one generator per row: a list or tuple of ``batch_size`` of them
    (returned as a tuple). Types and length only (host metadata, no sync)."""
    if value is None or isinstance(value, torch.Generator):
        return value
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name}: expected a torch.Generator or None, got {type(value).__name__}"
                        f"{_seed_hint(value)} (or a list of batch_size = {batch_size} generators, one per row)")
    for i, g in enumerate(value):
        if not isinstance(g, torch.Generator):
            raise TypeError(f"{name}: expected one torch.Generator per row, got {type(g).__name__} at index {i}")
    if len(value) != batch_size:
        raise ValueError(f"{name}: expected one generator per row, batch_size = {batch_size} in all, got "
                         f"{len(value)}")
    return tuple(value)


def check_positive_int(name: str, value: object) -> int:
    """An ``int`` ≥ 1 (a bool is not one): ``TypeError`` for another type, ``ValueError`` below 1, naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected a positive int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value


def check_token_id(name: str, value: object, num_states: int) -> int:
    """One token id, an ``int`` in ``[0, num_states)`` (a bool is not one): ``TypeError`` / ``ValueError`` naming
    ``name``. :func:`check_token_ids` checks a tensor of them."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int token id, got {type(value).__name__}")
    if not 0 <= value < num_states:
        raise ValueError(f"{name}: expected a token id in [0, {num_states}), got {value}")
    return value


COMPUTE_DTYPES = (torch.float32, torch.float64)
"""The dtypes an argument ``dtype=`` may choose for the arithmetic (posteriors, conversions)."""


def check_compute_dtype(value: object, name: str = "dtype") -> torch.dtype:
    """``torch.float32`` or ``torch.float64`` (:data:`COMPUTE_DTYPES`), the dtypes the arithmetic runs in."""
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name}: expected torch.float32 or torch.float64, got {type(value).__name__}")
    if value not in COMPUTE_DTYPES:
        raise ValueError(f"{name}: expected torch.float32 or torch.float64 (the posterior arithmetic), got {value}")
    return value


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` can hold token ids: an integer dtype (not floating, complex or bool)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_distribution(name: str, value: object, num_states: int, *, atol: float | None = None) -> torch.Tensor:
    """Float tensor (..., num_states), non-negative, rows summing to one."""
    p = check_tensor(name, value)
    if not p.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point distribution, got dtype {p.dtype}")
    if p.dim() == 0 or p.shape[-1] != num_states:
        raise ValueError(f"{name}: expected shape (..., {num_states}), got {tuple(p.shape)}")
    check_not_meta(name, p)
    if validation_enabled() and p.numel() > 0:
        with batched_checks():
            fail_if(torch.isnan(p).any(), lambda: f"{name}: contains NaN")
            fail_if((p < 0).any(), lambda: f"{name}: expected non-negative probabilities, got min "
                    f"{float(p.detach().min())}")
            tol = atol if atol is not None else (
                1e-10 if p.dtype == torch.float64 else (1e-4 if p.dtype == torch.float32 else 2e-2))
            err = (p.detach().sum(-1) - 1).abs().max()
            fail_if(err > tol, lambda: f"{name}: expected rows summing to 1 along the last dim, worst row is off by "
                    f"{float(err):.3g}")
    return p


def check_head(name: str, value: object, num_states: int) -> torch.Tensor:
    """Float tensor (..., num_states) of logits / log-values; NaN checked when validation is on."""
    h = check_tensor(name, value)
    if not h.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {h.dtype}")
    if h.dim() == 0 or h.shape[-1] != num_states:
        raise ValueError(f"{name}: expected shape (..., {num_states}), got {tuple(h.shape)}")
    check_finite(name, h)
    return h


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any floating input is float64, else float32 (bf16/fp16 are computed in float32)."""
    for x in tensors:
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
            return torch.float64
    return torch.float32


def is_diffusion_lm(model: object) -> bool:
    """Whether ``model`` (inside DDP/FSDP/DeepSpeed/compile wrappers) is a :class:`~unifusion.denoiser.Denoiser` (a
    :class:`~unifusion.DiffusionLM`, say): a model that declares its states and mask token and takes the adapter's
    options."""
    return isinstance(unwrap_model(model), Denoiser)


HEAD_ATTRIBUTE = "unifusion_parameterization"
"""The attribute that says what a model returns: ``"x0"``, ``"sedd"``, ``"m2s"`` or ``"ctmc"`` (the samplers'
parameterizations). :func:`unifusion.samplers.x0_model_as` sets it on its wrappers; any callable may carry it. A
:class:`~unifusion.DiffusionLM` returns x0 logits; other models are not known (``None``)."""

_HEAD_NAMES = {"x0": "x0 logits", "sedd": "SEDD log scores", "m2s": "M2S posterior-mean logits",
               "ctmc": "Neural-CTMC (log exit rate, jump logits) pairs"}


def converted_model(model: object) -> ConvertedHead | None:
    """``model`` if it is a :class:`~unifusion.denoiser.ConvertedHead` (an :func:`x0_model_as` wrapper), else
    ``None``."""
    return model if isinstance(model, ConvertedHead) else None


def model_parameterization(model: X0Model | BlockDenoiser) -> str | None:
    """What ``model`` returns, when it is known: ``"x0"`` for a :class:`~unifusion.DiffusionLM` (inside wrappers),
    the :data:`HEAD_ATTRIBUTE` tag otherwise (set by :func:`~unifusion.samplers.x0_model_as`), else ``None``."""
    inner = unwrap_model(model)
    if is_diffusion_lm(inner):
        return "x0"
    tag = getattr(inner, HEAD_ATTRIBUTE, None)
    return tag if isinstance(tag, str) else None


def check_model_parameterization(model: X0Model | BlockDenoiser, expected: str, *, who: str = "this function",
                                 argument: bool = False) -> None:
    """``ValueError`` naming both when ``model`` is known to return another head than ``expected`` (untagged
    callables pass: nothing is known about them). ``argument``: ``expected`` came from the caller's
    ``parameterization=`` argument (the message then says which value to pass)."""
    actual = model_parameterization(model)
    if actual is None or actual == expected:
        return
    source = (f"uf.samplers.x0_model_as(model, kernel, {actual!r})" if converted_model(unwrap_model(model))
              is not None else f"its {HEAD_ATTRIBUTE} tag")
    if expected == "x0" and not argument:
        raise ValueError(f"model: returns {_HEAD_NAMES.get(actual, actual)} (parameterization {actual!r}, from "
                         f"{source}), but {who} reads the model's output as x0 logits; pass the x0 model itself")
    raise ValueError(f"parameterization: the model returns {_HEAD_NAMES.get(actual, actual)} (parameterization "
                     f"{actual!r}, from {source}), got parameterization={expected!r}; pass parameterization="
                     f"{actual!r}")


def _same_kernel(a: Any, b: Any) -> bool:
    """Whether two kernels are the same process: the same class and the same settings (tensors compared by value)."""
    if a is b:
        return True
    if type(a) is not type(b) or vars(a).keys() != vars(b).keys():
        return False
    for key, x in vars(a).items():
        y = vars(b)[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                    and torch.equal(x.detach().cpu(), y.detach().cpu())):
                return False
        elif x != y:
            return False
    return True


def check_model_kernel(model: X0Model | BlockDenoiser, kernel: Any, *, name: str = "kernel",
                       parameterization: str | None = "x0", who: str = "this function", argument: bool = False) -> None:
    """Raise ``ValueError`` when ``kernel`` does not fit the model: a different number of states, or — for a
    :class:`~unifusion.DiffusionLM`, which knows its mask token — a different mask id, or a mask/hybrid kernel on a
    model adapted without a mask token (its id ``kernel.mask_id`` is then an ordinary word).

    Also when the model is known to return another head than ``parameterization`` (:func:`model_parameterization`;
    ``who`` and ``argument`` as :func:`check_model_parameterization`; ``None``: not checked), and, for an
    :func:`~unifusion.samplers.x0_model_as` wrapper, when ``kernel`` is not the kernel its conversions use (an
    ``"x0"`` wrapper converts nothing: the model inside it is checked instead).

    Models that do not know their mask token (plain callables) are checked for ``num_states`` when they expose it.
    A :class:`~unifusion.UniformKernel` on a model with a mask token is allowed (the mask token is then one more
    noise state: the AR → mask → uniform conversion path).
    """
    if parameterization is not None:
        check_model_parameterization(model, parameterization, who=who, argument=argument)
    inner = unwrap_model(model)
    converted = converted_model(inner)
    if converted is not None and converted.parameterization == "x0":  # logits passed through: check the x0 model
        check_model_kernel(converted.model, kernel, name=name, parameterization=None)
        return
    if converted is not None and not _same_kernel(converted.kernel, kernel):
        raise ValueError(f"{name}: the model was converted by x0_model_as with {converted.kernel!r}, got {kernel!r}; "
                         "its heads are only right under the kernel they were converted with (pass that kernel)")
    num_states = getattr(inner, "num_states", None)
    if isinstance(num_states, int) and num_states != kernel.num_states:
        raise ValueError(f"{name}: has {kernel.num_states} states but the model predicts {num_states}; build the "
                         f"kernel with num_states=model.num_states")
    if not isinstance(inner, Denoiser) or kernel.mask_id is None:
        return
    if inner.mask_token_id is None:
        raise ValueError(
            f"{name}: {type(kernel).__name__} absorbs into mask id {kernel.mask_id}, but the model has no mask token "
            f"(it was adapted with add_mask_token=False, so id {kernel.mask_id} is an ordinary word to it); adapt "
            "the model with a mask token (adapt_ar_model(..., add_mask_token=True)) or use a UniformKernel")
    if inner.mask_token_id != kernel.mask_id:
        raise ValueError(f"{name}: mask_id={kernel.mask_id} but the model's mask token is {inner.mask_token_id}; "
                         f"build the kernel with mask_id=model.mask_token_id")


def model_device(model: object) -> torch.device | None:
    """The device of a model's first parameter (inside DDP/FSDP/DeepSpeed/compile wrappers), ``None`` for callables
    without parameters or models dispatched by accelerate (``hf_device_map``: their parameters may sit elsewhere)."""
    inner = unwrap_model(model)
    converted = converted_model(inner)
    if converted is not None:  # an x0_model_as wrapper: where the x0 model it calls lives
        return model_device(converted.model)
    hf = getattr(inner, "base_model", inner)
    if getattr(inner, "hf_device_map", None) is not None or getattr(hf, "hf_device_map", None) is not None:
        return None
    parameters = getattr(inner, "parameters", None)
    if not callable(parameters):
        return None
    try:
        return next(iter(parameters())).device
    except (StopIteration, TypeError):
        return None


def check_model_device(model: object, name: str, tensor: torch.Tensor | torch.device) -> None:
    """``ValueError`` when the model is on the meta device or ``tensor`` (argument ``name``; a tensor or a device) is
    on another device than the model's parameters (host metadata only: no sync)."""
    device = model_device(model)
    if device is None:
        return
    if device.type == "meta":
        raise ValueError("model: its parameters are on the meta device (no data); materialise it first, e.g. "
                         "model.to_empty(device=...) and load the weights")
    where = tensor if isinstance(tensor, torch.device) else tensor.device
    if where != device and not (where.type == device.type and (device.index is None or where.index is None)):
        raise ValueError(f"{name}: is on {where} but the model's parameters are on {device}; move it with "
                         f".to({str(device)!r})")


def check_prompt_mask(prompt_mask: object, valid: torch.Tensor) -> torch.Tensor:
    """The scored positions ``valid ∧ ¬prompt_mask`` ``(B, L)`` of a prompt-masked (SFT) loss or bound.

    ``prompt_mask`` must be a bool tensor (True = prompt token) of ``valid``'s shape; a row whose real tokens are all
    prompt is a ``ValueError`` (queued under :func:`batched_checks`; not checked with validation off)."""
    if not isinstance(prompt_mask, torch.Tensor):
        raise TypeError(f"prompt_mask: expected a (B, L) bool tensor, got {type(prompt_mask).__name__}")
    if prompt_mask.dtype != torch.bool:
        raise TypeError(f"prompt_mask: expected dtype torch.bool (True = prompt token), got {prompt_mask.dtype}")
    if tuple(prompt_mask.shape) != tuple(valid.shape):
        raise ValueError(f"prompt_mask: expected shape {tuple(valid.shape)} like x0, got {tuple(prompt_mask.shape)}")
    check_not_meta("prompt_mask", prompt_mask)
    scored = valid & ~host_to_device(prompt_mask, valid.device)
    if validation_enabled():
        empty = ~scored.any(-1)
        fail_if(empty.any(), lambda: (
            f"prompt_mask: covers every real token of rows {empty.nonzero().flatten().tolist()[:8]}; each row needs "
            "at least one token outside the prompt to score"))
    return scored
