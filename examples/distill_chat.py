"""Distil a block-diffusion chat model to decode several tokens per forward, judged by text quality: SFT on the bundled
chat set → record → distil → GenPPL, unigram entropy and tokens per forward on its held-out prompts, one command.

The chat counterpart of ``examples/distill_parallel.py`` (whose stages it reuses; that example measures accuracy on a
verifiable task, this one measures text): the issue's second goal, "on the bundled chat prompts (greedy): ≥ 2.5
tokens per forward with GenPPL ≤ 1.2× the undistilled model's and unigram entropy within 5 %".

Per seed:

1. **SFT** (``--sft-steps`` updates of ``--sft-batch`` rows): SmolLM2-135M-Instruct adapted to blocks of K
   (``uf.adapt_ar_model(..., block_size=K)``) trained with the prompt-masked diffusion loss on the bundled chat set's
   train split (``unifusion.chat.load_python_docs_chats("train")``: each conversation's last assistant answer + EOS,
   ``<|im_end|>``, is the completion; everything before it, rendered with the chat template and its generation
   prompt, is the prompt, left-padded to a multiple of K so that the completion starts a block exactly where the
   decoder starts it). Conversations whose answer and EOS do not fit ``--max-new-tokens`` are left out. The EOS
   fill after each answer's first EOS counts ``--sft-fill-weight`` times (0.1: the answers are short — about 22
   tokens of 40 — and a fully scored fill teaches the model that EOS is likely everywhere, so the one-token
   decode answers a word and stops).
2. **record** (``--record-prompts`` train prompts): the SFT model's own greedy decodes, one token per forward
   (``LowConfidence``, K steps per block), with their commit steps (:func:`unifusion.distill.record_trajectories`);
   all are kept (text has no verifier), or with ``--keep-ppl X`` those whose answer has perplexity ≤ X under the
   original AR model (the judge standing in for d3LLM's verifier).
3. **distil** (``--distill-steps`` updates of ``--distill-batch`` trajectories): ``distil`` of
   ``examples/distill_parallel.py`` — :func:`unifusion.distill.distillation_loss`, d3LLM's pseudo-trajectory mask and
   its complement, dParallel's certainty forcing (``--entropy-weight``, ``--entropy-temperature``), the whole model
   or ``--lora R``.
4. **evaluate**, before and after distillation, on the held-out prompts (``load_python_docs_chats("test")``, 17),
   greedy, the exact KV cache with merged commits: one token per forward (``LowConfidence``, K steps per block),
   ``ConfidenceThreshold(τ)`` for each ``--thresholds`` τ and Learn2PD's learned commit rule ``LearnedCommit(head, τ)``
   for each ``--commit-rule`` τ (its head fitted on that phase's frozen model's decodes of ``--commit-rule-prompts``
   train prompts) and, with ``--oracle``, :class:`~unifusion.distill.OracleCommit` on each batch's own
   one-token-per-forward decode (what a perfect learned rule would reach; never "the goal"). Per setting: tokens per
   forward (generated tokens up to and including EOS over model calls), GenPPL of the answers under the original AR
   model (:func:`unifusion.eval.generative_perplexity`), the mean unigram entropy of their GPT-2 tokens
   (:func:`unifusion.eval.unigram_entropy`, as ``unifusion demo``), and both relative to **the undistilled model at one
   token per forward** (the goal's reference). The AR model's own greedy ``generate`` on the same prompts (stopped at
   EOS) is reported beside them.

``OUT/report.json`` holds every number and every answer; ``OUT/report.md`` the table.

CPU smoke run (tiny random model)::

    python examples/distill_chat.py --model tiny --sft-steps 2 --distill-steps 2 --record-prompts 4 \\
        --eval-prompts 4 --commit-rule-prompts 2 --commit-rule-steps 3 --out /tmp/uf-distill-chat

SmolLM2-135M-Instruct (K = 8), the measurement of docs/guides/parallel-decoding.md ("On the bundled chat prompts")::

    python examples/distill_chat.py --report --seeds 0 --out runs/distill-chat
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill_parallel import (  # noqa: E402
    Setting,
    add_stage_options,
    build,
    check_stage_options,
    comma_ints,
    commit_rule_settings,
    decode,
    distil,
    encode_prompts,
    evaluate_grid,
    load,
    record,
    settings,
    sft,
    texts_and_lengths,
    write_report,
)

import unifusion as uf  # noqa: E402
from unifusion.chat import load_python_docs_chats  # noqa: E402
from unifusion.cpu_linears import packed_linears  # noqa: E402
from unifusion.distill import RewardFn  # noqa: E402


@dataclass(frozen=True)
class ChatPrompt:
    """One conversation cut before its last assistant answer: ``prompt`` (the rendered context with the generation
    prompt) and ``completion`` (that answer's text)."""

    prompt: str
    completion: str


def chat_prompts(tokenizer: Any, split: Literal["train", "test"], width: int) -> list[ChatPrompt]:
    """The bundled chat set's ``split`` as prompts and answers; an answer whose tokens and EOS exceed ``width`` is
    left out."""
    out = []
    for conversation in load_python_docs_chats(split):
        prompt = tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=True, tokenize=False)
        answer = conversation[-1]["content"]
        if len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1 <= width:
            out.append(ChatPrompt(prompt, answer))
    return out


