"""A model kind registered from outside the package trains, scores and samples through the public interface only.

The toy kind below is what a third party writes: a :class:`~unifusion.denoiser.DenoiserModule` subclass (a mean-field
x0 predictor: each position's hidden state is its token's embedding plus the mean embedding of what it sees), a
``wrap`` function registered with :func:`unifusion.hf.register_diffusion_lm`, and, for its block variant, its own
name for the clean stream (``context=``, declared by :meth:`~unifusion.denoiser.Denoiser.block_conditioning`; the
forward refuses a multi-block call without it, as a block model must). Through it:

* :func:`unifusion.rl.sequence_logprob` with every estimator the kind takes: the unbiased ones agree with the ELBO
  enumerated over every mask of the completion (4 SE); the block variant's ``"elbo"`` with the block ELBO enumerated
  under the decoder's blocks (cut where the completion starts, prompt length not a multiple of K), and ``"trace"``
  of a rollout with the rollout's own ``commit_logprob``;
* :class:`~unifusion.integrations.trl.DiffusionSFTTrainer` and
  :class:`~unifusion.integrations.trl.DiffusionGRPOTrainer` for two steps each.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

import unifusion as uf
from unifusion.block_partition import expand_block_times
from unifusion.denoiser import DenoiserModule
from unifusion.hf import registry
from unifusion.hf.backbone import BackboneMethods
from unifusion.losses import fused_linear_diffusion_loss

sys.path.insert(0, os.path.dirname(__file__))
from rl._exact import exact_elbo, generators, mean_and_se  # noqa: E402

DATA = Path(__file__).parent / "data"
MODEL_TYPE = "toy_mean_field"
VOCAB = 128  # the tiny tokenizer's
MASK = VOCAB  # the toy's mask state, after the vocabulary
STATES = VOCAB + 1


class ToyConfig(PretrainedConfig):
    model_type = MODEL_TYPE


class ToyNet(PreTrainedModel):
    """The transformers model of the toy kind: embeddings, an output head and a config naming its model type."""

    config_class = ToyConfig

    def __init__(self, config: ToyConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, 16)
        self.head = nn.Linear(16, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed


def toy_net(seed: int = 0, scale: float = 3.0) -> ToyNet:
    """Random weights N(0, scale²): sharp predictions that depend on what each position sees."""
    torch.manual_seed(seed)
    net = ToyNet(ToyConfig(vocab_size=STATES, eos_token_id=2, pad_token_id=0))
    with torch.no_grad():
        net.embed.weight.normal_(0.0, scale)
        net.head.weight.normal_(0.0, scale)
    return net


def _mean(values: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``(B, L, d)`` means of ``values`` ``(B, L, d)`` over the positions ``seen`` ``(B, L, L)`` (0 over none)."""
    w = seen.to(values.dtype)
    return torch.einsum("bij,bjd->bid", w, values) / w.sum(-1, keepdim=True).clamp_min(1.0)


