"""``unifusion sample`` with prompts or a decoding policy: its options, their checks, and the run through
:meth:`DiffusionLM.generate <unifusion.hf.DiffusionLM.generate>` (left-padded prompts, the chat template, EOS
stopping, tokens per forward)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ._cli_common import positive_int
from .denoiser import DenoiserModule

__all__ = ["chat_prompts", "check_decoding_args", "decoding_args", "sample_with_generate"]


def decoding_args(p: argparse.ArgumentParser) -> None:
    """The options of ``unifusion sample`` for prompts and block decoding."""
    from .samplers.policies import POLICY_NAMES

    g = p.add_argument_group("prompts and block decoding")
    g.add_argument("--prompt", action="append", default=None,
                   help="continue this text (repeat the option for several prompts; each gets --num-samples samples, "
                        "left-padded into batches; default: none, unconditional samples)")
    g.add_argument("--chat", action="store_true",
                   help="wrap each --prompt as a user message in the tokenizer's chat template (with the assistant's "
                        "turn opened)")
    g.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="tokens to generate after a prompt (default: --seq-len)")
    g.add_argument("--top-k", type=positive_int, default=None, help="keep the k most likely tokens (default: off)")
    g.add_argument("--policy", choices=POLICY_NAMES, default=None,
                   help="decode block by block with this policy (DiffusionLM.generate(policy=...)); default: the "
                        "--sampler over the whole sequence, or for a block model low_confidence (mask kernel) / "
                        "entropy_bound (uniform kernel)")
    g.add_argument("--block-size", type=positive_int, default=None,
                   help="positions per block with --policy (a block model: its own; default: one block)")
    g.add_argument("--threshold", type=float, default=None,
                   help="the threshold policy's confidence in [0, 1] (implies --policy threshold; default 0.9)")
    g.add_argument("--cache-refresh", type=positive_int, default=None,
                   help="with --policy on a bidirectional model: the approximate dual cache, a full forward every N "
                        "steps of a block (default: no cache; block models always use their exact cache)")
    g.add_argument("--merge-commits", action="store_true",
                   help="with --policy on a block model: run each finished block within the next block's first step "
                        "(one call fewer per block, the same tokens)")
    g.add_argument("--no-eos-stop", action="store_true",
                   help="do not stop at the tokenizer's EOS token (default: a sample ends at its first EOS)")


def check_decoding_args(args: argparse.Namespace) -> None:
    """Option combinations that cannot work, before the model loads."""
    if args.threshold is not None and args.policy is None:
        args.policy = "threshold"
    if args.chat and not args.prompt:
        raise ValueError("--chat wraps --prompt texts; give at least one --prompt")
    if (args.prompt or args.policy) and args.sampler != "bayesian":
        raise ValueError("--prompt and --policy decode with DiffusionLM.generate; --sampler euler "
                         "samples unconditionally only")
    if args.policy is None and (args.block_size is not None or args.cache_refresh is not None or args.merge_commits):
        raise ValueError("--block-size, --cache-refresh and --merge-commits need --policy")


def chat_prompts(tok: Any, prompts: list[str]) -> list[str]:
    if getattr(tok, "chat_template", None) is None:
        raise ValueError("--chat needs a tokenizer with a chat template (tokenizer.chat_template is "
                         "unset); drop --chat or pass --tokenizer with one")
    return [str(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                        add_generation_prompt=True)) for text in prompts]


def sample_with_generate(args: argparse.Namespace, model: DenoiserModule, tok: Any, kernel: Any) -> int:
    """``unifusion sample`` with --prompt or --policy: DiffusionLM.generate on left-padded prompts, one generator per
    sample (seeded seed + its index: a sample does not depend on its batch), EOS stopping."""
    import torch

    from .samplers.policies import make_policy

    if tok is None:
        raise ValueError("--prompt needs a tokenizer (pass --tokenizer DIR)")
    device = next(model.parameters()).device
    policy = None if args.policy is None else make_policy(args.policy, threshold=args.threshold, arg="--policy")
    prompts = args.prompt or [""]
    texts_in = chat_prompts(tok, prompts) if args.chat else prompts
    rows = [(p, k) for p in range(len(prompts)) for k in range(args.num_samples)]
    eos = None if args.no_eos_stop else getattr(tok, "eos_token_id", None)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    new = args.max_new_tokens or args.seq_len
    if policy is None and model.block_size is not None:  # what generate would pick, named
        from .samplers.policies import default_policy

        policy = default_policy(kernel)
    label = (f"{args.policy or type(policy).__name__} policy" if policy is not None
             else f"{args.steps or 64} steps")
    records = []
    for lo in range(0, len(rows), args.batch_size):
        chunk = rows[lo: lo + args.batch_size]
        enc = tok([texts_in[p] for p, _ in chunk], padding=True, padding_side="left", return_tensors="pt",
                  add_special_tokens=not args.chat)
        ids, mask = enc["input_ids"].long(), enc["attention_mask"]
        P = ids.shape[1]
        generators = [torch.Generator(device=device).manual_seed(args.seed + lo + i) for i in range(len(chunk))]
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, policy=policy, num_steps=args.steps,
                             block_size=args.block_size, cache_refresh=args.cache_refresh,
                             merge_commits=args.merge_commits, kernel=kernel,
                             temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             eos_token_id=eos if isinstance(eos, int) else None, generator=generators,
                             return_dict=True, progress=sys.stderr.isatty())
        for i, ((p, _), row) in enumerate(zip(chunk, out.sequences[:, P:].tolist())):
            if isinstance(eos, int) and eos in row:
                row = row[: row.index(eos)]
            if kernel.mask_id is not None:
                row = [t for t in row if t != kernel.mask_id]
            records.append({"index": lo + i, "prompt": prompts[p], "seed": args.seed + lo + i,
                            "text": tok.decode(row, skip_special_tokens=True), "ids": row,
                            "num_forwards": int(out.num_forwards[i]),
                            "tokens_per_forward": round(float(out.tokens_per_forward[i]), 4)})
    for r in records:
        print(f"--- sample {r['index']} ({label}, seed {r['seed']}, {r['tokens_per_forward']} tokens/forward) ---")
        if r["prompt"]:
            print(f"[prompt] {r['prompt']}")
        print(r["text"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        print(f"wrote {args.out}")
    return 0
