"""``examples/distill_parallel.py`` in-process on a tiny random model: SFT → record → LoRA distillation → evaluation,
and the report's numbers checked against the counts they come from and against the library's AUP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _examples import load_example

import unifusion as uf
from unifusion.data import sorting
from unifusion.samplers.policies import ConfidenceThreshold, LowConfidence

TINY = ["--model", "tiny", "--backend", "eager", "--count", "3", "--digits", "2", "--sft-steps", "1",
        "--sft-batch", "2", "--record-problems", "3", "--keep", "all", "--distill-steps", "2", "--distill-batch",
        "2", "--lora", "2", "--thresholds", "0.6", "--forced", "2,4", "--eval-problems", "3", "--eval-batch", "2",
        "--commit-rule", "0.5", "--commit-rule-problems", "2", "--commit-rule-steps", "3", "--oracle",
        "--log-every", "1"]


def _example():
    return load_example("distill_parallel")


def test_tiny_run_report_is_consistent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = _example()
    report = example.main([*TINY, "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert json.loads((tmp_path / "report.json").read_text())["table"] == report["table"]
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["table"] in printed

    (run,) = report["runs"]
    n, width = 3, 8  # 3 problems; answer 8 tokens + EOS → two blocks of K = 8
    answer = sorting.answer_length(3, 2) + 1
    assert run["record"]["kept"] == run["record"]["problems"] == 3
    assert run["distill"]["steps"] == 2 and run["distill"]["lora_rank"] == 2 and not run["distill"]["per_block"]
    assert 0 < run["distill"]["trainable_parameters"] < 1_000_000  # the adapters only, not the 3M-parameter model
    names = ["1 token/forward", "threshold 0.6", "2 tokens/forward (forced)", "4 tokens/forward (forced)",
             "oracle commit (ceiling)", "learned commit 0.5"]
    for phase in ("before", "after"):
        results = {r["setting"]: r for r in run[phase]}
        assert list(results) == names
        for r in results.values():
            assert r["tokens_per_forward"] == pytest.approx(r["tokens"] / r["forwards"])
            assert n <= r["tokens"] <= n * 2 * width  # at least the EOS of each row, at most the whole completion
            assert r["seconds"] > 0 and 0 <= r["accuracy"] <= 100
            # the batch-1 timing: every problem (3 < --wall-problems' 16) decoded alone
            assert r["problems_batch1"] == n and r["seconds_batch1"] > 0 and r["tokens_per_forward_batch1"] > 0
        # at most k tokens committed per model call (the prefill rides with the first step)
        assert results["1 token/forward"]["tokens"] <= results["1 token/forward"]["forwards"]
        for k in (2, 4):
            forced = results[f"{k} tokens/forward (forced)"]
            assert forced["tokens"] <= k * forced["forwards"]
        # a threshold and the learned rule commit at least one token per step: no more calls than one per forward
        for name in ("threshold 0.6", "learned commit 0.5", "oracle commit (ceiling)"):
            assert results[name]["forwards"] <= results["1 token/forward"]["forwards"]
        # the rule's head was fitted on that phase's model: examples from every step of 2 problems' decodes
        rule = run["commit_rule"][phase]
        assert rule["examples"] >= 2 * width and 0 <= rule["positive_rate"] <= 1
    assert run["ar"]["tokens"] == n * answer and run["ar"]["tokens_per_forward"] == 1.0
    assert run["ar"]["batch"] == 2 and run["ar"]["problems_batch1"] == n
    assert run["ar"]["seconds_batch1"] > 0 and run["ar"]["seconds_batch1_packed"] > 0
    assert set(run["packing_seconds"]) == {"before", "after"}

    summary = report["summary"]
    rows = {(r["phase"], r["setting"]): r for r in summary["rows"]}
    assert len(rows) == 2 * len(names)
    for (phase, name), r in rows.items():
        measured = next(x for x in run[phase] if x["setting"] == name)
        assert r["tokens_per_forward"] == measured["tokens_per_forward"]
        assert r["x_ar_wall_time"] == pytest.approx(measured["seconds"] / run["ar"]["seconds"])
        assert r["x_ar_wall_time_batch1"] == pytest.approx(measured["seconds_batch1"] / run["ar"]["seconds_batch1"])
        assert r["x_ar_packed_batch1"] == pytest.approx(
            measured["seconds_batch1"] / run["ar"]["seconds_batch1_packed"])
        assert f"| {phase} | {name} | {measured['accuracy']:.1f} | {measured['tokens_per_forward']:.2f} |" in printed
    # the oracle reads the answer: it is a ceiling in the table, not a point of the frontier or of AUP
    assert [x["oracle"] for x in run["before"]] == [name == "oracle commit (ceiling)" for name in names]
    y_max = max(x["accuracy"] for phase in ("before", "after") for x in run[phase] if not x["oracle"])
    assert summary["aup_max_accuracy"] == y_max
    for phase in ("before", "after"):
        points = [(x["tokens_per_forward"], x["accuracy"]) for x in run[phase] if not x["oracle"]]
        expected = uf.eval.accuracy_under_parallelism([p[0] for p in points], [p[1] for p in points],
                                                      max_accuracy=max(y_max, 1e-9))
        assert summary["aup"][phase] == pytest.approx(expected)


def test_without_batch1_timings_the_report_has_no_batch1_columns() -> None:
    """``--wall-problems 0``: results without the batch-1 fields summarise and print without those columns, and the
    header still names the batch size of the timing it has."""
    example = _example()
    args = example.parse_args(["--model", "tiny", "--eval-batch", "2", "--wall-problems", "0"])
    result = {"setting": "1 token/forward", "accuracy": 50.0, "tokens_per_forward": 0.5, "seconds": 2.0}
    run = {"before": [result], "after": [dict(result, accuracy=75.0, tokens_per_forward=2.0, seconds=1.0)],
           "ar": {"accuracy": 0.0, "seconds": 4.0}}
    summary = example.summarise([run])
    assert [r["x_ar_wall_time"] for r in summary["rows"]] == [0.5, 0.25]
    assert all("x_ar_wall_time_batch1" not in r for r in summary["rows"]) and "seconds_batch1" not in summary["ar"]
    text = example.table(summary, args, [0])
    assert "batch 1" not in text and "at batch 2" in text


def test_bad_options_are_refused() -> None:
    example = _example()
    for argv in (["--forced", "3"], ["--thresholds", "1.5"], ["--max-new-tokens", "4"], ["--entropy-temperature", "0"],
                 ["--wall-problems", "-1"], ["--sft-fill-weight", "-0.5"]):
        with pytest.raises(SystemExit):
            example.parse_args(["--model", "tiny", *argv])


def test_eos_fill_is_what_follows_each_rows_first_eos() -> None:
    example = _example()
    eos = 2
    completion = torch.tensor([[5, 6, eos, eos, eos], [5, eos, 7, eos, eos], [5, 6, 7, 8, 9]])
    assert example.eos_fill(completion, eos).tolist() == [[False, False, False, True, True],
                                                         [False, False, True, True, True],
                                                         [False] * 5]


def test_sft_fill_weight_scales_only_the_fill() -> None:
    """One SFT update from the same weights and draws at fill weights 0, 1/2 and 1: the first update's loss is affine
    in the weight (same x_t, only the fill's terms scaled) and the fill, masked at some positions, adds to it."""
    example = _example()
    losses = []
    for weight in ("0", "0.5", "1"):
        args = example.parse_args([*TINY, "--sft-fill-weight", weight, "--max-new-tokens", "24"])
        model, tokenizer = example.build(args, 0)
        problems = sorting.make_problems(4, seed=0, count=3, digits=2)
        losses.append(example.sft(model, tokenizer, problems, args, 0, lambda line: None)["final_loss"])
    assert losses[0] < losses[2]
    assert losses[1] == pytest.approx((losses[0] + losses[2]) / 2, rel=1e-5)


def test_the_oracle_commits_against_the_one_token_decode_without_decoding_it_again() -> None:
    """``evaluate_grid``: the first setting (one token per forward) is decoded once and its sequences are every oracle
    setting's references; the other settings get none; a grid that does not start with it is refused, and so is an
    oracle decode without its reference."""
    example = _example()
    one = example.Setting("1 token/forward", LowConfidence(), 8)
    threshold = example.Setting("threshold 0.9", ConfidenceThreshold(0.9), 8)
    oracle = example.Setting("oracle commit (ceiling)", None, 8, oracle=True)
    sequences = [torch.arange(6).view(2, 3), torch.arange(3).view(1, 3)]
    calls: list[tuple[str, object]] = []

    def evaluate_one(setting, references):
        calls.append((setting.name, references))
        return {"setting": setting.name}, sequences if setting is one else [torch.zeros(1)]

    results = example.evaluate_grid([one, threshold, oracle], 8, evaluate_one)
    assert [r["setting"] for r in results] == ["1 token/forward", "threshold 0.9", "oracle commit (ceiling)"]
    assert [name for name, _ in calls] == [r["setting"] for r in results]  # one decode per setting, none twice
    assert calls[0][1] is None and calls[1][1] is None and calls[2][1] is sequences
    for grid, size in (([oracle, one], 8), ([threshold, one], 8), ([one], 4)):
        with pytest.raises(ValueError, match="grid: the first setting"):
            example.evaluate_grid(grid, size, evaluate_one)
    args = example.parse_args(["--model", "tiny"])
    with pytest.raises(ValueError, match="reference: the setting 'oracle commit"):
        example.decode(None, None, torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8), oracle, args)
