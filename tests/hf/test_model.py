"""Tests for unifusion.adapters: the AR → x0-diffusion wrapper, crossed over tiny random HF families."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from _dispatch_count import count_syncs
from _hf_tiny import BOS, FAMILIES, VOCAB, tiny_config, tiny_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import unifusion as uf
from unifusion._families import FAMILIES as REGISTRY
from unifusion._families import family_for
from unifusion._validation import validation
from unifusion.adapters import DiffusionLM, adapt_ar_model, anneal_schedule, annealed_attention_mask

L = 8  # sequence length of the tests (network length L + 1 = 9 > the sliding windows of 4 in _hf_tiny)
MASK_ID = 3


@pytest.fixture(autouse=True)
def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()


def _ids(B: int = 2, length: int = L, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (B, length), generator=g)


def _with_bos(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.full((x.shape[0], 1), BOS), x], dim=1)


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
        x = _ids()
        # reference: the base model run on each prefix [BOS, x_1..x_{i-1}] separately, last output
        net = _with_bos(x)
        ref = torch.stack([base(net[:, : i + 1]).logits[:, -1] for i in range(L)], dim=1)  # (B, L, V)
        fast = model(x, bidirectional_prob=0.0)  # no mask passed: the model's own causal mask
        general = model(x, bidirectional_prob=0.0, attention_mask=torch.ones(2, L))  # our 4D mask
        assert fast.shape == (2, L, model.vocab_size)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(general, ref, rtol=1e-5, atol=1e-5)

    @torch.no_grad()
    def test_later_token_influences_earlier_output_only_when_bidirectional(self, model_type: str) -> None:
        model = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID)
        x = _ids()
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
        x = _ids()
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
    def test_hidden_states_then_head_equals_forward(self, model_type: str) -> None:
        model = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID)
        x = _ids()
        for gamma in (0.0, 1.0):
            h = model.hidden_states(x, bidirectional_prob=gamma)
            assert h.shape == (2, L, model.lm_head_weight.shape[1])
            assert model.lm_head_weight.shape[0] == model.vocab_size
            torch.testing.assert_close(model.logits_from_hidden(h), model(x, bidirectional_prob=gamma),
                                       rtol=1e-5, atol=1e-5)

    def test_head_runs_on_the_kept_positions_only(self, model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
        """The logits are the network's (B, L + 1, V) logits without the last position, bit for bit, but computed
        on the L positions only: contiguous, and no (B, L + 1, V) tensor is made in forward or backward — through
        the family's ``logits_to_keep``, and through the backbone then the head module (for a family without it)."""
        from unifusion import adapters

        # a vocabulary no hidden or MLP width of the tiny models equals, so a (B, L + 1, V) tensor is recognisable
        model = adapt_ar_model(tiny_model(model_type, vocab_size=200), mask_token_id=MASK_ID, time_conditioning=True)
        nn.init.normal_(model.time_embedding.proj_out.weight, std=0.1)
        assert adapters._takes_logits_to_keep(type(model.base_model))  # every family of transformers 5
        x, t = _ids(), torch.tensor([0.3, 0.8])
        pad = torch.ones(2, L, dtype=torch.long)
        pad[1, :3] = 0  # left padding
        B, V = x.shape[0], model.vocab_size
        for head_path in ("logits_to_keep", "backbone_then_head"):
            if head_path == "backbone_then_head":
                monkeypatch.setattr(adapters, "_takes_logits_to_keep", lambda model_cls: False)
            for gamma, mask in ((0.0, None), (0.5, None), (1.0, None), (1.0, pad)):
                kwargs = model._net_inputs(x, t, gamma, None if mask is None else mask.bool(),
                                           torch.Generator().manual_seed(4))
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

    @torch.no_grad()
    def test_time_conditioning_starts_as_the_ar_model(self, model_type: str) -> None:
        base = tiny_model(model_type)
        model = adapt_ar_model(base, mask_token_id=MASK_ID, time_conditioning=True)
        x, t = _ids(), torch.tensor([0.2, 0.9])
        ref = base(_with_bos(x)).logits[:, :-1]
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
        x, t = _ids(), torch.tensor([0.3, 0.6])
        with torch.no_grad():
            assert torch.equal(model(x, t), loaded(x, t))


