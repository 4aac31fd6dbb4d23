"""``unifusion.data.arithmetic``: deterministic problems, a held-out split that never meets train, exact rewards.

(``tests/data/`` holds data files, so the tests of ``unifusion/data/`` live here.)
"""

from __future__ import annotations

import pytest

from unifusion.data import ArithmeticProblem, arithmetic, make_problems, reward, rewards


def test_problems_are_deterministic_distinct_and_correct():
    a = make_problems(300, seed=3)
    assert a == make_problems(300, seed=3)
    assert a != make_problems(300, seed=4) and set(a[:50]) != set(make_problems(50, seed=4))
    assert len(set(a)) == 300
    for p in a:
        x, y = p.operands
        assert 10 <= x <= 99 and 10 <= y <= 99 and p.answer == x + y and p.kind == "add"
        assert p.prompt == f"{x}+{y}=" and p.completion == str(x + y)
    assert any(p.operands[0] % 10 + p.operands[1] % 10 >= 10 for p in a)  # carries occur
    # a prefix of a longer draw is the shorter draw
    assert make_problems(20, seed=3) == a[:20]


def test_add_sub_problems_are_non_negative():
    for p in make_problems(100, seed=0, kind="add_sub", digits=1):
        a, b, c = p.operands
        assert p.answer == a + b - c >= 0 and p.prompt == f"{a}+{b}-{c}="


@pytest.mark.parametrize("kind", ["max", "median"])
def test_comparison_problems_answer_one_of_their_numbers(kind):
    a = make_problems(200, seed=1, kind=kind, digits=1)
    assert a == make_problems(200, seed=1, kind=kind, digits=1) and len(set(a)) == 200
    for p in a:
        x, y, z = p.operands
        assert p.kind == kind and p.prompt == f"{kind}({x},{y},{z})="
        assert p.answer == (max(x, y, z) if kind == "max" else sorted((x, y, z))[1])
        assert p.completion == str(p.answer) and reward(p.completion, p) == 1.0
    assert any(p.answer != p.operands[-1] for p in a) and any(p.answer == p.operands[0] for p in a)
    assert arithmetic.answer_width(kind, 2) == 2  # the answer is one of the operands
    padded = make_problems(5, seed=0, kind=kind, digits=1, pad_answers=True)
    assert all(p.width == 1 and len(p.completion) == 1 for p in padded)
    # each kind has its own split: the hash key names the kind
    train = make_problems(arithmetic.split_size("train", kind=kind, digits=1), kind=kind, digits=1)
    test = make_problems(arithmetic.split_size("test", kind=kind, digits=1), split="test", kind=kind, digits=1)
    assert len(train) + len(test) == 10 ** 3 and not {p.operands for p in train} & {p.operands for p in test}
    assert all(arithmetic.split_of(p.operands, kind) == "test" for p in test)


def test_splits_are_disjoint_and_fixed():
    train = make_problems(arithmetic.split_size("train"), seed=0)
    test = make_problems(arithmetic.split_size("test"), seed=0, split="test")
    assert len(train) + len(test) == 90 * 90  # every 2-digit pair is in exactly one split
    assert not {p.operands for p in train} & {p.operands for p in test}
    assert 0.07 < len(test) / (len(train) + len(test)) < 0.13  # ≈ 10 % held out
    assert all(arithmetic.split_of(p.operands) == "test" for p in test)
    # the rule depends on the operands only, not on the seed or n
    assert {p.operands for p in make_problems(40, seed=9, split="test")} <= {p.operands for p in test}
    assert arithmetic.split_of((47, 38)) == arithmetic.split_of([47, 38])


def test_reward_is_exact_on_edge_cases():
    p = ArithmeticProblem(operands=(47, 38), kind="add", answer=85)
    for text in ("85", " 85", "85\n", " 85\n12+3=15", "85.0", "85, because 7+8=15", "85abc"):
        assert reward(text, p) == 1.0, text
    for text in ("", " ", "850", "8 5", "-85", "84 85", "eighty-five", "85.5", "A: 84", "086"):
        assert reward(text, p) == 0.0, text
    assert reward("abc 85", p) == 1.0  # the first number counts, wherever it stands
    zero = ArithmeticProblem(operands=(5, 4, 9), kind="add_sub", answer=0)
    assert reward("0", zero) == 1.0 and reward("-0", zero) == 1.0 and reward("00", zero) == 1.0
    assert reward("1", zero) == 0.0


def test_format_reward_is_below_a_correct_answer():
    p = ArithmeticProblem(operands=(47, 38), kind="add", answer=85)
    assert reward("84", p, format_weight=0.1) == pytest.approx(0.1)
    assert reward(" 84 ", p, format_weight=0.1) == pytest.approx(0.1)
    assert reward("84 apples", p, format_weight=0.1) == 0.0  # not a bare integer
    assert reward("85", p, format_weight=0.1) == 1.0
    assert reward("84", p) == 0.0
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="format_weight"):
            reward("84", p, format_weight=bad)


def test_batch_rewards_and_records():
    ps = make_problems(3, seed=1)
    assert rewards([p.completion for p in ps], ps) == [1.0, 1.0, 1.0]
    assert rewards(["x", ps[1].completion, "1000"], ps) == [0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="problems"):
        rewards(["1"], ps)
    row = ps[0].as_dict()
    assert row["prompt"] == ps[0].prompt and row["answer"] == ps[0].answer and row["kind"] == "add"


def test_padded_answers_have_one_digit_place_per_position():
    plain, padded = make_problems(200, seed=2), make_problems(200, seed=2, pad_answers=True)
    assert [p.operands for p in padded] == [p.operands for p in plain]  # the same problems and answers
    assert [p.answer for p in padded] == [p.answer for p in plain]
    assert arithmetic.answer_width("add", 2) == 3 and arithmetic.answer_width("add", 3) == 4
    assert arithmetic.answer_width("add_sub", 1) == 2  # 9 + 9 - 0 = 18
    assert {len(p.completion) for p in padded} == {3} and any(p.answer < 100 for p in padded)
    for p in padded:
        assert p.completion == f"{p.answer:03d}" and reward(p.completion, p) == 1.0
    assert ArithmeticProblem((47, 38), "add", 85, width=3).completion == "085"
    assert make_problems(5, seed=0, split="test", kind="add_sub", digits=1, pad_answers=True)[0].width == 2
    with pytest.raises(TypeError, match="pad_answers"):
        make_problems(3, pad_answers=1)  # type: ignore[arg-type]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="split"):
        make_problems(3, split="val")
    with pytest.raises(ValueError, match="kind"):
        make_problems(3, kind="mul")
    with pytest.raises(ValueError, match="digits"):
        make_problems(3, digits=5)
    with pytest.raises(ValueError, match=r"digits: expected an int in \[1, 2\] for kind='max'"):
        make_problems(3, kind="max", digits=3)
    with pytest.raises(ValueError, match="n: expected an int in"):
        make_problems(arithmetic.split_size("test") + 1, split="test")
    with pytest.raises(ValueError, match="n: "):
        make_problems(-1)
    with pytest.raises(TypeError, match="completion"):
        reward(85, make_problems(1)[0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="problem"):
        reward("85", {"answer": 85})  # type: ignore[arg-type]
