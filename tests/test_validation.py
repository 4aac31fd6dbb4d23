"""Bad input raises ValueError / TypeError naming the argument; ``uf.validation.validation(False)`` skips value
checks only."""

from __future__ import annotations

import math
import re

import pytest
import torch

import unifusion as uf

L = uf.losses
S = 6


@pytest.fixture
def kernel() -> uf.HybridKernel:
    return uf.HybridKernel(S, 0, 0.3)


def test_kernel_constructors() -> None:
    for bad in (0, -3):
        with pytest.raises(ValueError, match="num_states"):
            uf.UniformKernel(bad)
    with pytest.raises(TypeError, match="num_states"):
        uf.UniformKernel(5.0)  # type: ignore[arg-type]
    for bad in (-1, S):
        with pytest.raises(ValueError, match="mask_id"):
            uf.MaskKernel(S, bad)
        with pytest.raises(ValueError, match="mask_id"):
            uf.HybridKernel(S, bad, 0.2)
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="p_uniform"):
            uf.HybridKernel(S, 0, bad)
    with pytest.raises(TypeError, match="schedule"):
        uf.UniformKernel(S, schedule="cosine")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="generator"):
        uf.GeneratorKernel(torch.ones(3, 3, dtype=torch.float64))  # rows do not sum to 0


def test_token_ids(kernel: uf.Kernel) -> None:
    for bad in (torch.tensor([0, S]), torch.tensor([-1, 2])):
        with pytest.raises(ValueError, match="x0"):
            kernel.marginal(bad, 0.5)
        with pytest.raises(ValueError, match="x_t"):
            kernel.rate_into(bad, 0.5)
    with pytest.raises(TypeError, match="x0"):
        kernel.marginal(torch.tensor([0.0, 1.0]).bool(), 0.5)
    with pytest.raises(TypeError, match="x_t"):
        uf.ReverseRate.from_x0_logits(kernel, torch.zeros(2, S), torch.tensor([1.0, 2.0]), 0.5)


def test_times(kernel: uf.Kernel) -> None:
    for bad in (0.0, 1.0, -0.2, torch.tensor([0.5, 1.2])):
        with pytest.raises(ValueError, match="t"):
            kernel.marginal(torch.tensor([1, 2]), bad)
        with pytest.raises(ValueError, match="t"):
            L.gidd_loss(torch.zeros(2, S), torch.tensor([1, 2]), torch.tensor([1, 2]), bad, kernel)
    with pytest.raises(TypeError, match="t"):
        kernel.marginal(torch.tensor([1, 2]), torch.tensor([1, 2]))  # integer times
    with pytest.raises(ValueError, match="s"):
        kernel.transition_into(torch.tensor([1]), 0.6, 0.5)


def test_head_shapes(kernel: uf.Kernel) -> None:
    x = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="x0_logits"):
        L.gidd_loss(torch.zeros(3, S + 1), x, x, 0.5, kernel)
    with pytest.raises(ValueError, match="x0_logits"):
        L.gidd_loss(torch.zeros(2, S), x, x, 0.5, kernel)
    with pytest.raises(ValueError, match="log_score"):
        L.sedd_loss(torch.zeros(3, 2), x, x, 0.5, kernel)
    with pytest.raises(ValueError, match="log_exit_rate"):
        L.ctmc_loss(torch.zeros(4), torch.zeros(3, S), x, x, 0.5, kernel)
    with pytest.raises(ValueError, match="x0_logits"):
        uf.ReverseRate.from_x0_logits(kernel, torch.zeros(3, S - 1), x, 0.5)
    with pytest.raises(TypeError, match="mu_logits"):
        L.m2s_loss(torch.zeros(3, S, dtype=torch.long), x, x, 0.5, kernel)
    with pytest.raises(TypeError, match="kernel"):
        L.mdlm_loss(torch.zeros(3, S), x, x, 0.5, uf.UniformKernel(S))


def test_distributions_and_nan(kernel: uf.Kernel) -> None:
    x = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="x0_probs"):
        uf.ReverseRate.from_x0(kernel, torch.full((2, S), 0.5), x, 0.5)
    with pytest.raises(ValueError, match="x0_probs"):
        kernel.posterior(torch.full((2, S), -0.1), x, 0.2, 0.5)
    with pytest.raises(ValueError, match="mu"):
        uf.ReverseRate.from_posterior_mean(kernel, torch.full((2, S), 0.3), x, 0.5)
    with pytest.raises(ValueError, match="x0"):
        kernel.marginal(torch.full((2, S), 0.9), 0.5)
    nan_head = torch.zeros(2, S)
    nan_head[1, 3] = math.nan
    with pytest.raises(ValueError, match="x0_logits"):
        L.gidd_loss(nan_head, x, x, 0.5, kernel)
    with pytest.raises(ValueError, match="log_score"):
        L.sedd_loss(nan_head, x, x, 0.5, kernel)
    with pytest.raises(ValueError, match="score"):
        uf.ReverseRate.from_score(kernel, -torch.ones(2, S), x, 0.5)


