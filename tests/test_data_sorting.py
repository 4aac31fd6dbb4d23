"""``unifusion.data.sorting``: deterministic lists, a held-out split that never meets train, exact rewards, answers
long enough to decode in parallel (SmolLM2's tokens)."""

from __future__ import annotations

import itertools

import pytest

from unifusion.data import SortProblem, sorting


def test_problems_are_deterministic_distinct_and_sorted():
    a = sorting.make_problems(300, seed=3)
    assert a == sorting.make_problems(300, seed=3) and len(set(a)) == 300
    assert set(a[:50]) != set(sorting.make_problems(50, seed=4))
    assert sorting.make_problems(20, seed=3) == a[:20]  # a prefix of a longer draw is the shorter draw
    for p in a:
        assert len(p.numbers) == 5 and all(10 <= x <= 99 for x in p.numbers)
        assert list(p.answer) == sorted(p.numbers) and p.kind == "sort"
        assert p.prompt == "sort(" + ",".join(map(str, p.numbers)) + ")="
        assert p.completion == ",".join(map(str, sorted(p.numbers)))
        assert len(p.completion) == sorting.answer_length(5, 2) == 14
        assert sorting.reward(p.completion, p) == 1.0
    assert any(list(p.numbers) != sorted(p.numbers) for p in a)  # the prompts are not already sorted
    assert p.as_dict()["answer"] == sorted(p.numbers)


def test_splits_are_disjoint_and_fixed():
    # an enumerated space: every list of three 1-digit numbers is in exactly one split
    train = sorting.make_problems(900, seed=0, count=3, digits=1)
    test_all = [p for p in map(SortProblem, itertools.product(range(10), repeat=3)) if sorting.split_of(p.numbers)
                == "test"]
    test = sorting.make_problems(len(test_all), seed=1, split="test", count=3, digits=1)
    assert set(test) == set(test_all) and not set(train) & set(test)
    assert 0.07 < len(test_all) / 1000 < 0.13  # ≈ 10 % held out
    with pytest.raises(ValueError, match="n: expected"):
        sorting.make_problems(len(test_all) + 1, split="test", count=3, digits=1)
    # a drawn space: the rule depends on the numbers only
    big_train = sorting.make_problems(2000, seed=5)
    big_test = sorting.make_problems(300, seed=5, split="test")
    assert not {p.numbers for p in big_train} & {p.numbers for p in big_test}
    assert all(sorting.split_of(p.numbers) == "test" for p in big_test)
    assert all(sorting.split_of(p.numbers) == "train" for p in big_train)


def test_reward_is_exact():
    p = SortProblem((47, 38, 91, 12, 5))
    assert p.completion == "5,12,38,47,91"
    for text in ("5,12,38,47,91", " 5, 12, 38, 47, 91\n", "5,12,38,47,91 done", "5,12,38,47,91."):
        assert sorting.reward(text, p) == 1.0, text
    for text in ("5,12,38,47", "5,12,38,47,91,7", "12,5,38,47,91", "5 12 38 47 91", "", "sorted: none",
                 "5,12,38,47,910"):
        assert sorting.reward(text, p) == 0.0, text
    assert sorting.reward("5,12,38,91,47", p, format_weight=0.1) == 0.1  # well formed, wrong
    assert sorting.reward("5,12,38", p, format_weight=0.1) == 0.0  # too few numbers
    assert sorting.rewards(["5,12,38,47,91", "1"], [p, p]) == [1.0, 0.0]


def test_bad_input_names_the_argument():
    p = SortProblem((3, 1))
    for call, kind, name in [
        (lambda: sorting.make_problems(5, count=1), ValueError, "count"),
        (lambda: sorting.make_problems(5, count=13), ValueError, "count"),
        (lambda: sorting.make_problems(5, digits=4), ValueError, "digits"),
        (lambda: sorting.make_problems(5, split="dev"), ValueError, "split"),  # type: ignore[arg-type]
        (lambda: sorting.make_problems(-1), ValueError, "n"),
        (lambda: sorting.make_problems(5, seed=1.5), TypeError, "seed"),  # type: ignore[arg-type]
        (lambda: sorting.reward(3, p), TypeError, "completion"),  # type: ignore[arg-type]
        (lambda: sorting.reward("1,3", object()), TypeError, "problem"),  # type: ignore[arg-type]
        (lambda: sorting.reward("1,3", p, format_weight=1.0), ValueError, "format_weight"),
        (lambda: sorting.rewards(["1,3"], [p, p]), ValueError, "problems"),
        (lambda: sorting.answer_length(5, 0), ValueError, "digits"),
    ]:
        with pytest.raises(kind, match=name):
            call()


def test_answers_are_long_in_smollm2_tokens():
    from unifusion.hf import load_smollm2_tokenizer

    tok = load_smollm2_tokenizer()
    for count, digits in ((5, 2), (5, 1), (4, 3)):
        problems = sorting.make_problems(50, seed=0, count=count, digits=digits)
        lengths = {len(tok(p.completion, add_special_tokens=False)["input_ids"]) for p in problems}
        # one token per digit and per comma: every answer of a (count, digits) has answer_length tokens, >= 8
        assert lengths == {sorting.answer_length(count, digits)} and min(lengths) >= 8
