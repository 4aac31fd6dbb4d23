"""A saved DiffusionLM folder as transformers and its users meet it (issue 44): ``config.json`` says the weights are a
diffusion model and keeps saying it through transformers' round trips; ``AutoModelForCausalLM.from_pretrained`` warns
(its load report names the marker) while the explicit backbone reuse stays quiet; ``from_pretrained`` takes
transformers' keywords and resolves a Hub id from a local Hub cache, offline."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from _hf_tiny import random_ids, tiny_model

from unifusion.hf import DiffusionLM, adapt_ar_model
from unifusion.hf.ar.io import DIFFUSION_ARCHITECTURE, DIFFUSION_CONFIG_KEY, DIFFUSION_MARKER


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[DiffusionLM, Path]:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(Path(__file__).parents[2] / "data" / "tiny_tokenizer")
    model = adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=4, tokenizer=tok).eval()
    folder = tmp_path_factory.mktemp("saved")
    model.save_pretrained(folder)
    return model, folder


def _warnings(caplog, load):
    """``load()``'s result and the messages transformers logged at warning level meanwhile."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_warning()  # tests/hf/conftest.py quiets transformers for every test
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        result = load()
    return result, [r.getMessage() for r in caplog.records if r.name.startswith("transformers")]


def test_config_json_says_diffusion_and_keeps_saying_it(saved, tmp_path) -> None:
    from transformers import AutoConfig

    model, folder = saved
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [DIFFUSION_ARCHITECTURE]
    record = config[DIFFUSION_CONFIG_KEY]
    assert record["kind"] == "block_diffusion" and record["block_size"] == 4 and record["shift"] == 1
    assert record["mask_token_id"] == model.mask_token_id == config["vocab_size"] - 1
    assert record["backbone_architecture"] == "LlamaForCausalLM"
    # a transformers round trip (AutoConfig.from_pretrained → save_pretrained) keeps the record
    AutoConfig.from_pretrained(folder).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())[DIFFUSION_CONFIG_KEY] == record
    plain = adapt_ar_model(tiny_model("llama"), add_mask_token=False)
    plain.save_pretrained(tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())[DIFFUSION_CONFIG_KEY]["kind"] == "diffusion"


def test_auto_model_for_causal_lm_warns_and_the_explicit_backbone_is_quiet(saved, caplog) -> None:
    """What a transformers user or a tool that takes the folder for a causal LM calls: it loads the backbone and
    warns, naming the marker; ``DiffusionLM.from_pretrained(folder).hf_model`` is the same backbone, without it."""
    from transformers import AutoModelForCausalLM

    model, folder = saved
    backbone, messages = _warnings(caplog, lambda: AutoModelForCausalLM.from_pretrained(folder))
    report = "\n".join(messages)
    assert DIFFUSION_MARKER in report and "UNEXPECTED" in report
    explicit, messages = _warnings(caplog, lambda: DiffusionLM.from_pretrained(folder).hf_model)
    assert not any(DIFFUSION_MARKER in m for m in messages), messages
    assert type(explicit) is type(backbone)
    x = random_ids(2, 6)
    torch.testing.assert_close(explicit(x).logits, backbone(x).logits, rtol=0, atol=0)
    torch.testing.assert_close(explicit(x).logits, model.hf_model(x).logits, rtol=0, atol=0)


def test_from_pretrained_takes_transformers_keywords(saved) -> None:
    model, folder = saved
    for kwargs in ({"torch_dtype": torch.bfloat16}, {"dtype": "bfloat16"},
                   {"dtype": torch.bfloat16, "torch_dtype": "bfloat16"}):
        assert DiffusionLM.from_pretrained(folder, **kwargs).dtype == torch.bfloat16, kwargs
    for device_map in ("cpu", {"": "cpu"}, torch.device("cpu")):
        assert DiffusionLM.from_pretrained(folder, device_map=device_map).device.type == "cpu"
    if torch.cuda.device_count() <= 1:
        expected = "cuda" if torch.cuda.device_count() else "cpu"
        assert DiffusionLM.from_pretrained(folder, device_map="auto").device.type == expected
    with pytest.raises(ValueError, match="dtype, torch_dtype: two names for one setting"):
        DiffusionLM.from_pretrained(folder, dtype=torch.float32, torch_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="device_map: places the model on one device"):
        DiffusionLM.from_pretrained(folder, device_map={"model": "cpu", "lm_head": "meta"})
    with pytest.raises(ValueError, match="device, device_map: two places"):
        DiffusionLM.from_pretrained(folder, device="cpu", device_map="meta")
    for name, value in (("revision", "main"), ("cache_dir", "/tmp/x"), ("token", "hf_x")):
        with pytest.raises(ValueError, match=f"{name}: .* is a local folder, which has no Hub revision"):
            DiffusionLM.from_pretrained(folder, **{name: value})
    assert DiffusionLM.from_pretrained(folder, local_files_only=True).block_size == 4  # true of a folder anyway


def _hub_cache(root: Path, repo_id: str, folder: Path, commit: str = "a" * 40) -> None:
    """``folder``'s files laid out as huggingface_hub caches a downloaded model repository."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_a_hub_id_resolves_through_the_hub_cache_offline(saved, tmp_path, monkeypatch) -> None:
    import huggingface_hub.constants as hub

    model, folder = saved
    _hub_cache(tmp_path / "hub", "someone/tiny-diffusion", folder)
    for name, value in (("HF_HUB_CACHE", str(tmp_path / "hub")), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read from the environment at import
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    loaded = DiffusionLM.from_pretrained("someone/tiny-diffusion")
    assert loaded.block_size == 4 and loaded.tokenizer is not None
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert DiffusionLM.from_pretrained("someone/tiny-diffusion", revision="main").block_size == 4
    with pytest.raises(ValueError, match="no such folder 'someone/absent'.*Hub repository id it could not be resolved"):
        DiffusionLM.from_pretrained("someone/absent")