def test_conversion_targets_and_reachability() -> None:
    kernel = uf.MaskKernel(S, 0)
    probs = torch.softmax(torch.zeros(2, S).index_fill(-1, torch.tensor([0]), -math.inf), -1)
    x_t = torch.tensor([0, 3])  # 3 is an unmasked state: unreachable from the other clean tokens
    with pytest.raises(ValueError, match="target"):
        uf.convert_x0_to("mdlm", probs, kernel, x_t, 0.5)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="x_t"):
        uf.convert_x0_to("m2s", probs, kernel, x_t, 0.5)
    mu = uf.convert_x0_to("m2s", probs, kernel, x_t, 0.5, strict=False)
    assert float(mu[1, 3]) == 1.0


def test_validation_switch_skips_value_checks_only(kernel: uf.Kernel) -> None:
    x = torch.tensor([1, 2])
    bad_probs = torch.full((2, S), 0.5)
    nan_head = torch.zeros(2, S)
    nan_head[0, 0] = math.nan
    assert uf.validation.validation_enabled()
    with uf.validation.validation(False):
        assert not uf.validation.validation_enabled()
        kernel.marginal(x, 1.5)  # times outside (0, 1): not checked
        kernel.marginal(torch.tensor([0, S + 3]).clamp_max(S - 1), 0.5)
        uf.ReverseRate.from_x0(kernel, bad_probs, x, 0.5)  # rows not summing to 1: not checked
        L.gidd_loss(nan_head, x, x, 0.5, kernel)  # NaN: not checked
        uf.convert_x0_to("m2s", torch.full((1, S), 1 / S), uf.MaskKernel(S, 0), torch.tensor([3]), 0.5)
        # shape and type checks still run
        with pytest.raises(ValueError, match="x0_logits"):
            L.gidd_loss(torch.zeros(2, S + 1), x, x, 0.5, kernel)
        with pytest.raises(TypeError, match="x0"):
            kernel.marginal(torch.tensor([0.5]).bool(), 0.5)
        with pytest.raises(ValueError, match="target"):
            uf.convert_x0_to("nope", bad_probs, kernel, x, 0.5)  # type: ignore[call-overload]
    assert uf.validation.validation_enabled()
    with pytest.raises(TypeError, match="enabled"):
        uf.validation.set_validation(1)  # type: ignore[arg-type]


def test_the_switch_lives_in_unifusion_validation(kernel: uf.Kernel) -> None:
    """unifusion.validation holds the switch; the package's checks read it there."""
    from unifusion import _validation
    from unifusion.validation import set_validation, validation, validation_enabled

    with validation(False):
        assert not validation_enabled() and not _validation.validation_enabled()
        assert not uf.validation.validation_enabled()
        kernel.marginal(torch.tensor([1]), 1.5)  # not checked
    set_validation(False)
    try:
        kernel.marginal(torch.tensor([1]), 1.5)
    finally:
        set_validation(True)
    with pytest.raises(ValueError, match="open interval"):
        kernel.marginal(torch.tensor([1]), 1.5)


def test_the_switch_is_one_explicit_object(kernel: uf.Kernel) -> None:
    """The state behind set_validation / validation / validation_enabled is ``unifusion.validation.SWITCH``; another
    ValidationSwitch is independent of it, and a scoped block restores what it found even when it raises."""
    from unifusion.validation import SWITCH, ValidationSwitch

    own = ValidationSwitch(False)
    assert not own.active() and SWITCH.active() and uf.validation.validation_enabled()
    with own.scoped(True):
        assert own.active() and SWITCH.enabled
    assert not own.enabled
    with pytest.raises(RuntimeError, match="inside"), uf.validation.validation(False):
        assert SWITCH.enabled is False and not uf.validation.validation_enabled()
        raise RuntimeError("inside")
    assert SWITCH.enabled is True
    with pytest.raises(TypeError, match="enabled: expected a bool, got int"):
        ValidationSwitch(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="enabled"), uf.validation.validation(0):  # type: ignore[arg-type]
        pass
    assert SWITCH.enabled is True


