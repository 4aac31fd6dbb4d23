"""``loglikelihood`` and ``loglikelihood_rolling`` of the harness model, and loglikelihood's bookkeeping.

A ``loglikelihood`` call groups its requests into questions (:func:`questions`), draws each answer's corrupted rows as
``score_choices`` / ``fair_pmi_scores`` would (the question's generator, common random numbers across its contexts),
and pools the rows of all questions by length into forward passes (:class:`RowPool`). Each row's result flows back to
its :class:`Block`, the block's to its :class:`Answer`, which computes the score once all its blocks are in; the call
reads every score back to the host at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..._device import host_to_device
from ...denoiser import Denoiser
from ...kernels import Kernel
from ...rates import x0_log_probs
from .._shared import logits_of
from ..choices import corrupt_span, standard_times, stratified_times
from ..likelihood import nll_bound
from ._args import FAIR_PMI_T_MIN
from ._common import Cuts, HarnessBase, evaluating, request_seed, seeded_generator


class LoglikelihoodRequests(HarnessBase):
    """The harness's ``loglikelihood`` and ``loglikelihood_rolling`` (a mixin of
    :class:`~unifusion.eval.harness.UnifusionLM`)."""

    @evaluating
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(−score, is_greedy)`` per ``(context, continuation)`` request (see :mod:`unifusion.eval.harness`).

        Requests are grouped as the harness emits them: consecutive requests of one document (same ``task_name`` and
        ``doc_id``; requests without a ``doc_id`` group by equal context) form one question; a request object that
        occurs twice in a question (the evaluator's padding under data parallelism) is scored once. Within a
        question, the continuations that share a context are scored together with the draws ``score_choices`` /
        ``fair_pmi_scores`` make from the question's generator; when the question's requests have different contexts
        (WinoGrande's partial scoring: one context per option, the same continuation), every context is scored from
        the same generator state, so all options see the same times, selected positions and noise tokens. The rows
        of all questions are then pooled by length into forward passes of ``batch_size`` rows.

        A context is cut from the left so that context + longest continuation of its question fits ``max_length``; a
        continuation longer than ``max_length`` keeps its last ``max_length`` tokens (scored without context). Both
        are counted in one warning per call.
        """
        pairs = [(str(r.args[0]), str(r.args[1])) for r in requests]
        all_questions: list[Question] = []
        pool = RowPool(self.model, self.kernel, self.batch_size_per_forward)
        cuts = Cuts()
        streams: dict[Any, tuple[torch.Generator, torch.Generator]] = {}  # seeding="task": per task
        bar = self._progress(len(requests), "loglikelihood", disable_tqdm)
        for members in questions(requests, pairs):
            unique: list[int] = []
            seen: dict[int, int] = {}
            for i in members:
                if id(requests[i]) not in seen:
                    seen[id(requests[i])] = i
                    unique.append(i)
            question = Question(members=members, first={i: seen[id(requests[i])] for i in members}, bar=bar)
            all_questions.append(question)
            generator, greedy_generator = self._question_generators(requests[members[0]],
                                                                    [list(pairs[i]) for i in unique], streams)
            by_context: dict[str, list[int]] = {}
            for i in unique:
                by_context.setdefault(pairs[i][0], []).append(i)
            state = generator.get_state()
            for context_text, group in by_context.items():
                generator.set_state(state)  # common random numbers across the question's contexts
                self._add_group(question, pool, context_text, group, [pairs[i][1] for i in group], generator,
                                greedy_generator, cuts)
            question.sealed = True
            question.maybe_finish()
        pool.flush()
        bar.close()
        cuts.warn("loglikelihood", len(requests), self.max_length)
        answers = [answer for question in all_questions for answer in question.answers]
        if any(answer.score is None for answer in answers):  # every row ran at the flush
            raise RuntimeError("loglikelihood: an answer was left unscored (a bug in unifusion.eval.harness)")
        # one read-back for the whole call (the scores live on the model's device)
        scores = torch.stack([cast(torch.Tensor, a.score) for a in answers]).tolist() if answers else []
        greedy = torch.stack([cast(torch.Tensor, a.greedy) for a in answers]).tolist() if answers and \
            self.check_greedy else [False] * len(answers)
        value = {answer.index: (-s, bool(g)) for answer, s, g in zip(answers, scores, greedy)}
        return [value[question.first[i]] for question in all_questions for i in question.members]

    def _question_generators(self, first: Any, content: list[list[str]],
                             streams: dict[Any, tuple[torch.Generator, torch.Generator]]
                             ) -> tuple[torch.Generator, torch.Generator]:
        """(scorer generator, is_greedy generator) of a question, on the CPU: the scorers draw the corruption there
        and move the rows to the model, so the numbers do not depend on the device."""
        if self.seeding == "request":
            return (seeded_generator(request_seed(self.seed, "loglikelihood", content), "cpu"),
                    seeded_generator(request_seed(self.seed, "is_greedy", content), "cpu"))
        task = getattr(first, "task_name", None)
        if task not in streams:
            streams[task] = (seeded_generator(self.seed, "cpu"), seeded_generator(self.seed + 1, "cpu"))
        return streams[task]

    def _add_group(self, question: Question, pool: RowPool, context_text: str, members: list[int],
                   continuations: Sequence[str], generator: torch.Generator, greedy_generator: torch.Generator,
                   cuts: Cuts) -> None:
        """Draw one context's corruption as ``score_choices`` / ``fair_pmi_scores`` would and queue its rows."""
        choices = []
        for text in continuations:
            ids = self._encode(text)
            if not ids:
                raise ValueError(f"continuation: {text!r} tokenizes to nothing")
            if len(ids) > self.max_length:
                cuts.continuations += 1
                cuts.lost = max(cuts.lost, len(ids) - self.max_length)
                ids = ids[-self.max_length:]
            choices.append(torch.tensor(ids, dtype=torch.long))
        budget = self.max_length - max(a.numel() for a in choices)
        context = self._encode(context_text)
        if len(context) > budget:
            cuts.contexts += 1
            cuts.lost = max(cuts.lost, len(context) - budget)
            context = context[-budget:] if budget > 0 else []
        context_t = torch.tensor(context, dtype=torch.long)
        null_t = torch.tensor(self._encode(self.null_context), dtype=torch.long)
        K = self.num_times
        for i, a in zip(members, choices):
            if self.method == "score":
                t = standard_times(K)
            else:
                t = stratified_times(K, FAIR_PMI_T_MIN, generator, torch.device("cpu"))
            z, selected = corrupt_span(self.kernel, a, t, generator)  # (K, m) each
            answer = Answer(question, i, a, selected, self.method)
            blocks = [Block(torch.cat([context_t.expand(K, -1), z], 1), t, a, answer, "context")]
            if self.method == "fair_pmi":
                blocks.append(Block(torch.cat([null_t.expand(K, -1), z], 1), t, a, answer, "null"))
            if self.check_greedy:
                t_1 = standard_times(1)  # (1,) = 1 − 10⁻³
                noise = torch.multinomial(self.kernel.prior(t_1), a.numel(), replacement=True,
                                          generator=greedy_generator)  # (1, m)
                blocks.append(Block(torch.cat([context_t.unsqueeze(0), noise], 1), t_1, a, answer, "greedy"))
            answer.pending = len(blocks)  # counted before any block can finish inside pool.add
            question.pending += 1
            question.answers.append(answer)
            for block in blocks:
                pool.add(block)

    @evaluating
    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """−(upper bound on −log p_θ(text)) in nats per request (see :mod:`unifusion.eval.harness`).

        ``nll_bound`` draws its times and corruption on the windows' device, the model's, so the generator lives
        there too: seeded with :func:`request_seed` ``(seed, "loglikelihood_rolling", text)`` per text
        (``seeding="request"``), or with ``seed`` at each task's first text (``seeding="task"``). On the CPU the
        numbers are ``nll_bound``'s with ``torch.Generator().manual_seed(...)``; on an accelerator the same estimator
        with that device's stream.
        """
        device = self.model.device
        streams: dict[Any, torch.Generator] = {}
        totals: list[torch.Tensor | None] = []
        bar = self._progress(len(requests), "loglikelihood_rolling", disable_tqdm)
        for request in requests:
            text = str(request.args[0])
            ids = self._encode(text)
            if self.seeding == "request":
                generator = seeded_generator(request_seed(self.seed, "loglikelihood_rolling", text), device)
            else:
                task = getattr(request, "task_name", None)
                if task not in streams:
                    streams[task] = seeded_generator(self.seed, device)
                generator = streams[task]
            total: torch.Tensor | None = None  # summed where nll_bound returns it, read once per call
            for lo in range(0, len(ids), self.max_length):
                window = host_to_device(torch.tensor(ids[lo: lo + self.max_length]).unsqueeze(0), device)
                bound = nll_bound(self.model, window, self.kernel, num_times=self.nll_times, generator=generator,
                                  per_token=False).sum().double()
                total = bound if total is None else total + bound
            totals.append(total)  # None: an empty text, bound 0
            bar.update(1)
        bar.close()
        values = iter(torch.stack([v for v in totals if v is not None]).tolist() if any(
            v is not None for v in totals) else [])
        return [0.0 if v is None else -next(values) for v in totals]


