"""Smoke tests of the training examples: each runs at tiny size on CPU in a subprocess.

Beyond "exit 0 and a finite loss", the training scripts share their random streams, so the same flags must give the
same per-update losses whatever the launcher: one process with accumulation, DDP and FSDP2 under torchrun (gloo),
DeepSpeed ZeRO-2/3 and Accelerate all reproduce the single-process run, which checks the global token-count
normaliser. A single-process run resumed from an FSDP2 checkpoint reproduces the uninterrupted run (weights and
optimizer state), and the ``save_pretrained`` exports of DDP and FSDP2 reload with identical weights.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
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

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
# 4 updates, global batch 8 = micro-batch 2 × 2 processes × 2 accumulation steps (× 4 on one process); γ anneals
# over 2 updates so the random causal/bidirectional mask is exercised; checkpoints after updates 2 and 4.
TRAIN_FLAGS = ["--tiny", "--steps", "4", "--micro-batch", "2", "--global-batch", "8", "--seq-len", "32",
               "--warmup", "1", "--anneal-steps", "2", "--save-every", "2", "--seed", "3"]
# the smoke runs compute in float32 whatever the machine (--dtype auto would take bf16 autocast where it is native)
FLOAT32 = ["--dtype", "float32"]
STEP_LINE = re.compile(r"^step\s+(\d+) \| loss (\S+) \| lr \S+ \| gamma \S+ \| grad_norm (\S+)", re.M)


def _run(args: list[str], *, torchrun: bool = False, timeout: int = 240, env: dict[str, str] | None = None) -> str:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun \
        else [sys.executable]
    proc = subprocess.run(launcher + args, capture_output=True, text=True, timeout=timeout, env=env or ENV)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _losses(stdout: str) -> dict[int, tuple[float, float]]:
    """``{update: (loss, gradient norm before clipping)}`` from the step lines."""
    losses = {int(k): (float(v), float(g)) for k, v, g in STEP_LINE.findall(stdout)}
    assert losses, stdout[-2000:]
    assert all(math.isfinite(v) and math.isfinite(g) for v, g in losses.values()), losses
    return losses


def _assert_same_losses(got: dict[int, tuple[float, float]], expected: dict[int, tuple[float, float]]) -> None:
    """Same loss and same gradient norm per update: AdamW and clipping hide a gradient scale error from the
    losses, the printed norm does not."""
    assert got.keys() <= expected.keys() and got, (got, expected)
    for step, (loss, grad_norm) in got.items():
        assert loss == pytest.approx(expected[step][0], rel=1e-5, abs=1e-6), (step, got, expected)
        assert grad_norm == pytest.approx(expected[step][1], rel=1e-3), (step, got, expected)


def _reload(folder: Path) -> uf.DiffusionLM:
    """The checkpoint, which records the training kernel (``--kernel uniform``, the default): the model has a mask
    token, so without the record ``generate`` and the evaluators would take the mask kernel."""
    assert (folder / "model.safetensors").is_file() and (folder / "unifusion_config.json").is_file(), folder
    model = uf.DiffusionLM.from_pretrained(folder)
    assert model.mask_token_id is not None and type(model.kernel) is uf.UniformKernel, (folder, model.kernel)
    assert type(uf.hf.default_kernel(model)[0]) is uf.UniformKernel
    return model


def _max_weight_diff(a: uf.DiffusionLM, b: uf.DiffusionLM) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)


# ------------------------------------------------------------------------------------------------ pure helpers
def test_accumulation_steps_reproduce_the_paper_batch_table():
    module = load_example("train_torchrun")
    # docs/guides/multi_gpu.md: (GPUs, micro-batch) → accumulation for 864 sequences per update
    for world, micro, accum in [(8, 12, 9), (16, 9, 6), (24, 12, 3), (48, 9, 2), (72, 12, 1), (96, 9, 1)]:
        assert module.accumulation_steps(864, micro, world) == accum
        assert micro * accum * world == module.PAPER_GLOBAL_BATCH
    with pytest.raises(ValueError, match="global_batch: expected a multiple of micro_batch × world_size"):
        module.accumulation_steps(864, 10, 8)
    with pytest.raises(ValueError, match="micro_batch"):
        module.accumulation_steps(864, 0, 8)


def test_cosine_lr_warms_up_linearly_then_decays_to_the_floor():
    module = load_example("train_torchrun")
    lr = [module.cosine_lr(k, peak_lr=1.0, warmup_steps=4, total_steps=20, min_lr_ratio=0.1) for k in range(25)]
    assert lr[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lr[4:], lr[5:]))
    assert lr[20] == pytest.approx(0.1) and lr[24] == pytest.approx(0.1)


def test_every_example_prints_help():
    scripts = ["train_torchrun", "train_deepspeed", "train_accelerate", "conversion_paths", "objectives",
               "paper_claims"]
    code = (
        "import runpy, sys\n"
        f"for name in {scripts!r}:\n"
        f"    sys.argv = [name, '--help']\n"
        "    try:\n"
        f"        runpy.run_path({str(EXAMPLES)!r} + '/' + name + '.py', run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (name, e.code)\n"
        "    print('HELP-OK', name, flush=True)\n"
    )
    out = _run(["-c", code])
    assert out.count("HELP-OK") == len(scripts), out[-2000:]
    assert "--global-batch" in out and "--deepspeed-config" in out and "--phase-steps" in out


@pytest.mark.parametrize("name, required", [
    ("train_torchrun", []), ("train_accelerate", []), ("conversion_paths", []), ("objectives", []), ("sft", []),
    ("finetune_diffusion_gemma", ["--tiny"]),
])
def test_examples_take_dtype_not_bf16(name, required, capsys):
    parse_args = load_example(name).parse_args
    assert parse_args(required).dtype == "auto"
    for choice in uf.precision.DTYPE_CHOICES:
        assert parse_args([*required, "--dtype", choice]).dtype == choice
    for gone in (["--bf16"], ["--dtype", "float16"]):
        with pytest.raises(SystemExit):
            parse_args([*required, *gone])
    assert "unrecognized arguments: --bf16" in capsys.readouterr().err


def test_training_dtype_resolves_and_describes_the_choice():
    module = load_example("train_torchrun")
    for option, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        got, line = module.training_dtype(option, "cpu")
        assert got == dtype and line.startswith("device cpu (") and line.count(f"--dtype {option} → {option}") == 1
        with module.training_autocast(got, torch.device("cpu")):  # bf16 autocast, or float32 compute
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype
    assert module.training_dtype("auto", "cpu")[0] == uf.precision.auto_dtype("cpu")


# ------------------------------------------------------------------------------------------------ train_torchrun
@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory) -> tuple[dict[int, float], Path]:
    """The reference: one process, 4 accumulation steps of 2 sequences per update."""
    out = tmp_path_factory.mktemp("single")
    stdout = _run([str(EXAMPLES / "train_torchrun.py"), *TRAIN_FLAGS, *FLOAT32, "--dist", "none", "--out", str(out)])
    assert "grad_accum 4 | global_batch 8 seq x 32 tok = 256 tok/update" in stdout
    return _losses(stdout), out


def test_train_torchrun_single_process_trains_and_checkpoints(single_process_run):
    losses, out = single_process_run
    assert sorted(losses) == [1, 2, 3, 4]
    model = _reload(out / "checkpoint-4")
    assert (out / "checkpoint-2" / "trainer_state.pt").is_file()
    x = torch.randint(4, 260, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(x)).all()


@pytest.mark.distributed
def test_train_torchrun_ddp_matches_single_process(single_process_run, tmp_path):
    reference, ref_dir = single_process_run
    stdout = _run([str(EXAMPLES / "train_torchrun.py"), *TRAIN_FLAGS, *FLOAT32, "--dist", "ddp", "--out",
                   str(tmp_path)], torchrun=True)
    assert "world_size 2 | dist ddp" in stdout and "grad_accum 2" in stdout
    _assert_same_losses(_losses(stdout), reference)
    assert _max_weight_diff(_reload(tmp_path / "checkpoint-4"), _reload(ref_dir / "checkpoint-4")) < 1e-5


@pytest.mark.distributed
@pytest.mark.ci_only  # FSDP2's gradients: tests/test_distributed.py; here its checkpoint and a resume (2 launches)
def test_train_torchrun_fsdp2_matches_single_process_and_resumes(single_process_run, tmp_path):
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "fully_shard"):  # FSDP2 needs torch >= 2.6
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    reference, ref_dir = single_process_run
    stdout = _run([str(EXAMPLES / "train_torchrun.py"), *TRAIN_FLAGS, *FLOAT32, "--dist", "fsdp2", "--out",
                   str(tmp_path)], torchrun=True)
    assert "world_size 2 | dist fsdp2" in stdout
    _assert_same_losses(_losses(stdout), reference)
    assert _max_weight_diff(_reload(tmp_path / "checkpoint-4"), _reload(ref_dir / "checkpoint-4")) < 1e-5
    # resume the sharded run's update-2 checkpoint on one process: updates 3 and 4 need the restored AdamW state
    resumed = _run([str(EXAMPLES / "train_torchrun.py"), *TRAIN_FLAGS, *FLOAT32, "--dist", "none", "--out",
                    str(tmp_path / "resumed"), "--resume", str(tmp_path / "checkpoint-2")])
    assert "at step 2" in resumed
    losses = _losses(resumed)
    assert sorted(losses) == [3, 4]
    _assert_same_losses(losses, reference)
    assert _max_weight_diff(_reload(tmp_path / "resumed" / "checkpoint-4"), _reload(ref_dir / "checkpoint-4")) < 1e-5


# ------------------------------------------------------------------------------------------------ deepspeed, accelerate
@pytest.mark.distributed
@pytest.mark.ci_only  # DeepSpeed's import and engine set-up are the costliest launches of the suite
@pytest.mark.parametrize("config", ["ds_zero2.json", "ds_zero3.json"])
def test_train_deepspeed_matches_single_process(single_process_run, tmp_path, config):
    pytest.importorskip("deepspeed")
    reference, ref_dir = single_process_run
    stdout = _run([str(EXAMPLES / "train_deepspeed.py"), *TRAIN_FLAGS, "--fp32", "--deepspeed-config",
                   str(EXAMPLES / config), "--out", str(tmp_path)], torchrun=True, timeout=400)
    assert f"deepspeed ZeRO-{config[7]}" in stdout
    _assert_same_losses(_losses(stdout), reference)
    assert (tmp_path / "deepspeed" / "latest").is_file()
    assert _max_weight_diff(_reload(tmp_path / "checkpoint-4"), _reload(ref_dir / "checkpoint-4")) < 1e-5


@pytest.mark.distributed
@pytest.mark.ci_only  # the same training as the DDP run above, launched through Accelerate
def test_train_accelerate_matches_single_process(single_process_run, tmp_path):
    pytest.importorskip("accelerate")
    reference, ref_dir = single_process_run
    stdout = _run([str(EXAMPLES / "train_accelerate.py"), "--cpu", *TRAIN_FLAGS, *FLOAT32, "--out", str(tmp_path)],
                  torchrun=True)
    assert "world_size 2 | accelerate" in stdout
    _assert_same_losses(_losses(stdout), reference)
    assert _max_weight_diff(_reload(tmp_path / "checkpoint-4"), _reload(ref_dir / "checkpoint-4")) < 1e-5


# ------------------------------------------------------------------------------------------------ paper §4.1 / §4.2
def _main_output(name: str, argv: list[str]) -> str:
    """What ``examples/<name>.py``'s ``main(argv)`` prints, run in this process (no new interpreter)."""
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert load_example(name).main(argv) == 0
    return printed.getvalue()


