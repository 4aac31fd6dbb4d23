"""unifusion.integrations.trl's GRPO: TRL's GRPOTrainer on the diffusion likelihood, on tiny random models whose
causal paths raise.

* two trainer steps pass on a model whose causal-LM forward, causal (γ = 0) forward, causal LM loss and
  transformers' ``generate`` all raise, while TRL's own log-prob method does hit that guard: no TRL code path
  computed autoregressive log-probs or generated autoregressively;
* every method the subclass overrides exists on the pinned TRL's ``GRPOTrainer`` with the parameters TRL passes,
  and is called during a step (a TRL rename would otherwise silently bypass the override), and the installed TRL is
  inside the ``[trl]`` extra's pin;
* the loss of each step equals ``grpo_loss`` on ``sequence_logprob`` estimates computed by hand (old policy =
  the weights at the rollout, reference = the initial weights, current = the weights at the step) on the same batch
  and row seeds; the old log-probs equal the current ones at the first iteration (ratio 1); the advantages are
  ``group_advantages`` of the rewards.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import trl
from datasets import Dataset
from packaging.requirements import Requirement
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

import unifusion as uf
from unifusion.denoiser import unwrap_model
from unifusion.integrations.trl import ROLLOUT_SALT, ROW_SEED, TRL_OVERRIDES, DiffusionGRPOConfig, DiffusionGRPOTrainer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _hf_tiny import tiny_diffusion_gemma, tiny_model, tiny_native  # noqa: E402

G = 2  # completions per prompt
PROMPTS = [{"prompt": "the cat and the dog"}, {"prompt": "a bird"}]


def mean_id(completion_ids, **_):
    """A trivial reward with no ties in practice: the completion's mean token id / 128."""
    return [sum(ids) / (128.0 * len(ids)) for ids in completion_ids]


def forbid_causal(model: uf.DiffusionLM) -> uf.DiffusionLM:
    """Make every autoregressive path of ``model`` raise: a causal-LM call on the wrapper (``input_ids=``,
    ``labels=``, TRL's ``fused_lm_head=``, ``logits_to_keep=``), its causal forward (``bidirectional_prob=0``), the
    backbone's causal LM loss (``labels=``) and transformers' ``generate``. The diffusion paths are unchanged."""
    hf = model.hf_model
    hf_cls = type(hf)

    @functools.wraps(hf_cls.forward)
    def hf_forward(self, *args, **kwargs):
        if kwargs.get("labels") is not None:
            raise AssertionError("the backbone's causal LM loss (labels=) was computed")
        return hf_cls.forward(self, *args, **kwargs)

    def hf_generate(self, *args, **kwargs):
        raise AssertionError("transformers' causal generate was called")

    hf.__class__ = type(f"NoCausal{hf_cls.__name__}", (hf_cls,), {"forward": hf_forward, "generate": hf_generate})
    lm_cls = type(model)

    def forward(self, *args, **kwargs):
        causal = {"input_ids", "labels", "fused_lm_head", "logits_to_keep"} & set(kwargs)
        if causal:
            raise AssertionError(f"a causal-LM call on the policy ({sorted(causal)})")
        gamma = kwargs.get("bidirectional_prob", 1.0)
        if isinstance(gamma, (int, float)) and gamma == 0:
            raise AssertionError("the causal (bidirectional_prob=0) forward was called")
        return lm_cls.forward(self, *args, **kwargs)

    model.__class__ = type(f"NoCausal{lm_cls.__name__}", (lm_cls,), {"forward": forward})
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return PreTrainedTokenizerFast.from_pretrained(ROOT / "tests" / "data" / "tiny_tokenizer")


def make_trainer(tmp_path, tokenizer, *, block_size: int | None = 4, **config) -> DiffusionGRPOTrainer:
    model = forbid_causal(uf.adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=block_size,
                                            tokenizer=tokenizer))
    options = dict(max_steps=2, per_device_train_batch_size=4, num_generations=G, max_completion_length=8,
                   report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, learning_rate=1e-2,
                   gradient_checkpointing=False, beta=0.1, num_iterations=2, loss_type="grpo", seed=3,
                   decoding_policy="low_confidence", num_steps=2, use_bias_correction_kl=False)
    options.update(config)
    args = DiffusionGRPOConfig(str(tmp_path), **options)
    return DiffusionGRPOTrainer(model, reward_funcs=mean_id, args=args,
                                train_dataset=Dataset.from_list(PROMPTS * 4), processing_class=tokenizer)


