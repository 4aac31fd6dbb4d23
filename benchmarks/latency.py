"""Decode latency (batch 1, the setting dParallel and d3LLM report speed at) and batch throughput of a block model
against the AR model's own ``generate`` with its KV cache, and where a block decode's time goes (not a test).

The task of ``examples/distill_parallel.py``: ``sort`` prompts (``sort(3,1,4,1,5)=``, left-padded to a multiple of
K), answers of ``--answer-tokens`` tokens (10: nine characters and EOS). For each batch size of ``--batches``, in
interleaved rounds (each round runs every variant once on the same prompts, so load that drifts during the run hits
all of them alike), the median over ``--rounds`` of:

* ``AR``: SmolLM2-135M's HF ``generate`` (greedy, KV cache, exactly ``--answer-tokens`` new tokens) — the
  reference every ratio divides by, measured in the same run; ``AR, packed once``: the same inside one
  :func:`unifusion.cpu_linears.packed_linears` block opened before the rounds;
* ``block s/blk``: the model adapted to blocks of K (``adapt_ar_model(..., block_size=K)``; untrained: the times are
  what matter, and a decode's cost depends only on its forwards and their positions) decoding the same
  ``--answer-tokens`` tokens greedily with ``LowConfidence`` at s steps per block (``--steps``: tokens per forward
  ≈ K/s) through the exact cache with merged commits (``generate(..., use_cache=True, merge_commits=True)``), as
  the example decodes; the variants of the CPU packing: ``default`` (``generate`` as shipped: a layer packs only
  after :data:`~unifusion.cpu_linears.GENERATE_PACK_AFTER_ROWS` rows in the call), ``packed once`` (one
  ``packed_linears`` block around the round's packed-once calls, its reorder not timed), ``packed per call``
  (packed at each call's entry, the reorder timed: what ``generate`` did before ``pack_after_rows``) and ``unpacked``
  (``packed_linears=False``); ``learned commit``: ``LearnedCommit(CommitHead, 0.5)`` (untrained head) at K steps per
  block, packed once — the policy reads hidden states and runs its head at every step.

Printed per row: the wall time of one call (``--clock process``: this process's CPU seconds, which on a shared
machine with one thread leaves out time spent waiting for a core), model calls per decode, positions per call
(backbone input columns per row: the first call carries the prompt, ``P + K + 1``; a step ``K + 1``, a step that
also commits the previous block ``2K + 1``), backbone ms per call, the rest of the call (output head, policy,
cache bookkeeping, python: the call minus its backbone time) and the ratio to ``AR`` at the same batch size. Also the
first call of each model in the process (allocations; not in the medians) and the reorder of ``packed_linears`` at
entry. The machine's load average is printed before and after.

    OMP_NUM_THREADS=1 python benchmarks/latency.py                    # SmolLM2-135M, K = 8, batches 1 and 32
    OMP_NUM_THREADS=1 python benchmarks/latency.py --batches 32 --rounds 2 --packings default "packed once"
    python benchmarks/latency.py --quick                              # tiny random model (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

import unifusion as uf
from unifusion.cpu_linears import packed_linears
from unifusion.data import sorting
from unifusion.distill import CommitHead, LearnedCommit
from unifusion.precision import describe_device
from unifusion.samplers.policies import LowConfidence

CLOCK: Callable[[], float] = time.perf_counter
PACKINGS = ("default", "packed once", "packed per call", "unpacked")


def load(quick: bool) -> tuple[Any, Any, Any]:
    """``(ar_model, block_model_source, tokenizer)``: two copies of the weights (the block model grows the embedding
    by its mask token)."""
    from unifusion.hf import load_smollm2, load_smollm2_tokenizer

    tokenizer = load_smollm2_tokenizer()
    if quick:
        from transformers import LlamaConfig, LlamaForCausalLM

        def tiny() -> Any:
            torch.manual_seed(0)
            config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                 max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            return LlamaForCausalLM(config).eval()

        return tiny(), tiny(), tokenizer
    return load_smollm2(), load_smollm2(), tokenizer


def prompts(tokenizer: Any, n: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` held-out sort prompts, left-padded to a multiple of ``K``: ``(ids, attention_mask)``."""
    rows = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
            for p in sorting.make_problems(n, 0, "test")]
    W = -(-max(map(len, rows)) // K) * K
    pad = tokenizer.eos_token_id
    return (torch.tensor([[pad] * (W - len(r)) + r for r in rows]),
            torch.tensor([[0] * (W - len(r)) + [1] * len(r) for r in rows]))


class BackboneClock:
    """Forward hooks on a backbone: each call's duration and input shape ``(B, T)``."""

    def __init__(self, *backbones: torch.nn.Module) -> None:
        self.calls: list[list[Any]] = []
        for b in backbones:
            b.register_forward_pre_hook(self._pre, with_kwargs=True)
            b.register_forward_hook(self._post, with_kwargs=True)

    def _pre(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        x = kwargs.get("input_ids", args[0] if args else None)
        x = kwargs.get("inputs_embeds") if x is None else x
        self.calls.append([CLOCK(), tuple(x.shape[:2])])

    def _post(self, module: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        self.calls[-1][0] = CLOCK() - self.calls[-1][0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--answer-tokens", type=int, default=10)
    p.add_argument("--steps", type=int, nargs="+", default=[8, 3, 2, 1], help="LowConfidence steps per block")
    p.add_argument("--packings", nargs="+", default=list(PACKINGS), choices=list(PACKINGS),
                   help="the block model's packing variants")
    p.add_argument("--no-learned", action="store_true", help="leave out the learned commit rule's row")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clock", choices=["wall", "process"], default="wall")
    p.add_argument("--quick", action="store_true", help="a tiny random model, 2 rounds")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "process" else time.perf_counter
    if args.quick:
        args.rounds = 2
    torch.set_grad_enabled(False)
    K, A = args.block_size, args.answer_tokens
    print(f"{describe_device('cpu')}, {torch.get_num_threads()} thread(s), float32, clock {args.clock}, "
          f"load average {os.getloadavg()}", flush=True)
    ar, source, tokenizer = load(args.quick)
    block = uf.adapt_ar_model(source, add_mask_token=True, block_size=K, tokenizer=tokenizer).eval()
    clock = BackboneClock(ar.model, block.hf_model.model)
    eos = tokenizer.eos_token_id
    head = CommitHead(block.hf_model.config.hidden_size)

    def ar_call(ids: torch.Tensor, mask: torch.Tensor) -> Any:
        return ar.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=A, min_new_tokens=A,
                           pad_token_id=eos, use_cache=True)

    def block_call(policy: Any, steps: int, **kw: Any) -> Callable[[torch.Tensor, torch.Tensor], Any]:
        def call(ids: torch.Tensor, mask: torch.Tensor) -> Any:
            return block.generate(ids, attention_mask=mask, max_new_tokens=A, policy=policy, num_steps=steps,
                                  use_cache=True, merge_commits=True, do_sample=False, eos_token_id=None,
                                  return_dict=True, **kw)
        return call

    def per_call_packed(steps: int) -> Callable[[torch.Tensor, torch.Tensor], Any]:
        inner = block_call(LowConfidence(), steps)

        def call(ids: torch.Tensor, mask: torch.Tensor) -> Any:
            with packed_linears(block, batch_hint=K):
                return inner(ids, mask)
        return call

    # (name, call, the model packed once around the round's calls (None: not), a block model?)
    variants: list[tuple[str, Callable[..., Any], Any, bool]] = [("AR", ar_call, None, False),
                                                                 ("AR, packed once", ar_call, ar, False)]
    for s in args.steps:
        options = {"default": (block_call(LowConfidence(), s), None),
                   "packed once": (block_call(LowConfidence(), s), block),
                   "packed per call": (per_call_packed(s), None),
                   "unpacked": (block_call(LowConfidence(), s, packed_linears=False), None)}
        variants += [(f"block {s}/blk, {k}", *options[k], True) for k in args.packings]
    if not args.no_learned:
        variants.append((f"learned commit 0.5, {K}/blk, packed once", block_call(LearnedCommit(head, 0.5), K),
                         block, True))
    rows: list[dict[str, Any]] = []
    for B in args.batches:
        ids, mask = prompts(tokenizer, B, K)
        first = {}
        for name, call in (("AR", ar_call), ("block", block_call(LowConfidence(), K))):
            t0 = CLOCK()
            call(ids, mask)
            first[name] = CLOCK() - t0
        reorder: dict[str, list[float]] = {"AR": [], "block": []}
        samples: dict[str, list[tuple[float, list[Any], Any]]] = {v[0]: [] for v in variants}
        for r in range(args.rounds + 1):  # round 0 warms every variant up
            for once in (False, True):  # the packed-once variants inside blocks opened (untimed) for this round
                with ExitStack() as stack:
                    if once:
                        for model, name in ((ar, "AR"), (block, "block")):
                            t0 = CLOCK()
                            stack.enter_context(packed_linears(model, batch_hint=K if model is block else 16))
                            reorder[name].append(CLOCK() - t0)
                    for name, call, packed, _ in variants:
                        if (packed is not None) != once:
                            continue
                        clock.calls.clear()
                        t0 = CLOCK()
                        out = call(ids, mask)
                        dt = CLOCK() - t0
                        if r:
                            samples[name].append((dt, list(clock.calls), out))
        print(f"batch {B}: first call AR {first['AR']:.2f} s, block {first['block']:.2f} s; packed_linears "
              f"reorder at entry (median) AR {statistics.median(reorder['AR']):.2f} s, block "
              f"{statistics.median(reorder['block']):.2f} s", flush=True)
        ar_s = statistics.median(x[0] for x in samples["AR"])
        for name, _, _, is_block in variants:
            xs = samples[name]
            wall = statistics.median(x[0] for x in xs)
            calls = xs[0][1]
            backbone = statistics.median(sum(c[0] for c in x[1]) for x in xs)
            positions = [c[1][1] for c in calls]
            tpf = float(xs[0][2].tokens_per_forward.mean()) if is_block else 1.0
            rows.append({"batch": B, "variant": name, "seconds": wall, "calls": len(calls), "positions": positions,
                         "backbone_ms_per_call": 1e3 * backbone / len(calls),
                         "other_ms": 1e3 * (wall - backbone), "tokens_per_forward": tpf, "x_ar": wall / ar_s,
                         "first_call_s": first,
                         "reorder_s": {k: statistics.median(v) for k, v in reorder.items()}})
    print(f"load average after: {os.getloadavg()}", flush=True)
    print(f"\n{A} new tokens per row, K = {K}; medians of {args.rounds} interleaved rounds; {args.clock} clock\n")
    print("| batch | variant | s / decode | × AR | tokens / forward | calls | positions per call | "
          "backbone ms / call | rest of the call, ms |")
    print("|---:|---|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        pos = ",".join(map(str, r["positions"][:4])) + (",…" if len(r["positions"]) > 4 else "")
        print(f"| {r['batch']} | {r['variant']} | {r['seconds']:.3f} | {r['x_ar']:.2f} | "
              f"{r['tokens_per_forward']:.2f} | {r['calls']} | {pos} | {r['backbone_ms_per_call']:.1f} | "
              f"{r['other_ms']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "clock": args.clock, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
