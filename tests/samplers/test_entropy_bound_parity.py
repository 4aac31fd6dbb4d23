"""EntropyBound + PolicySampler reproduce transformers' DiffusionGemmaForBlockDiffusion.generate token for token under
the same global seed, on a tiny random DiffusionGemma, through a minimal BlockDenoiser around its encoder (which
writes the KV cache) and decoder (which reads it, with self-conditioning). See /work/scratch/entropy_bound_notes.md
for the reference's sequence of random draws."""

import copy

import pytest
import torch
from _hf_tiny import tiny_diffusion_gemma

import unifusion as uf
from unifusion.samplers import PolicySampler
from unifusion.samplers.policies import EntropyBound

transformers = pytest.importorskip("transformers")
generation = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")

V, CANVAS, PROMPT, NEW = 128, 8, 5, 24


def _tiny_model(seed=0, eos_boost=None):
    model = tiny_diffusion_gemma(CANVAS, seed, V, num_experts=2, top_k_experts=1, sliding_window=16)
    with torch.no_grad():  # sharper predictions (entropies ~0.3-1.5 nats) than the random init's near-uniform ones
        model.lm_head.weight.mul_(30.0)
        if eos_boost is not None:
            model.lm_head.weight[1].mul_(eos_boost)
    return model


class DiffusionGemmaBlocks:
    """The minimal BlockDenoiser: the clean prefix and each committed block go through the encoder into the KV cache;
    a block (the canvas) goes through the decoder against it, with the previous step's scaled logits as
    self-conditioning. The masks and positions are built with the model's own public mask builders, as its
    generate does. Rows that no longer run are dropped from a copy of the cache."""

    def __init__(self, model):
        self.model, self.config = model, model.config

    def start_blocks(self, prefix, prefix_mask):
        cache = transformers.DynamicCache(config=self.config.get_text_config(decoder=True))
        return self._encode({"cache": cache, "mask": prefix_mask, "length": 0}, prefix)

    def _encode(self, state, ids):
        n, start = ids.shape[1], state["length"]
        position_ids = torch.arange(start, start + n, dtype=torch.int32)[None]
        masks = self.model.model.encoder.create_masks_for_generate(
            config=self.config, inputs_embeds=torch.empty((ids.shape[0], n, 0)), attention_mask=state["mask"],
            cache=state["cache"], position_ids=position_ids)
        state["cache"] = self.model.model.encoder(input_ids=ids, attention_mask=masks, cache=state["cache"],
                                                  position_ids=position_ids).cache
        state["length"] = start + n
        return state

    def denoise_block(self, state, block, t, rows, self_condition, positions=None):
        cache, mask = state["cache"], state["mask"]
        if rows.numel() != mask.shape[0]:
            cache = copy.deepcopy(cache)
            cache.batch_select_indices(rows)
            mask = mask[rows]
        n, start = block.shape[1], state["length"]
        decoder_mask = self.model.model.decoder.create_diffusion_decoder_attention_mask(
            config=self.config, inputs_embeds=block.unsqueeze(-1), cache=cache,
            decoder_attention_mask=torch.nn.functional.pad(mask, (0, n), value=True))
        return self.model(decoder_input_ids=block, self_conditioning_logits=self_condition, cache=cache,
                          decoder_attention_mask=decoder_mask,
                          decoder_position_ids=torch.arange(start, start + n, dtype=torch.int32)[None]).logits

    def commit_block(self, state, block, rows):
        assert rows.numel() == state["mask"].shape[0]  # no row stops at EOS before the last block here
        state["mask"] = torch.nn.functional.pad(state["mask"], (0, block.shape[1]), value=True)
        return self._encode(state, block)


def _run_both(model, seed, batch, bound, steps, stability, confidence, eos=None):
    pad = None if eos is None else 0
    config = generation.DiffusionGemmaGenerationConfig(
        max_new_tokens=NEW, max_denoising_steps=steps, t_min=0.4, t_max=0.8, stability_threshold=stability,
        sampler_config=generation.EntropyBoundSamplerConfig(entropy_bound=bound), confidence_threshold=confidence,
        eos_token_id=eos, pad_token_id=pad)
    ids = torch.randint(3, 120, (batch, PROMPT), generator=torch.Generator().manual_seed(100 + seed))
    torch.manual_seed(seed)
    reference = model.generate(ids, generation_config=config)
    policy = EntropyBound(bound, t_max=0.8, t_min=0.4, stability_threshold=stability, confidence_threshold=confidence)
    sampler = PolicySampler(DiffusionGemmaBlocks(model), uf.UniformKernel(V), policy, num_steps=steps,
                            block_size=CANVAS)
    prompt = torch.full((batch, PROMPT + NEW), -1)
    prompt[:, :PROMPT] = ids
    torch.manual_seed(seed)
    ours = sampler.sample(batch, PROMPT + NEW, prompt=prompt, eos_token_id=eos, pad_token_id=pad, return_dict=True)
    return reference, ours


@pytest.mark.parametrize("seed,batch,bound,steps,stability,confidence", [
    (2, 3, 1.0, 6, 1, 0.6),  # the third row stops its last canvas two steps early, the others run every step
    (0, 2, 0.5, 8, 0, 0.5),  # no stability requirement: rows stop their canvases at different steps
    (1, 2, 0.5, 8, 0, 0.5),
])
def test_generate_parity_with_transformers(seed, batch, bound, steps, stability, confidence):
    model = _tiny_model()
    reference, ours = _run_both(model, seed, batch, bound, steps, stability, confidence)
    assert torch.equal(ours.sequences, reference.sequences)
    # tokens per forward: generated tokens / the decoder passes each row took part in
    assert torch.allclose(ours.tokens_per_forward, reference.tokens_per_forward.float())
    assert (ours.num_forwards < steps * NEW // CANVAS).any()  # some row stopped a canvas early


def test_generate_parity_with_eos():
    """One row: the reference stops after the canvas holding EOS and pads its tail; ours stops there too (no further
    forwards) and fills the rest of the sequence with the pad id."""
    model = _tiny_model(eos_boost=1.8)
    reference, ours = _run_both(model, 4, 1, 2.0, 5, 1, 0.9, eos=1)
    n = reference.sequences.shape[1]
    assert n == PROMPT + CANVAS  # EOS (at position 9) ended generation after the first canvas
    assert torch.equal(ours.sequences[:, :n], reference.sequences)
    assert ours.sequences[0, 9] == 1 and (ours.sequences[:, 10:] == 0).all()
    assert ours.num_forwards.tolist() == [5]
    assert torch.allclose(ours.tokens_per_forward, reference.tokens_per_forward.float())
