"""TRL's ``GRPOTrainer`` on the diffusion likelihood: rollouts from unifusion's sampler, every log-prob from
:func:`~unifusion.rl.sequence_logprob` (public in :mod:`unifusion.integrations.trl`).

A diffusion LM has no causal ``log p(y_t | y_<t)``, and TRL's ``GRPOTrainer`` computes its log-probs with the causal
forward (a fused causal LM head it patches onto the model) and generates with transformers' or vLLM's causal
``generate``. :class:`DiffusionGRPOTrainer` (tested with TRL 1.16; the ``[trl]`` extra pins ``trl>=1.16,<1.17``)
replaces both and keeps the rest of TRL's trainer — datasets, reward functions, group advantages, the loss types
(``grpo``, ``dapo``, ``dr_grpo``, ``bnpo``, ...), the clip, the k3 KL, ``num_iterations``, logging, data parallelism:

* **Rollouts** (``_generate_single_turn``): the model's own :meth:`~unifusion.DiffusionLM.generate`, with the
  decoding policy, steps, block size and cache of :class:`DiffusionGRPOConfig` (the exact block KV cache of a block
  model by default) and TRL's ``temperature``, ``top_p``, ``top_k``; one generator per row, so a row's rollout does
  not depend on its batch neighbours. The completion ends at its first EOS (kept), like TRL's.
* **Log-probs** (``_get_per_token_logps_and_entropies``, TRL 1.16's one method for the old, reference and current
  policy): :func:`~unifusion.rl.sequence_logprob` with the config's ``estimator``, ``num_samples`` and
  ``estimator_options``. TRL's rows are ``[left-padded prompt | right-padded completion]``, the layout the
  rollout's ``generate`` returned (the completion cut after its EOS); each is scored as it stands.
  ``sequence_logprob``'s draws are each row's own and a block model's blocks are cut where the decoder cut them (from
  the row's first completion column, or its first real token for a ``"sequence_start"`` kind:
  ``Denoiser.block_origin``), so a row's estimate does not depend on its padding or batch.
* **Shared randomness** (``_generate_and_score_completions``, ``_compute_loss``): every rollout row gets a 62-bit
  seed, drawn from ``torch.Generator().manual_seed(args.seed)`` (the same draws on every rank; rank r takes the
  global rows ``[r·B, (r + 1)·B)``), carried with the row through TRL's shuffles and splits as the batch column
  :data:`ROW_SEED`. The old, reference and current estimates of row r use
  ``torch.Generator(device).manual_seed(row_seed[r])``: the same masks and times, so the ratio
  ``π_θ / π_old`` is 1 before the first update (up to float rounding when the batches are chunked differently) and
  carries no mask noise after it. The rollout uses ``manual_seed(row_seed[r] ^ ROLLOUT_SALT)``. Each checkpoint
  saves the seed generator's state (:mod:`unifusion.integrations.checkpoints`), so a resumed run draws the row seeds
  of the run that never stopped; ``save_model`` and ``checkpoint-N`` are the model's ``save_pretrained`` folders.

**TRL's per-token interface.** ``token_logps="per_token"`` (default) hands TRL the estimator's per-token shares
(:attr:`~unifusion.rl.SequenceLogProb.per_token`, which sum to the sequence estimate): TRL's token-level ratios are then
d1's and coupled-GRPO's, and ``importance_sampling_level="sequence"`` gives GSPO's length-normalised sequence ratio
``exp((log π_θ(y) − log π_old(y)) / |y|)``. ``token_logps="spread"`` spreads the sequence estimate evenly, ``log π(y) /
|y|`` at every completion token, so that even token-level ratios are that sequence ratio. Either way TRL's loss is
:func:`~unifusion.rl.grpo_loss` on the same estimates (``loss_type="grpo"``: ``normalization="grpo"``; ``"dapo"``:
``"dapo"`` with the global token count; ``"dr_grpo"``: ``"dr_grpo"`` with ``max_completion_length``) with
``use_bias_correction_kl=False``; TRL's default ``True`` multiplies the k3 term by the importance ratio.
``tests/test_integrations_trl_grpo.py`` checks the ``"grpo"`` case on two trained steps. The likelihood is the model's
at temperature 1 (TRL divides its causal logits by ``temperature``; the diffusion estimators score the model as is),
while the rollouts sample at ``temperature``. A row is scored in TRL's batch width (the padded prompt plus completion
length): the mask estimators of a fully bidirectional model draw over the row's width, which is the same for the old,
reference and current policy.

What is refused (``ValueError`` naming the option, when the config or the trainer is built: :func:`preflight`): an
estimator the model cannot take and ``"trace"`` (the trainer keeps no commit orders), vLLM and transformers'
continuous batching (causal generators), ``tools``, ``environment_factory``, ``rollout_func``, ``peft_config`` and
``quantization_config`` (wrap the backbone with peft before ``adapt_ar_model``), a dataset without a ``"prompt"``
column, the entropy mask and bonus (``top_entropy_quantile``,
``entropy_coef``, ``use_adaptive_entropy``: the estimators give no per-token entropy; the ``entropy`` metric is
NaN), ``cast_lm_head_to_fp32``, ``repetition_penalty`` ≠ 1, ``min_p``, ``generation_kwargs``, a MoE router loss,
multimodal inputs. The reference policy (``beta > 0``) is a frozen copy of the policy at the start (or
``ref_model=``), not a model TRL loads by name; ``sync_ref_model`` works as in TRL. TRL's fused causal head, which
``GRPOTrainer`` patches onto the model's ``forward``, is removed again: a causal-LM call on the policy fails rather
than computing autoregressive log-probs.

Recipe (``pip install "unifusion[trl]"``)::

    from unifusion.integrations.trl import DiffusionGRPOConfig, DiffusionGRPOTrainer

    model = uf.adapt_ar_model(AutoModelForCausalLM.from_pretrained(name), tokenizer=tok, block_size=32)
    args = DiffusionGRPOConfig("out", estimator="elbo", num_samples=2, decoding_policy="low_confidence",
                               num_generations=8, max_completion_length=64, beta=0.04)
    trainer = DiffusionGRPOTrainer(model, reward_funcs=[my_reward], args=args, train_dataset=prompts,
                                   processing_class=tok)
    trainer.train()
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from trl import GRPOConfig, GRPOTrainer, SyncRefModelCallback
from trl.models import prepare_deepspeed, prepare_fsdp, unwrap_model_for_generation

from .. import _validation as V
from ..denoiser import denoiser_of
from ..precision import auto_dtype
from ..rl.estimators import ESTIMATORS
from ..rl.logprob import check_estimator, sequence_logprob
from ..samplers.policies import POLICY_NAMES, make_policy
from .checkpoints import TrainerCheckpoints

__all__ = ["ROLLOUT_SALT", "ROW_SEED", "TRL_OVERRIDES", "DiffusionGRPOConfig", "DiffusionGRPOTrainer", "preflight"]

ROW_SEED = "row_seed"
"""The batch column (``(B,)`` int64, on the CPU) that carries each rollout row's seed through TRL's buffers."""

ROLLOUT_SALT = 0x5DEECE66D
"""Row r's rollout generator is seeded with ``row_seed[r] ^ ROLLOUT_SALT`` (its likelihood generators with
``row_seed[r]``)."""

TRL_OVERRIDES = ("_generate_single_turn", "_get_per_token_logps_and_entropies", "_generate_and_score_completions",
                 "_compute_loss")
"""The ``GRPOTrainer`` methods :class:`DiffusionGRPOTrainer` overrides (private TRL API, hence the pin; the tests
check that the pinned TRL still has and calls each of them)."""

_TOKEN_LOGPS = ("per_token", "spread")


def _has_accelerator() -> bool:
    """Whether torch sees a device other than the CPU (CUDA, MPS, XPU, ...) to train on."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    mps = getattr(torch.backends, "mps", None)
    return torch.cuda.is_available() or bool(mps is not None and mps.is_available())