# ---------------------------------------------------------------------------------------------------------------
# schedule and mask


def test_anneal_schedule() -> None:
    assert anneal_schedule(0, 100) == 0.0
    assert anneal_schedule(25, 100) == 0.25
    assert anneal_schedule(100, 100) == 1.0
    assert anneal_schedule(1000, 100) == 1.0
    assert anneal_schedule(0, 0) == 1.0
    with pytest.raises(ValueError, match="step"):
        anneal_schedule(-1, 10)
    with pytest.raises(ValueError, match="anneal_steps"):
        anneal_schedule(1, -10)
    with pytest.raises(TypeError, match="step"):
        anneal_schedule(1.5, 10)  # type: ignore[arg-type]


def test_annealed_mask_semantics() -> None:
    n = 64
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(annealed_attention_mask(2, n, 0.0)[0, 0], causal)
    assert annealed_attention_mask(2, n, 1.0).all()
    g = torch.Generator().manual_seed(0)
    A = annealed_attention_mask(4, n, 0.3, generator=g)
    assert A.shape == (4, 1, n, n)
    assert (A | ~causal).all()  # A ⊇ causal
    upper = A[:, 0][:, ~causal]
    assert abs(upper.float().mean().item() - 0.3) < 0.02  # B_ij ~ Bernoulli(γ) above the diagonal
    assert not torch.equal(A[0], A[1])  # drawn per sequence
    A2 = annealed_attention_mask(4, n, 0.3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(A, A2)
    valid = torch.ones(1, n, dtype=torch.bool)
    valid[0, -3:] = False
    Ap = annealed_attention_mask(1, n, 1.0, key_valid=valid)[0, 0]
    assert not Ap[: n - 3, n - 3 :].any()  # padded keys blocked for real queries
    assert torch.equal(Ap[n - 3 :, n - 3 :], torch.eye(3, dtype=torch.bool))  # padded queries see themselves
    Aw = annealed_attention_mask(1, n, 1.0, window=4)[0, 0]
    i = torch.arange(n)
    assert torch.equal(Aw, (i[:, None] - i[None, :]).abs() < 4)


@torch.no_grad()
def test_intermediate_gamma_uses_generator() -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    x = _ids()
    a = model(x, bidirectional_prob=0.5, generator=torch.Generator().manual_seed(1))
    b = model(x, bidirectional_prob=0.5, generator=torch.Generator().manual_seed(1))
    c = model(x, bidirectional_prob=0.5, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@torch.no_grad()
def test_annealed_forward_uses_the_paper_mask() -> None:
    """model(x, γ) = base([BOS, x]) under A = causal ∨ Bernoulli(γ), drawn by annealed_attention_mask."""
    base = tiny_model("llama")
    model = adapt_ar_model(base, mask_token_id=MASK_ID)
    x = _ids()
    A = annealed_attention_mask(2, L + 1, 0.5, generator=torch.Generator().manual_seed(3))
    ref = base(_with_bos(x), attention_mask=A).logits[:, :-1]
    out = model(x, bidirectional_prob=0.5, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2"])
@torch.no_grad()
def test_annealed_forward_leaves_global_rng_alone(model_type: str) -> None:
    model = adapt_ar_model(tiny_model(model_type), mask_token_id=MASK_ID)
    state = torch.get_rng_state()
    model(_ids(), bidirectional_prob=0.5, attention_mask=torch.ones(2, L), generator=torch.Generator())
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("model_type", ["mistral", "gemma2"])
@torch.no_grad()
def test_sliding_window_is_kept_and_symmetrised(model_type: str) -> None:
    """Windowed layers keep |i - j| < w: with w = 4 on both layers, x_L (distance 8) cannot reach output 0."""
    layer_types = {"gemma2": ["sliding_attention", "sliding_attention"]}.get(model_type)
    extra = {"layer_types": layer_types} if layer_types else {}
    model = adapt_ar_model(tiny_model(model_type, **extra), mask_token_id=MASK_ID)
    x = _ids()
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1 - 4) % (VOCAB - 4) + 4
    out, out2 = model(x), model(x2)
    torch.testing.assert_close(out[:, 0], out2[:, 0], rtol=0, atol=0)  # beyond 2 layers × (w - 1) = 6
    assert (out[:, L - 2] - out2[:, L - 2]).abs().max() > 1e-4  # within the window
    # without the window the far token is seen
    wide = adapt_ar_model(tiny_model(model_type, sliding_window=64, **extra), mask_token_id=MASK_ID)
    assert (wide(x)[:, 0] - wide(x2)[:, 0]).abs().max() > 1e-4


@torch.no_grad()
def test_gemma2_gets_additive_mask_and_eager_matches() -> None:
    model = adapt_ar_model(tiny_model("gemma2"), mask_token_id=MASK_ID)
    assert model.config._attn_implementation == "eager"
    assert model._mask_style() == "additive"
    assert model.final_logit_softcap == 30.0
    assert model(_ids()).abs().max() <= 30.0


@torch.no_grad()
def test_eager_llama_uses_additive_mask() -> None:
    sdpa = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    eager = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    eager.base_model.config._attn_implementation = "eager"
    for layer in eager.base_model.model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    x = _ids()
    torch.testing.assert_close(eager(x), sdpa(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager(x, bidirectional_prob=0.0), sdpa(x, bidirectional_prob=0.0))


# ---------------------------------------------------------------------------------------------------------------
# vocabulary, mask token, BOS


@torch.no_grad()
def test_mask_token_is_added_with_mean_embedding() -> None:
    base = tiny_model("llama")
    w = base.get_input_embeddings().weight.clone()
    w_out = base.get_output_embeddings().weight.clone()
    model = adapt_ar_model(base)
    assert model.mask_token_id == VOCAB and model.added_mask_token
    assert model.vocab_size == model.num_states == VOCAB + 1
    torch.testing.assert_close(model.base_model.get_input_embeddings().weight[VOCAB], w.mean(0))
    torch.testing.assert_close(model.lm_head_weight[VOCAB], w_out.mean(0))
    x = _ids()
    x[:, 2] = model.mask_token_id
    assert model(x).shape == (2, L, VOCAB + 1)


def test_mask_token_tied_model_stays_tied() -> None:
    model = adapt_ar_model(tiny_model("gpt2"))
    assert model.lm_head_weight is model.base_model.get_input_embeddings().weight
    assert model.num_states == VOCAB + 1


def test_given_mask_token_is_validated() -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=5)
    assert model.mask_token_id == 5 and model.num_states == VOCAB
    with pytest.raises(ValueError, match=r"mask_token_id: expected a token id in \[0, 128\), got 128"):
        adapt_ar_model(tiny_model("llama"), mask_token_id=VOCAB)
    with pytest.raises(TypeError, match="mask_token_id"):
        adapt_ar_model(tiny_model("llama"), mask_token_id=True)


def test_bos_resolution() -> None:
    assert adapt_ar_model(tiny_model("llama"), bos_token_id=7, mask_token_id=3).bos_token_id == 7
    assert adapt_ar_model(tiny_model("llama", bos_token_id=None), mask_token_id=3).bos_token_id == 2  # eos
    with pytest.raises(ValueError, match="bos_token_id"):
        adapt_ar_model(tiny_model("llama", bos_token_id=None, eos_token_id=None), mask_token_id=3)
    with pytest.raises(ValueError, match="bos_token_id"):
        adapt_ar_model(tiny_model("llama"), bos_token_id=10_000, mask_token_id=3)


# ---------------------------------------------------------------------------------------------------------------
# wrapping, unsupported models, bad inputs


def test_wrapping_twice_warns_and_can_be_undone() -> None:
    base = tiny_model("llama")
    model = adapt_ar_model(base, mask_token_id=MASK_ID)
    assert model.base_model is base  # not a copy
    with pytest.warns(UserWarning, match="already a DiffusionLM"):
        again = adapt_ar_model(model)
    assert again is model


def test_unsupported_models_are_rejected_with_the_supported_list() -> None:
    from transformers import AutoModel, AutoModelForCausalLM

    with pytest.raises(TypeError, match="expected a Hugging Face causal LM"):
        adapt_ar_model(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="nn.Module"):
        adapt_ar_model("gpt2")  # type: ignore[arg-type]
    bert = AutoModel.from_config(tiny_config("bert", **{"hidden_size": 32, "num_hidden_layers": 1,
                                                        "num_attention_heads": 2, "intermediate_size": 32}))
    with pytest.raises((TypeError, ValueError), match="supported model types: .*llama"):
        adapt_ar_model(bert)
    opt = AutoModelForCausalLM.from_config(tiny_config(
        "opt", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32,
        word_embed_proj_dim=32, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    with pytest.raises(ValueError, match="'opt' is not supported.*4D attention masks"):
        adapt_ar_model(opt)
    backbone = AutoModel.from_config(tiny_config("llama"))  # a LlamaModel: no output head
    with pytest.raises(TypeError, match="output head"):
        adapt_ar_model(backbone)


def test_bad_inputs_name_the_argument() -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    x = _ids()
    cases = [
        (TypeError, "x_t: expected a", dict(x_t=x.tolist())),
        (ValueError, r"x_t: expected shape \(B, L\), got \(16,\)", dict(x_t=x.flatten())),
        (TypeError, "x_t: expected integer token ids", dict(x_t=x.float())),
        (ValueError, r"x_t: expected token ids in \[0, 128\), got values in \[\d+, 200\]",
         dict(x_t=torch.cat([x[:, :-1], torch.full((2, 1), 200)], 1))),
        (ValueError, r"t: a 1-D t holds one time per row, so its length must be 2", dict(t=torch.rand(3))),
        (TypeError, "t: expected a float", dict(t="0.5")),
        (ValueError, r"t: expected times in the open interval \(0, 1\)", dict(t=torch.tensor([0.5, 1.0]))),
        (ValueError, r"bidirectional_prob: expected a float in \[0, 1\], got 1.5", dict(bidirectional_prob=1.5)),
        (TypeError, "bidirectional_prob", dict(bidirectional_prob=torch.tensor(0.5))),
        (ValueError, r"attention_mask: expected shape \(2, 8\)", dict(attention_mask=torch.ones(2, 7))),
        (ValueError, "attention_mask: expected contiguous padding",
         dict(attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]] * 2))),
    ]
    for exc, msg, kw in cases:
        args = {"x_t": x, **kw}
        with pytest.raises(exc, match=msg):
            model(args.pop("x_t"), args.pop("t", None), **args)
    tc = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, time_conditioning=True)
    with pytest.raises(ValueError, match="t: this model was adapted with time_conditioning=True"):
        tc(x)


