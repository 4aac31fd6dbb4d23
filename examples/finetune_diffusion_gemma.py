"""Fine-tune DiffusionGemma (transformers' ``DiffusionGemmaForBlockDiffusion``) with unifusion's objectives.

DiffusionGemma is a uniform-noise diffusion LM: its decoder predicts a clean canvas from a noisy one given the clean
prefix its encoder cached. Read as an x0 model under ``UniformKernel(V)`` (``uf.hf.wrap_diffusion_lm``), it trains
with the GIDD loss, a proper ELBO (``--weighting elbo``) or its clipped / dynamic weightings, instead of the flat
cross-entropy of third-party recipes:

    loss = Σ_{response tokens} D_t(canvas | clean prefix) / #response tokens   (+ --ar-weight × AR cross-entropy)

* the prompt stays clean at every time and scores 0 (``uf.diffusion_loss(..., prompt_mask=)``; the response is cut
  into canvases from the end of the prompt, each predicted from the clean prompt and earlier canvases);
* ``--self-conditioning p``: with probability p per row, a first no-grad pass's logits are fed back to the decoder
  (as generation does between steps);
* ``--ar-weight w``: plus w × the next-token cross-entropy of the encoder's hidden states over the clean sequence
  (the encoder is the same network run causally: this keeps it a good AR model for the cache);
* ``--freeze-router``: the MoE routers (``*.router.*``) get no updates (a common choice for small fine-tuning sets,
  which can unbalance the experts);
* ``--fused``: the loss from the decoder's hidden states chunk by chunk (the ``(B, L, V)`` logits never exist, for
  the 262k vocabulary), through the wrapper's own fused loss.

Everything runs in one ``forward`` of :class:`FineTuner` (diffusion loss and AR loss), so ``--dist fsdp2``
(``fully_shard`` on the root: the encoder and decoder layers share their weights, so they shard as one group) and
``--dist ddp`` see every parameter use inside the wrapped call. Each rank's loss sum is normalised by the *global*
response-token count.

CPU smoke run (tiny random model, a copy task)::

    python examples/finetune_diffusion_gemma.py --tiny --steps 3
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/finetune_diffusion_gemma.py --tiny \\
        --steps 3 --dist fsdp2

A checkpoint and a JSON-lines file of ``{"prompt": ..., "response": ...}``::

    torchrun --nproc_per_node=8 examples/finetune_diffusion_gemma.py --model google/diffusiongemma-26B-A4B-it \\
        --data sft.jsonl --seq-len 1024 --batch 4 --dtype bfloat16 --dist fsdp2 --freeze-router --self-conditioning 0.5
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import unifusion as uf
from unifusion.precision import DTYPE_CHOICES, describe_dtype_choice, resolve_dtype


def tiny_diffusion_gemma(seed: int) -> Any:
    """A random DiffusionGemma: 2 layers (sliding, full), 4 experts (top 2), vocabulary 128, canvas 8."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, global_head_dim=16, num_experts=4, top_k_experts=2,
                moe_intermediate_size=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=64)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=8, image_token_id=127,
                                  boi_token_id=126, eoi_token_id=125)
    torch.manual_seed(seed)
    return DiffusionGemmaForBlockDiffusion(config)


def copy_task(num: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x0 (num, L), prompt_mask)``: [BOS, w_1 … w_m, w_1 … w_m] with m = (L − 1) // 2, the copy is the response."""
    g = torch.Generator().manual_seed(seed)
    m = (seq_len - 1) // 2
    words = torch.randint(3, 120, (num, m), generator=g)
    x0 = torch.cat([torch.full((num, 1), 2), words, words, torch.full((num, seq_len - 1 - 2 * m), 1)], dim=1)
    prompt = torch.arange(seq_len)[None, :].expand(num, -1) < m + 1
    return x0, prompt