class ToyDenoiser(BackboneMethods, DenoiserModule):
    """The toy kind: h_i = e(x_t[i]) + mean of e(x_t) over what position i sees. Without blocks it sees every real
    position; with blocks of K (cut at column multiples of K) it sees its own block's x_t and the clean ``context``
    of the blocks before it. Time is not an input (a mask-kernel x0 predictor needs none)."""

    def __init__(self, net: ToyNet, *, tokenizer: Any = None, block_size: int | None = None) -> None:
        super().__init__()
        self.net = net
        self.mask_token_id = MASK
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.config = net.config
        self.generation_config = GenerationConfig(eos_token_id=net.config.eos_token_id,
                                                  pad_token_id=net.config.pad_token_id)
        self.kernel = uf.MaskKernel(STATES, MASK)

    @property
    def num_states(self) -> int:
        return STATES

    @property
    def device(self) -> torch.device:
        return self.net.head.weight.device

    def backbone(self) -> ToyNet:  # BackboneMethods: the methods TRL calls on a model, acting on the backbone
        return self.net

    def block_conditioning(self, x0: torch.Tensor) -> dict[str, Any]:
        return {} if self.block_size is None else {"context": x0}

    def hidden(self, x_t: torch.Tensor, attention_mask: torch.Tensor | None, context: torch.Tensor | None
               ) -> torch.Tensor:
        B, L = x_t.shape
        valid = torch.ones(B, L, dtype=torch.bool, device=x_t.device) if attention_mask is None else \
            attention_mask.bool()
        e = self.net.embed(x_t)
        if self.block_size is None or L <= self.block_size:
            return e + _mean(e, valid[:, None, :].expand(B, L, L))
        if context is None:
            raise ValueError("context: a multi-block call needs the clean stream (block_conditioning)")
        block = torch.arange(L, device=x_t.device) // self.block_size
        own = (block[:, None] == block[None, :])[None] & valid[:, None, :]
        earlier = (block[None, :] < block[:, None])[None] & valid[:, None, :]
        return e + _mean(e, own) + _mean(self.net.embed(context), earlier)

    def forward(self, x_t: torch.Tensor, t: Any = None, *, bidirectional_prob: float = 1.0,
                attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
                x0: torch.Tensor | None = None, kernel: Any = None, objective: Any = "gidd", weighting: Any = "elbo",
                max_weight: float = 2.0, reduction: Any = "none", position_weight: torch.Tensor | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        h = self.hidden(x_t, attention_mask, context)
        if kernel is None:
            return self.logits_from_hidden(h)
        assert x0 is not None and t is not None
        t_pos = t[:, None].expand(x_t.shape) if t.dim() == 1 else expand_block_times(t, x_t.shape[1], self.block_size)
        return fused_linear_diffusion_loss(h, self.net.head.weight, x0, x_t, t_pos, kernel, objective=objective,
                                           weighting=weighting, max_weight=max_weight, reduction=reduction,
                                           position_weight=position_weight)

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        return self.net.head(h)

    def block_forward(self) -> Any:
        if self.block_size is None:
            return None
        return lambda x_t, t, attention_mask=None: self(x_t, t, attention_mask=attention_mask, context=x_t)

    def generate(self, prompt_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return uf.samplers.generate(self, prompt_ids, *args, **kwargs)

    def save_pretrained(self, save_directory: Any, tokenizer: Any = None, *, kernel: Any = None) -> None:
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE, "block_size": self.block_size}))
        torch.save(self.net.state_dict(), folder / "weights.pt")

    @classmethod
    def from_pretrained(cls, directory: Any, *, dtype: Any = None, device: Any = None,
                        load_tokenizer: bool = True) -> ToyDenoiser:
        folder = Path(directory)
        net = toy_net()
        net.load_state_dict(torch.load(folder / "weights.pt"))
        block_size = json.loads((folder / "config.json").read_text())["block_size"]
        return cls(net, block_size=block_size).eval()


def wrap(net: ToyNet, *, tokenizer: Any = None, block_size: int | None = None) -> ToyDenoiser:
    return ToyDenoiser(net, tokenizer=tokenizer, block_size=block_size)