def test_diffusion_loss_checks_the_padding_rule_in_its_one_sync() -> None:
    """diffusion_loss runs the model with validation off (no per-step syncs), so it checks the model's padding rule
    (contiguous pads) itself, inside its one batched read-back; with validation off nothing is checked."""
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    kernel = uf.MaskKernel(model.num_states, MASK_ID)
    x0 = _ids()
    holes = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1, 0, 0]])
    for fused in (False, True):
        with pytest.raises(ValueError, match=r"attention_mask: expected contiguous padding .* holes: \[1\]"):
            uf.diffusion_loss(model, x0, kernel, attention_mask=holes, fused=fused)
    for good in ([[1] * 8, [1] * 5 + [0] * 3], [[1] * 8, [0] * 3 + [1] * 5], [[0] * 7 + [1], [1] + [0] * 7]):
        out, counter = count_syncs(uf.diffusion_loss, model, x0, kernel, attention_mask=torch.tensor(good),
                                   generator=torch.Generator().manual_seed(0))
        assert counter.syncs <= 1, counter.sync_ops
        assert out.num_tokens == int(torch.tensor(good).sum())
    with validation(False):
        uf.diffusion_loss(model, x0, kernel, attention_mask=holes)  # the switch covers this check too


def test_generator_must_be_a_generator_at_every_entry() -> None:
    """An int seed (a common slip) is a TypeError naming generator, with the fix; before, 0 < γ < 1 reached
    torch.rand(generator=0) and raised torch's own TypeError, and γ ∈ {0, 1} ignored it silently."""
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    kernel = uf.MaskKernel(model.num_states, MASK_ID)
    x, t = _ids(), torch.tensor([0.3, 0.7])
    calls = [lambda g, gamma: model(x, bidirectional_prob=gamma, generator=g),
             lambda g, gamma: model.hidden_states(x, bidirectional_prob=gamma, generator=g),
             lambda g, gamma: model.loss(x, t, x, kernel, bidirectional_prob=gamma, generator=g),
             lambda g, gamma: model(x, t, x0=x, kernel=kernel, bidirectional_prob=gamma, generator=g)]
    for call in calls:
        for gamma in (0.0, 0.5, 1.0):
            with pytest.raises(TypeError, match=r"generator: expected a torch.Generator or None, got int; use "
                                                r"torch.Generator\(\).manual_seed\(0\)"):
                call(0, gamma)
        with pytest.raises(TypeError, match="generator: expected a torch.Generator or None, got str"):
            call("0", 0.5)
        a, b = (call(torch.Generator().manual_seed(3), 0.5) for _ in range(2))
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # same seed, same Bernoulli mask