def sft_pairs(path: str, tokenizer: Any, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x0, prompt_mask, attention_mask)`` from ``{"prompt", "response"}`` lines: BOS + prompt + response + EOS,
    cut at ``seq_len`` and right-padded with the pad id."""
    rows, prompts = [], []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        p = [tokenizer.bos_token_id] + tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]
        r = tokenizer(item["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(p) >= seq_len:
            continue  # no response token would fit
        rows.append((p + r)[:seq_len])
        prompts.append(len(p))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    x0 = torch.full((len(rows), seq_len), pad)
    mask = torch.zeros((len(rows), seq_len), dtype=torch.bool)
    for i, row in enumerate(rows):
        x0[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), True
    prompt = torch.arange(seq_len)[None, :] < torch.tensor(prompts)[:, None]
    return x0, prompt, mask


class FineTuner(torch.nn.Module):
    """The wrapped model and the training objective in one ``forward`` (what DDP / FSDP2 wrap): returns the summed
    diffusion loss, its response-token count, and the summed AR loss with its token count."""

    def __init__(self, model: uf.hf.DiffusionGemmaLM, args: argparse.Namespace) -> None:
        super().__init__()
        self.model, self.args = model, args

    def forward(self, x0: torch.Tensor, prompt: torch.Tensor, mask: torch.Tensor | None,
                generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        args, model, kernel = self.args, self.model, self.model.kernel
        if args.fused:  # the wrapper's fused loss on the decoder's hidden states (final_logit_softcap applied)
            t = uf.sample_times(x0.shape[0], generator=generator, device=x0.device)
            x_t = torch.where(prompt, x0, kernel.sample(x0, t, generator=generator))
            loss = model(x_t, t, prompt_mask=prompt, attention_mask=mask, x0=x0, kernel=kernel,
                         weighting=args.weighting, max_weight=args.max_weight,
                         self_conditioning_prob=args.self_conditioning, generator=generator)
            scored = ~prompt if mask is None else mask & ~prompt
            total, count = loss.sum(), scored.sum()
        else:
            scorer = model.conditioned_on(x0, prompt_mask=prompt, attention_mask=mask,
                                          self_conditioning_prob=args.self_conditioning, generator=generator)
            out = uf.diffusion_loss(scorer, x0, kernel, prompt_mask=prompt, attention_mask=mask,
                                    weighting=args.weighting, max_weight=args.max_weight, generator=generator)
            total, count = out.loss.sum(), out.num_tokens
        ar_total, ar_count = total.new_zeros(()), total.new_zeros(())
        if args.ar_weight > 0:  # next-token cross-entropy of the causal encoder over the clean sequence
            hf = model.base_model
            h = hf.model.encoder(input_ids=x0, attention_mask=mask).last_hidden_state
            logits = model.logits_from_hidden(h[:, :-1])
            target = x0[:, 1:] if mask is None else x0[:, 1:].masked_fill(~mask[:, 1:], -100)
            ar_total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                                       reduction="sum")
            ar_count = (target != -100).sum().to(ar_total.dtype)
        return total, count.to(total.dtype), ar_total, ar_count


def freeze_routers(model: torch.nn.Module) -> int:
    """Stop updates of the MoE routers; returns how many parameter tensors were frozen."""
    frozen = 0
    for name, p in model.named_parameters():
        if ".router." in name:
            p.requires_grad_(False)
            frozen += 1
    return frozen


def setup_distributed(mode: str) -> tuple[int, int, torch.device]:
    if mode == "none":
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit(f"--dist {mode}: launch with torchrun")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a DiffusionGemma checkpoint folder (or hub name)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model and a copy task (smoke test)")
    parser.add_argument("--data", help='JSON lines with {"prompt": ..., "response": ...}')
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and update")
    parser.add_argument("--seq-len", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weighting", choices=["elbo", "clip", "dynamic"], default="elbo")
    parser.add_argument("--max-weight", type=float, default=2.0, help="upper clip of the GIDD weights")
    parser.add_argument("--ar-weight", type=float, default=0.0, help="weight of the encoder's AR loss (0: off)")
    parser.add_argument("--self-conditioning", type=float, default=0.0, help="probability of a self-conditioned pass")
    parser.add_argument("--freeze-router", action="store_true")
    parser.add_argument("--fused", action="store_true", help="the fused loss on the decoder's hidden states")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="the weights' dtype (the optimizer and the training compute follow it): bfloat16 or "
                             "float32. auto: bfloat16 where the device computes it natively (CUDA with bf16, a CPU "
                             "with AVX512-BF16 or AMX), float32 elsewhere (default: auto)")
    parser.add_argument("--dist", choices=["none", "ddp", "fsdp2"], default="none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="save the fine-tuned model here (rank 0)")
    args = parser.parse_args(argv)
    if args.tiny == (args.model is not None):
        parser.error("give exactly one of --tiny and --model")
    if args.model is not None and args.data is None:
        parser.error("--model needs --data")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, device = setup_distributed(args.dist)
    dtype = resolve_dtype(args.dtype, device)
    if rank == 0:
        print(describe_dtype_choice(args.dtype, device, bf16_means="bf16 weights"), flush=True)
    tokenizer = None
    if args.tiny:
        hf = tiny_diffusion_gemma(args.seed).to(dtype)
        x0_all, prompt_all = copy_task(64, args.seq_len, args.seed)
        mask_all = None
    else:
        from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

        hf = DiffusionGemmaForBlockDiffusion.from_pretrained(args.model, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        x0_all, prompt_all, mask_all = sft_pairs(args.data, tokenizer, args.seq_len)
    model = uf.hf.wrap_diffusion_lm(hf.to(device).train(), tokenizer=tokenizer)
    if args.freeze_router:
        print(f"frozen router tensors: {freeze_routers(model)}")
    trainer: torch.nn.Module = FineTuner(model, args)
    if args.dist == "ddp":
        trainer = torch.nn.parallel.DistributedDataParallel(trainer, device_ids=[device.index] if device.type ==
                                                            "cuda" else None)
    elif args.dist == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        trainer = fully_shard(trainer)  # one group: the encoder's and decoder's layers share their weights
    optimizer = torch.optim.AdamW([p for p in trainer.parameters() if p.requires_grad], lr=args.lr)
    for step in range(1, args.steps + 1):
        # the global batch of this update, the same whatever the number of ranks; this rank takes its rows
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        rows = torch.randint(0, x0_all.shape[0], (args.batch * world,), generator=g)[rank::world]
        x0, prompt = x0_all[rows].to(device), prompt_all[rows].to(device)
        mask = None if mask_all is None else mask_all[rows].to(device)
        generator = torch.Generator(device=device).manual_seed(args.seed * 7919 + step * 131 + rank)
        total, count, ar_total, ar_count = trainer(x0, prompt, mask, generator)
        counts = torch.stack([count.detach(), ar_count.detach()]).float()
        if world > 1:
            dist.all_reduce(counts)
        loss = total * world / counts[0].clamp_min(1)  # the ranks' gradients are averaged: × world
        if args.ar_weight > 0:
            loss = loss + args.ar_weight * ar_total * world / counts[1].clamp_min(1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in trainer.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        value = loss.detach() / world
        if world > 1:
            dist.all_reduce(value)
        if rank == 0:
            print(f"step {step:4d} | loss {float(value):.5f} | grad_norm {float(grad_norm):.4f}", flush=True)
            if not math.isfinite(float(value)):
                raise SystemExit("non-finite loss")
    if args.out and args.dist != "fsdp2" and rank == 0:
        model.save_pretrained(args.out)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
