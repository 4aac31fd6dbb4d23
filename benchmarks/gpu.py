"""GPU benchmark suite: the fast losses vs cross-entropy, the fused output head vs its alternatives, and sampling vs AR.

    python benchmarks/gpu.py --out results.json            # on a CUDA device (minutes)
    python benchmarks/gpu.py --dry-run --out /tmp/x.json   # every code path on the CPU at tiny sizes (seconds)
    python benchmarks/gpu.py --sections loss,fused         # a subset: loss, fused, sampling
    python benchmarks/gpu.py --quick --time-budget 540 --out q.json   # one pass under a 10-minute cap

Under a per-command time cap (a lent GPU: 10 minutes), run one section per command with its own ``--out``
(``--sections loss --out loss.json``, then ``fused``, then ``sampling``), or ``--quick`` (fewer sizes, steps and
repetitions); ``--time-budget SECONDS`` skips the rows that would start after the budget (recorded as skipped). The
JSON file is rewritten after every row and each row is printed as it finishes, so a run that is killed still leaves
every finished row.

Sections (each a table on stdout and a list of rows in the JSON):

* ``loss_vs_cross_entropy`` — ``uf.losses.gidd_loss`` (uniform and mask kernels) forward + backward on bf16 logits
  ``(N, V)`` against ``F.cross_entropy`` on the same logits, under
``uf.backend.set_backend("eager")`` and ``"compiled"``.
  Goal: loss / CE time ≤ 1.0×.
* ``fused_vs_alternatives`` — ``fused_linear_diffusion_loss`` (hidden ``(N, d)``, head ``(V, d)``, bf16) forward +
  backward against materialised logits ``h @ W.T`` + cross-entropy (and + ``gidd_loss``), Liger-Kernel's fused linear
  cross-entropy and Apple's Cut Cross-Entropy when installed (on CUDA; each is first checked against the float32
  cross-entropy of the same ``h``, ``W``, targets: ``rel_err_vs_ce``, an error row beyond 1 %). Goals: fused time ≤
  Liger's, fused peak memory ≤ 1.1× CCE's.
* ``sampling_vs_ar`` — the paper's App. C.6 table: a randomly initialised GPT-2-small (bf16), batch 1, 512 tokens,
  ``BayesianSampler`` with the uniform kernel in N steps against Hugging Face ``generate`` with its KV cache (512 new
  tokens, sampling) from a 1-token prompt; speed-up vs AR and the per-step overhead = (sampler time / N) / (one
  forward of the model on (1, 512)). Paper: 87.1 ms at 16 steps, 16.97× AR. Goal: ≥ 17× at 16 steps.

Timing on CUDA: warm-up calls (compilation included), then ``--reps`` runs each between CUDA events with a
synchronize; best and median reported. Before every call (timed or not) the previous call's gradients are released,
outside the timed region. Peak memory, the same for every row: ``torch.cuda.max_memory_allocated`` during one call
minus what was allocated just before it, with the previous gradients already released — inputs and weights are not
counted; the call's temporaries and the gradients it produces are. The sampling rows run under
``torch.inference_mode`` and report no memory. ``--dry-run`` runs the same timing code with host-clock events
(:class:`CpuOps` standing in for :class:`CudaOps`) on the CPU and reports no memory (``null``).

Validation (``uf.validation.set_validation``): rows time the hot paths with the argument checks off —
as ``diffusion_loss`` runs
the loss after its one batched check, and as a tuned training loop runs — and every section adds a row with the
defaults a user meets (checks on, with their host read-backs): the first kernel of (a) at each V, the fused loss of
(b), the sampler at the first step count in (c). Each row records ``"validation"``; the ratios and goals use the rows
with validation off.

Every timed row records the backend it asked for (``backend``), what ran (``backend_after``: the setting after it
ran, or ``"eager"`` once a configuration failed to compile — a compiler failure serves that configuration eagerly
from then on, ``uf.backend.compile_failures()`` — so a "compiled" row whose ``backend_after`` is ``"eager"`` may not
have been compiled), ``compile_stats`` (the
background compilations of ``"auto"``) and the warnings it raised. A row that raises (an OOM, a missing kernel) is
recorded with its ``error`` and the section goes on.

Without a CUDA device and without ``--dry-run`` the script exits with status 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import unifusion as uf
from unifusion.losses import fused_linear, fused_linear_diffusion_loss

GOALS = ("goals: fast loss fwd+bwd ≤ 1.0× F.cross_entropy; fused head time ≤ Liger's and peak memory ≤ 1.1× CCE's; "
         "BayesianSampler at 16 steps ≥ 17× HF generate (paper: 87.1 ms, 16.97×)")
SECTIONS = ("loss", "fused", "sampling")
NO_CUDA_MESSAGE = ("benchmarks/gpu.py: no CUDA device (torch.cuda.is_available() is False). Run it on a machine with "
                   "a GPU, or pass --dry-run to exercise every code path on the CPU at tiny sizes.")


# ----------------------------------------------------------------------------------------------------------- timing
class HostEvent:
    """A timing event on the host clock with CUDA events' interface: ``record()``, ``elapsed_time(end)`` in ms."""

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: HostEvent) -> float:
        if self.t is None or end.t is None:
            raise RuntimeError("HostEvent.elapsed_time: both events must be recorded first")
        return 1e3 * (end.t - self.t)


