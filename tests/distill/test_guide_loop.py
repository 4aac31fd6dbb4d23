"""docs/guides/parallel-decoding.md's own-loop block, run as written on a tiny block model: it records and keeps
exactly the verified decodes, saves what it loads back, trains the model, fits a commit head and decodes with it."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import torch
from _hf_tiny import tiny_model
from transformers import PreTrainedTokenizerFast

import unifusion as uf
from unifusion.distill import Trajectories, record_trajectories

ROOT = Path(__file__).resolve().parents[2]
MODEL_LINE = "uf.adapt_ar_model(hf_model, tokenizer=tok, block_size=8)"


def _guide_loop() -> str:
    """The own-loop block of the guide, as written there."""
    text = (ROOT / "docs" / "guides" / "parallel-decoding.md").read_text(encoding="utf-8")
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "train_commit_head(head, data" in b]
    return code


def test_the_guides_own_loop_runs_as_written(tmp_path, monkeypatch):
    tok = PreTrainedTokenizerFast.from_pretrained(ROOT / "tests" / "data" / "tiny_tokenizer")
    code = _guide_loop()
    assert MODEL_LINE in code
    made = []

    def make_model():
        torch.manual_seed(0)
        model = uf.adapt_ar_model(tiny_model("llama", seed=0), add_mask_token=True, tokenizer=tok, block_size=8)
        made.append(copy.deepcopy(model))  # the model before the loop trains it
        return model

    def is_correct(prompt, completion):  # a stand-in verifier: the answer opens with an even token
        return completion[0] % 2 == 0

    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(4, len(tok), (8, 5), generator=g)
    held_out_ids = torch.randint(4, len(tok), (2, 5), generator=g)
    scope = {"make_model": make_model, "tok": tok, "is_correct": is_correct, "prompt_ids": prompt_ids,
             "held_out_ids": held_out_ids, "num_updates": 2}
    monkeypatch.chdir(tmp_path)  # the block saves its trajectories in the working directory
    exec(compile(code.replace(MODEL_LINE, "make_model()"), "parallel-decoding.md", "exec"), scope)

    before, model, traj = made[0], scope["model"], scope["traj"]
    # the recording keeps exactly the verified rows of the model's own greedy one-token-per-forward decode
    everything = record_trajectories(before, prompt_ids, max_new_tokens=32, progress=False,
                                     eos_token_id=tok.eos_token_id)
    kept = [i for i in range(len(everything)) if everything.completion_ids[i, 0] % 2 == 0]
    assert 0 < len(kept) < len(everything)
    assert torch.equal(traj.completion_ids, everything.completion_ids[kept])
    assert torch.equal(traj.commit_step, everything.commit_step[kept])
    loaded = Trajectories.load(tmp_path / "trajectories.safetensors")
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "commit_step", "num_forwards"):
        assert torch.equal(getattr(loaded, name), getattr(traj, name)), name
    # the updates trained the model; the head was fitted on its decodes; the decode kept the prompts
    assert math.isfinite(float(scope["loss"].detach()))
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), model.parameters()))
    assert len(scope["data"]) > 0
    out = scope["out"]
    assert torch.equal(out.sequences[:, :5], held_out_ids)
    assert bool((out.num_forwards >= 1).all()) and float(scope["tokens_per_forward"]) > 0
