"""``examples/grpo.py``: its checks (each a ``ValueError`` before any rollout), and CPU smoke runs on a tiny random
model — one process (its ``main`` called in this process), two processes under ``torchrun`` (DDP, gloo) with the same
numbers, and ``--report``.

A random model never answers an arithmetic problem, so the runs that compare numbers use a reward with signal on
random text (``len(text) % 3``), passed through ``main(reward_fn=)`` by a small launcher script.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _examples import load_example

import unifusion as uf
from unifusion.data import arithmetic

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
TINY = ["--tiny", "--task", "add", "--steps", "2", "--sft-steps", "2", "--sft-batch", "4", "--sft-micro-batch", "2",
        "--eval-problems", "4", "--group-size", "2", "--prompts-per-step", "2", "--lr", "1e-3",
        "--backend", "eager", "--dtype", "float32"]
STEP_LINE = re.compile(r"^step\s+(\d+) \| reward (\S+) \| loss (\S+) \| logp/token (\S+) \| grad_norm (\S+)", re.M)
SFT_LINE = re.compile(r"^sft\s+(\d+) \| loss (\S+)", re.M)
LAUNCHER = f"""
import sys
sys.path.insert(0, {str(EXAMPLES)!r})
import grpo

def length_reward(completions, problems):
    return [float(len(c) % 3) for c in completions]

raise SystemExit(grpo.main(sys.argv[1:], reward_fn=length_reward))
"""


def _grpo():
    return load_example("grpo")


def _run(script: Path, args: list[str], *, torchrun: bool = False, timeout: int = 600) -> str:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun \
        else [sys.executable]
    proc = subprocess.run(launcher + [str(script), *args], capture_output=True, text=True, timeout=timeout, env=ENV,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def length_reward(completions, problems):
    """The launcher's reward (``LAUNCHER``), for the runs in this process."""
    return [float(len(c) % 3) for c in completions]


def _main(grpo, args: list[str], reward_fn=length_reward) -> str:
    """``grpo.main(args)`` in this process (one process, no launcher): what it prints. The runs that need a fresh
    interpreter or ``torchrun`` go through :func:`_run`."""
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert grpo.main(args, reward_fn=reward_fn) == 0
    return printed.getvalue()


def _steps(stdout: str) -> dict[int, tuple[float, ...]]:
    steps = {int(k): tuple(float(x) for x in rest) for k, *rest in STEP_LINE.findall(stdout)}
    assert steps, stdout[-2000:]
    for reward, loss, logp, grad_norm in steps.values():
        assert all(math.isfinite(x) for x in (reward, loss, grad_norm)), stdout[-2000:]
        assert math.isfinite(logp) or grad_norm == 0.0, stdout[-2000:]  # nan: a step whose groups all tied
    return steps


@pytest.fixture(scope="module")
def grpo():
    return _grpo()


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo_launcher") / "run_grpo.py"
    path.write_text(LAUNCHER)
    return path


@pytest.fixture(scope="module")
def one_process(grpo, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_one")
    return _main(grpo, [*TINY, "--out", str(out)]), out


# ------------------------------------------------------------------------------------------------ checks
def test_batch_and_reward_checks(grpo):
    assert grpo.check_batch(8, 4, 1) == 8 and grpo.check_batch(8, 4, 2) == 4
    with pytest.raises(ValueError, match="group_size: 3 does not divide the batch of 8"):
        grpo.check_batch(8, 3, 1)
    with pytest.raises(ValueError, match="group_size: 3 groups of 4 do not split into whole groups over 2"):
        grpo.check_batch(12, 4, 2)
    with pytest.raises(ValueError, match="group_size: expected at least 2"):
        grpo.check_batch(4, 1, 1)
    assert grpo.check_rewards([1, 0.5, 0], 3).tolist() == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="expected 3 rewards .* got 2"):
        grpo.check_rewards([1.0, 0.0], 3)
    with pytest.raises(ValueError, match="expected finite rewards, got nan for completion 1"):
        grpo.check_rewards([1.0, float("nan"), 0.0], 3)
    with pytest.raises(ValueError, match="expected a sequence of 3 numbers"):
        grpo.check_rewards(None, 3)
    with pytest.raises(ValueError, match="expected a sequence of 3 numbers"):
        grpo.check_rewards(["a", "b", "c"], 3)


