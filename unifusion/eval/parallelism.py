"""Accuracy under parallelism (AUP): one number for a decoder's accuracy across its tokens-per-forward settings, and
the accuracy–parallelism frontier plotted as the parallel-decoding papers plot it.

**AUP** (d3LLM, ``hao-ai-lab/d3LLM``, ``AUP_leaderboard/aup_utils.py``). A decoder run at several settings gives points
(ρ_i, y_i): ρ the tokens per forward (TPF, the hardware-independent parallelism), y the accuracy in percent. Sorted by
ρ (a stable sort: ties keep their given order), with y_1 the accuracy at the smallest ρ and Δ (default 5 points) the
allowed drop:

    the curve may not fall more than Δ:     y_1 − y_n ≤ Δ        (y_n at the largest ρ; else a ValueError)
    points below y_1 − Δ are left out:       {i : y_i ≥ y_1 − Δ}   (renumbered 1 … m)
    W(y) = min(exp(−α (1 − y / y_max)), 1)   the quality weight, α = 3 by default
    AUP = ρ_1 y_1 + Σ_{i=2..m} ½ (ρ_i − ρ_{i−1}) (y_i W(y_i) + y_{i−1} W(y_{i−1}))

y_max is the best accuracy of *every* method compared on the task (so methods share one weight), not of this curve
alone: pass it. The first term is the rectangle under the slowest point, unweighted; the trapezoids discount accuracy
below y_max by e^{−α (1 − y/y_max)}, so speed bought with accuracy earns less than speed at the same accuracy. One
point gives ρ_1 y_1. :func:`accuracy_under_parallelism` equals d3LLM's ``get_aup`` on every recorded case
(``tests/eval/fixtures/d3llm_aup.json``: their code run, not copied — the repository has no licence).

**The plot** (:func:`plot_parallelism`): x = tokens per forward ρ, y = accuracy (%), one curve per method through its
settings, a marker at each and the method's name at its fastest point, the AUP in the legend — d3LLM's
``plot_aup_curve`` and dParallel's accuracy-vs-parallelism figures. For GenPPL against tokens per forward (a quality
where lower is better, no AUP) use :func:`~unifusion.eval.plot_frontier` with ``x="tokens_per_forward"`` on
:func:`~unifusion.eval.frontier` results run with a policy.

Example::

    points = {"LowConfidence": [(1.0, 62.0), (1.9, 55.5)], "distilled": [(1.0, 61.5), (3.4, 60.8)]}
    best = max(y for curve in points.values() for _, y in curve)
    aup = {name: uf.eval.accuracy_under_parallelism(*zip(*curve), max_accuracy=best) for name, curve in points.items()}
    uf.eval.plot_parallelism(points, "aup.png")
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["accuracy_under_parallelism", "aup_weight", "plot_parallelism"]


def _check_number(name: str, value: object, *, low: float, strict: bool = False, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    x = float(value)
    bad_low = x <= low if strict else x < low
    if not math.isfinite(x) or bad_low or (high is not None and x > high):
        span = f"{'(' if strict else '['}{low:g}, {'∞)' if high is None else f'{high:g}]'}"
        raise ValueError(f"{name}: expected a finite number in {span}, got {value!r}")
    return x


def _check_points(tokens_per_forward: object, accuracy: object) -> tuple[list[float], list[float]]:
    seqs = []
    for name, values in (("tokens_per_forward", tokens_per_forward), ("accuracy", accuracy)):
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"{name}: expected a sequence of numbers, got {type(values).__name__}")
        seqs.append(values)
    rho_in, y_in = seqs
    if len(rho_in) != len(y_in):
        raise ValueError(f"accuracy: expected one value per tokens_per_forward value ({len(rho_in)}), got "
                         f"{len(y_in)}")
    if not rho_in:
        raise ValueError("tokens_per_forward: expected at least one (tokens per forward, accuracy) point, got none")
    rho = [_check_number(f"tokens_per_forward[{i}]", v, low=0.0, strict=True) for i, v in enumerate(rho_in)]
    y = [_check_number(f"accuracy[{i}]", v, low=0.0, high=100.0) for i, v in enumerate(y_in)]
    return rho, y


def aup_weight(accuracy: float, max_accuracy: float, *, alpha: float = 3.0) -> float:
    """AUP's quality weight W(y) = min(exp(−α (1 − y / y_max)), 1): 1 at and above ``max_accuracy``, e^{−α} at 0."""
    y = _check_number("accuracy", accuracy, low=0.0, high=100.0)
    y_max = _check_number("max_accuracy", max_accuracy, low=0.0, strict=True)
    alpha = _check_number("alpha", alpha, low=0.0)
    return min(math.exp(-alpha * (1.0 - y / y_max)), 1.0)


