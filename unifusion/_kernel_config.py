"""Kernels by name: the names (:data:`KERNEL_NAMES`), building one on a model's states (:func:`make_kernel`), the
small JSON-able record of a kernel (:func:`kernel_config` / :func:`kernel_from_config`: what
``DiffusionLM.save_pretrained`` writes to its config as ``"kernel"`` and ``from_pretrained`` reads back), and the rule
that picks a kernel when none is named (:func:`default_kernel`), shared by ``DiffusionLM.generate``, the harness and
the ``unifusion sample``/``eval`` commands.

Re-exported by :mod:`unifusion.hf` (``uf.hf.default_kernel``, ...). It imports only the kernels and schedules, so the
model wrapper, the loaders, the command line and the harness can all use it.
"""

from __future__ import annotations

import warnings
from typing import Any

from . import schedules
from .denoiser import DecodableModel
from .kernels import HybridKernel, Kernel, MaskKernel, UniformKernel

__all__ = ["KERNEL_NAMES", "DEFAULT_P_UNIFORM", "make_kernel", "kernel_config", "kernel_from_config",
           "default_kernel", "warn_if_not_recorded_kernel"]

KERNEL_NAMES = ("uniform", "mask", "hybrid")
"""The kernels that have a name: :class:`~unifusion.UniformKernel`, :class:`~unifusion.MaskKernel`,
:class:`~unifusion.HybridKernel`."""

DEFAULT_P_UNIFORM = 0.1
"""The hybrid kernel's uniform share when a hybrid kernel is named without one."""


def make_kernel(kind: object, num_states: int, mask_token_id: int | None, *, p_uniform: float = DEFAULT_P_UNIFORM,
                gamma: float = 1.0, schedule: schedules.Schedule | None = None, name: str = "kernel") -> Kernel:
    """The kernel named ``kind`` (one of :data:`KERNEL_NAMES`) on ``num_states`` states, absorbing into
    ``mask_token_id`` (mask and hybrid): ``UniformKernel(num_states, schedule)``, ``MaskKernel(num_states,
    mask_token_id, schedule)`` or ``HybridKernel(num_states, mask_token_id, p_uniform, gamma)``. A ``ValueError``
    naming the argument ``name`` for an unknown name or a mask/hybrid kernel on a model without a mask token."""
    if kind not in KERNEL_NAMES:
        raise ValueError(f"{name}: expected one of {KERNEL_NAMES}, got {kind!r}")
    if kind == "uniform":
        return UniformKernel(num_states, schedule)
    if mask_token_id is None:
        raise ValueError(f"{name}: {kind!r} needs a model with a mask token, but this one has none; adapt it with "
                         "adapt_ar_model(..., add_mask_token=True) (or load one saved with a mask token), or use "
                         "the uniform kernel")
    if kind == "mask":
        return MaskKernel(num_states, int(mask_token_id), schedule)
    return HybridKernel(num_states, int(mask_token_id), p_uniform, gamma)


def kernel_config(kernel: Any) -> dict[str, Any] | None:
    """A JSON-able description of ``kernel`` (what ``DiffusionLM.save_pretrained`` records as ``"kernel"``), or
    ``None`` for kernels it cannot describe (a :class:`~unifusion.GeneratorKernel`, a subclass, a custom schedule).

    ``{"name": "uniform" | "mask", "schedule": {"name": <built-in schedule class>, **its settings}}`` or
    ``{"name": "hybrid", "p_uniform": p_u, "gamma": γ}``; the mask id is the model's mask token.
    """
    if type(kernel) is HybridKernel:
        return {"name": "hybrid", "p_uniform": kernel.p_uniform, "gamma": kernel.gamma}
    if type(kernel) in (UniformKernel, MaskKernel):
        schedule = kernel.schedule
        if getattr(schedules, type(schedule).__name__, None) is not type(schedule):
            return None
        return {"name": "uniform" if type(kernel) is UniformKernel else "mask",
                "schedule": {"name": type(schedule).__name__, **vars(schedule)}}
    return None


def kernel_from_config(config: object, num_states: int, mask_token_id: int | None, *,
                       name: str = "kernel") -> Kernel:
    """The kernel :func:`kernel_config` described, on ``num_states`` states with mask id ``mask_token_id``; a
    ``ValueError`` naming ``name`` for a description it cannot rebuild (or a mask kernel without a mask token)."""
    if not isinstance(config, dict) or config.get("name") not in KERNEL_NAMES:
        raise ValueError(f"{name}: expected a kernel description with 'name' in {KERNEL_NAMES}, got {config!r}")
    kind = config["name"]
    if kind != "uniform" and mask_token_id is None:
        make_kernel(kind, num_states, mask_token_id, name=name)  # the missing mask token's error
    try:
        if kind == "hybrid":
            return make_kernel(kind, num_states, mask_token_id, p_uniform=float(config["p_uniform"]),
                               gamma=float(config["gamma"]))
        settings = dict(config.get("schedule") or {"name": "LinearSchedule"})
        schedule_cls = getattr(schedules, str(settings.pop("name", "")), None)
        if not (isinstance(schedule_cls, type) and issubclass(schedule_cls, schedules.Schedule)):
            raise ValueError(f"unknown schedule {config.get('schedule')!r}")
        return make_kernel(kind, num_states, mask_token_id, schedule=schedule_cls(**settings))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{name}: cannot rebuild the kernel described by {config!r} ({err})") from None


def default_kernel(model: DecodableModel) -> tuple[Kernel, str]:
    """The kernel a :class:`~unifusion.DiffusionLM` samples and is evaluated with when none is named, and why:
    ``model.kernel`` (the one it was trained with, when recorded), else a :class:`~unifusion.MaskKernel` on its mask
    token, else a :class:`~unifusion.UniformKernel`. ``DiffusionLM.generate``, ``unifusion sample`` and
    ``unifusion eval`` all follow this rule."""
    recorded = model.kernel
    if recorded is not None:
        return recorded, "the kernel recorded with the model (model.kernel, saved in its config)"
    if model.mask_token_id is not None:
        return (make_kernel("mask", model.num_states, model.mask_token_id),
                f"no kernel recorded with the model, and it has a mask token ({model.mask_token_id})")
    return make_kernel("uniform", model.num_states, None), "no kernel recorded with the model, and it has no mask token"


def warn_if_not_recorded_kernel(model: DecodableModel, kernel: Any, name: str = "kernel") -> bool:
    """Warn (``UserWarning``, naming both) when ``kernel`` is of another family than the kernel recorded with the model
    (``model.kernel``, saved in its config): a mask-trained model decoded with uniform noise, say, produces tokens its
    training never prepared it for. Returns whether it warned; nothing is recorded: no warning."""
    recorded = model.kernel
    if recorded is None or not isinstance(kernel, Kernel) or type(kernel) is type(recorded):
        return False
    warnings.warn(f"{name}: {type(kernel).__name__} contradicts the kernel recorded with the model "
                  f"({type(recorded).__name__}, model.kernel, saved in its config): the model was trained on other "
                  f"noise; leave {name}=None to use the recorded one", UserWarning, stacklevel=3)
    return True
