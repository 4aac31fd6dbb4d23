"""Block diffusion (unifusion.hf.ar.blocks): block-causal training in one forward, its identities, the cache helpers."""

from __future__ import annotations

import math

import pytest
import torch
from _cpu import FLEX_WRONG_ON_THIS_CPU
from _hf_tiny import VOCAB, tiny_model

import unifusion as uf
from unifusion.hf.ar import blocks

MASK_ID = 3
WINDOWED = ("mistral", "gemma3_text")  # window 4 on every layer; per layer type (a dict of masks)


def _model(block_size: int | None, model_type: str = "llama", attn: str | None = None, **kwargs) -> uf.DiffusionLM:
    hf = tiny_model(model_type)
    if attn is not None:
        hf.set_attn_implementation(attn)
    return uf.adapt_ar_model(hf, mask_token_id=MASK_ID, block_size=block_size, **kwargs)


def _kernel(name: str) -> uf.Kernel:
    return uf.MaskKernel(VOCAB, MASK_ID) if name == "mask" else uf.UniformKernel(VOCAB)


def _x0(B: int, L: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, VOCAB, (B, L), generator=torch.Generator().manual_seed(seed))


def _loss(model, x0, kernel, t, seed=0, **kwargs) -> uf.training.DiffusionLossOutput:
    with torch.no_grad():
        return uf.diffusion_loss(model, x0, kernel, t=t, generator=torch.Generator().manual_seed(seed), **kwargs)


# ----------------------------------------------------------------------------------------------------------
# the model: block size is part of it


def test_block_size_is_saved_restored_and_shown(tmp_path) -> None:
    model = _model(4)
    assert model.block_size == 4 and "block_size=4" in repr(model)
    model.save_pretrained(tmp_path / "m")
    again = uf.DiffusionLM.from_pretrained(tmp_path / "m")
    assert again.block_size == 4 and "block_size=4" in repr(again)
    x0, t = _x0(2, 10), torch.full((2, 3), 0.5)
    assert torch.equal(_loss(model.eval(), x0, _kernel("mask"), t).loss, _loss(again, x0, _kernel("mask"), t).loss)
    plain = _model(None)
    assert plain.block_size is None and "block_size" not in repr(plain)
    plain.save_pretrained(tmp_path / "p")
    assert "block_size" not in (tmp_path / "p" / "unifusion_config.json").read_text()
    assert uf.DiffusionLM.from_pretrained(tmp_path / "p").block_size is None


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError),
                                        ("4", TypeError)])
def test_block_size_must_be_a_positive_int(bad, error) -> None:
    with pytest.raises(error, match="block_size"):
        uf.adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, block_size=bad)


def test_clean_tokens_need_a_block_model() -> None:
    with pytest.raises(ValueError, match="clean"):
        _model(None)(_x0(1, 8), clean=_x0(1, 8))


# ----------------------------------------------------------------------------------------------------------
# identity 1: one block (K >= L) is the plain bidirectional model, bit for bit


@pytest.mark.parametrize("K", [8, 16])
@pytest.mark.parametrize("fused", [False, True])
def test_one_block_is_the_plain_model_bit_for_bit(K: int, fused: bool) -> None:
    plain, block = _model(None), _model(K)
    x0, kernel = _x0(3, 8), _kernel("mask")
    for gamma in (None, 0.5):
        a = uf.diffusion_loss(plain, x0, kernel, generator=torch.Generator().manual_seed(1), fused=fused,
                              bidirectional_prob=gamma)
        b = uf.diffusion_loss(block, x0, kernel, generator=torch.Generator().manual_seed(1), fused=fused,
                              bidirectional_prob=gamma)
        assert torch.equal(a.loss, b.loss) and torch.equal(a.t, b.t) and torch.equal(a.x_t, b.x_t)
        a.loss.sum().backward()
        b.loss.sum().backward()
        for p, q in zip(plain.parameters(), block.parameters()):
            assert p.grad is None and q.grad is None or torch.equal(p.grad, q.grad)


# ----------------------------------------------------------------------------------------------------------
# which inputs each prediction sees, through the public loss alone