def test_fused_loss_checks_the_kernel_against_the_model() -> None:
    """model.loss / forward(x0=, kernel=) check the kernel like diffusion_loss does (host metadata, no sync)."""
    added = adapt_ar_model(tiny_model("llama"))  # mask token added: id 128, 129 states
    assert added.mask_token_id == VOCAB and added.num_states == VOCAB + 1
    x, t = _ids(), torch.tensor([0.3, 0.7])
    wrong_id = uf.MaskKernel(added.num_states, mask_id=5)
    wrong_size = uf.UniformKernel(VOCAB)
    for call in (lambda k: added.loss(x, t, x, k), lambda k: added(x, t, x0=x, kernel=k)):
        with pytest.raises(ValueError, match=r"kernel: mask_id=5 but the model's mask token is 128; build the "
                                             r"kernel with mask_id=model.mask_token_id"):
            call(wrong_id)
        with pytest.raises(ValueError, match="kernel: has 128 states but the model predicts 129"):
            call(wrong_size)
        with pytest.raises(TypeError, match="kernel"):
            call("mask")
    uniform_only = adapt_ar_model(tiny_model("llama"), add_mask_token=False)
    with pytest.raises(ValueError, match="kernel: MaskKernel absorbs into mask id 5, but the model has no mask token"):
        uniform_only.loss(x, t, x, uf.MaskKernel(VOCAB, mask_id=5))
    right = uf.MaskKernel(added.num_states, mask_id=added.mask_token_id)
    with validation(False):  # the kernel check runs whatever the switch says, and reads no tensor value
        with pytest.raises(ValueError, match="kernel: mask_id=5"):
            added.loss(x, t, x, wrong_id)
        _, counter = count_syncs(added.loss, x, t, x, right)
    assert counter.syncs == 0, counter.sync_ops