def test_conversion_paths_runs_all_four_paths():
    stdout = _main_output("conversion_paths", ["--tiny", "--phase-steps", "2", "--eval-blocks", "16", *FLOAT32])
    for path, kernels in [("AR→mask", ("mask", "mask")), ("AR→uniform", ("uniform", "uniform")),
                          ("AR→mask→uniform", ("mask", "uniform")), ("AR→uniform→mask", ("uniform", "mask"))]:
        for phase, kernel in enumerate(kernels, start=1):
            line = re.search(rf"^{re.escape(path)}\s+phase {phase} \({kernel}\s*\) train (\S+) → (\S+) \| "
                             rf"eval@t=0.5 (\S+) → (\S+)$", stdout, re.M)
            assert line, (path, phase, stdout[-3000:])
            assert all(math.isfinite(float(v)) for v in line.groups())
        final = re.search(rf"^\s*{re.escape(path)}\s+(\S+)\s+(\S+)$", stdout.split("final model")[1], re.M)
        assert final and all(math.isfinite(float(v)) for v in final.groups())
    # paths that share their first phase share its numbers exactly (same copy of the model, same random streams)
    first = dict(re.findall(r"^(AR→\S+)\s+phase 1 \(\w+\s*\) (train .*)$", stdout, re.M))
    assert first["AR→mask"] == first["AR→mask→uniform"] and first["AR→uniform"] == first["AR→uniform→mask"]