def accuracy_under_parallelism(tokens_per_forward: Sequence[float], accuracy: Sequence[float], *,
                               max_accuracy: float, alpha: float = 3.0, max_drop: float = 5.0) -> float:
    """AUP of one decoder's (tokens per forward, accuracy) points (module docstring; d3LLM's ``get_aup``).

    Args:
        tokens_per_forward: ρ_i > 0 of each setting (any order).
        accuracy: y_i in percent, [0, 100], one per setting.
        max_accuracy: y_max > 0, the best accuracy of all methods compared on the task (the weight's reference).
        alpha: α ≥ 0, how hard accuracy below y_max is discounted (0: plain trapezoids).
        max_drop: Δ ≥ 0, the accuracy drop allowed from the slowest point: points below y_1 − Δ are left out.

    Returns:
        AUP in percent × tokens per forward.

    Raises:
        ValueError: an empty or mismatched pair of sequences, a ρ ≤ 0, an accuracy outside [0, 100], the fastest
            point more than ``max_drop`` below the slowest (``accuracy``), or a bad ``max_accuracy``, ``alpha`` or
            ``max_drop``.
    """
    rho, y = _check_points(tokens_per_forward, accuracy)
    y_max = _check_number("max_accuracy", max_accuracy, low=0.0, strict=True)
    alpha = _check_number("alpha", alpha, low=0.0)
    drop = _check_number("max_drop", max_drop, low=0.0)
    order = sorted(range(len(rho)), key=lambda i: rho[i])  # stable: ties keep their given order
    rho, y = [rho[i] for i in order], [y[i] for i in order]
    y_1 = y[0]
    if y_1 - y[-1] > drop:
        raise ValueError(f"accuracy: the fastest point ({rho[-1]:g} tokens/forward, {y[-1]:g} %) is more than "
                         f"max_drop = {drop:g} points below the slowest ({rho[0]:g}, {y_1:g} %); AUP is undefined "
                         "for a curve that falls that far")
    kept = [(r, acc) for r, acc in zip(rho, y) if acc >= y_1 - drop]

    def weighted(acc: float) -> float:
        return acc * aup_weight(acc, y_max, alpha=alpha)

    aup = kept[0][0] * kept[0][1]
    for (rho_prev, y_prev), (rho_i, y_i) in zip(kept, kept[1:]):
        aup += 0.5 * (rho_i - rho_prev) * (weighted(y_i) + weighted(y_prev))
    return aup


def plot_parallelism(curves: Mapping[str, Sequence[tuple[float, float]]], out_png: str | os.PathLike[str], *,
                     max_accuracy: float | None = None, alpha: float = 3.0, max_drop: float = 5.0,
                     title: str | None = "Accuracy under parallelism") -> Path:
    """Accuracy against tokens per forward, one curve per method, the AUP in the legend (module docstring).

    Args:
        curves: ``{method: [(tokens per forward, accuracy %), ...]}``; a method with one point is a single marker.
        out_png: the image to write (its folder is created).
        max_accuracy: AUP's y_max; default the best accuracy over all curves (d3LLM's choice per task).
        alpha: AUP's α (:func:`accuracy_under_parallelism`).
        max_drop: AUP's Δ; a curve that falls more than Δ has no AUP, and its legend entry says so.
        title: the axes title (``None`` for none).

    Returns:
        The path written.
    """
    if not isinstance(curves, Mapping):
        raise TypeError(f"curves: expected a mapping {{method: [(tokens per forward, accuracy), ...]}}, got "
                        f"{type(curves).__name__}")
    if not curves:
        raise ValueError("curves: expected at least one method, got none")
    points: dict[str, tuple[list[float], list[float]]] = {}
    for name, pairs in curves.items():
        if not isinstance(name, str):
            raise TypeError(f"curves: expected method names (str) as keys, got {type(name).__name__}")
        if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence) or not all(
                isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
            raise ValueError(f"curves: expected {name!r} to map to (tokens per forward, accuracy) pairs, got "
                             f"{pairs!r}")
        rho, y = _check_points([p[0] for p in pairs], [p[1] for p in pairs])
        order = sorted(range(len(rho)), key=lambda i: rho[i])
        points[name] = ([rho[i] for i in order], [y[i] for i in order])
    y_max = max(max(y) for _, y in points.values()) if max_accuracy is None else max_accuracy
    if y_max <= 0:  # every accuracy 0: the weight has no reference; any positive one gives the same AUP
        y_max = 1.0
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 5.0), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, (rho, y) in points.items():
        try:
            aup = accuracy_under_parallelism(rho, y, max_accuracy=y_max, alpha=alpha, max_drop=max_drop)
            label = f"{name} (AUP {aup:.1f})"
        except ValueError as err:
            if "max_drop" not in str(err):
                raise
            label = f"{name} (AUP n/a: drops > {max_drop:g} points)"
        line = ax.plot(rho, y, marker="o", markersize=5, linewidth=1.8, label=label)[0]
        ax.annotate(name, (rho[-1], y[-1]), textcoords="offset points", xytext=(6, 0), va="center", fontsize=8,
                    fontweight="bold", color=line.get_color())
    ax.set_xlabel("parallelism ρ (tokens per forward)")
    ax.set_ylabel("accuracy (%)")
    if title:
        ax.set_title(title, loc="left")
    ax.margins(x=0.15, y=0.1)
    ax.grid(True, linestyle="--", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