# ---------------------------------------------------------------------------------------------------------------
# the bookkeeping: questions, answers, and the pool of rows


def questions(requests: Sequence[Any], pairs: Sequence[tuple[str, str]]) -> Iterator[list[int]]:
    """Consecutive requests of one document (same task_name and doc_id); without a doc_id, consecutive requests with
    one context."""
    keys = [(getattr(r, "task_name", None), getattr(r, "doc_id", None)) for r in requests]
    start = 0
    while start < len(requests):
        end = start + 1
        if keys[start][1] is None:
            while end < len(requests) and keys[end][1] is None and pairs[end][0] == pairs[start][0]:
                end += 1
        else:
            while end < len(requests) and keys[end] == keys[start]:
                end += 1
        yield list(range(start, end))
        start = end


@dataclass(eq=False)
class Question:
    """A question's answers; counts on the progress bar once every row of every answer has run."""

    members: list[int]
    first: dict[int, int]  # request index -> the index of the first occurrence of the same request object
    bar: Any
    answers: list[Answer] = field(default_factory=list)
    pending: int = 0
    sealed: bool = False

    def maybe_finish(self) -> None:
        if self.sealed and not self.pending:
            self.bar.update(len(self.members))


@dataclass(eq=False)
class Answer:
    """One request's rows: the scorer's ``(K, m)`` NLLs (context, and null for Fair-PMI) and is_greedy. Its score
    stays a tensor on the model's device (no host sync per answer); the call reads all scores back at once."""

    question: Question
    index: int
    answer: torch.Tensor  # (m,)
    selected: torch.Tensor  # (K, m): I_k(a)
    method: str
    pending: int = 0
    nll: dict[str, torch.Tensor] = field(default_factory=dict)
    greedy: torch.Tensor | None = None  # 0-d bool
    score: torch.Tensor | None = None  # 0-d float64

    def done(self, kind: str, value: torch.Tensor) -> None:
        if kind == "greedy":
            self.greedy = value
        else:
            self.nll[kind] = value
        self.pending -= 1
        if not self.pending:
            self.score = self._score()
            self.nll.clear()
            self.question.pending -= 1
            self.question.maybe_finish()

    def _score(self) -> torch.Tensor:
        """``score_choices``' S(a) or ``fair_pmi_scores``' S_PMI(a), from the same terms in the same order."""
        nll = self.nll["context"]  # (K, m) float64
        sel = self.selected.to(nll.device)
        if self.method == "score":
            sel = sel | ~sel.any(-1, keepdim=True)  # empty I_k: fall back to every span position
            per_time = (nll * sel).sum(-1) / sel.sum(-1)  # (K,)
            return per_time.mean()
        L_c = (nll * sel).sum(-1).mean()  # L̄(a|c)
        L_null = (self.nll["null"] * sel).sum(-1).mean()  # L̄(a|null)
        return (L_c - L_null) / self.answer.numel()


