"""Loading a released diffusion LM's checkpoint folder against transformers loading the same weights natively.

    python benchmarks/load.py [--repeats 3] [--dtype bfloat16]
                              [--kinds llada Dream sdar lladamoe Fast_dLLM_Qwen llada2_moe] [--json out.json]

For each kind (LLaDA, Dream, SDAR, LLaDA-MoE, Fast-dLLM v2, LLaDA 2; ``--kinds`` picks some by ``model_type``) a
random 135M-parameter model (SmolLM2-135M's shape: d = 576, 30 layers, MLP 1536, 9 heads / 3 KV heads, vocabulary
49,152; LLaDA-MoE's MLP is 8 experts of width 192, top 2, the same parameter count) is saved twice into a temporary
folder: in the kind's own layout (its ``config.json`` and weight names, what ``save_pretrained`` writes) and as the
backbone's transformers folder (``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` /
``Qwen3MoeForCausalLM``, whose fused experts transformers converts at load as unifusion does). LLaDA 2
(``llada2_moe``: a 136M MoE, d = 576, 10 layers, the first dense, 16 experts of 256 and a shared one, 4 per token)
has no transformers architecture; its backbone (``LLaDA2MoeForCausalLM``, a transformers ``PreTrainedModel``) loads
its own transformers folder with transformers' ``from_pretrained``. Each load then runs in a fresh process (so the
page cache is warm but nothing else is shared): ``uf.load_diffusion_lm(folder, dtype=...)`` against
``<Backbone>.from_pretrained(folder, dtype=...)``, timing the call; then every weight is read once (``amax``: no
copy; memory-mapped weights become resident). Two memory figures, each over the weights' size: the growth of the
process's resident memory over its size before the call (what stays), and the growth of its high-water mark
(``VmHWM``, reset before the call through ``/proc/self/clear_refs``: the peak during the load and the read).
Targets (issue 41): time ≤ 1.2× transformers', peak memory ≤ 1.2× the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SOURCES = {
    "llada": {"model_type": "llada", "d_model": 576, "n_heads": 9, "n_kv_heads": 3, "n_layers": 30,
              "mlp_hidden_size": 1536, "embedding_size": 49152, "vocab_size": 49152, "max_sequence_length": 2048,
              "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "weight_tying": False, "mask_token_id": 49151,
              "eos_token_id": 0, "pad_token_id": 0, "block_type": "llama", "layer_norm_type": "rms",
              "activation_type": "silu", "rope": True, "alibi": False, "include_bias": False},
    "Dream": {"model_type": "Dream", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
              "num_hidden_layers": 30, "intermediate_size": 1536, "vocab_size": 49152,
              "max_position_embeddings": 2048, "rope_theta": 100000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "mask_token_id": 49151, "eos_token_id": 0, "pad_token_id": 0},
    "sdar": {"model_type": "sdar", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
             "head_dim": 64, "num_hidden_layers": 30, "intermediate_size": 1536, "vocab_size": 49152,
             "max_position_embeddings": 2048, "rope_theta": 100000.0, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": False, "mask_token_id": 49151, "block_size": 4, "eos_token_id": 0,
             "pad_token_id": 0},
    "lladamoe": {"model_type": "lladamoe", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                 "num_hidden_layers": 30, "dense_intermediate_size": 1536, "expert_intermediate_size": 192,
                 "num_experts": 8, "num_experts_per_tok": 2, "moe_layer_freq": [1] * 30, "qk_layernorm": True,
                 "shared_expert_intermediate_size": None, "partial_rotary_factor": 1.0, "vocab_size": 49152,
                 "max_position_embeddings": 2048, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                 "tie_word_embeddings": False, "mask_token_id": 49151, "eos_token_id": 0, "pad_token_id": 0},
    "Fast_dLLM_Qwen": {"model_type": "Fast_dLLM_Qwen", "hidden_size": 576, "num_attention_heads": 9,
                       "num_key_value_heads": 3, "num_hidden_layers": 30, "intermediate_size": 1536,
                       "vocab_size": 49152, "max_position_embeddings": 2048, "rope_theta": 100000.0,
                       "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bd_size": 32, "mask_token_id": 49151,
                       "eos_token_id": 0, "pad_token_id": 0, "layer_types": ["full_attention"] * 30},
    "llada2_moe": {"model_type": "llada2_moe", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                   "num_hidden_layers": 10, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                   "max_position_embeddings": 2048, "rope_theta": 100000.0, "rms_norm_eps": 1e-6,
                   "use_qkv_bias": False, "use_bias": False, "use_qk_norm": True, "partial_rotary_factor": 0.5,
                   "num_experts": 16, "num_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4,
                   "topk_group": 2, "moe_intermediate_size": 256, "first_k_dense_replace": 1,
                   "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "mask_token_id": 49151,
                   "eos_token_id": 0, "pad_token_id": 0},
}
KIND_CLASSES = {"llada": "LLaDALM", "Dream": "DreamLM", "sdar": "SDARLM", "lladamoe": "LLaDAMoELM",
                "Fast_dLLM_Qwen": "FastDLLMv2LM", "llada2_moe": "LLaDA2LM"}

CHILD = r"""
import json, resource, sys, time
import torch
import unifusion as uf
which, folder, dtype, backbone = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3]), sys.argv[4]
import importlib, transformers
module, _, name = backbone.rpartition(":")  # a class of transformers, or module:class (LLaDA 2's backbone)
cls = getattr(importlib.import_module(module) if module else transformers, name)
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
def high_water():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the high-water mark: the imports' transient peak is not the load's
base = resident()
t0 = time.perf_counter()
model = uf.load_diffusion_lm(folder, dtype=dtype) if which == "unifusion" else cls.from_pretrained(folder, dtype=dtype)
seconds = time.perf_counter() - t0
weights = sum(p.numel() * p.element_size() for p in model.parameters())
touched = [p.detach().amax() for p in model.parameters()]  # memory-mapped weights become resident (no copy)
grown = resident() - base
peak = high_water() - base  # the high-water mark over the load and the read
print(json.dumps({"seconds": seconds, "weights_bytes": weights, "resident_growth_bytes": grown,
                  "peak_growth_bytes": peak}))