def spy(trainer, name: str, calls: Counter, record: list | None = None) -> None:
    """Count the calls of ``trainer.<name>`` (an instance attribute shadows the class's, as TRL calls
    ``self.<name>(...)``); with ``record``, keep each ``_compute_loss`` call's inputs, loss and weights."""
    method = getattr(trainer, name)

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        calls[name] += 1
        if record is None:
            return method(*args, **kwargs)
        model, inputs = args
        weights = copy.deepcopy(unwrap_model(model))
        loss = method(*args, **kwargs)
        record.append((inputs, loss.detach(), weights))
        return loss

    setattr(trainer, name, wrapped)


def test_two_steps_pass_with_every_causal_path_raising(tmp_path, tokenizer) -> None:
    trainer = make_trainer(tmp_path, tokenizer)
    model = trainer.model
    ids = torch.tensor([[4, 5, 6, 7]])
    with pytest.raises(AssertionError, match="causal-LM call"):
        model(input_ids=ids, labels=ids)
    with pytest.raises(AssertionError, match="bidirectional_prob=0"):
        model(ids, bidirectional_prob=0.0)
    with pytest.raises(AssertionError, match="causal generate"):
        model.hf_model.generate(ids)
    # TRL's own log-prob method takes the causal path, and the guard catches it (GRPOTrainer's fused-head patch on
    # the policy's forward was removed again)
    with pytest.raises(AssertionError, match="causal-LM call"):
        GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, torch.ones_like(ids), 2)

    before = model.lm_head_weight.detach().clone()
    result = trainer.train()
    assert result.global_step == 2
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(before, model.lm_head_weight)  # the steps trained the policy
    assert any(log.get("reward_std", 0) > 0 for log in trainer.state.log_history)  # a real learning signal


def test_the_docs_recipe_trains_two_steps_at_trl_defaults(tmp_path, tokenizer) -> None:
    """The module docstring's recipe, sized down, every other option at DiffusionGRPOConfig's and GRPOConfig's
    defaults (gradient checkpointing on: TRL re-enables it around each rollout with a positional argument)."""
    model = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=4, tokenizer=tokenizer)
    args = DiffusionGRPOConfig(str(tmp_path), estimator="elbo", num_samples=2, decoding_policy="low_confidence",
                               num_generations=2, max_completion_length=8, beta=0.04,
                               max_steps=2, per_device_train_batch_size=2, report_to=[])
    default = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}["gradient_checkpointing"]
    assert default is True and args.gradient_checkpointing is True
    assert args.bf16 == (uf.precision.auto_dtype("cpu") == torch.bfloat16)  # no GPU here: the CPU's choice
    assert args.use_cpu == args.bf16  # bf16 on a GPU-less machine: transformers needs use_cpu said
    trainer = DiffusionGRPOTrainer(model, reward_funcs=[mean_id], args=args,
                                   train_dataset=Dataset.from_list(PROMPTS * 2), processing_class=tokenizer)
    assert trainer.train().global_step == 2
    assert model.is_gradient_checkpointing  # the trainer turned it on; TRL off for the rollouts and on again


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu_only", "other_accelerator"])
def test_bf16_left_unset_follows_a_cpu_with_native_bf16(monkeypatch, tmp_path, accelerator) -> None:
    """No CUDA and a CPU that computes bf16 natively (AVX512-BF16, AMX): ``bf16=None`` picks bf16 and sets ``use_cpu``
    (transformers refuses bf16 without a GPU otherwise: TRL's defaults crashed there); with another accelerator
    present (MPS, XPU) it picks float32 and leaves ``use_cpu`` alone, so the run stays on that device. Explicit
    choices are kept."""
    monkeypatch.setattr(uf.precision, "native_bf16", lambda device="cpu": True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: accelerator)
    common = dict(num_generations=2, max_completion_length=8, per_device_train_batch_size=2, report_to=[])
    args = DiffusionGRPOConfig(str(tmp_path), **common)
    assert (args.bf16, args.use_cpu) == ((False, False) if accelerator else (True, True))
    explicit = DiffusionGRPOConfig(str(tmp_path), bf16=False, **common)
    assert (explicit.bf16, explicit.use_cpu) == (False, False)


