"""``examples/distill_chat.py`` in-process on a tiny random model: chat SFT → record → distillation → GenPPL, entropy
and tokens per forward on held-out chat prompts; the report's numbers checked against what they come from."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _examples import load_example

from unifusion.chat import load_python_docs_chats

TINY = ["--model", "tiny", "--sft-steps", "1", "--sft-batch", "2", "--record-prompts", "3", "--distill-steps", "2",
        "--distill-batch", "2", "--lora", "2", "--thresholds", "0.6", "--forced", "4", "--eval-prompts", "3",
        "--eval-batch", "2", "--commit-rule", "0.5", "--commit-rule-prompts", "2", "--commit-rule-steps", "3",
        "--max-new-tokens", "16", "--oracle", "--per-block", "--log-every", "1"]


def _example():
    return load_example("distill_chat")


def test_chat_prompts_cut_before_the_last_answer_and_leave_out_long_ones() -> None:
    example = _example()
    from unifusion.hf import load_smollm2_tokenizer
    tokenizer = load_smollm2_tokenizer()
    width = 24
    rows = example.chat_prompts(tokenizer, "test", width)
    conversations = load_python_docs_chats("test")
    fits = [c for c in conversations
            if len(tokenizer(c[-1]["content"], add_special_tokens=False)["input_ids"]) + 1 <= width]
    assert 0 < len(rows) == len(fits) < len(conversations)
    for row, conversation in zip(rows, fits):
        assert row.completion == conversation[-1]["content"]
        assert row.prompt.endswith("<|im_start|>assistant\n")  # the generation prompt
        assert conversation[-2]["content"] in row.prompt and row.completion not in row.prompt


def test_tiny_run_report_is_consistent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = _example()
    report = example.main([*TINY, "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert json.loads((tmp_path / "report.json").read_text())["table"] == report["table"]
    assert report["table"] in printed

    (run,) = report["runs"]
    n, width = 3, 16
    assert run["eval_prompts"] == n
    assert run["record"]["kept"] == run["record"]["problems"] == 3 and run["record"]["keep"] == "all"  # no verifier
    assert run["distill"]["steps"] == 2 and run["distill"]["lora_rank"] == 2 and run["distill"]["per_block"]
    names = ["1 token/forward", "threshold 0.6", "4 tokens/forward (forced)", "oracle commit (ceiling)",
             "learned commit 0.5"]
    reference = run["before"][0]
    for phase in ("before", "after"):
        assert [r["setting"] for r in run[phase]] == names
        for r in run[phase]:
            assert len(r["answers"]) == n
            assert r["tokens_per_forward"] == pytest.approx(r["tokens"] / r["forwards"])
            assert n <= r["tokens"] <= n * width
            # ratios to the undistilled one-token-per-forward decode (NaN where that reference has no text)
            for key, base in (("x_genppl", "genppl"), ("x_entropy", "entropy")):
                if reference[base] > 0:
                    assert r[key] == pytest.approx(r[base] / reference[base])
                else:
                    assert math.isnan(r[key])
            assert r["goal_met"] == example.goal_met(r, example.parse_args(TINY))
        # the oracle ceiling: never more forwards than one token per forward, never "the goal" (it reads the answer)
        oracle = run[phase][names.index("oracle commit (ceiling)")]
        assert oracle["oracle"] and not oracle["goal_met"]
        assert oracle["forwards"] <= run[phase][0]["forwards"]
    assert reference["x_entropy"] == 1.0 or math.isnan(reference["x_entropy"])
    assert len(run["ar"]["answers"]) == n and run["ar"]["tokens_per_forward"] == 1.0
    for phase in ("before", "after"):
        assert f"| {phase} | 1 token/forward | " in printed


def test_the_oracle_leaves_every_other_row_as_it_was(tmp_path: Path) -> None:
    """--oracle adds its row and changes nothing else: its decodes draw from a generator of their own, so the after
    phase's commit head (initialised from the global stream) and every other number are those of a run without it."""
    example = _example()
    without = [a for a in TINY if a != "--oracle"]
    (plain,) = example.main([*without, "--out", str(tmp_path / "plain")])["runs"]
    (oracle,) = example.main([*TINY, "--out", str(tmp_path / "oracle")])["runs"]
    for phase in ("before", "after"):
        rows = [r for r in oracle[phase] if not r["oracle"]]
        assert [r["setting"] for r in rows] == [r["setting"] for r in plain[phase]]
        for r, p in zip(rows, plain[phase]):
            assert (r["answers"], r["tokens"], r["forwards"]) == (p["answers"], p["tokens"], p["forwards"]), \
                r["setting"]


def test_judge_keeps_the_answers_the_ar_model_finds_likely() -> None:
    """--keep-ppl's filter: each answer's perplexity is GenPPL of that answer alone; a limit between two answers'
    keeps the likelier one; an empty answer is never kept."""
    example = _example()
    import unifusion as uf
    model, tokenizer = example.load(example.parse_args(["--model", "tiny"]), 0)
    judge = example.Judge(model.eval(), tokenizer, uf.eval.gpt2_tokenizer())
    texts = ["The method is called when the object is created.", "width width the the the", ""]
    ppl = judge.perplexities(texts)
    for text, value in zip(texts[:2], ppl):
        assert value == pytest.approx(float(uf.eval.generative_perplexity([text], model, tokenizer, progress=False)),
                                      rel=1e-5)  # batched with other texts: float32 sums in another order
    assert ppl[2] == math.inf and ppl[0] != ppl[1]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    limit = (ppl[0] + ppl[1]) / 2
    assert judge.keeps_likely(limit)([[1]] * 3, ids) == [ppl[0] <= limit, ppl[1] <= limit, False]
    assert judge.keeps_likely(math.inf)([[1]] * 3, ids) == [True, True, False]


def test_goal_is_all_three_conditions() -> None:
    example = _example()
    args = example.parse_args(["--model", "tiny"])
    good = {"tokens_per_forward": 2.5, "x_genppl": 1.2, "x_entropy": 0.96}
    assert example.goal_met(good, args)
    for key, value in (("tokens_per_forward", 2.4), ("x_genppl", 1.21), ("x_entropy", 0.94), ("x_entropy", 1.06),
                       ("x_genppl", math.nan)):
        assert not example.goal_met(dict(good, **{key: value}), args), key
    assert not example.goal_met(dict(good, oracle=True), args)


def test_bad_options_are_refused() -> None:
    example = _example()
    for argv in (["--forced", "3"], ["--thresholds", "1.5"], ["--commit-rule", "0"], ["--max-new-tokens", "0"],
                 ["--entropy-temperature", "0"], ["--eval-prompts", "0"], ["--distill-steps", "-1"],
                 ["--sft-fill-weight", "-1"], ["--keep-ppl", "-1"]):
        with pytest.raises(SystemExit):
            example.parse_args(["--model", "tiny", *argv])
