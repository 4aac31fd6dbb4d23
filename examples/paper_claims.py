"""The paper's claims at small scale, measured: four experiments on a real pretrained causal LM (SmolLM2-135M).

Each subcommand trains or evaluates with a budget counted in optimizer steps, samples or items — never wall seconds —
and draws every batch, time, corruption and sample from a generator keyed by ``--seed`` and the update index. The
fused losses and samplers run on the library's default backend (``--backend auto``: eager or compiled chosen from
each call's size alone, compiled in the caller's thread) unless ``--backend`` says otherwise, with a fixed thread
count (``--threads``). So two runs with the same arguments, torch version and CPU give bit-identical numbers, and a
busy machine changes only how long a run takes. Every number it prints is also written to ``OUT/<experiment>.json``;
``report`` renders the tables of docs/guides/experiments.md from those files (the committed ones live in
docs/assets/claims/).

    python examples/paper_claims.py fig2      --out runs/claims     # §3.2, Fig. 2: x0 head vs posterior-mean head
    python examples/paper_claims.py paths     --out runs/claims     # §4.2: AR→mask, AR→uniform, AR→mask→uniform
    python examples/paper_claims.py adapt     --out runs/claims     # the demo's adaptation, saved as a checkpoint
    python examples/paper_claims.py frontier  --out runs/claims     # §4.3: GenPPL / entropy vs 16…256 steps, 5 seeds
    python examples/paper_claims.py zeroshot  --out runs/claims --tasks DIR/social_iqa/task.json ...   # §4.4
    python examples/paper_claims.py report    --out runs/claims     # markdown tables from OUT/*.json

``--tiny`` runs every experiment on a tiny random Llama (seconds; what the test suite does).

Data: the bundled Python-documentation prose (``unifusion/data/``), 95 % for training, the rest held out.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

import unifusion as uf
from unifusion.eval.frontier import DEFAULT_SEEDS
from unifusion.precision import DTYPE_CHOICES, resolve_dtype

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
        hf = uf.hf.load_smollm2()
        tokenizer = uf.hf.load_smollm2_tokenizer()
        judge = uf.hf.load_smollm2().eval()
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
    """A CPU generator keyed by (seed, keys): the same batch, times and corruption for every run at a given step.

    ``hash`` of a tuple of ints does not depend on ``PYTHONHASHSEED``, so the streams are the same in every process."""
    g = torch.Generator()
    g.manual_seed(hash((seed, *keys)) % (2**63))
    return g


PROBE = 1  # generator key of the sample probes: generator(seed, update, PROBE), disjoint from training's (seed, update)


def train(model: uf.DiffusionLM, kernel: uf.Kernel, blocks: torch.Tensor, args: argparse.Namespace, *,
          steps: int, first_step: int = 0, anneal_steps: int, objective: str = "gidd", head: str = "x0",
          seed: int | None = None, log_every: int = 0, on_log: Any = None) -> list[float]:
    """``steps`` AdamW updates (warmup + cosine) in ``--dtype`` (auto: bf16 autocast where the CPU computes bf16
    natively, float32 elsewhere; float32 with ``--tiny``); per-update token-mean losses.

    Batches, times and corruptions are keyed by (``seed``, default ``--seed``; the global update index
    ``first_step + i``), so two runs with the same keys see exactly the same data (the Fig. 2 comparison, the
    conversion paths). ``on_log(update)`` runs every ``log_every`` updates (in eval mode; the probes of ``paths``)."""
    seed = args.seed if seed is None else seed
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0,
                            betas=(0.9, 0.98))
    losses = []
    bf16 = not args.tiny and resolve_dtype(args.dtype, "cpu") == torch.bfloat16
    model.train()
    for i in range(steps):
        k = first_step + i
        lr = args.lr * min(1.0, (i + 1) / max(1, args.warmup)) * 0.5 * (1 + math.cos(math.pi * i / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        g = generator(seed, k)
        x0 = blocks[torch.randint(0, len(blocks), (args.batch_size,), generator=g)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
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
                model.eval()
                on_log(k + 1)
                model.train()
    model.eval()
    return losses


@torch.no_grad()
def sample_quality(model: uf.DiffusionLM, kernel: uf.Kernel, tokenizer: Any, judge: Any, args: argparse.Namespace,
                   *, num_steps: int, generator: torch.Generator) -> dict[str, Any]:
    """GenPPL (judge: the original AR model, pooled over the samples) and unigram entropy (GPT-2 tokens) of
    ``--num-samples`` samples of ``--seq-len`` tokens, with the per-sample values a bootstrap needs."""
    ids = uf.BayesianSampler(model, kernel, num_steps).sample(args.num_samples, args.seq_len, generator=generator)
    texts = uf.eval.decode_samples(ids, tokenizer, mask_token_id=model.mask_token_id)
    ppl = uf.eval.generative_perplexity(texts, judge, tokenizer, progress=False)
    entropy_tok = uf.eval.gpt2_tokenizer() if not args.tiny else tokenizer
    entropy = uf.eval.unigram_entropy(uf.eval.retokenize(texts, entropy_tok))  # (num_samples,)
    return {"genppl": float(ppl), "entropy": float(entropy.mean()), "sample_nll": ppl.per_sample_nll,
            "sample_tokens": ppl.per_sample_tokens, "sample_entropy": entropy.tolist()}


def held_out_elbo(model: uf.DiffusionLM, kernel: uf.Kernel, held_out: torch.Tensor, args: argparse.Namespace,
                  *, seed: int | None = None) -> float:
    """Proposition 3.2's bound in nats per token on the first ``--eval-blocks`` held-out blocks (8 times each)."""
    x0 = held_out[: args.eval_blocks]
    g = torch.Generator().manual_seed(args.seed if seed is None else seed)
    return float(uf.eval.nll_bound(model, x0, kernel, num_times=8, generator=g).mean())