@pytest.fixture
def registered(monkeypatch):
    """The toy kind registered through the public registry (the registry's entries restored afterwards)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_LOADERS", dict(registry._LOADERS))
    uf.hf.register_diffusion_lm(MODEL_TYPE, wrap, loader=ToyDenoiser.from_pretrained)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(DATA / "tiny_tokenizer")


def test_the_kind_registers_wraps_and_loads(registered, tmp_path) -> None:
    assert MODEL_TYPE in uf.hf.supported_diffusion_lms()
    model = uf.wrap_diffusion_lm(toy_net(seed=1), block_size=4)
    assert isinstance(model, ToyDenoiser) and model.block_size == 4
    model.save_pretrained(tmp_path)
    loaded = uf.load_diffusion_lm(tmp_path)
    assert isinstance(loaded, ToyDenoiser) and loaded.block_size == 4
    torch.testing.assert_close(loaded.net.head.weight, model.net.head.weight, rtol=0, atol=0)


def _subset_log_probs(model: ToyDenoiser, x0: torch.Tensor, positions: list[int]) -> dict[frozenset[int], torch.Tensor]:
    """``log p(x0_i | x0 with M masked)`` for every subset M of ``positions`` (one row; the toy without blocks)."""
    import itertools
    subsets = [frozenset(c) for r in range(len(positions) + 1) for c in itertools.combinations(positions, r)]
    x_t = x0.repeat(len(subsets), 1)
    for j, M in enumerate(subsets):
        x_t[j, sorted(M)] = MASK
    with torch.no_grad():
        logits = model(x_t).double()
    logits[..., MASK] = -math.inf
    lp = torch.log_softmax(logits, -1).gather(-1, x0.repeat(len(subsets), 1)[..., None])[..., 0]
    return {M: lp[j] for j, M in enumerate(subsets)}


ROW = torch.tensor([[1, 17, 40, 9, 55, 23, 70, 12, 31]])  # prompt 3 tokens, completion 6
PROMPT = 3


def _completion_of_rows(n: int) -> torch.Tensor:
    """``(n, L)`` bool: ROW's completion (every column after its PROMPT prompt tokens) on ``n`` copies."""
    completion = torch.zeros((n, ROW.shape[1]), dtype=torch.bool)
    completion[:, PROMPT:] = True
    return completion


def _check_elbo_estimate_near(model, exact: float, *, estimator: str = "elbo", seed: int = 6,
                              n: int = 400) -> torch.Tensor:
    """``sequence_logprob``'s ``estimator`` estimates ``(n,)`` of ROW's completion, one row seed each (from
    ``seed``), their mean within 4 standard errors of ``exact``."""
    x0, completion = ROW.repeat(n, 1), _completion_of_rows(n)
    with torch.no_grad():
        est = uf.rl.sequence_logprob(model, x0, completion, estimator=estimator, generator=generators(n, seed=seed))
    mean, se = mean_and_se(est.sequence)
    assert abs(mean - exact) < 4 * se, (estimator, mean, se, exact)
    return est.sequence


@pytest.mark.parametrize("estimator", ["elbo", "elbo_discrete", "coupled"])
def test_unbiased_estimators_of_the_kind_match_its_enumerated_elbo(registered, estimator) -> None:
    model = uf.wrap_diffusion_lm(toy_net(seed=2)).eval()
    positions = list(range(PROMPT, ROW.shape[1]))
    exact = exact_elbo(_subset_log_probs(model, ROW[0], positions), positions)
    estimates = _check_elbo_estimate_near(model, exact, estimator=estimator, seed=5)
    assert estimates.std() > 0  # the draws differ: each row's own generator


def test_every_estimator_of_the_kind_runs_and_carries_gradients(registered) -> None:
    model = uf.wrap_diffusion_lm(toy_net(seed=3))
    x0, completion = ROW.repeat(2, 1), _completion_of_rows(2)
    trace = torch.full_like(x0, -1)
    trace[:, PROMPT:] = torch.tensor([2, 0, 1, 1, 0, 2])
    options = {"trace": {"trace": trace}, "quadrature": {"draws": 2}, "eubo": {"eubo_beta": 2.0}}
    for estimator in uf.rl.ESTIMATORS:
        model.zero_grad()
        est = uf.rl.sequence_logprob(model, x0, completion, estimator=estimator,
                                     num_samples=1 if estimator == "trace" else 2,
                                     generator=torch.Generator().manual_seed(0), **options.get(estimator, {}))
        assert torch.isfinite(est.sequence).all() and (est.sequence < 0).all(), estimator
        assert (est.per_token[:, :PROMPT] == 0).all(), estimator
        est.sequence.sum().backward()
        assert model.net.head.weight.grad.abs().sum() > 0, estimator


