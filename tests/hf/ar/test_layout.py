"""unifusion.hf.ar.layout: the shifted network layout [BOS, x_t] with right and left padding."""

from __future__ import annotations

import torch

from unifusion.hf.ar.attention import AnnealedPattern
from unifusion.hf.ar.layout import shifted_layout

BOS = 1


def test_unpadded_layout_prepends_bos() -> None:
    x = torch.tensor([[5, 6, 7], [8, 9, 10]])
    layout = shifted_layout(x, BOS, 0.5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(layout.input_ids, torch.tensor([[BOS, 5, 6, 7], [BOS, 8, 9, 10]]))
    assert layout.position_ids is None
    pattern = layout.pattern
    assert isinstance(pattern, AnnealedPattern) and (pattern.batch_size, pattern.length, pattern.gamma) == (2, 4, 0.5)
    assert pattern.key_valid is None and not pattern.is_causal and not pattern.is_full
    assert shifted_layout(x, BOS, 0.0).pattern.is_causal and shifted_layout(x, BOS, 1.0).pattern.is_full


def test_padding_keeps_bos_before_the_first_real_token() -> None:
    """Right padding: pads stay at the end. Left padding: BOS goes just before the first real token, the pads stay in
    front, and position ids count real tokens only (a padded row's real positions equal the unpadded row's)."""
    x = torch.tensor([[5, 6, 7, 0], [0, 0, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    layout = shifted_layout(x, BOS, 1.0, attention_mask=mask)
    assert torch.equal(layout.input_ids, torch.tensor([[BOS, 5, 6, 7, 0], [0, 0, BOS, 8, 9]]))
    assert layout.position_ids is not None
    assert torch.equal(layout.position_ids, torch.tensor([[0, 1, 2, 3, 3], [0, 0, 0, 1, 2]]))
    key_valid = layout.pattern.key_valid
    assert key_valid is not None
    assert torch.equal(key_valid, torch.tensor([[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool))
    assert not layout.pattern.is_full and layout.pattern.mask_reason() == "padding: attention_mask"