def _positions(out: uf.training.DiffusionLossOutput, kernel_name: str, block: range, x0: torch.Tensor):
    """(i, j) in ``block`` of row 0: i scored (masked, or any position for uniform noise), j != i noisy-visible
    (unmasked, so its noisy token equals x0 and changes with it)."""
    x_t = out.x_t[0]
    scored = [i for i in block if (x_t[i] == MASK_ID if kernel_name == "mask" else True)]
    visible = [j for j in block if x_t[j] == x0[0, j]]
    for i in scored:
        for j in visible:
            if j != i:
                return i, j
    raise AssertionError("no (scored, visible) pair: change the seed")


@pytest.mark.parametrize("kernel_name", ["mask", "uniform"])
@pytest.mark.parametrize("model_type, attn", [("llama", "sdpa"), ("llama", "eager"), ("mistral", "sdpa"),
                                              ("gemma3_text", "sdpa")])
def test_block_causal_dependencies(kernel_name: str, model_type: str, attn: str) -> None:
    K, L = 4, 10  # ragged: blocks [0, 4), [4, 8), [8, 10)
    model, kernel = _model(K, model_type, attn), _kernel(kernel_name)
    x0 = _x0(2, L)
    t = torch.tensor([[0.5, 0.5, 0.5], [0.3, 0.6, 0.9]])
    base = _loss(model, x0, kernel, t)
    assert base.t.shape == (2, 3)

    # 1. changing the clean tokens of a later block leaves the earlier blocks' per-position losses unchanged
    for start in (4, 8):
        other = x0.clone()
        other[:, start:] = (other[:, start:] + 7) % (VOCAB - 4) + 4
        out = _loss(model, other, kernel, t)
        torch.testing.assert_close(out.loss[:, :start], base.loss[:, :start], rtol=0, atol=1e-6)
        assert not torch.allclose(out.loss[:, start:], base.loss[:, start:])

    # 2. a token's loss depends on the other (noisy) tokens of its block
    i, j = _positions(base, kernel_name, range(4, 8), x0)
    other = x0.clone()
    other[0, j] = (other[0, j] + 11) % (VOCAB - 4) + 4
    out = _loss(model, other, kernel, t)
    assert out.x_t[0, j] == other[0, j]  # still visible in the block
    assert (out.loss[0, i] - base.loss[0, i]).abs() > 1e-6
    torch.testing.assert_close(out.loss[:, :4], base.loss[:, :4], rtol=0, atol=1e-6)

    # 3. near t = 1 (the block is almost pure noise) the previous block's clean tokens change the next block's losses
    t1 = torch.full((2, 3), 1 - 1e-4)
    near = _loss(model, x0, kernel, t1)
    other = x0.clone()
    other[:, 4:8] = (other[:, 4:8] + 5) % (VOCAB - 4) + 4
    out = _loss(model, other, kernel, t1)
    torch.testing.assert_close(out.loss[:, :4], near.loss[:, :4], rtol=0, atol=1e-6)
    change = (out.loss[:, 8:] - near.loss[:, 8:]).abs() / near.loss[:, 8:].abs()  # uniform noise: tiny losses
    assert change.max() > 1e-3


def test_block_times_default_per_block_or_per_sequence() -> None:
    model, kernel, x0 = _model(4), _kernel("mask"), _x0(3, 10)
    per_block = uf.diffusion_loss(model, x0, kernel, generator=torch.Generator().manual_seed(0))
    assert per_block.t.shape == (3, 3) and len(set(per_block.t.flatten().tolist())) == 9
    per_seq = uf.diffusion_loss(model, x0, kernel, generator=torch.Generator().manual_seed(0), block_times="sequence")
    assert per_seq.t.shape == (3, 3) and torch.equal(per_seq.t, per_seq.t[:, :1].expand(3, 3))
    with pytest.raises(ValueError, match="block_times"):
        uf.diffusion_loss(model, x0, kernel, block_times="token")
    with pytest.raises(ValueError, match="t"):
        uf.diffusion_loss(model, x0, kernel, t=torch.full((3, 5), 0.5))