# ------------------------------------------------------------------------------------------------ evaluation
@dataclass
class Judge:
    """The original AR model and what scores text: GenPPL under it, unigram entropy over GPT-2 tokens."""

    model: Any
    tokenizer: Any
    entropy_tokenizer: Any

    def score(self, texts: list[str]) -> dict[str, float]:
        scored = [t for t in texts if t.strip()]
        genppl = (float(uf.eval.generative_perplexity(scored, self.model, self.tokenizer, progress=False))
                  if scored else math.nan)
        entropy = float(uf.eval.unigram_entropy(uf.eval.retokenize(texts, self.entropy_tokenizer)).mean())
        return {"genppl": genppl, "entropy": entropy, "empty_answers": len(texts) - len(scored)}

    def perplexities(self, texts: list[str]) -> list[float]:
        """Each text's own perplexity under the AR model (``inf`` for an empty text)."""
        scored = [i for i, t in enumerate(texts) if t.strip()]
        out = [math.inf] * len(texts)
        if scored:
            result = uf.eval.generative_perplexity([texts[i] for i in scored], self.model, self.tokenizer,
                                                   progress=False)
            for i, nll, n in zip(scored, result.per_sample_nll, result.per_sample_tokens):
                out[i] = math.exp(nll / n) if n else math.inf
        return out

    def keeps_likely(self, limit: float) -> RewardFn:
        """A recording filter (``record_trajectories``' ``reward_fn``): keep a decode whose answer has perplexity at
        most ``limit`` under the AR model — the judge standing in for the verifier text does not have; an empty
        answer is never kept."""
        def keep(prompts: list[list[int]], completions: list[list[int]]) -> list[bool]:
            texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
            return [math.isfinite(ppl) and ppl <= limit for ppl in self.perplexities(texts)]
        return keep


