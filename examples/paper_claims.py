"""The paper's claims at small scale, measured: four experiments on a real pretrained causal LM (SmolLM2-135M).

Each subcommand trains or evaluates with a budget counted in optimizer steps, samples or items — never wall seconds —
so a busy machine changes only how long a run takes, not its result. Seeds are fixed; every number it prints is also
written to ``OUT/<experiment>.json``. Results and the exact commands: docs/guides/experiments.md.

    python examples/paper_claims.py fig2      --out runs/claims     # §3.2, Fig. 2: x0 head vs posterior-mean head
    python examples/paper_claims.py paths     --out runs/claims     # §4.2: AR→mask, AR→uniform, AR→mask→uniform
    python examples/paper_claims.py adapt     --out runs/claims     # the demo's adaptation, saved as a checkpoint
    python examples/paper_claims.py frontier  --out runs/claims     # §4.3: GenPPL / entropy vs 16…256 steps, 5 seeds
    python examples/paper_claims.py zeroshot  --out runs/claims --tasks DIR/social_iqa/task.json ...   # §4.4

``--tiny`` runs every experiment on a tiny random Llama (seconds; what the test suite does).

Data: the bundled Python-documentation prose (``unifusion/data/``), 95 % for training, the rest held out.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

import unifusion as uf
from unifusion.eval.frontier import DEFAULT_SEEDS

CORPUS = Path(uf.__file__).parent / "data" / "python_docs_prose.txt"


# ------------------------------------------------------------------------------------------------ shared pieces
def load_model(args: argparse.Namespace, *, add_mask_token: bool) -> tuple[uf.DiffusionLM, Any, Any]:
    """(adapted model, tokenizer, frozen AR judge): SmolLM2-135M, or a tiny random Llama with ``--tiny``."""
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from _hf_tiny import tiny_model  # noqa: E402
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "tests" / "data" /
                                                  "tiny_tokenizer")
        hf = tiny_model("llama", vocab_size=len(tokenizer))
        judge = copy.deepcopy(hf).eval()
    else:
        hf = uf.models.load_smollm2()
        tokenizer = uf.models.load_smollm2_tokenizer()
        judge = uf.models.load_smollm2().eval()
    for p in judge.parameters():
        p.requires_grad_(False)
    return uf.adapt_ar_model(hf, add_mask_token=add_mask_token), tokenizer, judge


def token_blocks(tokenizer: Any, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) blocks ``(n, seq_len)`` of the bundled corpus (last 5 % of paragraphs held out)."""
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


def generator(seed: int, *keys: int) -> torch.Generator:
    """A CPU generator keyed by (seed, keys): the same batch, times and corruption for every run at a given step."""
    g = torch.Generator()
    g.manual_seed(hash((seed, *keys)) % (2**63))
    return g


