"""The harness model class :class:`UnifusionLM`: its constructor (model, tokenizer, kernel, model arguments), data
parallelism and the harness API around the request types (``_loglikelihood``, ``_generation``)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, cast

import torch
from lm_eval.api.model import LM

from ... import _validation as V
from ..._kernel_config import default_kernel, make_kernel, warn_if_not_recorded_kernel
from ...denoiser import DenoiserModule
from ...hf.ar.model import DiffusionLM
from ...hf.loading import dtype_from_name
from ...hf.registry import load_registered, registered_model_type
from ...kernels import Kernel
from . import _distributed
from ._args import (
    FALLBACK_MAX_LENGTH,
    METHODS,
    MODEL_ARGS,
    POSITION_KEYS,
    SEEDINGS,
    as_batch_size,
    as_bool,
    as_int,
    as_temperature,
    as_top_k,
    as_top_p,
)
from ._common import evaluating
from ._conditional import ConditionalRequests, is_prefix_conditioned
from ._generation import GenerationRequests, check_decoding_for_model, decoding_options
from ._loglikelihood import LoglikelihoodRequests


class UnifusionLM(ConditionalRequests, LoglikelihoodRequests, GenerationRequests, LM):
    """lm-evaluation-harness model for a :class:`~unifusion.DiffusionLM`, or a native diffusion LM of
    :mod:`unifusion.hf.registry` (DiffusionGemma) (see :mod:`unifusion.eval.harness`).

    Args:
        pretrained: a folder written by ``DiffusionLM.save_pretrained``, or a checkpoint folder of a registered
            native diffusion LM (a DiffusionGemma folder, plain or written by ``DiffusionGemmaLM.save_pretrained``),
            loaded through the registry (its tokenizer is loaded from the same folder unless ``tokenizer`` is given).
        model: a live ``DiffusionLM`` or ``DiffusionGemmaLM`` instead of ``pretrained`` (periodic evaluation in a
            training script).
        tokenizer: a tokenizer object, or a folder to load one from.
        kernel: ``"mask"`` or ``"uniform"``, or a :class:`~unifusion.Kernel`; default: the library's one rule,
            :func:`unifusion.hf.default_kernel` (the kernel recorded with the model by ``save_pretrained``, else
            mask when the model has a mask token, else uniform). Checked against the model (states, mask token) here.
        method: ``"score"`` (K = 32, the paper's protocol; the default) or ``"fair_pmi"`` (K = 128) for
            ``loglikelihood``.
        fair_pmi: ``True`` is ``method="fair_pmi"``, ``False`` is ``method="score"`` (strings ``"True"``/``"false"``
            from the command line work too).
        num_times: K of ``method`` (default: 32 for score, 128 for fair_pmi).
        null_context: Fair-PMI's answer-only context.
        check_greedy: compute ``is_greedy`` of ``loglikelihood`` (one extra model row per answer); ``False`` returns
            ``False`` without it.
        nll_times: stratified times of ``loglikelihood_rolling``'s bound (default 128).
        max_length: longest context + answer (``loglikelihood``), prompt + new tokens (``generate_until``) and
            rolling window, in tokens; default and maximum: the model's position limit (``max_position_embeddings``
            or the like in its config) − 1 for the BOS position the adapter prepends (2048 when the config names
            none). Contexts and prompts are cut from the left, with a warning that counts them.
        max_gen_toks: cap on the new tokens of a ``generate_until`` request (default: none, so the task's
            ``max_gen_toks``, else 256). The sampler fills the whole canvas at every step, so its cost grows with it.
        num_steps: sampler steps of ``generate_until`` (default 64); with a ``policy``, steps per block (default:
            the block size).
        policy: ``generate_until``'s decoding policy by name (:class:`~unifusion.eval.harness.DecodingOptions`);
            ``None`` keeps the Bayesian sampler.
        block_size: block size of policy decoding (default: the model's).
        threshold: the confidence threshold of the ``"threshold"`` policy.
        cache_refresh: Fast-dLLM's approximate prefix cache for bidirectional models, refreshed every this many
            steps (``None``: the exact path).
        merge_commits: with a policy on a block model, run each finished block within the next block's first step
            (one forward fewer per block, the same tokens).
        do_sample: sample (at ``temperature``) when a task's ``gen_kwargs`` set neither ``do_sample`` nor a
            temperature; default ``False`` (argmax x_θ, the harness's convention).
        temperature: sampling temperature when the task's ``gen_kwargs`` set none.
        top_p: nucleus mass of sampling (``None``: off) when the task's ``gen_kwargs`` set none.
        top_k: top-k of sampling (``None`` or 0: off) when the task's ``gen_kwargs`` set none.
        seed: seeds every request's random numbers (see :mod:`unifusion.eval.harness`).
        seeding: ``"request"`` (default: a generator per request from :func:`request_seed`) or ``"task"`` (one
            stream per task, ``run_multiple_choice``'s numbers; one process only).
        batch_size: rows per forward pass of the scorers and prompts per sampler batch (the harness's
            ``--batch_size``; ``auto`` means 64).
        max_batch_size: accepted for the harness's ``--max_batch_size`` (unused: the scorers batch by rows).
        device: where to run (``"cuda"``, ``"cpu"``, ...); default: a live model stays where it is, a checkpoint
            goes to ``cuda`` when available, else the CPU. Under ``torchrun`` each process takes
            ``cuda:LOCAL_RANK``.
        dtype: weights' dtype (``"bfloat16"``, ``torch.float32``, ...); default (or ``"auto"``): the saved one (a
            live model is converted in place, so leave it unset for a model that is still training).
    """

    def __init__(self, pretrained: str | None = None, *, model: DenoiserModule | None = None, tokenizer: Any = None,
                 kernel: str | Kernel | None = None, method: str | None = None, fair_pmi: Any = None,
                 num_times: Any = None, null_context: str = "Answer:", check_greedy: Any = True,
                 nll_times: Any = 128, max_length: Any = None, max_gen_toks: Any = None, num_steps: Any = None,
                 do_sample: Any = False, temperature: Any = 1.0, top_p: Any = None, top_k: Any = None,
                 seed: Any = 0, seeding: str = "request", batch_size: Any = 64, max_batch_size: Any = None,
                 device: str | None = None, dtype: str | torch.dtype | None = None, policy: Any = None,
                 block_size: Any = None, threshold: Any = None, cache_refresh: Any = None, merge_commits: Any = False,
                 **unused: Any) -> None:
        super().__init__()
        if unused:
            raise TypeError(f"model_args: unknown argument(s) {sorted(unused)}; the arguments are "
                            f"{[name for name, _, _ in MODEL_ARGS] + ['model']}")
        if (pretrained is None) == (model is None):
            raise ValueError("pretrained: give exactly one of pretrained=DIR (a saved DiffusionLM) and model= (a live "
                             "DiffusionLM)")
        if model is not None and not (isinstance(model, DiffusionLM) or is_prefix_conditioned(model)):
            raise TypeError(f"model: expected a unifusion DiffusionLM or a wrapped diffusion LM "
                            f"(unifusion.hf.wrap_diffusion_lm), got {type(model).__name__}")
        if dtype == "auto":  # the harness's hf-model habit: keep the saved dtype
            dtype = None
        if dtype is not None and not isinstance(dtype, (str, torch.dtype)):
            raise TypeError(f"dtype: expected a name such as 'bfloat16' or a torch.dtype, got {type(dtype).__name__}")
        torch_dtype = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
        if seeding not in SEEDINGS:
            raise ValueError(f"seeding: expected one of {SEEDINGS}, got {seeding!r}")
        self.seeding = seeding
        device, self._rank, self._world_size = _distributed.join_processes(device, model)
        if self._world_size > 1:
            self.accelerator = _distributed.Collectives(self.all_gather, self.barrier)
        if pretrained is not None and registered_model_type(pretrained) is not None:
            # a registered family's wrapper: a Denoiser that is a module (DiffusionGemmaLM), as the harness needs
            model = cast(DenoiserModule, load_registered(pretrained, dtype=torch_dtype, device=device))
        elif pretrained is not None:
            model = DiffusionLM.from_pretrained(pretrained, dtype=torch_dtype, device=device)
        elif model is not None:
            if device is not None:
                model = model.to(device)
            if torch_dtype is not None:
                model = model.to(torch_dtype)
        assert model is not None  # exactly one of pretrained and model (checked above)
        self.model = model
        self.conditional = is_prefix_conditioned(model)
        self.tokenizer = self._tokenizer(tokenizer, pretrained)
        self.kernel = self._kernel(kernel)
        V.check_model_kernel(self.model, self.kernel)  # a wrong mask id fails here, not at the first request
        if method is not None and method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
        if fair_pmi is not None:
            wanted = "fair_pmi" if as_bool("fair_pmi", fair_pmi) else "score"
            if method is not None and method != wanted:
                raise ValueError(f"fair_pmi: {fair_pmi!r} contradicts method={method!r}; give one of the two")
            method = wanted
        self.method = method if method is not None else "score"
        if self.conditional and self.method != "score":
            raise ValueError(f"method: {type(model).__name__} scores a continuation by the conditional bound on "
                             f"-log p(continuation | context); method={self.method!r} does not apply to it")
        self.num_times = as_int("num_times", num_times if num_times is not None else
                                (32 if self.method == "score" else 128))
        self.null_context = str(null_context)
        self.check_greedy = as_bool("check_greedy", check_greedy)
        self.nll_times = as_int("nll_times", nll_times)
        self.model_max_length = self._position_limit()
        self.max_length = self.model_max_length if max_length is None else as_int("max_length", max_length,
                                                                                  minimum=2)
        if self.max_length > self.model_max_length:
            raise ValueError(f"max_length: {self.max_length} exceeds what the model takes: "
                             f"{self.model_max_length} tokens (its position limit minus the BOS position the adapter "
                             "prepends)")
        self.max_gen_toks = None if max_gen_toks is None else as_int("max_gen_toks", max_gen_toks)
        self.num_steps = 64 if num_steps is None else as_int("num_steps", num_steps)
        self.decoding = decoding_options(policy, block_size, threshold, cache_refresh,
                                         None if num_steps is None else self.num_steps, merge_commits=merge_commits)
        if self.decoding.merge_commits and getattr(self.model, "block_size", None) is None:
            raise ValueError("merge_commits: merges commits into a block model's exact cache; this model has no "
                             "block_size (adapt_ar_model(..., block_size=K))")
        if self.conditional and self.decoding.policy is not None:
            raise ValueError(f"policy: {type(model).__name__} samples with its own sampler (generate_until uses its "
                             "generate); leave policy, block_size, threshold and cache_refresh unset")
        if not self.conditional:  # what generate_until would refuse, before any task runs
            check_decoding_for_model(self.decoding, self.model, self.kernel)
        self.do_sample = as_bool("do_sample", do_sample)
        self.temperature = as_temperature(temperature)
        if self.temperature == 0.0:
            raise ValueError("temperature: expected > 0 (the model's sampling temperature); for argmax decoding "
                             "use do_sample=false")
        self.top_p = as_top_p(top_p)
        self.top_k = as_top_k(top_k)
        self.seed = as_int("seed", seed, minimum=0)
        self.batch_size_per_forward = as_batch_size(batch_size)
        if self.seeding == "task" and self._world_size > 1:
            raise ValueError(f"seeding: 'task' streams one generator through a task's documents in order, which needs "
                             f"all of them in one process; with {self._world_size} processes use seeding=request "
                             "(the default)")

    # ------------------------------------------------------------------------------------------------ setup
    def _tokenizer(self, tokenizer: Any, pretrained: str | None) -> Any:
        from transformers import AutoTokenizer

        if tokenizer is None:
            tokenizer = getattr(self.model, "tokenizer", None)
        if tokenizer is None and pretrained is not None:
            tokenizer = pretrained
        if isinstance(tokenizer, (str, Path)):
            try:
                return AutoTokenizer.from_pretrained(str(tokenizer))
            except (OSError, ValueError) as err:
                raise ValueError(f"tokenizer: no tokenizer found in {str(tokenizer)!r} (save it with "
                                 f"model.save_pretrained(dir, tokenizer=tok) or pass tokenizer=PATH): {err}") from None
        if tokenizer is None or not callable(tokenizer):
            raise ValueError("tokenizer: none given and none saved with the model; pass tokenizer= (an object or a "
                             "folder)")
        return tokenizer

    def _kernel(self, kernel: str | Kernel | None) -> Kernel:
        """``kernel=`` as a :class:`~unifusion.Kernel`: a Kernel as given, ``"mask"``/``"uniform"`` on the model's
        states, ``None`` by :func:`unifusion.hf.default_kernel` (the recorded kernel, else mask, else uniform)."""
        if kernel is None:
            return default_kernel(self.model)[0]
        if not isinstance(kernel, Kernel):
            if kernel not in ("mask", "uniform"):
                raise ValueError(f"kernel: expected 'mask', 'uniform' or a unifusion Kernel, got {kernel!r}")
            kernel = make_kernel(kernel, self.model.num_states, self.model.mask_token_id)
        warn_if_not_recorded_kernel(self.model, kernel)
        return kernel

    def _position_limit(self) -> int:
        """Tokens the model takes after the BOS the adapter prepends: its config's position limit − 1."""
        config: Any = getattr(self.model, "config", None)
        if callable(getattr(config, "get_text_config", None)):
            config = config.get_text_config()
        for key in POSITION_KEYS:
            limit = getattr(config, key, None)
            if isinstance(limit, int) and not isinstance(limit, bool) and limit > 1:
                return limit - 1
        return FALLBACK_MAX_LENGTH

    # ------------------------------------------------------------------------------------------------ requests
    @evaluating
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(−score, is_greedy)`` per request (:meth:`LoglikelihoodRequests.loglikelihood`); a native diffusion LM:
        ``(−conditional bound, is_greedy)`` (:mod:`unifusion.eval.harness._conditional`)."""
        if self.conditional:
            return self._conditional_loglikelihood(requests, disable_tqdm)
        return super().loglikelihood(requests, disable_tqdm)

    @evaluating
    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """−(the bound on −log p_θ(text)) per request (:meth:`LoglikelihoodRequests.loglikelihood_rolling`; a native
        diffusion LM: each window given BOS)."""
        if self.conditional:
            return self._conditional_rolling(requests, disable_tqdm)
        return super().loglikelihood_rolling(requests, disable_tqdm)

    def _sample(self, prompts: torch.Tensor, max_new: int, generators: Any, *, temperature: float,
                top_k: int | None, top_p: float | None, decoding: Any = None) -> torch.Tensor:
        if self.conditional:  # the model's own sampler (its temperature schedule; no top-k/top-p)
            return self._conditional_sample(prompts, max_new, generators)
        return super()._sample(prompts, max_new, generators, temperature=temperature, top_k=top_k, top_p=top_p,
                               decoding=decoding)

    # ------------------------------------------------------------------------------------------------ harness API
    @property
    def device(self) -> torch.device:
        """Where the model runs (the harness's evaluator puts its collective tensors here)."""
        return self.model.device

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor``, concatenated along dim 0 (0-d tensors stacked)."""
        return _distributed.all_gather(tensor, self._world_size)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every process's ``obj`` on rank ``dst`` (``None`` elsewhere)."""
        return _distributed.gather_object(obj, self._rank, self._world_size, dst)

    def barrier(self) -> None:
        _distributed.barrier(self._world_size)

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's name (the harness keys its request cache by it when chat templates are applied)."""
        return str(getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The tokenizer's chat template (``chat_template`` names one of several), ``None`` when not applied."""
        if chat_template is False or chat_template is None:
            return None
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"apply_chat_template: the tokenizer ({self.tokenizer_name!r}) has no chat template; "
                             "evaluate without --apply_chat_template, or give a tokenizer that has one "
                             "(tokenizer=PATH)")
        if isinstance(template, dict):
            name = "default" if chat_template is True else str(chat_template)
            if name not in template:
                raise ValueError(f"apply_chat_template: no template {name!r} in the tokenizer's "
                                 f"{sorted(template)}")
            return str(template[name])
        return str(template)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the tokenizer's chat template renders it (text, special tokens included; the requests'
        text is then tokenized without adding special tokens). ``add_generation_prompt=False`` continues the last
        (assistant) message instead of opening a new one."""
        self.chat_template(True)  # a clear error when there is no template
        try:
            return str(self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt,
                                                          continue_final_message=not add_generation_prompt))
        except Exception as err:  # jinja's TemplateError: templates that reject a system message
            if not any(m.get("role") == "system" for m in chat_history) or "system" not in str(err).lower():
                raise
            warnings.warn(f"apply_chat_template: the chat template rejected the system message ({err}); applying it "
                          "without", stacklevel=2)
            history = [m for m in chat_history if m.get("role") != "system"]
            return str(self.tokenizer.apply_chat_template(history, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt,
                                                          continue_final_message=not add_generation_prompt))
