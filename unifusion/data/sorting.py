"""A verifiable task with long answers: sort a list of numbers. Exact rewards and a fixed held-out split, as
:mod:`unifusion.data.arithmetic`, but the answer is a whole list — what a decoder that emits several tokens per
forward needs to be measured on (an answer of one or two tokens cannot show parallelism).

::

    prompt                  completion
    "sort(47,38,91,12,5)="  "5,12,38,47,91"        count = 5, digits = 2 (the default)

``count`` numbers (2 to 12) of ``digits`` digits each (1 to 3, no leading zero; 1 digit: 0–9), repeats allowed,
ascending in the answer, joined by commas without spaces. Every answer of one ``(count, digits)`` has the same length,
``count · digits + count − 1`` characters, and with SmolLM2's tokenizer (one token per digit and per comma) as many
tokens: 14 at the default, at least 9 for ``count ≥ 5``; :func:`answer_length` gives it.

**Split.** A list is held out when the first byte of ``blake2b("sort:47,38,91,12,5")`` (the numbers in the prompt's
order) is below 26 (≈ 10 %), so ``split="test"`` never shares a problem with ``split="train"``, whatever ``n`` and
``seed``. ``make_problems(n, seed, split)`` returns the first ``n`` distinct lists of the split in an order fixed by
``seed``: when the lists number at most 200,000 they are enumerated and shuffled with ``random.Random(seed)``
(so every list of the split can be drawn); beyond that (2-digit lists of 3 or more) they are drawn from
``random.Random(seed)`` one number at a time, keeping the new ones of the split. A shorter draw is a prefix of a longer
one either way.

**Reward** (:func:`reward`): 1.0 when the completion's first list — integers separated by commas, spaces allowed
after a comma — is exactly the sorted list, else 0.0: ``"5,12,38,47,91"``, ``" 5, 12, 38, 47, 91\\n"`` and
``"5,12,38,47,91 done"`` score 1; a missing, extra or misplaced number (``"5,12,38,47"``, ``"5,12,38,47,91,7"``,
``"12,5,38,47,91"``) scores 0. ``format_weight`` (default 0, exact) gives a wrong but well-formed answer (the
stripped completion is a list of ``count`` integers) that much instead of 0.

Example::

    from unifusion.data import sorting

    train = sorting.make_problems(1000, seed=0)
    test = sorting.make_problems(200, seed=0, split="test")
    p = train[0]
    p.prompt, p.completion                    # ("sort(59,63,15,43,75)=", "15,43,59,63,75")
    sorting.reward("15, 43, 59, 63, 75", p)   # 1.0
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

__all__ = ["SPLITS", "SortProblem", "answer_length", "make_problems", "reward", "rewards", "split_of"]

SPLITS = ("train", "test")
"""The two splits; every list is in exactly one (:func:`split_of`)."""

_TEST_THRESHOLD = 26  # first hash byte below this: held out (26/256 ≈ 10.2 %)
_ENUMERATE_LIMIT = 200_000  # lists up to this many are enumerated; beyond, drawn
_MAX_COUNT, _MAX_DIGITS = 12, 3
_FIRST_LIST = re.compile(r"-?\d+(?:, *-?\d+)*")


@dataclass(frozen=True)
class SortProblem:
    """One problem: the numbers to sort.

    Attributes:
        numbers: the list as the prompt shows it.
    """

    numbers: tuple[int, ...]

    @property
    def kind(self) -> str:
        """``"sort"`` (the task's name, as :class:`~unifusion.data.ArithmeticProblem` names its kind)."""
        return "sort"

    @property
    def answer(self) -> tuple[int, ...]:
        """The numbers in ascending order."""
        return tuple(sorted(self.numbers))

    @property
    def prompt(self) -> str:
        """The question, e.g. ``"sort(47,38,91,12,5)="``."""
        return "sort(" + ",".join(str(x) for x in self.numbers) + ")="

    @property
    def completion(self) -> str:
        """The target answer text for supervised fine-tuning, e.g. ``"5,12,38,47,91"`` (append the tokenizer's
        EOS)."""
        return ",".join(str(x) for x in self.answer)

    def as_dict(self) -> dict[str, object]:
        """``{"prompt", "completion", "answer", "numbers", "kind"}``: a row for a ``datasets.Dataset``."""
        return {"prompt": self.prompt, "completion": self.completion, "answer": list(self.answer),
                "numbers": list(self.numbers), "kind": self.kind}


def _check_int(name: str, value: object, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: expected an int in [{low}, {high}] ({what}), got {value!r}")
    return value


def _check_split(split: object) -> str:
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    return str(split)


def split_of(numbers: Sequence[int]) -> str:
    """``"test"`` or ``"train"``: the split the list (in the prompt's order) belongs to (the module docstring's hash
    rule)."""
    key = ("sort:" + ",".join(str(int(x)) for x in numbers)).encode()
    return "test" if hashlib.blake2b(key, digest_size=8).digest()[0] < _TEST_THRESHOLD else "train"


def answer_length(count: int = 5, digits: int = 2) -> int:
    """Characters of every answer of ``count`` numbers of ``digits`` digits (SmolLM2 tokens too: one per digit and
    per comma): ``count · digits + count − 1``."""
    count = _check_int("count", count, 2, _MAX_COUNT, "how many numbers to sort")
    digits = _check_int("digits", digits, 1, _MAX_DIGITS, "digits of every number")
    return count * digits + count - 1


def _number_range(digits: int) -> range:
    return range(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits)


@lru_cache(maxsize=8)
def _pool(count: int, digits: int, split: str) -> tuple[tuple[int, ...], ...]:
    """Every list of the split, in lexicographic order (small spaces only)."""
    r = _number_range(digits)
    return tuple(t for t in itertools.product(r, repeat=count) if split_of(t) == split)


def make_problems(n: int, seed: int = 0, split: Literal["train", "test"] = "train", *, count: int = 5,
                  digits: int = 2) -> list[SortProblem]:
    """``n`` distinct lists of the split, in an order fixed by ``seed`` (module docstring).

    Args:
        n: how many (for an enumerated space at most the split's size; 1-digit lists of 5: 89,825 train, 10,175 test).
        seed: the order's seed.
        split: ``"train"`` or ``"test"`` (held out; never overlaps train).
        count: numbers per list, 2 to 12.
        digits: digits of every number, 1 to 3.

    Raises:
        ValueError: an unknown split, ``count`` or ``digits`` out of range, ``n`` negative or above the split's size
            (of an enumerated space; a drawn space holds millions).
    """
    count = _check_int("count", count, 2, _MAX_COUNT, "how many numbers to sort")
    digits = _check_int("digits", digits, 1, _MAX_DIGITS, "digits of every number")
    split_ = _check_split(split)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    r = _number_range(digits)
    space = len(r) ** count
    if space <= _ENUMERATE_LIMIT:
        pool = _pool(count, digits, split_)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(pool):
            raise ValueError(f"n: expected an int in [0, {len(pool)}] (the {split_} split of {count} numbers of "
                             f"{digits} digit(s)), got {n!r}")
        order = list(range(len(pool)))
        random.Random(seed).shuffle(order)
        return [SortProblem(pool[i]) for i in order[:n]]
    top = space // 20  # far below the split's size, so the draw ends quickly
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= top:
        raise ValueError(f"n: expected an int in [0, {top}] for {count} numbers of {digits} digits, got {n!r}")
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    out: list[SortProblem] = []
    while len(out) < n:
        numbers = tuple(rng.choice(r) for _ in range(count))
        if numbers not in seen and split_of(numbers) == split_:
            seen.add(numbers)
            out.append(SortProblem(numbers))
    return out


def reward(completion: str, problem: SortProblem, *, format_weight: float = 0.0) -> float:
    """The exact reward of one completion (module docstring): 1.0 if its first comma-separated list of integers is
    the sorted list; else ``format_weight`` if the stripped completion is a list of as many integers, else 0.0.

    Raises:
        TypeError: ``completion`` is not a ``str`` or ``problem`` not a :class:`SortProblem`.
        ValueError: ``format_weight`` outside [0, 1).
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion: expected the decoded text (str), got {type(completion).__name__}")
    if not isinstance(problem, SortProblem):
        raise TypeError(f"problem: expected a SortProblem, got {type(problem).__name__}")
    if isinstance(format_weight, bool) or not isinstance(format_weight, (int, float)) or not (
            math.isfinite(format_weight) and 0.0 <= format_weight < 1.0):
        raise ValueError(f"format_weight: expected a float in [0, 1) (below a correct answer's 1.0), got "
                         f"{format_weight!r}")
    match = _FIRST_LIST.search(completion)
    if match is None:
        return 0.0
    given = tuple(int(x) for x in match.group().split(","))
    if given == problem.answer:
        return 1.0
    if format_weight and match.group() == completion.strip() and len(given) == len(problem.numbers):
        return float(format_weight)
    return 0.0


def rewards(completions: Sequence[str], problems: Sequence[SortProblem], *,
            format_weight: float = 0.0) -> list[float]:
    """:func:`reward` of each ``(completion, problem)`` pair (one problem per completion).

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(completions) != len(problems):
        raise ValueError(f"problems: expected one per completion ({len(completions)}), got {len(problems)}")
    return [reward(c, p, format_weight=format_weight) for c, p in zip(completions, problems)]