def train(model: uf.DiffusionLM, kernel: uf.Kernel, blocks: torch.Tensor, args: argparse.Namespace, *,
          steps: int, first_step: int = 0, anneal_steps: int, objective: str = "gidd", head: str = "x0",
          log_every: int = 0, on_log: Any = None) -> list[float]:
    """``steps`` AdamW updates (warmup + cosine) with bf16 autocast; per-update token-mean losses.

    Batches, times and corruptions are keyed by the global update index ``first_step + i``, so two runs with the same
    index see exactly the same data (the Fig. 2 comparison, the conversion paths)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0,
                            betas=(0.9, 0.98))
    losses = []
    model.train()
    for i in range(steps):
        k = first_step + i
        lr = args.lr * min(1.0, (i + 1) / max(1, args.warmup)) * 0.5 * (1 + math.cos(math.pi * i / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        g = generator(args.seed, k)
        x0 = blocks[torch.randint(0, len(blocks), (args.batch_size,), generator=g)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.tiny):
            out = uf.diffusion_loss(model, x0, kernel, objective=objective, head=head, step=k,
                                    anneal_steps=anneal_steps, generator=g)
        loss = out.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if log_every and ((i + 1) % log_every == 0 or i + 1 == steps):
            print(f"  step {k + 1}: loss {sum(losses[-log_every:]) / len(losses[-log_every:]):.4f}", flush=True)
            if on_log is not None:
                on_log(k + 1)
    model.eval()
    return losses


@torch.no_grad()
def sample_quality(model: uf.DiffusionLM, kernel: uf.Kernel, tokenizer: Any, judge: Any, args: argparse.Namespace,
                   *, num_steps: int, seed: int) -> dict[str, float]:
    """GenPPL (judge: the original AR model) and unigram entropy (GPT-2 tokens) of ``--num-samples`` samples."""
    g = torch.Generator().manual_seed(seed)
    ids = uf.BayesianSampler(model, kernel, num_steps).sample(args.num_samples, args.seq_len, generator=g)
    texts = uf.eval.decode_samples(ids, tokenizer, mask_token_id=model.mask_token_id)
    ppl = uf.eval.generative_perplexity(texts, judge, tokenizer, progress=False)
    entropy_tok = uf.eval.gpt2_tokenizer() if not args.tiny else tokenizer
    entropy = uf.eval.unigram_entropy(uf.eval.retokenize(texts, entropy_tok))
    return {"genppl": float(ppl), "entropy": float(entropy.mean()) if isinstance(entropy, torch.Tensor)
            else float(entropy)}


def held_out_elbo(model: uf.DiffusionLM, kernel: uf.Kernel, held_out: torch.Tensor, args: argparse.Namespace
                  ) -> float:
    """Proposition 3.2's bound in nats per token on the first ``--eval-blocks`` held-out blocks (8 times each)."""
    x0 = held_out[: args.eval_blocks]
    bound = uf.eval.nll_bound(model, x0, kernel, num_times=8, generator=torch.Generator().manual_seed(args.seed))
    return float(bound.mean())


def write(args: argparse.Namespace, name: str, result: dict[str, Any]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"experiment": name, "tiny": args.tiny, "args": {k: v for k, v in vars(args).items() if k != "func"},
              "torch": torch.__version__, "unifusion": uf.__version__, "threads": torch.get_num_threads(),
              "date": time.strftime("%Y-%m-%d"), **result}
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / (name + '.json')}")


def kernel_named(name: str, model: uf.DiffusionLM) -> uf.Kernel:
    S = model.num_states
    if name == "uniform":
        return uf.UniformKernel(S)
    assert model.mask_token_id is not None
    return uf.MaskKernel(S, model.mask_token_id)


# ------------------------------------------------------------------------------------------------ experiments
def run_fig2(args: argparse.Namespace) -> dict[str, Any]:
    """§3.2 / Fig. 2: the same M2S objective with the network read as an x0 head (converted, Theorem 3.5) or used
    directly as the posterior mean μ; same data, times and corruptions; mean loss over the first ``--first`` updates."""
    base, tokenizer, _ = load_model(args, add_mask_token=False)
    train_blocks, _ = token_blocks(tokenizer, args.seq_len)
    kernel = uf.UniformKernel(base.num_states)
    curves = {}
    for head in ("x0", "mu"):
        print(f"[fig2] {head} head: {args.steps} updates", flush=True)
        model = copy.deepcopy(base)
        curves[head] = train(model, kernel, train_blocks, args, steps=args.steps, anneal_steps=args.anneal_steps,
                             objective="m2s", head=head, log_every=args.log_every)
    k = min(args.first, args.steps)
    early = {h: sum(c[:k]) / k for h, c in curves.items()}
    lower = 1.0 - early["x0"] / early["mu"]
    print(f"[fig2] mean M2S loss over the first {k} updates: x0 head {early['x0']:.4f}, μ head {early['mu']:.4f} "
          f"→ x0 head {100 * lower:.1f} % lower (paper: 48.6 %)")
    return {"first": k, "early_mean": early, "x0_lower_fraction": lower, "curves": curves}


PATHS = {"AR→mask": ("mask", "mask"), "AR→uniform": ("uniform", "uniform"), "AR→mask→uniform": ("mask", "uniform")}


