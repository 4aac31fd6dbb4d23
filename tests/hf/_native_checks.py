"""Checks shared by the tests of the released diffusion LMs (tests/hf/llada, tests/hf/dream): each kind's fixture
folder holds its tiny random checkpoint (their layout, written by their own code) and ``reference.safetensors`` (their
inputs and outputs); see the fixture folders' README.md."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import unifusion as uf
from unifusion.hf.native_checkpoint import save_weights

RECORDED_ATOL = 1e-4
"""Float32 logits against their recorded ones: equal up to how another CPU rounds. The tests held at 10⁻⁵ on the CPU
the references were recorded on; on an AVX512 CPU (another matmul kernel, another summation order; 2026-11-30) ours
differ from them by up to 2.4·10⁻⁵ at logits of standard deviation ~6, where a wrong mask moves them by far more
(LLaDA's padded rows with the padding left visible: 14)."""


def reference(fixtures: Path) -> dict[str, torch.Tensor]:
    return load_file(str(fixtures / "reference.safetensors"))


def copy_checkpoint(fixtures: Path, tmp_path: Path) -> Path:
    target = tmp_path / "checkpoint"
    shutil.copytree(fixtures / "checkpoint", target)
    return target


def subset_log_probs(model: Any, x0: torch.Tensor, positions: list[int]) -> dict[frozenset[int], torch.Tensor]:
    """``log x_θ(x0_i | x0 with M masked)`` ``(L,)`` float64 for every subset M of ``positions`` (the mask state left
    out, MDLM's SUBS convention), from one forward of the model."""
    mask = model.mask_token_id
    subsets = [frozenset(c) for r in range(len(positions) + 1) for c in itertools.combinations(positions, r)]
    x_t = x0.repeat(len(subsets), 1)
    for j, M in enumerate(subsets):
        x_t[j, sorted(M)] = mask
    with torch.no_grad():
        logits = model(x_t).double()
    logits[..., mask] = -math.inf
    lp = torch.log_softmax(logits, -1).gather(-1, x0.repeat(len(subsets), 1)[..., None])[..., 0]
    return {M: lp[j] for j, M in enumerate(subsets)}


def exact_elbo(lp: dict[frozenset[int], torch.Tensor], positions: list[int]) -> float:
    """The mask kernel's ELBO of the completion, Σ_{M ≠ ∅} (l − 1)! (n − l)! / n! Σ_{i∈M} log x_θ(x_i | x_¬M)."""
    n = len(positions)
    total = 0.0
    for M, v in lp.items():
        if M:
            l_ = len(M)
            total += math.factorial(l_ - 1) * math.factorial(n - l_) / math.factorial(n) * float(v[sorted(M)].sum())
    return total


def check_estimators_match_the_enumerated_elbo(model: Any) -> None:
    """``uf.diffusion_loss`` (SFT: the prompt clean), ``uf.eval.nll_bound`` and ``uf.rl.sequence_logprob`` are
    unbiased for the enumerated ELBO of a 5-token completion after a 3-token prompt: the mean of R independent rows
    lies within 4 standard errors."""
    L, P, R = 8, 3, 256
    positions = list(range(P, L))
    x0 = torch.randint(0, 80, (L,), generator=torch.Generator().manual_seed(5))
    elbo = exact_elbo(subset_log_probs(model, x0, positions), positions)
    _check_estimators_near(model, x0, P, R, elbo)


def check_block_estimators_match_the_enumerated_block_elbo(model: Any, *, prompt_length: int = 4,
                                                          completion_length: int = 8, rollout: bool = False,
                                                          seed: int = 5) -> None:
    """For a block kind (block size K = 4): ``uf.diffusion_loss`` (SFT, the prompt clean), ``uf.eval.nll_bound`` and
    ``uf.rl.sequence_logprob`` are unbiased for the enumerated block ELBO Σ_b ELBO(block b | x0 of blocks < b) of a
    completion (8 tokens: two blocks) after a prompt (4 tokens), the blocks cut at column multiples of K from column
    0 as the released kinds' decoders cut them (``block_origin="sequence_start"``; a prompt whose length K does not
    divide shares its last block with the first completion tokens, which stay clean in it): each block's term
    enumerates the masks of its completion positions through the training stream ``model(x_t, clean=x0)``; the mean
    of R rows lies within 4 standard errors. ``rollout``: the completion is the model's own sample from
    ``generate`` (random tokens otherwise; ``seed`` draws the tokens and the rollout), where blocks cut at the
    prompt's end instead are many standard errors off."""
    K = model.block_size
    assert K == 4 and model.block_origin == "sequence_start"
    P = prompt_length
    L, R = P + completion_length, 256
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randint(0, 80, (L,), generator=g)
    if rollout:  # a completion the model sampled (an RL rollout): the blocks matter most where it is likely
        from unifusion.samplers.policies import LowConfidence

        x0 = model.generate(x0[None, :P], max_new_tokens=L - P, policy=LowConfidence(), num_steps=1,
                            eos_token_id=None, generator=g)[0]
    elbo = 0.0
    mask = model.mask_token_id
    for start in range(P // K * K, L, K):
        positions = [c for c in range(start, min(start + K, L)) if c >= P]
        subsets = [frozenset(c) for r in range(K + 1) for c in itertools.combinations(positions, r)]
        x_t = x0.repeat(len(subsets), 1)
        for j, M in enumerate(subsets):
            x_t[j, sorted(M)] = mask
        with torch.no_grad():
            logits = model(x_t, clean=x0.repeat(len(subsets), 1)).double()
        logits[..., mask] = -math.inf
        lp = torch.log_softmax(logits, -1).gather(-1, x0.repeat(len(subsets), 1)[..., None])[..., 0]
        elbo += exact_elbo({M: lp[j] for j, M in enumerate(subsets)}, positions)
    _check_estimators_near(model, x0, P, R, elbo)


def _check_estimators_near(model: Any, x0: torch.Tensor, P: int, R: int, elbo: float) -> None:
    """``uf.diffusion_loss`` (materialised and fused equal), ``uf.eval.nll_bound`` and ``uf.rl.sequence_logprob`` of R
    copies of ``x0`` with its first ``P`` tokens the prompt: each mean within 4 standard errors of ``elbo``."""
    L = x0.shape[0]
    rows = x0.repeat(R, 1)
    completion = torch.zeros(R, L, dtype=torch.bool)
    completion[:, P:] = True
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        out = uf.diffusion_loss(model, rows, model.kernel, objective="mdlm", prompt_mask=~completion, generator=g)
        fused = uf.diffusion_loss(model, rows, model.kernel, objective="mdlm", prompt_mask=~completion,
                                  generator=torch.Generator().manual_seed(6), fused=True)
        bound = uf.eval.nll_bound(model, rows, model.kernel, num_times=2, per_token=False, prompt_mask=~completion,
                                  generator=g)
        logp = uf.rl.sequence_logprob(model, rows, completion, estimator="elbo",
                                      generator=[torch.Generator().manual_seed(i) for i in range(R)])
    torch.testing.assert_close(fused.loss, out.loss.float(), rtol=1e-4, atol=1e-4)  # fused = materialised logits
    for name, values in (("diffusion_loss", -out.loss.double().sum(-1)), ("nll_bound", -bound.double()),
                         ("sequence_logprob", logp.sequence.double())):
        mean, se = float(values.mean()), float(values.std() / math.sqrt(R))
        assert abs(mean - elbo) < 4 * se + 1e-4, (name, mean, se, elbo)


def check_fused_loss_is_mdlm_on_their_logits(model: Any, ref: dict[str, torch.Tensor], their_x0_logits: torch.Tensor,
                                            scored: torch.Tensor) -> None:
    """The fused MDLM loss at the recorded ``x_t`` equals ``(1/t) · −log softmax(their logits)[x0]`` at the masked
    positions (the mask column left out), 0 elsewhere: their training objective on their logits."""
    x_t, attn = ref["input_ids"], ref["attention_mask"]
    mask = model.mask_token_id
    x0 = torch.where(x_t == mask, (torch.arange(x_t.numel()).view_as(x_t) * 7) % 80, x_t)
    t = torch.tensor([0.3, 0.6, 0.9])
    with torch.no_grad():
        loss = model(x_t, t, x0=x0, kernel=uf.MaskKernel(model.num_states, mask), objective="mdlm",
                     attention_mask=attn)
    logits = their_x0_logits.double()
    logits[..., mask] = -math.inf
    ce = -torch.log_softmax(logits, -1).gather(-1, x0[..., None])[..., 0] / t[:, None].double()
    expected = torch.where((x_t == mask) & scored, ce, 0.0)
    where = scored | (x_t != mask)
    torch.testing.assert_close(loss.double()[where], expected[where], rtol=1e-5, atol=1e-5)
    assert bool(((x_t == mask) & scored).any())


def check_saved_folder_is_their_layout(cls: type, fixtures: Path, tmp_path: Path) -> None:
    """A saved model writes their weight names with identical tensors and their config keys, and loads back with
    identical logits (the load in their own modeling code: the fixture folder's make_fixtures.py --check-saved)."""
    model = cls.from_pretrained(fixtures / "checkpoint")
    with pytest.warns(UserWarning, match="no tokenizer"):
        model.save_pretrained(tmp_path / "saved")
    theirs = load_file(str(fixtures / "checkpoint" / "model.safetensors"))
    ours = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    config_theirs = json.loads((fixtures / "checkpoint" / "config.json").read_text())
    config_ours = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config_ours == config_theirs
    assert (tmp_path / "saved" / "generation_config.json").is_file()
    back = cls.from_pretrained(tmp_path / "saved")
    ref = reference(fixtures)
    with torch.no_grad():
        assert torch.equal(back(ref["input_ids"], attention_mask=ref["attention_mask"]),
                           model(ref["input_ids"], attention_mask=ref["attention_mask"]))


def check_sharded_lazy_load_in_the_dtype_asked(cls: type, fixtures: Path, tmp_path: Path) -> None:
    """Shards with an index load like the single file, and ``dtype=`` casts each tensor as it is read."""
    model = cls.from_pretrained(fixtures / "checkpoint")
    folder = tmp_path / "sharded"
    folder.mkdir()
    save_weights(model.hf_model, model.source_config, cls.weight_names(model.source_config), folder,
                 max_shard_bytes=20_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (folder / "model.safetensors").exists()
    bf16 = uf.load_diffusion_lm(folder, dtype="bfloat16")
    assert type(bf16) is cls and bf16.dtype == torch.bfloat16
    for (name, p), q in zip(model.named_parameters(), bf16.parameters()):
        assert torch.equal(p.to(torch.bfloat16), q), name
    assert not any(b.is_meta for b in bf16.buffers())


def check_bad_checkpoints(cls: type, fixtures: Path, tmp_path: Path, mask_id: int) -> None:
    """Missing and unexpected weights, a contradicting mask id, an unknown model type: ValueErrors naming them."""
    folder = copy_checkpoint(fixtures, tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    name = sorted(weights)[0]
    save_file({k: v for k, v in weights.items() if k != name}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing weights \\['{name}'\\]"):
        cls.from_pretrained(folder)
    save_file({**weights, "extra.weight": torch.zeros(2)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected weights \\['extra.weight'\\]"):
        cls.from_pretrained(folder)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "unifusion_config.json").write_text(json.dumps({"mask_token_id": mask_id + 1}))
    with pytest.raises(ValueError, match="mask_token_id"):
        cls.from_pretrained(folder)
    (folder / "unifusion_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mask_token_id": 10_000}))
    with pytest.raises(ValueError, match="mask_token_id = 10000"):
        cls.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "no_such_dllm"}))
    with pytest.raises(ValueError, match="known model types: .*'Dream'.*'llada'"):
        uf.load_diffusion_lm(folder)


def check_prefix_cache(model: Any, ref: dict[str, torch.Tensor]) -> None:
    """``cache_refresh=1`` gives the uncached tokens; a cached step on an unchanged sequence gives the full forward's
    logits (positions, padding and shift of the window right); ``cache_refresh=2`` saves forwards."""
    from unifusion.samplers.policies import ConfidenceThreshold, LowConfidence

    prompt, attn = ref["prompt_ids"], ref["prompt_attention_mask"]
    kw = {"attention_mask": attn, "max_new_tokens": 8, "block_size": 4, "do_sample": False, "eos_token_id": None}
    for policy in (LowConfidence(), ConfidenceThreshold(0.5)):
        assert torch.equal(model.generate(prompt, policy=policy, cache_refresh=1, **kw),
                           model.generate(prompt, policy=policy, **kw))
    out = model.generate(prompt, policy=LowConfidence(), num_steps=4, cache_refresh=2, return_dict=True, **kw)
    assert out.sequences.shape == (2, 13) and not bool((out.sequences[:, 5:] == model.mask_token_id).any())
    decoder = model.prefix_decoder(13, 2)
    state = decoder.start_blocks(prompt, attn.bool())
    block = torch.tensor([[model.mask_token_id, 7, model.mask_token_id, 9]] * 2)
    rows, t = torch.arange(2), torch.full((2,), 0.5)
    full = decoder.denoise_block(state, block, t, rows, None)  # the refresh: a full forward
    cached = decoder.denoise_block(state, block, t, rows, None)  # the window against the cache
    x = torch.full((2, 13), model.mask_token_id)
    x[:, :5], x[:, 5:9] = prompt, block
    with torch.no_grad():
        direct = model(x, attention_mask=torch.cat([attn, torch.ones(2, 8, dtype=attn.dtype)], 1))[:, 5:9]
    torch.testing.assert_close(full, direct, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached, direct, rtol=1e-5, atol=1e-4)


def check_trace_replay(model: Any, ref: dict[str, torch.Tensor], policy: Any = None) -> None:
    """``uf.rl.sequence_logprob(estimator="trace")`` replays the log-probabilities a sampled ``generate`` committed
    with (left-padded prompts, two blocks; uncached and with the prefix cache at refresh 1), with ``policy`` (default
    ``LowConfidence()``)."""
    from unifusion.samplers.policies import LowConfidence

    prompt, attn = ref["prompt_ids"], ref["prompt_attention_mask"]
    for extra in ({}, {"cache_refresh": 1}):
        out = model.generate(prompt, attention_mask=attn, max_new_tokens=8, block_size=4, num_steps=2,
                             policy=policy or LowConfidence(), eos_token_id=None, temperature=0.8, return_trace=True,
                             generator=[torch.Generator().manual_seed(i) for i in range(2)], **extra)
        completion = out.commit_step >= 0
        valid = torch.cat([attn, torch.ones(2, 8, dtype=attn.dtype)], 1)
        with torch.no_grad():
            r = uf.rl.sequence_logprob(model, out.sequences, completion, estimator="trace", trace=out.commit_step,
                                       temperature=0.8, attention_mask=valid)
        torch.testing.assert_close(r.per_token, out.commit_logprob, atol=1e-4, rtol=0)


def check_padded_rows_equal_rows_alone(model: Any, prompts: list[torch.Tensor], pad_id: int) -> None:
    """A left-padded batch of prompts whose lengths differ mod K (their first blocks hold different numbers of prompt
    tokens, the blocks cut from each row's first real token): sampled ``generate`` with per-row generators gives
    each row's tokens and trace alone, cached (merged commits or not) and uncached; ``sequence_logprob``'s
    ``"trace"`` replays the batch's commit log-probabilities."""
    from unifusion.samplers.policies import LowConfidence

    P = max(p.shape[0] for p in prompts)
    ids = torch.stack([torch.cat([torch.full((P - p.shape[0],), pad_id), p]) for p in prompts])
    attn = torch.stack([torch.arange(P) >= P - p.shape[0] for p in prompts]).long()
    kw = {"max_new_tokens": 7, "policy": LowConfidence(), "num_steps": 2, "eos_token_id": None,
          "temperature": 0.8, "return_trace": True}
    alone = [model.generate(p[None], generator=torch.Generator().manual_seed(i), **kw)
             for i, p in enumerate(prompts)]
    for extra in ({"use_cache": True}, {"use_cache": True, "merge_commits": True}, {"use_cache": False}):
        out = model.generate(ids, attention_mask=attn, **extra, **kw,
                             generator=[torch.Generator().manual_seed(i) for i in range(len(prompts))])
        for i, (p, one) in enumerate(zip(prompts, alone)):
            n = p.shape[0]
            assert torch.equal(out.sequences[i, P - n:], one.sequences[0]), (extra, i)
            assert torch.equal(out.commit_step[i, P - n:] >= 0, one.commit_step[0] >= 0), (extra, i)
            torch.testing.assert_close(out.commit_logprob[i, P - n:], one.commit_logprob[0], atol=1e-4, rtol=0)
    completion = out.commit_step >= 0
    valid = torch.cat([attn, torch.ones(len(prompts), 7, dtype=attn.dtype)], 1)
    with torch.no_grad():
        r = uf.rl.sequence_logprob(model, out.sequences, completion, estimator="trace", trace=out.commit_step,
                                   temperature=0.8, attention_mask=valid)
    torch.testing.assert_close(r.per_token, out.commit_logprob, atol=1e-4, rtol=0)
