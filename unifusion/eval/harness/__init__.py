"""A unifusion model inside EleutherAI's lm-evaluation-harness (``lm-eval`` on PyPI; ``pip install "unifusion[eval]"``).

Importing this module registers the harness model ``"unifusion"`` (:class:`UnifusionLM`), so both ways in work:

    unifusion harness --model_args pretrained=DIR --tasks piqa --batch_size 16      # the harness's own CLI
    lm_eval.simple_evaluate(model="unifusion", model_args="pretrained=DIR", tasks=["piqa"])
    lm_eval.simple_evaluate(model=UnifusionLM(model=model, tokenizer=tok), tasks=[...])   # a live model, in training

The three request types, with the paper's protocols (App. C.4, Proposition 3.2):

* ``loglikelihood(context, continuation)`` returns ``(−score, is_greedy)``. ``score`` is the paper's diffusion span
  score S(a) over the K-point time grid (:func:`~unifusion.eval.score_choices`, ``method="score"``, K = 32), or the
  Fair-PMI score (:func:`~unifusion.eval.fair_pmi_scores`, ``method="fair_pmi"``, K = 128, null context
  ``"Answer:"``). Both are *per-token* scores, lower is better, so the harness's ``acc`` (argmax of the returned
  value) is the protocol of :func:`~unifusion.eval.run_multiple_choice` (with ``seeding="task"``, its very numbers);
  ``acc_norm`` (divided by the answer's length in bytes) has no counterpart in the paper. The requests of one
  question (consecutive requests with the same ``task_name`` and ``doc_id``, as the harness emits them) are scored
  with shared randomness, as ``run_multiple_choice`` does; options with their own contexts (WinoGrande) are scored
  from the same generator state. The rows of all questions are pooled: rows of equal length go through the model
  ``batch_size`` at a time, whichever question they belong to (the draws are made per question first, so the pooling
  changes no number).
  ``is_greedy`` is True when every answer token is the argmax of the model's x0 prediction with the whole answer
  span replaced by noise at t = 1 − 10⁻³ (one extra row per answer, pooled the same way; ``check_greedy=False``
  skips it and returns False). Because the value is a per-token mean, metrics that sum or exponentiate
  log-likelihoods over documents (LAMBADA's ``perplexity``) are per-token-normalised, not sequence log-likelihoods.
* ``loglikelihood_rolling(text)`` returns −(Proposition 3.2's upper bound on −log p_θ(text)) in nats: a lower bound
  on the log-likelihood, from :func:`~unifusion.eval.nll_bound` with ``nll_times`` stratified times, over disjoint
  windows of ``max_length`` tokens (each window scored without the previous one as context).
  Block models (``adapt_ar_model(..., block_size=K)``): ``loglikelihood`` runs the block-causal forward with the clean
  row ``[context, answer]`` (an answer token's prediction sees the clean blocks before its own and the noisy tokens of
  its block), and ``loglikelihood_rolling`` the block bound (:func:`~unifusion.eval.nll_bound`).
* ``generate_until(context, gen_kwargs)``: the Bayesian sampler of :meth:`~unifusion.DiffusionLM.generate`
  (Algorithm 2) with the context as a fixed prefix, ``max_gen_toks`` new tokens, ``num_steps`` steps, ended at the
  tokenizer's EOS token and truncated at the first ``until`` string. ``do_sample=False`` (the harness's default when
  a task sets neither ``do_sample`` nor a temperature > 0) replaces x_θ by its argmax (a one-hot x_θ, ``top_k = 1``);
  the sampler's other random choices (which positions are revealed at each step; the noise tokens of a uniform
  kernel) stay, drawn from the request's own generator (each row of a sampler batch has its own generator:
  ``generate(..., generator=[one per row])``). Diffusion sampling has no unique greedy decoder: this is
  *deterministic* decoding (the same request gives the same text), not a search for the most likely sequence.
  With a decoding policy (model arguments ``policy``, ``block_size``, ``threshold``, ``cache_refresh``, ``num_steps``
  as steps per block; per task the ``gen_kwargs`` ``policy``, ``block_size``, ``threshold``, ``num_steps``) the
  continuation is decoded block by block (:class:`~unifusion.samplers.PolicySampler`), each row stopping at the
  tokenizer's EOS; a block model (``block_size=K``) decodes through its exact KV cache.

**Random numbers.** With ``seeding="request"`` (the default) every question of ``loglikelihood``, every text of
``loglikelihood_rolling`` and every ``generate_until`` request draws from its own generator, seeded with
:func:`request_seed` of the model's ``seed`` and the request's content. A request's numbers therefore do not depend on
the batch it is in, on the requests or tasks before it, or on the process that evaluates it (data-parallel runs give
the single-process numbers). Repeats of one request object (the harness's ``repeats``) get successive seeds, so
sampled repeats differ; greedy repeats are identical. ``seeding="task"`` instead streams one generator per task
through its questions in order, seeded with ``seed`` at the task's first request: the numbers of
``run_multiple_choice(..., seed=seed)`` and of ``nll_bound`` with one generator over the documents (one process only).

**Data-parallel evaluation.** Under ``torchrun`` / ``accelerate launch`` (``WORLD_SIZE`` > 1) the model joins the
process group (initialising it when the launcher has not: NCCL on CUDA, gloo on the CPU), runs on
``cuda:LOCAL_RANK`` (or the CPU), and gives the harness's evaluator ``rank``, ``world_size``, ``all_gather``,
``gather_object`` and ``barrier``: each process evaluates every ``world_size``-th document and rank 0 reports.

**Inside the package.** ``_model``: :class:`UnifusionLM` (its arguments, tokenizer and kernel; the harness API);
``_loglikelihood``: ``loglikelihood`` and ``loglikelihood_rolling`` with the bookkeeping of questions, answers and the
pool of rows; ``_generation``: ``generate_until``; ``_args``: the model arguments (:data:`MODEL_ARGS`) and their
parsers; ``_common``: :func:`request_seed` and what the request types share; ``_distributed``: the process group and
collectives; ``_cli``: ``unifusion harness`` (:func:`cli_main`).
"""

from __future__ import annotations

try:  # before the submodules, which import from it: one clear message without the extra
    from lm_eval.api.model import LM  # noqa: F401
    from lm_eval.api.registry import register_model
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("unifusion.eval.harness needs EleutherAI's lm-evaluation-harness: "
                      "pip install \"unifusion[eval]\" (or pip install lm-eval)") from err

from ._args import MODEL_ARGS
from ._cli import cli_main
from ._common import request_seed
from ._model import UnifusionLM

register_model("unifusion")(UnifusionLM)

__all__ = ["MODEL_ARGS", "UnifusionLM", "cli_main", "request_seed"]