def _git(*cmd: str) -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", *cmd], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment() -> dict[str, Any]:
    """What a rerun needs to match: code (commit; ``dirty`` if the package or examples differ from it), versions,
    backend, threads, CPU."""
    import platform

    import transformers

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    # "dirty": the code that runs (the package, the examples, the build config) differs from the commit
    status = _git("status", "--porcelain", "--untracked-files=no", "--", "../unifusion", ".", "../pyproject.toml")
    return {"commit": _git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status),
            "torch": torch.__version__, "transformers": transformers.__version__, "unifusion": uf.__version__,
            "python": platform.python_version(), "backend": uf.backend.get_backend(),
            "threads": torch.get_num_threads(),
            "cpu": cpu, "cpu_count": __import__("os").cpu_count()}


def write(args: argparse.Namespace, name: str, result: dict[str, Any]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"experiment": name, "tiny": args.tiny, "args": {k: v for k, v in vars(args).items() if k != "func"},
              **environment(), "date": time.strftime("%Y-%m-%d"), **result}
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out / (name + '.json')}")


def kernel_named(name: str, model: uf.DiffusionLM) -> uf.Kernel:
    S = model.num_states
    if name == "uniform":
        return uf.UniformKernel(S)
    if model.mask_token_id is None:
        raise ValueError(f"kernel {name!r}: the model has no mask token")
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
NOISE_PATH = "AR→uniform"


