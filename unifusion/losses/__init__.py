"""Losses: the master objective D_t and the five published losses, all per position (the caller reduces).

* :func:`bregman_rate_loss` — Definition 3.1's D_t on two :class:`~unifusion.ReverseRate` rows.
* :func:`sedd_loss`, :func:`mdlm_loss`, :func:`gidd_loss`, :func:`m2s_loss`, :func:`ctmc_loss` — App. A, each equal
  to D_t between the true conditional rates and the rates its head induces (Theorem 3.3).
"""

from .bregman import bregman_divergence, bregman_rate_loss
from .native import GIDD_WEIGHTINGS, ctmc_loss, gidd_loss, m2s_loss, mdlm_loss, sedd_loss

__all__ = [
    "GIDD_WEIGHTINGS",
    "bregman_divergence",
    "bregman_rate_loss",
    "ctmc_loss",
    "gidd_loss",
    "m2s_loss",
    "mdlm_loss",
    "sedd_loss",
]
