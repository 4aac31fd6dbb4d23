"""The perplexity–entropy frontier (paper §4.3, App. C.3).

For each sampling budget N in ``steps`` and each seed: draw ``num_samples`` unconditional samples of ``seq_len``
tokens, decode them, score them with a judge LM (:func:`~unifusion.eval.generative_perplexity`, pooled within the
seed) and retokenize them with GPT-2's tokenizer for the per-sample unigram entropy Ĥ
(:func:`~unifusion.eval.unigram_entropy`, averaged within the seed). Per N the reported values are the arithmetic
mean and the sample standard deviation (ddof = 1) of the per-seed GenPPLs and entropies (std = 0 with one seed).

The plot puts entropy on x and GenPPL on an inverted log y axis, so *better* (low GenPPL, high entropy) is the top
right; each model is one curve through its N points, labelled by N, with error bars of one std over seeds.
:func:`plot_frontier` overlays several models or checkpoints from results or the JSON files :func:`frontier` writes.

Example::

    res = uf.eval.frontier(model, kernel, num_samples=64, seq_len=128, judge_model=judge, judge_tokenizer=judge_tok,
                           tokenizer=tok, out_dir="runs/frontier", label="step-5000")
    uf.eval.plot_frontier(["runs/frontier/step-1000_frontier.json", res], "overlay.png")
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .._validation import check_model_kernel, check_positive_int
from ..denoiser import CausalLM, X0Model
from ..kernels import Kernel, check_kernel
from ..samplers import BayesianSampler, EulerSampler, PolicySampler
from ._shared import input_device, progress_bar
from .quality import generative_perplexity, gpt2_tokenizer, unigram_entropy

__all__ = ["FrontierResult", "PolicyFrontierSampler", "frontier", "plot_frontier", "DEFAULT_STEPS", "DEFAULT_SEEDS"]

DEFAULT_STEPS = (16, 32, 64, 128, 256)
DEFAULT_SEEDS = (123, 456, 789, 2024, 3407)
SamplerFactory = Callable[[X0Model, Kernel, int], Any]


@dataclass
class FrontierResult:
    """What :func:`frontier` measured.

    Attributes:
        label: the curve's name.
        runs: one dict per (steps, seed): ``steps, seed, genppl, entropy, num_samples, num_tokens``.
        summary: one dict per steps: ``steps, genppl_mean, genppl_std, entropy_mean, entropy_std, num_seeds``.
        config: the arguments that define the run (sampler, seq_len, num_samples, ...).
        paths: files written (``json``, ``csv``, ``runs_csv``, ``samples``, ``png``).
    """

    label: str
    runs: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "summary": self.summary, "runs": self.runs, "config": self.config,
                "paths": self.paths}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FrontierResult:
        for key in ("label", "summary"):
            if key not in data:
                raise ValueError(f"results: a frontier result needs {key!r}; got keys {sorted(data)}")
        return cls(label=data["label"], runs=list(data.get("runs", [])), summary=list(data["summary"]),
                   config=dict(data.get("config", {})), paths=dict(data.get("paths", {})))

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> FrontierResult:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def table(self) -> str:
        """The summary as a plain-text table."""
        rated = any("tokens_per_forward" in row for row in self.summary)
        lines = [f"{self.label}", f"{'steps':>6}  {'GenPPL':>20}  {'entropy (nats)':>20}  seeds"
                 + ("  tokens/forward" if rated else "")]
        for row in self.summary:
            rate = row.get("tokens_per_forward")
            lines.append(f"{row['steps']:>6}  {row['genppl_mean']:>11.3f} ± {row['genppl_std']:<7.3f}  "
                         f"{row['entropy_mean']:>11.4f} ± {row['entropy_std']:<7.4f}  {row['num_seeds']:>5}"
                         + (f"  {rate:14.2f}" if rate is not None else ""))
        return "\n".join(lines)


def _check_int_list(name: str, values: object, *, minimum: int) -> tuple[int, ...]:
    kind = "positive" if minimum == 1 else "non-negative"
    if isinstance(values, (int, str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name}: expected a sequence of {kind} ints, got {type(values).__name__}")
    out = tuple(values)
    if not out:
        raise ValueError(f"{name}: expected at least one value, got an empty sequence")
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"{name}: expected {kind} ints, got {v!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: expected distinct values, got {list(out)}")
    return out


def make_sampler(sampler: str | SamplerFactory, model: X0Model, kernel: Kernel, num_steps: int,
                 sampler_kwargs: dict[str, Any]) -> Any:
    """The sampler ``sampler`` names (``"bayesian"``, ``"euler"``) or a factory ``(model, kernel, num_steps,
    **sampler_kwargs) -> sampler`` builds, with ``num_steps`` steps (what :func:`frontier` and ``unifusion sample``
    run)."""
    if callable(sampler):
        return sampler(model, kernel, num_steps, **sampler_kwargs)
    if sampler == "bayesian":
        return BayesianSampler(model, kernel, num_steps, **sampler_kwargs)
    if sampler == "euler":
        return EulerSampler(model, kernel, num_steps, **sampler_kwargs)
    raise ValueError(f"sampler: expected 'bayesian', 'euler' or a factory (model, kernel, num_steps) -> sampler, "
                     f"got {sampler!r}")


class PolicyFrontierSampler:
    """A frontier sampler that decodes with a policy: ``sample(batch_size, seq_len, generator=)`` draws unconditional
    samples by block decoding (``model.generate(policy=...)`` for a :class:`~unifusion.hf.DiffusionLM`, else
    :class:`~unifusion.samplers.PolicySampler` on the x0 callable), ``num_steps`` steps per block, and keeps
    :attr:`tokens_per_forward` (all generated tokens / all forwards so far)."""

    def __init__(self, model: X0Model, kernel: Kernel, num_steps: int, *, policy: Any, block_size: int | None = None,
                 **sampler_kwargs: Any) -> None:
        self.model, self.kernel, self.num_steps, self.policy = model, kernel, num_steps, policy
        self.block_size, self.kwargs = block_size, sampler_kwargs
        self.tokens = self.forwards = 0
        generate = getattr(model, "generate", None)  # a model that generates itself (DiffusionLM.generate)
        self._generate: Callable[..., Any] | None = generate if callable(generate) else None
        self._sampler = None if self._generate is not None else PolicySampler(
            model, kernel, policy, num_steps=num_steps, block_size=block_size, **sampler_kwargs)

    @classmethod
    def factory(cls, policy: Any, block_size: int | None) -> SamplerFactory:
        """A ``sampler=`` factory ``(model, kernel, num_steps, **kw) -> PolicyFrontierSampler``."""
        def make(model: X0Model, kernel: Kernel, num_steps: int, **kw: Any) -> PolicyFrontierSampler:
            return cls(model, kernel, num_steps, policy=policy, block_size=block_size, **kw)

        make.__name__ = f"policy:{type(policy).__name__}"
        return make

    @property
    def tokens_per_forward(self) -> float | None:
        return self.tokens / self.forwards if self.forwards else None

    def sample(self, batch_size: int, seq_len: int, *, generator: Any = None) -> torch.Tensor:
        out: Any
        if self._generate is None:
            assert self._sampler is not None  # built in __init__ for a model that does not generate itself
            out = self._sampler.sample(batch_size, seq_len, generator=generator, return_dict=True)
        else:
            empty = torch.zeros((batch_size, 0), dtype=torch.long, device=generator.device if generator is not None
                                else None)
            out = self._generate(empty, max_new_tokens=seq_len, policy=self.policy, num_steps=self.num_steps,
                                 block_size=self.block_size, kernel=self.kernel, eos_token_id=None,
                                 generator=generator, return_dict=True, **self.kwargs)
        self.tokens += int((out.tokens_per_forward * out.num_forwards).round().sum())
        self.forwards += int(out.num_forwards.sum())
        return out.sequences


def decode_samples(samples: torch.Tensor, tokenizer: Any, *, mask_token_id: int | None = None) -> list[str]:
    """Decode ``(B, L)`` ids to text, dropping a mask id and ids the tokenizer does not know (an added mask row)."""
    size = len(tokenizer)
    texts = []
    for row in samples.tolist():
        ids = [i for i in row if i < size and i != mask_token_id]
        texts.append(tokenizer.decode(ids))
    return texts


def _safe_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") or "model"


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def frontier(model: X0Model, kernel: Kernel, *, steps: Sequence[int] = DEFAULT_STEPS,
             seeds: Sequence[int] = DEFAULT_SEEDS, num_samples: int, seq_len: int, judge_model: CausalLM,
             judge_tokenizer: Any, tokenizer: Any, sampler: str | SamplerFactory = "bayesian",
             out_dir: str | os.PathLike[str], label: str = "model", batch_size: int = 16, judge_batch_size: int = 8,
             entropy_tokenizer: Any = None, sampler_kwargs: dict[str, Any] | None = None, plot: bool = True,
             progress: bool = True, resume: bool = False, policy: Any = None,
             block_size: int | None = None) -> FrontierResult:
    """Sample, score and summarise one model's GenPPL–entropy frontier (App. C.3's protocol); write it to disk.

    Args:
        model: x0 model ``(x_t (B, L), t (B,)) -> logits``.
        kernel: its forward kernel.
        steps: sampling budgets N (positive ints; the paper: 16 … 256).
        seeds: one generator seed per repetition (non-negative ints; the paper: 123, 456, 789, 2024, 3407).
        num_samples: samples per (steps, seed) (the paper: 1024).
        seq_len: tokens per sample (the paper: 512 small / 1024 medium).
        judge_model: the GenPPL judge causal LM (the paper: GPT-2 large).
        judge_tokenizer: the judge's tokenizer.
        tokenizer: decodes the model's samples to text.
        sampler: ``"bayesian"`` (Algorithm 2), ``"euler"``, or a factory ``(model, kernel, num_steps, **kw)`` returning
            an object with ``.sample(batch_size, seq_len, generator=...)``.
        out_dir: folder for ``{label}_frontier.json``, ``{label}_frontier.csv`` (summary), ``{label}_runs.csv``,
            ``{label}_samples.jsonl`` (one line per sample: steps, seed, index, entropy, text) and
            ``{label}_frontier.png``.
        label: the curve's name (also the file prefix, sanitised).
        batch_size: samples drawn per sampler call; judge_batch_size: texts per judge forward.
        entropy_tokenizer: tokenizer for Ĥ; default GPT-2's (:func:`~unifusion.eval.gpt2_tokenizer`).
        sampler_kwargs: extra keyword arguments for the sampler (``temperature``, ``top_p``, ``eps``, ...).
        plot: write the PNG (needs matplotlib).
        progress: progress bars.
        policy: a :class:`~unifusion.samplers.policies.DecodingPolicy`: sample by block decoding
            (:class:`PolicyFrontierSampler`; a :class:`~unifusion.hf.DiffusionLM` through its ``generate``, so a block
            model uses its KV cache) instead of ``sampler``; ``steps`` are then steps per block, and every run
            reports ``tokens_per_forward`` (generated tokens / forwards, pooled over the run's samples).
        block_size: positions per block with ``policy`` (a block model: its own).
        resume: continue a stopped run: the (steps, seed) points already complete in ``{label}_samples.jsonl``
            (``num_samples`` lines with indices 0 … num_samples − 1) are not sampled again; their GenPPL and entropy
            are computed from the saved texts, as a full run computes them from the same texts, so the result equals
            an uninterrupted run's. Incomplete points (a run stopped while writing) are dropped and redrawn.

    Returns:
        :class:`FrontierResult`; ``print(result.table())`` shows the summary.

    Randomness: each (steps, seed) run uses ``torch.Generator(device).manual_seed(seed)`` on the model's device, so
    a run is reproducible on its own and seeds are shared across budgets.
    """
    steps = _check_int_list("steps", steps, minimum=1)
    seeds = _check_int_list("seeds", seeds, minimum=0)
    num_samples = check_positive_int("num_samples", num_samples)
    seq_len = check_positive_int("seq_len", seq_len)
    batch_size = check_positive_int("batch_size", batch_size)
    judge_batch_size = check_positive_int("judge_batch_size", judge_batch_size)
    kernel = check_kernel(kernel)
    if not isinstance(resume, bool):
        raise TypeError(f"resume: expected a bool, got {type(resume).__name__}")
    if not isinstance(label, str) or not label:
        raise ValueError(f"label: expected a non-empty string, got {label!r}")
    sampler_kwargs = dict(sampler_kwargs or {})
    if policy is not None:
        sampler = PolicyFrontierSampler.factory(policy, block_size)
    elif block_size is not None:
        raise ValueError("block_size: block decoding needs a policy (policy=LowConfidence(), ...)")
    # the head the sampler reads: x0 logits for "bayesian", the parameterization argument for "euler"; a factory's
    # sampler checks its own
    head = None if callable(sampler) else sampler_kwargs.get("parameterization", "x0") if sampler == "euler" else "x0"
    check_model_kernel(model, kernel, parameterization=head if isinstance(head, str) else None, who="frontier",
                       argument=sampler == "euler")
    ent_tok = entropy_tokenizer if entropy_tokenizer is not None else gpt2_tokenizer()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = _safe_label(label)
    paths = {"json": out / f"{prefix}_frontier.json", "csv": out / f"{prefix}_frontier.csv",
             "runs_csv": out / f"{prefix}_runs.csv", "samples": out / f"{prefix}_samples.jsonl"}
    if plot:
        paths["png"] = out / f"{prefix}_frontier.png"
    device = input_device(model)

    runs: list[dict[str, Any]] = []
    grid = [(n, s) for n in steps for s in seeds]
    done = _complete_points(paths["samples"], num_samples) if resume else {}
    with open(paths["samples"], "w") as sample_file:
        for rows in done.values():  # kept as they were; the points of this grid are read from them below
            sample_file.writelines(line for line, _ in rows)
        sample_file.flush()
        for num_steps, seed in progress_bar(grid, enabled=progress, desc=f"frontier {label}"):
            if (num_steps, seed) in done:
                texts = [text for _, text in done[(num_steps, seed)]]
            else:
                smp = make_sampler(sampler, model, kernel, num_steps, sampler_kwargs)
                generator = torch.Generator(device=device).manual_seed(seed)
                chunks = []
                for k in range(0, num_samples, batch_size):
                    b = min(batch_size, num_samples - k)
                    chunks.append(smp.sample(b, seq_len, generator=generator).cpu())
                ids = torch.cat(chunks)  # (num_samples, seq_len)
                texts = decode_samples(ids, tokenizer, mask_token_id=kernel.mask_id)
            ppl = generative_perplexity(texts, judge_model, judge_tokenizer, batch_size=judge_batch_size,
                                        progress=False)
            retok = [list(r) for r in ent_tok(texts, add_special_tokens=False)["input_ids"]]
            H = unigram_entropy(retok)  # (num_samples,)
            runs.append({"steps": num_steps, "seed": seed, "genppl": ppl.perplexity, "entropy": float(H.mean()),
                         "num_samples": num_samples, "num_tokens": ppl.num_tokens})
            if policy is not None:  # resumed points were not sampled in this run: their rate is unknown
                rate = None if (num_steps, seed) in done else getattr(smp, "tokens_per_forward", None)
                runs[-1]["tokens_per_forward"] = rate
            if (num_steps, seed) in done:
                continue
            for i, (text, h) in enumerate(zip(texts, H.tolist())):
                sample_file.write(json.dumps({"steps": num_steps, "seed": seed, "index": i, "entropy": h,
                                              "text": text}) + "\n")
            sample_file.flush()  # one grid point at a time: progress is visible and a crash keeps what was drawn

    summary: list[dict[str, Any]] = []
    for num_steps in steps:
        mine = [r for r in runs if r["steps"] == num_steps]
        g = [r["genppl"] for r in mine]
        h = [r["entropy"] for r in mine]
        summary.append({"steps": num_steps, "genppl_mean": statistics.fmean(g), "genppl_std": _std(g),
                        "entropy_mean": statistics.fmean(h), "entropy_std": _std(h), "num_seeds": len(mine)})
        rates = [r["tokens_per_forward"] for r in mine if r.get("tokens_per_forward") is not None]
        if policy is not None:
            summary[-1]["tokens_per_forward"] = statistics.fmean(rates) if rates else None
    sampler_name = sampler if isinstance(sampler, str) else getattr(sampler, "__name__", type(sampler).__name__)
    config = {"steps": list(steps), "seeds": list(seeds), "num_samples": num_samples, "seq_len": seq_len,
              "sampler": sampler_name, "sampler_kwargs": {k: repr(v) for k, v in sampler_kwargs.items()},
              "kernel": repr(kernel), "judge": type(judge_model).__name__,
              "judge_name": getattr(getattr(judge_model, "config", None), "_name_or_path", None)}
    result = FrontierResult(label=label, runs=runs, summary=summary, config=config,
                            paths={k: str(v) for k, v in paths.items()})

    _write_csv(paths["csv"], summary)
    _write_csv(paths["runs_csv"], runs)
    with open(paths["json"], "w") as f:
        json.dump(result.to_dict(), f, indent=2)
    if plot:
        plot_frontier([result], paths["png"])
    return result


def _complete_points(path: Path, num_samples: int) -> dict[tuple[int, int], list[tuple[str, str]]]:
    """The (line, text) pairs of ``path`` (a samples file) grouped by (steps, seed), for the points with exactly the
    sample indices 0 … num_samples − 1 (in file order); empty when the file does not exist. Unreadable lines (a run
    stopped mid-line) and incomplete points are left out."""
    if not path.is_file():
        return {}
    points: dict[tuple[int, int], list[tuple[int, str, str]]] = {}
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
                key, index, text = (int(row["steps"]), int(row["seed"])), int(row["index"]), str(row["text"])
            except (ValueError, KeyError, TypeError):
                continue
            points.setdefault(key, []).append((index, line if line.endswith("\n") else line + "\n", text))
    return {key: [(line, text) for _, line, text in rows] for key, rows in points.items()
            if [index for index, _, _ in rows] == list(range(num_samples))}


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _as_result(item: object) -> FrontierResult:
    if isinstance(item, FrontierResult):
        return item
    if isinstance(item, dict):
        return FrontierResult.from_dict(item)
    if isinstance(item, (str, os.PathLike)):
        path = Path(item)
        if not path.is_file():
            raise ValueError(f"results: expected a frontier JSON file, got {str(path)!r} (no such file)")
        return FrontierResult.from_json(path)
    raise TypeError(f"results: expected FrontierResult, dict or JSON path items, got {type(item).__name__}")


def _minor_log_label(value: float, _pos: int) -> str:
    """Label minor log ticks at 2·10^k, 3·10^k and 5·10^k only."""
    if value <= 0:
        return ""
    lead = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return f"{value:g}" if any(abs(lead - d) < 1e-6 for d in (2, 3, 5)) else ""


def plot_frontier(results: Sequence[FrontierResult | dict[str, Any] | str | os.PathLike[str]] | FrontierResult
                  | str | os.PathLike[str], out_png: str | os.PathLike[str], *,
                  labels: Sequence[str] | None = None, title: str | None = "auto",
                  x: Literal["entropy", "tokens_per_forward"] = "entropy") -> Path:
    """Overlay the frontiers of several models or checkpoints in one PNG.

    Args:
        results: :class:`FrontierResult`\\ s, their ``to_dict()`` dicts, or paths to the ``*_frontier.json`` files
            :func:`frontier` writes (a single one is accepted too).
        out_png: the image to write.
        labels: curve names overriding each result's ``label``.
        title: axes title (``None`` for none; ``"auto"``: "GenPPL–entropy frontier", or "GenPPL under
            parallelism" for ``x="tokens_per_forward"``).
        x: the x axis: ``"entropy"``, the mean unigram entropy (nats; error bars one std over seeds), or
            ``"tokens_per_forward"``, the decoder's parallelism — the speed/quality frontier of results run with a
            ``policy`` (every summary row then needs ``tokens_per_forward``); accuracy against tokens per forward is
            :func:`~unifusion.eval.plot_parallelism`.

    Axes: x as chosen, y = GenPPL on an inverted log scale; points labelled by steps; error bars one std over seeds;
    an arrow marks *better* (top right: low GenPPL, high entropy or more tokens per forward).
    """
    if x not in ("entropy", "tokens_per_forward"):
        raise ValueError(f"x: expected 'entropy' or 'tokens_per_forward', got {x!r}")
    if title == "auto":
        title = "GenPPL under parallelism" if x == "tokens_per_forward" else "GenPPL–entropy frontier"
    if isinstance(results, (FrontierResult, str, os.PathLike, dict)):
        results = [results]
    items = [_as_result(r) for r in results]
    if not items:
        raise ValueError("results: expected at least one frontier result")
    if labels is not None:
        labels = list(labels)
        if len(labels) != len(items):
            raise ValueError(f"labels: expected {len(items)} labels (one per result), got {len(labels)}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, ScalarFormatter

    fig = Figure(figsize=(7.0, 5.0), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for k, res in enumerate(items):
        if x == "tokens_per_forward" and any(r.get("tokens_per_forward") is None for r in res.summary):
            raise ValueError(f"results: x='tokens_per_forward' needs every summary row's tokens_per_forward (a "
                             f"frontier run with a policy); {res.label!r} lacks it")
        rows = sorted(res.summary, key=lambda r: r["tokens_per_forward"] if x == "tokens_per_forward" else r["steps"])
        xs = [r["tokens_per_forward"] if x == "tokens_per_forward" else r["entropy_mean"] for r in rows]
        y = [r["genppl_mean"] for r in rows]
        xerr = None if x == "tokens_per_forward" else [r["entropy_std"] for r in rows]
        bars = ax.errorbar(xs, y, xerr=xerr, yerr=[r["genppl_std"] for r in rows],
                           marker="o", markersize=4, linewidth=1.4, capsize=2.5,
                           label=labels[k] if labels is not None else res.label)
        color = bars.lines[0].get_color()
        for r, x_r in zip(rows, xs):
            ax.annotate(str(r["steps"]), (x_r, r["genppl_mean"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7, color=color)
    ax.set_yscale("log")
    ax.invert_yaxis()
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(FuncFormatter(_minor_log_label))
    ax.margins(0.08)
    values = [r["genppl_mean"] for res in items for r in res.summary if r["genppl_mean"] > 0]
    if values and max(values) / min(values) < 3.0:
        # less than half a decade: log ticks would fall outside the data, so label a few values inside it
        from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

        lo, hi = ax.get_ylim()[::-1] if ax.yaxis_inverted() else ax.get_ylim()
        ticks = [float(f"{v:.3g}") for v in (lo * (hi / lo) ** (k / 4) for k in range(5))]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("parallelism (tokens per forward)" if x == "tokens_per_forward"
                  else "mean unigram entropy (nats, GPT-2 tokens)")
    ax.set_ylabel("generative perplexity (log scale, inverted)")
    if title:
        ax.set_title(title, loc="left")
    ax.grid(True, which="both", alpha=0.25)
    # "better" = low GenPPL (top, the axis is inverted) and high entropy (right): an arrow above the top-right corner
    ax.annotate("better", xy=(1.0, 1.07), xytext=(0.84, 1.015), xycoords="axes fraction", textcoords="axes fraction",
                fontsize=10, fontweight="bold", fontstyle="italic", annotation_clip=False,
                arrowprops={"arrowstyle": "-|>", "lw": 1.5, "color": "black"})
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
