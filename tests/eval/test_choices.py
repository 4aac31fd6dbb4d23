"""Zero-shot multiple choice: the standard score, Fair-PMI, the AR baseline and the BIG-bench-style runner."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _hf_tiny import tiny_model

import unifusion as uf
from unifusion.eval import ar_choice_nll, fair_pmi_scores, load_task, run_multiple_choice, score_choices
from unifusion.eval.choices import corrupt_span

DATA = Path(__file__).parents[1] / "data"
S = 40


class KnowsTheAnswer:
    """x0 model: every position predicts ``x_t[:, key_pos] + shift`` (sharply), plus a fixed answer-only ``bias``.

    The context is clean, so the prediction on the answer span is deterministic given the context.
    """

    def __init__(self, num_states: int, key_pos: int = 0, shift: int = 10, strength: float = 6.0,
                 bias: torch.Tensor | None = None) -> None:
        self.num_states, self.key_pos, self.shift, self.strength = num_states, key_pos, shift, strength
        self.bias = torch.zeros(num_states) if bias is None else bias
        self.calls = 0

    def __call__(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        B, L = x_t.shape
        assert t.shape == (B,) and bool(((t > 0) & (t < 1)).all())
        target = (x_t[:, min(self.key_pos, L - 1)] + self.shift) % self.num_states  # short null contexts
        logits = self.strength * torch.nn.functional.one_hot(target, self.num_states).float()  # (B, S)
        return (logits + self.bias).unsqueeze(1).expand(B, L, self.num_states)


@pytest.mark.parametrize("kernel", [uf.UniformKernel(S), uf.MaskKernel(S, mask_id=S - 1),
                                    uf.HybridKernel(S, mask_id=S - 1, p_uniform=0.2)], ids=repr)
def test_score_choices_picks_the_answer_the_model_knows(kernel):
    model = KnowsTheAnswer(S)
    g = torch.Generator().manual_seed(0)
    for q in range(5):
        context = [q, 30, 31]
        choices = [[(q + d) % 10 + 10, (q + d) % 10 + 10] for d in (2, 0, 5)] + [[q + 10]]
        scores = score_choices(model, kernel, context, choices, num_times=8, generator=g)
        assert scores.shape == (4,) and scores.dtype == torch.float64
        assert int(scores[1:3].argmin()) == 0  # the two-token correct answer beats the wrong two-token ones
        assert int(scores[:3].argmin()) == 1
        assert scores[3] == pytest.approx(float(scores[1]), abs=1e-4)  # one or two copies: same per-token score


def test_score_equals_answer_nll_for_a_context_free_fixed_prediction():
    # x_θ independent of z_t and t: every I_k gives mean_i −log p(a_i), so S(a) is exact whatever the draws
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(S, generator=g)
    log_p = torch.log_softmax(logits.double(), -1)
    model = lambda x_t, t: logits.expand(*x_t.shape, S)
    choices = [[3], [7], [5, 5, 5]]
    scores = score_choices(model, uf.UniformKernel(S), [1, 2], choices, num_times=5)
    torch.testing.assert_close(scores, torch.stack([-log_p[3], -log_p[7], -log_p[5]]), rtol=1e-6, atol=1e-6)


def test_batching_across_choices_and_times_does_not_change_scores():
    model = KnowsTheAnswer(S, strength=2.0)
    kernel = uf.UniformKernel(S)
    choices = [[11, 12], [13], [14, 15], [16, 17, 18]]
    a = score_choices(model, kernel, [1, 2, 3], choices, num_times=6, batch_size=1,
                      generator=torch.Generator().manual_seed(3))
    calls_small = model.calls
    model.calls = 0
    b = score_choices(model, kernel, [1, 2, 3], choices, num_times=6, batch_size=64,
                      generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(a, b)
    assert calls_small == 6 * 4 and model.calls == 3  # one forward per answer length


def test_corrupted_span_follows_the_kernel():
    g = torch.Generator().manual_seed(0)
    span = torch.full((4000,), 5)
    t = torch.tensor([0.25, 0.7], dtype=torch.float64)
    for kernel in (uf.UniformKernel(S), uf.MaskKernel(S, mask_id=S - 1)):
        z, selected = corrupt_span(kernel, span, t, g)
        assert z.shape == selected.shape == (2, 4000)
        assert torch.equal(z[~selected], span.expand(2, -1)[~selected])  # unselected tokens stay clean
        frac = selected.double().mean(-1)
        torch.testing.assert_close(frac, t, atol=0.03, rtol=0)  # β_t = t for the linear schedule
        if kernel.mask_id is not None:
            assert bool((z[selected] == kernel.mask_id).all())
        else:  # uniform noise: about 1/S of the selected tokens land on the clean token by chance
            assert abs(float((z[selected] == 5).double().mean()) - 1 / S) < 0.01


def test_fair_pmi_removes_answer_only_bias():
    # the model prefers answer token 20 regardless of the question (+3), the context adds +2 for the true answer
    bias = torch.zeros(S)
    bias[20] = 3.0
    model = KnowsTheAnswer(S, strength=2.0, bias=bias)
    kernel = uf.UniformKernel(S)
    null = [39]  # "Answer:" -> its key token maps to answer 39 + 10 = 9, a token no choice uses
    correct, wrong = [0 + 10], [20]
    g = torch.Generator().manual_seed(0)
    plain = score_choices(model, kernel, [0], [correct, wrong], num_times=16, generator=g)
    assert int(plain.argmin()) == 1  # the biased answer wins the plain score
    pmi = fair_pmi_scores(model, kernel, [0], [correct, wrong], null, num_times=16, generator=g)
    assert int(pmi.argmin()) == 0
    # identical contexts: shared randomness makes every PMI score exactly 0
    same = fair_pmi_scores(model, kernel, [0], [correct, wrong, [10, 20]], [0], num_times=8, generator=g)
    torch.testing.assert_close(same, torch.zeros(3, dtype=torch.float64))


def test_fair_pmi_against_direct_formula_for_fixed_prediction():
    # x_θ independent of z_t: L̄(a|c) = (1/K) Σ_k Σ_{i∈I_k} c_i, with c_i = −log p_c(a_i); the null context differs
    log_c = torch.log_softmax(torch.arange(S, dtype=torch.float64) / S, -1)
    log_n = torch.log_softmax(-torch.arange(S, dtype=torch.float64) / S, -1)

    def model(x_t, t):
        use_c = (x_t[:, 0] == 1).float()[:, None, None]
        return use_c * log_c.float() + (1 - use_c) * log_n.float()

    g = torch.Generator().manual_seed(4)
    a = [7]
    scores = fair_pmi_scores(model, uf.UniformKernel(S), [1], [a], [2], num_times=64, generator=g)
    # single-token answer: L̄ = (fraction of times selected) · c; E[fraction] = ∫ t dt over (1e-3, 1) ≈ 1/2
    g2 = torch.Generator().manual_seed(4)
    from unifusion.eval.choices import stratified_times

    t = stratified_times(64, 1e-3, g2, torch.device("cpu"))
    _, selected = corrupt_span(uf.UniformKernel(S), torch.tensor(a), t, g2)
    frac = selected.double().mean()
    expected = frac * (-log_c[7] + log_n[7])
    torch.testing.assert_close(scores, expected.reshape(1), rtol=1e-5, atol=1e-6)
    assert 0.3 < float(frac) < 0.7


def test_ar_choice_nll_matches_manual_log_softmax():
    model = tiny_model("llama", seed=2)
    context, choices = [5, 6, 7], [[8], [9, 10, 11]]
    got = ar_choice_nll(model, context, choices, bos_token_id=1)
    mean = ar_choice_nll(model, context, choices, bos_token_id=1, reduction="mean")
    for k, a in enumerate(choices):
        ids = torch.tensor([[1, *context, *a]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        ref = -sum(float(logp[3 + j, tok]) for j, tok in enumerate(a))
        assert float(got[k]) == pytest.approx(ref, rel=1e-5)
        assert float(mean[k]) == pytest.approx(ref / len(a), rel=1e-5)
    with pytest.raises(ValueError, match="context_ids"):
        ar_choice_nll(model, [], choices)


def test_runner_on_the_tiny_task(tokenizer):
    V = len(tokenizer)
    task = load_task(DATA / "tiny_task.json")
    assert len(task["examples"]) == 6
    model = KnowsTheAnswer(V, key_pos=3, shift=0)  # the answer is the 4th word of the input
    kernel = uf.UniformKernel(V)
    for method in ("score", "fair_pmi"):
        res = run_multiple_choice(DATA / "tiny_task.json", model, kernel, tokenizer, method=method, num_times=4,
                                  progress=False)
        assert res.accuracy == 1.0 and res.num_correct == res.num_examples == 6
        assert len(res.predictions) == 6 and all(len(s) == 3 for s in res.scores)
    # AR baseline: a causal "LM" that copies the 4th input token (input_ids carry the BOS first, so index 4)
    def ar(input_ids):
        key = input_ids[:, 4]
        return 5.0 * torch.nn.functional.one_hot(key, V).float().unsqueeze(1).expand(*input_ids.shape, V)

    res = run_multiple_choice(task, None, None, tokenizer, method="ar", ar_model=ar, max_examples=4, progress=False)
    assert res.accuracy == 1.0 and res.num_examples == 4
    # a model that points one word off gets everything wrong
    off = KnowsTheAnswer(V, key_pos=2, shift=0)
    res = run_multiple_choice(task, off, kernel, tokenizer, num_times=4, progress=False)
    assert res.num_examples == 6 and res.to_dict()["method"] == "score"
    assert math.isfinite(res.accuracy) and res.accuracy < 1.0


def test_bad_input(tmp_path, tokenizer):
    model = KnowsTheAnswer(S)
    kernel = uf.UniformKernel(S)
    with pytest.raises(ValueError, match="num_times"):
        score_choices(model, kernel, [1], [[2]], num_times=0)
    with pytest.raises(ValueError, match="num_times"):
        fair_pmi_scores(model, kernel, [1], [[2]], [3], num_times=0)
    with pytest.raises(ValueError, match="choices_ids"):
        score_choices(model, kernel, [1], [])
    with pytest.raises(ValueError, match=r"choices_ids\[1\].*empty"):
        score_choices(model, kernel, [1], [[2], []])
    with pytest.raises(ValueError, match="choices_ids"):
        score_choices(model, kernel, [1], [[S + 3]])
    with pytest.raises(TypeError, match="kernel"):
        score_choices(model, "uniform", [1], [[2]])
    mismatched = KnowsTheAnswer(S)
    mismatched.num_states = S + 1
    with pytest.raises(ValueError, match="kernel.*states"):
        score_choices(mismatched, kernel, [1], [[2]])
    with pytest.raises(ValueError, match="method"):
        run_multiple_choice(DATA / "tiny_task.json", model, kernel, tokenizer, method="bogus")
    with pytest.raises(ValueError, match="task"):
        run_multiple_choice(tmp_path / "missing.json", model, kernel, tokenizer)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"examples": [{"input": "x", "target_scores": {}}]}))
    with pytest.raises(ValueError, match="no choices"):
        load_task(bad)
