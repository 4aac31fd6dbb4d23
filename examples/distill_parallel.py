"""Distil a block-diffusion model to decode several tokens per forward: SFT → record → distil → evaluate, one command.

The pipeline (per seed):

1. **SFT** (``--sft-steps``, at most ``--sft-seconds``): the prompt-masked diffusion loss on the ``sort`` task's
   answers (:mod:`unifusion.data.sorting`: ``sort(3,1,4,1,5)=`` → ``1,1,3,4,5``, 9 tokens + EOS; ``--digits 2``:
   ``sort(47,38,91,12,5)=`` → ``5,12,38,47,91``, 14 tokens + EOS), so that
   the block model (SmolLM2-135M-Instruct adapted to blocks of K = 8, as ``examples/grpo.py``) answers in format;
2. **record** (``--record-problems`` train problems): the SFT model's own greedy decodes, one token per forward
   (``LowConfidence``, K steps per block), with the forward each token was committed at
   (:func:`unifusion.distill.record_trajectories`); ``--keep correct`` (default, d3LLM's choice) keeps only the
   verified-correct answers;
3. **distil** (``--distill-steps``, at most ``--train-seconds``; the whole model, or ``--lora R`` adapters through
   :func:`unifusion.distill.add_lora`): :func:`unifusion.distill.distillation_loss` — d3LLM's pseudo-trajectory mask
   at a drawn state and its complement (dParallel's complementary pair), each scored by certainty forcing
   (cross-entropy + ``--entropy-weight`` × the entropy at T = ``--entropy-temperature`` of the masked tokens already
   predicted right);
4. **evaluate**, before and after distillation, on ``--eval-problems`` held-out problems (greedy, batches of
   ``--eval-batch``, the exact KV cache with merged commits) at each decoding setting: one token per forward
   (``LowConfidence``, K steps per block), ``ConfidenceThreshold(τ)`` for each ``--thresholds`` τ (Fast-dLLM) and k
   tokens forced per forward for each ``--forced`` k (``LowConfidence``, K/k steps per block), and Learn2PD's learned
   commit rule (``LearnedCommit(head, τ)`` for each ``--commit-rule`` τ, its head fitted on the phase's frozen model;
   with ``--oracle``, :class:`~unifusion.distill.OracleCommit` on each batch's own one-token-per-forward decode: the
   ceiling of a perfect learned rule, left out of AUP): accuracy (exact reward), tokens per forward (generated tokens up
   to and including EOS / model calls; the prefill rides with the first step), wall time; and the original AR model's
   own ``generate`` with its KV cache (greedy) on the same prompts, made to emit as many tokens as the answers have
   (answer + EOS), in the same batches and dtype: the wall-time reference. Wall time is measured at two batch sizes:
   ``--eval-batch`` (all problems: a throughput figure, where a CPU is compute-bound and a block step of 9–17 positions
   a row costs several AR steps) and **batch 1** on the first ``--wall-problems`` problems, one call each (the latency
   setting dParallel and d3LLM report speed at), block and AR models alike. The block model's CPU linears are packed
   once per phase (:func:`unifusion.cpu_linears.packed_linears` around the phase's decodes; the reorder is reported, not
   timed); the AR reference runs as transformers ships it (its batch-1 time with packed linears is reported beside it).

AUP (:func:`unifusion.eval.accuracy_under_parallelism`, d3LLM's definition, y_max the best accuracy of both curves)
of the before and after curves (their points are the seeds' means), and the frontier plot
(:func:`unifusion.eval.plot_parallelism`). ``OUT/report.json`` holds every run's numbers and the summary;
``OUT/report.md`` the table; ``OUT/frontier.png`` the plot.

``--report``: every seed of ``--seeds`` (else ``--seed`` alone).

CPU smoke run (tiny random model)::

    python examples/distill_parallel.py --model tiny --sft-steps 2 --distill-steps 2 --record-problems 8 \\
        --eval-problems 8 --keep all --out /tmp/uf-distill

SmolLM2-135M-Instruct (K = 8), the measurement of docs/guides/parallel-decoding.md: the defaults (3 seeds, 5
one-digit numbers, 60 SFT updates of 8 rows, 96 recorded problems, 80 distillation updates of 4 trajectories at
lr 2·10⁻⁵, 64 held-out problems; ~12 minutes a seed on both cores of the project's CPU)::

    OMP_NUM_THREADS=2 python examples/distill_parallel.py --report --out runs/distill-report

Steps, not seconds, bound the stages by default (``--sft-seconds`` / ``--train-seconds`` cap them by wall time), so
the numbers do not depend on the machine's load. The two-digit task and longer budgets: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_torchrun import load_pretrained, stream_generator, tiny_with_smollm2_tokenizer  # noqa: E402

import unifusion as uf  # noqa: E402
from unifusion.cpu_linears import packed_linears  # noqa: E402
from unifusion.data import sorting  # noqa: E402
from unifusion.distill import (  # noqa: E402
    CommitHead,
    LearnedCommit,
    OracleCommit,
    RewardFn,
    Trajectories,
    add_lora,
    collect_commit_data,
    distillation_loss,
    record_trajectories,
    train_commit_head,
)
from unifusion.samplers.policies import ConfidenceThreshold, LowConfidence  # noqa: E402
from unifusion.validation import validation  # noqa: E402

_NUMBERS = re.compile(r"sort\(([\d,]+)\)=")


# ------------------------------------------------------------------------------------------------ model and rows
def load(args: argparse.Namespace, seed: int) -> tuple[Any, Any]:
    """``(hf_model, tokenizer)``: SmolLM2-135M-Instruct (``smollm2``), a local HF folder, or (``tiny``) a random
    2-layer Llama with SmolLM2's vocabulary and tokenizer."""
    if args.model == "tiny":
        return tiny_with_smollm2_tokenizer(seed, max_positions=256)
    return load_pretrained(args.model)


