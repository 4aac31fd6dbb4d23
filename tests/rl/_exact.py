"""Exact quantities of tiny models by enumeration (completions of at most 8 tokens): the mask kernel's ELBO, the block
ELBO and the any-order log-likelihood, from one forward over every mask of the completion. Float64 throughout."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import numpy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hf_tiny import tiny_diffusion_gemma as hf_tiny_diffusion_gemma  # noqa: E402
from _hf_tiny import tiny_model  # noqa: E402

import unifusion as uf  # noqa: E402

MASK = 3


def adapted(seed: int = 0, **kw: object) -> uf.DiffusionLM:
    """A tiny random llama adapted as a mask-kernel diffusion LM (mask token 3)."""
    return uf.adapt_ar_model(tiny_model("llama", seed=seed), mask_token_id=MASK, **kw).eval()


def subset_log_probs(model, x0: torch.Tensor, positions: list[int], clean: bool = False
                     ) -> dict[frozenset[int], torch.Tensor]:
    """For every subset M of ``positions``: ``log p(x0_i | x0 with M masked)`` for all i, float64 ``(L,)``
    (MDLM's SUBS convention: the mask logit is left out). ``x0`` is one row ``(L,)``."""
    subsets = [frozenset(c) for r in range(len(positions) + 1) for c in itertools.combinations(positions, r)]
    x_t = x0.repeat(len(subsets), 1)
    for j, M in enumerate(subsets):
        x_t[j, sorted(M)] = MASK
    t = torch.full((len(subsets),), 0.5)
    extra = {"clean": x0.repeat(len(subsets), 1)} if clean else {}
    with torch.no_grad():
        logits = model(x_t, t, **extra).double()
    logits[..., MASK] = -math.inf
    lp = torch.log_softmax(logits, -1).gather(-1, x0.repeat(len(subsets), 1)[..., None])[..., 0]
    return {M: lp[j] for j, M in enumerate(subsets)}


def exact_elbo(lp: dict[frozenset[int], torch.Tensor], positions: list[int]) -> float:
    """Σ_{M ≠ ∅} (l − 1)! (n − l)! / n! Σ_{i∈M} log p(x_i | x_¬M)."""
    n = len(positions)
    total = 0.0
    for M, v in lp.items():
        l_ = len(M)
        if l_:
            total += math.factorial(l_ - 1) * math.factorial(n - l_) / math.factorial(n) * float(v[sorted(M)].sum())
    return total


def exact_log_likelihood(lp: dict[frozenset[int], torch.Tensor], positions: list[int]) -> float:
    """log E_order Π_k p(x_{σ(k)} | revealed), by dynamic programming over revealed sets S:
    g(S) = mean_{i ∉ S} p(x_i | S revealed, the rest masked) · g(S ∪ {i}), g(all) = 1."""
    full = frozenset(positions)
    log_g: dict[frozenset[int], float] = {full: 0.0}
    for r in range(len(positions) - 1, -1, -1):
        for S in map(frozenset, itertools.combinations(positions, r)):
            masked = full - S
            terms = [float(lp[masked][i]) + log_g[S | {i}] for i in masked]
            log_g[S] = torch.logsumexp(torch.tensor(terms, dtype=torch.float64), 0).item() - math.log(len(masked))
    return log_g[frozenset()]


def exact_mean_field(lp: dict[frozenset[int], torch.Tensor], positions: list[int]) -> float:
    """Σ_i log p(x_i | prompt, completion all masked)."""
    return float(lp[frozenset(positions)][positions].sum())


def mean_and_se(values: torch.Tensor) -> tuple[float, float]:
    v = values.double()
    return float(v.mean()), float(v.std() / math.sqrt(v.numel()))


def generators(count: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 100_003 + i) for i in range(count)]


def tiny_diffusion_gemma(canvas_length: int = 4) -> uf.hf.diffusion_gemma.DiffusionGemmaLM:
    """A random DiffusionGemma (2 layers, 2 experts, vocabulary 128), wrapped."""
    return uf.wrap_diffusion_lm(hf_tiny_diffusion_gemma(canvas_length, num_experts=2, top_k_experts=1))


def sharpened(seed: int = 0, **kw: object) -> uf.DiffusionLM:
    """:func:`adapted` with its embeddings and head ×8 and its projections ×2: predictions that depend strongly on
    what each position sees (a random tiny model is nearly uniform, which hides which tokens a prediction saw)."""
    model = adapted(seed, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name or "lm_head" in name:
                p.mul_(8.0)
            elif "proj" in name:
                p.mul_(2.0)
    return model


def decoder_block_log_probs(model, x0: torch.Tensor, lo: int, hi: int) -> dict[frozenset[int], torch.Tensor]:
    """For every subset M of the block ``[lo, hi)``: ``log p(x0_i | x0[:lo] clean, the block with M masked)`` at the
    block's positions (0 elsewhere), float64 ``(L,)``, computed by the decoder ``generate`` samples with (the block
    model's exact KV-cache decoder: the prefix ``x0[:lo]`` prefilled as the prompt, one denoising step on the
    block). ``x0`` is one row ``(L,)``; the mask logit is left out."""
    positions = list(range(lo, hi))
    subsets = [frozenset(c) for r in range(len(positions) + 1) for c in itertools.combinations(positions, r)]
    S = len(subsets)
    block = x0[lo:hi].repeat(S, 1)
    for j, M in enumerate(subsets):
        block[j, [m - lo for m in sorted(M)]] = MASK
    decoder = model.block_decoder()
    with torch.no_grad():
        state = decoder.start_blocks(x0[:lo].repeat(S, 1), torch.ones(S, lo, dtype=torch.bool))
        logits = decoder.denoise_block(state, block, torch.full((S,), 0.5), torch.arange(S), None).double()
    logits[..., MASK] = -math.inf
    lp = torch.log_softmax(logits, -1).gather(-1, x0[lo:hi].repeat(S, 1)[..., None])[..., 0]
    full = torch.zeros(S, x0.shape[0], dtype=torch.float64)
    full[:, lo:hi] = lp
    return {M: full[j] for j, M in enumerate(subsets)}


def truncated_elbo(lp: dict[frozenset[int], torch.Tensor], positions: list[int], t_min: float) -> float:
    """The mask-kernel ELBO (linear schedule) over times ``[t_min, 1]`` only: ``Σ_{M ≠ ∅} Σ_{i∈M} log p(x_i | x_¬M)
    ∫_{t_min}^1 t^{l−1} (1 − t)^{n−l} dt`` (``(1/t)`` times the probability of the mask M at time t; Gauss–Legendre
    with 16 nodes is exact for these polynomials). ``t_min = 0`` gives :func:`exact_elbo`."""
    n = len(positions)
    nodes, weights = numpy.polynomial.legendre.leggauss(16)
    t = (1 + t_min) / 2 + (1 - t_min) / 2 * nodes
    w = weights * (1 - t_min) / 2
    total = 0.0
    for M, v in lp.items():
        l_ = len(M)
        if l_:
            total += float((w * t ** (l_ - 1) * (1 - t) ** (n - l_)).sum()) * float(v[sorted(M)].sum())
    return total
