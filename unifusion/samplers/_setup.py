"""Argument checks and the setup of a sampling run (private): what both samplers do before their step loop.

Cheap checks (types, shapes, devices) raise ``ValueError``/``TypeError`` naming the argument. Value checks (prompt ids)
are queued and read back once per :meth:`sample` call (:func:`unifusion._validation.batched_checks`); the step loops
then run with validation off, so no step synchronises with the device.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .. import _validation as V
from .._device import host_to_device
from ..kernels import Kernel
from ._draws import Generators, draw_rows

PROMPT_FILL = -1
"""Fill value of a prompt tensor: positions holding ``PROMPT_FILL`` are generated, every other position is kept."""

ModelFn = Callable[[torch.Tensor, torch.Tensor], Any]


def check_model(model: object) -> ModelFn:
    if not callable(model):
        raise TypeError(f"model: expected a callable (x_t (B, L), t (B,)) -> head, got {type(model).__name__}")
    return model


def check_callback(callback: object) -> None:
    """``None`` or a callable taking ``(step, t, x_t)``; a wrong arity is a TypeError before the first step."""
    if callback is None:
        return
    if not callable(callback):
        raise TypeError(f"callback: expected a callable (step, t, x_t) -> bool or None, got {type(callback).__name__}")
    try:
        signature = inspect.signature(callback)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    try:
        signature.bind(1, 0.5, None)
    except TypeError:
        raise TypeError(f"callback: expected a callable taking (step, t, x_t), got one with signature "
                        f"{signature}") from None


def check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps: expected a float in (0, 1), got {type(eps).__name__}")
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps: expected a float in the open interval (0, 1), got {eps}")
    return float(eps)


def check_sampling_options(temperature: object, top_k: object, top_p: object, num_states: int | None = None
                           ) -> tuple[float, int | None, float | None]:
    """Temperature > 0; top_k in [1, num_states] (or None); top_p in (0, 1] (or None)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature: expected a float > 0, got {type(temperature).__name__}")
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise ValueError(f"temperature: expected a finite float > 0, got {temperature}")
    if top_k is not None:
        top_k = V.check_positive_int("top_k", top_k)
        if num_states is not None and top_k > num_states:
            raise ValueError(f"top_k: expected at most num_states = {num_states}, got {top_k} (top_k = num_states "
                             "keeps every token; pass None for no filter)")
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
            raise TypeError(f"top_p: expected None or a float in (0, 1], got {type(top_p).__name__}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p: expected None or a float in (0, 1], got {top_p}")
        top_p = float(top_p)
    return float(temperature), top_k, top_p


def resolve_device(model: object, prompt: object, generator: Generators,
                   device: torch.device | str | None) -> tuple[torch.device, str]:
    """Where sampling runs and which argument said so: ``device`` if given, else the prompt's, the generator's (the
    first row's), the model's parameters', else the CPU. Returns ``(device, source)`` with ``source`` the argument's
    name (``"device"``, ``"prompt"``, ``"generator"`` or ``"model"``), for error messages."""
    if device is not None:
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device: expected None, a str or a torch.device, got {type(device).__name__}")
        return torch.device(device), "device"
    if isinstance(prompt, torch.Tensor):
        return prompt.device, "prompt"
    if isinstance(prompt, (tuple, list)) and prompt and isinstance(prompt[0], torch.Tensor):
        return prompt[0].device, "prompt"
    first = generator if generator is None or isinstance(generator, torch.Generator) else generator[0]
    if first is not None:
        return first.device, "generator"
    parameters = getattr(model, "parameters", None)
    if callable(parameters):
        try:
            return next(iter(parameters())).device, "model"
        except (StopIteration, TypeError):
            pass
    return torch.device("cpu"), "model"


def check_devices(model: object, generator: Generators, device: torch.device, source: str) -> None:
    """The model's parameters and the generator(s) live where sampling runs, which is not the meta device (host
    metadata only: no sync). ``source`` names the argument the device came from (:func:`resolve_device`)."""
    if device.type == "meta" and source != "model":  # a meta model: check_model_device says so
        raise ValueError(f"{source}: is on the meta device (no data), so there is nothing to sample on; build it on a "
                         "real device")
    V.check_model_device(model, source, device)
    rows = (generator,) if isinstance(generator, torch.Generator) else generator or ()
    for i, g in enumerate(rows):
        if g.device.type != device.type:
            which = "" if isinstance(generator, torch.Generator) else f"the generator of row {i} "
            raise ValueError(f"generator: {which}is on {g.device} but sampling runs on {device} (from {source}); "
                             f"create it there, e.g. torch.Generator(device={str(device)!r})")