class _Probe:
    """``probe(update, kernel_name)``: one point of a conversion path's trajectory, appended to ``record["probes"]``:
    GenPPL / entropy of samples drawn under the named kernel, the held-out bound under both kernels."""

    def __init__(self, model: uf.DiffusionLM, record: dict[str, Any], seed: int, args: argparse.Namespace,
                 tokenizer: Any, judge: Any, held_out: torch.Tensor) -> None:
        self.model, self.record, self.seed, self.args = model, record, seed, args
        self.tokenizer, self.judge, self.held_out = tokenizer, judge, held_out

    def __call__(self, update: int, kernel_name: str) -> None:
        model, args = self.model, self.args
        q = sample_quality(model, kernel_named(kernel_name, model), self.tokenizer, self.judge, args,
                           num_steps=args.sample_steps, generator=generator(self.seed, update, PROBE))
        # the bound's times and corruptions are the same for every path and seed (--seed): differences between
        # paths and seeds are the models', not the estimator's
        bound = {k: held_out_elbo(model, kernel_named(k, model), self.held_out, args) for k in ("mask", "uniform")}
        self.record["probes"].append({"update": update, "kernel": kernel_name, **q, "heldout_bound": bound})
        print(f"  update {update} ({kernel_name}): GenPPL {q['genppl']:.1f}, entropy {q['entropy']:.3f}, "
              f"held-out bound mask {bound['mask']:.3f} / uniform {bound['uniform']:.3f}", flush=True)


def run_paths(args: argparse.Namespace) -> dict[str, Any]:
    """§4.2: three conversion paths, two phases of ``--steps`` updates each (the kernel switched between phases on
    AR→mask→uniform), and AR→uniform again for each of ``--noise-seeds`` (other data, times, corruptions and
    samples: the run-to-run noise). Per update the training loss; at update 0 and every ``--probe-every`` updates
    GenPPL / unigram entropy of ``--num-samples`` samples under the current kernel and the held-out bound under both
    kernels. AR→mask→uniform starts from AR→mask's model after phase 1 (the same run up to there, not rerun)."""
    base, tokenizer, judge = load_model(args, add_mask_token=True)  # one state space S = V + 1 for both kernels
    train_blocks, held_out = token_blocks(tokenizer, args.seq_len)
    plan = [(name, phases, args.seed) for name, phases in PATHS.items()]
    plan += [(f"{NOISE_PATH} (seed {s})", PATHS[NOISE_PATH], s) for s in args.noise_seeds]
    needed = {(seed, phases[:j]) for i, (_, phases, seed) in enumerate(plan) for j in range(1, len(phases))
              if any(p[1][:j] == phases[:j] and p[2] == seed for p in plan[:i])}
    snapshots: dict[tuple, tuple[uf.DiffusionLM, dict[str, Any]]] = {}
    out: dict[str, Any] = {}
    for name, phases, seed in plan:
        print(f"[paths] {name}", flush=True)
        model, record, start = None, {"seed": seed, "kernels": list(phases), "loss": [], "probes": []}, 0
        for j in range(len(phases) - 1, 0, -1):
            if (seed, phases[:j]) in snapshots:
                snap_model, snap_record = snapshots[(seed, phases[:j])]
                model, record, start = copy.deepcopy(snap_model), copy.deepcopy(snap_record), j
                record["kernels"] = list(phases)
                record["shared_until"] = j * args.steps
                print(f"  updates 1–{j * args.steps} shared with the run before (same seed and kernels)", flush=True)
                break
        if model is None:
            model = copy.deepcopy(base).eval()

        probe = _Probe(model, record, seed, args, tokenizer, judge, held_out)
        if start == 0:
            probe(0, phases[0])
        for i in range(start, len(phases)):
            kernel_name = phases[i]
            record["loss"] += train(model, kernel_named(kernel_name, model), train_blocks, args, steps=args.steps,
                                    first_step=i * args.steps, anneal_steps=args.anneal_steps, seed=seed,
                                    log_every=args.probe_every,
                                    on_log=lambda update, kn=kernel_name, pr=probe: pr(update, kn))
            if (seed, phases[: i + 1]) in needed:
                snapshots[(seed, phases[: i + 1])] = (copy.deepcopy(model), copy.deepcopy(record))
        out[name] = record
    return {"paths": out}


