"""Teacher trajectories: recording, the file format, validation, replay, and the masks drawn from them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import unifusion as uf
from unifusion.distill import (
    DistillMask,
    Trajectories,
    block_size_curriculum,
    draw_trajectory_steps,
    mask_ratio_curriculum,
    pseudo_trajectory_mask,
    random_block_mask,
    record_trajectories,
    replay,
    view_times,
)
from unifusion.hf import DiffusionLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _hf_tiny import tiny_model  # noqa: E402

MASK = 3


def adapted(seed: int = 0, **kw: object) -> DiffusionLM:
    """A tiny random llama adapted as a mask-kernel diffusion LM (mask token 3), float64."""
    return uf.adapt_ar_model(tiny_model("llama", seed=seed), mask_token_id=MASK, **kw).eval().double()

K, NEW = 4, 12
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [20, 21, 22, 23, 24, 25]]


@pytest.fixture(scope="module")
def model():
    return adapted(block_size=K)


@pytest.fixture(scope="module")
def traj(model):
    return record_trajectories(model, PROMPTS, max_new_tokens=NEW, batch_size=3, progress=False, eos_token_id=None)


def test_recording_is_generate_row_by_row(model, traj):
    assert len(traj) == 4 and traj.prompt_length == 8 and traj.block_size == K
    assert traj.prompt_mask.sum(-1).tolist() == [len(p) for p in PROMPTS]
    for i, p in enumerate(PROMPTS):
        out = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             return_trace=True)
        assert torch.equal(out.sequences[0, len(p):], traj.completion_ids[i])
        assert torch.equal(out.commit_step[0, len(p):], traj.commit_step[i])  # padding moves no step
    assert (traj.commit_step >= 0).all()
    torch.testing.assert_close(traj.tokens_per_forward, NEW / traj.num_forwards.float())


def test_replaying_the_recorded_order_reproduces_generates_tokens(model, traj):
    assert torch.equal(replay(model, traj, batch_size=3), traj.completion_ids)
    other = adapted(seed=1, block_size=K)
    assert not torch.equal(replay(other, traj), traj.completion_ids)  # another model's replay differs


def test_plain_model_with_a_block_size():
    plain = adapted()
    rec = record_trajectories(plain, PROMPTS[:2], max_new_tokens=8, block_size=K, progress=False, eos_token_id=None)
    assert torch.equal(replay(plain, rec), rec.completion_ids)
    with pytest.raises(ValueError, match="block_size"):
        record_trajectories(plain, PROMPTS[:1], max_new_tokens=4, progress=False)


def test_save_and_load(traj, tmp_path):
    path = tmp_path / "t.safetensors"
    traj.save(path)
    back = Trajectories.load(path)
    assert back.block_size == K
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "commit_step", "num_forwards"):
        assert torch.equal(getattr(back, name), getattr(traj, name))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="path"):
        Trajectories.load(tmp_path / "other.safetensors")


def test_reward_keeps_the_accepted_rows(model, traj):
    seen = []

    def reward(prompts, completions):
        seen.append((prompts, completions))
        return [len(p) > 2 for p in prompts]

    kept = record_trajectories(model, PROMPTS, max_new_tokens=NEW, batch_size=3, progress=False, eos_token_id=None,
                               reward_fn=reward)
    assert seen[0][0] == PROMPTS[:3] and seen[1][0] == PROMPTS[3:]
    assert seen[0][1][0] == traj.completion_ids[0].tolist()
    assert torch.equal(kept.completion_ids, traj.completion_ids[[0, 1, 3]])
    with pytest.raises(ValueError, match="reward_fn"):
        record_trajectories(model, PROMPTS, max_new_tokens=4, progress=False, reward_fn=lambda p, c: [True])


def _fields(traj, **change):
    fields = dict(prompt_ids=traj.prompt_ids, prompt_mask=traj.prompt_mask, completion_ids=traj.completion_ids,
                  commit_step=traj.commit_step, num_forwards=traj.num_forwards, block_size=traj.block_size)
    return {**fields, **change}


def test_a_trace_that_does_not_match_its_tokens_is_refused(traj):
    with pytest.raises(ValueError, match="commit_step"):
        Trajectories(**_fields(traj, commit_step=traj.commit_step[:, :-1]))
    hole = traj.commit_step.clone()
    hole[0, 2] = -1
    with pytest.raises(ValueError, match="commit_step"):
        Trajectories(**_fields(traj, commit_step=hole))
    swapped = traj.commit_step.clone()
    swapped[:, :K], swapped[:, K:2 * K] = traj.commit_step[:, K:2 * K], traj.commit_step[:, :K]
    with pytest.raises(ValueError, match="commit_step"):  # block 1's steps before block 0's
        Trajectories(**_fields(traj, commit_step=swapped))
    with pytest.raises(ValueError, match="commit_step"):
        Trajectories(**_fields(traj, num_forwards=traj.num_forwards - 2))
    with pytest.raises(ValueError, match="prompt_ids"):
        Trajectories(**_fields(traj, prompt_ids=traj.prompt_ids[:, 1:], prompt_mask=traj.prompt_mask[:, 1:]))
    with pytest.raises(ValueError, match="completion_ids"):
        Trajectories(**_fields(traj, completion_ids=traj.completion_ids[:2]))


class _Recording:
    """A block decoder that records, at each of its model calls, the block it is asked to denoise."""

    def __init__(self, inner):
        self.inner, self.calls, self.commits, self.seen = inner, 0, 0, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start_blocks(self, prefix, prefix_mask):
        self.calls = 1  # the prefill: call 0
        return self.inner.start_blocks(prefix, prefix_mask)

    def denoise_block(self, state, block, t, rows, self_condition, positions=None):
        self.seen.append((self.calls, self.commits, block.clone()))
        self.calls += 1
        return self.inner.denoise_block(state, block, t, rows, self_condition, positions)

    def commit_block(self, state, block, rows):
        self.calls += 1
        self.commits += 1
        return self.inner.commit_block(state, block, rows)


def test_the_pseudo_trajectory_mask_is_what_the_decoder_had_not_committed(model, monkeypatch):
    """At every model call n of the decoder, the masked positions of the block it denoises are exactly the
    pseudo-trajectory mask at s = n − 1 (the active block's tokens committed after s), and the active block is that
    block."""
    decoders = []

    def block_decoder(merge_commits=False):
        decoders.append(_Recording(DiffusionLM.block_decoder(model, merge_commits=merge_commits)))
        return decoders[-1]

    monkeypatch.setattr(model, "block_decoder", block_decoder, raising=False)
    from unifusion.samplers.policies import ConfidenceThreshold

    for policy, eos in ((None, None), (ConfidenceThreshold(0.02), 18)):
        decoders.clear()
        rec = record_trajectories(model, PROMPTS, max_new_tokens=NEW, batch_size=1, progress=False,
                                  eos_token_id=eos, policy=policy)
        checked = 0
        for row, dec in enumerate(decoders):
            for n, b, block in dec.seen:
                view = pseudo_trajectory_mask(rec.commit_step[row:row + 1], n - 1, block_size=K)
                cols = slice(b * K, (b + 1) * K)
                committed = rec.commit_step[row, cols] >= 0  # the fill after EOS: masked in every view
                assert torch.equal(view.masked[0, cols][committed], (block[0] == MASK)[committed])
                assert view.masked[0, cols][~committed].all()
                assert view.active[0].nonzero().flatten().tolist() == list(range(b * K, (b + 1) * K))
                assert not view.masked[0, :b * K].any() and not view.masked[0, (b + 1) * K:].any()
                checked += 1
        stopped = (rec.commit_step < 0).any(-1)
        if eos is None:
            assert checked == int((rec.num_forwards - 1 - (NEW // K - 1)).sum())  # every denoising call
        else:
            assert stopped.any() and checked == sum(len(d.seen) for d in decoders)


def test_mask_choices_and_errors(traj):
    steps = traj.commit_step
    s = draw_trajectory_steps(steps, block_size=K, generator=torch.Generator().manual_seed(0))
    view = pseudo_trajectory_mask(steps, s, block_size=K)
    assert torch.equal(view.masked, view.active & (steps > s[:, None]))
    comp = view.complement()
    assert not (comp.masked & view.masked).any() and torch.equal(comp.masked | view.masked, view.active)
    later = pseudo_trajectory_mask(steps, s, block_size=K, later_blocks="masked")
    first_active = view.active.float().argmax(-1)
    cols = torch.arange(steps.shape[1])
    assert torch.equal(later.active, cols >= first_active[:, None] // K * K)
    assert torch.equal(later.masked, later.active & (steps > s[:, None]))
    per_block = draw_trajectory_steps(steps, block_size=K, per_block=True, generator=torch.Generator())
    assert per_block.shape == (4, NEW // K)
    pb = pseudo_trajectory_mask(steps, per_block, block_size=K)
    assert torch.equal(pb.masked, steps > per_block.repeat_interleave(K, -1))
    assert pb.masked.unflatten(-1, (NEW // K, K)).any(-1).all()  # every block has something masked
    last = steps.amax(-1)
    with pytest.raises(ValueError, match="step"):
        pseudo_trajectory_mask(steps, last, block_size=K)
    with pytest.raises(ValueError, match="step"):
        pseudo_trajectory_mask(steps, -2, block_size=K)
    with pytest.raises(ValueError, match="step"):
        pseudo_trajectory_mask(steps, torch.zeros(4, 2, dtype=torch.long), block_size=K)
    assert pseudo_trajectory_mask(steps, -1, block_size=K).masked[:, :K].all()


def test_draws_cover_every_state():
    steps = torch.tensor([[1, 1, 2, 4, 6, 7, 7, 8]])  # states -1.. : before commits 1, 2, 4, 6, 7, 8
    draws = {int(draw_trajectory_steps(steps, block_size=4, generator=torch.Generator().manual_seed(i))[0])
             for i in range(200)}
    assert draws == {0, 1, 3, 5, 6, 7}


def test_random_block_mask_and_curricula():
    g = torch.Generator().manual_seed(0)
    done = torch.ones(500, 12, dtype=torch.bool)
    done[:, 10:] = False
    view = random_block_mask(done, 0.3, block_size=4, generator=g)
    assert isinstance(view, DistillMask)
    blocks = view.active.unflatten(-1, (3, 4)).any(-1)
    assert (blocks.sum(-1) == 1).all() and not (view.active & ~done).any()
    assert 0.25 < view.masked.sum() / view.active.sum() < 0.35
    assert blocks.float().mean(0).min() > 0.25  # each block drawn
    with pytest.raises(ValueError, match="ratio"):
        random_block_mask(done, 1.5, block_size=4)
    assert mask_ratio_curriculum(0, 100) == 0.2 and mask_ratio_curriculum(50, 100) == pytest.approx(0.5)
    assert mask_ratio_curriculum(500, 100) == 0.8
    assert [block_size_curriculum(s, 100) for s in (0, 30, 60, 99, 200)] == [4, 8, 16, 32, 32]
    with pytest.raises(ValueError, match="start"):
        mask_ratio_curriculum(0, 10, start=2.0)


def test_view_times_are_the_masked_fraction_per_block():
    masked = torch.tensor([[True, False, False, False, True, True, False, True, True, True]])
    torch.testing.assert_close(view_times(masked, block_size=4), torch.tensor([[0.25, 0.75, 0.999]]))
    torch.testing.assert_close(view_times(masked, block_size=None), torch.tensor([0.6]))


def test_sampled_recordings_follow_the_generator(model):
    def rec(seed):
        return record_trajectories(model, PROMPTS[:2], max_new_tokens=8, temperature=0.8, progress=False,
                                   eos_token_id=None, generator=torch.Generator().manual_seed(seed))

    a, b, c = rec(0), rec(0), rec(1)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.commit_step, b.commit_step)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    with pytest.raises(ValueError, match="temperature"):
        record_trajectories(model, PROMPTS[:1], max_new_tokens=4, temperature=-1.0, progress=False)


def test_sequence_start_trajectories_cut_the_completion_after_the_prompts_last_tokens(tmp_path):
    """A ``"sequence_start"`` kind's decoder (SDAR, LLaDA 2, Fast-dLLM v2) decodes a prompt of 6 with blocks of 4 as
    [prompt 4–5 | completion 0–1], [completion 2–5]: steps 1, 0 in the first block, 3, 2, 4, 2 in the second. The
    trajectories take that order (the same steps cut from the completion's first column would interleave blocks),
    keep the origin through a file, and the masks follow the decoder's blocks."""
    prompt = torch.tensor([[0, 0, 11, 12, 13, 14, 15, 16]])
    fields = dict(prompt_ids=prompt, prompt_mask=prompt > 0, completion_ids=torch.tensor([[30, 31, 32, 33, 34, 35]]),
                  commit_step=torch.tensor([[1, 0, 3, 2, 4, 2]]), num_forwards=torch.tensor([6]), block_size=4)
    with pytest.raises(ValueError, match="commit_step: a block's steps must all follow"):
        Trajectories(**fields)
    traj = Trajectories(**fields, block_origin="sequence_start")
    assert traj.block_leads.tolist() == [2]
    traj.save(tmp_path / "t.safetensors")
    assert Trajectories.load(tmp_path / "t.safetensors").block_origin == "sequence_start"
    lead = traj.block_leads
    view = pseudo_trajectory_mask(traj.commit_step, 1, block_size=4, lead=lead)  # after call 1: the second block
    assert view.active.tolist() == [[False, False, True, True, True, True]]
    assert view.masked.tolist() == [[False, False, True, True, True, True]]
    per_block = pseudo_trajectory_mask(traj.commit_step, torch.tensor([[0, 2]]), block_size=4, lead=lead)
    assert per_block.masked.tolist() == [[True, False, True, False, True, False]]
    states = draw_trajectory_steps(traj.commit_step, block_size=4, per_block=True, lead=lead,
                                   generator=torch.Generator().manual_seed(0))
    assert states.shape == (1, 2) and states[0, 0] in (-1, 0) and states[0, 1] in (1, 2, 3)
    random = random_block_mask(torch.ones(1, 6, dtype=torch.bool), 1.0, block_size=4, lead=lead,
                               generator=torch.Generator().manual_seed(0))
    assert random.active.tolist() in ([[True, True, False, False, False, False]],
                                      [[False, False, True, True, True, True]])
    with pytest.raises(ValueError, match="lead"):
        pseudo_trajectory_mask(traj.commit_step, 1, block_size=4, lead=torch.tensor([4]))
