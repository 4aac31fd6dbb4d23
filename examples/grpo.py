"""GRPO on a block-diffusion model in your own loop: rollouts, exact rewards, group advantages, diffusion likelihoods.

The loop, one step (``--prompts-per-step`` P prompts, ``--group-size`` G completions each):

1. **rollouts**: the P prompts, each repeated G times, decoded by the block model's cached decoder
   (``model.generate(..., policy=LowConfidence(), use_cache=True, generator=[one per row])``); a row's generator is
   keyed by (seed, step, global row), so a rollout does not depend on its batch neighbours nor on the process count;
2. **rewards**: :func:`unifusion.data.arithmetic.rewards` (exact: 1 for the right number first) or your function
   ``reward_fn(completions, problems) -> floats`` (checked: one finite number per completion);
3. **advantages**: :func:`unifusion.rl.group_advantages`, ``(r − mean_g r) / (std_g r + 10⁻⁴)`` per prompt;
4. **likelihoods**: :func:`unifusion.rl.sequence_logprob` (``--estimator``; a block model takes the block ELBO
   ``"elbo"``) of the current policy, and under ``torch.no_grad()`` of the old policy (``--inner-updates`` > 1) and
   the reference (``--kl-coef`` > 0), **all with the same generator seed**: the same masks and times, so the ratio
   ``π/π_old`` carries no mask noise. With one inner update the old policy *is* the current one and its estimate
   with that seed is ``logps.detach()`` (the ratio is 1, the gradient GRPO's policy gradient);
5. **objective** (``--objective``): ``grpo`` (:func:`~unifusion.rl.grpo_loss`, clipped ratio + k3 KL),
   ``wd1`` (:func:`~unifusion.rl.wd1_loss`, softmax weights per group, no ratio) or ``spg``
   (:func:`~unifusion.rl.spg_loss`: an ELBO where A > 0, the EUBO where A ≤ 0; a block model has no EUBO estimator,
   so there the ELBO serves both signs, SPG's ω = 0 — the run says so); then one optimizer step.

Layout. Prompts are left-padded to a multiple of the block size K and the completion is ``--max-new-tokens`` tokens
(the answer, then EOS up to the end), so the completion's blocks are the blocks the decoder generated, in SFT,
rollouts and likelihoods alike. The block model's training forward cuts blocks at column multiples of K: that is why
the rows are left-padded (``diffusion_loss``'s check for right padding is switched off for the SFT loss).

Task: :mod:`unifusion.data.arithmetic` (``--task``: ``max(47,38,91)=`` → ``91``, ``47+38=`` → ``85``, ...; a fixed
held-out split). ``--sft-steps`` first fine-tunes on the task's answers (``uf.diffusion_loss(..., prompt_mask=)``,
as ``examples/sft.py``) so that completions have the format; ``--eval-problems`` N held-out problems are answered
greedily before and after GRPO.

Multi-process: ``torchrun`` (DDP; gloo on CPU): each rank decodes its own P/world prompts, losses are normalised by
global counts and DDP averages the gradients, so the same flags give the same numbers on 1 or n processes.

``--report``: issue 33's measurement — per seed, SFT once, then GRPO with each objective (grpo, wd1, spg) for
``--train-seconds`` from the same SFT weights; held-out accuracy before and after; mean and spread over the seeds;
rollout tokens/s (completion positions decoded per second) and the share of step time in rollouts and in the
likelihoods with their backward and the optimizer step; a markdown table to stdout and ``OUT/report.md``.

CPU smoke run (tiny random model)::

    python examples/grpo.py --tiny --steps 2 --sft-steps 2 --eval-problems 8 --out /tmp/uf-grpo
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/grpo.py --tiny --steps 2 --out /tmp/uf-grpo

SmolLM2-135M-Instruct as a block model (K = 8), the measurement of docs/guides/rl.md (``--task max``, 8 SFT updates,
lr 5·10⁻⁶: the defaults)::

    python examples/grpo.py --report --train-seconds 150 --eval-problems 200 --out runs/grpo-report
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_torchrun import (  # noqa: E402
    add_dtype_argument,
    all_reduce_sum,
    load_pretrained,
    setup_distributed,
    stream_generator,
    tiny_with_smollm2_tokenizer,
    training_autocast,
    training_dtype,
    wrap_model,
)

import unifusion as uf  # noqa: E402
from unifusion.data import arithmetic  # noqa: E402
from unifusion.samplers.policies import LowConfidence  # noqa: E402
from unifusion.validation import validation  # noqa: E402

RewardFn = Callable[[list[str], list[arithmetic.ArithmeticProblem]], Sequence[float]]
OBJECTIVES = ("grpo", "wd1", "spg")
ROLLOUT_STREAM = 1_000  # generator streams: 0 SFT order, 1 likelihood masks, 2.. SFT micro-batches, 1000 + row rollouts


# ------------------------------------------------------------------------------------------------ checks
def check_batch(batch_size: int, group_size: int, world_size: int) -> int:
    """Rows per process: ``batch_size`` rollouts per step in groups of ``group_size``, whole groups on each of
    ``world_size`` processes. ``ValueError`` when the group size does not divide the (per-process) batch."""
    for name, value in (("group_size", group_size), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if group_size < 2:
        raise ValueError(f"group_size: expected at least 2 completions per prompt (advantages compare them), got "
                         f"{group_size}")
    if batch_size % group_size:
        raise ValueError(f"group_size: {group_size} does not divide the batch of {batch_size} rollouts per step")
    if batch_size % (group_size * world_size):
        raise ValueError(f"group_size: {batch_size // group_size} groups of {group_size} do not split into whole "
                         f"groups over {world_size} processes (--prompts-per-step must be a multiple of the process "
                         "count)")
    return batch_size // world_size


def check_rewards(values: object, num_completions: int) -> torch.Tensor:
    """The rewards ``(B,)`` float64 of a reward function's return: one finite real number per completion, else a
    ``ValueError`` saying what came."""
    try:
        rewards = [float(v) for v in values]  # type: ignore[attr-defined]
    except (TypeError, ValueError) as err:
        raise ValueError(f"reward_fn: expected a sequence of {num_completions} numbers, got "
                         f"{type(values).__name__} ({err})") from None
    if len(rewards) != num_completions:
        raise ValueError(f"reward_fn: expected {num_completions} rewards (one per completion), got {len(rewards)}")
    bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise ValueError(f"reward_fn: expected finite rewards, got {rewards[bad[0]]} for completion {bad[0]} "
                         f"({len(bad)} non-finite)")
    return torch.tensor(rewards, dtype=torch.float64)


def probe_reward_fn(reward_fn: RewardFn, problems: list[arithmetic.ArithmeticProblem], group_size: int) -> None:
    """Call ``reward_fn`` once as a step will (G completions per problem: the answer and G − 1 empty strings) and
    check what it returns, before any rollout runs."""
    completions = [p.completion if j == 0 else "" for p in problems for j in range(group_size)]
    repeated = [p for p in problems for _ in range(group_size)]
    check_rewards(reward_fn(completions, repeated), len(completions))


# ------------------------------------------------------------------------------------------------ model and rows
def load_policy(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(hf_model, tokenizer)``: SmolLM2-135M-Instruct (bundled, offline), a local HF folder, or (``--tiny``) a
    random 2-layer Llama with SmolLM2's vocabulary and tokenizer."""
    if args.tiny:
        return tiny_with_smollm2_tokenizer(args.seed, max_positions=256)
    return load_pretrained(args.model)  # build() puts the wrapped model in train mode


