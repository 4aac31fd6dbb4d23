"""Which implementation runs unifusion's fused hot paths: eager PyTorch or ``torch.compile``, decided by the call.

The fast x0-head losses (:func:`unifusion.losses.x0_head_loss`, :func:`~unifusion.losses.fused_linear_diffusion_loss`)
and the samplers' per-step pass over the vocabulary are pure tensor functions. Compiled, Inductor fuses each into a
few cache-resident loops per row; eagerly the same functions run op by op on blocks of rows. Both give the same
values to float rounding. Compiling costs seconds to a minute per configuration (device, dtypes, kernel family).

Settings (:func:`set_backend`, :func:`using`, or the environment variable ``UNIFUSION_BACKEND`` read at import):

* ``"auto"`` (default): a call that processes at least :data:`AUTO_MIN_LOGITS` logits (positions × states; 2²⁴)
  runs compiled, a smaller one eagerly (:func:`runs_compiled`). The README's usage block, tests and notebooks run
  eagerly and return at once; a training-sized call compiles its configuration on first use, in the caller's thread
  (that call waits), and logs one record saying what it compiled and how long it took (logger ``"unifusion"``).
* ``"compiled"``: every call runs compiled (each configuration compiles on its first call).
* ``"eager"``: never compile (no compiler needed).

The choice depends only on the setting and on what the caller passes — never on timing or on how often a function
was called — so two identical runs compute identical numbers, and the ranks of a multi-GPU run that pass the same
shapes make the same choice. (A run whose calls straddle :data:`AUTO_MIN_LOGITS`, e.g. variable batch sizes near
it, mixes the two implementations deterministically; pin ``"compiled"`` or ``"eager"`` to avoid that.) Nothing runs
in the background: unifusion starts no threads and changes no thread counts or priorities.

If compiling a configuration fails (no C++ compiler, no Triton, an unsupported device) the call is served eagerly and
one ``RuntimeWarning`` names the configuration and the error; that configuration runs eagerly from then on
(:func:`compile_failures` lists it), while the setting and every other configuration stay as they were. Running out
of device memory is not a compiler failure: ``torch.OutOfMemoryError`` propagates from the call as it would eagerly.
Inside a caller's own ``torch.compile`` region the functions are traced inline, whatever the setting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

from . import _compile
from ._compile import AUTO_MIN_LOGITS, BACKENDS

__all__ = ["AUTO_MIN_LOGITS", "BACKENDS", "compile_failures", "compile_stats", "get_backend", "runs_compiled",
           "set_backend", "using"]


def set_backend(backend: Literal["auto", "compiled", "eager"]) -> None:
    """Run the fused hot paths ``"auto"`` (default: compiled from :data:`AUTO_MIN_LOGITS` logits per call up),
    ``"compiled"`` or ``"eager"`` for the whole process. Same values either way, to float rounding."""
    _compile.COMPILER.backend = _compile.check_backend(backend)


def get_backend() -> str:
    """The current setting: ``"auto"``, ``"compiled"`` or ``"eager"`` (a compiler failure does not change it)."""
    return _compile.COMPILER.backend


@contextlib.contextmanager
def using(backend: Literal["auto", "compiled", "eager"]) -> Iterator[None]:
    """Context manager: the setting ``backend`` for a block, the previous one restored afterwards::

        with unifusion.backend.using("eager"):
            loss = uf.losses.gidd_loss(...)
    """
    previous = get_backend()
    set_backend(backend)
    try:
        yield
    finally:
        _compile.COMPILER.backend = previous


def runs_compiled(num_logits: int) -> bool:
    """Whether a call that processes ``num_logits`` logits (positions × states, e.g. ``x0_logits.numel()``) runs
    compiled under the current setting (outside a caller's own ``torch.compile`` region)."""
    return _compile.chooses_compiled(num_logits)


def compile_stats() -> dict[str, float]:
    """``{"compiled": n, "seconds": s}``: the configurations compiled so far in this process and the seconds their
    first calls took (compiling, plus the one call itself). A training loop subtracts the growth of ``seconds``
    across a step from the step's time to count training, not compiling (``unifusion demo`` does)."""
    stats = _compile.COMPILER.stats
    return {"compiled": stats["compiled"], "seconds": stats["seconds"]}


def compile_failures() -> dict[str, str]:
    """The configurations whose compilation failed in this process, ``{what it was: the error}``; each runs eagerly
    from then on (the others still compile)."""
    return dict(_compile.COMPILER.failed.values())