def test_value_checks_follow_the_validation_switch() -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    with validation(False), torch.no_grad():
        model(_ids(), torch.tensor([0.0, 1.0]))  # t out of (0, 1): not checked when validation is off


# ---------------------------------------------------------------------------------------------------------------
# training features


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    x = _ids()
    grads = []
    for checkpointing in (False, True):
        model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert model.is_gradient_checkpointing
        model(x, bidirectional_prob=0.5, generator=torch.Generator().manual_seed(0)).logsumexp(-1).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1])


def test_bf16_autocast_runs_and_is_close() -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, time_conditioning=True)
    x, t = _ids(), torch.tensor([0.1, 0.7])
    with torch.no_grad():
        ref = model(x, t)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, t, bidirectional_prob=0.5)
            out1 = model(x, t)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out1.float(), ref, rtol=0.05, atol=0.05)


def test_bf16_weights_additive_mask() -> None:
    model = adapt_ar_model(tiny_model("gemma2").to(torch.bfloat16), mask_token_id=MASK_ID)
    mask = torch.ones(2, L)
    mask[1, -2:] = 0
    with torch.no_grad():
        out = model(_ids(), bidirectional_prob=0.5, attention_mask=mask)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_save_config_is_stamped_and_tolerant(tmp_path) -> None:
    import unifusion

    base = tiny_model("llama")
    base.config.quantization_config = {"quant_method": "gguf"}  # what a GGUF-loaded model carries
    model = adapt_ar_model(base)
    model.save_pretrained(tmp_path)
    stamp = json.loads((tmp_path / "unifusion_config.json").read_text())
    expected_version = getattr(unifusion, "__version__", None)
    if expected_version is not None:
        assert stamp["unifusion_version"] == expected_version
    assert stamp["bos_token_id"] == BOS and stamp["mask_token_id"] == VOCAB
    assert stamp["dtype"] == "float32" and not stamp["time_conditioning"]
    assert "quantization_config" not in stamp["base_config"]
    stamp["from_the_future"] = 1
    (tmp_path / "unifusion_config.json").write_text(json.dumps(stamp))
    with pytest.warns(UserWarning, match="from_the_future"):
        loaded = DiffusionLM.from_pretrained(tmp_path)
    assert loaded.num_states == VOCAB + 1
    with pytest.raises(ValueError, match="directory"):
        DiffusionLM.from_pretrained(tmp_path / "missing")


