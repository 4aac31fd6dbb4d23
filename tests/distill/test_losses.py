"""Certainty forcing (dParallel) and the KL to a teacher, on logits and through the fused output head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

import unifusion as uf
from unifusion.distill import (
    certainty_forcing_loss,
    certainty_forcing_terms,
    fused_certainty_forcing_loss,
    teacher_kl_loss,
)

FIXTURE = Path(__file__).parent / "fixtures" / "dparallel_compute_loss.safetensors"


def _cases():
    with safe_open(str(FIXTURE), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return meta, {name: ({k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(name + ".")}, opts)
                  for name, opts in json.loads(meta["cases"]).items()}


META, CASES = _cases()


def test_fixture_records_its_source():
    assert META["repo"] == "czg1225/dParallel" and META["licence"] == "MIT" and len(META["commit"]) == 40
    assert META["function"] == "DLMTrainer.compute_loss"


@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_dparallels_compute_loss_run_unmodified(name):
    """The complementary pair is two calls; the total and its gradients equal dParallel's compute_loss on the same
    fixed logits and the masks its forward_process_semi_ar drew."""
    case, opts = CASES[name]
    z1 = case["logits"].clone().requires_grad_(True)
    z2 = case["logits_rev"].clone().requires_grad_(True)
    y = case["input_ids"]
    total = (certainty_forcing_loss(z1, y, case["masked"], **opts)
             + certainty_forcing_loss(z2, y, case["masked_rev"], **opts))
    torch.testing.assert_close(total.detach(), case["loss"], rtol=1e-9, atol=1e-9)
    g1, g2 = torch.autograd.grad(total, (z1, z2))
    torch.testing.assert_close(g1, case["grad_logits"], rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(g2, case["grad_logits_rev"], rtol=1e-7, atol=1e-9)


def _view(seed=0, B=3, L=10, S=12, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, S, (B, L), generator=g)
    z = torch.randn(B, L, S, generator=g, dtype=dtype) * 2
    z.scatter_add_(-1, y[..., None], torch.where(torch.rand(B, L, 1, generator=g) < 0.5, 5.0, 0.0).to(dtype))
    masked = torch.rand(B, L, generator=g) < 0.6
    return z, y, masked


def test_entropy_gradient_is_zero_at_wrong_and_unmasked_positions():
    z, y, masked = _view()
    z.requires_grad_(True)
    terms = certainty_forcing_terms(z, y, masked)
    (grad,) = torch.autograd.grad(terms.entropy.sum(), z)
    certain = masked & (z.detach().argmax(-1) == y)
    assert certain.any() and (masked & ~certain).any() and (~masked).any()
    assert grad[~certain].abs().max() == 0
    assert grad[certain].abs().amax(-1).min() > 0
    # the whole loss: unmasked positions get no gradient at all
    (full,) = torch.autograd.grad(certainty_forcing_loss(z, y, masked), z)
    assert full[~masked].abs().max() == 0


def test_terms_are_the_per_position_form_of_the_loss():
    z, y, masked = _view(1)
    t = certainty_forcing_terms(z, y, masked, temperature=0.7, entropy_weight=1.5)
    assert torch.equal(t.certain, masked & (z.argmax(-1) == y))
    ce = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), reduction="none")
    torch.testing.assert_close(t.cross_entropy, torch.where(masked, ce.view_as(y), 0.0))
    p = torch.softmax(z / 0.7, -1)
    H = -(p * p.log()).sum(-1)
    torch.testing.assert_close(t.entropy, torch.where(t.certain, H, 0.0))
    want = ce.view_as(y)[masked].mean() + 1.5 * H[t.certain].mean()
    torch.testing.assert_close(t.loss(), want)


def test_mask_id_leaves_the_mask_column_out():
    z, y, masked = _view(2)
    y = torch.where(y == 3, 4, y)
    z[..., 3] = 50.0  # the mask token would win every argmax
    with_col = certainty_forcing_terms(z, y, masked)
    without = certainty_forcing_terms(z, y, masked, mask_id=3)
    assert not with_col.certain.any() and without.certain.any()
    keep = [i for i in range(z.shape[-1]) if i != 3]
    ref = certainty_forcing_terms(z[..., keep], torch.where(y > 3, y - 1, y), masked)
    torch.testing.assert_close(without.loss(), ref.loss())


def test_empty_views_give_zero_with_a_gradient():
    z, y, _ = _view(3)
    z.requires_grad_(True)
    loss = certainty_forcing_loss(z, y, torch.zeros_like(y, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0 and z.grad is not None and z.grad.abs().max() == 0


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=0.0), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(entropy_weight=-0.1), "entropy_weight"), (dict(temperature=float("nan")), "temperature")])
def test_bad_options_name_the_argument(kwargs, name):
    z, y, masked = _view()
    with pytest.raises(ValueError, match=name):
        certainty_forcing_loss(z, y, masked, **kwargs)
    with pytest.raises(ValueError, match=name):
        fused_certainty_forcing_loss(torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long),
                                     torch.ones(2, dtype=torch.bool), **kwargs)


def test_bad_shapes_name_the_argument():
    z, y, masked = _view()
    with pytest.raises(ValueError, match="targets"):
        certainty_forcing_loss(z, y[:, :-1], masked)
    with pytest.raises(ValueError, match="masked"):
        certainty_forcing_loss(z, y, masked.long())
    with pytest.raises(ValueError, match="targets"):
        certainty_forcing_loss(z, torch.where(masked, 99, y), masked)
    with pytest.raises(ValueError, match="targets"):
        certainty_forcing_loss(z, torch.where(masked, 3, y), masked, mask_id=3)
    with pytest.raises(ValueError, match="targets"):
        fused_certainty_forcing_loss(torch.randn(2, 4), torch.randn(5, 4), torch.tensor([3, 1]),
                                     torch.ones(2, dtype=torch.bool), mask_id=3)


def test_teacher_kl():
    zs, _, pos = _view(4)
    zt, _, _ = _view(5)
    zs.requires_grad_(True)
    kl = teacher_kl_loss(zs, zt, pos, temperature=2.0)
    p, q = torch.softmax(zt / 2, -1), torch.softmax(zs.detach() / 2, -1)
    want = (p * (p.log() - q.log())).sum(-1)[pos].mean()
    torch.testing.assert_close(kl.detach(), want)
    rev = teacher_kl_loss(zs, zt, pos, temperature=2.0, direction="reverse", reduction="none")
    torch.testing.assert_close(rev.detach(), torch.where(pos, (q * (q.log() - p.log())).sum(-1), 0.0))
    assert teacher_kl_loss(zt, zt, pos).abs().item() < 1e-12
    (g,) = torch.autograd.grad(kl, zs)
    assert g[~pos].abs().max() == 0
    with pytest.raises(ValueError, match="teacher_logits"):
        teacher_kl_loss(zs, zt[:, :-1], pos)


# -------------------------------------------------------------------------------------------------------------
# the fused path


class _LargestOutput(TorchDispatchMode):
    """The largest number of rows of any op output with the vocabulary as its last dimension."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("head", ["plain", "bias_scale_softcap"])