def time_grid(num_steps: int, eps: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """t_n = (1 − ε)(1 − n/N) for n = 0..N, ``(N + 1,)`` in ``dtype`` (Algorithm 2; t_N = 0 exactly).

    Built on ``device`` in float64 (float32 on MPS), then rounded once to ``dtype``: a grid made on the host and
    copied over would make the host wait for the device (CUDA copies pageable memory with a stream sync)."""
    work = torch.float32 if device.type == "mps" else torch.float64
    n = torch.arange(num_steps + 1, dtype=work, device=device)
    t = (1.0 - eps) * (1.0 - n / num_steps)
    t[-1] = 0.0  # a fill on the device
    return t.to(dtype)


def resolve_prompt(prompt: object, batch_size: int, seq_len: int, kernel: Kernel,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Normalise ``prompt`` to ``(ids (B, L) int64, keep (B, L) bool)`` or ``None``.

    Accepted forms: a tensor with :data:`PROMPT_FILL` (−1) at the positions to generate, or a pair ``(ids, keep_mask)``
    with ``keep_mask`` True where ``ids`` is kept. Leading shapes ``(L,)`` and ``(1, L)`` broadcast over the batch.
    Kept ids must be clean states (in ``[0, num_states)`` and not the mask state).
    """
    if prompt is None:
        return None
    if isinstance(prompt, torch.Tensor):
        ids = prompt
        if not V.is_integer_dtype(ids.dtype):
            raise TypeError(f"prompt: expected integer token ids with {PROMPT_FILL} at generated positions, "
                            f"got dtype {ids.dtype}")
        keep = ids != PROMPT_FILL
    elif isinstance(prompt, (tuple, list)) and len(prompt) == 2:
        ids, keep = prompt
        if not isinstance(ids, torch.Tensor) or not isinstance(keep, torch.Tensor):
            raise TypeError("prompt: expected a pair (ids, keep_mask) of tensors, got "
                            f"({type(ids).__name__}, {type(keep).__name__})")
        if not V.is_integer_dtype(ids.dtype):
            raise TypeError(f"prompt: expected integer token ids in (ids, keep_mask), got dtype {ids.dtype}")
        if keep.dtype != torch.bool:
            raise TypeError(f"prompt: expected a bool keep_mask in (ids, keep_mask), got dtype {keep.dtype}")
        if keep.shape != ids.shape:
            raise ValueError(f"prompt: ids {tuple(ids.shape)} and keep_mask {tuple(keep.shape)} must have one shape")
    else:
        raise TypeError("prompt: expected a (B, L) tensor with -1 at generated positions or a pair (ids, keep_mask), "
                        f"got {type(prompt).__name__}")
    V.check_not_meta("prompt", ids)
    V.check_not_meta("prompt", keep)
    if ids.dim() == 1:
        ids, keep = ids[None], keep[None]
    if ids.dim() != 2 or ids.shape[1] != seq_len or ids.shape[0] not in (1, batch_size):
        raise ValueError(f"prompt: expected shape ({batch_size}, {seq_len}), (1, {seq_len}) or ({seq_len},) to "
                         f"match batch_size and seq_len, got {tuple(ids.shape)}")
    # a prompt on the host goes to the device pinned and without blocking (host_to_device); once per sample() call
    ids = host_to_device(ids, device).to(torch.long).expand(batch_size, seq_len)
    keep = host_to_device(keep, device).expand(batch_size, seq_len)
    if V.validation_enabled():  # value checks: queued, read back with the run's other checks (one host sync)
        out_of_range = keep & ((ids < 0) | (ids >= kernel.num_states))
        V.fail_if(out_of_range.any(), lambda: (
            f"prompt: expected kept token ids in [0, {kernel.num_states}), got values in [{int(ids[keep].min())}, "
            f"{int(ids[keep].max())}] (use {PROMPT_FILL} to mark positions to generate)"))
        if kernel.mask_id is not None:
            V.fail_if((keep & (ids == kernel.mask_id)).any(), lambda: (
                f"prompt: kept tokens must be clean, got the mask id {kernel.mask_id}; mark positions to generate "
                f"with {PROMPT_FILL} (or keep_mask=False) instead"))
    ids = torch.where(keep, ids, torch.zeros_like(ids))  # fill values never reach the model
    return ids, keep


@dataclass
class SamplingRun:
    """What both samplers' :meth:`sample` set up before their step loop (see :func:`start_run`)."""

    B: int
    L: int
    device: torch.device
    kept: tuple[torch.Tensor, torch.Tensor] | None  # the resolved prompt (ids, keep mask) or None
    ts: torch.Tensor  # t_0 … t_N on the device, (N + 1,): indexing it never syncs
    t_host: list[float]  # the same times on the host (for callbacks and the prior)
    x: torch.Tensor  # z_{t_0}: a draw from the kernel's prior, prompt applied, (B, L)
    steps: Iterable[int]  # range(N), wrapped in a tqdm bar when asked
    generator: Generators  # the checked randomness: None, one generator, or a tuple of B (one per row)


def start_run(sampler: Any, batch_size: object, seq_len: object, prompt: object, generator: object,
              progress: bool, callback: object, device: torch.device | str | None) -> SamplingRun:
    """Check :meth:`sample`'s arguments, resolve device and prompt, build the time grid t_n = (1 − ε)(1 − n/N) and
    draw z_{t_0} from the prior (per row with per-row generators). ``sampler`` has ``model``, ``kernel``,
    ``num_steps``, ``eps`` and ``dtype``; the checked generator(s) are ``SamplingRun.generator``."""
    B = V.check_positive_int("batch_size", batch_size)
    L = V.check_positive_int("seq_len", seq_len)
    check_callback(callback)
    generators = V.check_generators(generator, B)
    kernel, N, eps = sampler.kernel, sampler.num_steps, sampler.eps
    parameterization = getattr(sampler, "parameterization", None)  # EulerSampler's argument; BayesianSampler: x0
    V.check_model_kernel(sampler.model, kernel, parameterization=parameterization or "x0",
                         who=type(sampler).__name__, argument=parameterization is not None)
    dev, source = resolve_device(sampler.model, prompt, generators, device)
    check_devices(sampler.model, generators, dev, source)
    with V.batched_checks():  # the run's value checks, read back once (steps then run with validation off)
        kept = resolve_prompt(prompt, B, L, kernel, dev)
    ts = time_grid(N, eps, sampler.dtype, dev)
    t_host = [(1.0 - eps) * (1.0 - n / N) for n in range(N)] + [0.0]
    with V.unchecked():  # t_0 = 1 − ε is valid by construction
        x = apply_prompt(draw_rows(lambda shape, g: kernel.sample_prior(shape, t=t_host[0], generator=g, device=dev),
                                   (B, L), generators), kept)
    steps: Iterable[int] = range(N)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="sampling", total=N)
    return SamplingRun(B, L, dev, kept, ts, t_host, x, steps, generators)


def apply_prompt(x: torch.Tensor, prompt: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    if prompt is None:
        return x
    return torch.where(prompt[1], prompt[0], x)




def check_head_shape(name: str, head: object, batch_size: int, seq_len: int, num_states: int,
                     what: str = "x0 logits") -> torch.Tensor:
    """The model's ``(B, L, S)`` floating output; a clear error otherwise (shape read on the host, no sync)."""
    if not isinstance(head, torch.Tensor):
        raise TypeError(f"{name}: expected the model to return a (B, L, num_states) tensor of {what}, "
                        f"got {type(head).__name__}")
    if not head.dtype.is_floating_point:
        raise TypeError(f"{name}: expected floating-point {what}, got dtype {head.dtype}")
    if head.device.type == "meta":
        raise ValueError(f"{name}: returned {what} on the meta device (no data); the model must run on a real device")
    if tuple(head.shape) != (batch_size, seq_len, num_states):
        raise ValueError(f"{name}: expected the model to return {what} of shape (B, L, num_states) = "
                         f"({batch_size}, {seq_len}, {num_states}), got {tuple(head.shape)}")
    return head