def test_prompts_are_left_padded_to_whole_blocks(grpo):
    from unifusion.hf import load_smollm2_tokenizer

    tok = load_smollm2_tokenizer()
    ids, mask = grpo.encode_prompts(tok, ["47+38=", "7+8-12="], block_size=8, max_new_tokens=8, positions=64)
    assert ids.shape == (2, 8) and mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1] and mask[1].sum() == 7
    assert tok.decode(ids[0, 2:]) == "47+38="
    with pytest.raises(ValueError, match="prompt: 6 tokens .* exceed the model's 16 positions"):
        grpo.encode_prompts(tok, ["47+38="], block_size=8, max_new_tokens=8, positions=16)
    p = arithmetic.ArithmeticProblem((47, 38), "add", 85)
    answer = grpo.answer_ids(tok, [p], 5)
    assert answer.tolist() == [tok("85", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] * 3]
    assert grpo.decode_completions(tok, answer) == ["85"]
    with pytest.raises(ValueError, match="--max-new-tokens: 2 cannot hold the answer '85'"):
        grpo.answer_ids(tok, [p], 2)


@pytest.fixture
def no_rollouts(monkeypatch):
    """Fails the test if any rollout (``generate``) or SFT step (``diffusion_loss``) runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("a rollout or an SFT step ran before the input checks")

    monkeypatch.setattr(uf.DiffusionLM, "generate", refuse)
    monkeypatch.setattr(uf, "diffusion_loss", refuse)


@pytest.mark.parametrize("reward_fn, match", [
    (lambda completions, problems: [1.0] * (len(completions) - 1), "reward_fn: expected 4 rewards .* got 3"),
    (lambda completions, problems: [float("inf")] * len(completions), "reward_fn: expected finite rewards"),
    (lambda completions, problems: None, "reward_fn: expected a sequence of 4 numbers"),
])
def test_bad_reward_function_raises_before_any_rollout(grpo, no_rollouts, tmp_path, reward_fn, match):
    with pytest.raises(ValueError, match=match):
        grpo.main([*TINY, "--out", str(tmp_path)], reward_fn=reward_fn)


def test_too_long_prompt_raises_before_any_rollout(grpo, no_rollouts, tmp_path):
    with pytest.raises(ValueError, match=r"prompt: 6 tokens \(padded to 8.*exceed the model's 256 positions"):
        grpo.main([*TINY, "--max-new-tokens", "300", "--out", str(tmp_path)])


def test_group_split_over_processes_raises_before_any_rollout(grpo, no_rollouts, tmp_path):
    argv = [*TINY, "--prompts-per-step", "3", "--out", str(tmp_path)]
    args = grpo.parse_args(argv)
    model, tokenizer = grpo.build(args, torch.device("cpu"))
    grpo.preflight(args, model, tokenizer, arithmetic.rewards, world=1)  # one process: fine
    with pytest.raises(ValueError, match="group_size: 3 groups of 2 do not split into whole groups over 2"):
        grpo.preflight(args, model, tokenizer, arithmetic.rewards, world=2)
    with pytest.raises(ValueError, match="--estimator: DiffusionLM with blocks supports estimator='elbo'"):
        grpo.preflight(grpo.parse_args([*argv, "--estimator", "coupled"]), model, tokenizer, arithmetic.rewards,
                       world=1)


def test_padded_answers_reach_sft_and_evaluation(grpo):
    from unifusion.hf import load_smollm2_tokenizer

    args = grpo.parse_args(["--task", "add", "--pad-answers", "--eval-problems", "5"])
    train, test = grpo.task_problems(args, "train"), grpo.task_problems(args, "test")
    assert len(test) == 5 and len(train) == arithmetic.split_size("train")
    assert all(len(p.completion) == 3 for p in train + test) and train[0].completion == f"{train[0].answer:03d}"
    assert not grpo.parse_args([]).pad_answers
    tok = load_smollm2_tokenizer()
    p = arithmetic.ArithmeticProblem((47, 38), "add", 85, width=3)
    row = grpo.answer_ids(tok, [p], 8)
    assert grpo.decode_completions(tok, row) == ["085"] and arithmetic.reward("085", p) == 1.0


def test_arguments_are_checked(grpo):
    args = grpo.parse_args([])
    assert (args.block_size, args.max_new_tokens, args.objective, args.estimator) == (8, 8, "grpo", "elbo")
    # the CPU recipe of docs/guides/rl.md's table
    assert (args.task, args.sft_steps, args.lr) == ("max", 8, 5e-6)
    for bad in (["--group-size", "0"], ["--kl-coef", "-1"], ["--objective", "wd1", "--kl-coef", "0.1"],
                ["--temperature", "0"], ["--objective", "ppo"]):
        with pytest.raises(SystemExit):
            grpo.parse_args(bad)


# ------------------------------------------------------------------------------------------------ runs
def test_tiny_run_trains_and_writes_metrics(one_process):
    stdout, out = one_process
    steps = _steps(stdout)
    assert sorted(steps) == [1, 2]
    assert any(g > 0 for *_, g in steps.values())  # the length reward has signal: a real gradient
    assert "held-out accuracy before GRPO" in stdout and "held-out accuracy after GRPO" in stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2
    # a held-out accuracy is a count over the 4 evaluated problems (--eval-problems 4)
    for key in ("accuracy_before", "accuracy_after"):
        assert (metrics[key] * 4) == round(metrics[key] * 4), (key, metrics[key])
    assert 0 < metrics["rollout_share"] < 1 and 0 < metrics["likelihood_share"] < 1
    assert metrics["rollout_tokens_per_s"] > 0 and len(metrics["records"]) == 2


@pytest.mark.parametrize("extra", [["--objective", "grpo", "--inner-updates", "2", "--kl-coef", "0.05"]])
def test_tiny_run_other_objectives_and_options(grpo, tmp_path, extra):
    """Old and reference policies (μ = 2, β > 0); wd1 and spg run in the report test below."""
    steps = _steps(_main(grpo, [*TINY, "--sft-steps", "0", "--eval-problems", "0", "--steps", "1", *extra,
                                "--out", str(tmp_path)]))
    assert sorted(steps) == [1]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["objective"] == extra[1] and metrics["args"]["inner_updates"] == (2 if "2" in extra else 1)
    assert (metrics["spg_upper"] or "").startswith("elbo") == (extra[1] == "spg")  # a block model has no EUBO


@pytest.mark.distributed
@pytest.mark.ci_only  # a torchrun launch of the script (DDP: tests/test_examples.py, tests/test_distributed.py)
def test_tiny_torchrun_matches_one_process(one_process, launcher, tmp_path):
    stdout = _run(launcher, [*TINY, "--out", str(tmp_path)], torchrun=True)
    assert "world_size 2" in stdout
    expected, got = _steps(one_process[0]), _steps(stdout)
    assert got.keys() == expected.keys()
    for step, values in got.items():
        # reward, loss, logp/token, grad_norm: the same rollouts, masks and (all-reduced) gradients
        assert values == pytest.approx(expected[step], rel=1e-4, abs=1e-5, nan_ok=True), (step, got, expected)
    sft_one, sft_two = dict(SFT_LINE.findall(one_process[0])), dict(SFT_LINE.findall(stdout))
    assert sft_one.keys() == sft_two.keys() == {"1", "2"}
    for step, loss in sft_two.items():
        assert float(loss) == pytest.approx(float(sft_one[step]), rel=1e-5), (sft_one, sft_two)


def test_tiny_report_writes_a_table(grpo, tmp_path):
    stdout = _main(grpo, [*TINY, "--report", "--seeds", "0,1", "--steps", "1", "--sft-steps", "1",
                          "--out", str(tmp_path)])
    table = (tmp_path / "report.md").read_text()
    assert table.strip() in stdout
    for objective in ("| grpo |", "| wd1 |", "| spg (ω = 0"):
        assert objective in table
    runs = json.loads((tmp_path / "report.json").read_text())["runs"]
    assert len(runs) == 6 and {r["seed"] for r in runs} == {0, 1}
    assert [r["objective"] for r in runs] == ["grpo", "wd1", "spg"] * 2
    for r in runs:  # a block model has no EUBO: spg's ELBO stand-in, and only there
        assert (r.get("spg_upper") or "").startswith("elbo") == (r["objective"] == "spg")


def test_tiny_run_skips_the_update_when_every_group_ties(grpo, tmp_path):
    # the exact reward on a random model: every completion scores 0, every advantage is 0, nothing to learn from
    stdout = _main(grpo, [*TINY, "--sft-steps", "0", "--eval-problems", "0", "--steps", "1", "--out", str(tmp_path)],
                   reward_fn=None)
    assert "all groups tied: no update" in stdout
    record = json.loads((tmp_path / "metrics.json").read_text())["records"][0]
    assert record["reward"] == 0.0 and record["updated"] is False and record["grad_norm"] == 0.0
