"""unifusion.precision: ``"auto"`` is bf16 exactly where the device computes it natively, float32 elsewhere — with
the hardware queries patched to each kind of machine, and once for real on an emulated AVX2 CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from unifusion import precision


@pytest.fixture
def cpu(monkeypatch):
    """Patch the two CPU queries: ``cpu(capability, onednn_bf16)``."""

    def set_cpu(capability: str, onednn_bf16: bool) -> None:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(precision, "_onednn_bf16", lambda: onednn_bf16)

    return set_cpu


@pytest.mark.parametrize(("capability", "onednn_bf16", "expected"), [
    ("AVX512", True, torch.bfloat16),   # AVX512-BF16 or AMX (e.g. Sapphire Rapids, Zen 4)
    ("AVX512", False, torch.float32),   # AVX512 without its bf16 extension (e.g. Skylake-X)
    ("AVX2", True, torch.float32),      # an AVX512-BF16 machine emulating AVX2 (ATEN_CPU_CAPABILITY=avx2 only)
    ("AVX2", False, torch.float32),     # an AVX2-only CPU (e.g. the 2-core EPYC of issue 30)
    ("DEFAULT", False, torch.float32),  # no vector extension torch uses
])
def test_cpu_gets_bf16_only_with_native_support(cpu, capability, onednn_bf16, expected):
    cpu(capability, onednn_bf16)
    assert precision.native_bf16("cpu") is (expected == torch.bfloat16)
    assert precision.auto_dtype("cpu") == expected == precision.resolve_dtype("auto", torch.device("cpu"))
    assert capability in precision.describe_device("cpu")


@pytest.mark.parametrize("bf16_supported", [True, False])
def test_cuda_gets_bf16_where_the_gpu_supports_it(monkeypatch, cpu, bf16_supported):
    """A CUDA device asks torch.cuda (compute capability ≥ 8.0), whatever the host CPU is."""
    cpu("AVX2", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
    expected = torch.bfloat16 if bf16_supported else torch.float32
    assert precision.auto_dtype("cuda") == expected == precision.auto_dtype(torch.device("cuda", 0))


def test_other_devices_compute_in_float32(cpu):
    cpu("AVX512", True)
    assert precision.auto_dtype("meta") == torch.float32


@pytest.mark.parametrize(("capability", "onednn_bf16", "option", "line"), [
    ("AVX2", False, "auto", "device cpu (AVX2, no native bf16) | --dtype auto → float32"),
    ("AVX512", True, "auto", "device cpu (AVX512, native bf16) | --dtype auto → bfloat16 (bf16 autocast)"),
    ("AVX2", False, "bfloat16", "device cpu (AVX2, no native bf16) | --dtype bfloat16 → bfloat16 (bf16 autocast)"),
    ("AVX512", True, "float32", "device cpu (AVX512, native bf16) | --dtype float32 → float32"),
])
def test_the_dtype_choice_is_described_in_one_line(cpu, capability, onednn_bf16, option, line):
    """The line the demo and the examples print: the device, its capability, the option and what it resolved to."""
    cpu(capability, onednn_bf16)
    assert precision.describe_dtype_choice(option, "cpu", bf16_means="bf16 autocast") == line
    assert precision.describe_dtype_choice(option, "cpu") == line.removesuffix(" (bf16 autocast)")
    with pytest.raises(ValueError, match="dtype: expected one of"):
        precision.describe_dtype_choice("float16", "cpu")


def test_explicit_dtypes_are_kept_and_bad_ones_named(cpu):
    cpu("AVX2", False)
    assert precision.resolve_dtype("bfloat16") == torch.bfloat16  # asked for explicitly: honoured
    assert precision.resolve_dtype("float32", "cuda") == torch.float32
    assert precision.resolve_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype: expected one of \('auto', 'float32', 'bfloat16'\), got 'fp16'"):
        precision.resolve_dtype("fp16")
    with pytest.raises(ValueError, match="dtype: expected torch.float32 or torch.bfloat16, got torch.float16"):
        precision.resolve_dtype(torch.float16)
    with pytest.raises(TypeError, match="dtype: expected one of .* or a torch.dtype, got int"):
        precision.resolve_dtype(16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device: expected a device such as 'cpu' or 'cuda:0', got 'gpu0'"):
        precision.auto_dtype("gpu0")
    with pytest.raises(TypeError, match="device: expected a torch.device or its name, got int"):
        precision.auto_dtype(0)  # type: ignore[arg-type]


def _auto_in_subprocess(env: dict[str, str]) -> str:
    code = "import torch; from unifusion import precision; print(precision.cpu_capability(), precision.auto_dtype())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_an_emulated_avx2_cpu_chooses_float32_for_real():
    """No patching: ATEN_CPU_CAPABILITY=avx2 with ONEDNN_MAX_CPU_ISA=AVX2 makes any x86 machine dispatch like an AVX2
    one (docs/performance.md: it reproduces the slow bf16 block step), and auto follows."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("the emulation variables are x86-only")
    assert _auto_in_subprocess({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}) == "AVX2 torch.float32"