def test_bf16_is_the_precision_of_the_likelihood_passes_only(tmp_path, tokenizer) -> None:
    """What ``bf16=True`` changes in this trainer (docs/guides/rl.md, "bf16"): accelerate's autocast wraps the
    policy's forward, which only the likelihood passes call; the rollouts (``generate``) compute in the weights'
    dtype. So ``bf16=False`` gives float32 log-probs and changes nothing else."""
    trainer = make_trainer(tmp_path, tokenizer, bf16=True, max_steps=1)
    linear = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))
    phase, seen = ["likelihood"], Counter()
    linear.register_forward_hook(lambda module, inputs, output: seen.update([(phase[0], output.dtype)]))
    rollout = trainer._generate_single_turn

    def tagged(*args, **kwargs):
        phase[0] = "rollout"
        try:
            return rollout(*args, **kwargs)
        finally:
            phase[0] = "likelihood"

    trainer._generate_single_turn = tagged
    trainer.train()
    assert seen[("rollout", torch.float32)] > 0 and seen[("likelihood", torch.bfloat16)] > 0
    assert set(seen) == {("rollout", torch.float32), ("likelihood", torch.bfloat16)}


def test_overrides_exist_on_the_pinned_trl_and_are_called(tmp_path, tokenizer) -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    line = re.search(r"^trl = \[(.*)\]$", pyproject, re.M)  # the [trl] extra
    assert line is not None
    pin = next(Requirement(r) for r in re.findall(r'"([^"]+)"', line.group(1)) if Requirement(r).name == "trl")
    assert pin.specifier.contains(trl.__version__), f"trl {trl.__version__} is outside the [trl] pin {pin}"
    pins = {Requirement(r).specifier for r in re.findall(r'"(trl[<>=~!][^"]*)"', pyproject)}
    assert pins == {pin.specifier}  # [trl] and [dev] pin TRL alike
    assert not re.search(r"^rl = ", pyproject, re.M)  # one TRL extra

    own = {name for name, value in vars(DiffusionGRPOTrainer).items()
           if callable(value) and name != "__init__" and hasattr(GRPOTrainer, name)}
    assert own == set(TRL_OVERRIDES)  # every override is in the list the spies below check
    for name in TRL_OVERRIDES:
        theirs = inspect.signature(getattr(GRPOTrainer, name)).parameters
        ours = inspect.signature(getattr(DiffusionGRPOTrainer, name)).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values())
        missing = [p for p in theirs if p not in ours and not takes_any]
        assert not missing, f"GRPOTrainer.{name} has parameters {missing} that the override does not take"

    # mask_truncated_completions: the tiny model's completions end without EOS, so TRL masks every row out; the
    # step must still run (and back-propagate) through the override
    trainer = make_trainer(tmp_path, tokenizer, mask_truncated_completions=True)
    calls: Counter = Counter()
    for name in TRL_OVERRIDES:
        spy(trainer, name, calls)
    trainer.train()
    # one rollout batch scored twice (old and reference policy), two loss steps (current policy)
    assert calls == Counter({"_generate_and_score_completions": 1, "_generate_single_turn": 1,
                             "_get_per_token_logps_and_entropies": 4, "_compute_loss": 2})
    assert [log["loss"] for log in trainer.state.log_history if "loss" in log] == [0.0, 0.0]  # all rows masked