def max_positions(model: uf.DiffusionLM) -> int | None:
    return getattr(model.base_model.config, "max_position_embeddings", None)


def encode_prompts(tokenizer: Any, texts: Sequence[str], *, block_size: int, max_new_tokens: int,
                   positions: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_ids (n, W), attention_mask (n, W))``: the prompts left-padded to a width W that is a multiple of
    ``block_size`` (so the completion starts a block). ``ValueError`` when a prompt and its completion do not fit
    the model's positions (``W + max_new_tokens + 1 > positions``, bos included)."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    longest = max(len(r) for r in rows)
    W = -(-longest // block_size) * block_size
    if positions is not None and W + max_new_tokens + 1 > positions:
        raise ValueError(f"prompt: {longest} tokens (padded to {W}, a multiple of the block size) + --max-new-tokens "
                         f"{max_new_tokens} + bos exceed the model's {positions} positions "
                         f"(max_position_embeddings)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (W - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (W - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def answer_ids(tokenizer: Any, problems: Sequence[arithmetic.ArithmeticProblem], max_new_tokens: int) -> torch.Tensor:
    """``(n, N)``: each answer's tokens, then EOS up to ``N = max_new_tokens`` (what the decoder emits)."""
    eos = tokenizer.eos_token_id
    rows = []
    for p in problems:
        ids = tokenizer(p.completion, add_special_tokens=False)["input_ids"] + [eos]
        if len(ids) > max_new_tokens:
            raise ValueError(f"--max-new-tokens: {max_new_tokens} cannot hold the answer {p.completion!r} and EOS "
                             f"({len(ids)} tokens)")
        rows.append(ids + [eos] * (max_new_tokens - len(ids)))
    return torch.tensor(rows)


def decode_completions(tokenizer: Any, completion_ids: torch.Tensor) -> list[str]:
    """Each row's text up to its first EOS."""
    eos = tokenizer.eos_token_id
    out = []
    for row in completion_ids.tolist():
        if eos in row:
            row = row[:row.index(eos)]
        out.append(tokenizer.decode(row, skip_special_tokens=True))
    return out


@dataclass
class Rollouts:
    """One step's completions on this process.

    Attributes:
        input_ids: ``(B, W + N)`` prompt (left-padded) then completion.
        attention_mask: ``(B, W + N)``, 0 on the left padding.
        completion_mask: ``(B, W + N)`` bool, the N completion positions.
        texts: the completions, decoded up to EOS.
        seconds: wall time of the decoding.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    texts: list[str]
    seconds: float


@torch.no_grad()
def rollout(model: uf.DiffusionLM, tokenizer: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
            max_new_tokens: int, generators: list[torch.Generator] | None, temperature: float,
            num_steps: int | None, greedy: bool = False) -> Rollouts:
    """Decode ``max_new_tokens`` after every prompt row with the block model's cached decoder (one generator per
    row); rows stop at EOS and are filled with EOS after it."""
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    seq = model.generate(prompt_ids, attention_mask=prompt_mask, max_new_tokens=max_new_tokens,
                         policy=LowConfidence(), num_steps=num_steps, use_cache=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                         temperature=temperature, do_sample=not greedy, generator=generators)
    model.train(was_training)
    W = prompt_ids.shape[1]
    attention = torch.cat([prompt_mask, torch.ones_like(seq[:, W:])], 1)
    completion = torch.zeros_like(seq, dtype=torch.bool)
    completion[:, W:] = True
    return Rollouts(seq, attention, completion, decode_completions(tokenizer, seq[:, W:]),
                    time.perf_counter() - t0)


def row_generators(seed: int, step: int, rows: range, device: torch.device) -> list[torch.Generator]:
    """One generator per global row index of a step's rollouts."""
    return [stream_generator(seed, step, ROLLOUT_STREAM + r, device) for r in rows]


# ------------------------------------------------------------------------------------------------ SFT and eval
def sft(wrapped: torch.nn.Module, inner: uf.DiffusionLM, tokenizer: Any, problems: list[arithmetic.ArithmeticProblem],
        args: argparse.Namespace, *, rank: int, world: int, autocast: Any, log: Callable[[str], None]) -> None:
    """``--sft-steps`` updates of the prompt-masked diffusion loss on ``problems`` (prompt → answer + EOS fill),
    ``--sft-batch`` rows per update in micro-batches of ``--sft-micro-batch`` spread over the processes; each
    micro-batch's corruption is keyed by (seed, step, global micro-batch), so 1 or n processes compute the same."""
    if args.sft_steps == 0:
        return
    kernel = uf.MaskKernel(inner.num_states, inner.mask_token_id)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=args.sft_lr, weight_decay=0.0)
    micro, batch = args.sft_micro_batch, args.sft_batch
    accum = batch // (micro * world)
    device = next(inner.parameters()).device
    order = torch.randperm(len(problems), generator=stream_generator(args.seed, 0, 0)).tolist()
    t0 = time.perf_counter()
    for step in range(args.sft_steps):
        picked = [problems[order[(step * batch + i) % len(problems)]] for i in range(batch)]
        loss_sum = torch.zeros((), device=device)
        for m in range(accum):
            i = m * world + rank  # global micro-batch index
            chunk = picked[i * micro:(i + 1) * micro]
            prompt_ids, prompt_mask = encode_prompts(tokenizer, [p.prompt for p in chunk],
                                                     block_size=args.block_size, max_new_tokens=args.max_new_tokens,
                                                     positions=max_positions(inner))
            ids = torch.cat([prompt_ids, answer_ids(tokenizer, chunk, args.max_new_tokens)], 1).to(device)
            attention = torch.cat([prompt_mask, torch.ones(len(chunk), args.max_new_tokens, dtype=torch.long)],
                                  1).to(device)
            is_prompt = torch.zeros_like(ids, dtype=torch.bool)
            is_prompt[:, :prompt_ids.shape[1]] = True
            sync = wrapped.no_sync() if (world > 1 and m < accum - 1) else nullcontext()
            with sync, autocast, validation(False):  # left padding on purpose (module docstring)
                out = uf.diffusion_loss(wrapped, ids, kernel, attention_mask=attention, prompt_mask=is_prompt,
                                        bidirectional_prob=1.0, generator=stream_generator(args.seed, step, 2 + i,
                                                                                           device))
                # the mean over the update's scored tokens: every row scores max_new_tokens
                (out.loss.sum() * world / (batch * args.max_new_tokens)).backward()
            loss_sum += out.loss.detach().sum()
        torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % args.log_every == 0 or step + 1 == args.sft_steps:
            loss = all_reduce_sum(loss_sum, world) / (batch * args.max_new_tokens)
            log(f"sft {step + 1:>5d} | loss {loss.item():.6f} | {time.perf_counter() - t0:.1f} s")