class CpuOps:
    """The device calls :class:`Timer` makes, on the CPU: host-clock events, nothing to synchronize, no memory
    statistics. It stands in for :class:`CudaOps` in the dry run, so the timing code path is the CUDA one."""

    memory_stats = False

    def synchronize(self, device: torch.device) -> None:
        pass

    def event(self) -> Any:
        return HostEvent()

    def empty_cache(self) -> None:
        pass

    def reset_peak(self, device: torch.device) -> None:
        raise NotImplementedError("CpuOps has no memory statistics")

    def allocated(self, device: torch.device) -> int:
        raise NotImplementedError("CpuOps has no memory statistics")

    def max_allocated(self, device: torch.device) -> int:
        raise NotImplementedError("CpuOps has no memory statistics")


class CudaOps(CpuOps):
    """The device calls :class:`Timer` makes, on CUDA: ``torch.cuda``'s (or a stand-in module with the same functions,
    which is how the tests check this path without a GPU)."""

    memory_stats = True

    def __init__(self, cuda: Any = None) -> None:
        self.cuda = torch.cuda if cuda is None else cuda

    def synchronize(self, device: torch.device) -> None:
        self.cuda.synchronize(device)

    def event(self) -> Any:
        return self.cuda.Event(enable_timing=True)

    def empty_cache(self) -> None:
        self.cuda.empty_cache()

    def reset_peak(self, device: torch.device) -> None:
        self.cuda.reset_peak_memory_stats(device)

    def allocated(self, device: torch.device) -> int:
        return int(self.cuda.memory_allocated(device))

    def max_allocated(self, device: torch.device) -> int:
        return int(self.cuda.max_memory_allocated(device))


class Timer:
    """Times a zero-argument callable between two events with a synchronize on each side (CUDA events on a GPU; host
    clock events on the CPU, through the same code) and measures its peak memory where the device has statistics.

    ``reset`` (if given) runs before every call, outside the timed region: it releases the previous call's gradients,
    so every call, and the memory measurement, starts from the same state. ``ops``: the device calls
    (:class:`CudaOps` on CUDA, :class:`CpuOps` on the CPU by default).
    """

    def __init__(self, device: torch.device, reps: int, warmup: int, ops: CpuOps | None = None) -> None:
        self.device, self.reps, self.warmup = device, reps, warmup
        self.ops = ops if ops is not None else (CudaOps() if device.type == "cuda" else CpuOps())

    def sync(self) -> None:
        self.ops.synchronize(self.device)

    def _once(self, fn: Callable[[], Any], reset: Callable[[], None] | None) -> float:
        """Milliseconds of one call."""
        if reset is not None:
            reset()
        start, end = self.ops.event(), self.ops.event()
        self.sync()
        start.record()
        fn()
        end.record()
        self.sync()
        return float(start.elapsed_time(end))

    def peak_mib(self, fn: Callable[[], Any], reset: Callable[[], None] | None = None) -> float | None:
        """Peak device memory of one call above what was allocated just before it, after ``reset`` (MiB); ``None``
        where the device has no memory statistics (the CPU)."""
        if not self.ops.memory_stats:
            return None
        if reset is not None:
            reset()  # the previous call's gradients are released before "before" is read, so this call's count
        gc.collect()
        self.sync()
        self.ops.empty_cache()
        self.ops.reset_peak(self.device)
        before = self.ops.allocated(self.device)
        fn()
        self.sync()
        return (self.ops.max_allocated(self.device) - before) / 2**20

    def measure(self, fn: Callable[[], Any], memory: bool = True,
                reset: Callable[[], None] | None = None) -> dict[str, Any]:
        """Warm-up calls, one memory call, ``reps`` timed calls; the backend in force afterwards, the ``"auto"``
        compile stats and the warnings raised (e.g. a compiler failure that turned the process eager)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(self.warmup):
                if reset is not None:
                    reset()
                fn()
            self.sync()
            peak = self.peak_mib(fn, reset) if memory else None
            times = [self._once(fn, reset) for _ in range(self.reps)]
        if reset is not None:
            reset()
        return {"best_ms": min(times), "median_ms": statistics.median(times), "peak_mib": peak,
                **_backend_state(), "warnings": sorted({f"{w.category.__name__}: {w.message}"[:300] for w in caught})}


def _backend_state() -> dict[str, Any]:
    """What actually ran: ``uf.backend.get_backend()`` now (``"eager"`` once a configuration failed to compile), and
    ``uf.backend.compile_stats()``."""
    ran = "eager" if uf.backend.compile_failures() else uf.backend.get_backend()
    return {"backend_after": ran, "compile_stats": uf.backend.compile_stats()}


def _failed(exc: BaseException) -> dict[str, Any]:
    """A row's fields for a call that raised (the OOM, or the error's type and first line)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    kind = "OOM" if isinstance(exc, torch.OutOfMemoryError) else type(exc).__name__
    lines = str(exc).strip().splitlines()
    message = lines[0][:200] if lines else repr(exc)[:200]
    return {"best_ms": None, "median_ms": None, "peak_mib": None, **_backend_state(), "warnings": [],
            "error": f"{kind}: {message}"}