@dataclass
class DiffusionGRPOConfig(GRPOConfig):
    """TRL's ``GRPOConfig`` plus the diffusion likelihood and decoding options (module docstring).

    ``bf16`` left unset (``None``) follows :func:`unifusion.precision.auto_dtype` of the training device: bf16 mixed
    precision where the device computes bf16 natively, float32 elsewhere (TRL's default, ``True`` unless ``fp16``,
    makes a step several times slower on a CPU without native bf16, and on a GPU-less machine needs ``use_cpu``); on
    a machine without an accelerator whose CPU computes bf16 natively it is bf16 with ``use_cpu=True`` set for
    transformers, which refuses bf16 without a GPU otherwise.
    In this trainer bf16 is the precision of the likelihood passes only (accelerate's autocast wraps the policy's
    forward; the rollouts compute in the weights' dtype), and it moves a token's log-prob by a few hundredths of a
    nat (docs/guides/rl.md, "bf16"): ``bf16=False`` gives float32 log-probs and float32-stable ratios.

    TRL's ``temperature``, ``top_p``, ``top_k`` and ``max_completion_length`` apply to the rollouts; ``beta``,
    ``epsilon``, ``loss_type``, ``importance_sampling_level``, ``num_iterations``, ... to the loss as in TRL.

    The fields beyond ``GRPOConfig``'s:

    Args:
        estimator: the :func:`~unifusion.rl.sequence_logprob` estimator (``"elbo"``, ``"elbo_discrete"``,
            ``"coupled"``, ``"quadrature"``, ``"mean_field"``, ``"eubo"``; a block model takes ``"elbo"``).
        num_samples: its ``num_samples`` K (passes per estimate; the same name as in ``sequence_logprob``).
        estimator_options: its estimator options (``{"t_range": [0.2, 0.8], "fully_masked": True}``, ...).
        token_logps: ``"per_token"`` or ``"spread"`` (module docstring).
        decoding_policy: a policy name of :data:`~unifusion.samplers.policies.POLICY_NAMES` (``"low_confidence"``,
            ``"threshold"``, ...) or ``None``: :meth:`~unifusion.DiffusionLM.generate`'s default (the default policy
            on a block model, the Bayesian sampler on a fully bidirectional one).
        policy_threshold: ``"threshold"``'s confidence (default 0.9).
        policy_bound: ``"entropy_bound"``'s bound (default 1.0).
        num_steps: ``generate``'s ``num_steps`` (steps per block with a policy; ``None``: its default).
        decoding_block_size: ``generate``'s ``block_size`` (a block model decodes with its own).
        use_cache: ``generate``'s ``use_cache`` (the exact block KV cache of a block model).
    """

    estimator: str = field(default="elbo", metadata={"help": f"sequence_logprob estimator, one of {ESTIMATORS}."})
    num_samples: int = field(default=1, metadata={"help": "Monte-Carlo passes K per log-prob estimate."})
    estimator_options: dict[str, Any] | None = field(
        default=None, metadata={"help": "Options of the estimator (sequence_logprob's **options)."})
    token_logps: str = field(default="per_token", metadata={
        "help": "How log-probs meet TRL's per-token interface: 'per_token' (the estimator's per-token shares) or "
                "'spread' (the sequence estimate spread evenly over the completion)."})
    decoding_policy: str | None = field(default=None, metadata={
        "help": f"Rollout decoding policy, one of {POLICY_NAMES}, or None for generate's default."})
    policy_threshold: float | None = field(default=None, metadata={"help": "Confidence of the 'threshold' policy."})
    policy_bound: float | None = field(default=None, metadata={"help": "Bound of the 'entropy_bound' policy."})
    num_steps: int | None = field(default=None, metadata={"help": "generate's num_steps (steps per block)."})
    decoding_block_size: int | None = field(default=None, metadata={"help": "generate's block_size."})
    use_cache: bool = field(default=True, metadata={"help": "generate's use_cache (exact block KV cache)."})

    _VALID_DICT_FIELDS = GRPOConfig._VALID_DICT_FIELDS + ["estimator_options"]

    def _resolve_bf16(self) -> None:
        """``bf16=None``: :func:`~unifusion.precision.auto_dtype` of the device the trainer trains on. On a machine
        with no accelerator whose CPU computes bf16 natively (AVX512-BF16, AMX) that is bf16 on the CPU, which
        transformers' ``TrainingArguments`` refuses unless ``use_cpu`` is set — so it is set (the run is on the CPU
        either way). On an accelerator other than CUDA the choice is float32: ``use_cpu`` would move the run off it."""
        if torch.cuda.is_available() and not self.use_cpu:
            self.bf16 = not self.fp16 and auto_dtype("cuda") == torch.bfloat16
            return
        self.bf16 = not self.fp16 and auto_dtype("cpu") == torch.bfloat16
        if self.bf16 and not self.use_cpu:
            if _has_accelerator():
                self.bf16 = False
            else:
                self.use_cpu = True

    def __post_init__(self) -> None:
        if self.bf16 is None:  # TRL's default is True; bf16 only where the device computes it natively
            self._resolve_bf16()
        super().__post_init__()
        if self.estimator not in ESTIMATORS or self.estimator == "trace":
            raise ValueError(f"estimator: expected one of {tuple(e for e in ESTIMATORS if e != 'trace')} ('trace' "
                             f"needs each rollout's commit order, which the trainer does not keep), got "
                             f"{self.estimator!r}")
        V.check_positive_int("num_samples", self.num_samples)
        if self.estimator_options is not None and not isinstance(self.estimator_options, dict):
            raise TypeError(f"estimator_options: expected a dict or None, got {type(self.estimator_options).__name__}")
        if self.token_logps not in _TOKEN_LOGPS:
            raise ValueError(f"token_logps: expected one of {_TOKEN_LOGPS}, got {self.token_logps!r}")
        if self.decoding_policy is not None:
            make_policy(self.decoding_policy, threshold=self.policy_threshold, bound=self.policy_bound,
                        arg="decoding_policy")
        elif self.policy_threshold is not None or self.policy_bound is not None:
            raise ValueError("decoding_policy: policy_threshold / policy_bound need a named policy, got None")
        for name in ("num_steps", "decoding_block_size"):
            if getattr(self, name) is not None:
                V.check_positive_int(name, getattr(self, name))
        refused = {
            "use_vllm": self.use_vllm,
            "use_transformers_continuous_batching": self.use_transformers_continuous_batching,
            "top_entropy_quantile": self.top_entropy_quantile != 1.0, "entropy_coef": self.entropy_coef != 0.0,
            "use_adaptive_entropy": self.use_adaptive_entropy, "cast_lm_head_to_fp32": self.cast_lm_head_to_fp32,
            "repetition_penalty": self.repetition_penalty != 1.0, "min_p": self.min_p is not None,
            "generation_kwargs": bool(self.generation_kwargs), "use_liger_kernel": self.use_liger_kernel,
        }
        for name, bad in refused.items():
            if bad:
                raise ValueError(f"{name}: not supported by DiffusionGRPOTrainer (rollouts come from unifusion's "
                                 f"sampler, log-probs from sequence_logprob), got {getattr(self, name)!r}; leave it "
                                 "at its default")


