"""The stages of ``unifusion demo`` that train for parallel decoding, after the block-diffusion training: distillation
on the model's own decodes (``--distill-seconds``) and Learn2PD's learned commit rule (``--commit-rule``).

Both read the demo's options (:func:`unifusion.demo.add_demo_arguments`) and import the distillation layer when they
run, so that the command line starts fast.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .distill import CommitHead
    from .hf.ar.model import DiffusionLM

__all__ = ["commit_rule_stage", "distillation_stage"]


def distillation_stage(model: DiffusionLM, prompts: torch.Tensor, args: argparse.Namespace, device: torch.device,
                       dtype: torch.dtype) -> dict[str, Any]:
    """The distillation stage (``--distill-seconds``, recording counted in it): the trained model's greedy decodes of
    ``prompts`` ``(n, P)``, one token per forward (``LowConfidence``, K steps per block, ``--new-tokens`` each,
    no EOS stop), recorded with the forward each token was committed at
    (:func:`unifusion.distill.record_trajectories`), then updates of the whole model with
    :func:`unifusion.distill.distillation_loss` (d3LLM's pseudo-trajectory view and its complement, dParallel's
    certainty forcing), ``--batch-size`` trajectories each, while the mean step so far fits in the budget (at least
    one)."""
    from .distill import distillation_loss, record_trajectories
    from .samplers.policies import LowConfidence

    start = time.perf_counter()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    was_training = model.training
    model.eval()
    with torch.no_grad(), autocast:
        traj = record_trajectories(model, prompts.to(device), max_new_tokens=args.new_tokens, policy=LowConfidence(),
                                   num_steps=model.block_size, batch_size=args.batch_size, progress=False,
                                   eos_token_id=None, use_cache=True, merge_commits=True)
    recorded = time.perf_counter() - start
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.distill_lr, weight_decay=0.0)
    g = torch.Generator(device=device).manual_seed(args.seed)
    steps, loss, step_seconds = 0, float("nan"), 0.0
    # a step that the mean step so far says would end past the budget is not started (the first always runs)
    while steps == 0 or time.perf_counter() - start + step_seconds / steps <= args.distill_seconds:
        step_start = time.perf_counter()
        rows = torch.randint(len(traj), (min(args.batch_size, len(traj)),), generator=g, device=device).cpu()
        with autocast:
            value = distillation_loss(model, traj.select(rows), generator=g)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps, loss = steps + 1, value.item()
        step_seconds += time.perf_counter() - step_start
    model.train(was_training)
    return {"recorded": len(traj), "record_seconds": recorded,
            "recorded_tokens_per_forward": float(traj.tokens_per_forward.mean()), "steps": steps,
            "final_loss": loss, "seconds": time.perf_counter() - start, "lr": args.distill_lr}


def commit_rule_stage(model: DiffusionLM, prompts: torch.Tensor, args: argparse.Namespace, device: torch.device,
                      dtype: torch.dtype) -> tuple[CommitHead, dict[str, Any]]:
    """Learn2PD's learned commit rule on the model as it is (frozen): every (step, masked position) of its greedy
    one-token-per-forward decodes of ``prompts`` ``(n, P)`` (``--new-tokens`` each, no EOS stop), labelled whether
    the step's argmax is the token the decode ends with (:func:`unifusion.distill.collect_commit_data`), fit a
    :class:`~unifusion.distill.CommitHead` by binary cross-entropy for ``--commit-rule-steps`` steps: (the head,
    what the stage did)."""
    from .distill import CommitHead, collect_commit_data, train_commit_head

    start = time.perf_counter()
    was_training = model.training
    model.eval()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    with torch.no_grad(), autocast:
        data = collect_commit_data(model, prompts.to(device), max_new_tokens=args.new_tokens,
                                   num_steps=model.block_size, batch_size=args.batch_size, use_cache=True,
                                   merge_commits=True, eos_token_id=None)
    model.train(was_training)
    head = CommitHead(data.hidden.shape[-1]).to(device)
    losses = train_commit_head(head, data, steps=args.commit_rule_steps,
                               generator=torch.Generator().manual_seed(args.seed))
    head.eval()
    return head, {"prompts": len(prompts), "examples": len(data), "positive_rate": data.positive_rate,
                  "final_loss": losses[-1], "train_accuracy": head.accuracy(data),
                  "seconds": time.perf_counter() - start}
