"""``unifusion sample`` with prompts and decoding policies (unifusion/_cli_generate.py): --prompt (left-padded
batches, samples independent of the batch size), --chat, --policy / --threshold / --block-size / --num-steps,
--top-k, EOS stopping, bad combinations; tiny random models saved to a temporary folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _hf_tiny import tiny_model

import unifusion as uf
from unifusion.cli import main

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("cli_generate")
    tok = PreTrainedTokenizerFast.from_pretrained(DATA / "tiny_tokenizer")
    dm_dir, chat_dir = root / "dm", root / "chat"
    dm = uf.adapt_ar_model(tiny_model("llama", seed=1), tokenizer=tok)  # an added mask token
    dm.save_pretrained(dm_dir)
    block_dir = root / "block"
    uf.adapt_ar_model(tiny_model("llama", seed=1), tokenizer=tok, block_size=4).save_pretrained(block_dir)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}<assistant>"
    tok.save_pretrained(chat_dir)
    return {"dm": str(dm_dir), "block": str(block_dir), "chat_tok": str(chat_dir), "root": root}


def _records(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def test_prompts_with_a_policy_do_not_depend_on_the_batch(folders, capsys):
    outs = []
    for batch, name in ((3, "a.jsonl"), (1, "b.jsonl")):
        out = folders["root"] / name
        rc = main(["sample", "--model", folders["dm"], "--prompt", "the cat", "--prompt", "the big dog ran to the",
                   "--policy", "low_confidence", "--block-size", "4", "--num-steps", "2", "--max-new-tokens", "8",
                   "--num-samples", "2", "--batch-size", str(batch), "--seed", "3", "--device", "cpu",
                   "--out", str(out)])
        assert rc == 0
        outs.append(_records(out))
    stdout = capsys.readouterr().out
    assert "low_confidence policy" in stdout and "[prompt] the cat" in stdout
    a, b = outs
    assert [r["prompt"] for r in a] == ["the cat"] * 2 + ["the big dog ran to the"] * 2
    assert [r["text"] for r in a] == [r["text"] for r in b]
    assert all(r["num_forwards"] >= 1 and len(r["ids"]) <= 8 for r in a)


def test_threshold_implies_the_policy_and_top_k_reaches_the_sampler(folders, capsys):
    rc = main(["sample", "--model", folders["dm"], "--prompt", "the cat", "--threshold", "0.5", "--block-size", "4",
               "--max-new-tokens", "8", "--num-samples", "1", "--top-k", "5", "--device", "cpu"])
    assert rc == 0 and "threshold policy" in capsys.readouterr().out
    rc = main(["sample", "--model", folders["dm"], "--steps", "3", "--num-samples", "1", "--seq-len", "6",
               "--top-k", "5", "--device", "cpu"])
    assert rc == 0 and "(3 steps, seed 0)" in capsys.readouterr().out
    # a prompt without a policy: the Bayesian sampler through generate, stopped at EOS afterwards
    rc = main(["sample", "--model", folders["dm"], "--prompt", "the cat", "--num-steps", "4", "--max-new-tokens", "6",
               "--num-samples", "1", "--device", "cpu"])
    assert rc == 0 and "4 steps" in capsys.readouterr().out


def test_block_model_merge_commits_same_texts(folders, capsys):
    """A saved block model decodes through its cache; --merge-commits gives the same samples."""
    texts = []
    for extra in ([], ["--merge-commits"]):
        out = folders["root"] / f"block{len(extra)}.jsonl"
        rc = main(["sample", "--model", folders["block"], "--prompt", "the big dog ran to the", "--policy",
                   "low_confidence", "--num-steps", "2", "--max-new-tokens", "12", "--num-samples", "2",
                   "--no-eos-stop", "--device", "cpu", "--out", str(out), *extra])
        assert rc == 0
        texts.append([(r["ids"], r["num_forwards"]) for r in _records(out)])
    # every backbone call counts: prefill + 3 blocks × 2 steps + 2 commits (merged: the prefill inside the first
    # step, each commit inside the next block's)
    assert [ids for ids, _ in texts[0]] == [ids for ids, _ in texts[1]]
    assert all(n == 9 for _, n in texts[0]) and all(n == 6 for _, n in texts[1])
    capsys.readouterr()
    rc = main(["sample", "--model", folders["block"], "--seq-len", "8", "--device", "cpu"])  # no policy: the default
    assert rc == 0 and "(LowConfidence policy" in capsys.readouterr().out
    rc = main(["sample", "--model", folders["block"], "--seq-len", "8", "--sampler", "euler", "--device", "cpu"])
    assert rc == 2 and "--sampler" in capsys.readouterr().err


def test_chat_applies_the_template(folders, capsys):
    out = folders["root"] / "chat.jsonl"
    rc = main(["sample", "--model", folders["dm"], "--tokenizer", folders["chat_tok"], "--chat", "--prompt", "hi",
               "--policy", "random", "--block-size", "4", "--max-new-tokens", "4", "--num-samples", "1",
               "--device", "cpu", "--out", str(out)])
    assert rc == 0 and _records(out)[0]["prompt"] == "hi"
    rc = main(["sample", "--model", folders["dm"], "--chat", "--prompt", "hi", "--device", "cpu"])
    assert rc == 2 and "chat template" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--chat"], "--chat"),
    (["--block-size", "4"], "--policy"),
    (["--merge-commits"], "--policy"),
    (["--policy", "random", "--sampler", "euler"], "euler"),
    (["--policy", "threshold", "--threshold", "1.5", "--prompt", "a"], "threshold"),
])
def test_bad_combinations(folders, capsys, argv, message):
    rc = main(["sample", "--model", folders["dm"], "--device", "cpu", "--max-new-tokens", "4", *argv])
    assert rc == 2 and message in capsys.readouterr().err