class Recorder:
    """Collects a section's rows: each row is printed as it finishes and the whole JSON rewritten, so a run killed
    by a time limit keeps every finished row; rows that would start after the deadline are recorded as skipped."""

    def __init__(self, results: dict[str, Any], save: Callable[[], None], deadline: float | None) -> None:
        self.results, self.save, self.deadline = results, save, deadline
        self.key = ""

    def section(self, key: str) -> list[dict[str, Any]]:
        self.key = key
        self.results[key] = []
        return self.results[key]

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def row(self, fields: dict[str, Any], run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``fields`` updated by ``run()`` (its measurement), by ``_failed`` if it raises, or skipped past the
        deadline; appended, printed and saved."""
        row = dict(fields)
        start = time.perf_counter()
        if self.out_of_time():
            row.update({"best_ms": None, "median_ms": None, "peak_mib": None, "skipped": "time budget"})
        else:
            try:
                row.update(run())
            except Exception as exc:  # noqa: BLE001 - an OOM or a missing kernel is a row, not a crash
                row.update(_failed(exc))
        row["seconds"] = round(time.perf_counter() - start, 3)
        self.results[self.key].append(row)
        label = " ".join(f"{k}={row[k]}" for k in fields)
        if row.get("error") or row.get("skipped"):
            status = row.get("error") or row["skipped"]
        elif row.get("best_ms") is None:
            status = str(row.get("status", "not measured"))
        else:
            status = f"best {_fmt(row['best_ms'], '.3f')} ms, backend_after {row.get('backend_after')}"
        print(f"  [{self.key}] {label}: {status} ({row['seconds']:.1f} s)", flush=True)
        self.save()
        return row


def _fmt(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:{spec}}{suffix}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _print_table(title: str, columns: list[tuple[str, int]], rows: list[list[str]]) -> None:
    print(f"\n{title}")
    print("".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w) in enumerate(columns)))
    for row in rows:
        print("".join(f"{cell:>{w}}" if i else f"{cell:<{w}}" for i, (cell, (_, w)) in enumerate(zip(row, columns))))


# ------------------------------------------------------------------------------------------- (a) loss vs cross-entropy
def _bench_loss_v(N: int, V: int, backends: list[str], kernel_names: list[str], device: torch.device, timer: Timer,
                  rec: Recorder) -> None:
    """Rows of one vocabulary size: cross-entropy, then gidd_loss (uniform, mask) under each backend."""
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(N, V, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    x0 = torch.randint(0, V - 1, (N,), device=device, generator=g)  # never the mask id V - 1
    t = torch.rand(N, device=device, generator=g) * 0.98 + 0.01
    every = {"uniform": uf.UniformKernel(V), "mask": uf.MaskKernel(V, V - 1)}
    kernels = {name: every[name] for name in kernel_names}
    x_ts = {name: k.sample(x0, t, generator=g) for name, k in kernels.items()}

    def reset() -> None:
        logits.grad = None

    def ce() -> None:
        F.cross_entropy(logits, x0, reduction="none").sum().backward()

    def make(name: str) -> Callable[[], None]:
        kernel, x_t = kernels[name], x_ts[name]

        def run() -> None:
            uf.losses.gidd_loss(logits, x0, x_t, t, kernel).sum().backward()
        return run

    base = rec.row({"backend": "-", "loss": "cross_entropy", "validation": False, "N": N, "V": V},
                   lambda: timer.measure(ce, reset=reset))
    base["ratio_vs_ce"] = 1.0 if base["best_ms"] is not None else None
    # validation off: the loss as diffusion_loss runs it (after the step's one batched check); then the first
    # kernel once more with the defaults a direct caller of gidd_loss meets (validation on: its checks' read-backs)
    configs = [(backend, name, False) for backend in backends for name in kernels]
    configs.append((backends[-1], next(iter(kernels)), True))
    for backend, name, validation in configs:
        def run(backend: str = backend, name: str = name, validation: bool = validation) -> dict[str, Any]:
            uf.backend.set_backend(backend)
            with uf.validation.validation(validation):
                return timer.measure(make(name), reset=reset)

        row = rec.row({"backend": backend, "loss": f"gidd_{name}", "validation": validation, "N": N, "V": V}, run)
        row["ratio_vs_ce"] = _ratio(row["best_ms"], base["best_ms"])
    rec.save()


def bench_loss(cfg: argparse.Namespace, device: torch.device, timer: Timer, rec: Recorder) -> None:
    rows = rec.section("loss_vs_cross_entropy")
    for V in cfg.loss_v:
        try:
            _bench_loss_v(cfg.loss_n, V, cfg.backends, cfg.loss_kernels, device, timer, rec)
        except Exception as exc:  # noqa: BLE001 - the inputs themselves did not fit: a row, and the next size
            rec.row({"backend": "-", "loss": "inputs", "validation": False, "N": cfg.loss_n, "V": V},
                    lambda exc=exc: _failed(exc))
        gc.collect()
    for r in rows:
        r.setdefault("ratio_vs_ce", None)
    rec.save()
    _print_table(f"(a) loss forward+backward vs F.cross_entropy, bf16 logits (N, V), best of {timer.reps} "
                 f"(goal: ratio ≤ 1.00×; val: argument checks on)",
                 [("loss", 16), ("backend", 10), ("val", 5), ("ran", 9), ("N", 8), ("V", 9), ("best ms", 10),
                  ("median ms", 11), ("peak MiB", 10), ("vs CE", 8), ("goal", 6)],
                 [[r["loss"], r["backend"], "on" if r["validation"] else "off", str(r.get("backend_after", "-")),
                   str(r["N"]), str(r["V"]),
                   _fmt(r["best_ms"], ".3f"), _fmt(r["median_ms"], ".3f"), _fmt(r["peak_mib"], ".0f"),
                   _fmt(r.get("ratio_vs_ce"), ".2f", "x"),
                   "-" if r["loss"] == "cross_entropy" or r.get("ratio_vs_ce") is None
                   else ("ok" if r["ratio_vs_ce"] <= 1.0 else "MISS")] for r in rows])


# ---------------------------------------------------------------------------------------- (b) fused vs alternatives
THIRD_PARTY_DEVICE_TYPES = ("cuda",)
"""Devices Liger-Kernel's and Cut Cross-Entropy's kernels run on (both are Triton kernels; ROCm builds report
``"cuda"``). Elsewhere their rows are ``"skipped: needs CUDA"``."""


def _liger(reduction: str) -> Callable[..., torch.Tensor] | str:
    """Liger-Kernel's fused linear cross-entropy as ``fn(h (N, d), W (V, d), y (N,)) -> loss``, or why not.

    ``LigerFusedLinearCrossEntropyLoss(reduction=...)`` is called as ``module(lin_weight, _input, target)`` — the
    weight first (liger-kernel 0.8.5, ``transformers/fused_linear_cross_entropy.py``). It returns the loss tensor
    (a tuple in releases before 0.5, a ``CrossEntropyOutput`` when asked for extra outputs, which we do not do)."""
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return "not installed"
    module = LigerFusedLinearCrossEntropyLoss(reduction=reduction)

    def fn(h: torch.Tensor, W: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = module(W, h, y)  # Liger's order: (lin_weight, _input, target)
        if isinstance(out, tuple):
            out = out[0]
        return getattr(out, "loss", out)
    return fn


def _cce(reduction: str) -> Callable[..., torch.Tensor] | str:
    """Apple's Cut Cross-Entropy as ``fn(h (N, d), W (V, d), y (N,)) -> loss``, or why not:
    ``linear_cross_entropy(e, c, targets, ..., reduction=...)`` with the embeddings ``e`` first and the classifier
    ``c`` (V, d) second (cut-cross-entropy 25.1.1)."""
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError:
        return "not installed"

    def fn(h: torch.Tensor, W: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(h, W, y, reduction=reduction)
    return fn


def _check_close_to_ce(fn: Callable[[], torch.Tensor], reference: torch.Tensor, rtol: float = 1e-2) -> float:
    """Relative error of ``fn()`` against the float32 cross-entropy ``reference``; a ``RuntimeError`` (the row's
    error) beyond ``rtol``, so a wrapper that passed the arguments in the wrong order cannot report a time."""
    with torch.no_grad():
        value = fn().float()
    err = float((value - reference).abs() / reference.abs().clamp_min(1e-12))
    if not math.isfinite(err) or err > rtol:
        raise RuntimeError(f"loss {float(value):.6g} differs from cross-entropy {float(reference):.6g} by "
                           f"{err:.2g} (relative), more than {rtol}")
    return err


def bench_fused(cfg: argparse.Namespace, device: torch.device, timer: Timer, rec: Recorder) -> None:
    N, d, V = cfg.fused_n, cfg.fused_d, cfg.fused_v
    rows = rec.section("fused_vs_alternatives")
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(N, d, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    W = (0.02 * torch.randn(V, d, device=device, generator=g)).to(torch.bfloat16).requires_grad_()
    x0 = torch.randint(0, V, (N,), device=device, generator=g)
    t = torch.rand(N, device=device, generator=g) * 0.98 + 0.01
    kernel = uf.UniformKernel(V)
    x_t = kernel.sample(x0, t, generator=g)
    with torch.no_grad():
        ce_sum = F.cross_entropy(h.float() @ W.float().T, x0, reduction="sum")  # reference of the CE variants

    def reset() -> None:
        h.grad = None
        W.grad = None

    def wrap(loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            loss_fn().backward()
        return run

    def fused() -> torch.Tensor:
        return fused_linear_diffusion_loss(h, W, x0, x_t, t, kernel, reduction="sum")

    # (name, backend, validation, run or status, the loss to check against cross-entropy before timing)
    variants: list[tuple[str, str, bool, Callable[[], None] | str, Callable[[], torch.Tensor] | None]] = [
        ("materialised_ce", "-", False, wrap(lambda: F.cross_entropy(h @ W.T, x0, reduction="sum")), None),
        ("materialised_gidd", cfg.backends[-1], False,
         wrap(lambda: uf.losses.gidd_loss(h @ W.T, x0, x_t, t, kernel).sum()), None),
    ]
    for backend in cfg.backends:
        variants.append(("fused_gidd", backend, False, wrap(fused), None))
    # the defaults a user meets: validation on (the argument checks' host read-back included)
    variants.append(("fused_gidd", cfg.backends[-1], True, wrap(fused), None))
    for name, factory in (("liger_flce", _liger), ("cce", _cce)):
        fn = factory("sum")
        if isinstance(fn, str):
            variants.append((name, "-", False, fn, None))
        elif device.type not in THIRD_PARTY_DEVICE_TYPES:
            variants.append((name, "-", False, "skipped: needs CUDA", None))
        else:
            def loss(fn: Callable[..., torch.Tensor] = fn) -> torch.Tensor:
                return fn(h, W, x0)
            variants.append((name, "-", False, wrap(loss), loss))
    for name, backend, validation, run, check in variants:
        fields: dict[str, Any] = {"variant": name, "backend": backend, "validation": validation, "N": N, "d": d,
                                  "V": V}
        if isinstance(run, str):
            rec.row(fields, lambda run=run: {"best_ms": None, "median_ms": None, "peak_mib": None, "status": run})
            continue

        def measure(run: Callable[[], None] = run, backend: str = backend, validation: bool = validation,
                    check: Callable[[], torch.Tensor] | None = check) -> dict[str, Any]:
            if backend != "-":
                uf.backend.set_backend(backend)
            extra = {} if check is None else {"rel_err_vs_ce": _check_close_to_ce(check, ce_sum)}
            with uf.validation.validation(validation):
                return {**timer.measure(run, reset=reset), **extra}

        row = rec.row(fields, measure)
        row["status"] = row.get("error") or row.get("skipped") or "ok"
    fast = [r for r in rows if not r["validation"]]  # the reference rows: validation off
    by = {r["variant"]: r for r in reversed(fast)}  # the first row of each variant
    base = by["materialised_ce"]
    for r in rows:
        r["time_vs_materialised_ce"] = _ratio(r["best_ms"], base["best_ms"])
        r["time_vs_liger"] = _ratio(r["best_ms"], by["liger_flce"]["best_ms"])
        r["memory_vs_cce"] = _ratio(r["peak_mib"], by["cce"]["peak_mib"])
    rec.save()

    def goal(r: dict[str, Any]) -> str:
        if r["variant"] != "fused_gidd":
            return "-"
        verdicts = []
        if r["time_vs_liger"] is not None:
            verdicts.append("time ok" if r["time_vs_liger"] <= 1.0 else "time MISS")
        if r["memory_vs_cce"] is not None:
            verdicts.append("mem ok" if r["memory_vs_cce"] <= 1.1 else "mem MISS")
        return ", ".join(verdicts) or "no reference"

    _print_table(f"(b) output head + loss forward+backward, bf16, N={N} d={d} V={V}, best of {timer.reps} "
                 f"(goals: fused time ≤ Liger's, memory ≤ 1.1× CCE's; val: argument checks on)",
                 [("variant", 19), ("backend", 10), ("val", 5), ("ran", 9), ("best ms", 10), ("median ms", 11),
                  ("peak MiB", 10), ("vs CE", 8), ("vs Liger", 10), ("mem/CCE", 9), ("  status / goal", 30)],
                 [[r["variant"], r["backend"], "on" if r["validation"] else "off", str(r.get("backend_after", "-")),
                   _fmt(r["best_ms"], ".3f"), _fmt(r["median_ms"], ".3f"), _fmt(r["peak_mib"], ".0f"),
                   _fmt(r["time_vs_materialised_ce"], ".2f", "x"), _fmt(r["time_vs_liger"], ".2f", "x"),
                   _fmt(r["memory_vs_cce"], ".2f", "x"),
                   "  " + (r["status"] if r["status"] != "ok" else goal(r))] for r in rows])


# -------------------------------------------------------------------------------------------- (c) sampling vs AR
def bench_sampling(cfg: argparse.Namespace, device: torch.device, timer: Timer, rec: Recorder) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    rows = rec.section("sampling_vs_ar")
    torch.manual_seed(0)
    config = GPT2Config(**cfg.gpt2_overrides)
    base = GPT2LMHeadModel(config).to(device=device, dtype=cfg.model_dtype).eval()
    L = cfg.seq_len
    bos = torch.tensor([[config.bos_token_id]], device=device)
    uf.backend.set_backend(cfg.sample_backend)

    def ar() -> torch.Tensor:
        return base.generate(bos, attention_mask=torch.ones_like(bos), max_new_tokens=L, min_new_tokens=L,
                             do_sample=True, use_cache=True, pad_token_id=config.eos_token_id)

    last: dict[str, torch.Tensor] = {}

    def keep(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            last["out"] = fn()
        return run

    def checked(fn: Callable[[], torch.Tensor], check: Callable[[torch.Tensor], None]) -> Callable[[], dict[str, Any]]:
        """Measure ``fn``, then check its last output (a wrong output makes the row an error, not a number)."""
        def run() -> dict[str, Any]:
            last.pop("out", None)
            res = timer.measure(keep(fn), memory=False)
            check(last["out"])
            return res
        return run

    def ar_check(out: torch.Tensor) -> None:
        if out.shape[1] != L + 1:
            raise RuntimeError(f"generate produced {out.shape[1] - 1} new tokens, expected {L}")

    with torch.inference_mode():
        ar_row = rec.row({"method": "gpt2 AR generate (KV cache)", "steps": None, "validation": False},
                         checked(ar, ar_check))
        model = uf.adapt_ar_model(base, add_mask_token=False)
        kernel = uf.UniformKernel(model.num_states)
        gx = torch.Generator(device=device).manual_seed(1)
        x = torch.randint(0, model.num_states, (1, L), device=device, generator=gx)
        tt = torch.full((1,), 0.5, device=device)

        def forward() -> dict[str, Any]:
            with uf.validation.validation(False):
                return timer.measure(lambda: model(x, tt), memory=False)

        fwd_row = rec.row({"method": "adapted forward (1, L)", "steps": 1, "validation": False}, forward)

        def ids_check(ids: torch.Tensor) -> None:
            if ids.shape != (1, L) or int(ids.min()) < 0 or int(ids.max()) >= model.num_states:
                raise RuntimeError(f"sampler returned invalid ids: shape {tuple(ids.shape)}")

        # validation off, then the first step count with the defaults (validation on: checked once per sample())
        for N, validation in [(N, False) for N in cfg.steps] + [(cfg.steps[0], True)]:
            def sample(N: int = N, validation: bool = validation) -> dict[str, Any]:  # a failure is the row's
                sampler = uf.BayesianSampler(model, kernel, num_steps=N)
                g = torch.Generator(device=device).manual_seed(0)
                with uf.validation.validation(validation):
                    return checked(lambda: sampler.sample(1, L, generator=g), ids_check)()

            rec.row({"method": "BayesianSampler (uniform)", "steps": N, "validation": validation}, sample)
    ar_ms, fwd_ms = ar_row["best_ms"], fwd_row["best_ms"]
    for r in rows:
        r["speedup_vs_ar"] = _ratio(ar_ms, r["best_ms"])
        r["per_step_overhead"] = (_ratio(r["best_ms"] / r["steps"], fwd_ms)
                                  if r["method"].startswith("BayesianSampler") and r["best_ms"] is not None
                                  else None)
    rec.save()
    first = next((r for r in rows if r["steps"] == 16 and r["method"].startswith("Bayes") and not r["validation"]),
                 None)
    _print_table(f"(c) App. C.6: GPT-2 ({config.n_layer} layers, d={config.n_embd}, V={config.vocab_size}) "
                 f"{str(cfg.model_dtype).removeprefix('torch.')}, "
                 f"batch 1, {L} tokens, best of {timer.reps}; sampler backend {cfg.sample_backend} "
                 f"(paper: 87.1 ms at 16 steps, 16.97x; goal ≥ 17x; val: argument checks on)",
                 [("method", 30), ("steps", 6), ("val", 5), ("ran", 9), ("best ms", 11), ("median ms", 11),
                  ("tokens/s", 10), ("vs AR", 8), ("step/fwd", 9), ("  status", 10)],
                 [[r["method"], "-" if r["steps"] is None else str(r["steps"]), "on" if r["validation"] else "off",
                   str(r.get("backend_after", "-")),
                   _fmt(r["best_ms"], ".1f"), _fmt(r["median_ms"], ".1f"),
                   _fmt(L / (r["best_ms"] / 1e3) if r["best_ms"] else None, ".0f"),
                   _fmt(r["speedup_vs_ar"], ".2f", "x"), _fmt(r["per_step_overhead"], ".2f", "x"),
                   "  " + (r.get("error") or r.get("skipped") or "ok")] for r in rows])
    if first is not None and first["speedup_vs_ar"] is not None:
        print(f"16 steps: {first['speedup_vs_ar']:.2f}x AR -> goal ≥ 17x "
              f"{'met' if first['speedup_vs_ar'] >= 17 else 'MISSED'}")


# -------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: check every code path, in seconds")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of: " + ", ".join(SECTIONS))
    p.add_argument("--reps", type=int, default=None, help="timed runs per row (default 10; sampling 5; dry run 1)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per row (default 2; dry run 0)")
    p.add_argument("--backends", default="eager,compiled", help="loss backends to compare")
    p.add_argument("--loss-kernels", default="uniform,mask", help="kernels of the loss section: uniform, mask")
    p.add_argument("--sample-backend", default=None, help="backend for sampling (default compiled; dry run eager)")
    p.add_argument("--dry-run-compiled", action="store_true",
                   help="with --dry-run, also run the compiled backend (compiles on the CPU: tens of seconds)")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes, steps and repetitions (V=262,144 only, 16 and 64 steps, 3 reps): one pass of "
                        "every section that fits a 10-minute limit with room for compilation")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="rows that would start after this many seconds are recorded as skipped (the run then ends "
                        "cleanly, e.g. below a per-command time limit)")
    args = p.parse_args(argv)
    if args.time_budget is not None and args.time_budget <= 0:
        p.error(f"--time-budget: expected a positive number of seconds, got {args.time_budget}")
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    for s in args.sections:
        if s not in SECTIONS:
            p.error(f"--sections: unknown section {s!r} (choose from {', '.join(SECTIONS)})")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.loss_kernels = [k.strip() for k in args.loss_kernels.split(",") if k.strip()]
    for k in args.loss_kernels:
        if k not in ("uniform", "mask"):
            p.error(f"--loss-kernels: unknown kernel {k!r} (choose from uniform, mask)")
    for b in args.backends:
        if b not in ("eager", "compiled", "auto"):
            p.error(f"--backends: unknown backend {b!r}")
    if args.dry_run:
        if not args.dry_run_compiled:
            args.backends = [b for b in args.backends if b != "compiled"] or ["eager"]
        args.reps = args.reps or 1
        args.warmup = 0 if args.warmup is None else args.warmup
        args.loss_n, args.loss_v = 64, [1000, 2000]
        args.fused_n, args.fused_d, args.fused_v = 64, 32, 2000
        args.gpt2_overrides = dict(n_layer=2, n_embd=64, n_head=2, n_positions=128)
        args.seq_len, args.steps = 64, [2, 4]
        args.sample_backend = args.sample_backend or "eager"
        args.model_dtype = torch.float32  # bf16 matmuls are slow on most CPUs; the GPU run uses bf16
    else:
        args.reps = args.reps or (3 if args.quick else 10)
        args.warmup = (1 if args.quick else 2) if args.warmup is None else args.warmup
        args.loss_n, args.loss_v = 16384, ([262144] if args.quick else [49152, 262144])
        args.fused_n, args.fused_d, args.fused_v = 16384, 1536, 262144
        args.gpt2_overrides = {}
        args.seq_len, args.steps = 512, ([16, 64] if args.quick else [16, 32, 64, 128, 256])
        args.sample_backend = args.sample_backend or "compiled"
        args.model_dtype = torch.bfloat16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # piped to a file under a time limit: every line lands
    device = torch.device("cpu") if args.dry_run else torch.device("cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    info = {"name": name, "type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
            "unifusion": uf.__version__, "dry_run": bool(args.dry_run), "quick": bool(args.quick),
            "sections": args.sections, "backends": args.backends, "sample_backend": args.sample_backend,
            "reps": args.reps, "warmup": args.warmup, "time_budget_s": args.time_budget,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "goals": GOALS,
            # how the fused loss accumulates ∂W from bf16 operands here: "addmm"/"mm" (float32-output GEMM on the
            # bf16 operands: tensor cores) or null (float32 operands)
            "fused_fp32_accumulation": fused_linear.fp32_accumulation_mode(device, torch.bfloat16)}
    print(f"device: {name} | torch {torch.__version__} (CUDA {torch.version.cuda}) | unifusion {uf.__version__}"
          f"{' | DRY RUN: tiny sizes on the CPU, numbers not meaningful' if args.dry_run else ''}")
    print(GOALS)
    print(f"fused loss: dW accumulated from bf16 operands by {info['fused_fp32_accumulation'] or 'float32 GEMMs'}; "
          f"default block at V={args.fused_v}: "
          f"{fused_linear.default_chunk_size(args.fused_n, args.fused_v, device)} rows")
    if args.dry_run:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    # Validation: the rows time the hot paths with the argument checks off (as diffusion_loss runs the loss after
    # its one batched check, and as a tuned loop runs); each section adds a row with the defaults a user meets
    # (validation on: the checks' host read-backs included), marked "validation": true.
    uf.validation.set_validation(False)
    results: dict[str, Any] = {"device": info, "loss_vs_cross_entropy": [], "fused_vs_alternatives": [],
                               "sampling_vs_ar": []}

    def save() -> None:
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            tmp = f"{args.out}.tmp"
            with open(tmp, "w") as f:
                json.dump(results, f, indent=2)
            os.replace(tmp, args.out)  # a kill mid-write leaves the previous complete file

    save()
    t0 = time.perf_counter()
    deadline = None if args.time_budget is None else t0 + args.time_budget
    sampling_timer = Timer(device, args.reps if args.dry_run else min(args.reps, 5), args.warmup)
    timer = Timer(device, args.reps, args.warmup)
    rec = Recorder(results, save, deadline)
    for section, key, fn, tm in (("loss", "loss_vs_cross_entropy", bench_loss, timer),
                                 ("fused", "fused_vs_alternatives", bench_fused, timer),
                                 ("sampling", "sampling_vs_ar", bench_sampling, sampling_timer)):
        if section not in args.sections:
            continue
        print(f"\n== {section} ({time.perf_counter() - t0:.0f} s elapsed)")
        try:
            fn(args, device, tm, rec)
        except Exception as exc:  # noqa: BLE001 - setting a section up failed (inputs, the model): record, go on
            rec.key = key
            rec.results.setdefault(key, [])
            rec.row({"section": section, "setup": "failed"}, lambda exc=exc: _failed(exc))
        gc.collect()
        timer.ops.empty_cache()
    results["device"]["seconds"] = round(time.perf_counter() - t0, 1)
    save()
    print(f"\ntotal {time.perf_counter() - t0:.1f} s" + (f"; results in {args.out}" if args.out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
