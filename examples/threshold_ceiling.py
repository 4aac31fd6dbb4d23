"""How many tokens per forward can a confidence threshold commit on text as uncertain as the AR model's own?

``unifusion demo`` decodes at temperature 1 with Fast-dLLM's threshold (``ConfidenceThreshold(0.9)``): a step commits
every masked position of the block whose drawn token has probability ≥ τ under the model, and at least the most
confident one. How many positions clear τ is a property of the *distribution* the model has learned, not only of how
well it has learned it: a position clears 0.9 only where the text is that predictable without the tokens still masked
before it. This script measures that property for a causal LM's own distribution, by running the threshold decoder
on a **marginal oracle** — a "diffusion model" whose x_θ at every masked position is exactly the AR model's marginal
given what is committed:

    x_θ,j(v) = p_AR(x_j = v | x_<s, the committed positions of the block),

x_<s the prompt and the finished blocks, estimated by Monte Carlo: ``--num-samples`` S continuations of the block are
drawn from the AR model at ``--temperature`` (with its KV cache, after the block's committed prefix), those that
disagree with a committed position further right are rejected (every such position was committed at probability
≥ τ, or as a step's single most confident one, so most draws survive; when fewer than S/4 survive, S are drawn
afresh, up to 8 times, until S/2 survive; a state none survives is estimated without that condition and counted in
``unconditioned``, and the report counts the states estimated from fewer than 16 survivors, ``thin``), and
x_θ,j is the frequency of each token at j among the survivors. Each step then runs unifusion's own
:func:`~unifusion.samplers.policies.mask.mask_step` with ``ConfidenceThreshold(τ)`` on log x_θ: the candidates are
drawn from x_θ and committed exactly as the demo's decoder commits them. Tokens per forward are the new tokens over
the steps, as the demo counts them.

A model that equals the AR model's distribution decodes that many tokens per forward under the threshold, no more:
beyond it a model commits more only by being surer than the AR model, which is lower entropy and, judged by the AR
model, a different GenPPL. (Greedy decoding is another question: a deterministic decode has no such limit, only the
model's capacity to compute it ahead.)

The prompts are the demo's held-out prompts (the last 5 % of the bundled corpus's paragraphs, chunks of
``--prompt-len`` + ``--new-tokens`` tokens, the first ``--prompt-len`` of each). ``OUT/report.json`` holds every
prompt's tokens per forward, its continuation and the per-step statistics.

CPU smoke run (tiny random model)::

    python examples/threshold_ceiling.py --model tiny --num-prompts 1 --new-tokens 8 --num-samples 16 --out /tmp/uf-tc

SmolLM2-135M-Instruct (the demo's AR model), docs/guides/parallel-decoding.md ("What the AR model's own uncertainty
allows")::

    python examples/threshold_ceiling.py --out runs/threshold-ceiling
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_torchrun import tiny_with_smollm2_tokenizer  # noqa: E402

from unifusion.demo import chunk_tokens, corpus_token_streams  # noqa: E402
from unifusion.samplers.policies import ConfidenceThreshold, RowRandomness  # noqa: E402
from unifusion.samplers.policies.mask import mask_step  # noqa: E402

MAX_DRAWS = 8
"""Draws of S continuations per state at most, until S/2 agree with the block's committed positions."""


def demo_prompts(tokenizer: Any, count: int, prompt_len: int, new_tokens: int) -> torch.Tensor:
    """``(count, prompt_len)``: the held-out prompts of ``unifusion demo`` (its corpus's held-out stream in chunks of
    ``prompt_len + new_tokens`` tokens, the first ``prompt_len`` of the first ``count``)."""
    chunks = chunk_tokens(corpus_token_streams(tokenizer)[1], prompt_len + new_tokens)
    if len(chunks) < count:
        raise ValueError(f"count: the held-out stream holds {len(chunks)} prompts of {prompt_len + new_tokens} "
                         f"tokens, got {count}")
    return chunks[:count, :prompt_len]