def _as_generated(inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's rows as generate returned them: ``[left-padded prompt | completion]`` (cut after its EOS): ids,
    completion mask, attention mask. Nothing is moved."""
    prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
    ids = torch.cat([prompt, completion], 1)
    scored = torch.cat([torch.zeros_like(prompt, dtype=torch.bool), inputs["completion_mask"].bool()], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    return ids, scored, attention


@pytest.mark.parametrize("block_size, config", [
    (4, dict(estimator="elbo", num_samples=2)),
    (None, dict(estimator="coupled", token_logps="spread", decoding_policy=None, num_steps=4)),
], ids=["block-elbo-per_token", "coupled-spread"])
def test_each_step_loss_is_grpo_loss_of_sequence_logprob(tmp_path, tokenizer, block_size, config) -> None:
    trainer = make_trainer(tmp_path, tokenizer, block_size=block_size, **config)
    args = trainer.args
    reference = copy.deepcopy(unwrap_model(trainer.ref_model))
    rollouts: list = []
    original = trainer._generate_and_score_completions

    def keep(inputs):
        out = original(inputs)
        rollouts.append(out)
        return out

    trainer._generate_and_score_completions = keep
    records: list = []
    spy(trainer, "_compute_loss", Counter(), records)
    trainer.train()
    assert len(rollouts) == 1 and len(records) == 2

    # the advantages are GRPO's group advantages of the rewards (before TRL shuffles the batch)
    out = rollouts[0]
    rewards = torch.tensor(mean_id([c[m.bool()].tolist() for c, m in zip(out["completion_ids"],
                                                                             out["completion_mask"])]))
    assert rewards.std() > 0
    torch.testing.assert_close(out["advantages"], uf.rl.group_advantages(rewards, G))

    old_policy = records[0][2]  # the weights at the rollout (the first step's, before its update)
    # the rows are what the policy's own generate returns for each row's rollout seed, in generate's layout
    inputs = records[0][0]
    P = inputs["prompt_ids"].shape[1]
    for b in range(len(inputs[ROW_SEED])):
        gen = torch.Generator().manual_seed(int(inputs[ROW_SEED][b]) ^ ROLLOUT_SALT)
        with torch.no_grad():
            again = old_policy.generate(
                inputs["prompt_ids"][b:b + 1], attention_mask=inputs["prompt_mask"][b:b + 1],
                max_new_tokens=args.max_completion_length, policy=trainer._policy, num_steps=args.num_steps,
                generator=[gen], eos_token_id=list(trainer.eos_token_ids), pad_token_id=tokenizer.pad_token_id)
        n = int(inputs["completion_mask"][b].sum())
        assert torch.equal(again[0, P:P + n], inputs["completion_ids"][b, :n])
    assert any(int(m.sum()) % 4 for m in inputs["prompt_mask"])  # prompts whose length is not a multiple of K
    for step, (inputs, loss, policy) in enumerate(records):
        ids, scored, attention = _as_generated(inputs)

        def score(model, inputs=inputs, ids=ids, scored=scored, attention=attention):
            gens = [torch.Generator().manual_seed(int(s)) for s in inputs[ROW_SEED]]
            with torch.no_grad():
                est = uf.rl.sequence_logprob(model, ids, scored, estimator=args.estimator,
                                             num_samples=args.num_samples, generator=gens,
                                             attention_mask=attention)
            if args.token_logps == "spread":
                return torch.where(scored, (est.sequence / scored.sum(-1))[:, None], torch.zeros(()))
            return est.per_token

        current, old, ref = score(policy), score(old_policy), score(reference)
        expected = uf.rl.grpo_loss(current, old, inputs["advantages"], scored, ref_logps=ref, kl_coef=args.beta,
                                   epsilon=args.epsilon, normalization="grpo").sum()
        torch.testing.assert_close(loss, expected)
        # TRL's old log-probs (computed at the rollout) are the hand estimates at TRL's completion positions
        trl_old = inputs["old_per_token_logps"]
        completion = inputs["completion_mask"].bool()
        torch.testing.assert_close(trl_old[completion], old[scored])
        if step == 0:
            torch.testing.assert_close(current, old)  # the first iteration's ratio is 1: same weights, same masks
        else:
            assert not torch.allclose(current, old)  # the step moved the policy: the ratio and the KL are live
            assert not torch.allclose(current, ref)


def test_bad_options_are_refused_before_any_rollout(tmp_path, tokenizer) -> None:
    def config(**options):
        return DiffusionGRPOConfig(str(tmp_path), num_generations=2, per_device_train_batch_size=2, report_to=[],
                                   use_cpu=True, **options)

    for option, value in [("estimator", "exact"), ("estimator", "trace"), ("num_samples", 0),
                          ("token_logps", "mean"), ("decoding_policy", "beam"), ("use_vllm", True),
                          ("entropy_coef", 0.01), ("top_entropy_quantile", 0.2), ("repetition_penalty", 1.3)]:
        with pytest.raises(ValueError, match=option):
            config(**{option: value})
    with pytest.raises(TypeError, match="model: expected a unifusion model"):
        DiffusionGRPOTrainer(tiny_model("llama"), reward_funcs=mean_id, args=config(), processing_class=tokenizer)
    with pytest.raises(TypeError, match="model: expected a unifusion model"):
        DiffusionGRPOTrainer("HuggingFaceTB/SmolLM2-135M", reward_funcs=mean_id, args=config())
    with pytest.raises(TypeError, match="model: DiffusionGemmaLM.generate does not take the rollout options"):
        DiffusionGRPOTrainer(uf.hf.wrap_diffusion_lm(tiny_diffusion_gemma()), reward_funcs=mean_id, args=config(),
                             processing_class=tokenizer)

    # the model and the TRL features: refused when the trainer is built, before TRL's constructor runs
    block = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=True, block_size=4, tokenizer=tokenizer)
    data = Dataset.from_list(PROMPTS)
    built: list = []
    original = GRPOTrainer.__init__
    try:
        GRPOTrainer.__init__ = lambda *a, **k: built.append(1)  # would be the first thing to run after the checks
        with pytest.raises(ValueError, match="estimator: DiffusionLM with blocks supports estimator='elbo'"):
            DiffusionGRPOTrainer(block, reward_funcs=mean_id, args=config(estimator="coupled"), train_dataset=data)
        for option in ("tools", "rollout_func", "environment_factory", "peft_config", "quantization_config"):
            with pytest.raises(ValueError, match=f"{option}: not supported by DiffusionGRPOTrainer"):
                DiffusionGRPOTrainer(block, reward_funcs=mean_id, args=config(), train_dataset=data,
                                     **{option: [mean_id] if option == "tools" else object()})
        with pytest.raises(ValueError, match="train_dataset: expected a 'prompt' column"):
            DiffusionGRPOTrainer(block, reward_funcs=mean_id, args=config(),
                                 train_dataset=Dataset.from_list([{"question": "a bird"}]))
    finally:
        GRPOTrainer.__init__ = original
    assert not built


def test_unifusion_rl_is_torch_only_and_the_trainers_live_in_one_trl_module() -> None:
    import ast

    imported = set()
    for path in (ROOT.parent / "unifusion" / "rl").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add(("." * node.level) + (node.module or ""))
    assert not {m for m in imported if m.split(".")[0] in ("trl", "transformers", "accelerate", "datasets")
                or "integrations" in m}, imported
    import unifusion.integrations.trl as module

    assert {"DiffusionSFTTrainer", "DiffusionGRPOTrainer", "DiffusionGRPOConfig"} <= set(module.__all__)
    assert not hasattr(uf.rl, "trl")


@pytest.mark.parametrize("kind", ["llada", "dream", "sdar", "lladamoe", "fast_dllm", "llada2"])
def test_two_steps_on_a_released_diffusion_lm_kind(tmp_path, tokenizer, kind) -> None:
    """The trainer on LLaDA / Dream / LLaDA-MoE (unifusion.hf.native kinds, bidirectional, no blocks), SDAR, LLaDA 2
    and Fast-dLLM v2 (block-causal, rollouts through the exact block cache; Fast-dLLM v2 shifted): two steps with the
    ELBO estimator, transformers' generate on the backbone raising (no autoregressive rollout), the policy trained."""
    model = tiny_native(kind, tokenizer)
    hf_cls = type(model.hf_model)

    def hf_generate(self, *args, **kwargs):
        raise AssertionError("transformers' causal generate was called")

    model.hf_model.__class__ = type(f"NoCausal{hf_cls.__name__}", (hf_cls,), {"generate": hf_generate})
    args = DiffusionGRPOConfig(str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=G,
                               max_completion_length=8, report_to=[], use_cpu=True, save_strategy="no",
                               logging_steps=1, learning_rate=1e-2, beta=0.1, seed=3, num_steps=4,
                               decoding_policy="low_confidence", estimator="elbo", num_samples=2)
    trainer = DiffusionGRPOTrainer(model, reward_funcs=mean_id, args=args,
                                   train_dataset=Dataset.from_list(PROMPTS * 4), processing_class=tokenizer)
    before = model.hf_model.lm_head.weight.detach().clone()
    assert trainer.train().global_step == 2
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(before, model.hf_model.lm_head.weight)