def run_adapt(args: argparse.Namespace) -> dict[str, Any]:
    """The demo's adaptation (uniform noise, GIDD ELBO loss, linear schedule, attention annealed from causal to
    bidirectional over the first ``--anneal-steps`` updates, default half the run) for ``--steps`` updates; saves the
    checkpoint (and its tokenizer) to OUT/adapted."""
    model, tokenizer, _ = load_model(args, add_mask_token=False)
    train_blocks, held_out = token_blocks(tokenizer, args.seq_len)
    kernel = uf.UniformKernel(model.num_states)
    losses = train(model, kernel, train_blocks, args, steps=args.steps, anneal_steps=args.anneal_steps,
                   log_every=args.log_every)
    path = Path(args.out) / "adapted"
    model.save_pretrained(path, kernel=kernel, tokenizer=tokenizer)  # the kernel recorded: generate defaults to it
    elbo = held_out_elbo(model, kernel, held_out, args)
    print(f"[adapt] {args.steps} updates, last-10 mean loss {sum(losses[-10:]) / len(losses[-10:]):.4f}, held-out "
          f"bound {elbo:.3f} nats/token; saved {path}")
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
                              progress=False, resume=args.resume)
    print(result.table())
    rows = result.summary
    falls = all(b["genppl_mean"] <= a["genppl_mean"] for a, b in zip(rows, rows[1:]))
    print(f"[frontier] GenPPL {'falls' if falls else 'does not fall monotonically'} with the number of steps")
    return {"summary": rows, "runs": result.runs, "config": result.config, "genppl_monotone_in_steps": falls,
            "files": result.paths}


ZEROSHOT_SCORERS = (("AR (base)", "ar"), ("adapted, span score", "score"), ("adapted, Fair-PMI", "fair_pmi"))


def run_zeroshot(args: argparse.Namespace) -> dict[str, Any]:
    """§4.4: zero-shot multiple choice on BIG-bench task files — the base AR model, the adapted model with the
    paper's span score over ``--num-times`` (32) times, and with Fair-PMI over ``--pmi-times`` (the paper: 128) — on
    the first ``--max-examples`` examples of each task. OUT/zeroshot.json is written after each task (``"partial"``
    until all are done)."""
    path = Path(args.adapted or Path(args.out) / "adapted")
    if not path.is_dir():
        raise SystemExit(f"zeroshot: run `adapt` first (no checkpoint at {path})")
    model = uf.DiffusionLM.from_pretrained(path)
    ar, tokenizer, _ = load_model(args, add_mask_token=False)
    kernel = uf.UniformKernel(model.num_states)
    times = {"ar": None, "score": args.num_times, "fair_pmi": args.pmi_times}
    out: dict[str, Any] = {}
    for task in args.tasks:
        name = Path(task).parent.name or Path(task).stem
        row = {}
        for label, method in ZEROSHOT_SCORERS:
            t0 = time.time()
            res = uf.eval.run_multiple_choice(task, ar if method == "ar" else model, kernel, tokenizer,
                                              method=method, max_examples=args.max_examples, seed=args.seed,
                                              progress=False, num_times=times[method])
            targets = [ex["target_scores"] for ex in uf.eval.load_task(task)["examples"][: res.num_examples]]
            correct = [int(list(t.values())[p] == max(t.values())) for t, p in zip(targets, res.predictions)]
            row[label] = {"method": method, "num_times": times[method], "accuracy": res.accuracy,
                          "n": res.num_examples, "num_correct": res.num_correct, "correct": correct,
                          "num_choices": [len(t) for t in targets], "seconds": round(time.time() - t0, 1)}
            print(f"[zeroshot] {name}: {label}: {res.accuracy:.3f} on {res.num_examples} examples "
                  f"({time.time() - t0:.0f} s)", flush=True)
        out[name] = row
        if len(out) < len(args.tasks):  # what is done so far, in case a long run is stopped
            write(args, "zeroshot", {"tasks": out, "partial": True})
    return {"tasks": out}


# ------------------------------------------------------------------------------------------------ report
EXPERIMENTS = ("adapt", "fig2", "paths", "frontier", "zeroshot")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _window_means(losses: list[float], width: int) -> list[tuple[int, int, float]]:
    """(first update, last update, mean loss) of consecutive windows of ``width`` updates (1-based)."""
    return [(lo + 1, min(lo + width, len(losses)), _mean(losses[lo: lo + width]))
            for lo in range(0, len(losses), width)]