"""


def write_folders(root: Path, dtype: str, kinds: list[str]) -> dict[str, tuple[Path, Path, str]]:
    import torch

    import unifusion as uf

    folders = {}
    for kind in kinds:
        source = SOURCES[kind]
        cls = getattr(uf.hf, KIND_CLASSES[kind])
        torch.manual_seed(0)
        model = cls.from_source(source)
        model.hf_model.to(getattr(torch, dtype))
        theirs, native = root / f"{kind}_layout", root / f"{kind}_native"
        theirs.mkdir(parents=True)
        model.save_checkpoint_files(theirs)
        model.hf_model.save_pretrained(native)
        backbone = type(model.hf_model)
        folders[kind] = (theirs, native, backbone.__name__ if backbone.__module__.startswith("transformers.")
                         else f"{backbone.__module__}:{backbone.__name__}")
    return folders


def measure(which: str, folder: Path, dtype: str, backbone: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", CHILD, which, str(folder), dtype, backbone],
                         capture_output=True, text=True, check=True, cwd=ROOT, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kinds", nargs="+", default=list(SOURCES), choices=list(SOURCES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = {}
    with tempfile.TemporaryDirectory(prefix="unifusion-load-") as tmp:
        for kind, (theirs, native, backbone) in write_folders(Path(tmp), args.dtype, args.kinds).items():
            runs = {which: [measure(which, folder, args.dtype, backbone) for _ in range(args.repeats)]
                    for which, folder in (("unifusion", theirs), ("transformers", native))}
            row = {which: {"seconds_median": statistics.median(r["seconds"] for r in rs),
                           "resident_over_weights": max(r["resident_growth_bytes"] for r in rs)
                           / rs[0]["weights_bytes"],
                           "peak_over_weights": max(r["peak_growth_bytes"] for r in rs) / rs[0]["weights_bytes"]}
                   for which, rs in runs.items()}
            row["time_ratio"] = row["unifusion"]["seconds_median"] / row["transformers"]["seconds_median"]
            row["weights_mib"] = runs["unifusion"][0]["weights_bytes"] / 2**20
            report[kind] = row
            print(f"{kind}: {row['weights_mib']:.0f} MiB of weights; unifusion "
                  f"{row['unifusion']['seconds_median']:.3f} s, transformers "
                  f"{row['transformers']['seconds_median']:.3f} s (ratio {row['time_ratio']:.2f}); "
                  f"resident / weights: unifusion "
                  f"{row['unifusion']['resident_over_weights']:.2f}, transformers "
                  f"{row['transformers']['resident_over_weights']:.2f}; peak / weights: unifusion "
                  f"{row['unifusion']['peak_over_weights']:.2f}, transformers "
                  f"{row['transformers']['peak_over_weights']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
