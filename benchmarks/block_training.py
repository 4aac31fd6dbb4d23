"""Cost of a block-diffusion training step against a plain one (not a test).

One training step (``diffusion_loss`` forward + backward, mask kernel, bf16 autocast by default) of SmolLM2-135M
(``unifusion.hf.load_smollm2``) adapted twice: ``block_size=None`` (the baseline: one bidirectional forward over
L + 1 positions) and ``block_size=K`` (one forward over the ``[clean | noisy]`` stream of ``2L − K + L/K`` positions,
:mod:`unifusion.hf.ar.blocks`). Each variant runs in a fresh process (``--child``) so its peak memory is its own: peak
RSS increase over the loaded model and inputs on the CPU, ``torch.cuda.max_memory_allocated`` on CUDA. The table
prints the time (median of ``--steps`` steps after one warm-up) and the peak memory with their ratios to the
baseline, all measured in this run.

    python benchmarks/block_training.py [--seq-len 512] [--block-size 32] [--batch-size 4] [--steps 3]
                                        [--device cpu|cuda] [--attn sdpa|eager|flex_attention] [--no-autocast]
                                        [--fused] [--random]

``--random`` uses a SmolLM2-shaped model with random weights (no download, no cache needed; the same cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

_MARK = "BLOCK_TRAINING_JSON "


def _load(args: argparse.Namespace) -> torch.nn.Module:
    if args.random:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        hf = LlamaForCausalLM(cfg)
    else:
        from unifusion.hf import load_smollm2

        hf = load_smollm2(torch.float32)
    hf.set_attn_implementation(args.attn)
    return hf.to(args.device).train()


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child(args: argparse.Namespace) -> None:
    import unifusion as uf

    block_size = None if args.child == "none" else int(args.child)
    device = torch.device(args.device)
    model = uf.adapt_ar_model(_load(args), block_size=block_size)
    kernel = uf.MaskKernel(model.num_states, model.mask_token_id)
    g = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randint(0, 49152, (args.batch_size, args.seq_len), generator=g, device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.no_autocast):
            out = uf.diffusion_loss(model, x0, kernel, generator=g, fused=args.fused)
        out.mean().backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up (allocator, kernels, flex compilation)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _peak_rss()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else _peak_rss()) - base
    print(_MARK + json.dumps({"time": statistics.median(times), "peak": peak}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flex_attention"])
    parser.add_argument("--no-autocast", action="store_true", help="float32 instead of bf16 autocast")
    parser.add_argument("--fused", action="store_true", help="the fused linear loss (no (B, L, V) logits)")
    parser.add_argument("--random", action="store_true", help="random SmolLM2-shaped weights (no model cache)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args)
        return
    passthrough = [a for a in sys.argv[1:] if a != "--child"]
    results = {}
    for variant in ("none", str(args.block_size)):
        out = subprocess.run([sys.executable, __file__, "--child", variant, *passthrough], capture_output=True,
                             text=True)
        line = next((s for s in out.stdout.splitlines() if s.startswith(_MARK)), None)
        if out.returncode != 0 or line is None:
            sys.exit(f"variant block_size={variant} failed ({out.returncode}):\n{out.stdout[-2000:]}\n"
                     f"{out.stderr[-4000:]}")
        results[variant] = json.loads(line[len(_MARK):])
    L, K = args.seq_len, args.block_size
    nb = -(-L // K)
    print(f"# SmolLM2-135M{' (random weights)' if args.random else ''}, B={args.batch_size}, L={L}, "
          f"{'fp32' if args.no_autocast else 'bf16 autocast'}, {args.attn}, {args.device}"
          f"{', fused loss' if args.fused else ''}; block model runs {(nb - 1) * K + L + nb} positions vs {L + 1}")
    base = results["none"]
    print(f"{'block_size':12s} {'step s':>8s} {'x':>6s} {'peak MiB':>9s} {'x':>6s}")
    for variant, r in results.items():
        print(f"{variant:12s} {r['time']:8.3f} {r['time'] / base['time']:6.2f} {r['peak'] / 2**20:9.1f} "
              f"{r['peak'] / max(base['peak'], 1):6.2f}")


if __name__ == "__main__":
    main()
