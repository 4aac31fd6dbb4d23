"""A learned commit rule (Learn2PD, Bao et al. 2025): a small head on the frozen model's hidden states that predicts,
per masked position, whether the model's current prediction is already the token the decode ends with — and the
decoding policy that commits what it accepts.

**What is learned.** At step n of block decoding, position j of the active block is still masked; the model gives
x_θ,j and its argmax a_j^n with probability c_j^n = max_v x_θ,j(v), from the final hidden state h_j^n (the output
head's input). A teacher decode (by default greedy :class:`~unifusion.samplers.policies.LowConfidence`, one token per
forward: the careful one) ends with token x_j. The head f_φ scores

    s_j^n = f_φ(h_j^n, c_j^n) = W_2 GELU(W_1 [h_j^n ; c_j^n] + b_1) + b_2        (a 2-layer MLP, logits)

and is trained with binary cross-entropy against the label y_j^n = 1[a_j^n = x_j] on every (step, masked position)
of the teacher's trajectories; the model's weights are never touched (its states are recorded under ``no_grad``).
Learn2PD's filter reads the block's confidences only; the hidden state gives the head what the model knows about the
position beyond its top probability, and c_j^n is kept as an input, so the threshold rule is one of the functions
the head can represent.

**Decoding** (:class:`LearnedCommit`, beside :class:`~unifusion.samplers.policies.ConfidenceThreshold`): commit every
masked position with σ(s_j^n) ≥ τ, and always the ``num_commit`` highest-scoring ones (at least one, so every step
makes progress). It reads hidden states (``reads_hidden``), which :class:`~unifusion.hf.DiffusionLM` and the
released kinds (:class:`~unifusion.hf.native.NativeDiffusionLM`) give on both paths: cached (their block caches'
``denoise_block_hidden``) and uncached (``block_forward().hidden_states``, ``hidden_states``), so
cached and uncached decoding commit the same positions and give the same tokens, as for any policy.

**Recording** (:func:`collect_commit_data`). One ``model.generate`` call with the teacher policy wrapped in a
recorder that sees every step's :class:`~unifusion.samplers.policies.PolicyStep` — the running rows
(``step.randomness.rows``), the hidden states, the argmax, its probability, the masked and the committed positions —
and passes the teacher's choice through unchanged, so the decode is the teacher's own. Within a row, steps follow one
block until none of its positions is left masked; the next step of that row starts the next block. A position's
final token is the one committed there; positions the decode never commits (the fill after EOS) are left out.

Example::

    head = uf.distill.CommitHead(model.config.hidden_size)
    data = uf.distill.collect_commit_data(model, prompt_ids, max_new_tokens=64)
    uf.distill.train_commit_head(head, data, steps=300, generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt_ids, max_new_tokens=64, policy=uf.distill.LearnedCommit(head, 0.9),
                         do_sample=False, return_dict=True)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..denoiser import DecodableModel
from ..samplers import generate
from ..samplers.policies import (
    BlockStep,
    DecodingPolicy,
    LowConfidence,
    MaskPolicy,
    PolicyStep,
    RowRandomness,
    select_top,
)

__all__ = ["CommitHead", "CommitRuleData", "LearnedCommit", "OracleCommit", "collect_commit_data",
           "train_commit_head"]

_FORMAT = "unifusion.distill.CommitHead"


class CommitHead(nn.Module):
    """f_φ(h, c): a 2-layer MLP from a position's final hidden state ``h`` ``(..., d)`` and its argmax probability
    ``c`` ``(...)`` to the logit that the argmax is the final token ``(...)`` (module docstring).

    Args:
        hidden_size: d, the model's hidden size (``model.config.hidden_size``).
        width: the MLP's hidden width.
    """

    def __init__(self, hidden_size: int, width: int = 64) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("width", width)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.hidden_size, self.width = hidden_size, width
        self.inner = nn.Linear(hidden_size + 1, width)  # W_1, b_1
        self.outer = nn.Linear(width, 1)  # W_2, b_2

    def forward(self, hidden: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
        """Logits ``(...)`` of hidden states ``(..., d)`` (any float dtype: computed in the head's dtype) and argmax
        probabilities ``(...)``."""
        if hidden.shape[-1] != self.hidden_size or hidden.shape[:-1] != confidence.shape:
            raise ValueError(f"hidden: expected shape (..., {self.hidden_size}) with confidence of shape (...), got "
                             f"{tuple(hidden.shape)} and {tuple(confidence.shape)}")
        dtype = self.inner.weight.dtype
        x = torch.cat([hidden.to(dtype), confidence.to(dtype).unsqueeze(-1)], -1)  # (..., d + 1)
        return self.outer(nn.functional.gelu(self.inner(x))).squeeze(-1)

    def accuracy(self, data: CommitRuleData, *, threshold: float = 0.5) -> float:
        """The fraction of ``data``'s examples where σ(f_φ) ≥ ``threshold`` agrees with the label."""
        threshold = _check_probability("threshold", threshold)
        device = self.inner.weight.device
        with torch.no_grad():
            score = torch.sigmoid(self(data.hidden.to(device), data.confidence.to(device)).float())
        return float(((score >= threshold).cpu() == data.label).float().mean())

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the head to one safetensors file (weights, with its sizes in the metadata)."""
        from safetensors.torch import save_file

        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": _FORMAT, "config": json.dumps({"hidden_size": self.hidden_size, "width": self.width})}
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(out), metadata=meta)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, device: torch.device | str | None = None) -> CommitHead:
        """The head :meth:`save` wrote (float32 as saved; on ``device``)."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        file = Path(path)
        if not file.is_file():
            raise ValueError(f"path: expected a commit head file written by CommitHead.save, got {str(file)!r} "
                             "(no such file)")
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != _FORMAT:
            raise ValueError(f"path: {str(file)!r} is not a commit head (metadata format {meta.get('format')!r})")
        config = json.loads(meta["config"])
        head = cls(int(config["hidden_size"]), int(config["width"]))
        head.load_state_dict(load_file(str(file)))
        return head.to(device) if device is not None else head


def _check_probability(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float in [0, 1], got {type(value).__name__}")
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name}: expected a probability in [0, 1], got {value}")
    return float(value)


class LearnedCommit(MaskPolicy):
    """Commit every masked position whose head score σ(f_φ(h_j, c_j)) ≥ ``threshold``, and always the
    ``num_commit`` best (module docstring): :class:`~unifusion.samplers.policies.ConfidenceThreshold` with the
    head's score as the confidence. Adaptive (a block may take fewer steps than positions); reads hidden states.

    The committed token is the step's candidate: the argmax with ``do_sample=False`` (the head was trained on the
    argmax; greedy decoding is what it predicts), a draw from x_θ otherwise.

    Args:
        head: the trained :class:`CommitHead` (on the model's device).
        threshold: τ in [0, 1].
    """

    fixed_count = False
    reads_hidden = True

    def __init__(self, head: CommitHead, threshold: float = 0.5) -> None:
        if not isinstance(head, CommitHead):
            raise TypeError(f"head: expected a CommitHead, got {type(head).__name__}")
        self.head = head
        self.threshold = _check_probability("threshold", threshold)

    def __repr__(self) -> str:
        return f"LearnedCommit(threshold={self.threshold})"

    def confidence(self, step: PolicyStep) -> torch.Tensor:
        """σ(f_φ(h_j, c_j)) ``(B, K)``, c_j the argmax's probability under ``step.probs``."""
        if step.hidden is None:
            raise ValueError("step: LearnedCommit reads hidden states; the step has none (the sampler gives them to "
                             "a policy with reads_hidden)")
        with torch.no_grad():
            return torch.sigmoid(self.head(step.hidden, step.probs.max(-1).values).float())

    def select(self, step: PolicyStep) -> torch.Tensor:
        score = self.confidence(step)
        return select_top(score, step.undecided, step.num_commit) | (step.undecided & (score >= self.threshold))


class OracleCommit(LowConfidence):
    """The commit rule a learned one is trained to be: commit every masked position whose candidate already equals
    the token a reference decode put there — the labels of :func:`collect_commit_data` read as a policy — and always
    the ``num_commit`` most confident (:class:`~unifusion.samplers.policies.LowConfidence`).

    With ``reference`` the model's own one-token-per-forward greedy decode of the same prompts (the teacher
    :class:`CommitHead` learns from), its tokens per forward are what a perfect Learn2PD filter reaches on that
    model: the parallelism already in the frozen model, before any distillation (Learn2PD's motivating count of
    tokens "decoded early"). It is a diagnostic, not a decoder: it reads the answer. The text it gives need not
    equal the reference (committing early changes the context of later positions).

    Args:
        reference: ``(B, L)`` int64 full sequences of the reference decode (prompt and generation, ``generate``'s
            ``sequences`` for the same prompts, ``max_new_tokens`` and layout), indexed by the sampler's columns.
    """

    fixed_count = False

    def __init__(self, reference: torch.Tensor) -> None:
        super().__init__()
        if not isinstance(reference, torch.Tensor):
            raise TypeError(f"reference: expected a (B, L) tensor of token ids, got {type(reference).__name__}")
        if reference.dim() != 2 or reference.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"reference: expected a (B, L) integer tensor of token ids (generate's sequences), got "
                             f"shape {tuple(reference.shape)} and dtype {reference.dtype}")
        self.reference = reference

    def __repr__(self) -> str:
        return f"OracleCommit(reference of shape {tuple(self.reference.shape)})"

    def decide(self, logits: torch.Tensor, undecided: torch.Tensor, num_commit: torch.Tensor,
               randomness: RowRandomness, where: BlockStep, *, mask_id: int | None, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, do_sample: bool = True,
               hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:class:`~unifusion.samplers.policies.LowConfidence`'s step, then also every undecided position whose
        candidate equals ``reference`` at its column (``where.columns``, ``randomness.rows``)."""
        columns, seq_len = where.columns, where.seq_len
        if columns is None or seq_len is None:
            raise ValueError("where: OracleCommit reads each position's column and the sequence length "
                             "(BlockStep(columns=..., seq_len=...)), as generate passes them")
        batch = randomness.batch_size
        if tuple(self.reference.shape) != (batch, seq_len):
            raise ValueError(f"reference: expected the reference decode's sequences of shape ({batch}, {seq_len}) "
                             f"(this decode's rows and length), got {tuple(self.reference.shape)}")
        tokens, commit, p = super().decide(logits, undecided, num_commit, randomness, where, mask_id=mask_id,
                                           temperature=temperature, top_k=top_k, top_p=top_p, do_sample=do_sample,
                                           hidden=hidden)
        reference = self.reference.to(tokens.device)
        if randomness.rows is not None:
            reference = reference[randomness.rows.to(tokens.device)]
        inside = columns < seq_len  # a row whose block ends early repeats seq_len
        expected = reference.gather(1, columns.clamp_max(seq_len - 1))
        return tokens, commit | (undecided & inside & (tokens == expected)), p


@dataclass
class CommitRuleData:
    """Recorded (step, masked position) examples: what :class:`CommitHead` learns from.

    Attributes:
        hidden: ``(N, d)`` float32, the final hidden state of each example.
        confidence: ``(N,)`` float32, its argmax probability c.
        label: ``(N,)`` bool, whether its argmax is the token the decode committed there.
        num_forwards: the teacher decode's model calls, all rows together; ``num_tokens``: the tokens it committed.
    """

    hidden: torch.Tensor
    confidence: torch.Tensor
    label: torch.Tensor
    num_forwards: int = 0
    num_tokens: int = 0

    def __len__(self) -> int:
        return int(self.label.shape[0])

    @property
    def positive_rate(self) -> float:
        """The fraction of examples whose argmax is already final (a constant predictor's accuracy is the larger
        of this and its complement)."""
        return float(self.label.float().mean()) if len(self) else 0.0


class _Recorder(MaskPolicy):
    """The teacher policy, unchanged, with every step's hidden states, argmax, masked and committed positions kept
    (copied to the host: a recording pass, not a hot loop). :class:`_AdaptiveRecorder` records an adaptive
    teacher (the sampler reads the schedule from the class)."""

    reads_hidden = True

    def __init__(self, teacher: MaskPolicy) -> None:
        self.teacher = teacher
        self.steps: list[dict[str, torch.Tensor]] = []

    def select(self, step: PolicyStep) -> torch.Tensor:
        commit = self.teacher.select(step) & step.undecided
        assert step.hidden is not None  # reads_hidden: the sampler gives them
        B = step.tokens.shape[0]
        rows = step.randomness.rows
        top = step.probs.max(-1)
        self.steps.append({"rows": (torch.arange(B) if rows is None else rows).cpu(),
                           "hidden": step.hidden.float().cpu(), "confidence": top.values.float().cpu(),
                           "argmax": top.indices.cpu(), "tokens": step.tokens.cpu(),
                           "undecided": step.undecided.cpu(), "commit": commit.cpu()})
        return commit


class _AdaptiveRecorder(_Recorder):
    fixed_count = False


def _label(steps: list[dict[str, torch.Tensor]]) -> CommitRuleData:
    """The examples of a recorded run (module docstring: blocks per row, final token = the committed one)."""
    block: dict[int, int] = {}  # row -> index of its current block
    open_after: dict[int, bool] = {}  # row -> whether its block still had masked positions after its last step
    final: dict[tuple[int, int, int], int] = {}  # (row, block, position) -> committed token
    where: list[list[tuple[int, int]]] = []  # per step, per running row: (row, block)
    for s in steps:
        left = (s["undecided"] & ~s["commit"]).any(-1).tolist()
        where.append([])
        for a, r in enumerate(s["rows"].tolist()):
            if not open_after.get(r, False):
                block[r] = block.get(r, -1) + 1
            open_after[r] = left[a]
            where[-1].append((r, block[r]))
            for j in s["commit"][a].nonzero().flatten().tolist():
                final[(r, block[r], j)] = int(s["tokens"][a, j])
    hidden, conf, label = [], [], []
    for s, rows in zip(steps, where):
        for a, (r, b) in enumerate(rows):
            for j in s["undecided"][a].nonzero().flatten().tolist():
                token = final.get((r, b, j))
                if token is None:  # never committed: the fill after EOS
                    continue
                hidden.append(s["hidden"][a, j])
                conf.append(s["confidence"][a, j])
                label.append(int(s["argmax"][a, j]) == token)
    if not label:
        raise ValueError("prompt_ids: the decode recorded no masked position (nothing was generated)")
    return CommitRuleData(hidden=torch.stack(hidden), confidence=torch.stack(conf), label=torch.tensor(label),
                          num_tokens=len(final))


def collect_commit_data(model: DecodableModel, prompt_ids: torch.Tensor, *, max_new_tokens: int,
                        policy: DecodingPolicy | None = None, num_steps: int | None = None, batch_size: int = 16,
                        attention_mask: torch.Tensor | None = None, **generate_kwargs: Any) -> CommitRuleData:
    """Decode ``prompt_ids`` with the teacher ``policy`` (greedy) and record every (step, masked position) example
    (module docstring).

    Args:
        model: a model with hidden states on its decoding paths (a :class:`~unifusion.hf.DiffusionLM`, a released
            kind; a model without blocks with ``block_size=`` in ``generate_kwargs``).
        prompt_ids: ``(B, P)`` prompts (left-padded with ``attention_mask`` when their lengths differ).
        max_new_tokens: tokens to generate per prompt.
        policy: the teacher, a mask policy; default :class:`~unifusion.samplers.policies.LowConfidence` (with
            ``num_steps=None``: one token per forward).
        num_steps: steps per block for the teacher (``generate``'s).
        batch_size: prompts per ``generate`` call.
        attention_mask: ``(B, P)``, 1 at real prompt tokens.
        generate_kwargs: further ``generate`` arguments (``eos_token_id``, ``use_cache``, ...); ``do_sample``
            defaults to ``False``.

    Returns:
        :class:`CommitRuleData` with ``num_forwards`` and ``num_tokens`` of the teacher decode.
    """
    teacher = LowConfidence() if policy is None else policy
    if not isinstance(teacher, MaskPolicy):
        raise TypeError(f"policy: expected a mask policy (the teacher commits masked positions), got "
                        f"{type(teacher).__name__}")
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids: expected a (B, P) tensor of token ids, got "
                         f"{tuple(prompt_ids.shape) if isinstance(prompt_ids, torch.Tensor) else type(prompt_ids)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
    generate_kwargs.setdefault("do_sample", False)
    parts: list[CommitRuleData] = []
    forwards = 0
    for start in range(0, prompt_ids.shape[0], batch_size):
        recorder = _Recorder(teacher) if teacher.fixed_count else _AdaptiveRecorder(teacher)
        mask = None if attention_mask is None else attention_mask[start:start + batch_size]
        out = generate(model, prompt_ids[start:start + batch_size], max_new_tokens=max_new_tokens, policy=recorder,
                       num_steps=num_steps, attention_mask=mask, return_dict=True, **generate_kwargs)
        forwards += int(out.num_forwards.sum())
        parts.append(_label(recorder.steps))
    return CommitRuleData(hidden=torch.cat([p.hidden for p in parts]),
                          confidence=torch.cat([p.confidence for p in parts]),
                          label=torch.cat([p.label for p in parts]), num_forwards=forwards,
                          num_tokens=sum(p.num_tokens for p in parts))


def train_commit_head(head: CommitHead, data: CommitRuleData, *, steps: int = 300, lr: float = 1e-3,
                      batch_size: int = 512, weight_decay: float = 0.0,
                      generator: torch.Generator | None = None) -> list[float]:
    """Fit ``head`` to ``data`` by binary cross-entropy (AdamW with ``weight_decay``; minibatches drawn with
    ``generator``); only the head's parameters are optimised. Returns the loss of every step."""
    if not isinstance(head, CommitHead):
        raise TypeError(f"head: expected a CommitHead, got {type(head).__name__}")
    if not isinstance(data, CommitRuleData) or len(data) == 0:
        raise ValueError("data: expected a non-empty CommitRuleData (collect_commit_data)")
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr: expected a positive float, got {lr!r}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not (
            math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay: expected a float >= 0, got {weight_decay!r}")
    device = head.inner.weight.device
    hidden, conf = data.hidden.to(device), data.confidence.to(device)
    target = data.label.to(device=device, dtype=torch.float32)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    head.train()
    for _ in range(steps):
        idx = torch.randint(0, len(data), (min(batch_size, len(data)),), generator=generator).to(device)
        loss = nn.functional.binary_cross_entropy_with_logits(head(hidden[idx], conf[idx]).float(), target[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    head.eval()
    return losses
