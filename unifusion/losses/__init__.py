"""Losses: the master objective D_t and the five published losses, all per position (the caller reduces).

* :func:`bregman_rate_loss` — Definition 3.1's D_t on two :class:`~unifusion.ReverseRate` rows.
* :func:`sedd_loss`, :func:`mdlm_loss`, :func:`gidd_loss`, :func:`m2s_loss`, :func:`ctmc_loss` — App. A, each equal
  to D_t between the true conditional rates and the rates its head induces (Theorem 3.3).
* :func:`gidd_loss_weight` — the per-position weight of :func:`gidd_loss` (ELBO, clipped or GIDD's dynamic one).
* :func:`x0_head_loss` — D_t of an x0 head (GIDD / MDLM / the x0-head SEDD, M2S, CTMC losses) at the cost of a
  cross-entropy; :func:`gidd_loss` and :func:`mdlm_loss` here are its fast paths (same values as the references).
* :func:`fused_linear_diffusion_loss` — output head + x0-head loss without materialising the logits.
* :func:`check_objective` — the objective's name checked against the kernel (what every x0-head loss accepts).
  Both run ``torch.compile``-fused on training-sized calls and eagerly on small ones (:mod:`unifusion.backend`).

The straightforward O(S)-per-position implementations live in :mod:`unifusion.losses.native`; the references of the
two fast losses are :func:`reference_gidd_loss` and :func:`reference_mdlm_loss`.
"""

from .bregman import bregman_divergence, bregman_rate_loss
from .fast import X0_HEAD_OBJECTIVES, check_objective, gidd_loss, mdlm_loss, x0_head_loss
from .fused_linear import fused_linear_diffusion_loss
from .native import (
    GIDD_WEIGHTINGS,
    ctmc_loss,
    gidd_loss_weight,
    m2s_loss,
    reference_gidd_loss,
    reference_mdlm_loss,
    sedd_loss,
)

__all__ = [
    "GIDD_WEIGHTINGS",
    "X0_HEAD_OBJECTIVES",
    "bregman_divergence",
    "bregman_rate_loss",
    "check_objective",
    "ctmc_loss",
    "fused_linear_diffusion_loss",
    "gidd_loss",
    "gidd_loss_weight",
    "m2s_loss",
    "mdlm_loss",
    "reference_gidd_loss",
    "reference_mdlm_loss",
    "sedd_loss",
    "x0_head_loss",
]