def _block_elbo_under_decoder_blocks(model: ToyDenoiser, x0: torch.Tensor, start: int, origin: int | None = None
                                     ) -> float:
    """The block ELBO of ``x0[start:]`` (one row) with blocks of K cut from ``origin`` (the decoder's; default
    ``start``), enumerated: block [lo, hi) is predicted from the clean x0[:lo] and its own noisy tokens (its columns
    before ``start`` clean), straight from the toy's definition (h_i = e(x_t[i]) + mean e(block's x_t) + mean
    e(x0[:lo]), 0 for none))."""
    import itertools
    K, L = model.block_size, x0.shape[0]
    embed, head = model.net.embed, model.net.head
    total = 0.0
    first = start if origin is None else origin + (start - origin) // K * K
    for lo in range(first, L, K):
        hi = min(lo + K, L)
        positions = [c for c in range(lo, hi) if c >= start]
        lp: dict[frozenset[int], torch.Tensor] = {}
        for r in range(len(positions) + 1):
            for M in map(frozenset, itertools.combinations(positions, r)):
                block = x0[lo:hi].clone()
                block[[m - lo for m in sorted(M)]] = MASK
                with torch.no_grad():
                    e = embed(block)
                    h = e + e.mean(0) + (embed(x0[:lo]).mean(0) if lo else 0.0)  # a mean over none is 0
                    logits = head(h).double()
                logits[..., MASK] = -math.inf
                full = torch.zeros(L, dtype=torch.float64)
                full[lo:hi] = torch.log_softmax(logits, -1).gather(-1, x0[lo:hi, None])[:, 0]
                lp[M] = full
        total += exact_elbo(lp, positions)
    return total


def test_block_kind_scores_under_the_decoders_blocks_through_its_declared_clean_stream(registered) -> None:
    model = uf.wrap_diffusion_lm(toy_net(seed=4), block_size=4).eval()
    exact = _block_elbo_under_decoder_blocks(model, ROW[0], PROMPT)  # blocks [3..6], [7, 8]
    _check_elbo_estimate_near(model, exact)
    with pytest.raises(ValueError, match="estimator"):  # a block model takes the block ELBO (and traces)
        uf.rl.sequence_logprob(model, ROW, _completion_of_rows(1), estimator="coupled")


def test_a_kind_declaring_blocks_from_the_sequence_start_is_sampled_and_scored_under_them(registered) -> None:
    """A kind that declares ``block_origin = "sequence_start"`` (a released block model's layout; the default is
    ``"prompt_end"``): ``sequence_logprob`` is unbiased for the block ELBO enumerated with blocks from column 0 (the
    first holding the prompt's 3 tokens and the first completion token), and its rollout's trace replays."""
    class FromSequenceStart(ToyDenoiser):
        block_origin = "sequence_start"

    assert ToyDenoiser.block_origin == "prompt_end"
    model = FromSequenceStart(toy_net(seed=4), block_size=4).eval()
    exact = _block_elbo_under_decoder_blocks(model, ROW[0], PROMPT, origin=0)  # blocks [0..3], [4..7], [8]
    assert abs(exact - _block_elbo_under_decoder_blocks(model, ROW[0], PROMPT)) > 0.5  # another distribution
    _check_elbo_estimate_near(model, exact)
    prompt = ROW[:, :PROMPT].repeat(2, 1)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=6, policy=uf.samplers.policies.LowConfidence(), num_steps=2,
                             use_cache=False, return_dict=True, return_trace=True, eos_token_id=None,
                             generator=[torch.Generator().manual_seed(i) for i in range(2)])
        replayed = uf.rl.sequence_logprob(model, out.sequences, _completion_of_rows(2), estimator="trace",
                                          trace=out.commit_step)
    assert bool((out.commit_step[:, 3] < out.commit_step[:, 4:].amin(-1)).all())  # column 3 decoded in block 0
    torch.testing.assert_close(replayed.sequence, out.commit_logprob.sum(-1).to(replayed.sequence.dtype), rtol=1e-5,
                               atol=1e-5)