def build(args: argparse.Namespace, seed: int) -> tuple[uf.DiffusionLM, Any]:
    hf_model, tokenizer = load(args, seed)
    model = uf.adapt_ar_model(hf_model, add_mask_token=True, block_size=args.block_size, tokenizer=tokenizer)
    return model.to(args.device).train(), tokenizer


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (wall times of CUDA decodes end when the work does)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def encode_prompts(tokenizer: Any, texts: list[str], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (n, W), mask (n, W))``: left-padded to a multiple of ``block_size`` (the completion starts a block)."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    W = -(-max(len(r) for r in rows) // block_size) * block_size
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (W - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (W - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def answer_ids(tokenizer: Any, problems: list[sorting.SortProblem], width: int) -> torch.Tensor:
    """``(n, width)``: each answer's tokens, then EOS up to ``width``."""
    eos = tokenizer.eos_token_id
    rows = [tokenizer(p.completion, add_special_tokens=False)["input_ids"] + [eos] for p in problems]
    if max(len(r) for r in rows) > width:
        raise ValueError(f"--max-new-tokens: {width} cannot hold an answer and its EOS ({max(map(len, rows))} "
                         "tokens)")
    return torch.tensor([r + [eos] * (width - len(r)) for r in rows])


def eos_fill(completion: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """``(n, width)`` bool: True after each row's first EOS (the fill), False up to and including it."""
    is_eos = (completion == eos_token_id).long()
    return (is_eos.cumsum(1) - is_eos) > 0


def texts_and_lengths(tokenizer: Any, completion: torch.Tensor) -> tuple[list[str], list[int]]:
    """Each row's text up to its first EOS and its generated length (tokens up to and including that EOS)."""
    eos = tokenizer.eos_token_id
    texts, lengths = [], []
    for row in completion.tolist():
        end = row.index(eos) if eos in row else len(row)
        texts.append(tokenizer.decode(row[:end], skip_special_tokens=True))
        lengths.append(min(end + 1, len(row)))
    return texts, lengths


# ------------------------------------------------------------------------------------------------ stages
def sft(model: uf.DiffusionLM, tokenizer: Any, problems: list[sorting.SortProblem], args: argparse.Namespace,
        seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    """``--sft-steps`` updates (at most ``--sft-seconds``) of the prompt-masked diffusion loss, ``--sft-batch`` rows
    each, left-padded prompts (the block layout cuts at column multiples of K).

    Each completion is its answer, one EOS and EOS fill up to ``--max-new-tokens``; the fill's per-position losses
    count ``args.sft_fill_weight`` times (1: LLaDA's SFT, every EOS scored; 0: only the answer and its first EOS —
    the fill stays in ``x_t``, masked like the rest, but teaches nothing). A heavily scored fill teaches a model with
    short answers that EOS is likely anywhere, which confidence-ordered decoding then commits first (the EOS trap)."""
    kernel = uf.MaskKernel(model.num_states, model.mask_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)
    order = torch.randperm(len(problems), generator=stream_generator(seed, 0, 0)).tolist()
    t0, loss, steps = time.perf_counter(), float("nan"), 0
    model.train()
    for step in range(args.sft_steps):
        if args.sft_seconds and time.perf_counter() - t0 > args.sft_seconds:
            break
        batch = [problems[order[(step * args.sft_batch + i) % len(problems)]] for i in range(args.sft_batch)]
        prompt_ids, prompt_mask = encode_prompts(tokenizer, [p.prompt for p in batch], args.block_size)
        answers = answer_ids(tokenizer, batch, args.max_new_tokens)
        ids = torch.cat([prompt_ids, answers], 1)
        weight = torch.ones(ids.shape, dtype=torch.float32)
        weight[:, prompt_ids.shape[1]:][eos_fill(answers, tokenizer.eos_token_id)] = args.sft_fill_weight
        attention = torch.cat([prompt_mask, torch.ones(len(batch), args.max_new_tokens, dtype=torch.long)], 1)
        is_prompt = torch.zeros_like(ids, dtype=torch.bool)
        is_prompt[:, :prompt_ids.shape[1]] = True
        with validation(False):  # left padding on purpose
            out = uf.diffusion_loss(model, ids.to(args.device), kernel, attention_mask=attention.to(args.device),
                                    prompt_mask=is_prompt.to(args.device), bidirectional_prob=1.0,
                                    generator=stream_generator(seed, step, 2, args.device))
        scaled = (out.loss * weight.to(out.loss.device)).sum() / (len(batch) * args.max_new_tokens)
        scaled.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss, steps = scaled.item(), step + 1
        if steps % args.log_every == 0:
            log(f"sft {steps:>5d} | loss {loss:.4f} | {time.perf_counter() - t0:.1f} s")
    return {"steps": steps, "seconds": time.perf_counter() - t0, "final_loss": loss}


def prompt_problem(prompt: list[int], tokenizer: Any) -> sorting.SortProblem:
    """The problem a recorded prompt asks (its numbers read back from the text)."""
    match = _NUMBERS.search(tokenizer.decode(prompt, skip_special_tokens=True))
    if match is None:
        raise ValueError("prompts: a recorded prompt is not a sort(...)= problem")
    return sorting.SortProblem(tuple(int(x) for x in match.group(1).split(",")))


def record(model: uf.DiffusionLM, tokenizer: Any, problems: list[sorting.SortProblem], args: argparse.Namespace,
           reward_fn: RewardFn | None = None) -> tuple[Trajectories | None, dict[str, Any]]:
    """The teacher's greedy one-token-per-forward decodes of ``problems``, filtered by ``reward_fn`` if given, else
    by ``--keep`` (``"correct"``: the sort verifier)."""
    def correct(prompts: list[list[int]], completions: list[list[int]]) -> list[bool]:
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        return [sorting.reward(t, prompt_problem(p, tokenizer)) == 1.0 for t, p in zip(texts, prompts)]

    model.eval()
    ids, mask = encode_prompts(tokenizer, [p.prompt for p in problems], args.block_size)
    t0 = time.perf_counter()
    traj = record_trajectories(model, ids, prompt_mask=mask.bool(), max_new_tokens=args.max_new_tokens,
                               policy=LowConfidence(), num_steps=args.block_size, batch_size=args.eval_batch,
                               reward_fn=reward_fn or (correct if args.keep == "correct" else None), progress=False,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                               use_cache=True, merge_commits=True)
    info = {"problems": len(problems), "kept": len(traj), "seconds": time.perf_counter() - t0, "keep": args.keep}
    return (traj if len(traj) else None), info


def distil(model: uf.DiffusionLM, traj: Trajectories | None, args: argparse.Namespace, seed: int,
           log: Callable[[str], None]) -> dict[str, Any]:
    """``--distill-steps`` updates (at most ``--train-seconds``) of the complementary-pair certainty forcing on
    random batches of the kept trajectories; none kept: no update (the report says so)."""
    if traj is None or args.distill_steps == 0:
        return {"steps": 0, "seconds": 0.0, "final_loss": None, "trainable_parameters": 0,
                "skipped": "no kept trajectory" if traj is None else "--distill-steps 0"}
    if args.lora:
        add_lora(model, r=args.lora, lora_alpha=2 * args.lora)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.distill_lr, weight_decay=0.0)
    g = torch.Generator(device=args.device).manual_seed(seed)
    t0, loss, steps = time.perf_counter(), float("nan"), 0
    model.train()
    for step in range(args.distill_steps):
        if args.train_seconds and time.perf_counter() - t0 > args.train_seconds:
            break
        rows = torch.randint(len(traj), (min(args.distill_batch, len(traj)),), generator=g, device=args.device).cpu()
        value = distillation_loss(model, traj.select(rows), masks="trajectory", per_block=args.per_block,
                                  temperature=args.entropy_temperature, entropy_weight=args.entropy_weight,
                                  generator=g)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss, steps = value.item(), step + 1
        if steps % args.log_every == 0:
            log(f"distil {steps:>5d} | loss {loss:.4f} | {time.perf_counter() - t0:.1f} s")
    return {"steps": steps, "seconds": time.perf_counter() - t0, "final_loss": loss,
            "trainable_parameters": sum(p.numel() for p in params), "lora_rank": args.lora or None,
            "per_block": args.per_block}


# ------------------------------------------------------------------------------------------------ evaluation
@dataclass(frozen=True)
class Setting:
    """One decoding setting: a policy and its steps per block; ``oracle``: the policy is
    :class:`~unifusion.distill.OracleCommit` on each batch's one-token-per-forward decode (``policy`` unused)."""

    name: str
    policy: Any
    num_steps: int
    oracle: bool = False


def settings(args: argparse.Namespace) -> list[Setting]:
    K = args.block_size
    out = [Setting("1 token/forward", LowConfidence(), K)]
    out += [Setting(f"threshold {tau:g}", ConfidenceThreshold(tau), K) for tau in args.thresholds]
    out += [Setting(f"{k} tokens/forward (forced)", LowConfidence(), K // k) for k in args.forced]
    if args.oracle:
        out.append(Setting("oracle commit (ceiling)", None, K, oracle=True))
    return out


def commit_rule_settings(model: uf.DiffusionLM, tokenizer: Any, problems: list[sorting.SortProblem],
                         args: argparse.Namespace, seed: int) -> tuple[list[Setting], dict[str, Any]]:
    """Learn2PD's learned commit rule on the model as it is (frozen): a :class:`~unifusion.distill.CommitHead` fitted
    to the model's own greedy one-token-per-forward decodes of ``problems`` (train problems), one
    ``LearnedCommit(head, τ)`` setting per ``--commit-rule`` τ."""
    if not args.commit_rule:
        return [], {}
    model.eval()
    t0 = time.perf_counter()
    ids, mask = encode_prompts(tokenizer, [p.prompt for p in problems], args.block_size)
    data = collect_commit_data(model, ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                               num_steps=args.block_size, batch_size=args.eval_batch, use_cache=True,
                               merge_commits=True, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.eos_token_id)
    hidden_size = data.hidden.shape[-1]
    head = CommitHead(hidden_size).to(args.device)
    losses = train_commit_head(head, data, steps=args.commit_rule_steps,
                               generator=torch.Generator().manual_seed(seed))
    info = {"examples": len(data), "positive_rate": data.positive_rate, "final_loss": losses[-1],
            "train_accuracy": head.accuracy(data), "seconds": time.perf_counter() - t0}
    return [Setting(f"learned commit {tau:g}", LearnedCommit(head, tau), args.block_size)
            for tau in args.commit_rule], info


def batches(tokenizer: Any, problems: list[sorting.SortProblem], args: argparse.Namespace) -> list[tuple[Any, ...]]:
    return [(chunk, *encode_prompts(tokenizer, [p.prompt for p in chunk], args.block_size))
            for chunk in (problems[s:s + args.eval_batch] for s in range(0, len(problems), args.eval_batch))]


def decode(model: uf.DiffusionLM, tokenizer: Any, ids: torch.Tensor, mask: torch.Tensor, setting: Setting,
           args: argparse.Namespace, reference: torch.Tensor | None = None) -> tuple[Any, float]:
    """One timed ``generate`` call of the block model (greedy, exact KV cache with merged commits): ``(output,
    seconds)``. An oracle setting commits against ``reference``, ``(B, P + N)``: these rows' one-token-per-forward
    decode; it draws (greedy decoding draws all the same) from a generator of its own, so that adding the oracle
    leaves the global stream — and what is initialised from it later, such as the next phase's commit head — as it
    was."""
    ids, mask = ids.to(args.device), mask.to(args.device)
    policy, generator = setting.policy, None
    if setting.oracle:
        if reference is None:
            raise ValueError(f"reference: the setting {setting.name!r} is an oracle and needs the rows' "
                             "one-token-per-forward decode, got None")
        policy = OracleCommit(reference.to(args.device))
        generator = torch.Generator(device=args.device).manual_seed(0)
    synchronize(args.device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, policy=policy,
                         num_steps=setting.num_steps, use_cache=True, merge_commits=True, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                         generator=generator, return_dict=True)
    synchronize(args.device)
    return out, time.perf_counter() - t0


@torch.no_grad()
def evaluate(model: uf.DiffusionLM, tokenizer: Any, rows: list[tuple[Any, ...]], setting: Setting,
             args: argparse.Namespace, single: list[tuple[Any, ...]] | None = None,
             references: list[torch.Tensor] | None = None) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Greedy decoding of every batch at one setting: ``(result, sequences)``. ``result``: accuracy (%), generated
    tokens, model calls, wall time; and, given ``single`` (the ``--wall-problems`` prompts one row each), the same
    prompts' wall time at batch 1 (``seconds_batch1``) and its tokens per forward. ``sequences``: each call's
    ``(B, P + N)`` output, the batches of ``rows`` then those of ``single`` — what an oracle setting takes as
    ``references`` (in the same order) from the one-token-per-forward setting. The caller holds the packed linears
    open (the packing is not in these times)."""
    model.eval()
    num_calls = len(rows) + len(single or [])
    if references is not None and len(references) != num_calls:
        raise ValueError(f"references: one decode per batch ({num_calls}), got {len(references)}")
    sequences: list[torch.Tensor] = []

    def run(i: int, ids: torch.Tensor, mask: torch.Tensor) -> tuple[Any, float]:
        out, dt = decode(model, tokenizer, ids, mask, setting, args,
                         reference=None if references is None else references[i])
        sequences.append(out.sequences)
        return out, dt

    correct = tokens = forwards = 0
    seconds = 0.0
    for i, (chunk, ids, mask) in enumerate(rows):
        out, dt = run(i, ids, mask)
        seconds += dt
        texts, lengths = texts_and_lengths(tokenizer, out.sequences[:, ids.shape[1]:])
        correct += int(sum(sorting.rewards(texts, chunk)))
        tokens += sum(lengths)
        forwards += int(out.num_forwards.sum())
    n = sum(len(c) for c, _, _ in rows)
    result = {"setting": setting.name, "oracle": setting.oracle, "steps_per_block": setting.num_steps,
              "accuracy": 100.0 * correct / n,
              "tokens": tokens, "forwards": forwards, "tokens_per_forward": tokens / forwards, "seconds": seconds,
              "batch": args.eval_batch}
    if single:
        seconds1, tokens1, forwards1 = 0.0, 0, 0
        for i, (_, ids, mask) in enumerate(single, start=len(rows)):
            out, dt = run(i, ids, mask)
            seconds1 += dt
            tokens1 += sum(texts_and_lengths(tokenizer, out.sequences[:, ids.shape[1]:])[1])
            forwards1 += int(out.num_forwards.sum())
        result.update(seconds_batch1=seconds1, problems_batch1=len(single),
                      tokens_per_forward_batch1=tokens1 / forwards1)
    return result, sequences


def evaluate_grid(grid: list[Setting], block_size: int,
                  evaluate_one: Callable[[Setting, list[torch.Tensor] | None],
                                         tuple[dict[str, Any], list[torch.Tensor]]]) -> list[dict[str, Any]]:
    """Every setting of ``grid`` through ``evaluate_one(setting, references)``; ``grid[0]`` decodes one token per
    forward (``LowConfidence``, ``block_size`` steps per block), and its sequences are the references of every oracle
    setting after it (no second decode of them)."""
    first_setting = grid[0]
    if (first_setting.oracle or not isinstance(first_setting.policy, LowConfidence)
            or first_setting.num_steps != block_size):
        raise ValueError(f"grid: the first setting must decode one token per forward (LowConfidence, {block_size} "
                         f"steps per block), got {first_setting.name!r}")
    first, references = evaluate_one(grid[0], None)
    return [first] + [evaluate_one(s, references if s.oracle else None)[0] for s in grid[1:]]


def evaluate_phase(model: uf.DiffusionLM, tokenizer: Any, rows: list[tuple[Any, ...]],
                   single: list[tuple[Any, ...]], grid: list[Setting], args: argparse.Namespace
                   ) -> tuple[list[dict[str, Any]], float]:
    """Every setting of ``grid`` (:func:`evaluate_grid`), the model's CPU linears packed once for all of them
    (:func:`unifusion.cpu_linears.packed_linears`, what ``generate`` does per call otherwise): ``(results, packing
    seconds)``. A warm-up call at each batch size first (the merged cache's first call, allocations)."""
    model.eval()
    t0 = time.perf_counter()
    with packed_linears(model):
        packing = time.perf_counter() - t0
        for warm in ([(c[:2], i[:2], m[:2]) for c, i, m in rows[:1]], single[:1]):
            for _, ids, mask in warm:
                decode(model, tokenizer, ids, mask, grid[0], args)
        results = evaluate_grid(grid, args.block_size,
                                lambda s, refs: evaluate(model, tokenizer, rows, s, args, single, refs))
    return results, packing


@torch.no_grad()
def evaluate_ar(ar_model: Any, tokenizer: Any, rows: list[tuple[Any, ...]], answer_tokens: int,
                device: torch.device) -> dict[str, Any]:
    """The AR model's cached ``generate`` (greedy) on the same batches, ``answer_tokens`` new tokens per row."""
    ar_model.eval()
    correct, seconds = 0, 0.0
    for chunk, ids, mask in rows:
        ids, mask = ids.to(device), mask.to(device)
        synchronize(device)
        t0 = time.perf_counter()
        out = ar_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=answer_tokens,
                                min_new_tokens=answer_tokens, pad_token_id=tokenizer.eos_token_id, use_cache=True)
        synchronize(device)
        seconds += time.perf_counter() - t0
        texts, _ = texts_and_lengths(tokenizer, out[:, ids.shape[1]:])
        correct += int(sum(sorting.rewards(texts, chunk)))
    n = sum(len(c) for c, _, _ in rows)
    return {"setting": "HF AR generate + KV cache (not fine-tuned)", "accuracy": 100.0 * correct / n,
            "tokens": answer_tokens * n, "tokens_per_forward": 1.0, "seconds": seconds, "batch": rows[0][1].shape[0]}


def evaluate_ar_all(ar_model: Any, tokenizer: Any, rows: list[tuple[Any, ...]], single: list[tuple[Any, ...]],
                    args: argparse.Namespace) -> dict[str, Any]:
    """The AR reference at both batch sizes: ``--eval-batch`` (plain HF layers), and at batch 1 on the
    ``--wall-problems`` prompts both plain (``seconds_batch1``, the issue's reference) and with its linears packed
    as the block model's are (``seconds_batch1_packed``)."""
    answer = sorting.answer_length(args.count, args.digits) + 1
    warm = [(c[:2], i[:2], m[:2]) for c, i, m in rows[:1]]
    evaluate_ar(ar_model, tokenizer, warm, 2, args.device)
    ar = evaluate_ar(ar_model, tokenizer, rows, answer, args.device)
    if single:
        evaluate_ar(ar_model, tokenizer, single[:1], 2, args.device)
        ar["seconds_batch1"] = evaluate_ar(ar_model, tokenizer, single, answer, args.device)["seconds"]
        ar["problems_batch1"] = len(single)
        with packed_linears(ar_model):
            evaluate_ar(ar_model, tokenizer, single[:1], 2, args.device)
            ar["seconds_batch1_packed"] = evaluate_ar(ar_model, tokenizer, single, answer, args.device)["seconds"]
    return ar


# ------------------------------------------------------------------------------------------------ report
def aup_or_none(points: list[tuple[float, float]], max_accuracy: float) -> float | None:
    """AUP of ``points`` (tokens per forward, accuracy %), ``None`` where d3LLM's definition has none (the fastest
    point more than 5 points below the slowest)."""
    try:
        return uf.eval.accuracy_under_parallelism([p[0] for p in points], [p[1] for p in points],
                                                  max_accuracy=max(max_accuracy, 1e-9))
    except ValueError as err:
        if "max_drop" not in str(err):
            raise
        return None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase and setting, the seeds' means (and spread of the accuracy), the wall time relative to the AR model's
    at the evaluation batch (``x_ar_wall_time``) and, with ``--wall-problems``, at batch 1 (``x_ar_wall_time_batch1``
    against plain HF layers, ``x_ar_packed_batch1`` against the AR model with packed linears); the AUP of each
    phase's mean points."""
    names = [r["setting"] for r in runs[0]["before"]]
    ar_seconds = statistics.mean(r["ar"]["seconds"] for r in runs)
    batch1 = "seconds_batch1" in runs[0]["ar"]
    ar = {"accuracy": statistics.mean(r["ar"]["accuracy"] for r in runs), "seconds": ar_seconds}
    if batch1:
        ar["seconds_batch1"] = statistics.mean(r["ar"]["seconds_batch1"] for r in runs)
        ar["seconds_batch1_packed"] = statistics.mean(r["ar"]["seconds_batch1_packed"] for r in runs)
    rows = []
    for phase in ("before", "after"):
        for i, name in enumerate(names):
            results = [r[phase][i] for r in runs]
            acc = [x["accuracy"] for x in results]
            row = {"phase": phase, "setting": name, "oracle": results[0].get("oracle", False),
                   "accuracy": statistics.mean(acc),
                   "accuracy_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                   "tokens_per_forward": statistics.mean(x["tokens_per_forward"] for x in results),
                   "seconds": statistics.mean(x["seconds"] for x in results),
                   "x_ar_wall_time": statistics.mean(x["seconds"] for x in results) / ar_seconds}
            if batch1:
                seconds1 = statistics.mean(x["seconds_batch1"] for x in results)
                row.update(seconds_batch1=seconds1,
                           tokens_per_forward_batch1=statistics.mean(x["tokens_per_forward_batch1"] for x in results),
                           x_ar_wall_time_batch1=seconds1 / ar["seconds_batch1"],
                           x_ar_packed_batch1=seconds1 / ar["seconds_batch1_packed"])
            rows.append(row)
    curves = {phase: [(r["tokens_per_forward"], r["accuracy"]) for r in rows if r["phase"] == phase and not r["oracle"]]
              for phase in ("before", "after")}
    y_max = max(y for curve in curves.values() for _, y in curve)
    aup = {phase: aup_or_none(curve, y_max) for phase, curve in curves.items()}
    return {"rows": rows, "curves": curves, "aup": aup, "aup_max_accuracy": y_max, "ar": ar}


def table(summary: dict[str, Any], args: argparse.Namespace, seeds: list[int]) -> str:
    aup, ar = summary["aup"], summary["ar"]
    batch1 = "seconds_batch1" in ar
    lines = [f"sort ({args.count} numbers of {args.digits} digits), {args.eval_problems} held-out problems, greedy, "
             f"K = {args.block_size}, seeds {seeds}, {torch.get_num_threads()} thread(s); accuracy and tokens per "
             f"forward at batch {args.eval_batch}; wall time relative to the AR model's generate + KV cache on the "
             f"same prompts and answer length, at batch {args.eval_batch} (all {args.eval_problems} problems)"
             + (f" and at batch 1 (the first {args.wall_problems} problems one at a time; the block model's linears "
                "packed once per phase, not timed; AR plain, and AR packed in brackets)" if batch1 else ""), "",
             "| phase | decoding | accuracy % | tokens / forward | wall s | × AR wall time |"
             + (" tok/fwd, batch 1 | wall s, batch 1 | × AR, batch 1 |" if batch1 else ""),
             "|---|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if batch1 else "")]
    for r in summary["rows"]:
        spread = f" ± {r['accuracy_std']:.1f}" if len(seeds) > 1 else ""
        line = (f"| {r['phase']} | {r['setting']} | {r['accuracy']:.1f}{spread} | "
                f"{r['tokens_per_forward']:.2f} | {r['seconds']:.2f} | {r['x_ar_wall_time']:.2f} |")
        if batch1:
            line += (f" {r['tokens_per_forward_batch1']:.2f} | {r['seconds_batch1']:.2f} | "
                     f"{r['x_ar_wall_time_batch1']:.2f} ({r['x_ar_packed_batch1']:.2f}) |")
        lines.append(line)
    line = f"| — | HF AR generate + KV cache | {ar['accuracy']:.1f} | 1.00 | {ar['seconds']:.2f} | 1.00 |"
    if batch1:
        line += f" 1.00 | {ar['seconds_batch1']:.2f} ({ar['seconds_batch1_packed']:.2f} packed) | 1.00 |"
    lines.append(line)
    fmt = {k: ("n/a (drops > 5 points)" if v is None else f"{v:.1f}") for k, v in aup.items()}
    lines += ["", f"AUP (y_max = {summary['aup_max_accuracy']:.1f} %): before {fmt['before']}, after {fmt['after']}"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ arguments, main
def comma_floats(text: str) -> list[float]:
    """An argparse type: ``"0.9,0.7"`` → ``[0.9, 0.7]``."""
    return [float(x) for x in text.split(",") if x.strip()]


def comma_ints(text: str) -> list[int]:
    """An argparse type: ``"0,1,2"`` → ``[0, 1, 2]``."""
    return [int(x) for x in text.split(",") if x.strip()]


def add_stage_options(p: argparse.ArgumentParser, *, sft_steps: int, sft_batch: int, sft_fill_weight: float,
                      distill_steps: int) -> None:
    """The options of the stages ``examples/distill_chat.py`` shares with this example (each script its defaults):
    :func:`sft`, :func:`distil`, the decoding grid of :func:`settings` and the learned commit rule of
    :func:`commit_rule_settings`."""
    p.add_argument("--sft-steps", type=int, default=sft_steps, help="SFT updates (at most; see --sft-seconds)")
    p.add_argument("--sft-seconds", type=float, default=0.0, help="stop SFT after this wall time (0: no limit)")
    p.add_argument("--sft-batch", type=int, default=sft_batch)
    p.add_argument("--sft-lr", type=float, default=1e-4)
    p.add_argument("--sft-fill-weight", type=float, default=sft_fill_weight,
                   help="weight of the EOS fill after each answer's first EOS in the SFT loss (1: all scored, "
                        "LLaDA's SFT; docs/guides/parallel-decoding.md)")
    p.add_argument("--distill-steps", type=int, default=distill_steps,
                   help="distillation updates (at most; --train-seconds)")
    p.add_argument("--train-seconds", type=float, default=0.0, help="stop distillation after this wall time")
    p.add_argument("--distill-batch", type=int, default=4, help="trajectories per update (each gives 2 views)")
    p.add_argument("--distill-lr", type=float, default=2e-5,
                   help="distillation learning rate (AdamW; why 2e-5: docs/guides/parallel-decoding.md)")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank R (0: distil the whole model)")
    p.add_argument("--per-block", action="store_true",
                   help="one pseudo-trajectory state per block, every block of a trajectory scored in one forward "
                        "(default: one per trajectory, d3LLM's view: one block scored)")
    p.add_argument("--entropy-weight", type=float, default=2.0, help="certainty forcing's λ (dParallel: 2)")
    p.add_argument("--entropy-temperature", type=float, default=0.5, help="certainty forcing's T (dParallel: 0.5)")
    p.add_argument("--thresholds", type=comma_floats, default=[0.9, 0.7, 0.5], help="ConfidenceThreshold τ's")
    p.add_argument("--forced", type=comma_ints, default=[], help="tokens forced per forward (K/k steps per block)")
    p.add_argument("--commit-rule", type=comma_floats, default=[0.9, 0.7],
                   help="τ's of Learn2PD's learned commit rule (LearnedCommit), fitted on the model of each phase "
                        "(empty: none)")
    p.add_argument("--commit-rule-steps", type=int, default=300, help="training steps of the commit rule's head")
    p.add_argument("--oracle", action="store_true",
                   help="also decode with OracleCommit on each phase's own one-token-per-forward decode: the tokens "
                        "per forward of a perfect learned commit rule (a ceiling, not a decoder; left out of AUP)")


def check_stage_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks of :func:`add_stage_options`' values (``p.error`` on a bad one); ``--forced`` against
    ``args.block_size``."""
    for name in ("sft_batch", "distill_batch", "commit_rule_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    for name in ("sft_steps", "sft_seconds", "sft_fill_weight", "distill_steps", "train_seconds", "lora",
                 "entropy_weight"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')}: expected a non-negative number, got {getattr(args, name)}")
    if not args.entropy_temperature > 0:
        p.error(f"--entropy-temperature: expected a positive float, got {args.entropy_temperature}")
    bad = [k for k in args.forced if k < 2 or args.block_size % k]
    if bad:
        p.error(f"--forced: expected divisors of --block-size {args.block_size} above 1, got {bad}")
    for name in ("thresholds", "commit_rule"):
        if any(not 0 < t < 1 for t in getattr(args, name)):
            p.error(f"--{name.replace('_', '-')}: expected values in (0, 1), got {getattr(args, name)}")


def write_report(out: Path, report: dict[str, Any], text: str, args: argparse.Namespace) -> None:
    """``report`` (with the machine it ran on) as ``out/report.json`` and ``text`` as ``out/report.md``."""
    report["machine"] = {"device": str(args.device), "cpu": platform.processor() or platform.machine(),
                         "threads": torch.get_num_threads(), "dtype": "float32", "torch": torch.__version__}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(text + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' (random 2-layer Llama) or a HF folder")
    p.add_argument("--block-size", type=int, default=8, help="K, the block model's block size")
    p.add_argument("--count", type=int, default=5, help="numbers per sort problem")
    p.add_argument("--digits", type=int, default=1, help="digits per number")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="completion length (default: the answer and EOS rounded up to whole blocks)")
    add_stage_options(p, sft_steps=60, sft_batch=8, sft_fill_weight=1.0, distill_steps=80)
    p.add_argument("--record-problems", type=int, default=96, help="train problems the teacher decodes")
    p.add_argument("--keep", choices=("correct", "all"), default="correct",
                   help="recorded answers kept: the verified-correct ones (d3LLM) or all")
    p.add_argument("--commit-rule-problems", type=int, default=32,
                   help="train problems whose decodes fit the commit rule's head")
    p.add_argument("--eval-problems", type=int, default=64, help="held-out problems (the same for every seed)")
    p.add_argument("--eval-batch", type=int, default=32, help="rows per decoding call (accuracy, tokens per forward "
                   "and the first wall-time column)")
    p.add_argument("--wall-problems", type=int, default=16,
                   help="held-out problems also decoded one at a time (batch 1, the anchors' latency setting) for "
                        "the batch-1 wall-time columns, block and AR models alike (0: none)")
    p.add_argument("--backend", choices=("auto", "compiled", "eager"), default="auto",
                   help="unifusion's loss/sampler backend (uf.backend.set_backend)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=comma_ints, default=[0, 1, 2], help="--report: the seeds")
    p.add_argument("--report", action="store_true", help="run every seed of --seeds")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default="unifusion-distill", help="output folder (report.json, report.md, frontier.png)")
    args = p.parse_args(argv)
    for name in ("block_size", "record_problems", "eval_problems", "eval_batch", "log_every",
                 "commit_rule_problems"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    if args.wall_problems < 0:
        p.error(f"--wall-problems: expected a non-negative number, got {args.wall_problems}")
    check_stage_options(p, args)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    answer = sorting.answer_length(args.count, args.digits) + 1  # characters = tokens (one per digit and comma)
    if args.max_new_tokens is None:
        args.max_new_tokens = -(-answer // args.block_size) * args.block_size
    if args.max_new_tokens < answer:
        p.error(f"--max-new-tokens: expected at least the answer and EOS ({answer} tokens), got {args.max_new_tokens}")
    return args


def batch1_text(result: dict[str, Any]) -> str:
    """The log's batch-1 part of a result (empty without ``--wall-problems``)."""
    if "seconds_batch1" not in result:
        return ""
    return (f" | {result['seconds_batch1']:.2f} s (batch 1, {result['problems_batch1']} problems, "
            f"{result['tokens_per_forward_batch1']:.2f} tok/fwd)")


def run_seed(args: argparse.Namespace, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    torch.manual_seed(seed)
    model, tokenizer = build(args, seed)
    train = sorting.make_problems(max(args.record_problems, args.sft_steps * args.sft_batch), seed, "train",
                                  count=args.count, digits=args.digits)
    test = sorting.make_problems(args.eval_problems, 0, "test", count=args.count, digits=args.digits)
    rows = batches(tokenizer, test, args)
    log(f"--- seed {seed}: SFT")
    sft_info = sft(model, tokenizer, train, args, seed, log)
    rule_problems = train[-args.record_problems:][:args.commit_rule_problems]
    learned, rule_before = commit_rule_settings(model, tokenizer, rule_problems, args, seed)
    grid = settings(args)
    single = [([c[r]], *encode_prompts(tokenizer, [c[r].prompt], args.block_size))
              for c, _, _ in rows for r in range(len(c))][:args.wall_problems]
    before, packing_before = evaluate_phase(model, tokenizer, rows, single, grid + learned, args)
    for r in before:
        log(f"before | {r['setting']:<28} | acc {r['accuracy']:5.1f} % | {r['tokens_per_forward']:.2f} tok/fwd | "
            f"{r['seconds']:.2f} s (batch {args.eval_batch}){batch1_text(r)}")
    traj, record_info = record(model, tokenizer, train[-args.record_problems:], args)
    log(f"recorded {record_info['kept']} of {record_info['problems']} trajectories ({args.keep})")
    distill_info = distil(model, traj, args, seed, log)
    learned, rule_after = commit_rule_settings(model, tokenizer, rule_problems, args, seed)
    after, packing_after = evaluate_phase(model, tokenizer, rows, single, grid + learned, args)
    for r in after:
        log(f"after  | {r['setting']:<28} | acc {r['accuracy']:5.1f} % | {r['tokens_per_forward']:.2f} tok/fwd | "
            f"{r['seconds']:.2f} s (batch {args.eval_batch}){batch1_text(r)}")
    del model
    ar_model = load(args, seed)[0].to(args.device)
    ar = evaluate_ar_all(ar_model, tokenizer, rows, single, args)
    log(f"AR     | acc {ar['accuracy']:5.1f} % | {ar['seconds']:.2f} s (batch {args.eval_batch})"
        + (f" | {ar['seconds_batch1']:.2f} s (batch 1, {len(single)} problems; packed "
           f"{ar['seconds_batch1_packed']:.2f} s)" if single else ""))
    return {"seed": seed, "sft": sft_info, "record": record_info, "distill": distill_info, "before": before,
            "after": after, "ar": ar, "packing_seconds": {"before": packing_before, "after": packing_after},
            "commit_rule": {"before": rule_before, "after": rule_after}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the pipeline; write and return the report."""
    args = parse_args(argv)
    uf.backend.set_backend(args.backend)

    def log(line: str) -> None:
        print(line, flush=True)

    seeds = args.seeds if args.report else [args.seed]
    log(f"model {args.model}, K = {args.block_size}, sort {args.count}×{args.digits} digits, "
        f"{'LoRA r = ' + str(args.lora) if args.lora else 'full'} distillation, seeds {seeds}, "
        f"{args.device}, {torch.get_num_threads()} threads, float32")
    t0 = time.perf_counter()
    runs = [run_seed(args, seed, log) for seed in seeds]
    summary = summarise(runs)
    text = table(summary, args, seeds)
    print(text, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = uf.eval.plot_parallelism({f"{phase} distillation": curve for phase, curve in summary["curves"].items()},
                                   out / "frontier.png", max_accuracy=max(summary["aup_max_accuracy"], 1e-9),
                                   title=f"sort, {args.model}, K = {args.block_size}")
    report = {"args": vars(args), "seeds": seeds, "runs": runs, "summary": summary, "table": text,
              "frontier_png": str(png), "seconds": time.perf_counter() - t0}
    write_report(out, report, text, args)
    log(f"wrote {out / 'report.json'}, {out / 'report.md'}, {png}")
    return report


if __name__ == "__main__":
    main()