_ROLLOUT_OPTIONS = ("attention_mask", "max_new_tokens", "policy", "num_steps", "block_size", "use_cache",
                    "temperature", "top_p", "top_k", "eos_token_id", "pad_token_id", "generator")


def preflight(model: torch.nn.Module | str, args: DiffusionGRPOConfig, *, train_dataset: Any = None,
              ref_model: torch.nn.Module | None = None, **trl_features: Any) -> None:
    """Everything :class:`DiffusionGRPOTrainer` refuses, checked before it builds anything (no rollout has run):

    * ``model``: a unifusion model (a :class:`~unifusion.denoiser.Denoiser` of any kind, inside its wrappers) whose
      ``generate`` takes the rollout options the trainer passes (``TypeError`` naming ``model``); ``ref_model``
      likewise;
    * ``args.estimator`` for this model (:func:`~unifusion.rl.check_estimator`, without traces: the trainer keeps
      none);
    * TRL's features the trainer does not support (``tools``, ``rollout_func``, ``environment_factory``,
      ``peft_config``, ``quantization_config``): a ``ValueError`` naming the option when given;
    * a ``train_dataset`` with column names and no ``"prompt"`` column.

    ``examples/grpo.py`` runs :func:`~unifusion.rl.check_estimator` the same way.
    """
    inner = denoiser_of(model) if not isinstance(model, str) else None
    if inner is None:
        got = repr(model) if isinstance(model, str) else type(model).__name__
        raise TypeError(f"model: expected a unifusion model (adapt_ar_model(...), DiffusionLM.from_pretrained(...), "
                        f"any Denoiser), got {got}")
    accepted = inspect.signature(type(inner).generate).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    missing = [o for o in _ROLLOUT_OPTIONS if o not in accepted and not takes_any]
    if not inner.generate_takes_sampler_options:
        missing = [o for o in _ROLLOUT_OPTIONS if o not in accepted]
    if missing:
        raise TypeError(f"model: {type(inner).__name__}.generate does not take the rollout options {missing} "
                        "DiffusionGRPOTrainer passes (unifusion.samplers.generate's)")
    if ref_model is not None and denoiser_of(ref_model) is None:
        raise TypeError(f"ref_model: expected a unifusion model or None, got {type(ref_model).__name__}")
    check_estimator(inner, args.estimator, traces=False)
    for name, value in trl_features.items():
        if value is not None:
            raise ValueError(f"{name}: not supported by DiffusionGRPOTrainer (rollouts come from the model's own "
                             f"generate, one turn, full weights; wrap the backbone with peft before adapt_ar_model "
                             f"for adapters), got {value!r}")
    columns = getattr(train_dataset, "column_names", None)
    if isinstance(columns, list) and "prompt" not in columns:
        raise ValueError(f"train_dataset: expected a 'prompt' column (TRL's prompt format), got columns {columns}")


