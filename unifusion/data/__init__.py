"""Bundled offline data: the Python-documentation prose and chat set (:mod:`unifusion.chat` reads them) and
:mod:`unifusion.data.arithmetic`, verifiable integer tasks (addition, max, median) with exact rewards for RL, and
:mod:`unifusion.data.sorting`, a verifiable task with long answers (sort a list of numbers)."""

from . import arithmetic, sorting
from .arithmetic import ArithmeticProblem, make_problems, reward, rewards
from .sorting import SortProblem

__all__ = ["ArithmeticProblem", "SortProblem", "arithmetic", "make_problems", "reward", "rewards", "sorting"]
