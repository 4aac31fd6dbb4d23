"""The transformers model methods a trainer calls on unifusion's models (unifusion.hf.backbone).

* The methods are found in the trainers' own source (``model.<name>(`` in transformers' ``Trainer`` and TRL's SFT and
  GRPO trainers and helpers), not listed by hand; every one that is a ``PreTrainedModel`` method exists on
  :class:`~unifusion.DiffusionLM` and :class:`~unifusion.hf.DiffusionGemmaLM` and accepts every call transformers'
  own signature accepts (positional order and names, defaults, ``**kwargs``).
* Gradient checkpointing checkpoints the diffusion forward (the block-causal one included): the tensors kept for the
  backward are fewer, the loss and the gradients the same.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
import transformers
import trl
from _hf_tiny import tiny_diffusion_gemma, tiny_model

import unifusion as uf
from unifusion.denoiser import Denoiser
from unifusion.hf.checkpoint import CheckpointMixin

MASK_ID = 127


def _called_on_models() -> set[str]:
    """``PreTrainedModel`` methods the trainers call as ``model.<name>(...)`` (torch's ``nn.Module`` methods aside)."""
    roots = {Path(transformers.__file__).parent: ["trainer.py"],
             Path(trl.__file__).parent: ["trainer/grpo_trainer.py", "trainer/sft_trainer.py", "trainer/utils.py",
                                         "models/utils.py"]}
    names: set[str] = set()
    for root, files in roots.items():
        for file in files:
            names |= set(re.findall(r"\bmodel\.(\w+)\(", (root / file).read_text()))
    return {n for n in names if callable(getattr(transformers.PreTrainedModel, n, None))
            and not hasattr(torch.nn.Module, n)}


def _accepts(ours: inspect.Signature, theirs: inspect.Signature) -> list[str]:
    """Why a call that ``theirs`` accepts could fail on ``ours`` (empty: none)."""
    P = inspect.Parameter
    problems = []
    o = list(ours.parameters.values())
    t = list(theirs.parameters.values())
    o_var_kw = any(p.kind is P.VAR_KEYWORD for p in o)
    o_var_pos = any(p.kind is P.VAR_POSITIONAL for p in o)
    o_positional = [p for p in o if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    t_positional = [p for p in t if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    for i, p in enumerate(t_positional):
        if i >= len(o_positional):
            if not o_var_pos:
                problems.append(f"positional argument {i} ({p.name}) not taken")
        elif o_positional[i].name != p.name and p.kind is not P.POSITIONAL_ONLY:
            problems.append(f"positional argument {i} is {o_positional[i].name!r}, transformers' is {p.name!r}")
    names = {p.name for p in o if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    for p in t:
        if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and p.name not in names and not o_var_kw:
            problems.append(f"keyword {p.name!r} not taken")
        if p.kind is P.VAR_KEYWORD and not o_var_kw:
            problems.append("**kwargs not taken")
        if p.kind is P.VAR_POSITIONAL and not o_var_pos:
            problems.append("*args not taken")
    t_required = {p.name for p in t if p.default is P.empty and p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    for p in o:
        if p.default is P.empty and p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and p.name not in t_required:
            problems.append(f"{p.name!r} required, optional in transformers")
    return problems


@pytest.mark.parametrize("cls", [uf.DiffusionLM, uf.hf.DiffusionGemmaLM, uf.hf.LLaDALM, uf.hf.DreamLM, uf.hf.SDARLM,
                                 uf.hf.LLaDAMoELM, uf.hf.FastDLLMv2LM, uf.hf.LLaDA2LM],
                         ids=lambda c: c.__name__)
def test_the_methods_trainers_call_take_transformers_signatures(cls) -> None:
    called = _called_on_models()
    assert {"gradient_checkpointing_enable", "enable_input_require_grads", "num_parameters"} <= called
    # unifusion's own interface (save_pretrained: the Denoiser's format) and the adapter API, which the trainers call
    # on peft models only (is_peft_model / active_adapters guards; a unifusion model is never one)
    own = {n for n in called if hasattr(Denoiser, n) or hasattr(CheckpointMixin, n) or n.endswith("_adapter")}
    checked = called - own
    shared = {n for n in dir(transformers.PreTrainedModel) if callable(getattr(transformers.PreTrainedModel, n))
              and not n.startswith("_") and hasattr(cls, n) and not hasattr(torch.nn.Module, n)
              and not hasattr(Denoiser, n) and not hasattr(CheckpointMixin, n)}
    assert checked <= shared, f"{cls.__name__} lacks {sorted(checked - shared)}"
    for name in sorted(shared):
        problems = _accepts(inspect.signature(getattr(cls, name)),
                            inspect.signature(getattr(transformers.PreTrainedModel, name)))
        assert not problems, f"{cls.__name__}.{name}: {problems}"


def _models() -> list:
    return [uf.adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID, block_size=4),
            uf.hf.wrap_diffusion_lm(tiny_diffusion_gemma()),
            uf.load_diffusion_lm(Path(__file__).parent / "llada" / "fixtures" / "checkpoint"),
            uf.load_diffusion_lm(Path(__file__).parent / "lladamoe" / "fixtures" / "checkpoint")]


@pytest.mark.parametrize("which", [0, 1, 2, 3], ids=["DiffusionLM-blocks", "DiffusionGemmaLM", "LLaDALM", "LLaDAMoELM"])
def test_checkpointing_keeps_fewer_tensors_for_the_same_loss_and_gradients(which: int) -> None:
    """Bytes the autograd graph keeps (saved tensors) through one diffusion_loss: fewer with checkpointing (only
    the checkpointed layers' inputs are kept), the same loss and gradients; TRL's positional call and disable work."""
    results = []
    for checkpointing in (False, True):
        model = _models()[which].train()
        x0 = torch.randint(4, min(100, model.num_states - 8), (2, 16), generator=torch.Generator().manual_seed(0))
        kernel = uf.hf.default_kernel(model)[0]
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})  # TRL's positional call
            assert model.is_gradient_checkpointing
        saved = [0]

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved[0] += t.numel() * t.element_size()
            return t

        prompt = torch.zeros_like(x0, dtype=torch.bool)
        prompt[:, :3] = True
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = uf.diffusion_loss(model, x0, kernel, generator=torch.Generator().manual_seed(1),
                                     prompt_mask=prompt).loss.mean()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((saved[0], loss.detach(), grads))
        if checkpointing:
            model.gradient_checkpointing_disable()
            assert not model.is_gradient_checkpointing
    (plain, loss0, g0), (ckpt, loss1, g1) = results
    assert ckpt < 0.8 * plain, (ckpt, plain)
    torch.testing.assert_close(loss1, loss0)
    torch.testing.assert_close(g1, g0)


def test_resize_token_embeddings_keeps_the_mask_token() -> None:
    model = uf.adapt_ar_model(tiny_model("llama"), mask_token_id=MASK_ID)
    model.resize_token_embeddings(136)
    assert model.num_states == 136 and model.get_input_embeddings().num_embeddings == 136
    with pytest.raises(ValueError, match="new_num_tokens: the model's mask token is id 127"):
        model.resize_token_embeddings(127)