@torch.no_grad()
def evaluate(model: uf.DiffusionLM, tokenizer: Any, batches: list[tuple[Any, ...]], setting: Setting,
             judge: Judge, args: argparse.Namespace, references: list[torch.Tensor] | None = None
             ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Greedy decoding of the held-out prompts at one setting: ``(result, sequences)``; ``result``: tokens per
    forward, GenPPL, entropy, answers; ``sequences``: each batch's ``(B, P + N)`` output, what an oracle setting
    takes as ``references`` from the one-token-per-forward setting."""
    model.eval()
    if references is not None and len(references) != len(batches):
        raise ValueError(f"references: one decode per batch ({len(batches)}), got {len(references)}")
    texts: list[str] = []
    sequences: list[torch.Tensor] = []
    tokens = forwards = 0
    seconds = 0.0
    for i, (_, ids, mask) in enumerate(batches):
        out, dt = decode(model, tokenizer, ids, mask, setting, args,
                         reference=None if references is None else references[i])
        sequences.append(out.sequences)
        seconds += dt
        batch_texts, lengths = texts_and_lengths(tokenizer, out.sequences[:, ids.shape[1]:])
        texts += batch_texts
        tokens += sum(lengths)
        forwards += int(out.num_forwards.sum())
    result = {"setting": setting.name, "oracle": setting.oracle, "steps_per_block": setting.num_steps,
              "tokens": tokens, "forwards": forwards,
              "tokens_per_forward": tokens / forwards, "seconds": seconds, **judge.score(texts), "answers": texts}
    return result, sequences


def evaluate_phase(model: uf.DiffusionLM, tokenizer: Any, batches: list[tuple[Any, ...]], grid: list[Setting],
                   judge: Judge, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every setting of ``grid`` (:func:`evaluate_grid`: the oracle reuses the one-token decode), linears packed."""
    with packed_linears(model):
        return evaluate_grid(grid, args.block_size,
                             lambda s, refs: evaluate(model, tokenizer, batches, s, judge, args, refs))


@torch.no_grad()
def evaluate_ar(judge: Judge, batches: list[tuple[Any, ...]], args: argparse.Namespace) -> dict[str, Any]:
    """The AR model's own greedy ``generate`` (KV cache) on the same prompts, stopped at EOS."""
    texts: list[str] = []
    tokens = 0
    for _, ids, mask in batches:
        out = judge.model.generate(ids.to(args.device), attention_mask=mask.to(args.device), do_sample=False,
                                   max_new_tokens=args.max_new_tokens, pad_token_id=judge.tokenizer.eos_token_id,
                                   eos_token_id=judge.tokenizer.eos_token_id)
        batch_texts, lengths = texts_and_lengths(judge.tokenizer, out[:, ids.shape[1]:])
        texts += batch_texts
        tokens += sum(lengths)
    return {"setting": "HF AR generate + KV cache (not fine-tuned)", "tokens": tokens, "tokens_per_forward": 1.0,
            **judge.score(texts), "answers": texts}


def relative(results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """Each result's GenPPL and entropy over the reference's (in place: ``x_genppl``, ``x_entropy``; NaN where the
    reference is 0 or NaN: its answers were all empty)."""
    def ratio(value: float, base: float) -> float:
        return value / base if base > 0 else math.nan

    for r in results:
        r["x_genppl"] = ratio(r["genppl"], reference["genppl"])
        r["x_entropy"] = ratio(r["entropy"], reference["entropy"])


def goal_met(result: dict[str, Any], args: argparse.Namespace) -> bool:
    """The issue's chat goal at one setting: tokens per forward ≥ ``--goal-tokens-per-forward``, GenPPL ≤
    ``--goal-genppl``× and unigram entropy within ``--goal-entropy``·100 % of the undistilled model's (never at the
    oracle ceiling: it reads the answer)."""
    return (not result.get("oracle", False) and result["tokens_per_forward"] >= args.goal_tokens_per_forward
            and result["x_genppl"] <= args.goal_genppl and abs(result["x_entropy"] - 1.0) <= args.goal_entropy)


def run_seed(args: argparse.Namespace, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    torch.manual_seed(seed)
    model, tokenizer = build(args, seed)
    train = chat_prompts(tokenizer, "train", args.max_new_tokens)
    test = chat_prompts(tokenizer, "test", args.max_new_tokens)[:args.eval_prompts]
    batches = [(chunk, *encode_prompts(tokenizer, [r.prompt for r in chunk], args.block_size))
               for chunk in (test[s:s + args.eval_batch] for s in range(0, len(test), args.eval_batch))]
    judge_model = load(args, seed)[0].to(args.device).eval()
    judge = Judge(judge_model, tokenizer, uf.eval.gpt2_tokenizer())
    log(f"--- seed {seed}: SFT on {len(train)} conversations")
    sft_info = sft(model, tokenizer, train, args, seed, log)
    recorded_rows = train[-args.record_prompts:]
    rule_rows = recorded_rows[:args.commit_rule_prompts]
    # commit_rule_settings reads each row's .prompt only: a ChatPrompt serves as a sort problem there
    learned, rule_before = commit_rule_settings(model, tokenizer, rule_rows, args, seed)
    grid = settings(args)
    before = evaluate_phase(model, tokenizer, batches, grid + learned, judge, args)
    traj, record_info = record(model, tokenizer, recorded_rows, args,
                               reward_fn=judge.keeps_likely(args.keep_ppl) if args.keep_ppl else None)
    record_info["keep_ppl"] = args.keep_ppl or None
    log(f"recorded {record_info['problems']} decodes, kept {record_info['kept']} ({record_info['seconds']:.0f} s)")
    distill_info = distil(model, traj, args, seed, log)
    learned, rule_after = commit_rule_settings(model, tokenizer, rule_rows, args, seed)
    after = evaluate_phase(model, tokenizer, batches, grid + learned, judge, args)
    ar = evaluate_ar(judge, batches, args)
    reference = before[0]  # the undistilled model, one token per forward
    relative(before + after + [ar], reference)
    for phase, results in (("before", before), ("after", after)):
        for r in results:
            r["goal_met"] = goal_met(r, args)
            log(f"{phase:<6} | {r['setting']:<24} | {r['tokens_per_forward']:.2f} tok/fwd | GenPPL {r['genppl']:.1f} "
                f"({r['x_genppl']:.2f}×) | entropy {r['entropy']:.3f} ({r['x_entropy']:.3f}×)"
                + (" | goal met" if r["goal_met"] else ""))
    log(f"AR     | GenPPL {ar['genppl']:.1f} ({ar['x_genppl']:.2f}×) | entropy {ar['entropy']:.3f}")
    return {"seed": seed, "sft": sft_info, "record": record_info, "distill": distill_info, "before": before,
            "after": after, "ar": ar, "commit_rule": {"before": rule_before, "after": rule_after},
            "eval_prompts": len(test)}


def table(runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Per phase and setting, the seeds' means; ratios to each seed's undistilled one-token-per-forward decode."""
    n = runs[0]["eval_prompts"]
    lines = [f"bundled chat set, {n} held-out prompts, greedy, K = {args.block_size}, seeds "
             f"{[r['seed'] for r in runs]}, {torch.get_num_threads()} thread(s); × : relative to the undistilled "
             "model at one token per forward; goal: ≥ "
             f"{args.goal_tokens_per_forward:g} tokens/forward, GenPPL ≤ {args.goal_genppl:g}×, entropy within "
             f"{100 * args.goal_entropy:g} %", "",
             "| phase | decoding | tokens / forward | GenPPL | × GenPPL | unigram entropy | × entropy | goal |",
             "|---|---|---:|---:|---:|---:|---:|---|"]

    def mean(phase: str, i: int, key: str) -> float:
        return statistics.mean(r[phase][i][key] for r in runs)

    for phase in ("before", "after"):
        for i, first in enumerate(runs[0][phase]):
            met = sum(r[phase][i]["goal_met"] for r in runs)
            lines.append(f"| {phase} | {first['setting']} | {mean(phase, i, 'tokens_per_forward'):.2f} | "
                         f"{mean(phase, i, 'genppl'):.1f} | {mean(phase, i, 'x_genppl'):.2f} | "
                         f"{mean(phase, i, 'entropy'):.3f} | {mean(phase, i, 'x_entropy'):.3f} | "
                         f"{met}/{len(runs)} |")
    ar = [r["ar"] for r in runs]
    lines.append(f"| — | HF AR generate + KV cache | 1.00 | {statistics.mean(a['genppl'] for a in ar):.1f} | "
                 f"{statistics.mean(a['x_genppl'] for a in ar):.2f} | {statistics.mean(a['entropy'] for a in ar):.3f} "
                 f"| {statistics.mean(a['x_entropy'] for a in ar):.3f} | |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ arguments, main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' (random 2-layer Llama) or a HF folder")
    p.add_argument("--block-size", type=int, default=8, help="K, the block model's block size")
    p.add_argument("--max-new-tokens", type=int, default=40,
                   help="completion length: answers with their EOS longer than this are left out of training")
    add_stage_options(p, sft_steps=50, sft_batch=4, sft_fill_weight=0.1, distill_steps=60)
    p.add_argument("--record-prompts", type=int, default=96, help="train prompts the teacher decodes")
    p.add_argument("--keep-ppl", type=float, default=0.0,
                   help="keep a recorded decode only if its answer's perplexity under the original AR model is at "
                        "most this (0: keep every decode)")
    p.add_argument("--commit-rule-prompts", type=int, default=32,
                   help="train prompts whose decodes fit the commit rule's head")
    p.add_argument("--eval-prompts", type=int, default=17, help="held-out prompts (at most the 17 of the set)")
    p.add_argument("--eval-batch", type=int, default=32, help="rows per decoding call")
    p.add_argument("--goal-tokens-per-forward", type=float, default=2.5)
    p.add_argument("--goal-genppl", type=float, default=1.2, help="GenPPL at most this × the undistilled model's")
    p.add_argument("--goal-entropy", type=float, default=0.05, help="unigram entropy within this fraction")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=comma_ints, default=[0], help="--report: the seeds")
    p.add_argument("--report", action="store_true", help="run every seed of --seeds")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default="unifusion-distill-chat", help="output folder (report.json, report.md)")
    args = p.parse_args(argv)
    for name in ("block_size", "max_new_tokens", "record_prompts", "eval_prompts", "eval_batch",
                 "log_every", "commit_rule_prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    if args.keep_ppl < 0:
        p.error(f"--keep-ppl: expected a non-negative number, got {args.keep_ppl}")
    check_stage_options(p, args)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.keep = "all"  # distill_parallel.record: text has no verifier, every decode is kept
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the pipeline; write and return the report."""
    args = parse_args(argv)

    def log(line: str) -> None:
        print(line, flush=True)

    seeds = args.seeds if args.report else [args.seed]
    log(f"model {args.model}, K = {args.block_size}, bundled chat set, "
        f"{'LoRA r = ' + str(args.lora) if args.lora else 'full'} distillation, seeds {seeds}, {args.device}, "
        f"{torch.get_num_threads()} threads, float32")
    t0 = time.perf_counter()
    runs = [run_seed(args, seed, log) for seed in seeds]
    text = table(runs, args)
    print(text, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args), "seeds": seeds, "runs": runs, "table": text, "seconds": time.perf_counter() - t0}
    write_report(out, report, text, args)
    log(f"wrote {out / 'report.json'}, {out / 'report.md'}")
    return report


if __name__ == "__main__":
    main()
