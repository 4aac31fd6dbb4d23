"""The frontier driver (files, statistics, reproducibility) and the overlay plot."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import pytest
import torch

import unifusion as uf
from unifusion.eval import FrontierResult, frontier, generative_perplexity, plot_frontier

DATA = Path(__file__).parents[1] / "data"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class TinyX0:
    """A random x0 model over V states whose prediction depends on the left neighbour and on t."""

    def __init__(self, V: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.num_states = V
        self.table = 2.0 * torch.randn(V, V, generator=g)

    def __call__(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        left = torch.roll(x_t, 1, dims=1)
        return self.table[left] * (1.0 + t[:, None, None])


class ConstantSampler:
    """Sampler factory for tests: every sample is ``pattern`` tiled to the requested length."""

    def __init__(self, model, kernel, num_steps, pattern=(50,)):
        self.pattern = torch.tensor(pattern)

    def sample(self, batch_size, seq_len, *, generator=None):
        row = self.pattern.repeat(seq_len // len(self.pattern) + 1)[:seq_len]
        return row.expand(batch_size, seq_len).clone()


def test_frontier_writes_consistent_files(tmp_path, tokenizer, judge):
    V = len(tokenizer)
    model, kernel = TinyX0(V), uf.UniformKernel(V)
    steps, seeds = (2, 4), (123, 456, 789)
    res = frontier(model, kernel, steps=steps, seeds=seeds, num_samples=5, seq_len=12, judge_model=judge,
                   judge_tokenizer=tokenizer, tokenizer=tokenizer, out_dir=tmp_path, label="tiny run/1",
                   batch_size=2, entropy_tokenizer=tokenizer, progress=False)
    assert isinstance(res, FrontierResult) and res.label == "tiny run/1"
    assert [(r["steps"], r["seed"]) for r in res.runs] == [(n, s) for n in steps for s in seeds]
    for key in ("json", "csv", "runs_csv", "samples", "png"):
        assert Path(res.paths[key]).is_file() and Path(res.paths[key]).name.startswith("tiny_run_1_")
    assert Path(res.paths["png"]).read_bytes()[:8] == PNG_MAGIC

    lines = [json.loads(x) for x in Path(res.paths["samples"]).read_text().splitlines()]
    assert len(lines) == len(steps) * len(seeds) * 5
    for run in res.runs:
        mine = [x for x in lines if x["steps"] == run["steps"] and x["seed"] == run["seed"]]
        texts = [x["text"] for x in mine]
        assert len(texts) == 5 and all(texts)
        # GenPPL pooled within the seed, entropy averaged within the seed
        ppl = generative_perplexity(texts, judge, tokenizer, progress=False)
        assert run["genppl"] == pytest.approx(ppl.perplexity, rel=1e-6)
        assert run["entropy"] == pytest.approx(statistics.fmean(x["entropy"] for x in mine), rel=1e-9)
    for row in res.summary:
        mine = [r for r in res.runs if r["steps"] == row["steps"]]
        assert row["genppl_mean"] == pytest.approx(statistics.fmean(r["genppl"] for r in mine))
        assert row["genppl_std"] == pytest.approx(statistics.stdev(r["genppl"] for r in mine))  # sample std
        assert row["entropy_std"] == pytest.approx(statistics.stdev(r["entropy"] for r in mine))
        assert row["num_seeds"] == 3

    again = FrontierResult.from_json(res.paths["json"])
    assert again.summary == res.summary and again.runs == res.runs
    with open(res.paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["steps"]) for r in rows] == list(steps)
    assert float(rows[0]["genppl_mean"]) == pytest.approx(res.summary[0]["genppl_mean"])
    assert "GenPPL" in res.table() and "±" in res.table()

    # reproducible: the same seeds (and batch size) give the same samples and numbers
    res2 = frontier(model, kernel, steps=steps, seeds=seeds, num_samples=5, seq_len=12, judge_model=judge,
                    judge_tokenizer=tokenizer, tokenizer=tokenizer, out_dir=tmp_path / "again", label="tiny run/1",
                    batch_size=2, entropy_tokenizer=tokenizer, plot=False, progress=False)
    assert res2.runs == res.runs
    assert "png" not in res2.paths


def test_entropy_of_known_samples_and_default_gpt2_retokenization(tmp_path, tokenizer, judge):
    V = len(tokenizer)
    cat = tokenizer.convert_tokens_to_ids("cat")
    words = tokenizer.convert_tokens_to_ids(["the", "cat", "dog", "bird"])
    kernel = uf.UniformKernel(V)
    const = frontier(TinyX0(V), kernel, steps=[3], seeds=[0], num_samples=2, seq_len=9, judge_model=judge,
                     judge_tokenizer=tokenizer, tokenizer=tokenizer, out_dir=tmp_path,
                     sampler=lambda m, k, n: ConstantSampler(m, k, n, pattern=(cat,)), label="const",
                     entropy_tokenizer=tokenizer, plot=False, progress=False)
    assert const.runs[0]["entropy"] == 0.0 and const.summary[0]["genppl_std"] == 0.0  # one seed: std 0
    four = frontier(TinyX0(V), kernel, steps=[3], seeds=[0], num_samples=2, seq_len=8, judge_model=judge,
                    judge_tokenizer=tokenizer, tokenizer=tokenizer, out_dir=tmp_path,
                    sampler=lambda m, k, n: ConstantSampler(m, k, n, pattern=tuple(words)), label="four",
                    plot=False, progress=False)  # default: GPT-2's tokenizer
    # "the cat dog bird the cat dog bird" -> GPT-2: "the", " cat", " dog", " bird", " the", " cat", " dog", " bird"
    expected = -(2 * (1 / 8) * math.log(1 / 8) + 3 * (2 / 8) * math.log(2 / 8))
    assert four.runs[0]["entropy"] == pytest.approx(expected)


def test_plot_frontier_overlays_json_files_and_results(tmp_path):
    def fake(label, shift):
        summary = [{"steps": n, "genppl_mean": 300.0 / (k + 1) + shift, "genppl_std": 2.0,
                    "entropy_mean": 5.0 + 0.05 * k, "entropy_std": 0.01, "num_seeds": 5}
                   for k, n in enumerate((16, 32, 64))]
        return FrontierResult(label=label, runs=[], summary=summary)

    path = tmp_path / "a_frontier.json"
    path.write_text(json.dumps(fake("ckpt-1000", 0.0).to_dict()))
    out = plot_frontier([path, fake("ckpt-2000", -20.0), fake("x", 10.0).to_dict()], tmp_path / "sub" / "overlay.png",
                        labels=["step 1000", "step 2000", "baseline"])
    assert out.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="labels"):
        plot_frontier([path], tmp_path / "x.png", labels=["a", "b"])
    with pytest.raises(ValueError, match="results"):
        plot_frontier([tmp_path / "missing.json"], tmp_path / "x.png")
    with pytest.raises(TypeError, match="results"):
        plot_frontier([3], tmp_path / "x.png")


def test_frontier_resume_equals_an_uninterrupted_run(tmp_path, tokenizer, judge):
    """A run stopped after some points (and mid-way through writing one) and resumed gives the runs, summary and
    samples file of an uninterrupted run, without sampling the complete points again."""
    V = len(tokenizer)
    model, kernel = TinyX0(V), uf.UniformKernel(V)
    kw = dict(steps=(2, 3), seeds=(5, 6), num_samples=3, seq_len=10, judge_model=judge, judge_tokenizer=tokenizer,
              tokenizer=tokenizer, batch_size=2, entropy_tokenizer=tokenizer, plot=False, progress=False)
    full = frontier(model, kernel, out_dir=tmp_path / "full", **kw)

    calls: list[int] = []

    def stops_at_the_third_point(m, k, num_steps):
        sampler = uf.BayesianSampler(m, k, num_steps)
        calls.append(num_steps)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return sampler

    with pytest.raises(KeyboardInterrupt):
        frontier(model, kernel, out_dir=tmp_path / "stopped", sampler=stops_at_the_third_point, **kw)
    samples = tmp_path / "stopped" / "model_samples.jsonl"
    kept = samples.read_text().splitlines(keepends=True)
    assert len(kept) == 2 * 3
    # a third point cut off after one line and a half, and a stray point of another grid
    third = Path(full.paths["samples"]).read_text().splitlines(keepends=True)[6:]
    samples.write_text("".join(kept) + third[0] + third[1][:15] + json.dumps(
        {"steps": 9, "seed": 1, "index": 0, "entropy": 0.0, "text": "x"}) + "\n")

    sampled: list[int] = []

    def counting(m, k, num_steps):
        sampled.append(num_steps)
        return uf.BayesianSampler(m, k, num_steps)

    resumed = frontier(model, kernel, out_dir=tmp_path / "stopped", sampler=counting, resume=True, **kw)
    assert sampled == [3, 3]  # the two complete points of steps 2 were read back, not sampled
    assert resumed.runs == full.runs and resumed.summary == full.summary
    assert samples.read_text() == Path(full.paths["samples"]).read_text()  # cut-off point, stray dropped
    with pytest.raises(TypeError, match="resume"):
        frontier(model, kernel, out_dir=tmp_path / "x", resume=1, **kw)


def test_frontier_bad_input(tmp_path, tokenizer, judge):
    V = len(tokenizer)
    kw = dict(num_samples=2, seq_len=4, judge_model=judge, judge_tokenizer=tokenizer, tokenizer=tokenizer,
              out_dir=tmp_path, progress=False)
    model, kernel = TinyX0(V), uf.UniformKernel(V)
    with pytest.raises(ValueError, match="steps"):
        frontier(model, kernel, steps=[16, 0], **kw)
    with pytest.raises(ValueError, match="steps"):
        frontier(model, kernel, steps=[], **kw)
    with pytest.raises(ValueError, match="steps"):
        frontier(model, kernel, steps=[1.5], **kw)
    with pytest.raises(TypeError, match="steps"):
        frontier(model, kernel, steps=16, **kw)
    with pytest.raises(ValueError, match="seeds"):
        frontier(model, kernel, seeds=[1, -2], **kw)
    with pytest.raises(ValueError, match="seeds"):
        frontier(model, kernel, seeds=[1, 1], **kw)
    with pytest.raises(ValueError, match="num_samples"):
        frontier(model, kernel, **{**kw, "num_samples": 0})
    with pytest.raises(ValueError, match="sampler"):
        frontier(model, kernel, steps=[2], seeds=[1], sampler="nope", **kw)
    with pytest.raises(ValueError, match="kernel"):
        frontier(model, uf.UniformKernel(V + 1), steps=[2], seeds=[1], **kw)
