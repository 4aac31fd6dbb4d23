"""Fixed-seed outputs of the public API, written to a file and compared bit for bit (the layout refactor's check).

    python benchmarks/api_fingerprint.py --out before.safetensors          # on the old commit
    python benchmarks/api_fingerprint.py --out after.safetensors --compare before.safetensors

Every entry is computed on the eager backend (``UNIFUSION_BACKEND=eager``), in float32 and float64, from tiny random
models and fixed generators: the fast and reference losses of every kernel and weighting, their gradients, the five
objectives through ``diffusion_loss`` (unfused and fused) on an adapted tiny Llama, the Bayesian and Euler samplers,
``DiffusionLM.generate``, ``nll_bound`` and the multiple-choice scores. Only public names are used, so the script
runs against the layout before and after a refactor. ``--compare`` prints each entry that differs (max |a − b|) and
exits 1 if any does; entries present on one side only are listed.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["UNIFUSION_BACKEND"] = "eager"

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import unifusion as uf  # noqa: E402


def _tiny_llama(vocab: int = 64, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128, head_dim=8,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def _kernels(S: int, mask_id: int) -> dict[str, object]:
    return {"uniform": uf.UniformKernel(S), "mask": uf.MaskKernel(S, mask_id),
            "hybrid": uf.HybridKernel(S, mask_id, p_uniform=0.2, gamma=1.0)}


def losses(out: dict[str, torch.Tensor]) -> None:
    S, B, L = 40, 3, 7
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, S - 1, (B, L), generator=g)
    t = torch.rand(B, 1, generator=g) * 0.9 + 0.05
    for dtype in (torch.float32, torch.float64):
        logits0 = torch.randn(B, L, S, generator=g, dtype=dtype) * 3
        for name, kernel in _kernels(S, S - 1).items():
            x_t = kernel.sample(x0, t, generator=torch.Generator().manual_seed(1))
            out[f"x_t/{name}"] = x_t
            for weighting in ("elbo", "clip", "dynamic"):
                logits = logits0.clone().requires_grad_(True)
                loss = uf.losses.gidd_loss(logits, x0, x_t, t, kernel, weighting=weighting)
                loss.sum().backward()
                key = f"gidd/{name}/{weighting}/{dtype}"
                out[key], out[key + "/grad"] = loss.detach(), logits.grad
                ref = uf.losses.reference_gidd_loss(logits0, x0, x_t, t, kernel, weighting=weighting)
                out[f"reference_gidd/{name}/{weighting}/{dtype}"] = ref
            p = logits0.softmax(-1)
            p = p * kernel.clean_state_mask.to(dtype)
            p = p / p.sum(-1, keepdim=True)
            for target in ("sedd", "m2s"):
                out[f"convert/{target}/{name}/{dtype}"] = uf.convert_x0_to(target, p, kernel, x_t, t, strict=False)
            exit_rate, jump = uf.convert_x0_to("ctmc", p, kernel, x_t, t)
            out[f"convert/ctmc/{name}/{dtype}"] = torch.cat([exit_rate.unsqueeze(-1), jump], -1)
            out[f"rate/{name}/{dtype}"] = uf.ReverseRate.from_x0_logits(kernel, logits0, x_t, t).rates
            out[f"marginal/{name}/{dtype}"] = kernel.marginal(x0, t.to(dtype))
            out[f"posterior/{name}/{dtype}"] = kernel.posterior(p, x_t, (t * 0.5).to(dtype), t.to(dtype))
        mask = _kernels(S, S - 1)["mask"]
        x_t = mask.sample(x0, t, generator=torch.Generator().manual_seed(1))
        out[f"mdlm/{dtype}"] = uf.losses.mdlm_loss(logits0, x0, x_t, t, mask)


def training(out: dict[str, torch.Tensor]) -> None:
    V = 64
    for added in (False, True):
        model = uf.adapt_ar_model(_tiny_llama(V), add_mask_token=added)
        S = model.num_states
        kernel = uf.MaskKernel(S, model.mask_token_id) if added else uf.UniformKernel(S)
        x0 = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(2))
        pad = torch.ones_like(x0)
        pad[1, 9:] = 0
        objectives = ("gidd", "mdlm", "sedd", "m2s", "ctmc") if added else ("gidd", "sedd", "m2s", "ctmc")
        for objective in objectives:
            for fused in (False, True):
                model.zero_grad()
                res = uf.diffusion_loss(model, x0, kernel, objective=objective, generator=torch.Generator()
                                        .manual_seed(3), attention_mask=pad, bidirectional_prob=0.5, fused=fused)
                res.loss.sum().backward()
                key = f"diffusion_loss/{added}/{objective}/{fused}"
                out[key] = res.loss.detach()
                out[key + "/x_t"] = res.x_t
                out[key + "/grad"] = model.base_model.model.layers[0].self_attn.q_proj.weight.grad.clone()
        with torch.no_grad():
            out[f"logits/{added}"] = model(x0, torch.full((2,), 0.3), attention_mask=pad)
            out[f"generate/{added}"] = model.generate(x0[:, :4], max_new_tokens=8, num_steps=4,
                                                      generator=torch.Generator().manual_seed(4))
            out[f"bayesian/{added}"] = uf.BayesianSampler(model, kernel, 5, top_k=10).sample(
                2, 10, generator=torch.Generator().manual_seed(5))
            out[f"euler/{added}"] = uf.EulerSampler(model, kernel, 5).sample(
                2, 10, generator=torch.Generator().manual_seed(6))
            out[f"nll_bound/{added}"] = uf.eval.nll_bound(model, x0, kernel, num_times=8,
                                                          generator=torch.Generator().manual_seed(7),
                                                          attention_mask=pad)
            out[f"score_choices/{added}"] = torch.as_tensor(uf.eval.score_choices(
                model, kernel, x0[0, :5].tolist(), [x0[1, :3].tolist(), x0[1, 3:7].tolist()], num_times=4,
                generator=torch.Generator().manual_seed(8)), dtype=torch.float64)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the outputs (.safetensors)")
    parser.add_argument("--compare", default=None, help="a file written earlier to compare against, bit for bit")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the same reduction order on every run
    out: dict[str, torch.Tensor] = {}
    losses(out)
    training(out)
    save_file({k: v.detach().contiguous() for k, v in out.items()}, args.out)
    print(f"{len(out)} outputs written to {args.out}")
    if args.compare is None:
        return 0
    before = load_file(args.compare)
    differ = 0
    for key in sorted(set(before) | set(out)):
        if key not in before or key not in out:
            print(f"only in {'after' if key in out else 'before'}: {key}")
            differ += 1
            continue
        a, b = before[key], out[key].detach()
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.nan_to_num(), b.nan_to_num()):
            gap = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("nan")
            print(f"differs: {key} (max |a - b| = {gap:.3g})")
            differ += 1
    print(f"{len(out)} outputs compared: {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