def test_objectives_rate_equivalent_losses_train_identically():
    stdout = _main_output("objectives", ["--tiny", "--steps", "3", "--eval-blocks", "16", *FLOAT32])
    rows = {}
    for line in stdout.split("eval ELBO@0.5")[1].splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 9 and cells[1] in ("uniform", "mask"):
            rows[(cells[0], cells[1])] = cells
    assert len(rows) == 8, stdout[-3000:]
    for key in [("sedd", "uniform"), ("m2s", "uniform"), ("ctmc", "uniform"), ("mdlm", "mask")]:
        assert float(rows[key][7]) <= 1e-4, rows[key]  # Corollary 3.4: same loss function of the logits
    assert float(rows[("m2s (μ head)", "uniform")][7]) > 1e-2  # a different parameterization trains differently
    assert all(math.isfinite(float(c)) for cells in rows.values() for c in cells[3:])
    assert re.search(r"M2S, mean loss over the first 3 updates: x0 head \S+, μ head \S+", stdout)


def _paper_claims_module():
    spec = importlib.util.spec_from_file_location("_example_paper_claims", EXAMPLES / "paper_claims.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paper_claims_runs_every_experiment_tiny(tmp_path):
    """examples/paper_claims.py at tiny size: each experiment writes its JSON with finite, well-formed results, on
    the library's default backend ("auto") whatever UNIFUSION_BACKEND says; a second process with the same arguments
    reproduces the adaptation's losses bit for bit; ``report`` renders every experiment."""
    import json

    script = str(EXAMPLES / "paper_claims.py")
    common = ["--tiny", "--out", str(tmp_path), "--num-samples", "2", "--threads", "1"]
    env = dict(ENV, UNIFUSION_BACKEND="eager")
    module = _paper_claims_module()  # the experiments run in this process (one interpreter instead of six)
    threads = torch.get_num_threads()
    try:
        for argv in (["fig2"], ["adapt"], ["frontier", "--frontier-steps", "2", "4", "--seeds", "1", "2"],
                     ["zeroshot", "--max-examples", "3", "--num-times", "2", "--pmi-times", "3", "--tasks",
                      str(Path(__file__).parent / "data" / "tiny_task.json")],
                     ["paths", "--eval-blocks", "2", "--sample-steps", "2", "--probe-every", "2"]):
            with contextlib.redirect_stdout(io.StringIO()):
                assert module.main([*argv, *common]) == 0
    finally:
        torch.set_num_threads(threads)  # --threads 1 set it for the process
    result = {name: json.loads((tmp_path / f"{name}.json").read_text())
              for name in ("fig2", "adapt", "frontier", "zeroshot", "paths")}
    assert {r["backend"] for r in result.values()} == {"auto"} and {r["threads"] for r in result.values()} == {1}
    assert all(isinstance(r["commit"], str) and len(r["commit"]) == 40 for r in result.values())
    fig2 = result["fig2"]
    assert set(fig2["curves"]) == {"x0", "mu"} and all(len(c) == 3 for c in fig2["curves"].values())
    assert fig2["x0_lower_fraction"] == pytest.approx(1 - fig2["early_mean"]["x0"] / fig2["early_mean"]["mu"])
    adapt = result["adapt"]
    assert math.isfinite(adapt["heldout_elbo"]) and (tmp_path / "adapted" / "tokenizer.json").is_file()
    assert adapt["args"]["anneal_steps"] == 1  # half of the 3 updates
    assert type(uf.DiffusionLM.from_pretrained(tmp_path / "adapted").kernel) is uf.UniformKernel  # recorded
    rows = result["frontier"]["summary"]
    assert [r["steps"] for r in rows] == [2, 4] and all(math.isfinite(r["genppl_mean"]) for r in rows)
    assert len(result["frontier"]["runs"]) == 4
    (task,) = result["zeroshot"]["tasks"].values()
    assert set(task) == {"AR (base)", "adapted, span score", "adapted, Fair-PMI"}
    assert [v["num_times"] for v in task.values()] == [None, 2, 3]
    assert all(0.0 <= v["accuracy"] <= 1.0 and v["n"] == 3 == len(v["correct"]) for v in task.values())
    assert all(sum(v["correct"]) == v["num_correct"] for v in task.values())
    paths = result["paths"]["paths"]
    assert set(paths) == {"AR→mask", "AR→uniform", "AR→mask→uniform", "AR→uniform (seed 1)"}
    for record in paths.values():
        assert len(record["loss"]) == 6 and all(math.isfinite(v) for v in record["loss"])
        assert [p["update"] for p in record["probes"]] == [0, 2, 3, 5, 6]  # every 2 updates and at phase ends
        for p in record["probes"]:
            assert len(p["sample_nll"]) == len(p["sample_tokens"]) == len(p["sample_entropy"]) == 2
            assert p["genppl"] == pytest.approx(math.exp(sum(p["sample_nll"]) / sum(p["sample_tokens"])))
            assert all(math.isfinite(v) for v in p["heldout_bound"].values())
    # AR→mask→uniform continues AR→mask's model after phase 1, then trains with the uniform kernel
    two_stage = paths["AR→mask→uniform"]
    assert two_stage["shared_until"] == 3 and two_stage["loss"][:3] == paths["AR→mask"]["loss"][:3]
    assert [p["kernel"] for p in two_stage["probes"]] == ["mask"] * 3 + ["uniform"] * 2
    assert paths["AR→uniform (seed 1)"]["loss"] != paths["AR→uniform"]["loss"]

    # determinism: a second process (fresh interpreter, UNIFUSION_BACKEND=eager in its environment), same arguments,
    # bit-identical losses and bound
    again = tmp_path / "again"
    _run([script, "adapt", *common[:2], str(again), *common[3:]], env=env)
    rerun = json.loads((again / "adapt.json").read_text())
    assert rerun["loss"] == adapt["loss"] and rerun["heldout_elbo"] == adapt["heldout_elbo"]

    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert module.main(["report", "--out", str(tmp_path)]) == 0
    out = printed.getvalue()
    for marker in ("<!-- runs -->", "<!-- fig2 -->", "<!-- adapt -->", "<!-- paths -->", "<!-- frontier -->",
                   "<!-- zeroshot -->", "Seed noise (AR→uniform, seed 0 vs 1"):
        assert marker in out
    assert (tmp_path / "report.md").read_text() in out and (tmp_path / "paths.png").stat().st_size > 0


def test_paper_claims_adapt_honours_anneal_steps(monkeypatch, tmp_path):
    """``adapt --anneal-steps N`` reaches the training loop, not a default derived from the run length."""
    module = _paper_claims_module()
    seen = []

    def fake_train(*args, anneal_steps, **kwargs):
        seen.append(anneal_steps)
        raise KeyboardInterrupt  # stop before saving anything

    monkeypatch.setattr(module, "train", fake_train)
    for argv, expected in ((["--steps", "10", "--anneal-steps", "7"], 7), (["--steps", "10"], 5)):
        with pytest.raises(KeyboardInterrupt):
            module.run_adapt(module.parse_args(["adapt", "--tiny", "--out", str(tmp_path), *argv]))
        assert seen[-1] == expected


def test_paper_claims_report_statistics():
    """The report's intervals: the bootstrap interval of a pooled GenPPL brackets it and shrinks with more samples;
    Wilson's interval matches its closed form (7/10 → [0.397, 0.892])."""
    module = _paper_claims_module()
    nll, tokens = [130.0, 150.0, 170.0, 190.0], [40, 40, 40, 40]
    lo, hi = module.genppl_interval(nll, tokens)
    pooled = math.exp(sum(nll) / sum(tokens))
    assert lo < pooled < hi
    lo4, hi4 = module.genppl_interval(nll * 4, tokens * 4)
    assert hi4 - lo4 < hi - lo
    assert module.wilson(7, 10) == pytest.approx((0.3968, 0.8922), abs=1e-4)


def test_experiments_page_shows_the_committed_results():
    """Every results block of docs/guides/experiments.md is what ``paper_claims.py report`` renders from the
    committed run files in docs/assets/claims/ (numbers on the page come from those files, not by hand)."""
    module = _paper_claims_module()
    root = EXAMPLES.parent
    page = (root / "docs" / "guides" / "experiments.md").read_text(encoding="utf-8")
    sections = module.render(root / "docs" / "assets" / "claims")
    assert set(sections) == {"runs", "fig2", "adapt", "paths", "frontier", "zeroshot"}
    assert sorted(m[2] for m in module.PAGE_BLOCK.finditer(page)) == sorted(sections)  # every block, once
    assert module.fill_page(page, sections) == page, (
        "the page's tables differ from the committed results: run `python examples/paper_claims.py report "
        "--out docs/assets/claims --page docs/guides/experiments.md`")
