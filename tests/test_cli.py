"""The ``unifusion`` command line, end to end on tiny random models saved to a temporary folder."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from _hf_tiny import tiny_model

import unifusion as uf
from unifusion.cli import build_parser, main

DATA = Path(__file__).parent / "data"
TASK = DATA / "tiny_task.json"

HELP = [["sample"], ["eval"], ["eval", "genppl"], ["eval", "frontier"], ["eval", "mc"], ["eval", "nll"]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A Hugging Face causal-LM folder and a saved DiffusionLM folder, both with the tiny tokenizer."""
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("cli")
    tok = PreTrainedTokenizerFast.from_pretrained(DATA / "tiny_tokenizer")
    hf_dir, dm_dir = root / "hf", root / "dm"
    judge = tiny_model("llama", seed=0)
    judge.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    dm = uf.adapt_ar_model(tiny_model("llama", seed=1), mask_token_id=2)
    dm.save_pretrained(dm_dir)
    tok.save_pretrained(dm_dir)
    texts = root / "texts.txt"
    texts.write_text("the cat sat on the mat .\nthe big dog ran to the river and the red bird sat in the tree .\n")
    return {"hf": str(hf_dir), "dm": str(dm_dir), "root": root, "texts": str(texts)}


@pytest.mark.parametrize("argv", HELP, ids=" ".join)
def test_help_of_every_subcommand(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: unifusion " + " ".join(argv))
    if argv not in (["eval"],):
        assert "--" in out


def _parsers(parser, name="unifusion"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_help_is_plain_text_and_every_option_states_its_default():
    seen = 0
    for name, parser in _parsers(build_parser()):
        text = parser.format_help()
        for markup in ("``", ":func:", ":class:", ":data:", "::"):
            assert markup not in text, f"{name} --help shows reST markup {markup!r}"
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            help_line = formatter._get_help_string(action) or ""
            assert help_line.strip(), f"{name} {action.option_strings[0]} has no help line"
            if not (action.required or isinstance(action, argparse._StoreTrueAction)):
                assert "default" in help_line.lower(), f"{name} {action.option_strings[0]} does not state its default"
            seen += 1
    assert seen > 50


def test_demo_help_says_what_it_does_and_how_long(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "SmolLM2-135M" in out and "How long" in out and "(default: 300.0)" in out


def test_python_dash_m_and_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "unifusion", "--help"], capture_output=True, text=True, check=True)
    assert "sample" in out.stdout and "eval" in out.stdout
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "unifusion"]
    assert ep.value == "unifusion.cli:main"
    assert "demo" in build_parser().format_help()  # the demo hook is registered