def test_fused_equals_the_logits_path_in_float64_and_holds_no_full_logits(head):
    g = torch.Generator().manual_seed(0)
    B, L, d, S, chunk = 3, 20, 8, 64, 9
    h = torch.randn(B, L, d, generator=g, dtype=torch.float64, requires_grad=True)
    W = (torch.randn(S, d, generator=g, dtype=torch.float64) * 0.8).requires_grad_(True)
    y = torch.randint(6, S, (B, L), generator=g)  # never the mask id 5
    with torch.no_grad():  # make some masked predictions right, so the entropy term is live
        W[y[0, :6]] += 3.0 * h[0, :6].detach()
    masked = torch.rand(B, L, generator=g) < 0.7
    opts: dict = dict(temperature=0.6, entropy_weight=1.7, mask_id=5)
    if head != "plain":
        b = (torch.randn(S, generator=g, dtype=torch.float64) * 0.1).requires_grad_(True)
        opts.update(lm_head_bias=b, logit_scale=0.9, final_logit_softcap=6.0)
    leaves = [h, W] + ([opts["lm_head_bias"]] if head != "plain" else [])

    def logits_path():
        z = h @ W.T
        if head != "plain":
            z = (z + opts["lm_head_bias"]) * 0.9
            z = 6.0 * torch.tanh(z / 6.0)
        return certainty_forcing_loss(z, y, masked, temperature=0.6, entropy_weight=1.7, mask_id=5)

    ref = logits_path()
    ref_grads = torch.autograd.grad(ref, leaves)
    assert certainty_forcing_terms((h @ W.T).detach(), y, masked, mask_id=5).certain.any()
    meter = _LargestOutput(S)
    with meter:
        fused = fused_certainty_forcing_loss(h, W, y, masked, chunk_size=chunk, **opts)
        grads = torch.autograd.grad(fused, leaves)
    torch.testing.assert_close(fused, ref, rtol=1e-12, atol=1e-12)
    for a, b_ in zip(grads, ref_grads):
        torch.testing.assert_close(a, b_, rtol=1e-10, atol=1e-12)
    assert 0 < meter.rows <= chunk < masked.sum()  # blocks of logits only (W.T has d = 8 rows)


def test_fused_entropy_gradient_is_zero_at_wrong_and_unmasked_rows():
    g = torch.Generator().manual_seed(1)
    N, d, S = 30, 6, 20
    h = torch.randn(N, d, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(S, d, generator=g, dtype=torch.float64)
    y = torch.where(torch.rand(N, generator=g) < 0.5, (h.detach() @ W.T).argmax(-1), torch.randint(0, S, (N,),
                                                                                                   generator=g))
    masked = torch.rand(N, generator=g) < 0.7
    with_entropy = fused_certainty_forcing_loss(h, W, y, masked, entropy_weight=2.0, chunk_size=4)
    ce_only = fused_certainty_forcing_loss(h, W, y, masked, entropy_weight=0.0, chunk_size=4)
    (g1,) = torch.autograd.grad(with_entropy, h)
    (g0,) = torch.autograd.grad(ce_only, h)
    certain = masked & ((h.detach() @ W.T).argmax(-1) == y)
    assert certain.any() and (masked & ~certain).any()
    diff = (g1 - g0).abs().amax(-1)
    assert diff[~certain].max() == 0 and diff[certain].min() > 0
    assert g1[~masked].abs().max() == 0


def test_fused_float32_matches_and_frozen_head():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(40, 16, generator=g, requires_grad=True)
    W = torch.randn(100, 16, generator=g)
    y = torch.randint(0, 100, (40,), generator=g)
    masked = torch.rand(40, generator=g) < 0.5
    fused = fused_certainty_forcing_loss(h, W, y, masked)
    ref = certainty_forcing_loss(h @ W.T, y, masked)
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    (gh,) = torch.autograd.grad(fused, h)
    (rh,) = torch.autograd.grad(ref, h)
    torch.testing.assert_close(gh, rh, rtol=1e-4, atol=1e-6)
    assert uf.distill.default_rows_per_block(262144) == 32