@torch.no_grad()
def sample_continuations(model: Any, prefix: torch.Tensor, length: int, num_samples: int, temperature: float,
                         generator: torch.Generator) -> torch.Tensor:
    """``(num_samples, length)`` continuations of ``prefix`` ``(1, L)`` drawn from the AR model at ``temperature``
    (the prefix is run once; its KV cache is repeated for the samples)."""
    # the KV cache's name, in the call and in its output: ``cache`` from transformers 5.24 on (``past_key_values``
    # deprecated), ``past_key_values`` before
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(prefix, use_cache=True)
    cache = getattr(out, cache_kwarg)
    cache.batch_repeat_interleave(num_samples)
    logits = out.logits[:, -1].float().expand(num_samples, -1)
    tokens = []
    for i in range(length):
        x = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
        tokens.append(x)
        if i + 1 < length:
            out = model(x, use_cache=True, **{cache_kwarg: cache})
            cache, logits = getattr(out, cache_kwarg), out.logits[:, -1].float()
    return torch.cat(tokens, 1)


def agreeing(samples: torch.Tensor, start: int, block: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
    """The rows of ``samples`` ``(S, K - start)`` (continuations from block position ``start``) that carry the block's
    committed tokens (``block`` ``(K,)``, ``committed`` ``(K,)`` bool) at every committed position from ``start``."""
    check = committed[start:]
    return samples[(samples[:, check] == block[start:][check]).all(1)]


def marginal_log_probs(samples: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``(K', V)`` log frequencies of each token at each column of ``samples`` ``(S, K')`` (−inf where unseen)."""
    counts = torch.zeros(samples.shape[1], vocab_size, dtype=torch.float64)
    counts.scatter_add_(1, samples.T.contiguous(), torch.ones(samples.T.shape, dtype=torch.float64))
    return (counts / samples.shape[0]).log()


@dataclass
class Decode:
    """One prompt decoded on the marginal oracle: the new tokens, the steps (forwards) it took, the per-step
    statistics (block, surviving samples, positions committed) and the states estimated unconditioned."""

    tokens: list[int]
    forwards: int
    steps: list[dict[str, int]] = field(default_factory=list)
    unconditioned: int = 0


def threshold_decode(model: Any, prompt: torch.Tensor, *, block_size: int, new_tokens: int, threshold: float,
                     num_samples: int, temperature: float, vocab_size: int, generator: torch.Generator) -> Decode:
    """``ConfidenceThreshold(threshold)`` run block by block on the marginal oracle of the AR ``model`` (module
    docstring): ``prompt`` ``(1, P)``, ``new_tokens`` a multiple of ``block_size``."""
    if new_tokens % block_size:
        raise ValueError(f"new_tokens: expected a multiple of block_size {block_size}, got {new_tokens}")
    policy, K = ConfidenceThreshold(threshold), block_size
    randomness = RowRandomness(generator, None, 1)
    sequence = prompt
    result = Decode([], 0)
    for b in range(new_tokens // K):
        block = torch.zeros(K, dtype=torch.long)
        committed = torch.zeros(K, dtype=torch.bool)
        pool, pool_start = None, 0
        while not bool(committed.all()):
            start = int(committed.long().cumprod(0).sum())  # the committed prefix of the block
            survivors = None if pool is None else agreeing(pool, pool_start, block, committed)[:, start - pool_start:]
            if survivors is None or len(survivors) < num_samples // 4:
                prefix = torch.cat([sequence, block[:start].view(1, -1)], 1)
                draws: list[torch.Tensor] = []
                kept: list[torch.Tensor] = []  # each draw's rows that agree with the committed positions
                while sum(len(k) for k in kept) < num_samples // 2 and len(draws) < MAX_DRAWS:
                    draws.append(sample_continuations(model, prefix, K - start, num_samples, temperature, generator))
                    kept.append(agreeing(draws[-1], start, block, committed))
                pool, pool_start = torch.cat(draws), start
                survivors = torch.cat(kept)
                if len(survivors) == 0:  # the committed positions are this unlikely together: drop the condition
                    survivors = pool
                    result.unconditioned += 1
            undecided = ~committed[start:]
            log_x0 = marginal_log_probs(survivors, vocab_size).float()
            tokens, commit = mask_step(policy, log_x0[None], undecided[None], torch.ones(1, dtype=torch.long),
                                       randomness, mask_id=None, temperature=1.0, do_sample=True)
            block[start:] = torch.where(commit[0], tokens[0], block[start:])
            committed[start:] |= commit[0]
            result.forwards += 1
            result.steps.append({"block": b, "survivors": len(survivors), "committed": int(commit.sum())})
        sequence = torch.cat([sequence, block.view(1, -1)], 1)
        result.tokens += block.tolist()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' (SmolLM2-135M-Instruct, offline) or 'tiny' (smoke)")
    p.add_argument("--num-prompts", type=int, default=8, help="the demo's held-out prompts (its --num-samples)")
    p.add_argument("--prompt-len", type=int, default=16, help="the demo's --prompt-len")
    p.add_argument("--new-tokens", type=int, default=48, help="the demo's --new-tokens")
    p.add_argument("--block-size", type=int, default=8, help="the demo's --block-size")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.9], help="ConfidenceThreshold τ values")
    p.add_argument("--temperature", type=float, default=1.0, help="the AR model's sampling temperature (> 0)")
    p.add_argument("--num-samples", type=int, default=128, help="continuations per estimate (S)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/threshold-ceiling")
    args = p.parse_args(argv)
    for name in ("num_prompts", "prompt_len", "new_tokens", "block_size", "num_samples"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected a positive count, got {getattr(args, name)}")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ValueError(f"--temperature: expected a positive temperature, got {args.temperature}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.model == "tiny":
        model, tokenizer = tiny_with_smollm2_tokenizer(args.seed, args.prompt_len + args.new_tokens)
    elif args.model == "smollm2":
        from unifusion.hf import load_smollm2, load_smollm2_tokenizer
        model, tokenizer = load_smollm2(), load_smollm2_tokenizer()
    else:
        raise ValueError(f"--model: expected 'smollm2' or 'tiny', got {args.model!r}")
    model.eval()
    prompts = demo_prompts(tokenizer, args.num_prompts, args.prompt_len, args.new_tokens)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    report: dict[str, Any] = {"args": vars(args), "torch": torch.__version__, "machine": platform.processor(),
                              "thresholds": {}}
    for tau in args.thresholds:
        rows, start = [], time.perf_counter()
        for i in range(len(prompts)):
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + i)
            d = threshold_decode(model, prompts[i:i + 1], block_size=args.block_size, new_tokens=args.new_tokens,
                                 threshold=tau, num_samples=args.num_samples, temperature=args.temperature,
                                 vocab_size=vocab_size, generator=g)
            rows.append({"prompt": i, "forwards": d.forwards, "tokens_per_forward": args.new_tokens / d.forwards,
                         "unconditioned": d.unconditioned, "thin": sum(s["survivors"] < 16 for s in d.steps),
                         "text": tokenizer.decode(d.tokens), "steps": d.steps})
            print(f"τ {tau:g} | prompt {i}: {args.new_tokens / d.forwards:.2f} tokens/forward ({d.forwards} forwards, "
                  f"{time.perf_counter() - start:.0f} s)", flush=True)
        forwards = sum(r["forwards"] for r in rows)
        per_prompt = [r["tokens_per_forward"] for r in rows]
        report["thresholds"][f"{tau:g}"] = {
            "tokens_per_forward": args.new_tokens * len(rows) / forwards,
            "min": min(per_prompt), "max": max(per_prompt),
            "unconditioned": sum(r["unconditioned"] for r in rows), "thin": sum(r["thin"] for r in rows),
            "steps": forwards,
            "seconds": time.perf_counter() - start, "prompts": rows}
        print(f"τ {tau:g}: {args.new_tokens * len(rows) / forwards:.3f} tokens per forward over {len(rows)} prompts "
              f"(per prompt {min(per_prompt):.2f}–{max(per_prompt):.2f})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