@pytest.mark.parametrize("objective", uf.training.OBJECTIVES)
def test_every_objective_and_the_fused_loss(objective: str) -> None:
    model, kernel, x0 = _model(4), _kernel("mask"), _x0(2, 10)
    t = torch.tensor([[0.2, 0.5, 0.8], [0.4, 0.6, 0.9]])
    ref = _loss(model, x0, kernel, t, objective=objective)
    out = _loss(model, x0, kernel, t, objective=objective, fused=True)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-4, atol=1e-5)
    if objective == "gidd":  # ELBO weights: all five objectives agree (Corollary 3.4) on the block layout too
        for other in ("mdlm", "sedd"):
            torch.testing.assert_close(_loss(model, x0, kernel, t, objective=other).loss, ref.loss,
                                       rtol=1e-4, atol=1e-4)
        for weighting in ("clip", "dynamic"):
            assert torch.isfinite(_loss(model, x0, kernel, t, weighting=weighting).loss).all()


def test_bf16_autocast_and_gradients() -> None:
    model, kernel, x0 = _model(4), _kernel("uniform"), _x0(2, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = uf.diffusion_loss(model, x0, kernel, generator=torch.Generator().manual_seed(0), step=3,
                                anneal_steps=10)
    out.mean().backward()
    assert out.bidirectional_prob == 0.3 and torch.isfinite(out.loss).all()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_right_padding_equals_the_shorter_row() -> None:
    model = _model(4)
    x0, x_t = _x0(1, 8), _x0(1, 8, seed=1)
    x_t[0, 2] = MASK_ID
    pad = torch.tensor([[1] * 6 + [0, 0]])
    t = torch.tensor([[0.3, 0.7]])
    with torch.no_grad():
        padded = model(x_t, t, clean=x0, attention_mask=pad)
        short = model(x_t[:, :6], t, clean=x0[:, :6])
    torch.testing.assert_close(padded[:, :6], short, rtol=1e-5, atol=1e-5)


def test_left_padding_in_block_training_is_a_value_error_saying_to_right_pad() -> None:
    """A block model cuts blocks at column multiples of K: a left-padded row would train on other blocks than its
    right-padded twin, so diffusion_loss refuses it; the right-padded batch trains."""
    model = _model(4)
    x0, kernel = _x0(2, 8), _kernel("mask")
    left = torch.tensor([[1] * 8, [0, 0, 0] + [1] * 5])
    with pytest.raises(ValueError, match="attention_mask: a block model cuts blocks .* right-pad the batch"):
        _loss(model, x0, kernel, None, attention_mask=left)
    out = _loss(model, x0, kernel, None, attention_mask=left.flip(-1))
    assert out.num_tokens.item() == 13 and torch.isfinite(out.loss).all()
    # a plain (bidirectional) model takes left padding as before
    _loss(_model(None), x0, kernel, None, attention_mask=left)


# ----------------------------------------------------------------------------------------------------------
# identity 2: block size 1, mask kernel, causal attention = the AR model


def test_block_model_without_clean_is_refused_unless_causal() -> None:
    """A block model's plain bidirectional forward over more than one block is not what it was trained for: a
    ValueError naming clean (the causal forward, γ = 0, is the AR model and stays allowed; so does one block)."""
    model = _model(4)
    x0 = _x0(2, 8)
    with pytest.raises(ValueError, match="clean"):
        model(x0, torch.full((2,), 0.5))
    with torch.no_grad():
        assert model(x0, bidirectional_prob=0.0).shape == (2, 8, model.num_states)
        assert model(x0[:, :4], torch.full((2,), 0.5)).shape == (2, 4, model.num_states)


def test_block_size_one_at_gamma_zero_is_the_ar_model() -> None:
    model, kernel = _model(1), _kernel("mask")
    x0 = _x0(1, 6)
    with torch.no_grad():
        ar = model(x0, bidirectional_prob=0.0)  # the plain wrapper at γ = 0: the AR model's next-token logits
        nll = torch.nn.functional.cross_entropy(ar[0], x0[0], reduction="sum").item()
        # every prediction is the AR one: at t ≈ 1 (all masked) the loss is w(t) · CE at every position
        t = torch.full((1, 6), 1 - 1e-6)
        x_t = torch.full_like(x0, MASK_ID)
        torch.testing.assert_close(model(x_t, t, clean=x0, bidirectional_prob=0.0), ar, rtol=1e-5, atol=1e-5)
        # the bound equals the AR NLL in expectation: a Monte Carlo mean of the loss over 2048 draws
        B = 2048
        out = uf.diffusion_loss(model, x0.expand(B, 6), kernel, bidirectional_prob=0.0,
                                generator=torch.Generator().manual_seed(0))
    per_row = out.loss.sum(-1).double()
    mean, sem = per_row.mean().item(), per_row.std().item() / math.sqrt(B)
    assert abs(mean - nll) < 4 * sem, (mean, nll, sem)


# ----------------------------------------------------------------------------------------------------------
# the bound


def test_nll_bound_of_a_block_model() -> None:
    from unifusion.eval.likelihood import nll_bound

    kernel, x0 = _kernel("mask"), _x0(2, 10)
    plain, one_block = _model(None), _model(10)
    a = nll_bound(plain, x0, kernel, num_times=4, generator=torch.Generator().manual_seed(0))
    b = nll_bound(one_block, x0, kernel, num_times=4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    block = _model(4)
    c = nll_bound(block, x0, kernel, num_times=4, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(c).all() and not torch.allclose(a, c)
    # the block bound changes with the clean tokens of an earlier block even where the later ones are kept
    other = x0.clone()
    other[:, :4] = (other[:, :4] + 3) % (VOCAB - 4) + 4
    d = nll_bound(block, other, kernel, num_times=4, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(c, d)


# ----------------------------------------------------------------------------------------------------------
# cached decoding: prefix cache + one block's K + 1 noisy positions = the training forward


def _noisy(x0: torch.Tensor, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(x0.shape, generator=g) < 0.5, torch.full_like(x0, MASK_ID), x0)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma3_text"])
@pytest.mark.parametrize("gamma", [0.0, 1.0])
def test_cached_block_decode_equals_the_training_forward(model_type: str, gamma: float) -> None:
    K, L = 4, 10
    model = _model(K, model_type).eval()
    x0 = _x0(2, L)
    x_t = _noisy(x0)
    with torch.no_grad():
        full = model(x_t, torch.full((2,), 0.5), clean=x0, bidirectional_prob=gamma)  # (B, L, V)
    # (a) a causal prefill of the clean prefix, then the block's K + 1 positions against the cache
    for s, e in [(0, 4), (4, 8), (8, 10)]:
        state = blocks.prefill(model, x0[:, :s])
        assert state.length == s and state.cache.get_seq_length() == s
        out = blocks.denoise_block(model, state, x_t[:, s:e], bidirectional_prob=gamma)
        assert state.cache.get_seq_length() == s  # left as it was
        torch.testing.assert_close(out, full[:, s:e], rtol=1e-5, atol=1e-5)
    # (b) block by block: commit each block, decode the next
    state = blocks.prefill(model, x0[:, :0])
    for s, e in [(0, 4), (4, 8), (8, 10)]:
        out = blocks.denoise_block(model, state, x_t[:, s:e], bidirectional_prob=gamma)
        torch.testing.assert_close(out, full[:, s:e], rtol=1e-5, atol=1e-5)
        state = blocks.commit_block(model, state, x0[:, s:e])
    assert state.length == L and torch.equal(state.anchor, x0[:, -1])


def test_cache_helpers_with_time_conditioning() -> None:
    model = _model(4, time_conditioning=True).eval()
    torch.nn.init.normal_(model.time_embedding.proj_out.weight)  # a non-trivial time embedding
    x0 = _x0(1, 8)
    x_t = _noisy(x0)
    t = torch.tensor([[0.3, 0.8]])
    with torch.no_grad():
        full = model(x_t, t, clean=x0)
    state = blocks.prefill(model, x0[:, :4])
    torch.testing.assert_close(blocks.denoise_block(model, state, x_t[:, 4:], torch.tensor([0.8])), full[:, 4:],
                               rtol=1e-5, atol=1e-5)


def test_cache_helpers_reject_bad_input() -> None:
    model = _model(4)
    with pytest.raises(ValueError, match="clean_ids"):
        blocks.prefill(model, torch.zeros(3, dtype=torch.long))
    state = blocks.prefill(model, _x0(2, 4))
    with pytest.raises(ValueError, match="x_t_block"):
        blocks.denoise_block(model, state, _x0(3, 4))
    with pytest.raises(ValueError, match="bidirectional_prob"):
        blocks.denoise_block(model, state, _x0(2, 4), bidirectional_prob=0.5)
    with pytest.raises(ValueError, match="tokens"):
        blocks.commit_block(model, state, torch.full((2, 4), VOCAB + 5))
    assert state.anchor.shape == (2,) and state.length == 4


# ----------------------------------------------------------------------------------------------------------
# the layout and its masks


def test_layout_and_ragged_rule() -> None:
    lay = blocks.block_layout(10, 4)
    assert (lay.num_blocks, lay.num_clean, lay.size) == (3, 8, 8 + 10 + 3)
    assert lay.internal.tolist() == list(range(8)) + [0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 8, 9, 10]
    assert lay.block.tolist() == [-1] * 8 + [0] * 5 + [1] * 5 + [2] * 3
    assert lay.predict.tolist() == [8, 9, 10, 11, 13, 14, 15, 16, 18, 19]
    A = blocks.block_attention_mask(lay, 1, 1.0)[0, 0]
    # the anchor of block 1 (stream 13, internal 4) sees clean internal 0..3 and its block, nothing else
    assert A[13].nonzero().flatten().tolist() == [0, 1, 2, 3, 13, 14, 15, 16, 17]
    # a clean query sees clean keys causally only
    assert A[5].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
    C = blocks.block_attention_mask(lay, 1, 0.0)[0, 0]
    assert C[14].nonzero().flatten().tolist() == [0, 1, 2, 3, 13, 14]
    add = blocks.block_attention_mask(lay, 1, 1.0, style="additive")[0, 0]
    assert torch.equal(add == 0, A)


@FLEX_WRONG_ON_THIS_CPU
@torch.no_grad()
def test_compiled_flex_attention_itself_matches_sdpa_on_this_cpu(static_flex: None) -> None:
    """The root cause behind the flex tests' marker, with no unifusion code: torch's compiled ``flex_attention`` under
    a causal-offset BlockMask (the shape of a cached block step) against SDPA with the same dense mask."""
    flex_attention = pytest.importorskip("torch.nn.attention.flex_attention")
    compiled = torch.compile(flex_attention.flex_attention, dynamic=False)
    g = torch.Generator().manual_seed(0)
    for q_len, kv_len in ((4, 8), (2, 8), (2, 10)):
        q, k, v = (torch.randn(2, 2, n, 16, generator=g) for n in (q_len, kv_len, kv_len))
        offset = kv_len - q_len

        def causal_offset(b, h, q_idx, kv_idx, offset=offset):
            return kv_idx <= q_idx + offset

        block_mask = flex_attention.create_block_mask(causal_offset, 2, 1, q_len, kv_len, device="cpu")
        dense = torch.ones(q_len, kv_len, dtype=torch.bool).tril(offset)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        torch.testing.assert_close(compiled(q, k, v, block_mask=block_mask), expected, rtol=1e-5, atol=1e-5)


def test_the_static_flex_fixture_leaves_dynamo_config_as_it_found_it(static_flex: None) -> None:
    """Inside: sizes static. The next test checks that the setting is back and still an attribute afterwards."""
    assert torch._dynamo.config.automatic_dynamic_shapes is False


def test_dynamo_config_is_intact_after_the_static_flex_fixture() -> None:
    """pytest ≥ 9.2's monkeypatch deleted this attribute on undo, which broke every later torch.compile."""
    assert hasattr(torch._dynamo.config, "automatic_dynamic_shapes")
    assert torch._dynamo.config.automatic_dynamic_shapes is True
    assert torch.compile(lambda x: x * 2)(torch.ones(2)).tolist() == [2.0, 2.0]


@FLEX_WRONG_ON_THIS_CPU
@torch.no_grad()
def test_flex_attention_block_mask_matches_sdpa(static_flex: None) -> None:
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import BlockMask, create_mask

    K, L = 4, 10
    sdpa, flex = _model(K), _model(K, attn="flex_attention")
    x0 = _x0(2, L)
    x_t, t = _noisy(x0), torch.full((2,), 0.5)
    for gamma in (0.0, 0.5, 1.0):
        ref = sdpa(x_t, t, clean=x0, bidirectional_prob=gamma, generator=torch.Generator().manual_seed(3))
        out = flex(x_t, t, clean=x0, bidirectional_prob=gamma, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the cache helpers on flex attention: the same logits as the training forward
    full = flex(x_t, t, clean=x0)
    state = blocks.prefill(flex, x0[:, :4])
    torch.testing.assert_close(blocks.denoise_block(flex, state, x_t[:, 4:8]), full[:, 4:8], rtol=1e-5, atol=1e-5)
    state = blocks.commit_block(flex, state, x0[:, 4:8])
    torch.testing.assert_close(blocks.denoise_block(flex, state, x_t[:, 8:]), full[:, 8:], rtol=1e-5, atol=1e-5)
    lay = blocks.block_layout(L, K)
    bm = blocks.block_attention_mask(lay, 2, 0.5, generator=torch.Generator().manual_seed(3), style="block")
    assert isinstance(bm, BlockMask)
    dense = blocks.block_attention_mask(lay, 2, 0.5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(create_mask(bm.mask_mod, 2, 1, lay.size, lay.size, device="cpu"), dense)


def test_flex_block_mask_skips_empty_tiles() -> None:
    from torch.nn.attention.flex_attention import BlockMask

    lay = blocks.block_layout(1024, 32)
    bm = blocks.block_attention_mask(lay, 1, 1.0, style="block")
    assert isinstance(bm, BlockMask)
    tiles = bm.to_dense()[0, 0]  # (q tiles, kv tiles): 1 where a tile is computed
    assert tiles.float().mean() < 0.6  # clean→noisy, noisy→later clean and other blocks' tiles are skipped


@pytest.mark.parametrize("kernel_name", ["uniform", "mask", "hybrid", "generator"])
def test_every_kernel_with_per_block_times(kernel_name: str) -> None:
    """Per-block times reach the corruption and the loss of every kernel family; fused = unfused."""
    model, x0 = _model(4), _x0(2, 10)
    if kernel_name == "hybrid":
        kernel = uf.HybridKernel(VOCAB, MASK_ID, p_uniform=0.3)
    elif kernel_name == "generator":
        R = torch.rand(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.05
        R.fill_diagonal_(0.0)
        R -= torch.diag(R.sum(-1))
        kernel = uf.GeneratorKernel(R)
    else:
        kernel = _kernel(kernel_name)
    t = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.6, 0.95]])
    ref = _loss(model, x0, kernel, t)
    assert torch.isfinite(ref.loss).all() and (ref.loss > 0).any()
    if kernel_name != "generator":  # the fused loss takes the interpolating kernels only
        torch.testing.assert_close(_loss(model, x0, kernel, t, fused=True).loss, ref.loss, rtol=1e-4, atol=1e-5)
    if kernel_name == "mask":  # the corruption follows each block's time: more masks in later blocks
        assert (ref.x_t[:, :4] == MASK_ID).float().mean() < (ref.x_t[:, 8:] == MASK_ID).float().mean()


def test_the_block_layout_refuses_a_model_without_blocks() -> None:
    model, x = _model(None), _x0(1, 8)
    with pytest.raises(ValueError, match="model: block_hidden_states runs a block model's layout"):
        blocks.block_hidden_states(model, model.hf_model, x, None, x, 1.0)