def run_paths(args: argparse.Namespace) -> dict[str, Any]:
    """§4.2: three conversion paths, two phases of ``--steps`` updates each (the kernel switched between phases on
    AR→mask→uniform); the loss per update and, after each phase, GenPPL / entropy of samples under the phase's kernel
    and the held-out ELBO under both kernels."""
    base, tokenizer, judge = load_model(args, add_mask_token=True)  # one state space S = V + 1 for both kernels
    train_blocks, held_out = token_blocks(tokenizer, args.seq_len)
    out: dict[str, Any] = {}
    for name, phases in PATHS.items():
        print(f"[paths] {name}", flush=True)
        model = copy.deepcopy(base)
        record: dict[str, Any] = {"loss": [], "checkpoints": []}
        for i, kernel_name in enumerate(phases):
            kernel = kernel_named(kernel_name, model)
            record["loss"] += train(model, kernel, train_blocks, args, steps=args.steps, first_step=i * args.steps,
                                    anneal_steps=args.anneal_steps, log_every=args.log_every)
            q = sample_quality(model, kernel, tokenizer, judge, args, num_steps=args.sample_steps, seed=args.seed)
            elbo = {k: held_out_elbo(model, kernel_named(k, model), held_out, args) for k in ("mask", "uniform")}
            record["checkpoints"].append({"after_step": (i + 1) * args.steps, "kernel": kernel_name, **q,
                                          "heldout_elbo": elbo})
            print(f"  after {(i + 1) * args.steps} updates ({kernel_name}): GenPPL {q['genppl']:.1f}, entropy "
                  f"{q['entropy']:.2f}, held-out ELBO mask {elbo['mask']:.3f} / uniform {elbo['uniform']:.3f}",
                  flush=True)
        out[name] = record
    return {"paths": out}


