"""unifusion.hf.ar.families crossed with the model: every registered family through one shared checker, on tiny random
models (tests/_hf_tiny.py)."""

from __future__ import annotations

import pytest
import torch
from _hf_tiny import BOS, FAMILIES, VOCAB, random_ids, tiny_model, with_bos
from torch import nn

from unifusion.hf import DiffusionLM, adapt_ar_model
from unifusion.hf.ar.families import FAMILIES as REGISTRY
from unifusion.hf.ar.families import family_for

L = 8  # sequence length of the tests (network length L + 1 = 9 > the sliding windows of 4 in _hf_tiny)
MASK_ID = 3


# ---------------------------------------------------------------------------------------------------------------
# the shared checker, crossed over all families


@pytest.mark.parametrize("model_type", FAMILIES)
class TestFamilies:
    def test_registry_entry(self, model_type: str) -> None:
        assert family_for(model_type) is REGISTRY[model_type]

    @torch.no_grad()
    def test_causal_shift_equals_next_token_logits(self, model_type: str) -> None:
        base = tiny_model(model_type)
        model = adapt_ar_model(base, mask_token_id=MASK_ID)
        assert model.bos_token_id == BOS
        x = random_ids()
        # reference: the base model run on each prefix [BOS, x_1..x_{i-1}] separately, last output
        net = with_bos(x)
        ref = torch.stack([base(net[:, : i + 1]).logits[:, -1] for i in range(L)], dim=1)  # (B, L, V)
        fast = model(x, bidirectional_prob=0.0)  # no mask passed: the model's own causal mask
        general = model(x, bidirectional_prob=0.0, attention_mask=torch.ones(2, L))  # our 4D mask
        assert fast.shape == (2, L, model.vocab_size)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(general, ref, rtol=1e-5, atol=1e-5)

    @torch.no_grad()
    def test_later_token_influences_earlier_output_only_when_bidirectional(self, model_type: str) -> None:
        model = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID)
        x = random_ids()
        x2 = x.clone()
        x2[:, -1] = (x2[:, -1] + 1 - 4) % (VOCAB - 4) + 4  # change the last token only
        causal, causal2 = model(x, bidirectional_prob=0.0), model(x2, bidirectional_prob=0.0)
        torch.testing.assert_close(causal, causal2, rtol=0, atol=0)  # no output may see x_L causally
        bid, bid2 = model(x), model(x2)
        # output L-2 comes from the query at x_{L-2}: it sees x_L only through bidirectional attention
        assert (bid[:, L - 2] - bid2[:, L - 2]).abs().max() > 1e-4
        assert not torch.allclose(bid, causal)

    @pytest.mark.parametrize("gamma", [0.0, 1.0])
    @pytest.mark.parametrize("side", ["right", "left"])
    @torch.no_grad()
    def test_padding_invariance(self, model_type: str, gamma: float, side: str) -> None:
        model = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID)
        x = random_ids()
        n = L - 3  # real length of row 1
        padded = x.clone()
        mask = torch.ones(2, L, dtype=torch.long)
        if side == "right":
            padded[1, n:] = 0
            mask[1, n:] = 0
            real = slice(None, n)
        else:
            padded[1, : L - n] = 0
            mask[1, : L - n] = 0
            real = slice(L - n, None)
        out = model(padded, bidirectional_prob=gamma, attention_mask=mask)
        assert torch.isfinite(out).all()
        alone0 = model(x[:1], bidirectional_prob=gamma)
        alone1 = model(padded[1:, real], bidirectional_prob=gamma)
        torch.testing.assert_close(out[:1], alone0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[1:, real], alone1, rtol=1e-5, atol=1e-5)

    @torch.no_grad()
    def test_time_conditioning_starts_as_the_ar_model(self, model_type: str) -> None:
        base = tiny_model(model_type)
        model = adapt_ar_model(base, mask_token_id=MASK_ID, time_conditioning=True)
        x, t = random_ids(), torch.tensor([0.2, 0.9])
        ref = base(with_bos(x)).logits[:, :-1]
        torch.testing.assert_close(model(x, t, bidirectional_prob=0.0), ref, rtol=1e-5, atol=1e-5)
        nn.init.normal_(model.time_embedding.proj_out.weight, std=0.1)  # once trained, t matters
        assert not torch.allclose(model(x, t, bidirectional_prob=0.0), ref, atol=1e-4)

    def test_save_load_round_trip_bit_identical(self, model_type: str, tmp_path) -> None:
        model = adapt_ar_model(tiny_model(model_type), time_conditioning=True)  # adds a mask token
        nn.init.normal_(model.time_embedding.proj_out.weight, std=0.1)
        model.save_pretrained(tmp_path)
        loaded = DiffusionLM.from_pretrained(tmp_path)
        a, b = model.state_dict(), loaded.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
        assert (loaded.bos_token_id, loaded.mask_token_id, loaded.num_states) == (
            model.bos_token_id, model.mask_token_id, model.num_states)
        x, t = random_ids(), torch.tensor([0.3, 0.6])
        with torch.no_grad():
            assert torch.equal(model(x, t), loaded(x, t))
