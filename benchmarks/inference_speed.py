"""The paper's inference-speed table (App. C.6, Table "Single-sequence sampling speed") on this machine (not a test).

Diffusion: ``BayesianSampler`` with the uniform kernel on the adapted model (bidirectional ``DiffusionLM``), batch 1,
``seq_len`` tokens in N steps (N model calls on the full sequence). AR: Hugging Face ``generate`` of the same base
model with its KV cache, greedy, exactly ``seq_len`` new tokens after BOS. Each row is the median of ``--repeats``
timed runs after one warm-up, excluding loading and tokenisation; "vs AR" = AR time / diffusion time.

    python benchmarks/inference_speed.py                        # SmolLM2-135M, 512 tokens, 16..256 steps (slow on CPU)
    python benchmarks/inference_speed.py --quick                # 128 tokens, 16/32/64 steps
    python benchmarks/inference_speed.py --seq-len 256 --steps 16 64 --dtype bf16
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _memory  # noqa: E402

import unifusion as uf  # noqa: E402
from unifusion.samplers import BayesianSampler  # noqa: E402


def load(name: str, dtype: torch.dtype) -> torch.nn.Module:
    if name == "smollm2":
        from unifusion.hf import load_smollm2

        return load_smollm2(dtype=dtype)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50257, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                      bos_token_id=50256, eos_token_id=50256)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="128 tokens, 16/32/64 steps")
    parser.add_argument("--short-warmup", action="store_true",
                        help="warm the sampler up once with a 2-step run instead of a full run before every row "
                             "(for long CPU runs: the warm-up only compiles and touches memory)")
    args = parser.parse_args()
    if args.quick:
        args.seq_len, args.steps = 128, [16, 32, 64]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    L = args.seq_len

    base = load(args.model, dtype)
    V = base.get_input_embeddings().weight.shape[0]
    model = uf.adapt_ar_model(base, mask_token_id=V - 1)  # the uniform kernel never uses the mask id
    kernel = uf.UniformKernel(V)
    bos = torch.tensor([[model.bos_token_id]])
    pad = base.generation_config.pad_token_id
    pad = pad if pad is not None else base.config.eos_token_id

    def ar() -> torch.Tensor:
        return base.generate(bos, attention_mask=torch.ones_like(bos), max_new_tokens=L, min_new_tokens=L,
                             do_sample=False, use_cache=True, pad_token_id=pad)

    rows: list[tuple[str, str, float]] = []
    with torch.inference_mode(), uf.validation.validation(False):
        out = ar()
        assert out.shape[1] == L + 1, f"generate produced {out.shape[1] - 1} tokens, expected {L}"
        rows.append((f"{args.model} (AR, KV cache)", "--", _memory.time_calls(ar, args.repeats)))
        if args.short_warmup:
            BayesianSampler(model, kernel, 2).sample(1, L, generator=torch.Generator().manual_seed(0))
        for N in args.steps:
            sampler = BayesianSampler(model, kernel, N)
            g = torch.Generator().manual_seed(0)
            rows.append((f"{args.model} (diffusion)", str(N),
                         _memory.time_calls(lambda s=sampler, g=g: s.sample(1, L, generator=g), args.repeats,
                                            warmup=0 if args.short_warmup else 1)))

    ar_time = rows[0][2]
    warm = " (diffusion: one 2-step warm-up)" if args.short_warmup else ""
    print(f"\n{args.model}, {args.dtype}, batch 1, {L} tokens, threads={torch.get_num_threads()}, "
          f"median of {args.repeats} after a warm-up{warm}")
    print(f"{'Model':<26}{'Steps':>6}{'Time (ms)':>12}{'Tokens/s':>10}{'vs AR':>8}")
    for name, steps, t in rows:
        print(f"{name:<26}{steps:>6}{1e3 * t:12.1f}{L / t:10.1f}{ar_time / t:7.2f}x")


if __name__ == "__main__":
    main()