def genppl_interval(nll: list[float], tokens: list[int], *, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of the pooled GenPPL exp(Σ nll / Σ tokens) over resampled samples (a fixed seed, so
    the report is reproducible). It measures the sampling noise of one probe, not that of training."""
    import random

    rng = random.Random(seed)
    n = len(nll)
    values = []
    for _ in range(reps):
        pick = [rng.randrange(n) for _ in range(n)]
        values.append(math.exp(sum(nll[i] for i in pick) / max(1, sum(tokens[i] for i in pick))))
    values.sort()
    return values[int(0.025 * reps)], values[int(0.975 * reps) - 1]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion k / n."""
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def _table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    return "\n".join("| " + " | ".join(r) + " |" for r in [header, rule, *rows])


def report_runs(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name in EXPERIMENTS:
        r = results.get(name)
        if r is None:
            continue
        commit = (r.get("commit") or "?")[:7] + (" (dirty)" if r.get("dirty") else "")
        rows.append([f"`{name}`", r["date"], f"`{commit}`", f"{r['wall_seconds']:,.0f}", r.get("backend", "?"),
                     str(r.get("threads", "?")), r.get("torch", "?"), r.get("transformers", "?")])
    return _table(["experiment", "date", "commit", "wall (s)", "backend", "threads", "torch", "transformers"], rows,
                  "lllrlrll")


def report_fig2(r: dict[str, Any]) -> str:
    k = r["first"]
    rows = []
    for head, label in (("x0", "x0 (shifted AR output)"), ("mu", "μ (same network, read as μ)")):
        c = r["curves"][head]
        top = max(range(len(c)), key=c.__getitem__)
        rows.append([label, f"{c[0]:.2f}", f"**{r['early_mean'][head]:.2f}**",
                     f"{_mean(c[-k:]):.2f}", f"{c[top]:.1f} (update {top + 1})"])
    n = len(r["curves"]["x0"])
    table = _table(["head", "M2S loss, first update", f"mean over updates 1–{k}",
                    f"mean over updates {n - k + 1}–{n}", "largest update loss"], rows)
    return table + f"\n\nx0 head's early loss lower by **{100 * r['x0_lower_fraction']:.1f} %** (paper: 48.6 %)."


def report_adapt(r: dict[str, Any], width: int = 10) -> str:
    w = _window_means(r["loss"], width)
    table = _table(["updates", *[f"{a}–{b}" for a, b, _ in w]],
                   [["mean training loss (nats/token)", *[f"{m:.2f}" for *_, m in w]]], "l" + "r" * len(w))
    return table + f"\n\nHeld-out bound after {len(r['loss'])} updates: **{r['heldout_elbo']:.2f} nats/token**."


def report_paths(r: dict[str, Any], width: int = 10) -> str:
    paths = r["paths"]
    names = list(paths)
    heads = ["update", *names]
    updates = sorted({p["update"] for rec in paths.values() for p in rec["probes"]})

    def probe(name: str, update: int) -> tuple[dict[str, Any] | None, str]:
        rec = paths[name]
        hit = next((p for p in rec["probes"] if p["update"] == update), None)
        shared = "†" if hit is not None and update <= rec.get("shared_until", -1) else ""
        return hit, shared

    def cells(fmt: Any) -> list[list[str]]:
        rows = []
        for u in updates:
            row = [str(u)]
            for name in names:
                hit, mark = probe(name, u)
                row.append("–" if hit is None else fmt(hit) + mark)
            rows.append(row)
        return rows

    def ppl(p: dict[str, Any]) -> str:
        lo, hi = genppl_interval(p["sample_nll"], p["sample_tokens"])
        return f"{p['genppl']:,.0f} [{lo:,.0f}, {hi:,.0f}]"

    out = []
    width_rows = []
    windows = {n: _window_means(paths[n]["loss"], width) for n in names}
    for i, (a, b, _) in enumerate(windows[names[0]]):
        width_rows.append([f"{a}–{b}", *[f"{windows[n][i][2]:.2f}" for n in names]])
    out.append("Training loss (nats/token), mean over each 10 updates:\n\n" + _table(["updates", *names], width_rows))
    out.append("GenPPL [95 % bootstrap interval over the samples] under the kernel being trained:\n\n"
               + _table(heads, cells(ppl)))
    out.append("Unigram entropy (nats, GPT-2 tokens), mean over the samples:\n\n"
               + _table(heads, cells(lambda p: f"{p['entropy']:.2f}")))
    out.append("Held-out bound (nats/token), mask kernel / uniform kernel:\n\n"
               + _table(heads, cells(lambda p: f"{p['heldout_bound']['mask']:.2f} / "
                                               f"{p['heldout_bound']['uniform']:.2f}")))
    shared = [n for n in names if "shared_until" in paths[n]]
    notes = [f"† {n}: updates 0–{paths[n]['shared_until']} are the run of "
             f"{next(m for m in names if m != n and paths[m]['kernels'][0] == paths[n]['kernels'][0])} "
             "(same seed and kernel)" for n in shared]
    noisy = [n for n in names if n.endswith(")") and "(seed" in n]
    for n in noisy:
        ref = n.split(" (seed")[0]
        if ref not in paths:
            continue
        pairs = [(probe(ref, u)[0], probe(n, u)[0]) for u in updates]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        ratios = [b["genppl"] / a["genppl"] for a, b in pairs]
        dbound = [abs(b["heldout_bound"]["uniform"] - a["heldout_bound"]["uniform"]) for a, b in pairs]
        dent = [abs(b["entropy"] - a["entropy"]) for a, b in pairs]
        wins = zip(_window_means(paths[ref]["loss"], width), _window_means(paths[n]["loss"], width))
        dloss = [abs(a[2] - b[2]) for a, b in wins]
        notes.append(f"Seed noise ({ref}, seed {paths[ref]['seed']} vs {paths[n]['seed']}; other batches, times, "
                     f"corruptions and samples): GenPPL ratio {min(ratios):.2f}–{max(ratios):.2f} over the "
                     f"{len(pairs)} probes, entropy differences up to {max(dent):.2f} nats, uniform-bound "
                     f"differences up to {max(dbound):.2f} nats/token, 10-update loss means differ by up to "
                     f"{max(dloss):.2f}.")
    return "\n\n".join(out + notes)


def report_frontier(r: dict[str, Any]) -> str:
    seeds = r["config"]["seeds"]
    rows = []
    for s in r["summary"]:
        per_seed = {x["seed"]: x["genppl"] for x in r["runs"] if x["steps"] == s["steps"]}
        rows.append([str(s["steps"]), f"{s['genppl_mean']:,.0f} ± {s['genppl_std']:,.0f}",
                     f"{s['entropy_mean']:.3f} ± {s['entropy_std']:.3f}",
                     " / ".join(f"{per_seed[k]:,.0f}" for k in seeds)])
    verdict = "falls" if r["genppl_monotone_in_steps"] else "does not fall monotonically"
    return (_table(["steps", "GenPPL", "unigram entropy (nats)",
                    f"GenPPL per seed ({' / '.join(map(str, seeds))})"], rows, "rrrl")
            + f"\n\nMean GenPPL {verdict} with the number of steps.")


def report_zeroshot(r: dict[str, Any]) -> str:
    tasks = r["tasks"]
    names = list(tasks)
    labels = list(next(iter(tasks.values())))
    rows = []
    for label in labels:
        row = [label]
        for t in names:
            v = tasks[t][label]
            lo, hi = wilson(v["num_correct"], v["n"])
            k = f", K = {v['num_times']}" if v.get("num_times") else ""
            row[0] = label + k if k and k not in row[0] else row[0]
            row.append(f"{v['accuracy']:.3f} ({v['num_correct']}/{v['n']}) [{lo:.2f}, {hi:.2f}]")
        rows.append(row)
    chance = ["chance"] + [f"{_mean([1 / c for c in tasks[t][labels[0]]['num_choices']]):.3f}" for t in names]
    return (_table(["scorer", *names], [*rows, chance])
            + "\n\nAccuracy (correct/items) [95 % Wilson interval].")


RENDER = {"fig2": report_fig2, "adapt": report_adapt, "paths": report_paths, "frontier": report_frontier,
          "zeroshot": report_zeroshot}


def load_results(folder: str | Path) -> dict[str, dict[str, Any]]:
    """The experiments' JSON files in ``folder`` (those present)."""
    folder = Path(folder)
    return {name: json.loads((folder / f"{name}.json").read_text(encoding="utf-8")) for name in EXPERIMENTS
            if (folder / f"{name}.json").is_file()}


def render(folder: str | Path) -> dict[str, str]:
    """``{section: markdown}``: the runs table (``"runs"``) and one block per experiment found in ``folder``."""
    results = load_results(folder)
    if not results:
        raise SystemExit(f"report: no experiment JSON ({', '.join(EXPERIMENTS)}) in {folder}")
    return {"runs": report_runs(results), **{name: RENDER[name](r) for name, r in results.items()}}


def plot_paths(r: dict[str, Any], out_png: Path) -> Path:
    """Loss (10-update means) and GenPPL (with bootstrap intervals) against the update, one line per path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.0, 4.0), dpi=150)
    FigureCanvasAgg(fig)
    ax_loss, ax_ppl = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name, rec in r["paths"].items():
        w = _window_means(rec["loss"], 10)
        line, = ax_loss.plot([b for _, b, _ in w], [m for *_, m in w], marker="o", markersize=3, label=name)
        probes = sorted(rec["probes"], key=lambda p: p["update"])
        x = [p["update"] for p in probes]
        y = [p["genppl"] for p in probes]
        ci = [genppl_interval(p["sample_nll"], p["sample_tokens"]) for p in probes]
        ax_ppl.errorbar(x, y, yerr=[[v - lo for v, (lo, _) in zip(y, ci)], [hi - v for v, (_, hi) in zip(y, ci)]],
                        marker="o", markersize=3, capsize=2, color=line.get_color(), label=name)
    half = len(next(iter(r["paths"].values()))["loss"]) // 2
    for ax in (ax_loss, ax_ppl):
        ax.axvline(half, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("update")
        ax.grid(True, alpha=0.25)
    ax_loss.set_ylabel("training loss, 10-update mean (nats/token)")
    ax_ppl.set_yscale("log")
    ax_ppl.set_ylabel("GenPPL (judge: SmolLM2-135M), 95 % bootstrap")
    ax_ppl.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png)
    return out_png


# a results block of a markdown page: <!-- report:NAME --> ... <!-- /report:NAME -->
PAGE_BLOCK = re.compile(r"(<!-- report:(\w+) -->\n)(.*?)(<!-- /report:\2 -->)", re.S)


def fill_page(page: str, sections: dict[str, str]) -> str:
    """``page`` with every results block replaced by the section of the same name (blocks without one are left
    as they are)."""
    def fill(m: re.Match[str]) -> str:
        name = m[2]
        return m[0] if name not in sections else f"{m[1]}\n{sections[name].strip()}\n\n{m[4]}"

    return PAGE_BLOCK.sub(fill, page)


def run_report(args: argparse.Namespace) -> None:
    """Print the markdown tables rendered from OUT/*.json, write them to OUT/report.md, plot OUT/paths.png and
    OUT/frontier.png (when those results are there) and, with ``--page``, fill that page's results blocks."""
    sections = render(args.out)
    text = "\n\n".join(f"<!-- {name} -->\n{block}" for name, block in sections.items()) + "\n"
    out = Path(args.out)
    (out / "report.md").write_text(text, encoding="utf-8")
    if args.page:
        page = Path(args.page)
        page.write_text(fill_page(page.read_text(encoding="utf-8"), sections), encoding="utf-8")
    results = load_results(out)
    if "paths" in results:
        plot_paths(results["paths"], out / "paths.png")
    if "frontier" in results:
        f = results["frontier"]
        uf.eval.plot_frontier({"label": "adapted", "summary": f["summary"], "runs": f["runs"]}, out / "frontier.png",
                              title=f"GenPPL–entropy frontier, {len(f['config']['seeds'])} seeds × "
                                    f"{f['config']['num_samples']} samples of {f['config']['seq_len']} tokens")
    print(text)


# ------------------------------------------------------------------------------------------------ command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("experiment", choices=[*EXPERIMENTS, "report"])
    parser.add_argument("--out", default="runs/claims", help="output folder (JSON results, checkpoint, plots)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2 (smoke test)")
    parser.add_argument("--backend", choices=["auto", "eager", "compiled"], default="auto",
                        help="how the fused losses and samplers run (uf.backend.set_backend; 'auto' chooses from "
                             "each call's size alone, the same way in every run)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (results are bit-reproducible for a fixed count; default torch's)")
    parser.add_argument("--steps", type=int, default=None,
                        help="updates per run (fig2), per phase (paths) or in all (adapt); default 60/60/200, 3 tiny")
    parser.add_argument("--first", type=int, default=10, help="fig2: window of the early-loss mean")
    parser.add_argument("--anneal-steps", type=int, default=None,
                        help="attention annealing horizon in updates (default: half of --steps for adapt, else "
                             "--steps)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="training precision; auto: bf16 autocast where the CPU computes bf16 natively "
                             "(AVX512-BF16 or AMX), float32 elsewhere; --tiny trains in float32 (default: auto)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None, help="default 64 (16 with --tiny)")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--num-samples", type=int, default=8, help="samples per GenPPL probe / frontier point")
    parser.add_argument("--sample-steps", type=int, default=32, help="paths: sampling steps of the GenPPL probe")
    parser.add_argument("--probe-every", type=int, default=10,
                        help="paths: GenPPL, entropy and held-out bounds at update 0 and every this many updates")
    parser.add_argument("--noise-seeds", type=int, nargs="*", default=[1],
                        help=f"paths: rerun {NOISE_PATH} with each of these seeds (the seed-to-seed noise)")
    parser.add_argument("--eval-blocks", type=int, default=16, help="held-out sequences of the bound probe")
    parser.add_argument("--frontier-steps", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS), help="frontier: sampler seeds")
    parser.add_argument("--resume", action="store_true",
                        help="frontier: keep the complete points of a stopped run's samples file (same numbers)")
    parser.add_argument("--tasks", nargs="*", default=[], help="zeroshot: BIG-bench task.json files")
    parser.add_argument("--adapted", default=None,
                        help="frontier/zeroshot: the adapted checkpoint (default OUT/adapted)")
    parser.add_argument("--max-examples", type=int, default=100, help="zeroshot: examples per task")
    parser.add_argument("--num-times", type=int, default=32, help="zeroshot: time-grid size K of the span score")
    parser.add_argument("--pmi-times", type=int, default=128, help="zeroshot: time-grid size K of Fair-PMI")
    parser.add_argument("--page", default=None,
                        help="report: a markdown page whose <!-- report:NAME --> blocks get the rendered tables")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="training / probe seed")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 3 if args.tiny else {"fig2": 60, "paths": 60, "adapt": 200}.get(args.experiment, 200)
    if args.seq_len is None:
        args.seq_len = 16 if args.tiny else 64
    if args.anneal_steps is None:
        args.anneal_steps = max(1, args.steps // 2) if args.experiment == "adapt" else args.steps
    for name in ("steps", "anneal_steps", "probe_every", "num_samples", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads: expected a positive integer, got {args.threads}")
    if args.tiny:
        args.eval_blocks = min(args.eval_blocks, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.experiment == "report":
        run_report(args)
        return 0
    uf.backend.set_backend(args.backend)  # explicit, so UNIFUSION_BACKEND in the environment does not change results
    if args.threads is not None:
        torch.set_num_threads(args.threads)
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
