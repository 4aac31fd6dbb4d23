"""Fixed-seed outputs and the public surface of the API, written to one file and compared (the refactors' check).

    python benchmarks/api_fingerprint.py --out before.safetensors          # on the old commit (PYTHONPATH=old tree)
    python benchmarks/api_fingerprint.py --out after.safetensors --compare before.safetensors

Numbers: every entry is computed on the eager backend (``UNIFUSION_BACKEND=eager``), in float32 and float64, from
tiny random models and fixed generators: the fast and reference losses of every kernel and weighting, their
gradients, the five objectives through ``diffusion_loss`` (unfused and fused) on an adapted tiny Llama, the Bayesian
and Euler samplers, ``DiffusionLM.generate``, ``nll_bound`` and the multiple-choice scores; ``unifusion.rl``: every
estimator through ``sequence_logprob`` (estimates, per-token values, a weight's gradient) on rollouts of a tiny
model without blocks and with blocks (K = 4, prompt 6; ``"elbo"`` and ``"trace"``), one row left-padded, the
estimators' plans (``plan_masks``), the quadrature nodes, ``group_advantages``, ``grpo_loss`` (every level and
normalisation, with and without the KL term, and its gradient), ``wd1_loss``, ``spg_loss`` and ``dpo_loss``. Only
public names are called, and a keyword argument whose name a refactor may change is passed by its position in the
callee's signature (``_call(..., by_index=...)``), so the same calls run against the layouts before and after a
rename.

Surface: every exported name of ``unifusion`` and of each public module with an ``__all__``, with its kind and
signature, and the public members of exported classes (``benchmarks/_surface.py``), stored as uint8 tensors of JSON
text keyed ``surface:<module>.<name>`` in the same safetensors file.

``--compare`` prints each number entry that differs bit for bit (max |a − b|) or is on one side only, then the
surface's ``renamed:`` (a removed name or parameter paired with its added counterpart when the rest of the
description is identical), ``removed:``, ``added:`` and ``changed:`` entries. It exits 1 if a number differs;
surface changes alone exit 0 unless ``--strict-surface``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
from typing import Any

os.environ["UNIFUSION_BACKEND"] = "eager"

import _surface  # noqa: E402
import numpy as np  # noqa: E402
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


def _param(fn: object, index: int) -> str:
    """The name of ``fn``'s parameter at ``index``: a renamed keyword argument is passed by its position in the
    signature, so the same call runs before and after a rename."""
    return list(inspect.signature(fn).parameters)[index]  # type: ignore[arg-type]


def _call(fn: Any, *args: Any, by_index: dict[int, Any] | None = None, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` plus the keyword arguments ``by_index`` ({parameter position: value})."""
    return fn(*args, **kwargs, **{_param(fn, i): v for i, v in (by_index or {}).items()})


