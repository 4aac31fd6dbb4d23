"""Complementary masking (diffusion_loss(..., complementary=True)): shapes, the pair's partition of the tokens, and an
unbiased ELBO estimate checked against the exact ELBO enumerated over all masks on a tiny model."""

from __future__ import annotations

import itertools
import math
import os
import sys

import pytest
import torch

import unifusion as uf
from unifusion.training import complement_time

sys.path.insert(0, os.path.dirname(__file__))
from _hf_tiny import tiny_model  # noqa: E402

MASK_ID = 3


def _model(block_size: int | None = None) -> uf.DiffusionLM:
    return uf.adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, block_size=block_size)


def _x0(B: int = 1, L: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 128, (B, L), generator=torch.Generator().manual_seed(seed))


def _masked_nll(model: uf.DiffusionLM, x_t: torch.Tensor, x0: torch.Tensor, **kwargs) -> torch.Tensor:
    """−log p_θ(x0_i | x_t) at every position, the mask state excluded from the softmax (SUBS), float64."""
    with torch.no_grad():
        logits = model(x_t, torch.full((x_t.shape[0],), 0.5), **kwargs).double()
    logits[..., MASK_ID] = -math.inf
    return -logits.log_softmax(-1).gather(-1, x0[..., None])[..., 0]


def _exact_elbo(model: uf.DiffusionLM, x0: torch.Tensor, span: range, **kwargs) -> float:
    """Σ_M (l−1)!(n−l)!/n! Σ_{i∈M} −log p_θ(x0_i | x0 with M masked), over the non-empty masks M of ``span``."""
    n = len(span)
    masks = [m for r in range(1, n + 1) for m in itertools.combinations(span, r)]
    x_t = x0.repeat(len(masks), 1)
    for row, m in enumerate(masks):
        x_t[row, list(m)] = MASK_ID
    if "clean" in kwargs:
        kwargs["clean"] = kwargs["clean"].expand_as(x_t)
    nll = _masked_nll(model, x_t, x0.expand_as(x_t), **kwargs)
    total = 0.0
    for row, m in enumerate(masks):
        l = len(m)  # noqa: E741
        total += math.factorial(l - 1) * math.factorial(n - l) / math.factorial(n) * nll[row, list(m)].sum().item()
    return total


def _estimates(model: uf.DiffusionLM, x0: torch.Tensor, kernel: uf.MaskKernel, seeds: int, B: int) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for seed in range(seeds):
            r = uf.diffusion_loss(model, x0.expand(B, -1), kernel, complementary=True,
                                  generator=torch.Generator().manual_seed(seed))
            out.append(r.loss.double().sum() / (2 * B))  # the pair average, per sequence
    return torch.stack(out)


def test_pair_shapes_partition_and_token_count() -> None:
    model, kernel = _model(), uf.MaskKernel(128, MASK_ID)
    x0 = _x0(B=3, L=6)
    pad = torch.ones_like(x0)
    pad[2, 4:] = 0
    out = uf.diffusion_loss(model, x0, kernel, complementary=True, attention_mask=pad,
                            generator=torch.Generator().manual_seed(0))
    assert out.loss.shape == out.mask.shape == out.x_t.shape == (6, 6) and out.t.shape == (6,)
    torch.testing.assert_close(out.t[3:], 1.0 - out.t[:3])  # linear schedule: t' = 1 − t
    first, second = out.x_t[:3] == MASK_ID, out.x_t[3:] == MASK_ID
    real = pad.bool()
    assert torch.equal(first ^ second, real)  # every real token masked in exactly one half
    assert not (first | second)[~real].any()  # padding never masked
    assert torch.equal(out.mask, pad.repeat(2, 1).float()) and out.num_tokens.item() == 2 * pad.sum().item()
    assert torch.equal(out.loss != 0, torch.cat([first, second]))  # scored exactly where masked


@pytest.mark.parametrize("schedule", [uf.schedules.LinearSchedule(), uf.schedules.CosineSchedule()])
def test_unbiased_against_the_enumerated_elbo(schedule) -> None:
    """The ELBO does not depend on the schedule; the cosine one exercises the second half's weight α'_t / α'_t'."""
    model, kernel = _model(), uf.MaskKernel(128, MASK_ID, schedule)
    x0 = _x0(L=5)
    exact = _exact_elbo(model, x0, range(5))
    est = _estimates(model, x0, kernel, seeds=40, B=16)
    sem = est.std() / math.sqrt(len(est))
    assert abs(est.mean().item() - exact) < 4 * sem.item(), (est.mean().item(), exact, sem.item())


def test_a_block_model_complements_each_blocks_time_and_mask() -> None:
    model, kernel = _model(block_size=3), uf.MaskKernel(128, MASK_ID)
    x0 = _x0(L=6, seed=1)
    out = uf.diffusion_loss(model, x0.expand(2, -1), kernel, complementary=True,
                            generator=torch.Generator().manual_seed(0))
    assert out.t.shape == (4, 2)
    torch.testing.assert_close(out.t[2:], 1.0 - out.t[:2])
    assert torch.equal((out.x_t[:2] == MASK_ID) ^ (out.x_t[2:] == MASK_ID), torch.ones(2, 6, dtype=torch.bool))
    # exact: Σ over blocks of the block's ELBO given its clean prefix (the block-causal forward; later blocks clean)
    exact = sum(_exact_block_elbo(model, x0, b) for b in (0, 3))
    est = _estimates(model, x0, kernel, seeds=40, B=16)
    sem = est.std() / math.sqrt(len(est))
    assert abs(est.mean().item() - exact) < 4 * sem.item(), (est.mean().item(), exact, sem.item())


def _exact_block_elbo(model: uf.DiffusionLM, x0: torch.Tensor, start: int) -> float:
    """The block [start, start+3)'s enumerated ELBO: its predictions see the clean prefix and the block's own noise."""
    return _exact_elbo(model, x0, range(start, start + 3), clean=x0)


@pytest.mark.parametrize("schedule", [uf.schedules.CosineSchedule(), uf.schedules.LinearSchedule()])
def test_complement_time_inverts_the_keep_probability(schedule) -> None:
    t = torch.tensor([0.01, 0.1, 0.5, 0.9, 0.99], dtype=torch.float64)
    torch.testing.assert_close(schedule.one_minus_alpha(complement_time(schedule, t)), schedule.alpha(t))


def test_complementary_needs_a_mask_kernel_and_elbo_weights() -> None:
    model = _model()
    with pytest.raises(ValueError, match="complementary: expected a MaskKernel.*got UniformKernel"):
        uf.diffusion_loss(model, _x0(), uf.UniformKernel(128), complementary=True)
    with pytest.raises(ValueError, match="complementary: .*weighting='elbo'.*'clip'"):
        uf.diffusion_loss(model, _x0(), uf.MaskKernel(128, MASK_ID), complementary=True, weighting="clip")
    with pytest.raises(TypeError, match="complementary: expected a bool, got int"):
        uf.diffusion_loss(model, _x0(), uf.MaskKernel(128, MASK_ID), complementary=1)
