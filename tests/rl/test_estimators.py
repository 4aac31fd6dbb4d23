"""Mask plans: per-row randomness, the masks each estimator draws, and how log-probs combine."""

from __future__ import annotations

import math

import pytest
import torch

import unifusion as uf
from unifusion.rl.estimators import combine_logps, gauss_legendre, plan_masks


def _completion(B: int = 3, L: int = 10, starts: tuple[int, ...] = (2, 4, 6)) -> torch.Tensor:
    c = torch.zeros(B, L, dtype=torch.bool)
    for b, s in enumerate(starts[:B]):
        c[b, s:] = True
    return c


@pytest.mark.parametrize("estimator", ["elbo_discrete", "coupled", "quadrature", "mean_field", "eubo"])
def test_a_rows_masks_do_not_depend_on_its_neighbours_or_the_split(estimator):
    c = _completion()
    full = plan_masks(estimator, c, num_samples=2, generator=torch.Generator().manual_seed(5))
    for lo, hi in ((0, 1), (1, 3)):  # the same batch split over two "ranks"
        part = plan_masks(estimator, c[lo:hi], num_samples=2, generator=torch.Generator().manual_seed(5),
                          row_offset=lo)
        assert torch.equal(part.noised, full.noised[:, lo:hi]) and torch.equal(part.coef, full.coef[:, lo:hi])
    other = c.clone()
    other[0] = True  # a different neighbour
    moved = plan_masks(estimator, other, num_samples=2, generator=torch.Generator().manual_seed(5))
    assert torch.equal(moved.noised[:, 1:], full.noised[:, 1:])
    again = plan_masks(estimator, c, num_samples=2, generator=torch.Generator().manual_seed(5))
    assert torch.equal(again.noised, full.noised) and torch.equal(again.t, full.t)  # same seed, same plan


def test_a_list_of_generators_is_one_per_row():
    c = _completion()
    a = plan_masks("elbo_discrete", c, generator=[torch.Generator().manual_seed(i) for i in range(3)])
    b = plan_masks("elbo_discrete", c[1:], generator=[torch.Generator().manual_seed(i) for i in range(1, 3)])
    assert torch.equal(a.noised[:, 1:], b.noised)


def test_masks_stay_inside_the_completion_and_have_their_counts():
    c = _completion()
    n = c.sum(-1)
    g = torch.Generator().manual_seed(0)
    p = plan_masks("elbo_discrete", c, num_samples=4, generator=g)
    assert not (p.scored & ~c).any()
    count = p.scored.sum(-1)  # (K, B)
    assert ((count >= 1) & (count <= n)).all()
    assert torch.allclose(p.coef, n / (4 * count.double()))
    q = plan_masks("coupled", c, num_samples=2, generator=g)
    pair = q.scored[:2] | q.scored[2:]  # every token scored once per pair (ties have probability 0)
    assert torch.equal(pair, c[None].expand(2, -1, -1)) and not (q.scored[:2] & q.scored[2:]).any()
    f = plan_masks("coupled", c, generator=g, t_range=(0.2, 0.8), fully_masked=True)
    assert f.num_passes == 3 and torch.equal(f.scored[2], c) and ((f.t[0] >= 0.2) & (f.t[0] <= 0.8)).all()
    m = plan_masks("mean_field", c, generator=g, prompt_mask_prob=1.0)
    assert m.noised.all() and torch.equal(m.scored[0], c)


def test_gdpo_counts_round_the_node_times():
    c = _completion(1, 12, (2,))
    p = plan_masks("quadrature", c, num_samples=2, generator=torch.Generator().manual_seed(0))
    nodes, weights = gauss_legendre(2)
    assert torch.equal(p.scored.sum(-1)[:, 0], torch.tensor([round(10 * t) for t in nodes]))
    assert torch.allclose(p.coef[:, 0], torch.tensor(weights / nodes, dtype=torch.float64))


def test_gauss_legendre_integrates_polynomials_of_degree_2k_minus_1():
    t, w = gauss_legendre(3)
    for d in range(6):
        assert abs(float((w * t ** d).sum()) - 1 / (d + 1)) < 1e-12


def test_combine_is_linear_or_spg_eubo():
    c = _completion(2, 6, (2, 3))
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(3, 2, 6, generator=g, dtype=torch.float64)
    p = plan_masks("elbo_discrete", c, num_samples=3, generator=g)
    want = (p.coef[..., None] * torch.where(p.scored, lp, 0)).sum(0)
    assert torch.allclose(combine_logps(p, lp), want)
    e = plan_masks("eubo", c, num_samples=3, generator=g, eubo_beta=1.5)
    got = combine_logps(e, lp)
    for b in range(2):
        for i in range(6):
            hit = e.scored[:, b, i]
            if not hit.any():
                assert got[b, i] == 0
                continue
            inner = sum(float(e.coef[k, b]) * math.exp(1.5 * float(lp[k, b, i])) for k in range(3) if hit[k]) / 3
            assert abs(float(got[b, i]) - math.log(inner) / 1.5) < 1e-12


def test_bad_plans_name_the_argument():
    c = _completion()
    with pytest.raises(ValueError, match="num_samples"):
        plan_masks("coupled", c, num_samples=0)
    with pytest.raises(ValueError, match="completion_mask"):
        plan_masks("coupled", c & False)
    with pytest.raises(ValueError, match="estimator"):
        plan_masks("elbo", c)
    with pytest.raises(ValueError, match="t_range"):
        plan_masks("coupled", c, t_range=(0.8, 0.2))
    with pytest.raises(ValueError, match="eubo_beta"):
        plan_masks("eubo", c, eubo_beta=0.0)
    with pytest.raises(ValueError, match="generator"):
        plan_masks("eubo", c, generator=[torch.Generator()])
    assert uf.rl.ESTIMATORS[0] == "elbo"