# ---------------------------------------------------------------------------------------------------- model vs kernel
def test_check_model_kernel_names_both_mask_ids():
    from _hf_tiny import tiny_model

    from unifusion._validation import check_model_kernel

    with_mask = uf.adapt_ar_model(tiny_model("llama"))  # mask token added: id V, S = V + 1
    S, m = with_mask.num_states, with_mask.mask_token_id
    check_model_kernel(with_mask, uf.MaskKernel(S, m))
    check_model_kernel(with_mask, uf.HybridKernel(S, m, 0.1))
    check_model_kernel(with_mask, uf.UniformKernel(S))  # the mask token as one more noise state: allowed
    with pytest.raises(ValueError, match=rf"mask_id=5 but the model's mask token is {m}"):
        check_model_kernel(with_mask, uf.MaskKernel(S, 5))
    with pytest.raises(ValueError, match=f"has {S + 1} states but the model predicts {S}"):
        check_model_kernel(with_mask, uf.UniformKernel(S + 1))
    no_mask = uf.adapt_ar_model(tiny_model("llama"), add_mask_token=False)
    with pytest.raises(ValueError, match="add_mask_token=False"):
        check_model_kernel(no_mask, uf.MaskKernel(no_mask.num_states, 0))
    wrapped = torch.nn.Module()
    wrapped.module = with_mask  # what DDP / DeepSpeed expose
    with pytest.raises(ValueError, match="mask token is"):
        check_model_kernel(wrapped, uf.MaskKernel(S, 0))
    check_model_kernel(lambda x_t, t: None, uf.MaskKernel(S, 0))  # a plain callable knows no mask token


def test_sequence_times_and_meta_tensors():
    """The shared helpers behind the time rule for model calls and the meta-tensor errors."""
    from unifusion import _validation as V

    shape = (4, 4)  # B == L
    row = torch.tensor([0.1, 0.2, 0.3, 0.4])
    for t in (row, row[:, None]):
        assert torch.equal(V.check_sequence_times("t", t, shape), row)
    for t in (0.5, torch.tensor(0.5), torch.tensor([0.5])):
        assert torch.equal(V.check_sequence_times("t", t, shape), torch.full((4,), 0.5))
    with pytest.raises(ValueError, match=r"t: the model takes one time per sequence: a float, shape \(4,\) or "
                                         r"\(4, 1\), got shape \(4, 4\)"):
        V.check_sequence_times("t", row[:, None].expand(4, 4), shape)
    with pytest.raises(ValueError, match="a 1-D t holds one time per row"):
        V.check_sequence_times("t", torch.full((5,), 0.5), shape)
    with pytest.raises(ValueError, match="open interval"):
        V.check_sequence_times("t", 1.5, shape)
    with pytest.raises(ValueError, match="x0_logits: is on the meta device"):
        V.check_head("x0_logits", torch.empty(2, S, device="meta"), S)
    with pytest.raises(ValueError, match="hidden: is on the meta device"):
        V.check_tensor("hidden", torch.empty(2, device="meta"))
    # a device (not only a tensor) is compared with the model's parameters, by host metadata
    V.check_model_device(torch.nn.Linear(2, 2), "device", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"device: is on meta but the model's parameters are on cpu"):
        V.check_model_device(torch.nn.Linear(2, 2), "device", torch.device("meta"))