def evaluate(inner: uf.DiffusionLM, tokenizer: Any, problems: list[arithmetic.ArithmeticProblem],
             args: argparse.Namespace, *, rank: int, world: int) -> float:
    """Held-out accuracy: greedy decoding (argmax tokens, low-confidence order), exact reward, over all ranks."""
    mine = problems[rank::world]
    device = next(inner.parameters()).device
    correct = torch.zeros((), dtype=torch.float64, device=device)
    for s in range(0, len(mine), args.eval_batch):
        chunk = mine[s:s + args.eval_batch]
        prompt_ids, prompt_mask = encode_prompts(tokenizer, [p.prompt for p in chunk], block_size=args.block_size,
                                                 max_new_tokens=args.max_new_tokens, positions=max_positions(inner))
        out = rollout(inner, tokenizer, prompt_ids.to(device), prompt_mask.to(device),
                      max_new_tokens=args.max_new_tokens, generators=None, temperature=1.0,
                      num_steps=args.rollout_steps, greedy=True)
        correct += sum(arithmetic.rewards(out.texts, chunk))
    return float(all_reduce_sum(correct, world)) / max(len(problems), 1)


# ------------------------------------------------------------------------------------------------ the GRPO step
def score(model: Any, batch: Rollouts, args: argparse.Namespace, step: int, *, row_offset: int,
          estimator: str | None = None) -> uf.rl.SequenceLogProb:
    """``sequence_logprob`` with the step's estimator seed: old, reference and current policy see the same masks."""
    device = batch.input_ids.device
    return uf.rl.sequence_logprob(model, batch.input_ids, batch.completion_mask, attention_mask=batch.attention_mask,
                                  estimator=estimator or args.estimator, num_samples=args.num_samples,
                                  generator=stream_generator(args.seed, step, 1, device), row_offset=row_offset)