def test_save_load_bf16(tmp_path) -> None:
    model = adapt_ar_model(tiny_model("gpt2").to(torch.bfloat16))
    model.save_pretrained(tmp_path)
    loaded = DiffusionLM.from_pretrained(tmp_path)
    assert loaded.lm_head_weight.dtype == torch.bfloat16
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k
    assert loaded.lm_head_weight is loaded.base_model.get_input_embeddings().weight  # still tied


def test_peft_lora_base() -> None:
    peft = pytest.importorskip("peft")
    base = tiny_model("llama")
    x = _ids()
    with torch.no_grad():
        ref = adapt_ar_model(base, mask_token_id=MASK_ID)(x)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model = adapt_ar_model(lora, mask_token_id=MASK_ID)
    assert model.family.model_type == "llama" and model.base_model is lora
    out = model(x)
    torch.testing.assert_close(out, ref)  # LoRA B starts at zero
    out.logsumexp(-1).sum().backward()
    trained = [n for n, p in model.named_parameters() if p.grad is not None]
    assert trained and all("lora" in n for n in trained)
    with pytest.raises(TypeError, match="merge"):
        model.save_pretrained("unused")


@pytest.mark.slow
def test_torch_compile_matches_eager() -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    x = _ids()
    with torch.no_grad():
        eager = model(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(model)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_uniform_only_adaptation_keeps_the_vocabulary(tmp_path):
    """add_mask_token=False (the paper's uniform setting): no resize, logits equal the AR model's, round-trips."""
    base = tiny_model("llama")
    reference = tiny_model("llama")
    model = adapt_ar_model(base, add_mask_token=False)
    assert model.mask_token_id is None and model.num_states == VOCAB
    assert base.get_input_embeddings().weight.shape[0] == VOCAB
    x = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = model(x, bidirectional_prob=0.0)
    bos = torch.full((2, 1), model.bos_token_id)
    expected = reference(torch.cat([bos, x], 1)).logits[:, :-1]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    loaded = DiffusionLM.from_pretrained(tmp_path)
    assert loaded.mask_token_id is None and loaded.num_states == VOCAB
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="add_mask_token"):
        adapt_ar_model(tiny_model("llama"), add_mask_token="no")
