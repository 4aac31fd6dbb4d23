"""A verifiable task for RL on a CPU: small integer problems with exact rewards and a fixed held-out split.

Four kinds, on operands of ``digits`` digits (no leading zero), each a short prompt whose answer is a handful of
tokens::

    kind        prompt               completion
    "add"       "47+38="             "85"        a + b, with carries
    "add_sub"   "47+38-12="          "73"        a + b − c, the result kept ≥ 0
    "max"       "max(47,38,91)="     "91"        the largest of a, b, c
    "median"    "median(47,38,91)="  "47"        the middle one of a, b, c

(the completion is the answer's digits; the trainer appends the tokenizer's EOS; ``"085"`` with
``pad_answers=True``, zero-padded to the width of the kind's largest answer).

**Which kind for what.** The addition kinds are the harder tasks: SmolLM2-135M adapted to a block-diffusion model
does not learn them from a few hundred SFT updates, so on a CPU its accuracy stays at a few percent and GRPO's groups
are nearly all wrong (``docs/guides/rl.md``). The comparison kinds are what such a model learns within minutes:
``"max"`` goes from ≈ 17 % before any SFT to 56–80 % after 8 updates (three seeds), the start where groups
disagree and GRPO has a gradient; ``"median"`` (two comparisons) stays near 50 % over the first 30 updates. Every
answer of ``"max"`` and ``"median"`` is one of the prompt's numbers, so a model that copies one at random scores 1/3.

**Padded answers** (``make_problems(..., pad_answers=True)``): every completion has the same number of digits
(:func:`answer_width`: ``digits + 1`` for the addition kinds, up to 198 for 2-digit ``"add"``; ``digits`` for the
comparison kinds), so each position of the answer is one digit place — hundreds, tens, units — whatever the
answer. A model that fills the answer's positions in parallel (a block-diffusion model) then
does not have to decide the answer's length before it can place a digit; the reward is unchanged (``"085"``'s
first number is 85).

**Split.** Each operand tuple belongs to one split for good: it is held out when the first byte of
``blake2b("add:47,38")`` (the kind and the operands, in the prompt's order) is below 26 (≈ 10 %), so
``split="test"`` never shares a problem with ``split="train"``, whatever ``n`` and ``seed``, on every Python version
and machine. ``make_problems(n, seed,
split)`` enumerates the split's tuples in a fixed order, shuffles them with ``random.Random(seed)`` and returns the
first n: distinct problems, the same ones for the same arguments.

**Reward** (:func:`reward`): 1.0 when the *first* number in the completion (an optional minus sign, digits, an
optional decimal part) equals the answer, else 0.0 — ``"85"``, ``" 85\\n"``, ``"85.0"`` and ``"85, since ..."``
score 1; ``"850"``, ``"8 5"``, ``"-85"``, ``"84 85"`` and ``""`` score 0. ``format_weight`` (default 0, exact) gives
a wrong but well-formed answer (the completion, stripped, is a bare integer) that much instead of 0.

Example::

    from unifusion.data import arithmetic

    train = arithmetic.make_problems(1000, seed=0)
    test = arithmetic.make_problems(200, seed=0, split="test")
    p = train[0]
    p.prompt, p.completion               # ('34+67=', '101')
    arithmetic.reward(" 101", p)         # 1.0
    arithmetic.rewards(["101", "102"], [p, p])   # [1.0, 0.0]
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

__all__ = ["KINDS", "SPLITS", "ArithmeticProblem", "Kind", "answer_width", "make_problems", "reward", "rewards",
           "split_of", "split_size"]

KINDS = ("add", "add_sub", "max", "median")
"""The problem kinds: ``"add"`` (a + b), ``"add_sub"`` (a + b − c ≥ 0), ``"max"`` (the largest of a, b, c) and
``"median"`` (the middle one of a, b, c)."""

Kind = Literal["add", "add_sub", "max", "median"]

SPLITS = ("train", "test")
"""The two splits; every operand tuple is in exactly one (:func:`split_of`)."""

_MAX_DIGITS = {"add": 3, "add_sub": 2, "max": 2, "median": 2}  # the split enumerates every tuple: ≤ 810,000 of them
_COMPARISONS = ("max", "median")
_TEST_THRESHOLD = 26  # first hash byte below this: held out (26/256 ≈ 10.2 %)
_FIRST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BARE_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class ArithmeticProblem:
    """One problem: its operands, kind and exact answer.

    Attributes:
        operands: ``(a, b)`` for ``"add"``, ``(a, b, c)`` for the other kinds.
        kind: one of :data:`KINDS`.
        answer: the exact result.
        width: the completion's digits: the answer zero-padded on the left to this width (0: unpadded).
    """

    operands: tuple[int, ...]
    kind: str
    answer: int
    width: int = 0

    @property
    def prompt(self) -> str:
        """The question, e.g. ``"47+38="``, ``"47+38-12="`` or ``"max(47,38,91)="``."""
        if self.kind in _COMPARISONS:
            return self.kind + "(" + ",".join(str(x) for x in self.operands) + ")="
        a, b, *rest = self.operands
        return f"{a}+{b}" + "".join(f"-{c}" for c in rest) + "="

    @property
    def completion(self) -> str:
        """The target answer text for supervised fine-tuning, e.g. ``"85"``, or ``"085"`` at ``width=3`` (append
        the tokenizer's EOS)."""
        return str(self.answer).zfill(self.width)

    def as_dict(self) -> dict[str, object]:
        """``{"prompt", "completion", "answer", "operands", "kind"}``: a row for a ``datasets.Dataset`` (TRL reads
        ``prompt``; reward functions get the other columns as keyword arguments)."""
        return {"prompt": self.prompt, "completion": self.completion, "answer": self.answer,
                "operands": list(self.operands), "kind": self.kind}


def _check_kind(kind: object) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    return str(kind)


def _check_digits(digits: object, kind: str) -> int:
    top = _MAX_DIGITS[kind]
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= top:
        raise ValueError(f"digits: expected an int in [1, {top}] for kind={kind!r} (operands of that many digits), "
                         f"got {digits!r}")
    return digits


def split_of(operands: Sequence[int], kind: str = "add") -> str:
    """``"test"`` or ``"train"``: the split the operand tuple belongs to (the module docstring's hash rule)."""
    kind = _check_kind(kind)
    key = f"{kind}:{','.join(str(int(x)) for x in operands)}".encode()
    return "test" if hashlib.blake2b(key, digest_size=8).digest()[0] < _TEST_THRESHOLD else "train"


def _operand_range(digits: int) -> range:
    return range(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits)


@lru_cache(maxsize=16)
def _pool(kind: str, digits: int, split: str) -> tuple[tuple[int, ...], ...]:
    """Every operand tuple of the split, in lexicographic order."""
    r = _operand_range(digits)
    tuples: Iterable[tuple[int, ...]]
    if kind == "add":
        tuples = itertools.product(r, r)
    elif kind in _COMPARISONS:
        tuples = itertools.product(r, r, r)
    else:
        tuples = ((a, b, c) for a, b, c in itertools.product(r, r, r) if a + b - c >= 0)
    return tuple(t for t in tuples if split_of(t, kind) == split)


def split_size(split: str = "train", *, kind: str = "add", digits: int = 2) -> int:
    """How many distinct problems the split holds (``make_problems``'s largest ``n``)."""
    kind = _check_kind(kind)
    return len(_pool(kind, _check_digits(digits, kind), _check_split(split)))


def _check_split(split: object) -> str:
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    return str(split)


def answer_width(kind: str = "add", digits: int = 2) -> int:
    """The digits of the kind's largest answer (``pad_answers``' width): ``digits + 1`` for the addition kinds,
    ``digits`` for the comparison kinds."""
    kind = _check_kind(kind)
    top = 10 ** _check_digits(digits, kind) - 1
    return len(str(top if kind in _COMPARISONS else 2 * top))


def make_problems(n: int, seed: int = 0, split: Literal["train", "test"] = "train", *,
                  kind: Kind = "add", digits: int = 2,
                  pad_answers: bool = False) -> list[ArithmeticProblem]:
    """``n`` distinct problems of the split, in an order fixed by ``seed`` (module docstring).

    Args:
        n: how many (at most :func:`split_size`; 2-digit ``"add"``: 7,294 train, 806 test).
        seed: the shuffle's seed.
        split: ``"train"`` or ``"test"`` (held out; never overlaps train).
        kind: one of :data:`KINDS` (module docstring).
        digits: digits of every operand (2: operands 10–99); 1 to 3 for ``"add"``, 1 or 2 for the three-operand
            kinds (the split is made by enumerating every operand tuple once per process: a 2-digit three-operand
            kind takes seconds).
        pad_answers: zero-pad every completion to :func:`answer_width` digits (module docstring); the problems,
            answers and rewards are the same.

    Raises:
        ValueError: an unknown split or kind, ``digits`` out of range, ``n`` negative or above the split's size.
    """
    kind_ = _check_kind(kind)
    digits, split_ = _check_digits(digits, kind_), _check_split(split)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if not isinstance(pad_answers, bool):
        raise TypeError(f"pad_answers: expected a bool, got {type(pad_answers).__name__}")
    width = answer_width(kind_, digits) if pad_answers else 0
    pool = _pool(kind_, digits, split_)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(pool):
        raise ValueError(f"n: expected an int in [0, {len(pool)}] (the {split_} split of {digits}-digit {kind_!r} "
                         f"problems), got {n!r}")
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order[:n]:
        ops = pool[i]
        out.append(ArithmeticProblem(operands=ops, kind=kind_, answer=_answer(kind_, ops), width=width))
    return out


def _answer(kind: str, operands: tuple[int, ...]) -> int:
    if kind == "add":
        return operands[0] + operands[1]
    if kind == "add_sub":
        return operands[0] + operands[1] - operands[2]
    if kind == "max":
        return max(operands)
    return sorted(operands)[1]  # median


def reward(completion: str, problem: ArithmeticProblem, *, format_weight: float = 0.0) -> float:
    """The exact reward of one completion (module docstring): 1.0 if its first number is the answer; else
    ``format_weight`` if the stripped completion is a bare integer, else 0.0.

    Raises:
        TypeError: ``completion`` is not a ``str`` or ``problem`` not an :class:`ArithmeticProblem`.
        ValueError: ``format_weight`` outside [0, 1).
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion: expected the decoded text (str), got {type(completion).__name__}")
    if not isinstance(problem, ArithmeticProblem):
        raise TypeError(f"problem: expected an ArithmeticProblem, got {type(problem).__name__}")
    if isinstance(format_weight, bool) or not isinstance(format_weight, (int, float)) or not (
            math.isfinite(format_weight) and 0.0 <= format_weight < 1.0):
        raise ValueError(f"format_weight: expected a float in [0, 1) (below a correct answer's 1.0), got "
                         f"{format_weight!r}")
    match = _FIRST_NUMBER.search(completion)
    if match is not None and float(match.group()) == problem.answer:
        return 1.0
    if format_weight and _BARE_INTEGER.fullmatch(completion.strip()):
        return float(format_weight)
    return 0.0


def rewards(completions: Sequence[str], problems: Sequence[ArithmeticProblem], *,
            format_weight: float = 0.0) -> list[float]:
    """:func:`reward` of each ``(completion, problem)`` pair; the two sequences have one entry per completion (repeat
    a problem G times for a group of G completions).

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(completions) != len(problems):
        raise ValueError(f"problems: expected one per completion ({len(completions)}), got {len(problems)}")
    return [reward(c, p, format_weight=format_weight) for c, p in zip(completions, problems)]