def test_sample_then_genppl_end_to_end(folders, capsys):
    out = folders["root"] / "samples.jsonl"
    rc = main(["sample", "--model", folders["dm"], "--kernel", "uniform", "--steps", "3", "--num-samples", "3",
               "--seq-len", "6", "--batch-size", "2", "--seed", "5", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "--- sample 2 (3 steps, seed 5) ---" in stdout
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2] and all(len(r["ids"]) == 6 for r in records)

    result = folders["root"] / "genppl.json"
    rc = main(["eval", "genppl", "--texts", str(out), "--judge", folders["hf"], "--entropy-tokenizer", "judge",
               "--device", "cpu", "--out", str(result)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "GenPPL" in stdout and "mean unigram entropy" in stdout
    payload = json.loads(result.read_text())
    # the same number as the library call
    from transformers import AutoModelForCausalLM, AutoTokenizer

    judge = AutoModelForCausalLM.from_pretrained(folders["hf"])
    ref = uf.eval.generative_perplexity([r["text"] for r in records], judge,
                                        AutoTokenizer.from_pretrained(folders["hf"]), progress=False)
    assert payload["genppl"] == pytest.approx(ref.perplexity, rel=1e-5)
    assert payload["num_texts"] == 3


def test_sample_adapts_a_hf_folder_on_the_fly_with_a_mask_kernel(folders, capsys):
    rc = main(["sample", "--model", folders["hf"], "--kernel", "mask", "--steps", "4", "--num-samples", "2",
               "--seq-len", "5", "--device", "cpu"])
    assert rc == 0
    assert capsys.readouterr().out.count("--- sample") == 2


def test_eval_mc_nll_and_frontier(folders, capsys):
    root = folders["root"]
    rc = main(["eval", "mc", "--model", folders["dm"], "--task", str(TASK), "--num-times", "2", "--device", "cpu",
               "--out", str(root / "mc.json")])
    assert rc == 0
    assert "accuracy" in capsys.readouterr().out
    mc = json.loads((root / "mc.json").read_text())
    assert mc["num_examples"] == 6 and 0.0 <= mc["accuracy"] <= 1.0 and len(mc["predictions"]) == 6
    rc = main(["eval", "mc", "--model", folders["hf"], "--method", "ar", "--task", str(TASK), "--max-examples", "3",
               "--device", "cpu", "--out", str(root / "mc_ar.json")])
    assert rc == 0 and json.loads((root / "mc_ar.json").read_text())["num_examples"] == 3
    capsys.readouterr()

    rc = main(["eval", "nll", "--model", folders["dm"], "--texts", folders["texts"], "--seq-len", "5",
               "--num-times", "2", "--device", "cpu", "--out", str(root / "nll.json")])
    assert rc == 0
    assert "perplexity bound" in capsys.readouterr().out
    nll = json.loads((root / "nll.json").read_text())
    assert nll["num_tokens"] == 7 + 16 and nll["num_blocks"] == 2 + 4 and nll["nll_bound_per_token"] > 0

    rc = main(["eval", "frontier", "--model", folders["dm"], "--judge", folders["hf"], "--steps", "2", "3",
               "--seeds", "1", "2", "--num-samples", "2", "--seq-len", "6", "--entropy-tokenizer", "model",
               "--label", "tiny", "--device", "cpu", "--out", str(root / "frontier")])
    assert rc == 0
    assert "±" in capsys.readouterr().out
    res = uf.eval.FrontierResult.from_json(root / "frontier" / "tiny_frontier.json")
    assert [r["steps"] for r in res.summary] == [2, 3] and len(res.runs) == 4
    assert (root / "frontier" / "tiny_frontier.png").is_file()


def test_bad_arguments_name_the_option(folders, capsys):
    for argv, option in ((["sample", "--model", "x", "--steps", "0"], "--steps"),
                         (["sample", "--model", "x", "--num-samples", "two"], "--num-samples"),
                         (["eval", "frontier", "--model", "x", "--judge", "y", "--out", "z", "--seeds", "1", "-3"],
                          "--seeds"),
                         (["eval", "mc", "--model", "x", "--task", "t", "--num-times", "0"], "--num-times")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert f"argument {option}" in capsys.readouterr().err
    rc = main(["sample", "--model", str(folders["root"] / "nope"), "--device", "cpu"])
    assert rc == 2 and "--model" in capsys.readouterr().err
    empty = folders["root"] / "empty.txt"
    empty.write_text("\n\n")
    rc = main(["eval", "genppl", "--texts", str(empty), "--judge", folders["hf"], "--device", "cpu"])
    assert rc == 2 and "--texts" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# the default kernel: the one saved with the model, else mask on its mask token, else uniform (as generate)


def _sample(model_dir, capsys, *extra):
    rc = main(["sample", "--model", str(model_dir), "--steps", "2", "--num-samples", "1", "--seq-len", "4",
               "--device", "cpu", *extra])
    captured = capsys.readouterr()
    return rc, captured.err


def test_sample_and_eval_without_kernel_follow_one_rule_and_say_which(folders, tmp_path, capsys):
    from unifusion.hf import default_kernel

    # a checkpoint with a mask token and no recorded kernel: mask on its mask token
    rc, err = _sample(folders["dm"], capsys)
    assert rc == 0
    assert "unifusion sample: kernel MaskKernel(num_states=" in err and "mask_id=2" in err
    assert "has a mask token (2)" in err and "pass --kernel to choose" in err
    # DiffusionLM.generate's default is the same kernel
    loaded = uf.DiffusionLM.from_pretrained(folders["dm"])
    assert type(default_kernel(loaded)[0]) is uf.MaskKernel and default_kernel(loaded)[0].mask_id == 2
    # the kernel recorded at save time wins (here: the AR -> mask -> uniform path, uniform on a model with a mask)
    recorded = tmp_path / "recorded"
    loaded.save_pretrained(recorded, kernel=uf.HybridKernel(loaded.num_states, 2, 0.25))
    rc, err = _sample(recorded, capsys)
    assert rc == 0 and "kernel HybridKernel(" in err and "p_uniform=0.25" in err and "recorded with the model" in err
    loaded.save_pretrained(recorded, kernel=uf.UniformKernel(loaded.num_states))
    rc, err = _sample(recorded, capsys)
    assert rc == 0 and "kernel UniformKernel(" in err and "recorded with the model" in err
    # an HF folder adapted on the fly: no mask token is added without --kernel, so uniform
    rc, err = _sample(folders["hf"], capsys)
    assert rc == 0 and "kernel UniformKernel(" in err and "no mask token" in err
    # an explicit --kernel is used as given, silently
    rc, err = _sample(folders["dm"], capsys, "--kernel", "uniform")
    assert rc == 0 and "kernel" not in err
    # eval subcommands: the same rule and the same note
    rc = main(["eval", "nll", "--model", folders["dm"], "--texts", folders["texts"], "--seq-len", "5",
               "--num-times", "2", "--device", "cpu"])
    assert rc == 0 and "unifusion eval nll: kernel MaskKernel(" in capsys.readouterr().err


def test_p_uniform_is_for_the_hybrid_kernel_only(folders, capsys):
    rc, err = _sample(folders["dm"], capsys, "--p-uniform", "0.3")
    assert rc == 2 and "--p-uniform: only used with --kernel hybrid, got --kernel (not given)" in err
    rc, err = _sample(folders["dm"], capsys, "--kernel", "mask", "--p-uniform", "0.3")
    assert rc == 2 and "got --kernel mask" in err
    rc, err = _sample(folders["dm"], capsys, "--kernel", "hybrid", "--p-uniform", "0.3")
    # nothing but transformers' own "Loading weights" bar (the saved folder is a standard transformers checkpoint)
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert rc == 0 and all(line.startswith("Loading weights") for line in lines), err


def test_make_kernel_lives_in_the_kernel_config_module():
    import unifusion.cli as cli
    from unifusion._kernel_config import make_kernel

    assert not hasattr(cli, "make_kernel")
    assert type(make_kernel("hybrid", 9, 8)) is uf.HybridKernel and make_kernel("hybrid", 9, 8).p_uniform == 0.1
    with pytest.raises(ValueError, match="--kernel: 'mask' needs a model with a mask token"):
        make_kernel("mask", 9, None, name="--kernel")
    with pytest.raises(ValueError, match=r"--kernel: expected one of \('uniform', 'mask', 'hybrid'\), got 'nope'"):
        make_kernel("nope", 9, 8, name="--kernel")