class DiffusionGRPOTrainer(TrainerCheckpoints, GRPOTrainer):
    """TRL's ``GRPOTrainer`` with unifusion rollouts and :func:`~unifusion.rl.sequence_logprob` log-probs (module
    docstring).

    Args:
        model: a unifusion model: a :class:`~unifusion.DiffusionLM` (fully bidirectional or a block model) or any
            :class:`~unifusion.denoiser.Denoiser` whose ``generate`` takes :func:`unifusion.samplers.generate`'s
            options (or a DDP / compile wrapper around one, which :func:`~unifusion.denoiser.unwrap_model` looks
            through); a model name, a causal LM or ``DiffusionGemmaLM`` (whose ``generate`` takes other options) is
            a ``TypeError`` (:func:`preflight`).
        reward_funcs: TRL's reward functions (callables or reward models).
        args: a :class:`DiffusionGRPOConfig` (``None``: its defaults with ``output_dir="unifusion-grpo"``).
        train_dataset: TRL's dataset with a ``"prompt"`` column (other columns reach the reward functions).
        eval_dataset: as in ``GRPOTrainer``.
        processing_class: the tokenizer (default the model's :attr:`~unifusion.DiffusionLM.tokenizer`).
        reward_processing_classes: as in ``GRPOTrainer``.
        callbacks: as in ``GRPOTrainer``.
        optimizers: as in ``GRPOTrainer``.
        ref_model: the reference policy for ``beta > 0`` (default a frozen copy of ``model`` as passed).
        tools: TRL's, refused (``ValueError`` naming the option when given, :func:`preflight`).
        rollout_func: TRL's, refused.
        environment_factory: TRL's, refused.
        peft_config: TRL's, refused (wrap the backbone with peft before ``adapt_ar_model``).
        quantization_config: TRL's, refused.
    """

    def __init__(self, model: torch.nn.Module, reward_funcs: Any = None, args: DiffusionGRPOConfig | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 reward_processing_classes: Any = None, callbacks: Any = None,
                 optimizers: tuple[Any, Any] = (None, None), ref_model: torch.nn.Module | None = None,
                 *, tools: Any = None, rollout_func: Any = None, environment_factory: Any = None,
                 peft_config: Any = None, quantization_config: Any = None) -> None:
        if args is None:
            args = DiffusionGRPOConfig("unifusion-grpo")
        if not isinstance(args, DiffusionGRPOConfig):
            raise TypeError(f"args: expected a DiffusionGRPOConfig, got {type(args).__name__}")
        preflight(model, args, train_dataset=train_dataset, ref_model=ref_model, tools=tools,
                  rollout_func=rollout_func, environment_factory=environment_factory, peft_config=peft_config,
                  quantization_config=quantization_config)
        if processing_class is None:
            processing_class = getattr(model, "tokenizer", None)
            if processing_class is None:
                raise ValueError("processing_class: the model has no tokenizer; pass processing_class=tokenizer")
        self._seed_generator = torch.Generator().manual_seed(int(args.seed))
        self._active_row_seeds: torch.Tensor | None = None
        # GRPOTrainer would load the reference by name and patch a causal head onto the model's forward: build it
        # with beta = 0 and no sync (restored at once), make the reference here, and undo the patch.
        beta, sync = args.beta, args.sync_ref_model
        patched = model.__dict__.get("forward")
        args.beta, args.sync_ref_model = 0.0, False
        try:  # TRL types model as str | PreTrainedModel | PeftModel; a DiffusionLM is a module it trains the same way
            super().__init__(model=cast(Any, model), reward_funcs=reward_funcs, args=args,
                             train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                             reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                             optimizers=optimizers)
        finally:
            args.beta, args.sync_ref_model = beta, sync
        if patched is None:
            model.__dict__.pop("forward", None)
        else:
            model.forward = patched
        if self.aux_loss_enabled:
            raise ValueError(f"router_aux_loss_coef: the diffusion log-probs give no MoE router loss; set "
                             f"router_aux_loss_coef=0.0, got {self.router_aux_loss_coef}")
        self.beta = beta
        if beta != 0.0:
            # the reference DiffusionLM inside TRL's DeepSpeed/FSDP/accelerate wrapper, held where TRL keeps its
            # reference (typed PreTrainedModel by TRL): Any, as TRL's prepare_* return types differ from it
            reference: Any = copy.deepcopy(model) if ref_model is None else ref_model
            reference.eval().requires_grad_(False)
            if self.is_deepspeed_enabled:
                reference = prepare_deepspeed(reference, self.accelerator)
            elif self.is_fsdp_enabled:
                reference = prepare_fsdp(reference, self.accelerator)
            else:
                reference = self.accelerator.prepare_model(reference, evaluation_mode=True)
            self.ref_model = reference
            if sync:
                self.add_callback(SyncRefModelCallback(ref_model=self.ref_model, accelerator=self.accelerator))
        elif sync:
            raise ValueError("sync_ref_model: needs beta > 0 (no reference policy is used at beta = 0), got True")
        self._policy = None if args.decoding_policy is None else make_policy(
            args.decoding_policy, threshold=args.policy_threshold, bound=args.policy_bound, arg="decoding_policy")

    # -- shared randomness ------------------------------------------------------------------------------------------

    def extra_checkpoint_state(self) -> dict[str, Any]:
        """The row-seed generator's state, saved with each checkpoint: a resumed run draws the same row seeds (and so
        the same rollouts and masks) as the run that never stopped."""
        return {"row_seed_generator": self._seed_generator.get_state()}

    def load_extra_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Restore the row-seed generator (:meth:`extra_checkpoint_state`)."""
        self._seed_generator.set_state(state["row_seed_generator"])

    def _draw_row_seeds(self, num_rows: int) -> torch.Tensor:
        """``(num_rows,)`` int64 seeds of this rank's rows: one draw of the global batch's seeds (every rank draws
        the same), rank r's slice."""
        ranks, rank = self.accelerator.num_processes, self.accelerator.process_index
        seeds = torch.randint(0, 1 << 62, (num_rows * ranks,), generator=self._seed_generator, dtype=torch.int64)
        return seeds[rank * num_rows:(rank + 1) * num_rows].clone()

    @contextlib.contextmanager
    def _row_seeds(self, seeds: torch.Tensor) -> Iterator[None]:
        """The seeds of the rows that the log-prob and rollout calls inside see."""
        self._active_row_seeds = seeds
        try:
            yield
        finally:
            self._active_row_seeds = None

    def _seeds_for(self, num_rows: int, what: str) -> list[int]:
        seeds = self._active_row_seeds
        if seeds is None:
            raise RuntimeError(f"{what} ran outside a rollout batch or a loss step, so its rows have no seeds: the "
                               "TRL code path that called it is not one DiffusionGRPOTrainer knows (TRL version?)")
        if seeds.shape[0] != num_rows:
            raise RuntimeError(f"{what}: {num_rows} rows, but {seeds.shape[0]} row seeds")
        return [int(s) for s in seeds.tolist()]

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        """TRL's rollout-and-score step with a seed per row (module docstring): the rollouts and the old and
        reference log-probs inside use it, and the batch carries it (:data:`ROW_SEED`) to :meth:`_compute_loss`."""
        seeds = self._draw_row_seeds(len(inputs))
        with self._row_seeds(seeds):
            output = super()._generate_and_score_completions(inputs)
        output[ROW_SEED] = seeds
        return output

    def _compute_loss(self, model: torch.nn.Module, inputs: Any) -> Any:
        """TRL's loss, its current-policy log-probs drawn with the batch's row seeds."""
        if ROW_SEED not in inputs:
            raise ValueError(f"inputs: the batch has no {ROW_SEED!r} column (it comes from "
                             "_generate_and_score_completions)")
        with self._row_seeds(inputs[ROW_SEED]):
            return super()._compute_loss(model, inputs)

    # -- rollouts ---------------------------------------------------------------------------------------------------

    def _generate_single_turn(self, prompt_ids: Any, images: Any, multimodal_fields: Any, num_generations: Any,
                              has_tool_images: bool = False) -> tuple[list[list[int]], None]:
        """The completions of TRL's prompts (lists of ids) from :meth:`~unifusion.DiffusionLM.generate`, each cut
        after its first EOS; no sampling log-probs (TRL's are for vLLM's importance correction)."""
        if images is not None or multimodal_fields or has_tool_images:
            raise ValueError("prompt: DiffusionGRPOTrainer takes text prompts only, got images or multimodal fields")
        seeds = self._seeds_for(len(prompt_ids), "the rollout")
        device = self.accelerator.device
        pad = self._tokenizer.pad_token_id
        B, P = len(prompt_ids), max(len(p) for p in prompt_ids)
        ids = torch.full((B, P), pad, dtype=torch.long)
        attention = torch.zeros((B, P), dtype=torch.long)
        for b, p in enumerate(prompt_ids):
            if len(p):
                ids[b, P - len(p):] = torch.as_tensor(p, dtype=torch.long)
                attention[b, P - len(p):] = 1
        gens = [torch.Generator(device=device).manual_seed(s ^ ROLLOUT_SALT) for s in seeds]
        args = self.args
        assert isinstance(args, DiffusionGRPOConfig)
        with unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                         gather_deepspeed3_params=args.ds3_gather_for_generation) as unwrapped, \
                torch.no_grad():
            out = unwrapped.generate(
                ids.to(device), attention_mask=attention.to(device), max_new_tokens=self.max_completion_length,
                policy=self._policy, num_steps=args.num_steps, block_size=args.decoding_block_size,
                use_cache=args.use_cache, temperature=self.temperature,
                top_p=None if self.top_p is None or self.top_p >= 1.0 else self.top_p,
                top_k=self.top_k or None, eos_token_id=list(self.eos_token_ids), pad_token_id=pad, generator=gens)
        completions = out[:, P:].cpu()
        is_eos = torch.isin(completions, torch.tensor(list(self.eos_token_ids)))
        lengths = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, completions.shape[1])
        return [row[:n].tolist() for row, n in zip(completions, lengths.tolist())], None

    # -- log-probs --------------------------------------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model: torch.nn.Module, input_ids: torch.Tensor,
                                           attention_mask: torch.Tensor, logits_to_keep: int,
                                           batch_size: int | None = None,
                                           compute_entropy: bool = False, compute_aux_loss: bool = False,
                                           **multimodal: Any) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """TRL's ``(per-token log-probs (B, C), entropies, aux loss)`` of the completions (the last ``C =
        logits_to_keep`` columns) from :func:`~unifusion.rl.sequence_logprob` with the rows' seeds (module
        docstring): 0 at padding, entropies NaN (not estimated), no aux loss."""
        if any(v is not None for v in multimodal.values()):
            raise ValueError(f"inputs: DiffusionGRPOTrainer takes text only, got "
                             f"{sorted(k for k, v in multimodal.items() if v is not None)}")
        if compute_aux_loss:
            raise ValueError("router_aux_loss_coef: the diffusion log-probs give no MoE router loss")
        args = self.args
        assert isinstance(args, DiffusionGRPOConfig)
        B, W = input_ids.shape
        seeds = self._seeds_for(B, "the log-prob estimate")
        real = attention_mask.bool()
        scored = real.clone()
        scored[:, :W - logits_to_keep] = False
        # a row without completion tokens (TRL's mask_truncated_completions) is scored on a stand-in (its last real
        # token) and weighted 0: every row still runs through the model, so the loss stays connected to every
        # parameter (the backward of an all-masked batch, DDP's reducer); rows do not affect each other's numbers
        empty = ~scored.any(-1)
        if bool(empty.any()):
            last = W - 1 - torch.argmax(real.flip(-1).to(torch.uint8), dim=-1)  # (B,) each row's last real column
            scored = scored | (torch.zeros_like(scored).scatter(1, last[:, None], True) & empty[:, None])
        chunk = batch_size or B
        options = dict(args.estimator_options or {})
        pieces = []
        for start in range(0, B, chunk):
            rows = slice(start, min(start + chunk, B))
            gens = [torch.Generator(device=input_ids.device).manual_seed(s) for s in seeds[rows]]
            est = sequence_logprob(model, input_ids[rows], scored[rows], estimator=args.estimator,
                                   num_samples=args.num_samples, generator=gens,
                                   attention_mask=real[rows].long(), **options)
            values = est.per_token
            if args.token_logps == "spread":
                mask = scored[rows]
                values = torch.where(mask, (est.sequence / mask.sum(-1))[:, None], values.new_zeros(()))
            pieces.append(values)
        per_token = torch.cat(pieces)
        per_token = torch.where(empty[:, None], per_token * 0.0, per_token)
        logps = per_token[:, W - logits_to_keep:]
        entropies = torch.full_like(logps.detach(), float("nan")) if compute_entropy else None
        return logps, entropies, None