@dataclass(eq=False)
class Block:
    """Rows of one answer that share a length: ``x_t`` ``(R, L)`` (context, then the span), times ``(R,)``."""

    x_t: torch.Tensor
    t: torch.Tensor
    answer_ids: torch.Tensor  # (m,)
    owner: Answer
    kind: str  # "context", "null" or "greedy"
    results: list[torch.Tensor] = field(default_factory=list)
    filled: int = 0


class RowPool:
    """Rows of equal length, from any question, go through the model ``batch_size`` at a time. A row's result (the
    span's −log x_θ(a_i), float64, or the argmax check) does not depend on the rows beside it, so pooling changes no
    number; it only fills the forward passes. Nothing is read back to the host here."""

    def __init__(self, model: Denoiser, kernel: Kernel, batch_size: int) -> None:
        self.model, self.kernel, self.batch_size = model, kernel, batch_size
        self.waiting: dict[int, list[tuple[Block, int]]] = {}  # length -> (block, first row not yet run)
        self.count: dict[int, int] = {}

    def add(self, block: Block) -> None:
        L = block.x_t.shape[1]
        self.waiting.setdefault(L, []).append((block, 0))
        self.count[L] = self.count.get(L, 0) + block.x_t.shape[0]
        while self.count[L] >= self.batch_size:
            self._run(L, self.batch_size)

    def flush(self) -> None:
        for L in list(self.waiting):
            while self.count[L]:
                self._run(L, min(self.count[L], self.batch_size))

    def _run(self, L: int, rows: int) -> None:
        taken: list[tuple[Block, int, int]] = []  # (block, first row, number of rows)
        need, queue = rows, self.waiting[L]
        while need:
            block, start = queue[0]
            n = min(need, block.x_t.shape[0] - start)
            taken.append((block, start, n))
            need -= n
            if start + n == block.x_t.shape[0]:
                queue.pop(0)
            else:
                queue[0] = (block, start + n)
        self.count[L] -= rows
        device = self.model.device
        # built on the host (the corruption's generator is a CPU one); sent without making the host wait
        x_t = host_to_device(torch.cat([b.x_t[s: s + n] for b, s, n in taken]), device)
        t = host_to_device(torch.cat([b.t[s: s + n] for b, s, n in taken]).to(torch.float32), device)
        extra: dict[str, Any] = {}
        if (self.model.block_size or L) < L:  # a block model: answer block b sees the clean blocks before it
            clean = torch.cat([torch.cat([b.x_t[s: s + n, :L - b.answer_ids.numel()],
                                          b.answer_ids.expand(n, -1)], 1) for b, s, n in taken])
            extra = self.model.block_conditioning(host_to_device(clean, device))
        logits = logits_of(self.model(x_t, t, **extra))  # (rows, L, S)
        row = 0
        for block, _start, n in taken:
            m = block.answer_ids.numel()
            span = logits[row: row + n, -m:].float()  # (n, m, S)
            targets = host_to_device(block.answer_ids, device)
            if block.kind == "greedy":
                if self.kernel.mask_id is not None:
                    span[..., self.kernel.mask_id] = float("-inf")
                block.results.append((span.argmax(-1) == targets).all(-1))
            else:
                log_x = x0_log_probs(self.kernel, span)
                block.results.append(-log_x.gather(-1, targets.expand(n, m).unsqueeze(-1)).squeeze(-1))
            block.filled += n
            row += n
            if block.filled == block.x_t.shape[0]:  # results stay on the device: no host sync per forward
                value = torch.cat(block.results)
                block.owner.done(block.kind, value.all() if block.kind == "greedy" else value.double())
