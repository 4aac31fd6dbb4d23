"""Document masks for packed rows (diffusion_loss(..., document_ids=)): no token attends to another document, so a
packed row's per-token losses are each document's losses trained alone with the same times and masks."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import unifusion as uf
from unifusion.losses import x0_head_loss

sys.path.insert(0, os.path.dirname(__file__))
from _hf_tiny import tiny_model  # noqa: E402

MASK_ID = 3


def _docs(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 128, (1, n), generator=g) for n in lengths]


def _packed(docs: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, ...]:
    """x0, document ids, prompt mask (each document's first token is prompt, as a chat template's is), padding."""
    x0 = torch.cat(docs + [torch.zeros((1, pad), dtype=torch.long)], 1)
    ids = torch.cat([torch.full((1, d.shape[1]), i) for i, d in enumerate(docs)] + [torch.full((1, pad), -1)], 1)
    prompt = torch.zeros_like(x0, dtype=torch.bool)
    attention = torch.ones_like(x0)
    col = 0
    for d in docs:
        prompt[0, col] = True
        col += d.shape[1]
    attention[0, col:] = 0
    return x0, ids, prompt, attention


def _alone_loss(model, kernel, x0, x_t, t, block: bool) -> torch.Tensor:
    """The per-token loss of one document trained alone on the same x_t and times."""
    with torch.no_grad():
        if block:
            logits = model(x_t, t, clean=x0)
            t_pos = uf.hf.ar.blocks.expand_block_times(t, x0.shape[1], model.block_size)
        else:
            logits = model(x_t, t)
            t_pos = t[:, None].expand(x0.shape)
    return x0_head_loss(logits, x0, x_t, t_pos.to(logits.dtype), kernel)


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # rotary and absolute positions
def test_a_packed_block_row_scores_its_documents_as_if_alone(family) -> None:
    """Documents at block boundaries: every token, each document's first included, scores as alone."""
    model = uf.adapt_ar_model(tiny_model(family), mask_token_id=MASK_ID, block_size=4)
    kernel = uf.MaskKernel(model.num_states, MASK_ID)
    docs = _docs([8, 4, 3], seed=1)  # every document starts at a block boundary; the last block is padded
    x0, ids, _, attention = _packed(docs, pad=1)
    with torch.no_grad():
        out = uf.diffusion_loss(model, x0, kernel, document_ids=ids, attention_mask=attention,
                                generator=torch.Generator().manual_seed(0))
    assert out.t.shape == (1, 4) and (out.x_t[0, :15] == MASK_ID).any()
    col = 0
    for d in docs:
        n = d.shape[1]
        t = out.t[:, col // 4:(col + n + 3) // 4]
        alone = _alone_loss(model, kernel, d, out.x_t[:, col:col + n], t, block=True)
        torch.testing.assert_close(out.loss[:, col:col + n], alone, rtol=1e-4, atol=1e-5)
        col += n
    # without document ids the later documents see the earlier ones: their losses change
    with torch.no_grad():
        mixed = uf.diffusion_loss(model, x0, kernel, attention_mask=attention,
                                  generator=torch.Generator().manual_seed(0))
    assert torch.equal(mixed.x_t, out.x_t) and not torch.allclose(mixed.loss[:, 8:], out.loss[:, 8:])


def test_a_document_starting_inside_a_block_sees_only_itself() -> None:
    """Documents not at block boundaries: changing one document's tokens leaves the others' losses unchanged."""
    model = uf.adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, block_size=4)
    kernel = uf.MaskKernel(model.num_states, MASK_ID)
    docs = _docs([5, 6, 3], seed=2)
    x0, ids, prompt, _ = _packed(docs)
    other = x0.clone()
    other[0, 5:11] = torch.randint(4, 128, (6,), generator=torch.Generator().manual_seed(9))  # the middle document
    outs = []
    with torch.no_grad():
        for x in (x0, other):
            outs.append(uf.diffusion_loss(model, x, kernel, document_ids=ids, prompt_mask=prompt,
                                          t=torch.full((1, 4), 0.7), generator=torch.Generator().manual_seed(0)))
    for keep in (slice(0, 5), slice(11, 14)):
        torch.testing.assert_close(outs[0].loss[:, keep], outs[1].loss[:, keep], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(outs[0].loss[:, 5:11], outs[1].loss[:, 5:11])


def test_document_ids_checks() -> None:
    model = uf.adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, block_size=4)
    kernel = uf.MaskKernel(model.num_states, MASK_ID)
    x0, ids, prompt, _ = _packed(_docs([3, 3]))
    with pytest.raises(ValueError, match="document_ids: a document starts inside a block .* scored first token"):
        uf.diffusion_loss(model, x0, kernel, document_ids=ids)
    plain = uf.adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    with pytest.raises(ValueError, match="document_ids: packed documents need a block model"):
        uf.diffusion_loss(plain, x0, kernel, document_ids=ids, prompt_mask=prompt)
    with pytest.raises(ValueError, match=r"document_ids: expected an integer tensor of shape \(1, 6\)"):
        uf.diffusion_loss(model, x0, kernel, document_ids=ids[:, :4], prompt_mask=prompt)
    with pytest.raises(TypeError, match="document_ids: needs a DiffusionLM"):
        uf.diffusion_loss(lambda x_t, t: torch.zeros(*x_t.shape, 129), x0, uf.MaskKernel(129, MASK_ID),
                          document_ids=ids, prompt_mask=prompt)
    out = uf.diffusion_loss(model, x0, kernel, document_ids=ids, prompt_mask=prompt, complementary=True)
    assert out.loss.shape == (2, 6)