def test_block_kind_replays_its_rollout_to_the_rollouts_log_probs(registered) -> None:
    model = uf.wrap_diffusion_lm(toy_net(seed=5), block_size=4).eval()
    prompt = ROW[:, :PROMPT].repeat(2, 1)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=6, policy=uf.samplers.policies.LowConfidence(), num_steps=2,
                             use_cache=False, return_dict=True, return_trace=True, eos_token_id=None,
                             generator=[torch.Generator().manual_seed(i) for i in range(2)])
    with torch.no_grad():
        est = uf.rl.sequence_logprob(model, out.sequences, _completion_of_rows(2), estimator="trace",
                                     trace=out.commit_step)
    torch.testing.assert_close(est.sequence, out.commit_logprob.sum(-1).to(est.sequence.dtype), rtol=1e-5,
                               atol=1e-5)


def test_a_block_kind_that_declares_no_clean_stream_is_refused_by_name() -> None:
    class Undeclared(ToyDenoiser):
        block_conditioning = uf.denoiser.Denoiser.block_conditioning

    model = Undeclared(toy_net(), block_size=4)
    x0 = ROW.clone()
    with pytest.raises(TypeError, match="block_conditioning"):
        uf.rl.sequence_logprob(model, x0, _completion_of_rows(1))
    with pytest.raises(TypeError, match="block_conditioning"):
        uf.diffusion_loss(model, x0, model.kernel)


def test_sft_trainer_trains_the_kind(registered, tokenizer, tmp_path) -> None:
    from datasets import Dataset
    from trl import SFTConfig

    from unifusion.integrations.trl import DiffusionSFTTrainer

    model = uf.wrap_diffusion_lm(toy_net(seed=6), tokenizer=tokenizer, block_size=4)
    rows = [{"prompt": "ab cd ef", "completion": " gh ij kl mn op"}, {"prompt": "qr st", "completion": " uv wx"}]
    args = SFTConfig(str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                     save_strategy="no", logging_steps=1, learning_rate=1e-2, gradient_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DiffusionSFTTrainer(model, args, train_dataset=Dataset.from_list(rows * 4),
                                      processing_class=tokenizer)
        before = model.net.head.weight.detach().clone()
        result = trainer.train()
    assert result.global_step == 2 and math.isfinite(result.training_loss)
    assert not torch.equal(before, model.net.head.weight)


@pytest.mark.parametrize(("block_size", "estimator"), [(None, "coupled"), (4, "elbo")])
def test_grpo_trainer_trains_the_kind(registered, tokenizer, tmp_path, block_size, estimator) -> None:
    from datasets import Dataset

    from unifusion.integrations.trl import DiffusionGRPOConfig, DiffusionGRPOTrainer

    model = uf.wrap_diffusion_lm(toy_net(seed=7, scale=0.5), tokenizer=tokenizer, block_size=block_size)
    args = DiffusionGRPOConfig(str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=2,
                               max_completion_length=6, report_to=[], use_cpu=True, save_strategy="no",
                               logging_steps=1, learning_rate=1e-2, gradient_checkpointing=False, beta=0.1,
                               estimator=estimator, num_samples=1, decoding_policy="low_confidence", num_steps=2,
                               decoding_block_size=3 if block_size is None else None, use_cache=False, seed=3)
    prompts = [{"prompt": "the cat and the dog"}, {"prompt": "a bird"}]

    def mean_id(completion_ids, **_):
        return [sum(ids) / (128.0 * len(ids)) for ids in completion_ids]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DiffusionGRPOTrainer(model, reward_funcs=mean_id, args=args,
                                       train_dataset=Dataset.from_list(prompts * 4), processing_class=tokenizer)
        before = model.net.head.weight.detach().clone()
        result = trainer.train()
    assert result.global_step == 2 and math.isfinite(result.training_loss)
    assert not torch.equal(before, model.net.head.weight)
