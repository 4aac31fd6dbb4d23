"""sequence_logprob's fused head against materialised logits + log_softmax + gather (TRL's selective_log_softmax),
forward + backward, at N completion tokens and a large vocabulary.

    python benchmarks/rl_logprob.py [--n 4096] [--d 576] [--v 49152 262144] [--layers 1]

The policy is a random llama adapted with ``adapt_ar_model`` (``--layers`` layers, hidden ``--d``, vocabulary V, the
mask token the last id): both variants run the same backbone on the same ``(4, n/4 + 1)`` batch (one prompt token per
row, the rest completion, fully masked: one pass of ``estimator="mean_field"``, ``prompt_mask_prob=0``).

* ``materialised``: ``logits = model(x_t, t)`` (``(B, L, V)`` float32), ``log_softmax``, gather the completion's
  tokens, ``.sum().backward()`` (a plain softmax over all ids; the fused path leaves the mask id out, MDLM's SUBS —
  the same work).
* ``fused``: ``uf.rl.sequence_logprob(...).sequence.sum().backward()`` (no ``(B, L, V)`` tensor);
  ``--variant fused_weighted``: ``(out.per_token * w).sum().backward()`` with random per-token weights w, the
  gradient a GRPO loss sends (every token a different one: the fused backward recomputes the blocks).

Memory: peak RSS increase of one full-size run over the inputs and model, in its own process, after a warm-up call
on a short batch (eager backend: a compiler's one-off memory is not counted). Time: one run in another process after
a full-size warm-up (the library's default backend; one-off compilation not counted). Prints fused / materialised.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _memory  # noqa: E402

import unifusion as uf  # noqa: E402

_MARK = "RL_LOGPROB_JSON "


def _model(V: int, d: int, layers: int) -> uf.DiffusionLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
                         num_attention_heads=max(1, d // 64), num_key_value_heads=max(1, d // 192),
                         max_position_embeddings=8192, bos_token_id=0, eos_token_id=1, tie_word_embeddings=True)
    return uf.adapt_ar_model(LlamaForCausalLM(config), mask_token_id=V - 1)


def _batch(n: int, V: int, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    L = n // rows + 1
    ids = torch.randint(2, V - 1, (rows, L), generator=torch.Generator().manual_seed(0))
    completion = torch.ones(rows, L, dtype=torch.bool)
    completion[:, 0] = False
    return ids, completion


def _run(variant: str, model: uf.DiffusionLM, ids: torch.Tensor, completion: torch.Tensor) -> None:
    if variant in ("fused", "fused_weighted"):
        out = uf.rl.sequence_logprob(model, ids, completion, estimator="mean_field", prompt_mask_prob=0.0,
                                     generator=torch.Generator().manual_seed(0))
        if variant == "fused":
            out.sequence.sum().backward()
        else:  # every token a different incoming gradient, as a GRPO loss sends (A_i ρ_{i,t} / normaliser)
            w = torch.rand(out.per_token.shape, generator=torch.Generator().manual_seed(1))
            (out.per_token * w).sum().backward()
        return
    x_t = torch.where(completion, torch.full_like(ids, model.mask_token_id), ids)
    logits = model(x_t, torch.full((ids.shape[0],), 0.5))  # (B, L, V) float32
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]  # (the mask column stays: same cost)
    torch.where(completion, lp, torch.zeros_like(lp)).sum().backward()


def child(variant: str, n: int, V: int, d: int, layers: int) -> None:
    """``variant`` is ``"<name>:time"`` (warm-up at full size, so one-off compilation is not counted, then one timed
    run) or ``"<name>:memory"`` (warm-up on a short batch, then the peak RSS increase of one full-size run)."""
    torch.set_num_threads(2)
    uf.validation.set_validation(False)
    name, what = variant.split(":")
    if what == "memory":  # the eager backend: a compiled kernel's one-off compilation memory is not counted
        uf.backend.set_backend("eager")
    model = _model(V, d, layers)
    ids, completion = _batch(n, V)
    _run(name, model, *(_batch(64, V) if what == "memory" else (ids, completion)))  # warm-up
    model.zero_grad(set_to_none=False)
    _memory.baseline()
    start = time.perf_counter()
    _run(name, model, ids, completion)
    seconds = time.perf_counter() - start
    print(_MARK + json.dumps({"seconds": seconds}), flush=True)
    _memory.report()


def measure(variant: str, n: int, V: int, d: int, layers: int) -> tuple[float, int]:
    """(seconds, peak RSS increase in bytes) of a variant, each from its own process."""
    found: dict[str, float] = {}
    for what in ("time", "memory"):
        out = subprocess.run([sys.executable, __file__, "--child", f"{variant}:{what}", "--n", str(n), "--v", str(V),
                              "--d", str(d), "--layers", str(layers)], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{variant} at V={V}: exited {out.returncode}\n{out.stderr[-2000:]}")
        for line in out.stdout.splitlines():
            if what == "time" and line.startswith(_MARK):
                found["seconds"] = json.loads(line[len(_MARK):])["seconds"]
            if what == "memory" and line.startswith("PEAK_RSS_JSON "):
                found["peak"] = json.loads(line[len("PEAK_RSS_JSON "):])["peak_delta_bytes"]
    return found["seconds"], int(found["peak"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", default=None)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=576)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--v", type=int, nargs="+", default=[49152, 262144])
    p.add_argument("--variant", default="fused", choices=["fused", "fused_weighted"],
                   help="the fused variant compared with the materialised baseline")
    a = p.parse_args()
    if a.child:
        child(a.child, a.n, a.v[0], a.d, a.layers)
        return
    print(f"# cpu: {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, N = {a.n}, d = {a.d}, "
          f"layers = {a.layers}, fused variant: {a.variant}")
    print("V        materialised s  fused s  time ratio  materialised MiB  fused MiB  memory ratio")
    for V in a.v:
        tm, mm = measure("materialised", a.n, V, a.d, a.layers)
        tf, mf = measure(a.variant, a.n, V, a.d, a.layers)
        print(f"{V:<8} {tm:14.2f} {tf:8.2f} {tf / tm:11.2f} {mm / 2**20:17.0f} {mf / 2**20:10.0f} {mf / mm:13.2f}",
              flush=True)


if __name__ == "__main__":
    main()
