"""unifusion.hf.ar.head: the adapted model's output head, on every registered family (tiny random models,
tests/_hf_tiny.py)."""

from __future__ import annotations

import math

import pytest
import torch
from _hf_tiny import FAMILIES, random_ids, tiny_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import unifusion as uf
from unifusion.hf import adapt_ar_model
from unifusion.hf.ar import head

L = 8  # sequence length of the tests (network length L + 1 = 9 > the sliding windows of 4 in _hf_tiny)
MASK_ID = 3


class _OutputShapes(TorchDispatchMode):
    """The shapes of every tensor an op returns (forward and autograd's backward on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.seen.append(tuple(x.shape))
        return out


def test_logits_to_keep_is_read_from_the_forward_signature_once_per_class() -> None:
    class Current:
        def forward(self, input_ids, logits_to_keep=0): ...

    class Older:  # an int-only num_logits_to_keep: the backbone-then-head path
        def forward(self, input_ids, num_logits_to_keep=0): ...

    assert head.takes_logits_to_keep(Current) and not head.takes_logits_to_keep(Older)
    Current.forward = Older.forward  # type: ignore[method-assign]
    assert head.takes_logits_to_keep(Current)  # the answer is kept per class (a traced step reads it as a constant)


@pytest.mark.parametrize("model_type", FAMILIES)
class TestHead:
    @torch.no_grad()
    def test_hidden_states_then_head_equals_forward(self, model_type: str) -> None:
        model = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID)
        x = random_ids()
        for gamma in (0.0, 1.0):
            h = model.hidden_states(x, bidirectional_prob=gamma)
            assert h.shape == (2, L, model.lm_head_weight.shape[1])
            assert model.lm_head_weight.shape[0] == model.vocab_size
            torch.testing.assert_close(model.logits_from_hidden(h), model(x, bidirectional_prob=gamma),
                                       rtol=1e-5, atol=1e-5)

    def test_head_fn_takes_the_heads_place_on_the_forwards_hidden_states(self, model_type: str) -> None:
        """``forward(..., head_fn=f)`` returns ``f(h)`` of the hidden states ``hidden_states`` gives for the same
        arguments: the plain forward (time-conditioned, padded) and a block model's block-causal one (``clean``)."""
        model = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID, time_conditioning=True)
        x, t = random_ids(), torch.tensor([0.3, 0.8])
        pad = torch.ones(2, L, dtype=torch.long)
        pad[1, :3] = 0
        got = model(x, t, attention_mask=pad, head_fn=lambda h: h.sum(-1))
        torch.testing.assert_close(got, model.hidden_states(x, t, attention_mask=pad).sum(-1), rtol=0, atol=0)
        block = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID, block_size=4)
        x0 = random_ids(seed=1)
        got = block(x, attention_mask=pad, clean=x0, head_fn=lambda h: h)
        torch.testing.assert_close(got, block.hidden_states(x, attention_mask=pad, clean=x0), rtol=0, atol=0)
        with pytest.raises(TypeError, match="head_fn: expected a callable"):
            model(x, t, head_fn=1)
        with pytest.raises(ValueError, match="head_fn: replaces the output head"):
            model(x, t, x0=x, kernel=uf.MaskKernel(model.num_states, MASK_ID), head_fn=lambda h: h)

    def test_head_runs_on_the_kept_positions_only(self, model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
        """The logits are the network's (B, L + 1, V) logits without the last position, bit for bit, but computed
        on the L positions only: contiguous, and no (B, L + 1, V) tensor is made in forward or backward — through
        the family's ``logits_to_keep``, and through the backbone then the head module (for a family without it)."""
        # a vocabulary no hidden or MLP width of the tiny models equals, so a (B, L + 1, V) tensor is recognisable
        model = adapt_ar_model(tiny_model(model_type, vocab_size=200), mask_token_id=MASK_ID, time_conditioning=True)
        nn.init.normal_(model.time_embedding.proj_out.weight, std=0.1)
        assert head.takes_logits_to_keep(type(model.base_model))  # every family of transformers 5
        x, t = random_ids(), torch.tensor([0.3, 0.8])
        pad = torch.ones(2, L, dtype=torch.long)
        pad[1, :3] = 0  # left padding
        B, V = x.shape[0], model.vocab_size
        for head_path in ("logits_to_keep", "backbone_then_head"):
            if head_path == "backbone_then_head":
                monkeypatch.setattr(head, "takes_logits_to_keep", lambda model_cls: False)
            for gamma, mask in ((0.0, None), (0.5, None), (1.0, None), (1.0, pad)):
                kwargs = model.network_inputs(x, t, bidirectional_prob=gamma, attention_mask=mask,
                                              generator=torch.Generator().manual_seed(4))
                with torch.no_grad():
                    ref = model.base_model(**kwargs).logits[:, :-1]  # (B, L, V) view of (B, L + 1, V)
                with _OutputShapes() as shapes:
                    out = model(x, t, bidirectional_prob=gamma, attention_mask=mask,
                                generator=torch.Generator().manual_seed(4))
                    out.float().sum().backward()
                model.zero_grad(set_to_none=True)
                case = (head_path, gamma, mask is not None)
                assert out.is_contiguous() and out.shape == (B, L, V), case
                assert torch.equal(out.detach(), ref), (case, (out.detach() - ref).abs().max())
                full = [s for s in shapes.seen if s[-1:] == (V,) and math.prod(s) == B * (L + 1) * V]
                assert not full, f"{case}: a (B, L + 1, V) tensor was made: {full}"
