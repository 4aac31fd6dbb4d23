"""``uf.eval.nll_bound`` through the fast x0-head loss against the 0.1 path (the reference GIDD loss), same run.

    python benchmarks/nll_bound.py [--model smollm2|tiny] [--num-times 32] [--batch 2] [--seq-len 16] [--reps 2]

The evaluation guide's example: the bound of two 16-token sequences under SmolLM2-135M (V = 49,152) adapted with
the uniform kernel. Baseline: the same ``nll_bound`` call with its D_t computed by
``unifusion.losses.reference_gidd_loss`` (what 0.1 did), swapped in for this measurement only. Both runs use the same
generator seed, so they see the same times and corruptions; the script prints their largest relative difference
(float32 rounding) and the speed-up (target ≥ 8×). Best of ``--reps`` interleaved runs, 2 threads, validation off,
eager backend for both (the default ``"auto"`` would compile in the background mid-measurement).
"""

from __future__ import annotations

import argparse
import time

import torch

import unifusion as uf
from unifusion.eval import likelihood


def _model(name: str) -> uf.DiffusionLM:
    if name == "smollm2":
        return uf.adapt_ar_model(uf.models.load_smollm2(), add_mask_token=False).eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49_152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    return uf.adapt_ar_model(LlamaForCausalLM(config), add_mask_token=False).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                        help="SmolLM2-135M, or a 2-layer random Llama with the same vocabulary (default smollm2)")
    parser.add_argument("--num-times", type=int, default=32, help="K (the guide uses 128; the ratio barely moves)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    uf.set_validation(False)
    uf.set_backend("eager")

    model = _model(args.model)
    kernel = uf.UniformKernel(model.num_states)
    x0 = torch.randint(0, model.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    fast_loss = likelihood.x0_head_loss

    def run(reference: bool) -> tuple[float, torch.Tensor]:
        likelihood.x0_head_loss = uf.losses.reference_gidd_loss if reference else fast_loss  # type: ignore[assignment]
        try:
            start = time.perf_counter()
            bound = uf.eval.nll_bound(model, x0, kernel, num_times=args.num_times,
                                      generator=torch.Generator().manual_seed(1))
            return time.perf_counter() - start, bound
        finally:
            likelihood.x0_head_loss = fast_loss

    run(False)  # warm-up (allocator, first forward)
    best = {"reference (0.1)": float("inf"), "fast (now)": float("inf")}
    bounds = {}
    for _ in range(args.reps):
        for name, reference in (("reference (0.1)", True), ("fast (now)", False)):
            seconds, bounds[name] = run(reference)
            best[name] = min(best[name], seconds)
    diff = ((bounds["fast (now)"] - bounds["reference (0.1)"]).abs() / bounds["reference (0.1)"].abs()).max()
    print(f"nll_bound, {args.model}, V = {model.num_states}, B = {args.batch}, L = {args.seq_len}, "
          f"K = {args.num_times} (best of {args.reps})")
    for name, seconds in best.items():
        print(f"  {name:<16} {seconds:8.2f} s")
    speedup = best["reference (0.1)"] / best["fast (now)"]
    print(f"  speed-up {speedup:.1f}x (target >= 8x: {'met' if speedup >= 8 else 'NOT met'}); "
          f"bounds agree to {float(diff):.1e} relative")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
