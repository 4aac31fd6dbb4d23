"""unifusion.hf.ar.model: DiffusionLM's checks, forward options, training features and properties on tiny random models
(tests/_hf_tiny.py); the families are crossed in test_families.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from _dispatch_count import count_syncs
from _hf_tiny import VOCAB, random_ids, tiny_model

import unifusion as uf
from unifusion._validation import validation
from unifusion.hf import adapt_ar_model

L = 8  # sequence length of the tests (network length L + 1 = 9 > the sliding windows of 4 in _hf_tiny)
MASK_ID = 3


# ---------------------------------------------------------------------------------------------------------------
# bad inputs


def test_bad_inputs_name_the_argument() -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    x = random_ids()
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
        # a 0-d float tensor is a valid γ (the torch.compile form); other tensors are not
        (TypeError, "bidirectional_prob: expected a float in", dict(bidirectional_prob=torch.tensor([0.5]))),
        (TypeError, "bidirectional_prob: expected a float in", dict(bidirectional_prob=torch.tensor(1))),
        (ValueError, r"bidirectional_prob: expected a value in \[0, 1\], got 1.5",
         dict(bidirectional_prob=torch.tensor(1.5))),
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
    x0 = random_ids()
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
    x, t = random_ids(), torch.tensor([0.3, 0.7])
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
    x, t = random_ids(), torch.tensor([0.3, 0.7])
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
        model(random_ids(), torch.tensor([0.0, 1.0]))  # t out of (0, 1): not checked when validation is off


# ---------------------------------------------------------------------------------------------------------------
# the network's inputs


@torch.no_grad()
def test_network_inputs_are_what_the_wrapped_model_gets() -> None:
    """hf_model is the Hugging Face model (peft unwrapped); hf_model(**network_inputs(...)) is forward's network call:
    [BOS, x_t] (L + 1 positions), the attention path's keywords, logits equal to forward's on the first L positions."""
    base = tiny_model("llama")
    model = adapt_ar_model(base, mask_token_id=MASK_ID)
    assert model.hf_model is base
    x = random_ids()
    pad = torch.ones(2, L, dtype=torch.long)
    pad[1, :2] = 0
    for gamma, mask, keys in ((0.0, None, set()), (1.0, None, {"is_causal"}), (0.5, None, {"attention_mask"}),
                              (1.0, pad, {"attention_mask", "position_ids"})):
        kwargs = model.network_inputs(x, bidirectional_prob=gamma, attention_mask=mask,
                                      generator=torch.Generator().manual_seed(1))
        assert set(kwargs) == {"use_cache", "input_ids"} | keys, (gamma, mask is not None)
        assert kwargs["input_ids"].shape == (2, L + 1)
        logits = model.hf_model(**kwargs).logits[:, :-1]
        out = model(x, bidirectional_prob=gamma, attention_mask=mask, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(out, logits, rtol=0, atol=0)
    timed = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, time_conditioning=True)
    kwargs = timed.network_inputs(x, torch.tensor([0.2, 0.7]))
    assert "input_ids" not in kwargs and kwargs["inputs_embeds"].shape == (2, L + 1, 32)
    with pytest.raises(ValueError, match="t: this model was adapted with time_conditioning=True"):
        timed.network_inputs(x)

# ---------------------------------------------------------------------------------------------------------------
# training features


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    x = random_ids()
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
    x, t = random_ids(), torch.tensor([0.1, 0.7])
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
        out = model(random_ids(), bidirectional_prob=0.5, attention_mask=mask)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()

def test_peft_lora_base() -> None:
    peft = pytest.importorskip("peft")
    base = tiny_model("llama")
    x = random_ids()
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
    x = random_ids()
    with torch.no_grad():
        eager = model(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(model)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# device, dtype, num_parameters


def test_device_dtype_num_parameters() -> None:
    base = tiny_model("llama")
    n_base = base.num_parameters()
    model = adapt_ar_model(base, add_mask_token=False)
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert model.num_parameters() == n_base == sum(p.numel() for p in base.parameters())
    timed = adapt_ar_model(tiny_model("llama"), add_mask_token=False, time_conditioning=True)
    assert timed.num_parameters() == n_base + sum(p.numel() for p in timed.time_embedding.parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    model.lm_head_weight.requires_grad_(True)
    assert model.num_parameters(only_trainable=True) == model.lm_head_weight.numel()
    with pytest.raises(TypeError, match="only_trainable"):
        model.num_parameters(only_trainable="yes")  # type: ignore[arg-type]
    assert adapt_ar_model(tiny_model("llama").to(torch.bfloat16), add_mask_token=False).dtype == torch.bfloat16

@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_num_parameters_exclude_embeddings_counts_as_hugging_face(family: str) -> None:
    """``exclude_embeddings=True`` leaves out the ``nn.Embedding`` weights (and an output head tied to them), as
    Hugging Face's own ``num_parameters`` does: the same number for the same weights."""
    base = tiny_model(family)
    model = adapt_ar_model(base, add_mask_token=False)
    expected = base.num_parameters(exclude_embeddings=True)
    assert model.num_parameters(exclude_embeddings=True) == expected < model.num_parameters()
    embeddings = sum(m.weight.numel() for m in {id(m): m for m in model.modules()
                                                if isinstance(m, torch.nn.Embedding)}.values())
    assert model.num_parameters() - model.num_parameters(exclude_embeddings=True) == embeddings
    for p in model.parameters():
        p.requires_grad_(False)
    base.get_input_embeddings().weight.requires_grad_(True)
    assert model.num_parameters(only_trainable=True, exclude_embeddings=True) == 0
    with pytest.raises(TypeError, match="exclude_embeddings: expected a bool, got int"):
        model.num_parameters(exclude_embeddings=1)  # type: ignore[arg-type]