def supports_eubo(model: uf.DiffusionLM, length: int) -> bool:
    """Whether ``sequence_logprob(estimator="eubo")`` applies: mask-kernel models without blocks shorter than a row."""
    K = getattr(model, "block_size", None)
    return K is None or K >= length


def objective_loss(args: argparse.Namespace, wrapped: torch.nn.Module, inner: uf.DiffusionLM, batch: Rollouts,
                   advantages: torch.Tensor, *, old: torch.Tensor | None, ref: torch.Tensor | None, step: int,
                   row_offset: int, global_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's share of the global loss (its ``.backward()`` under DDP's averaging gives the global
    gradient: the normalisers are global counts, times the process count), and the current policy's sequence
    estimates ``(B,)``."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    N = args.max_new_tokens
    new = score(wrapped, batch, args, step, row_offset=row_offset)
    if args.objective == "grpo":
        old_logps = new.per_token.detach() if old is None else old
        per_token = uf.rl.grpo_loss(new.per_token, old_logps, advantages, batch.completion_mask, ref_logps=ref,
                                    kl_coef=args.kl_coef, epsilon=args.epsilon, num_sequences=global_rows)
        return per_token.sum() * world, new.sequence
    if args.objective == "wd1":
        per_sample = uf.rl.wd1_loss(new.sequence, advantages, group_size=args.group_size)
        return per_sample.sum() * world / (global_rows // args.group_size * N), new.sequence
    upper = new
    if supports_eubo(inner, batch.input_ids.shape[1]):
        upper = score(wrapped, batch, args, step, row_offset=row_offset, estimator="eubo")
    per_sample = uf.rl.spg_loss(new.sequence, upper.sequence, advantages, mix_weight=args.spg_mix)
    return per_sample.sum() * world / (global_rows * N), new.sequence


def grpo(args: argparse.Namespace, wrapped: torch.nn.Module, inner: uf.DiffusionLM, tokenizer: Any,
         train: list[arithmetic.ArithmeticProblem], reward_fn: RewardFn, *, rank: int, world: int, autocast: Any,
         log: Callable[[str], None]) -> list[dict[str, float]]:
    """``--steps`` GRPO steps (or until ``--train-seconds``); returns one record per step."""
    device = next(inner.parameters()).device
    P, G = args.prompts_per_step, args.group_size
    rows_local = check_batch(P * G, G, world)
    reference = None
    if args.kl_coef > 0 and args.objective == "grpo":
        reference = copy.deepcopy(inner).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=args.lr, weight_decay=0.0)
    records: list[dict[str, float]] = []
    t_start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        first = (step * P + rank * (P // world)) % len(train)
        problems = [train[(first + i) % len(train)] for i in range(P // world)]
        prompt_ids, prompt_mask = encode_prompts(tokenizer, [p.prompt for p in problems],
                                                 block_size=args.block_size, max_new_tokens=args.max_new_tokens,
                                                 positions=max_positions(inner))
        prompt_ids, prompt_mask = (x.repeat_interleave(G, 0).to(device) for x in (prompt_ids, prompt_mask))
        row0 = rank * rows_local
        with autocast:
            batch = rollout(inner, tokenizer, prompt_ids, prompt_mask, max_new_tokens=args.max_new_tokens,
                            generators=row_generators(args.seed, step, range(row0, row0 + rows_local), device),
                            temperature=args.temperature, num_steps=args.rollout_steps)
        repeated = [p for p in problems for _ in range(G)]
        rewards = check_rewards(reward_fn(batch.texts, repeated), rows_local)
        advantages = uf.rl.group_advantages(rewards, G).float().to(device)

        t1 = time.perf_counter()
        # a step whose every group has equal rewards has zero advantages: without a KL term its gradient is 0, so its
        # likelihoods are skipped (the ranks decide together; the rewards are host numbers, no device sync)
        varied = torch.tensor([float((rewards.view(-1, G).std(-1) > 0).any())], device=device)
        informative = bool(all_reduce_sum(varied, world).item() > 0) or reference is not None
        old = ref = None
        with torch.no_grad(), autocast:
            if informative and args.inner_updates > 1 and args.objective == "grpo":
                old = score(wrapped, batch, args, step, row_offset=row0).per_token
            if reference is not None:
                ref = score(reference, batch, args, step, row_offset=row0).per_token
        loss_value, logp_first = 0.0, float("nan")
        grad_norm = torch.zeros(())
        for j in range(args.inner_updates if informative else 0):
            with autocast:
                loss, logp = objective_loss(args, wrapped, inner, batch, advantages, old=old, ref=ref, step=step,
                                            row_offset=row0, global_rows=P * G)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(),
                                                       args.clip if args.clip > 0 else float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value += loss.detach().item() / world / args.inner_updates
            if j == 0:
                logp_first = logp.detach().sum().item() / args.max_new_tokens
        t2 = time.perf_counter()
        stats = all_reduce_sum(torch.tensor([rewards.sum().item(), loss_value, logp_first, t1 - t0, t2 - t1,
                                             t2 - t0, time.perf_counter() - t_start], dtype=torch.float64,
                                            device=device), world)
        stats = stats / torch.tensor([P * G, 1, P * G, world, world, world, world], dtype=torch.float64,
                                     device=device)
        record = {"step": step + 1, "reward": stats[0].item(), "loss": stats[1].item(),
                  "logp_per_token": stats[2].item(), "grad_norm": float(grad_norm),
                  "rollout_s": stats[3].item(), "likelihood_s": stats[4].item(), "step_s": stats[5].item(),
                  "rollout_tokens": P * G * args.max_new_tokens, "updated": informative}
        records.append(record)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            log(f"step {step + 1:>5d} | reward {record['reward']:.4f} | loss {record['loss']:.6f} | "
                f"logp/token {record['logp_per_token']:.4f} | grad_norm {record['grad_norm']:.4f} | "
                f"rollout {record['rollout_s']:.2f} s | likelihood {record['likelihood_s']:.2f} s | "
                f"{stats[6].item():.1f} s | {problems[0].prompt} {batch.texts[0]!r}"
                + ("" if informative else " | all groups tied: no update"))
        # the budget: the ranks agree because the mean elapsed time is all-reduced
        if args.train_seconds and stats[6].item() >= args.train_seconds:
            break
    return records


# ------------------------------------------------------------------------------------------------ arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (SmolLM2-135M-Instruct, bundled) or a local HF causal-LM folder")
    parser.add_argument("--tiny", action="store_true",
                        help="a random 2-layer Llama with SmolLM2's vocabulary and tokenizer (CPU smoke runs)")
    parser.add_argument("--block-size", type=int, default=8, help="block size K of the block-diffusion model")
    parser.add_argument("--task", choices=arithmetic.KINDS, default="max",
                        help="the problem kind (unifusion.data.arithmetic): max(a,b,c), median(a,b,c), a+b or a+b-c")
    parser.add_argument("--digits", type=int, default=2, help="digits per operand")
    parser.add_argument("--pad-answers", action=argparse.BooleanOptionalAction, default=False,
                        help="zero-pad the SFT answers to a fixed width (085): each answer position is one digit "
                             "place")
    parser.add_argument("--group-size", type=int, default=4, help="G, completions per prompt")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="prompts per step over all processes")
    parser.add_argument("--steps", type=int, default=10_000, help="GRPO steps (at most; see --train-seconds)")
    parser.add_argument("--train-seconds", type=float, default=0.0,
                        help="stop GRPO once this much wall time has passed (0: no limit); per run in --report")
    parser.add_argument("--inner-updates", type=int, default=1, help="μ, optimizer steps per batch of rollouts")
    parser.add_argument("--estimator", choices=uf.rl.ESTIMATORS, default="elbo",
                        help="sequence_logprob's estimator (a block model takes 'elbo', the block ELBO)")
    parser.add_argument("--num-samples", type=int, default=1, help="the estimator's passes per likelihood")
    parser.add_argument("--objective", choices=OBJECTIVES, default="grpo")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="grpo's k3 KL coefficient to the SFT policy")
    parser.add_argument("--epsilon", type=float, default=0.2, help="grpo's clip range")
    parser.add_argument("--spg-mix", type=float, default=None,
                        help="SPG's ω: ω·EUBO + (1−ω)·ELBO for negative advantages (default: the EUBO)")
    parser.add_argument("--lr", type=float, default=5e-6,
                        help="GRPO learning rate (AdamW; 2e-5 lowered max's accuracy on the CPU, docs/guides/rl.md)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0 = off)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="N, completion length (answer, then EOS)")
    parser.add_argument("--rollout-steps", type=int, default=None,
                        help="denoising steps per block (default the block size: one token per step)")
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout temperature")
    parser.add_argument("--format-reward", type=float, default=0.0,
                        help="reward of a wrong but well-formed (bare integer) answer (default 0: exact)")
    parser.add_argument("--sft-steps", type=int, default=8,
                        help="SFT updates on the task before GRPO (8: max's answers have the format, ~55 %% right)")
    parser.add_argument("--sft-batch", type=int, default=16, help="SFT rows per update (all processes)")
    parser.add_argument("--sft-micro-batch", type=int, default=8, help="SFT rows per forward")
    parser.add_argument("--sft-lr", type=float, default=1e-4, help="SFT learning rate")
    parser.add_argument("--eval-problems", type=int, default=100, help="held-out problems scored before and after")
    parser.add_argument("--eval-batch", type=int, default=32, help="rows per decoding call in evaluation")
    add_dtype_argument(parser)
    parser.add_argument("--backend", choices=("auto", "compiled", "eager"), default="auto",
                        help="unifusion's loss/sampler backend (uf.backend.set_backend)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", default="0,1,2", help="--report: the seeds, comma-separated")
    parser.add_argument("--report", action="store_true",
                        help="issue 33's measurement: SFT per seed, then grpo, wd1 and spg from it; a markdown table")
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--out", default="unifusion-grpo", help="output folder (metrics.json, report.md)")
    args = parser.parse_args(argv)
    for name in ("block_size", "digits", "group_size", "prompts_per_step", "steps", "inner_updates", "num_samples",
                 "max_new_tokens", "sft_batch", "sft_micro_batch", "eval_batch", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    for name in ("sft_steps", "eval_problems", "kl_coef", "train_seconds"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')}: expected a non-negative number, got {getattr(args, name)}")
    if args.kl_coef and args.objective != "grpo" and not args.report:
        parser.error(f"--kl-coef: the KL term is grpo's; --objective {args.objective} takes none")
    if not args.temperature > 0:
        parser.error(f"--temperature: expected a positive float, got {args.temperature}")
    return args


def check_sft_batch(args: argparse.Namespace, world: int) -> None:
    if args.sft_steps and args.sft_batch % (args.sft_micro_batch * world):
        raise ValueError(f"--sft-batch: expected a multiple of --sft-micro-batch × processes = "
                         f"{args.sft_micro_batch} × {world}, got {args.sft_batch}")


# ------------------------------------------------------------------------------------------------ main
def build(args: argparse.Namespace, device: torch.device) -> tuple[uf.DiffusionLM, Any]:
    hf_model, tokenizer = load_policy(args)
    model = uf.adapt_ar_model(hf_model, add_mask_token=True, block_size=args.block_size, tokenizer=tokenizer)
    return model.to(device).train(), tokenizer


def task_problems(args: argparse.Namespace, split: str) -> list[arithmetic.ArithmeticProblem]:
    """The task's problems: the whole train split in the order of ``--seed``, or the first ``--eval-problems`` of
    the held-out split (the same for every seed). Built once per arguments (the checks, SFT and every run of a
    report read the same list; a 2-digit three-operand train split is ~650,000 problems, seconds to build)."""
    seed = args.seed if split == "train" else 0
    n = None if split == "train" else args.eval_problems
    return list(_problems(args.task, args.digits, args.pad_answers, split, seed, n))


@lru_cache(maxsize=8)
def _problems(kind: arithmetic.Kind, digits: int, pad_answers: bool, split: str, seed: int,
              n: int | None) -> tuple[arithmetic.ArithmeticProblem, ...]:
    """:func:`task_problems`' cached list (``n=None``: the whole split)."""
    size = arithmetic.split_size(split, kind=kind, digits=digits) if n is None else n
    return tuple(arithmetic.make_problems(size, seed, "train" if split == "train" else "test", kind=kind,
                                          digits=digits, pad_answers=pad_answers))


def run_one(args: argparse.Namespace, inner: uf.DiffusionLM, tokenizer: Any, reward_fn: RewardFn, *, mode: str,
            rank: int, world: int, device: torch.device, dtype: torch.dtype, log: Callable[[str], None],
            sft_first: bool = True, before: float | None = None) -> dict[str, Any]:
    """SFT (if asked), held-out accuracy (unless ``before`` gives it), GRPO, held-out accuracy: one run's
    metrics."""
    train = task_problems(args, "train")
    test = task_problems(args, "test")
    wrapped = wrap_model(inner, mode, device)
    autocast = training_autocast(dtype, device)
    if sft_first:
        sft(wrapped, inner, tokenizer, train, args, rank=rank, world=world, autocast=autocast, log=log)
    if before is None:
        before = evaluate(inner, tokenizer, test, args, rank=rank, world=world) if test else float("nan")
    log(f"held-out accuracy before GRPO: {before:.4f} ({len(test)} problems)")
    records = grpo(args, wrapped, inner, tokenizer, train, reward_fn, rank=rank, world=world, autocast=autocast,
                   log=log)
    after = evaluate(inner, tokenizer, test, args, rank=rank, world=world) if test else float("nan")
    log(f"held-out accuracy after GRPO: {after:.4f} ({len(records)} steps)")
    rollout_s = sum(r["rollout_s"] for r in records)
    likelihood_s = sum(r["likelihood_s"] for r in records)
    step_s = sum(r["step_s"] for r in records)
    return {"objective": args.objective, "seed": args.seed, "accuracy_before": before, "accuracy_after": after,
            "steps": len(records), "rollout_tokens_per_s": sum(r["rollout_tokens"] for r in records) / rollout_s,
            "rollout_share": rollout_s / step_s, "likelihood_share": likelihood_s / step_s,
            "spg_upper": ("eubo" if supports_eubo(inner, 10 ** 9) else "elbo (a block model has no EUBO estimator)")
            if args.objective == "spg" else None,
            "records": records}


def preflight(args: argparse.Namespace, inner: uf.DiffusionLM, tokenizer: Any, reward_fn: RewardFn,
              world: int) -> None:
    """Every input check, before any rollout (or SFT) runs."""
    check_batch(args.prompts_per_step * args.group_size, args.group_size, world)
    check_sft_batch(args, world)
    train = task_problems(args, "train")
    # the longest prompt of the task and the longest answer must fit
    longest = max(train, key=lambda p: len(p.prompt))
    encode_prompts(tokenizer, [longest.prompt], block_size=args.block_size, max_new_tokens=args.max_new_tokens,
                   positions=max_positions(inner))
    answer_ids(tokenizer, [max(train, key=lambda p: len(p.completion))], args.max_new_tokens)
    probe_reward_fn(reward_fn, train[:args.prompts_per_step // world], args.group_size)
    try:  # the trainer's check: an estimator this model cannot take, 'trace' (no commit orders kept)
        uf.rl.check_estimator(inner, args.estimator, traces=False)
    except ValueError as error:
        raise ValueError(f"--{error}") from None


def report_table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The measurement as markdown: per objective, accuracy before → after per seed, mean and spread of the gain."""
    lines = [f"Held-out accuracy ({args.eval_problems} problems, greedy) after SFT ({args.sft_steps} updates) and "
             f"after GRPO ({args.train_seconds:g} s per run, {args.prompts_per_step} prompts × {args.group_size} "
             f"completions per step, lr {args.lr:g}, estimator {args.estimator})", "",
             "| objective | seeds: before → after | mean before | mean after | gain (mean ± std) | steps | "
             "rollout tok/s | rollout share | likelihood + update share |", "|---|---|---|---|---|---|---|---|---|"]
    for objective in OBJECTIVES:
        rows = [r for r in results if r["objective"] == objective]
        if not rows:
            continue
        gains = [100 * (r["accuracy_after"] - r["accuracy_before"]) for r in rows]
        spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
        per_seed = ", ".join(f"{100 * r['accuracy_before']:.1f} → {100 * r['accuracy_after']:.1f}" for r in rows)
        name = objective + (" (ω = 0: ELBO for both signs)" if rows[0].get("spg_upper", "eubo") not in
                            (None, "eubo") else "")
        lines.append(f"| {name} | {per_seed} | {statistics.mean(100 * r['accuracy_before'] for r in rows):.1f} | "
                     f"{statistics.mean(100 * r['accuracy_after'] for r in rows):.1f} | "
                     f"{statistics.mean(gains):+.1f} ± {spread:.1f} | "
                     f"{statistics.mean(r['steps'] for r in rows):.0f} | "
                     f"{statistics.mean(r['rollout_tokens_per_s'] for r in rows):.1f} | "
                     f"{statistics.mean(r['rollout_share'] for r in rows):.2f} | "
                     f"{statistics.mean(r['likelihood_share'] for r in rows):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, reward_fn: RewardFn | None = None) -> int:
    args = parse_args(argv)
    uf.backend.set_backend(args.backend)
    mode = "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "none"
    if args.report and mode != "none":
        raise SystemExit("--report: run it as one process")
    rank, world, _, device = setup_distributed(mode)
    is_main = rank == 0

    def log(line: str) -> None:
        if is_main:
            print(line, flush=True)

    dtype, dtype_line = training_dtype(args.dtype, device)
    if reward_fn is None:
        reward_fn = partial(arithmetic.rewards, format_weight=args.format_reward)
    out_dir = Path(args.out)
    model, tokenizer = build(args, device)
    preflight(args, model, tokenizer, reward_fn, world)  # every ValueError before any rollout
    log(f"world_size {world} | {dtype_line} | model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
        f"block_size {args.block_size} | task {args.digits}-digit {args.task} | {args.prompts_per_step} prompts × "
        f"{args.group_size} completions per step | objective {args.objective} | estimator {args.estimator}")
    if not args.report:
        result = run_one(args, model, tokenizer, reward_fn, mode=mode, rank=rank, world=world, device=device,
                         dtype=dtype, log=log)
        if is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "metrics.json").write_text(json.dumps({"args": vars(args), **result}, indent=1))
            log(f"wrote {out_dir / 'metrics.json'}")
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return 0

    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        base = argparse.Namespace(**{**vars(args), "seed": seed})
        if seed != args.seed:
            model, tokenizer = build(base, device)
        sft(model, model, tokenizer, task_problems(base, "train"), base, rank=0, world=1,
            autocast=training_autocast(dtype, device), log=log)
        start = copy.deepcopy(model.state_dict())
        before: float | None = None  # greedy decoding of the same weights: measured once per seed
        for objective in OBJECTIVES:
            run = argparse.Namespace(**{**vars(base), "objective": objective,
                                        "kl_coef": args.kl_coef if objective == "grpo" else 0.0})
            model.load_state_dict(start)
            log(f"--- seed {seed} | {objective}")
            results.append(run_one(run, model, tokenizer, reward_fn, mode=mode, rank=0, world=1, device=device,
                                   dtype=dtype, log=log, sft_first=False, before=before))
            before = results[-1]["accuracy_before"]
    table = report_table(results, args)
    print(table, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.md").write_text(table + "\n")
    (out_dir / "report.json").write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
