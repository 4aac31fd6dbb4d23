"""unifusion.cpu_linears: CPU linears through oneDNN with prepacked weights — equal to ``nn.Linear`` up to float32
rounding, the same decoded tokens, autograd and in-place updates handled, layers restored on exit, bad arguments."""

from __future__ import annotations

import pytest
import torch
from _hf_tiny import VOCAB, tiny_model
from torch import nn

import unifusion as uf
import unifusion.cpu_linears as cpu_linears
from unifusion.cpu_linears import packed_linears, packing_available
from unifusion.samplers.policies import ConfidenceThreshold, LowConfidence

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear operators")


def _net(bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40, bias=bias), nn.GELU(), nn.Linear(40, 16, bias=bias)).eval()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (9, 24), (17, 24), (2, 5, 24), (0, 24)])
def test_equals_nn_linear(bias, shape) -> None:
    net = _net(bias)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = net(x)
        with packed_linears(net) as n:
            out = net(x)
    assert n == 2
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_layers_are_restored_and_calls_really_routed(monkeypatch) -> None:
    net = _net()
    calls = []
    real = cpu_linears._PackedForward.__call__

    def spy(self, x):
        calls.append(x.shape)
        return real(self, x)

    monkeypatch.setattr(cpu_linears._PackedForward, "__call__", spy)
    with torch.no_grad(), packed_linears(net):
        assert all("forward" in m.__dict__ for m in net if isinstance(m, nn.Linear))
        net(torch.randn(3, 24))
    assert len(calls) == 2
    assert not any("forward" in m.__dict__ for m in net.modules())
    net(torch.randn(3, 24))
    assert len(calls) == 2  # outside the block nothing is routed


def test_gradient_calls_run_the_layer_itself() -> None:
    net = _net()
    x = torch.randn(4, 24)
    ref_grad = torch.autograd.grad(net(x).square().sum(), net[0].weight)[0]
    with packed_linears(net):
        grad = torch.autograd.grad(net(x).square().sum(), net[0].weight)[0]
    torch.testing.assert_close(grad, ref_grad)


def test_weights_updated_in_place_are_packed_again() -> None:
    """An optimizer step inside the block: the next call uses the new weights (version counter moved)."""
    net = _net()
    x = torch.randn(5, 24)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    with packed_linears(net):
        with torch.no_grad():
            before = net(x)
        net(x).square().sum().backward()
        opt.step()
        with torch.no_grad():
            after = net(x)
    with torch.no_grad():
        ref = net(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, ref, rtol=1e-5, atol=1e-5)


def test_which_layers_qualify(monkeypatch) -> None:
    class MyLinear(nn.Linear):
        pass

    net = nn.Sequential(nn.Linear(8, 8), MyLinear(8, 8), nn.Linear(8, 8).double(), nn.Linear(8, 8).bfloat16())
    hooked = nn.Linear(8, 8)
    hooked.forward = lambda x: x  # type: ignore[method-assign]  # e.g. accelerate's offloading hook
    net.append(hooked)
    monkeypatch.setattr(cpu_linears, "native_bf16", lambda device: False)
    with packed_linears(net) as n:
        assert n == 1  # the plain float32 layer only
    monkeypatch.undo()
    native = cpu_linears.native_bf16(torch.device("cpu"))  # this CPU's real answer: oneDNN packs bf16 only there
    with packed_linears(net) as n:
        assert n == (2 if native else 1)  # and the bf16 one where bf16 is native
    with packed_linears(net, enabled=False) as n:
        assert n == 0
    assert net[4].forward is not nn.Linear.forward and "forward" in net[4].__dict__  # the hook stays


def test_inputs_of_another_dtype_run_the_layer_itself() -> None:
    net = _net()
    x = torch.randn(3, 24, dtype=torch.float64)
    with torch.no_grad(), packed_linears(net):
        with pytest.raises(RuntimeError, match="dtype|Double|Float"):
            net(x)  # exactly what nn.Linear does with a float64 input on float32 weights


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="module: expected a torch.nn.Module, got str"):
        with packed_linears("model"):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError, match="enabled: expected None or a bool, got int"):
        with packed_linears(_net(), enabled=1):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="batch_hint: expected a positive int, got 0"):
        with packed_linears(_net(), batch_hint=0):
            pass
    with pytest.raises(ValueError, match="pack_after_rows: expected a non-negative int, got -1"):
        with packed_linears(_net(), pack_after_rows=-1):
            pass


