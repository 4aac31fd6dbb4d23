"""Evaluation: sample quality (GenPPL, unigram entropy, the frontier), accuracy under parallelism (AUP), zero-shot
multiple choice, the NLL bound.

Paper §4.3/App. C.3 (frontier), §4.4/App. C.4 (downstream), Proposition 3.2 (likelihood bound).
"""

from .choices import MultipleChoiceResult, ar_choice_nll, fair_pmi_scores, load_task, run_multiple_choice, score_choices
from .frontier import DEFAULT_SEEDS, DEFAULT_STEPS, FrontierResult, decode_samples, frontier, plot_frontier
from .likelihood import nll_bound, prior_kl
from .parallelism import accuracy_under_parallelism, aup_weight, plot_parallelism
from .quality import PerplexityResult, generative_perplexity, gpt2_tokenizer, retokenize, unigram_entropy

__all__ = [
    "DEFAULT_SEEDS",
    "DEFAULT_STEPS",
    "FrontierResult",
    "MultipleChoiceResult",
    "PerplexityResult",
    "accuracy_under_parallelism",
    "ar_choice_nll",
    "aup_weight",
    "decode_samples",
    "fair_pmi_scores",
    "frontier",
    "generative_perplexity",
    "gpt2_tokenizer",
    "load_task",
    "nll_bound",
    "plot_frontier",
    "plot_parallelism",
    "prior_kl",
    "retokenize",
    "run_multiple_choice",
    "score_choices",
    "unigram_entropy",
]
