"""Peak memory of ``uf.diffusion_loss`` against the model forward + the fast loss on the same logits (issue #15 §3).

    python benchmarks/loss_memory.py                               # SmolLM2-135M shape, B = 2, L = 256
    python benchmarks/loss_memory.py --layers 4 --seq-len 512 --json mem.json   # docs/gpu.md's CPU table
    python benchmarks/loss_memory.py --device cuda                 # on a GPU: torch.cuda.max_memory_allocated

Every variant runs a random Llama with SmolLM2-135M's shapes (``--layers`` of its 30 layers, d = 576, V = 49,152,
tied embeddings, float32 weights) adapted with ``adapt_ar_model``, on the same clean tokens ``x_0``, times ``t`` and
corruption ``x_t`` (one seeded generator), bidirectional (γ = 1), validation on (the defaults users meet), each in a
fresh process, in float32 and under ``torch.autocast(dtype=torch.bfloat16)``, as one training call (``--modes
train``: forward + ``.sum().backward()``) and one evaluation call (``eval``: the forward under ``torch.no_grad``):

* ``forward+loss`` (the baseline): ``logits = model(x_t, t)``, then ``uf.losses.x0_head_loss(logits, ...)``;
* ``diffusion_loss``: ``uf.diffusion_loss(model, x0, kernel, t=t, generator=g)`` (corrupts ``x_0`` itself);
* ``diffusion_loss_fused``: the same with ``fused=True`` (the logits never exist);
* ``sliced_logits``: the network's ``(B, L + 1, V)`` logits sliced to ``[:, :-1]`` and given to the loss — what
  ``DiffusionLM.forward`` returned before it applied the output head to the ``L`` positions it needs: a strided view
  that the loss copies whole, and whose backward allocates a ``(B, L + 1, V)`` gradient;
* ``float32_logits``: the logits cast to float32 before the loss — what ``diffusion_loss`` did to bf16 logits before
  (a no-op in float32).

Goal: ``diffusion_loss`` ≤ 1.1× ``forward+loss``.

Memory of one call, above what is live just before it (inputs and weights are not counted; the call's temporaries,
its saved activations and the gradients it produces are; parameter gradients are released before the call):

* CPU: the peak of live tensor bytes from the CPU allocator's own allocation/free events
  (``torch.profiler.profile(profile_memory=True)``; :func:`allocator_peak_bytes`) — exact and independent of the
  heap's behaviour; and, for reference, the peak RSS increase (``ru_maxrss``) of the first call in that process.
* CUDA: ``torch.cuda.max_memory_allocated`` during the call minus ``memory_allocated`` before it.

Ratios are against ``forward+loss`` in the same mode and dtype. CPU figures are memory of the CPU run: the allocator
counts tensor bytes, which a GPU's caching allocator rounds and caches differently; no GPU figure is implied.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

import unifusion as uf
from unifusion.hf import DiffusionLM

VARIANTS = ("forward+loss", "diffusion_loss", "diffusion_loss_fused", "sliced_logits", "float32_logits")
BASELINE = "forward+loss"
DTYPES = ("float32", "bf16-autocast")
MODES = ("train", "eval")
GOAL = 1.1
_MARK = "LOSS_MEMORY_JSON "


# ------------------------------------------------------------------------------------------------------- meters
def allocator_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak of CPU tensor memory live during ``fn()`` above what was live when it started, in bytes.

    Read from the allocator's own events: ``torch.profiler`` with ``profile_memory=True`` records every allocation
    and free of PyTorch's CPU allocator (ops, autograd's backward, Inductor's generated code alike), with its size;
    the running sum of those events, in time order, is the live memory the call added, and its maximum the peak.
    PyTorch's CPU allocator does not cache blocks, so this is exactly the memory the call's tensors held.

    The profiler sees the allocations of the calling thread (and autograd's, which runs there on the CPU), not those
    of Python threads the call starts: the eager fast loss splits its blocks over ``torch.get_num_threads()`` such
    threads, so the call runs with one intra-op thread here (its blocks then run in the calling thread, one at a
    time; with more threads each extra one holds one more block's temporaries, ~10 float32 blocks of 2¹⁸ logits).
    """
    from torch.profiler import ProfilerActivity, profile

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        torch.set_num_threads(threads)
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:  # pragma: no cover - a torch build without kineto
        raise RuntimeError("allocator_peak_bytes: this torch build's profiler has no kineto results")
    cpu = torch._C._autograd.DeviceType.CPU
    events = sorted((e for e in results.events() if e.name() == "[memory]" and e.device_type() == cpu),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += int(e.nbytes())
        peak = max(peak, live)
    return peak


def cuda_peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """``torch.cuda.max_memory_allocated`` during ``fn()`` minus what was allocated just before it, in bytes."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ------------------------------------------------------------------------------------------------ model, variants
def smollm2_shaped(layers: int, vocab_size: int = 49152, hidden_size: int = 576, intermediate_size: int = 1536,
                   heads: int = 9, kv_heads: int = 3) -> torch.nn.Module:
    """A random ``LlamaForCausalLM`` with SmolLM2-135M's shapes by default (``layers`` of them), float32, eval."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def adapted(base: torch.nn.Module, kernel: str) -> DiffusionLM:
    """``base`` adapted for ``kernel``: no mask token for ``"uniform"``; for ``"mask"`` token 0 is the absorbing state
    (an existing id, so the vocabulary and the shapes stay those of the base model)."""
    if kernel == "uniform":
        return uf.adapt_ar_model(base, add_mask_token=False)
    return uf.adapt_ar_model(base, mask_token_id=0)


class Case:
    """One configuration: the adapted model, ``x_0``, ``t``, the kernel and the seeded corruption ``x_t``."""

    def __init__(self, model: DiffusionLM, batch_size: int, seq_len: int, kernel: str, seed: int = 0) -> None:
        self.model, self.seed = model, seed
        device = model.device
        V = model.num_states
        g = torch.Generator(device=device).manual_seed(seed)
        if kernel == "mask" and model.mask_token_id is None:
            raise ValueError("kernel: 'mask' needs a model with a mask token (see adapted())")
        self.kernel = uf.UniformKernel(V) if kernel == "uniform" else uf.MaskKernel(V, mask_id=model.mask_token_id)
        self.x0 = torch.randint(1, V, (batch_size, seq_len), device=device, generator=g)
        self.t = torch.rand(batch_size, device=device, generator=g) * 0.98 + 0.01
        self.x_t = self.kernel.sample(self.x0, self.t, generator=self._generator())  # what diffusion_loss draws

    def _generator(self) -> torch.Generator:
        return torch.Generator(device=self.model.device).manual_seed(self.seed + 1)

    def _loss(self, logits: torch.Tensor) -> torch.Tensor:
        B, L = self.x0.shape
        return uf.losses.x0_head_loss(logits, self.x0, self.x_t, self.t[:, None].expand(B, L), self.kernel)

    def variant(self, name: str) -> Callable[[], torch.Tensor]:
        """The variant's forward; its ``.sum().backward()`` completes the call (see :meth:`step`)."""
        model = self.model
        if name == "forward+loss":
            return lambda: self._loss(model(self.x_t, self.t))
        if name in ("diffusion_loss", "diffusion_loss_fused"):
            fused = name.endswith("fused")
            return lambda: uf.diffusion_loss(model, self.x0, self.kernel, t=self.t, generator=self._generator(),
                                             fused=fused).loss
        if name == "float32_logits":  # what diffusion_loss did to bf16 logits before 0.2: a float32 copy
            return lambda: self._loss(model(self.x_t, self.t).float())
        if name == "sliced_logits":
            def sliced() -> torch.Tensor:
                kwargs = model.network_inputs(self.x_t, self.t)
                return self._loss(model.hf_model(**kwargs).logits[:, :-1])  # (B, L, V) view of (B, L + 1, V)
            return sliced
        raise ValueError(f"variant: expected one of {VARIANTS}, got {name!r}")

    def step(self, name: str, dtype: str, mode: str = "train") -> Callable[[], None]:
        """One call of ``name`` in ``dtype`` (``"float32"`` or ``"bf16-autocast"``): ``mode="train"`` is forward +
        ``.sum().backward()``, ``"eval"`` the forward and ``.sum()`` under ``torch.no_grad`` (a validation loss)."""
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
        forward = self.variant(name)
        device_type = self.model.device.type

        def run() -> None:
            ctx: AbstractContextManager[Any] = (torch.autocast(device_type, dtype=torch.bfloat16)
                                                if dtype == "bf16-autocast" else nullcontext())
            if mode == "eval":
                with torch.no_grad(), ctx:
                    forward().sum()
                return
            with ctx:
                loss = forward()
            loss.sum().backward()
        return run

    def release(self) -> None:
        self.model.zero_grad(set_to_none=True)


def peak_bytes(case: Case, name: str, dtype: str, mode: str = "train") -> int:
    """Peak memory of one call of ``name`` in ``dtype`` and ``mode`` above what was live before it (gradients
    released first): the CPU allocator's events on the CPU, ``max_memory_allocated`` on CUDA."""
    case.release()
    run = case.step(name, dtype, mode)
    device = case.model.device
    peak = cuda_peak_bytes(run, device) if device.type == "cuda" else allocator_peak_bytes(run)
    case.release()
    return peak


def logits_bytes(case: Case, dtype: str) -> int:
    B, L = case.x0.shape
    return B * L * case.model.num_states * (2 if dtype == "bf16-autocast" else 4)


# -------------------------------------------------------------------------------------------------------- main
def _child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    uf.backend.set_backend(args.backend)
    model = adapted(smollm2_shaped(args.layers, args.vocab), args.kernel).to(device)
    case = Case(model, args.batch_size, args.seq_len, args.kernel)
    run = case.step(args.child, args.dtype, args.mode)
    rss0 = _rss_bytes()
    run()  # first call: its peak RSS increase (CPU)
    rss = _rss_bytes() - rss0 if device.type == "cpu" else None
    peak = peak_bytes(case, args.child, args.dtype, args.mode)  # second call: the allocator's (or CUDA's) peak
    print(_MARK + json.dumps({"peak_bytes": peak, "rss_bytes": rss, "logits_bytes": logits_bytes(case, args.dtype)}),
          flush=True)


def _fmt(x: float | None, spec: str) -> str:
    width = spec.split(".")[0]
    return f"{'-':>{width}s}" if x is None else f"{x:{spec}}"


def _measure(args: argparse.Namespace, variant: str, dtype: str, mode: str) -> dict[str, Any] | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--dtype", dtype, "--mode", mode,
           "--layers", str(args.layers), "--vocab", str(args.vocab), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--kernel", args.kernel, "--device", args.device,
           "--threads", str(args.threads), "--backend", args.backend]
    out = subprocess.run(cmd, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith(_MARK):
            return dict(json.loads(line[len(_MARK):]))
    print(f"# {variant} {dtype} {mode}: child exited with {out.returncode}\n{out.stderr[-2000:]}", file=sys.stderr)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M has 30)")
    p.add_argument("--vocab", type=int, default=49152, help="V (SmolLM2: 49,152)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--kernel", choices=("uniform", "mask"), default="uniform")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated subset of " + ", ".join(DTYPES))
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated subset of: train (forward + backward), eval (forward under no_grad)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", choices=("eager", "compiled", "auto"), default=None,
                   help="uf.backend.set_backend for the loss (default: eager on the CPU, compiled on CUDA)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="train", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        _child(args)
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA device", file=sys.stderr)
        return 2
    args.backend = args.backend or ("compiled" if args.device.startswith("cuda") else "eager")
    chosen = {}
    for flag, allowed in (("dtypes", DTYPES), ("modes", MODES), ("variants", VARIANTS)):
        chosen[flag] = [x.strip() for x in getattr(args, flag).split(",") if x.strip()]
        for x in chosen[flag]:
            if x not in allowed:
                p.error(f"--{flag}: unknown value {x!r} (choose from {', '.join(allowed)})")
    variants = chosen["variants"]
    if BASELINE not in variants:
        variants.insert(0, BASELINE)
    meter = ("CUDA max_memory_allocated" if args.device.startswith("cuda")
             else "CPU allocator events (torch.profiler), CPU memory")
    print(f"# SmolLM2-shaped: {args.layers} layers, d=576, V={args.vocab}; B={args.batch_size}, L={args.seq_len}, "
          f"{args.kernel} kernel, {args.device}, loss backend {args.backend}; peak = {meter}, above the live memory "
          f"before the call; torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"{'mode':6s} {'dtype':14s} {'variant':22s} {'peak MiB':>9s} {'x base':>7s} {'+MiB':>8s} "
          f"{'+/logits':>9s} {'RSS MiB':>8s}")
    rows = []
    for mode in chosen["modes"]:
        for dtype in chosen["dtypes"]:
            res = {v: _measure(args, v, dtype, mode) for v in variants}
            base = res[BASELINE]
            for v in variants:
                r = res[v]
                if r is None:
                    print(f"{mode:6s} {dtype:14s} {v:22s} {'failed':>9s}")
                    continue
                ratio = r["peak_bytes"] / base["peak_bytes"] if base else None
                extra = r["peak_bytes"] - base["peak_bytes"] if base else None
                cols = [_fmt(r["peak_bytes"] / 2**20, "9.1f"), _fmt(ratio, "7.3f"),
                        _fmt(None if extra is None else extra / 2**20, "8.1f"),
                        _fmt(None if extra is None else extra / r["logits_bytes"], "9.2f"),
                        _fmt(None if r["rss_bytes"] is None else r["rss_bytes"] / 2**20, "8.1f")]
                print(f"{mode:6s} {dtype:14s} {v:22s} " + " ".join(cols))
                rows.append({"mode": mode, "dtype": dtype, "variant": v, **r, "ratio_vs_forward_loss": ratio})
            dl = res.get("diffusion_loss")
            if dl is not None and base is not None:
                ratio = dl["peak_bytes"] / base["peak_bytes"]
                print(f"# {mode} {dtype}: diffusion_loss / forward+loss = {ratio:.3f} (goal ≤ {GOAL}: "
                      f"{'met' if ratio <= GOAL else 'MISSED'}); one (B, L, V) logits tensor = "
                      f"{base['logits_bytes'] / 2**20:.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k not in ("child", "dtype", "mode", "json")},
                       "meter": meter, "torch": torch.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
