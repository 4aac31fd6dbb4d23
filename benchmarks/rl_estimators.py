"""Bias, spread and cost of every sequence_logprob estimator on a real model: SmolLM2-135M-Instruct (the embedded
default, adapted with a new mask token; not trained as a diffusion model), one prompt and one completion, many seeds.

    python benchmarks/rl_estimators.py [--seeds 64] [--reference 16]

Each estimator runs on ``--seeds`` copies of the one row, one generator per copy (rows draw independently): the mean
and standard deviation over copies are those of independent estimates. The reference is the mask-kernel ELBO,
``elbo_discrete`` with ``--reference`` samples per copy (its standard error is printed). "Bias" is mean − reference,
with the standard error of that difference. The second table: the spread of log π' − log π for π' a copy of the model
with its weights perturbed by 10⁻³ relative noise (what an importance ratio uses), with the same seeds for both
policies (shared masks) and with different seeds (independent masks), at the same forward count.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch

import unifusion as uf
from unifusion.hf.embedded import load_smollm2, load_smollm2_tokenizer

PROMPT = "Question: Tom has 12 apples and buys 7 more. How many apples does he have now?\nAnswer:"
COMPLETION = " He has 12 + 7 = 19 apples."

ESTIMATORS: list[tuple[str, str, int, dict]] = [
    ("elbo", "K=1", 1, {}),
    ("elbo", "K=4", 4, {}),
    ("elbo_discrete", "K=1", 1, {}),
    ("elbo_discrete", "K=4", 4, {}),
    ("coupled", "K=1, t in (0, 1)", 1, {}),
    ("coupled", "DiffuCoder: t in (0.2, 0.8), + fully masked", 1, {"t_range": (0.2, 0.8), "fully_masked": True}),
    ("quadrature", "GDPO: 2 nodes, exact counts", 2, {}),
    ("quadrature", "n/2 nodes, Bernoulli masks", 0, {"masks": "bernoulli"}),
    ("mean_field", "d1: prompt masked w.p. 0.15", 1, {}),
    ("mean_field", "prompt kept clean", 1, {"prompt_mask_prob": 0.0}),
    ("eubo", "SPG: K=4, eubo_beta=1.5", 4, {"eubo_beta": 1.5}),
]


def gens(count: int, seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(count)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=32)
    p.add_argument("--reference", type=int, default=8)
    a = p.parse_args()
    torch.set_num_threads(2)
    tok = load_smollm2_tokenizer()
    model = uf.adapt_ar_model(load_smollm2(), tokenizer=tok).eval()
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    completion = tok(COMPLETION, add_special_tokens=False)["input_ids"]
    ids = torch.tensor(prompt + completion)
    n = len(completion)
    R = a.seeds
    rows = ids.repeat(R, 1)
    comp = torch.zeros(R, ids.numel(), dtype=torch.bool)
    comp[:, len(prompt):] = True
    print(f"# SmolLM2-135M-Instruct (adapted, mask token added), prompt {len(prompt)} tokens, completion n = {n}, "
          f"{R} seeds, cpu {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")

    def run(m, estimator, K, seed, **opts):
        with torch.no_grad():
            start = time.perf_counter()
            out = uf.rl.sequence_logprob(m, rows, comp, estimator=estimator, num_samples=K,
                                         generator=gens(R, seed), **opts)
            return out.sequence.double(), out.num_forwards, time.perf_counter() - start

    ref, _, _ = run(model, "elbo_discrete", a.reference, 999)
    ref_mean, ref_se = float(ref.mean()), float(ref.std() / math.sqrt(R))
    print(f"# reference ELBO (elbo_discrete, K={a.reference}): {ref_mean:.3f} ± {ref_se:.3f} (standard error)")
    print()
    print("| estimator | setting | forwards | mean | bias vs ELBO | std over seeds | s per call of "
          f"{R} rows |")
    print("|---|---|---|---|---|---|---|")
    for estimator, label, K, opts in ESTIMATORS:
        K = K or -(-n // 2)
        est, fwd, sec = run(model, estimator, K, 1, **opts)
        mean, std = float(est.mean()), float(est.std())
        se = math.hypot(std / math.sqrt(R), ref_se)
        print(f"| `{estimator}` | {label} | {fwd} | {mean:.3f} | {mean - ref_mean:+.3f} ± {se:.3f} | {std:.3f} | "
              f"{sec:.1f} |", flush=True)

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for q in other.parameters():
            q.mul_(1.0 + 1e-3 * torch.randn(q.shape, generator=g))
    print()
    print("| estimator | forwards per policy | std of log π' − log π, shared masks | independent masks |")
    print("|---|---|---|---|")
    for estimator, K, opts in (("elbo", 2, {}), ("elbo_discrete", 2, {}), ("coupled", 1, {})):
        base, fwd, _ = run(model, estimator, K, 1, **opts)
        shared, _, _ = run(other, estimator, K, 1, **opts)
        indep, _, _ = run(other, estimator, K, 2, **opts)
        print(f"| `{estimator}` | {fwd} | {float((shared - base).std()):.4f} | {float((indep - base).std()):.4f} |",
              flush=True)


if __name__ == "__main__":
    main()
