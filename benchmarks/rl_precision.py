"""How far bf16 moves the RL log-probs: ``uf.rl.sequence_logprob`` under bf16 autocast against float32, with and
without ``compute_dtype=torch.float32``, on SmolLM2-135M adapted to a block model.

    python benchmarks/rl_precision.py [--rows 4] [--prompt 5] [--completion 24] [--num-samples 4] [--block-size 8]
                                      [--repeats 3] [--device cpu|cuda] [--json out.json]

The rows: fixed text prompts (``--prompt`` tokens each) and the AR model's greedy continuations (``--completion``
tokens, EOS suppressed), the completion scored; ``"elbo"`` with ``--num-samples`` passes and the same row seeds in
every mode, so the modes differ only in arithmetic. Modes: ``float32`` (no autocast, the reference);
``bf16 autocast, default`` (``torch.autocast(dtype=torch.bfloat16)`` around the call, ``compute_dtype`` left at its
default: the weights' dtype); ``bf16 (compute_dtype)`` (``compute_dtype=torch.bfloat16``: the backbone in bf16, the
head, log-softmax and 1/t-weighted sums float32 as always); ``fp16 (compute_dtype)`` (float16, for scale).

Printed per mode:

* ``|mode − fp32|``: mean and max over completion tokens of the per-token estimate's absolute difference from the
  float32 one (same weights);
* ``Δ nearby``: the mean per-token |log π_θ' − log π_θ| of two policies 10⁻⁵ apart (every weight times
  ``1 + 10⁻⁵ ε``, ε standard normal, fixed seed) in that mode — what a ratio of nearby policies carries;
* ``time``: the median of ``--repeats`` forward + backward passes of the weighted estimate (a GRPO-like loss),
  relative to float32's in the same run. On a CPU without native bf16 (AVX2) bf16 is emulated and slower than
  float32: the time column says nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any

import torch

import unifusion as uf
from unifusion.hf.loading import load_causal_lm

PROMPTS = ("The capital of France is Paris, and it is", "def add(a, b):\n    return", "Once upon a time there",
           "The three primary colours are", "In 1969 the first people to walk on the Moon",
           "A list of prime numbers: 2, 3, 5,", "The recipe needs two eggs, flour and",
           "Water boils at one hundred degrees")

MODES: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    # name: (the caller's autocast dtype, sequence_logprob's compute_dtype)
    "float32": (None, None),
    "bf16 autocast, default": (torch.bfloat16, None),
    "bf16 (compute_dtype)": (torch.bfloat16, torch.bfloat16),
    "fp16 (compute_dtype)": (torch.float16, torch.float16),
}


def rows(hf: Any, tokenizer: Any, n: int, prompt: int, completion: int,
         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of ``prompt`` prompt tokens and ``completion`` greedy AR tokens; the completion mask."""
    ids = []
    for text in (PROMPTS * (n // len(PROMPTS) + 1))[:n]:
        tokens = tokenizer(text, return_tensors="pt").input_ids[:, :prompt].to(device)
        if tokens.shape[1] < prompt:
            raise ValueError(f"--prompt: {text!r} has {tokens.shape[1]} tokens, fewer than {prompt}")
        with torch.no_grad():
            out = hf.generate(tokens, max_new_tokens=completion, min_new_tokens=completion, do_sample=False,
                              pad_token_id=tokenizer.eos_token_id)
        ids.append(out[0, :prompt + completion])
    x0 = torch.stack(ids)
    mask = torch.zeros_like(x0, dtype=torch.bool)
    mask[:, prompt:] = True
    return x0, mask


def estimate(model: uf.DiffusionLM, x0: torch.Tensor, mask: torch.Tensor, mode: str, num_samples: int,
             *, backward: bool = False) -> torch.Tensor:
    """The per-token ``"elbo"`` estimate ``(B, L)`` in ``mode``; with ``backward``, also the backward of a weighted
    sum (outside autocast, as the Trainer runs it)."""
    autocast, compute_dtype = MODES[mode]
    gens = [torch.Generator(device=x0.device).manual_seed(100 + b) for b in range(x0.shape[0])]
    region = torch.autocast(x0.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with torch.set_grad_enabled(backward), region:
        out = uf.rl.sequence_logprob(model, x0, mask, estimator="elbo", num_samples=num_samples, generator=gens,
                                     compute_dtype=compute_dtype)
        loss = (out.per_token * torch.linspace(-1.0, 1.0, x0.shape[0], device=x0.device)[:, None]).sum()
    if backward:
        loss.backward()
        model.zero_grad(set_to_none=True)
    return out.per_token.detach().float()


def nearby(model: uf.DiffusionLM, scale: float) -> dict[str, torch.Tensor]:
    """Perturb every weight in place by ``1 + scale · ε`` (fixed seed); returns the original weights."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + scale * torch.randn(p.shape, generator=g).to(p.device))
    return saved


def seconds(model: uf.DiffusionLM, x0: torch.Tensor, mask: torch.Tensor, mode: str, num_samples: int,
            repeats: int) -> float:
    """Median wall time of a forward + backward in ``mode`` (after one warm-up)."""
    estimate(model, x0, mask, mode, num_samples, backward=True)
    times = []
    for _ in range(repeats):
        if x0.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        estimate(model, x0, mask, mode, num_samples, backward=True)
        if x0.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt", type=int, default=5)
    p.add_argument("--completion", type=int, default=24)
    p.add_argument("--num-samples", type=int, default=4)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--perturbation", type=float, default=1e-5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    hf, tokenizer = load_causal_lm("smollm2")[:2]
    hf = hf.to(device).eval()
    x0, mask = rows(hf, tokenizer, a.rows, a.prompt, a.completion, device)
    model = uf.adapt_ar_model(hf, block_size=a.block_size).to(device).train()
    reference = estimate(model, x0, mask, "float32", a.num_samples)
    base = {mode: estimate(model, x0, mask, mode, a.num_samples) for mode in MODES}
    saved = nearby(model, a.perturbation)
    moved = {mode: estimate(model, x0, mask, mode, a.num_samples) for mode in MODES}
    model.load_state_dict(saved)
    times = {mode: seconds(model, x0, mask, mode, a.num_samples, a.repeats) for mode in MODES}
    print(f"# {uf.precision.describe_device(device)}; torch {torch.__version__}; SmolLM2-135M, K = {a.block_size}; "
          f"{a.rows} rows × {a.completion} completion tokens; elbo, num_samples = {a.num_samples}; "
          f"nearby = weights × (1 + {a.perturbation:g} ε)")
    print(f"{'mode':<24} {'|mode − fp32| mean':>18} {'max':>7} {'Δ nearby':>9} {'time':>8} {'× fp32':>7}")
    result: dict[str, Any] = {"device": uf.precision.describe_device(device), "torch": torch.__version__,
                              "args": vars(a), "modes": {}}
    for mode in MODES:
        d = (base[mode] - reference).abs()[mask]
        near = (moved[mode] - base[mode]).abs()[mask].mean().item()
        result["modes"][mode] = {"abs_diff_mean": d.mean().item(), "abs_diff_max": d.max().item(),
                                 "nearby_change_mean": near, "seconds": times[mode],
                                 "time_ratio": times[mode] / times["float32"]}
        print(f"{mode:<24} {d.mean().item():18.4f} {d.max().item():7.4f} {near:9.4f} {times[mode]:7.2f}s "
              f"{times[mode] / times['float32']:7.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