def test_enabled_true_without_the_operators_raises(monkeypatch) -> None:
    monkeypatch.setattr(cpu_linears, "packing_available", lambda: False)
    with pytest.raises(RuntimeError, match="no oneDNN linear operators"):
        with packed_linears(_net(), enabled=True):
            pass
    with packed_linears(_net()) as n:  # auto: quietly off
        assert n == 0


def _block_model() -> uf.DiffusionLM:
    return uf.adapt_ar_model(tiny_model("llama"), mask_token_id=3, block_size=4).eval()


PROMPT = torch.randint(4, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
LAYERS = 2 * 7 + 1  # 2 layers × (q, k, v, o, gate, up, down) + the head


def _decode(model: uf.DiffusionLM, policy=None, **kwargs) -> torch.Tensor:
    gens = [torch.Generator().manual_seed(10 + r) for r in range(2)]
    return model.generate(PROMPT, max_new_tokens=12, policy=policy or LowConfidence(), num_steps=2,
                          eos_token_id=None, generator=gens, **kwargs)


@pytest.mark.parametrize("policy", [LowConfidence(), ConfidenceThreshold(0.5)])
def test_cached_block_decoding_gives_the_same_tokens(policy) -> None:
    """A tiny block model decoded with the KV cache (merged commits, as the demo runs it), fp32: the same tokens
    with and without packed linears under the same generators."""
    model = _block_model()
    ref = _decode(model, policy, merge_commits=True, packed_linears=False)
    with packed_linears(model) as n:
        out = _decode(model, policy, merge_commits=True, packed_linears=False)
    assert n == LAYERS
    assert torch.equal(out, ref)


def _spy_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = cpu_linears._PackedForward.__call__

    def spy(self, x):
        calls.append(x.shape[-2] if x.dim() > 1 else 1)
        return real(self, x)

    monkeypatch.setattr(cpu_linears._PackedForward, "__call__", spy)
    return calls


def _count_reorders(monkeypatch) -> list[int]:
    reorders: list[int] = []
    real_repack = cpu_linears._PackedForward.repack

    def count_repack(self):
        reorders.append(self.batch_hint)
        real_repack(self)

    monkeypatch.setattr(cpu_linears._PackedForward, "repack", count_repack)
    return reorders


def test_generate_packs_a_cpu_block_model_in_eval_mode_by_default(monkeypatch) -> None:
    """``generate`` of a block model on the CPU in eval mode routes its linears without being asked and decodes the
    same tokens as ``packed_linears=False``; a layer packs (once, tuned to the block size) only after it has
    multiplied ``GENERATE_PACK_AFTER_ROWS`` rows in the call — this short call (~90 rows a layer) packs none, with
    the threshold at 0 every layer packs at entry, at 20 every layer packs mid-call — and each call leaves the layers
    plain. Training mode, a model without blocks and ``packed_linears=False`` run the layers' own forward (``True``
    routes in training mode too)."""
    calls = _spy_calls(monkeypatch)
    model = _block_model()
    ref = _decode(model, packed_linears=False)
    assert not calls
    reorders = _count_reorders(monkeypatch)
    assert torch.equal(_decode(model), ref) and calls
    assert reorders == []  # a short call pays no reorder
    monkeypatch.setattr(cpu_linears, "GENERATE_PACK_AFTER_ROWS", 0)
    assert torch.equal(_decode(model), ref)
    assert reorders == [4] * LAYERS
    assert torch.equal(_decode(model), ref)
    assert reorders == [4] * (2 * LAYERS)  # packed again by the second call: nothing is kept between calls
    monkeypatch.setattr(cpu_linears, "GENERATE_PACK_AFTER_ROWS", 20)
    assert torch.equal(_decode(model), ref)
    assert reorders == [4] * (3 * LAYERS)  # every layer crossed 20 rows within the call and packed once
    assert not any("forward" in m.__dict__ for m in model.modules())
    calls.clear()
    model.train()
    _decode(model)
    bidirectional = uf.adapt_ar_model(tiny_model("llama"), mask_token_id=3).eval()
    _decode(bidirectional)
    assert not calls
    model.train()
    _decode(model, packed_linears=True)  # True: also in training mode
    assert calls
    with pytest.raises(TypeError, match="packed_linears: expected None or a bool, got int"):
        _decode(model, packed_linears=1)


def test_pack_after_rows_runs_the_layer_itself_until_then(monkeypatch) -> None:
    """``pack_after_rows=10``: calls of 4 rows run ``nn.Linear`` (bit-equal) while fewer than 10 rows went through,
    the next call packs the layer once and later calls reuse the packed copy (equal up to float32 rounding)."""
    net = _net()
    reorders = _count_reorders(monkeypatch)
    xs = [torch.randn(4, 24, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    with torch.no_grad():
        refs = [net(x) for x in xs]
        with packed_linears(net, pack_after_rows=10) as n:
            outs = [net(x) for x in xs[:3]]
            assert reorders == []
            outs += [net(x) for x in xs[3:]]
    assert n == 2 and reorders == [16, 16]
    for out, ref in zip(outs[:3], refs[:3]):
        assert torch.equal(out, ref)
    for out, ref in zip(outs[3:], refs[3:]):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_generate_inside_an_open_block_packs_nothing_of_its_own(monkeypatch) -> None:
    """Packed once around many calls: the block packs every layer at entry, ``generate`` (default arguments) inside
    it reorders nothing more, decodes the tokens of the unpacked path, and the layers stay routed until the block
    closes."""
    model = _block_model()
    ref = _decode(model, packed_linears=False)
    reorders = _count_reorders(monkeypatch)
    with packed_linears(model, batch_hint=4) as n:
        assert n == LAYERS and reorders == [4] * LAYERS
        for _ in range(3):
            assert torch.equal(_decode(model), ref)
        assert reorders == [4] * LAYERS
        assert all(isinstance(m.__dict__.get("forward"), cpu_linears._PackedForward)
                   for m in model.modules() if type(m) is nn.Linear)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_repack_linears_sees_weights_changed_through_data() -> None:
    """Inside an open block a write through ``.data`` moves no version counter: the layer keeps its old packed copy
    (the documented limit) until ``repack_linears``, after which it equals the layer's own forward again. Outside a
    block, and for layers not yet packed, it packs nothing."""
    net = _net()
    x = torch.randn(5, 24)
    with torch.no_grad():
        with packed_linears(net) as n:
            before = net(x)
            for layer in (net[0], net[2]):
                layer.weight.data.mul_(-1.0)  # the bias is read live at each call; the weight is packed
            stale = net(x)
            assert uf.cpu_linears.repack_linears(net) == n == 2
            fresh = net(x)
        ref = net(x)
        with packed_linears(net, pack_after_rows=100):
            assert uf.cpu_linears.repack_linears(net) == 0  # nothing packed yet
    torch.testing.assert_close(stale, before, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fresh, before)
    torch.testing.assert_close(fresh, ref, rtol=1e-5, atol=1e-5)
    assert uf.cpu_linears.repack_linears(net) == 0
    with pytest.raises(TypeError, match="module: expected a torch.nn.Module, got str"):
        uf.cpu_linears.repack_linears("model")  # type: ignore[arg-type]


def test_training_after_generate_is_unchanged_and_the_next_generate_sees_the_new_weights() -> None:
    """Generate, then train: the training step's gradients are those of a twin model that never generated; the next
    generate decodes with the updated weights, equal to the unpacked path — also after an update through ``.data``,
    which moves no version counter (peft's merge, an EMA swap)."""
    model, twin = _block_model(), _block_model()
    kernel = uf.MaskKernel(VOCAB, 3)
    _decode(model)
    x0 = torch.randint(4, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = []
    for m in (model, twin):
        m.train()
        uf.diffusion_loss(m, x0, kernel, generator=torch.Generator().manual_seed(2)).loss.mean().backward()
        grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
        torch.optim.SGD(m.parameters(), lr=5.0).step()
        m.eval()
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert torch.equal(_decode(model), _decode(model, packed_linears=False))
    assert not torch.equal(_decode(model), _decode(_block_model(), packed_linears=False))  # the weights moved
    before = _decode(model)
    for p in model.parameters():
        p.data.mul_(-1.0)
    after = _decode(model)
    assert not torch.equal(after, before) and torch.equal(after, _decode(model, packed_linears=False))