def rl(out: dict[str, torch.Tensor]) -> None:
    """``unifusion.rl``: every estimator through ``sequence_logprob`` on a tiny model (no blocks; a block model,
    K = 4, prompt 6, for the block estimators), their plans, and the objectives on fixed inputs."""
    est = uf.rl.estimators
    eubo_beta = _param(est.plan_masks, 11)  # the "eubo" option is plan_masks' last parameter (SPG's β)
    g = torch.Generator().manual_seed(10)
    V, P, N = 64, 6, 8
    for block_size in (None, 4):
        model = uf.adapt_ar_model(_tiny_llama(V), add_mask_token=True, block_size=block_size)
        prompt = torch.randint(3, V, (2, P), generator=g)
        with torch.no_grad():
            roll = model.generate(prompt, max_new_tokens=N, num_steps=4, return_trace=True, eos_token_id=None,
                                  policy=uf.samplers.policies.LowConfidence(),
                                  generator=torch.Generator().manual_seed(11))
        ids, trace = roll.sequences, roll.commit_step
        comp = trace >= 0
        out[f"rl/rollout/{block_size}"] = torch.cat([ids, trace], -1)
        # the second row again, left-padded by 2 (prompt 4 real tokens + 2 pads: its own layout)
        pad = torch.zeros(1, 2, dtype=torch.long)
        ids3 = torch.cat([ids, torch.cat([pad, ids[1:, 2:]], 1)])
        comp3 = torch.cat([comp, torch.cat([pad.bool(), comp[1:, 2:]], 1)])
        att3 = torch.ones_like(ids3)
        att3[2, :2] = 0
        trace3 = torch.cat([trace, torch.cat([pad - 1, trace[1:, 2:]], 1)])
        names = ("elbo", "trace") if block_size else uf.rl.ESTIMATORS
        for estimator in names:
            opts: dict[str, Any] = {"trace": trace3} if estimator == "trace" else {}
            if estimator == "eubo":
                opts[eubo_beta] = 2.0
            model.zero_grad()
            res = uf.rl.sequence_logprob(model, ids3, comp3, estimator=estimator, attention_mask=att3,
                                         num_samples=1 if estimator == "trace" else 2,
                                         generator=None if estimator == "trace" else torch.Generator().manual_seed(12),
                                         **opts)
            res.sequence.sum().backward()
            key = f"rl/sequence_logprob/{block_size}/{estimator}"
            out[key], out[key + "/per_token"] = res.sequence.detach(), res.per_token.detach()
            out[key + "/grad"] = model.base_model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    comp = torch.ones(3, 7, dtype=torch.bool)
    comp[0, 5:] = False
    prompt_mask = torch.zeros(3, 7, dtype=torch.bool)
    prompt_mask[:, :2], comp[:, :2] = True, False
    for estimator in ("elbo_discrete", "coupled", "quadrature", "mean_field", "eubo"):
        kwargs: dict[str, Any] = {"prompt_mask": prompt_mask} if estimator == "mean_field" else {}
        plan = _call(est.plan_masks, estimator, comp, num_samples=3, generator=torch.Generator().manual_seed(13),
                     by_index={11: 2.0} if estimator == "eubo" else None, **kwargs)
        for i, f in enumerate(dataclasses.fields(plan)):
            value = getattr(plan, f.name)
            if isinstance(value, torch.Tensor):
                out[f"rl/plan_masks/{estimator}/{f.name}"] = value
            elif isinstance(value, float):
                out[f"rl/plan_masks/{estimator}/field{i}"] = torch.tensor(value, dtype=torch.float64)
    for n in (1, 3, 8):
        out[f"rl/gauss_legendre/{n}"] = torch.as_tensor(np.stack(est.gauss_legendre(n)))

    B, L = 4, 6
    x = torch.randn(B, L, generator=g, dtype=torch.float64) - 2
    x_old, x_ref = x + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64), x - 0.2
    m = torch.ones(B, L, dtype=torch.bool)
    m[1, 4:] = False
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    for scale in (True, False):
        out[f"rl/group_advantages/{scale}"] = uf.rl.group_advantages(rewards, 2, scale=scale)
    A = uf.rl.group_advantages(rewards, 2)
    for level in ("token", "sequence"):
        for normalization in ("grpo", "dr_grpo", "dapo"):
            for kl in (0.0, 0.04):
                logps = x.clone().requires_grad_(True)
                loss = _call(uf.rl.grpo_loss, logps, x_old, A, m, by_index={4: x_ref, 5: kl}, epsilon=0.2,
                             epsilon_high=0.28, level=level, normalization=normalization, max_length=L)
                loss.sum().backward()
                key = f"rl/grpo_loss/{level}/{normalization}/{kl}"
                out[key], out[key + "/grad"] = loss.detach(), logps.grad
    seq = x.sum(-1)
    for group_size in (None, 2):
        out[f"rl/wd1_loss/{group_size}"] = uf.rl.wd1_loss(seq, A, group_size=group_size)
    for mix in (None, 0.3):
        out[f"rl/spg_loss/{mix}"] = uf.rl.spg_loss(seq, seq + 1.5, A, mix_weight=mix)
    out["rl/dpo_loss"] = _call(uf.rl.dpo_loss, seq, seq.flip(0), 0.9 * seq, 1.1 * seq.flip(0), by_index={4: 0.7})


def _numbers(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """A line per number entry that differs bit for bit (or is on one side only)."""
    lines = []
    for key in sorted(set(before) | set(after)):
        if key not in before or key not in after:
            lines.append(f"only in {'after' if key in after else 'before'}: {key}")
            continue
        a, b = before[key], after[key]
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.nan_to_num(), b.nan_to_num()):
            gap = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("nan")
            lines.append(f"differs: {key} (max |a - b| = {gap:.3g})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the outputs (.safetensors)")
    parser.add_argument("--compare", default=None, help="a file written earlier to compare against")
    parser.add_argument("--strict-surface", action="store_true", help="exit 1 on surface changes too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the same reduction order on every run
    out: dict[str, torch.Tensor] = {}
    losses(out)
    training(out)
    rl(out)
    numbers = {k: v.detach().clone().contiguous() for k, v in out.items()}  # no two entries share memory
    entries = _surface.surface(uf)
    save_file({**numbers, **_surface.to_tensors(entries)}, args.out)
    print(f"{len(numbers)} outputs and {len(entries)} surface entries of {uf.__file__} written to {args.out}")
    if args.compare is None:
        return 0
    before = load_file(args.compare)
    differ = _numbers({k: v for k, v in before.items() if not k.startswith(_surface.PREFIX)}, numbers)
    for line in differ:
        print(line)
    print(f"{len(numbers)} outputs compared: {len(differ)} differ")
    changes = _surface.compare_surfaces(_surface.from_tensors(before), entries)
    for line in changes:
        print(line)
    print(f"{len(entries)} surface entries compared: {sum(not c.startswith(' ') for c in changes)} changes")
    return 1 if differ or (args.strict_surface and changes) else 0


if __name__ == "__main__":
    sys.exit(main())
