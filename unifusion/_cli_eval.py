"""``unifusion eval``: its subcommands ``genppl``, ``frontier``, ``mc`` and ``nll`` (each an ``_add_<name>`` that
builds its parser and a ``cmd_eval_<name>`` that runs it); :func:`add_eval` adds the group to the ``unifusion``
parser."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

from ._cli_common import (
    HelpFormatter,
    dtype_name,
    entropy_tokenizer,
    judge_args,
    load_judge,
    load_model,
    model_args,
    non_negative_int,
    positive_int,
    print_table,
    read_texts,
    resolve_device,
    sampler_args,
    write_json,
)

__all__ = ["EVAL_COMMANDS", "add_eval"]


# ---------------------------------------------------------------------------------------------------------------
# eval genppl


def _add_eval_genppl(sub: Any) -> None:
    p = sub.add_parser("genppl", formatter_class=HelpFormatter,
                       help="generative perplexity (and unigram entropy) of texts",
                       description="GenPPL of texts under a judge LM (App. C.3), pooled over all tokens, and the "
                                   "mean unigram entropy of the texts retokenized with GPT-2's tokenizer.")
    p.add_argument("--texts", required=True, help=".jsonl with a 'text' field per line, or a text file, one per line")
    judge_args(p)
    p.add_argument("--max-length", type=positive_int, default=None,
                   help="judge context in tokens (default: the judge's own)")
    p.add_argument("--entropy-tokenizer", default="gpt2", help="'gpt2', 'judge', or a tokenizer folder")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    p.add_argument("--out", default=None, help="write the result to this .json file (default: print only)")
    p.set_defaults(func=cmd_eval_genppl)


def cmd_eval_genppl(args: argparse.Namespace) -> int:
    from .eval import generative_perplexity, unigram_entropy

    texts = read_texts(args.texts)
    judge, judge_tok = load_judge(args)
    res = generative_perplexity(texts, judge, judge_tok, batch_size=args.judge_batch_size,
                                max_length=args.max_length, progress=sys.stderr.isatty())
    ent_tok = entropy_tokenizer("model" if args.entropy_tokenizer == "judge" else args.entropy_tokenizer, judge_tok)
    H = unigram_entropy([list(r) for r in ent_tok(texts, add_special_tokens=False)["input_ids"]])
    rows = [("texts", f"{len(texts)}"), ("scored tokens", f"{res.num_tokens}"),
            ("NLL / token (nats)", f"{res.mean_nll:.4f}"), ("GenPPL", f"{res.perplexity:.3f}"),
            ("mean unigram entropy (nats)", f"{float(H.mean()):.4f}")]
    print_table(rows)
    write_json(args.out, {"genppl": res.perplexity, "total_nll": res.total_nll, "num_tokens": res.num_tokens,
                           "mean_entropy": float(H.mean()), "num_texts": len(texts), "judge": args.judge,
                           "texts": args.texts})
    return 0


# ---------------------------------------------------------------------------------------------------------------
# eval frontier


def _add_eval_frontier(sub: Any) -> None:
    from .eval.frontier import DEFAULT_SEEDS, DEFAULT_STEPS

    p = sub.add_parser("frontier", formatter_class=HelpFormatter,
                       help="GenPPL–entropy frontier over steps and seeds",
                       description="App. C.3's frontier: per steps and seed, sample, score GenPPL with the judge and "
                                   "unigram entropy; write CSV/JSON/samples/PNG to --out.")
    model_args(p)
    judge_args(p)
    sampler_args(p)
    p.add_argument("--steps", type=positive_int, nargs="+", default=list(DEFAULT_STEPS),
                   help="sampling step counts")
    p.add_argument("--seeds", type=non_negative_int, nargs="+", default=list(DEFAULT_SEEDS),
                   help="seeds, one run per steps and seed")
    p.add_argument("--label", default="model", help="curve name and file prefix")
    p.add_argument("--entropy-tokenizer", default="gpt2", help="'gpt2', 'model', or a tokenizer folder")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=cmd_eval_frontier)


def cmd_eval_frontier(args: argparse.Namespace) -> int:
    from .eval import frontier

    model, tok, kernel = load_model(args)
    judge, judge_tok = load_judge(args)
    kw: dict[str, Any] = {"temperature": args.temperature}
    if args.top_p is not None:
        kw["top_p"] = args.top_p
    res = frontier(model, kernel, steps=args.steps, seeds=args.seeds, num_samples=args.num_samples,
                   seq_len=args.seq_len, judge_model=judge, judge_tokenizer=judge_tok, tokenizer=tok,
                   sampler=args.sampler, out_dir=args.out, label=args.label, batch_size=args.batch_size,
                   judge_batch_size=args.judge_batch_size, entropy_tokenizer=entropy_tokenizer(
                       args.entropy_tokenizer, tok), sampler_kwargs=kw, progress=sys.stderr.isatty())
    print(res.table())
    for name, path in res.paths.items():
        print(f"wrote {name}: {path}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# eval mc


def _add_eval_mc(sub: Any) -> None:
    p = sub.add_parser("mc", formatter_class=HelpFormatter,
                       help="zero-shot multiple-choice accuracy on a BIG-bench task.json",
                       description="Accuracy on a BIG-bench-style task (App. C.4): the diffusion score, Fair-PMI, "
                                   "or the AR log-likelihood baseline.")
    model_args(p)
    p.add_argument("--task", required=True, help="path to a BIG-bench task.json")
    p.add_argument("--method", choices=("score", "fair_pmi", "ar"), default="score",
                   help="diffusion span score, Fair-PMI, or the AR log-likelihood baseline")
    p.add_argument("--num-times", type=positive_int, default=None,
                   help="time-grid size K (default: 32 for score, 128 for fair_pmi)")
    p.add_argument("--max-examples", type=positive_int, default=None, help="score only the first N (default: all)")
    p.add_argument("--max-length", type=positive_int, default=512, help="context + answer length in tokens")
    p.add_argument("--batch-size", type=positive_int, default=64, help="sequences per forward pass")
    p.add_argument("--ar-reduction", choices=("sum", "mean"), default="sum",
                   help="AR baseline: summed or per-token log-likelihood")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the corruption noise")
    p.add_argument("--out", default=None, help="write the result to this .json file (default: print only)")
    p.set_defaults(func=cmd_eval_mc)


def cmd_eval_mc(args: argparse.Namespace) -> int:
    from .eval import run_multiple_choice
    from .hf.loading import load_causal_lm

    if args.method == "ar":
        device = resolve_device(args.device)
        model, tok = load_causal_lm(args.model, gguf_file=args.gguf_file, dtype=dtype_name(args.dtype, device),
                                    device=device)
        if args.tokenizer is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(args.tokenizer)
        kernel = None
    else:
        model, tok, kernel = load_model(args)
    res = run_multiple_choice(args.task, model, kernel, tok, method=args.method, max_examples=args.max_examples,
                              num_times=args.num_times, seed=args.seed, batch_size=args.batch_size,
                              max_length=args.max_length, ar_reduction=args.ar_reduction,
                              progress=sys.stderr.isatty())
    print_table([("task", args.task), ("method", args.method), ("examples", f"{res.num_examples}"),
                  ("correct", f"{res.num_correct}"), ("accuracy", f"{100 * res.accuracy:.2f}%")])
    write_json(args.out, {**res.to_dict(), "task": args.task, "model": args.model})
    return 0


# ---------------------------------------------------------------------------------------------------------------
# eval nll


def _add_eval_nll(sub: Any) -> None:
    p = sub.add_parser("nll", formatter_class=HelpFormatter,
                       help="upper bound on the NLL of texts (Proposition 3.2)",
                       description="Per-token upper bound on −log p_θ(x) from the master objective + C_ELBO, "
                                   "estimated with stratified times; texts are tokenized and cut into --seq-len "
                                   "blocks (the last block of each text is right-padded).")
    model_args(p)
    p.add_argument("--texts", required=True, help=".jsonl with a 'text' field per line, or a text file")
    p.add_argument("--seq-len", type=positive_int, default=128, help="block length in tokens")
    p.add_argument("--num-times", type=positive_int, default=128, help="stratified times K per block")
    p.add_argument("--batch-size", type=positive_int, default=8, help="blocks per forward pass")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the times and corruption noise")
    p.add_argument("--out", default=None, help="write the result to this .json file (default: print only)")
    p.set_defaults(func=cmd_eval_nll)


def cmd_eval_nll(args: argparse.Namespace) -> int:
    import torch

    from ._device import host_to_device
    from .eval import nll_bound

    model, tok, kernel = load_model(args)
    device = next(model.parameters()).device
    texts = read_texts(args.texts)
    blocks: list[list[int]] = []
    for ids in tok(texts, add_special_tokens=False)["input_ids"]:
        blocks += [list(ids[k: k + args.seq_len]) for k in range(0, len(ids), args.seq_len)]
    if not blocks:
        raise ValueError("--texts: the texts tokenize to nothing")
    generator = torch.Generator(device=device).manual_seed(args.seed)
    # the batches go to the device pinned and non-blocking, their bounds add up there: one read back at the end
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for k in range(0, len(blocks), args.batch_size):
        batch = blocks[k: k + args.batch_size]
        width = max(len(b) for b in batch)
        x0 = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for b, ids in enumerate(batch):
            x0[b, : len(ids)] = torch.tensor(ids)
            mask[b, : len(ids)] = 1
        padded = any(len(ids) < width for ids in batch)  # known on the host
        x0, mask = host_to_device(x0, device), host_to_device(mask, device)
        bound = nll_bound(model, x0, kernel, num_times=args.num_times, generator=generator,
                          attention_mask=mask if padded else None, per_token=False)
        total += bound.sum()
        count += sum(len(ids) for ids in batch)
    per_token = float(total) / count
    print_table([("blocks", f"{len(blocks)}"), ("tokens", f"{count}"), ("times K", f"{args.num_times}"),
                  ("NLL bound / token (nats)", f"{per_token:.4f}"),
                  ("perplexity bound", f"{math.exp(per_token):.3f}")])
    write_json(args.out, {"nll_bound_per_token": per_token, "perplexity_bound": math.exp(per_token),
                           "num_tokens": count, "num_blocks": len(blocks), "num_times": args.num_times})
    return 0


def add_eval(sub: Any) -> None:
    """The ``eval`` subcommand group (one subparser per entry of :data:`EVAL_COMMANDS`)."""
    p = sub.add_parser("eval", formatter_class=HelpFormatter,
                       help="evaluation: genppl, frontier, mc, nll",
                       description="Evaluation subcommands (paper §4.3, §4.4, Proposition 3.2).")
    eval_sub = p.add_subparsers(dest="eval_command", metavar="{" + ",".join(n for n, _ in EVAL_COMMANDS) + "}")
    eval_sub.required = True
    for _, add in EVAL_COMMANDS:
        add(eval_sub)


EVAL_COMMANDS: list[tuple[str, Callable[[Any], None]]] = [
    ("genppl", _add_eval_genppl), ("frontier", _add_eval_frontier), ("mc", _add_eval_mc), ("nll", _add_eval_nll)]