def test_a_batch_of_token_ids_is_one_rule_at_every_entry_point():
    """``(B, L)`` integer token ids with B, L >= 1: one check (``_validation.check_token_batch``) behind the model's
    forward, the losses, the likelihood, the RL log-probabilities and DiffusionGemma's prompts; each error names the
    argument, what was expected and what came."""
    from _hf_tiny import tiny_diffusion_gemma, tiny_model

    from unifusion import _validation as V

    ids = torch.ones(2, 3, dtype=torch.long)
    assert V.check_token_batch("x0", ids) is ids
    for value, error, message in [
            ([[1, 2]], TypeError, r"x0: expected a \(B, L\) integer tensor of token ids, got list"),
            (ids[0], ValueError, r"x0: expected shape \(B, L\), got \(3,\)"),
            (ids[:, :0], ValueError, r"x0: expected a non-empty batch of token ids \(B, L\) with B, L >= 1, got "
                                     r"\(2, 0\)"),
            (ids.float(), TypeError, "x0: expected integer token ids \\(int64\\), got dtype torch.float32"),
            (ids.bool(), TypeError, "x0: expected integer token ids \\(int64\\), got dtype torch.bool"),
            (ids.to("meta"), ValueError, "x0: is on the meta device")]:
        with pytest.raises(error, match="^" + message):
            V.check_token_batch("x0", value)
    with pytest.raises(ValueError, match=r"^prompt_ids: expected a non-empty batch of token ids \(B, P\) with B, P "
                                         r">= 1, got \(1, 0\)"):
        V.check_token_batch("prompt_ids", ids[:1, :0], ("B", "P"))

    model = uf.adapt_ar_model(tiny_model("llama"))
    kernel = uf.UniformKernel(model.num_states)
    gemma = uf.hf.wrap_diffusion_lm(tiny_diffusion_gemma())
    empty = ids[:0]
    entry_points = {
        "x_t": lambda x: model(x),
        "x0": lambda x: uf.diffusion_loss(model, x, kernel),
        "input_ids": lambda x: uf.rl.sequence_logprob(model, x, torch.ones_like(x, dtype=torch.bool)),
        "prompt_ids": lambda x: gemma.generate(x),
    }
    for name, call in entry_points.items():
        dims = "(B, P)" if name == "prompt_ids" else "(B, L)"
        with pytest.raises(ValueError, match=f"^{name}: expected a non-empty batch of token ids {re.escape(dims)}"):
            call(empty)
        with pytest.raises(TypeError, match=rf"^{name}: expected integer token ids \(int64\), got dtype "
                                            "torch.float32"):
            call(ids.float())
    with pytest.raises(ValueError, match=r"^x0: expected shape \(B, L\), got \(3,\)"):
        uf.eval.nll_bound(model, ids[0], kernel, num_times=2)
    with pytest.raises(ValueError, match=r"^x_t: expected shape \(B, L\), got \(3,\)"):
        gemma(ids[0], prompt_length=1)


def test_unchecked_is_local_to_the_context_and_library_code_never_sets_the_switch(kernel: uf.Kernel) -> None:
    """Library code turns checks off for its own internal calls only (a ContextVar): a thread inside ``unchecked()``
    leaves another thread's checks on; and no library module calls the process-wide switch."""
    import ast
    import threading
    from pathlib import Path

    from unifusion.validation import unchecked, validation_enabled

    inside, release, seen = threading.Event(), threading.Event(), {}

    def worker() -> None:
        with unchecked():
            seen["worker"] = validation_enabled()
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    assert inside.wait(10)
    seen["main"] = validation_enabled()
    with pytest.raises(ValueError, match="x0"):  # this thread's value checks still run
        kernel.sample(torch.full((1, 3), 10_000), 0.5)
    release.set()
    thread.join()
    assert seen == {"worker": False, "main": True}
    with unchecked():
        kernel.sample(torch.full((1, 3), 1), 0.5)
        assert not validation_enabled()
    assert validation_enabled()

    root = Path(uf.__file__).parent
    calls = []
    for path in root.rglob("*.py"):
        if path.name == "validation.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name in ("validation", "set_validation") or (
                        isinstance(f, ast.Attribute) and name in ("set", "scoped") and
                        isinstance(f.value, (ast.Name, ast.Attribute)) and "SWITCH" in ast.unparse(f.value)):
                    calls.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    assert not calls, calls


def test_the_architecture_page_names_all_process_state() -> None:
    """Every module-level object the package mutates (containers written to, thread-locals, context variables,
    cached functions) is named in docs/architecture.md."""
    import ast
    from pathlib import Path

    root = Path(uf.__file__).parent
    page = (root.parent / "docs" / "architecture.md").read_text()
    found = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        containers = {}
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) else \
                node.target if isinstance(node, ast.AnnAssign) else None
            value = getattr(node, "value", None)
            if isinstance(target, ast.Name) and value is not None:
                text = ast.unparse(value)
                if isinstance(value, (ast.Dict, ast.List, ast.Set)) or "threading.local" in text \
                        or "ContextVar" in text:
                    containers[target.id] = "local" in text or "ContextVar" in text
            if isinstance(node, ast.FunctionDef) and any("cache" in ast.unparse(d) for d in node.decorator_list):
                found.append(node.name)
        mutated = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name):
                mutated.add(node.value.id)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.attr in (
                        "append", "pop", "update", "clear", "setdefault", "add", "extend", "set"):
                mutated.add(node.func.value.id)
        found += [name for name, always in containers.items() if always or name in mutated]
    missing = sorted({name for name in found if f"{name}" not in page})
    assert not missing, f"process state not named in docs/architecture.md: {missing}"
