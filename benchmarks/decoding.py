"""Decoding speed: block decoding with a KV cache against AR generation and the full-sequence sampler (not a test).

For each number of new tokens N (after a P-token prompt, batch 1), in one run:

* ``AR + cache``: the wrapped Hugging Face model's own ``generate`` (greedy, its KV cache, exactly N tokens);
* ``full-seq Bayesian``: ``DiffusionLM.generate(policy=None, num_steps=N/4)`` — today's sampler, 4 tokens per forward,
  every forward over all P + N + 1 positions;
* ``block K + cache, r/fwd``: a block model (``adapt_ar_model(..., block_size=K)``) decoded with ``LowConfidence`` at
  K/r steps per block (r tokens per forward) through the exact cache (``use_cache=True``): the prompt prefilled once,
  each step runs the block's K + 1 positions, one more forward appends each finished block. ``generate``'s default
  path: on the CPU its linears run through oneDNN with weights packed within each call, once a layer has multiplied
  ``GENERATE_PACK_AFTER_ROWS`` rows (:mod:`unifusion.cpu_linears`; the packing counted in each row); the row
  ``..., packed`` / ``..., unpacked`` is the same decoder with the other choice of ``packed_linears``;
* ``block K + cache, thr τ``: the same with ``ConfidenceThreshold(τ)`` (adaptive: tokens per forward measured);
* ``block K + cache, merged commits, 4/fwd``: ``BlockCacheDecoder(model, merge_commits=True)`` — each finished block
  enters the cache within the next block's first step (no forward of its own; the same tokens);
* ``dual cache, 4/fwd`` (``--approx``): the fully bidirectional model with Fast-dLLM's approximate cache
  (``cache_refresh=K/4``: a full forward at each block's first step), and its token agreement with uncached decoding.

Printed: wall time (best of ``--repeats``), forwards (every backbone call: denoising steps, the prompt's prefill and
commit passes), tokens per forward, the ratio to AR, and the ratio to the full-sequence sampler at the same number of
forwards (its measured time per forward × the row's forwards). The adapted model is untrained (weights of SmolLM2):
the times are what matter.
Run it on a quiet machine; ``--quick`` runs a tiny random model in seconds (a smoke test of the script).

    python benchmarks/decoding.py                      # SmolLM2-135M, N = 128 and 512, P = 32, K = 32
    python benchmarks/decoding.py --new-tokens 128 --approx
    python benchmarks/decoding.py --quick
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

import unifusion as uf
from unifusion.hf import adapt_ar_model
from unifusion.hf.ar.decoding import BlockCacheDecoder
from unifusion.precision import DTYPE_CHOICES, describe_device, resolve_dtype
from unifusion.samplers import PolicySampler
from unifusion.samplers.policies import ConfidenceThreshold, LowConfidence


def _tiny() -> tuple[Any, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), 1


def _smollm2(dtype: torch.dtype) -> tuple[Any, int]:
    from unifusion.hf import load_smollm2

    hf = load_smollm2(dtype=dtype)
    return hf.eval(), int(hf.config.bos_token_id)


CLOCK: Callable[[], float] = time.perf_counter
"""What the rows time: the wall clock, or with ``--clock process`` this process's CPU seconds (``time.process_time``;
on a machine shared with other work, with one thread, it leaves out the time spent waiting for a core)."""


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Best time of ``repeats`` calls (:data:`CLOCK`; CUDA synchronised before and after each) and the last output."""
    best, out = float("inf"), None
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = CLOCK()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, CLOCK() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--rates", type=int, nargs="+", default=[2, 4, 8], help="tokens per forward (fixed count)")
    parser.add_argument("--thresholds", type=float, nargs="*", default=[0.7, 0.9])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="auto: bf16 where the device computes it natively, float32 elsewhere (default: auto)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--approx", action="store_true",
                        help="also the approximate dual cache of a bidirectional model")
    parser.add_argument("--quick", action="store_true", help="a tiny random model, N = 32, P = 8, K = 8, one repeat")
    parser.add_argument("--clock", choices=["wall", "process"], default="wall",
                        help="process: time each row in this process's CPU seconds (a loaded machine; run it with "
                             "OMP_NUM_THREADS=1)")
    parser.add_argument("--no-full", action="store_true", help="leave out the full-sequence sampler's row")
    parser.add_argument("--step-costs", action="store_true",
                        help="instead: the median time of one AR step and of one cached block step (K + 1 positions, "
                             "the head on all K or on K/2) for K = 4, 8, 16, 32, against a 48-token prefix")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "process" else time.perf_counter
    if args.quick:
        args.new_tokens, args.prompt_len, args.block_size, args.repeats = [32], 8, 8, 1
        args.rates = [r for r in args.rates if r <= 8]
    torch.set_grad_enabled(False)
    dtype = resolve_dtype(args.dtype, args.device)
    print(f"device {describe_device(args.device)}: --dtype {args.dtype} → {dtype}", flush=True)
    hf, _ = _tiny() if args.quick else _smollm2(dtype)
    hf = hf.to(args.device)
    K, P = args.block_size, args.prompt_len
    if args.step_costs:
        _step_costs(hf, args.device)
        return
    plain = adapt_ar_model(hf)  # adds the mask token (the embeddings grow by one row, in place)
    block = adapt_ar_model(hf, mask_token_id=plain.mask_token_id, block_size=K)  # the same weights and mask token
    prompt = torch.randint(10, int(hf.config.vocab_size), (1, P), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(args.device)
    rows: list[Row] = []
    for N in args.new_tokens:
        rows += _measure(N, args, hf, plain, block, prompt)
    _print(rows)


def _median_ms(fn: Callable[[], Any], n: int = 9) -> float:
    fn()
    times = sorted(_best(fn, 1)[0] for _ in range(n))
    return 1e3 * times[n // 2]


def _step_costs(hf: Any, device: str) -> None:
    """One AR step (one token against the cache) and one block step (K + 1 positions against the cache)."""
    from transformers import DynamicCache

    n = 48
    prefix = torch.randint(10, int(hf.config.vocab_size), (1, n), generator=torch.Generator().manual_seed(0))
    prefix, token = prefix.to(device), prefix[:, -1:].to(device)
    cache = DynamicCache()
    hf(input_ids=prefix, cache=cache, use_cache=True)

    def ar_step() -> None:
        hf(input_ids=token, cache=cache, use_cache=True)
        cache.crop(-1)

    ar = _median_ms(ar_step)
    print(f"AR step (1 position, head on 1): {ar:.1f} ms")
    mask_id = adapt_ar_model(hf).mask_token_id
    assert mask_id is not None
    for K in (4, 8, 16, 32):
        full_head, half_head = _block_step_ms(hf, prefix, mask_id, K)
        print(f"block step K = {K:2d} ({K + 1} positions): head on all {full_head:.1f} ms ({full_head / ar:.2f}x AR), "
              f"on {K // 2} {half_head:.1f} ms ({half_head / ar:.2f}x)")


def _block_step_ms(hf: Any, prefix: torch.Tensor, mask_id: int, K: int) -> tuple[float, float]:
    """Median ms of one cached block step of K + 1 positions, the head on all K and on the first K/2."""
    dev = prefix.device
    decoder = BlockCacheDecoder(adapt_ar_model(hf, mask_token_id=mask_id, block_size=K))
    state = decoder.start_blocks(prefix, torch.ones_like(prefix, dtype=torch.bool))
    block = torch.full((1, K), mask_id, device=dev)
    t, rows, half = torch.ones(1, device=dev), torch.arange(1, device=dev), torch.arange(K // 2, device=dev)[None]
    return (_median_ms(lambda: decoder.denoise_block(state, block, t, rows, None)),
            _median_ms(lambda: decoder.denoise_block(state, block, t, rows, None, positions=half)))


Row = tuple[int, str, float, str, float, "float | None"]


def _measure(N: int, args: Any, hf: Any, plain: Any, block: Any, prompt: torch.Tensor) -> list[Row]:
    """The table's rows for N new tokens."""
    K, P = args.block_size, args.prompt_len
    rows: list[Row] = []
    def ar() -> Any:
        return hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=N, min_new_tokens=N,
                           do_sample=False, use_cache=True, pad_token_id=0)

    t_ar, _ = _best(ar, args.repeats)
    rows.append((N, "AR + cache (HF generate)", t_ar, str(N), 1.0, None))
    if block.device.type == "cpu" and uf.cpu_linears.packing_available():
        start = CLOCK()
        with uf.cpu_linears.packed_linears(block, batch_hint=K):
            pack = CLOCK() - start
        print(f"N = {N}: packing the block model's linears for oneDNN takes {pack:.3f} s (counted in each "
              "generate row below)", flush=True)
    steps = max(N // 4, 1)
    per_forward: float | None = None
    if not args.no_full:
        t_full, _ = _best(lambda: plain.generate(prompt, max_new_tokens=N, num_steps=steps,
                                                 generator=torch.Generator(prompt.device).manual_seed(0)),
                          args.repeats)
        per_forward = t_full / steps
        rows.append((N, "full-seq Bayesian, 4/fwd", t_full, str(steps), N / steps, t_full))

    def full_at(forwards: int) -> float | None:
        return None if per_forward is None else per_forward * forwards

    model, tag = block, f"block {K} + cache"
    for r in args.rates:
        def fixed(r: int = r, packed: bool | None = None) -> Any:
            return model.generate(prompt, max_new_tokens=N, policy=LowConfidence(), num_steps=max(K // r, 1),
                                  eos_token_id=None, return_dict=True, packed_linears=packed,
                                  generator=torch.Generator(prompt.device).manual_seed(0))

        t, out = _best(fixed, args.repeats)
        f = int(out.num_forwards[0])
        rows.append((N, f"{tag}, {r}/fwd", t, str(f), float(out.tokens_per_forward[0]),
                     full_at(f)))
        if r == 4:  # the other choice of generate's packed_linears than its default for this block size
            other = not (block.device.type == "cpu" and uf.cpu_linears.packing_available())
            t, other_out = _best(lambda other=other: fixed(4, other), args.repeats)
            same = "same tokens" if torch.equal(other_out.sequences, out.sequences) else "OTHER TOKENS"
            rows.append((N, f"{tag}, {r}/fwd, {'packed' if other else 'unpacked'} ({same})", t, str(f),
                         float(out.tokens_per_forward[0]), full_at(f)))
    sampler = PolicySampler(BlockCacheDecoder(block, merge_commits=True), uf.MaskKernel(block.num_states,
                            block.mask_token_id), LowConfidence(), num_steps=max(K // 4, 1), block_size=K)
    full = torch.cat([prompt, torch.full((1, N), -1, device=prompt.device)], 1)
    def merged() -> Any:
        with uf.cpu_linears.packed_linears(block, batch_hint=K):  # what generate does on the CPU, packing counted
            return sampler.sample(1, P + N, prompt=full, return_dict=True,
                                  generator=torch.Generator(prompt.device).manual_seed(0))

    t, out = _best(merged, args.repeats)
    f = int(out.num_forwards[0])
    rows.append((N, f"{tag}, merged commits, 4/fwd", t, str(f), float(out.tokens_per_forward[0]),
                 full_at(f)))
    for tau in args.thresholds:
        def thr(tau: float = tau) -> Any:
            return model.generate(prompt, max_new_tokens=N, policy=ConfidenceThreshold(tau), eos_token_id=None,
                                  return_dict=True,
                                  generator=torch.Generator(prompt.device).manual_seed(0))

        t, out = _best(thr, args.repeats)
        f = int(out.num_forwards[0])
        rows.append((N, f"{tag}, thr {tau}", t, str(f), float(out.tokens_per_forward[0]),
                     full_at(f)))
    if args.approx:
        def approx(refresh: int | None) -> Any:
            return plain.generate(prompt, max_new_tokens=N, policy=LowConfidence(), num_steps=max(K // 4, 1),
                                  block_size=K, eos_token_id=None, return_dict=True, cache_refresh=refresh,
                                  generator=torch.Generator(prompt.device).manual_seed(0))

        t, out = _best(lambda: approx(max(K // 4, 1)), args.repeats)
        exact = approx(None).sequences
        agree = float((out.sequences[:, P:] == exact[:, P:]).float().mean())
        f = int(out.num_forwards[0])
        rows.append((N, f"dual cache (approx), 4/fwd, {agree:.0%} = uncached", t, str(f),
                     float(out.tokens_per_forward[0]), full_at(f)))
    return rows


def _print(rows: list[Row]) -> None:
    ar_time = {N: t for N, name, t, *_ in rows if name.startswith("AR")}
    clock = "cpu s" if CLOCK is time.process_time else "wall s"
    print(f"{'N':>5}  {'decoder':<48} {clock:>8} {'forwards':>12} {'tok/fwd':>8} {'vs AR':>7} {'vs full':>8}")
    for N, name, t, forwards, rate, full in rows:
        vs_full = f"{full / t:7.2f}x" if full is not None and name.startswith(("block", "dual", "no block")) else ""
        print(f"{N:>5}  {name:<48} {t:8.3f} {forwards:>12} {rate:8.2f} {t / ar_time[N]:6.2f}x {vs_full:>8}")
    for N, name, t, *_ in rows:
        if name.endswith("+ cache, 4/fwd"):
            print(f"N = {N}: generate of the block model at 4 tokens per forward (the default path, packing counted) "
                  f"takes {t / ar_time[N]:.2f}x the AR time")
    print("vs AR: time / AR's (lower is faster); vs full: full-sequence time at the same number of forwards / "
          "this row's (higher is faster). Forwards count every backbone call: prefill and commit passes included.")


if __name__ == "__main__":
    main()
