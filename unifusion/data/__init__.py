"""Bundled offline data: the Python-documentation prose and chat set (:mod:`unifusion.chat` reads them) and
:mod:`unifusion.data.arithmetic`, verifiable integer tasks (addition, max, median) with exact rewards for RL."""

from . import arithmetic
from .arithmetic import ArithmeticProblem, make_problems, reward, rewards

__all__ = ["ArithmeticProblem", "arithmetic", "make_problems", "reward", "rewards"]
