"""Accuracy under parallelism: d3LLM's ``get_aup`` on recorded points (run outside the repository, not copied), the
definition on hand-computed cases, bad input, and the two tokens-per-forward plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from unifusion.eval import FrontierResult, accuracy_under_parallelism, aup_weight, plot_frontier, plot_parallelism

FIXTURE = Path(__file__).parent / "fixtures" / "d3llm_aup.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_aup_equals_d3llm_get_aup_on_recorded_points():
    data = json.loads(FIXTURE.read_text())
    source = data["source"]
    assert source["repo"] == "hao-ai-lab/d3LLM" and len(source["commit"]) == 40 and "no licence" in source["licence"]
    cases = data["cases"]
    assert sum("raises" in c for c in cases) == 4 and len(cases) >= 30
    for case in cases:
        kwargs = {"max_accuracy": case["y_max"], "alpha": case.get("alpha", 3.0),
                  "max_drop": case.get("y_min_offset", 5.0)}
        if "raises" in case:  # theirs asserts; ours names the argument
            with pytest.raises(ValueError, match="accuracy|tokens_per_forward"):
                accuracy_under_parallelism(case["rho"], case["y"], **kwargs)
            continue
        ours = accuracy_under_parallelism(case["rho"], case["y"], **kwargs)
        assert math.isclose(ours, case["aup"], rel_tol=1e-12, abs_tol=1e-12), (case["name"], ours, case["aup"])


def test_aup_by_hand():
    assert accuracy_under_parallelism([2.5], [40.0], max_accuracy=80.0) == 100.0  # one point: ρ y, unweighted
    # α = 0: the rectangle under the first point and plain trapezoids
    assert accuracy_under_parallelism([3.0, 1.0], [48.0, 50.0], max_accuracy=50.0, alpha=0.0) == pytest.approx(
        1 * 50 + 0.5 * 2 * (50 + 48))
    # at y_max the weight is 1; below it e^{-α (1 - y/y_max)}
    w = math.exp(-3.0 * (1 - 45.0 / 50.0))
    assert accuracy_under_parallelism([1.0, 2.0], [50.0, 45.0], max_accuracy=50.0) == pytest.approx(
        50 + 0.5 * (50 + 45 * w))
    assert aup_weight(50.0, 50.0) == 1.0 and aup_weight(60.0, 50.0) == 1.0 and aup_weight(0.0, 50.0) == pytest.approx(
        math.exp(-3.0))
    # a point below y_1 - Δ in the middle is skipped: the trapezoid spans its neighbours
    assert accuracy_under_parallelism([1, 2, 3], [50, 40, 50], max_accuracy=50, alpha=0) == pytest.approx(
        50 + 0.5 * 2 * 100)
    # more accuracy at the same speed, or more speed at the same accuracy, never lowers AUP
    base = accuracy_under_parallelism([1, 4], [60, 57], max_accuracy=60)
    assert accuracy_under_parallelism([1, 4], [60, 58], max_accuracy=60) > base
    assert accuracy_under_parallelism([1, 5], [60, 57], max_accuracy=60) > base


def test_aup_bad_input_names_the_argument():
    ok = {"max_accuracy": 80.0}
    for args, kwargs, kind, name in [
        (([1.0], [80.0, 79.0]), ok, ValueError, "accuracy"),
        (([], []), ok, ValueError, "tokens_per_forward"),
        (([1.0, -2.0], [80.0, 79.0]), ok, ValueError, r"tokens_per_forward\[1\]"),
        (([1.0, float("nan")], [80.0, 79.0]), ok, ValueError, "tokens_per_forward"),
        (([1.0], [101.0]), ok, ValueError, r"accuracy\[0\]"),
        (([1.0, 2.0], [80.0, 70.0]), ok, ValueError, "accuracy.*max_drop"),
        (([1.0], [80.0]), {"max_accuracy": 0.0}, ValueError, "max_accuracy"),
        (([1.0], [80.0]), {"max_accuracy": 80.0, "alpha": -1.0}, ValueError, "alpha"),
        (([1.0], [80.0]), {"max_accuracy": 80.0, "max_drop": -0.5}, ValueError, "max_drop"),
        (("1.0", [80.0]), ok, TypeError, "tokens_per_forward"),
        (([1.0], ["80"]), ok, TypeError, "accuracy"),
    ]:
        with pytest.raises(kind, match=name):
            accuracy_under_parallelism(*args, **kwargs)


def test_plot_parallelism_writes_a_png(tmp_path):
    curves = {"one token per forward": [(1.0, 61.0)], "threshold": [(1.9, 55.0), (1.0, 61.0), (1.4, 59.5)],
              "distilled": [(1.0, 60.5), (3.2, 60.0), (4.1, 58.2)], "collapses": [(1.0, 60.0), (2.0, 30.0)]}
    out = plot_parallelism(curves, tmp_path / "sub" / "aup.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="curves"):
        plot_parallelism({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="curves"):
        plot_parallelism({"a": [(1.0, 2.0, 3.0)]}, tmp_path / "x.png")
    with pytest.raises(TypeError, match="curves"):
        plot_parallelism([(1.0, 60.0)], tmp_path / "x.png")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tokens_per_forward\[0\]"):
        plot_parallelism({"a": [(0.0, 60.0)]}, tmp_path / "x.png")


def test_plot_frontier_against_tokens_per_forward(tmp_path):
    def result(label, rates):
        summary = [{"steps": n, "genppl_mean": 40.0 + 5 * k, "genppl_std": 1.0, "entropy_mean": 5.0,
                    "entropy_std": 0.01, "num_seeds": 3, "tokens_per_forward": r}
                   for k, (n, r) in enumerate(zip((8, 4, 2), rates))]
        return FrontierResult(label=label, runs=[], summary=summary)

    out = plot_frontier([result("LowConfidence", [1.0, 2.0, 4.0]), result("threshold", [1.0, 1.3, 2.1])],
                        tmp_path / "genppl_tpf.png", x="tokens_per_forward")
    assert out.read_bytes()[:8] == PNG_MAGIC
    unrated = result("no rate", [1.0, 2.0, 4.0])
    unrated.summary[1]["tokens_per_forward"] = None
    with pytest.raises(ValueError, match="results"):
        plot_frontier([unrated], tmp_path / "x.png", x="tokens_per_forward")
    with pytest.raises(ValueError, match="x: expected"):
        plot_frontier([unrated], tmp_path / "x.png", x="speed")  # type: ignore[arg-type]