def run_adapt(args: argparse.Namespace) -> dict[str, Any]:
    """The demo's adaptation (uniform noise, GIDD ELBO loss, linear schedule, attention annealed over the first half)
    for ``--steps`` updates; saves the checkpoint (and its tokenizer) to OUT/adapted."""
    model, tokenizer, _ = load_model(args, add_mask_token=False)
    train_blocks, held_out = token_blocks(tokenizer, args.seq_len)
    kernel = uf.UniformKernel(model.num_states)
    losses = train(model, kernel, train_blocks, args, steps=args.steps, anneal_steps=max(1, args.steps // 2),
                   log_every=args.log_every)
    path = Path(args.out) / "adapted"
    model.save_pretrained(path, kernel=kernel)  # recorded: generate and the evaluators default to it
    tokenizer.save_pretrained(path)
    elbo = held_out_elbo(model, kernel, held_out, args)
    print(f"[adapt] {args.steps} updates, last-10 mean loss {sum(losses[-10:]) / len(losses[-10:]):.4f}, held-out "
          f"ELBO {elbo:.3f} nats/token; saved {path}")
    return {"loss": losses, "heldout_elbo": elbo, "checkpoint": str(path)}


def run_frontier(args: argparse.Namespace) -> dict[str, Any]:
    """§4.3: GenPPL and unigram entropy vs sampling steps over ``--seeds`` for the checkpoint written by ``adapt``."""
    path = Path(args.adapted or Path(args.out) / "adapted")
    if not path.is_dir():
        raise SystemExit(f"frontier: run `adapt` first (no checkpoint at {path})")
    model = uf.DiffusionLM.from_pretrained(path)
    _, tokenizer, judge = load_model(args, add_mask_token=False)
    result = uf.eval.frontier(model, uf.UniformKernel(model.num_states), steps=tuple(args.frontier_steps),
                              seeds=tuple(args.seeds), num_samples=args.num_samples, seq_len=args.seq_len,
                              judge_model=judge, judge_tokenizer=tokenizer, tokenizer=tokenizer,
                              out_dir=Path(args.out) / "frontier", label="adapted", batch_size=args.num_samples,
                              progress=False)
    print(result.table())
    rows = result.summary
    falls = all(b["genppl_mean"] <= a["genppl_mean"] for a, b in zip(rows, rows[1:]))
    print(f"[frontier] GenPPL {'falls' if falls else 'does not fall monotonically'} with the number of steps")
    return {"summary": rows, "genppl_monotone_in_steps": falls, "files": result.paths}


def run_zeroshot(args: argparse.Namespace) -> dict[str, Any]:
    """§4.4: zero-shot multiple choice on BIG-bench task files — the base AR model, the adapted model with the paper's
    32-time protocol, and with Fair-PMI — on the first ``--max-examples`` examples of each task."""
    path = Path(args.adapted or Path(args.out) / "adapted")
    if not path.is_dir():
        raise SystemExit(f"zeroshot: run `adapt` first (no checkpoint at {path})")
    model = uf.DiffusionLM.from_pretrained(path)
    ar, tokenizer, _ = load_model(args, add_mask_token=False)
    kernel = uf.UniformKernel(model.num_states)
    out: dict[str, Any] = {}
    for task in args.tasks:
        name = Path(task).parent.name or Path(task).stem
        row = {}
        for label, method, m in (("AR (base)", "ar", ar), ("adapted, 32 times", "score", model),
                                 ("adapted, Fair-PMI", "fair_pmi", model)):
            res = uf.eval.run_multiple_choice(task, m, kernel, tokenizer, method=method,
                                              max_examples=args.max_examples, seed=args.seed, progress=False,
                                              num_times=None if method == "ar" else args.num_times)
            row[label] = {"accuracy": res.accuracy, "n": res.num_examples}
            print(f"[zeroshot] {name}: {label}: {res.accuracy:.3f} on {res.num_examples} examples", flush=True)
        out[name] = row
    return {"tasks": out}


# ------------------------------------------------------------------------------------------------ command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("experiment", choices=["fig2", "paths", "adapt", "frontier", "zeroshot"])
    parser.add_argument("--out", default="runs/claims", help="output folder (JSON results, checkpoint, plots)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2 (smoke test)")
    parser.add_argument("--steps", type=int, default=None,
                        help="updates per run (fig2), per phase (paths) or in all (adapt); default 60/60/200, 3 tiny")
    parser.add_argument("--first", type=int, default=10, help="fig2: window of the early-loss mean")
    parser.add_argument("--anneal-steps", type=int, default=None, help="attention annealing horizon (default: steps)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None, help="default 64 (16 with --tiny)")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--num-samples", type=int, default=8, help="samples per GenPPL / frontier point")
    parser.add_argument("--sample-steps", type=int, default=32, help="paths: sampling steps of the GenPPL probe")
    parser.add_argument("--eval-blocks", type=int, default=16, help="held-out sequences of the ELBO probe")
    parser.add_argument("--frontier-steps", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--tasks", nargs="*", default=[], help="zeroshot: BIG-bench task.json files")
    parser.add_argument("--adapted", default=None,
                        help="frontier/zeroshot: the adapted checkpoint (default OUT/adapted)")
    parser.add_argument("--max-examples", type=int, default=100, help="zeroshot: examples per task")
    parser.add_argument("--num-times", type=int, default=None,
                        help="zeroshot: time-grid size K of both diffusion scores (default: 32, and 128 for Fair-PMI)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 3 if args.tiny else {"fig2": 60, "paths": 60, "adapt": 200}.get(args.experiment, 200)
    if args.seq_len is None:
        args.seq_len = 16 if args.tiny else 64
    if args.anneal_steps is None:
        args.anneal_steps = args.steps
    if args.tiny:
        args.eval_blocks = min(args.eval_blocks, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    run = {"fig2": run_fig2, "paths": run_paths, "adapt": run_adapt, "frontier": run_frontier,
           "zeroshot": run_zeroshot}[args.experiment]
    t0 = time.time()
    result = run(args)
    result["wall_seconds"] = round(time.time() - t0, 1)
    write(args, args.experiment, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
