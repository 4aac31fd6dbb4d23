"""Bayesian (ancestral) sampling from an x0 model: Algorithm 2 of the paper (App. C.5).

With t_n = (1 − ε)(1 − n/N), z_{t_0} drawn from the kernel's noise distribution π_{t_0}, each step draws per position

    z_s ~ p̂_{s|t}(· | z_t) = q_{t|s}(z_t | ·) q_s(· | x_θ) / q_t(z_t | x_θ),    t = t_n, s = t_{n+1},

where x_θ = x_θ(· | z_t, t) is the model's clean-token distribution (mask state excluded). The last step has s = 0
and q_0(·|x_θ) = x_θ, so it lands on clean tokens (for mask kernels: no mask left).

Example::

    sampler = uf.BayesianSampler(model, uf.UniformKernel(V), num_steps=64)
    tokens = sampler.sample(4, 512, generator=torch.Generator().manual_seed(0))        # (4, 512) int64
    prompt = torch.full((1, 512), -1); prompt[0, :16] = prefix_ids                     # -1 = generate here
    tokens = sampler.sample(4, 512, prompt=prompt)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import _validation as V
from ..kernels import InterpolatingKernel, Kernel, check_kernel
from ._draws import BLOCK_SIZE, COMPILE_MIN_STATES, compiled_block_log_mass, x0_weights
from ._setup import (
    ModelFn,
    apply_prompt,
    check_eps,
    check_head_shape,
    check_model,
    check_sampling_options,
    start_run,
)
from ._step import bayesian_step, bayesian_step_from_logits

__all__ = ["BayesianSampler"]

Callback = Callable[[int, float, torch.Tensor], object]


class BayesianSampler:
    """Algorithm 2: N posterior steps z_{t_n} → z_{t_{n+1}} under an x0 model, for any :class:`~unifusion.Kernel`.

    Args:
        model: callable ``(x_t (B, L) int64, t (B,) float) → x0 logits (B, L, num_states)``; a
            :class:`~unifusion.hf.DiffusionLM` qualifies (it attends bidirectionally by default). The logit of
            a mask state is ignored (x_θ puts 0 there). bf16 logits are upcast.
        kernel: the forward kernel the model was trained with. Uniform, mask and hybrid kernels take the O(V) mixture
            step (see :mod:`unifusion.samplers._step`); other kernels (:class:`~unifusion.GeneratorKernel`) use
            the dense posterior through the kernel's hooks, O(S²) per position.
        num_steps: N ≥ 1, the number of model calls.
        eps: ε in (0, 1); the first step starts at t_0 = 1 − ε.
        temperature: T > 0; x_θ = softmax(logits / T) before the posterior (then top-k, then top-p).
        top_k: keep the k most likely tokens of x_θ (ties kept).
        top_p: keep the smallest set of most likely tokens holding ≥ ``top_p`` of the remaining mass.
        dtype: ``torch.float32`` or ``torch.float64`` for the posterior arithmetic (and the times passed to the model).
        cache_unchanged: reuse the previous logits when no token changed since the last model call (MDLM's cache;
            helps mask kernels, where most steps unmask nothing at small L / large N). **Only valid for a model that
            ignores t.** Costs one host-device synchronisation per step (to decide whether to call the model).

    Randomness: every draw takes the ``generator`` passed to :meth:`sample`; a given generator state gives the same
    tokens. With one generator per row, row b draws from ``generator[b]`` exactly what a batch of one draws, so it
    equals ``sample(1, L, generator=generator[b])`` on its prompt row whatever rows are beside it (up to the model's
    arithmetic, which on some devices differs with the batch shape): per-request seeds in an evaluation harness.

    Arguments and the prompt are validated once per :meth:`sample` call (one host sync, plus one for the first model
    output); no step reads a tensor back to the host (unless ``cache_unchanged``): the model is called with
    validation off, since the sampler's tokens and times are valid by construction.

    The kernel must fit the model: with a :class:`~unifusion.DiffusionLM`, the same number of states and, for mask
    and hybrid kernels, the model's mask token (a ``ValueError`` names both ids otherwise). The model must return x0
    logits: a :func:`~unifusion.samplers.x0_model_as` wrapper of another parameterization is a ``ValueError`` (sample
    it with :class:`~unifusion.EulerSampler`). ``top_k`` is at most the number of states.
    """

    def __init__(self, model: ModelFn, kernel: Kernel, num_steps: int, *, eps: float = 1e-3, temperature: float = 1.0,
                 top_p: float | None = None, top_k: int | None = None, dtype: torch.dtype = torch.float32,
                 cache_unchanged: bool = False) -> None:
        self.model = check_model(model)
        self.kernel = check_kernel(kernel)
        self.num_steps = V.check_positive_int("num_steps", num_steps)
        self.eps = check_eps(eps)
        self.temperature, self.top_k, self.top_p = check_sampling_options(temperature, top_k, top_p,
                                                                          self.kernel.num_states)
        self.dtype = V.check_compute_dtype(dtype)
        if not isinstance(cache_unchanged, bool):
            raise TypeError(f"cache_unchanged: expected a bool, got {type(cache_unchanged).__name__}")
        self.cache_unchanged = cache_unchanged
        V.check_model_kernel(model, self.kernel, who="BayesianSampler")  # x0 logits under this kernel (cheap)

    def __repr__(self) -> str:
        return (f"BayesianSampler(kernel={self.kernel!r}, num_steps={self.num_steps}, eps={self.eps}, "
                f"temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, dtype={self.dtype})")

    def sample(self, batch_size: int, seq_len: int, *, prompt: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
               | None = None, generator: torch.Generator | Sequence[torch.Generator] | None = None,
               progress: bool = False, callback: Callback | None = None,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Generate ``(batch_size, seq_len)`` int64 token ids.

        Args:
            batch_size: B.
            seq_len: L.
            prompt: positions to keep, as a ``(B, L)`` tensor with ``-1`` (:data:`PROMPT_FILL`) where tokens are
                generated, or a pair ``(ids, keep_mask)`` (bool, True = keep). ``(L,)`` and ``(1, L)`` broadcast.
                Kept tokens are in z_t at every step (the model always sees them) and never change: prefix prompts
                and arbitrary infilling masks alike.
            generator: a ``torch.Generator`` on the sampling device (the default generator when ``None``), or a
                list of ``batch_size`` generators there, one per row: row b's draws (prior, then per step a
                ``(1, L, 4)`` uniform and, for uniform/mask/hybrid kernels, ``(1, L)`` noise tokens) come from
                ``generator[b]`` in the order a batch of one draws them (B small draws per step instead of one).
                A wrong length or device type is a ``ValueError``.
            progress: show a tqdm bar over the steps.
            callback: ``callback(step, t, x_t)`` after each step, with ``step`` = n + 1 steps done, ``t`` = t_{n+1}
                (a float; 0 after the last step) and ``x_t`` the ``(B, L)`` tokens at that time (a fresh tensor every
                step). Return ``True`` to stop early: :meth:`sample` then returns that ``x_t`` as it is (it may still
                hold noise or mask tokens). Any other return value continues.
            device: where to sample; default: the prompt's, else the generator's, else the model's device.
        """
        run = start_run(self, batch_size, seq_len, prompt, generator, progress, callback, device)
        B, L, dev, kept, ts, t_host, x = run.B, run.L, run.device, run.kept, run.ts, run.t_host, run.x
        generator = run.generator  # checked: None, one generator, or a tuple of B
        kernel, dtype = self.kernel, self.dtype
        S = kernel.num_states
        # top-k / top-p need the whole x_θ (and dense kernels the dense posterior): a reused workspace then; so
        # does the eager backend at LM vocabulary sizes (a softmax into the workspace beats unfused block sums)
        # the interpolating kernel when x_θ can go straight from the logits, else None
        direct = kernel if isinstance(kernel, InterpolatingKernel) and self.top_k is None and self.top_p is None \
            else None
        workspace: torch.Tensor | None = None
        head: torch.Tensor | None = None
        x_seen: torch.Tensor | None = None
        with torch.no_grad():
            for n in run.steps:
                t, s = ts[n], ts[n + 1]
                if head is None or x_seen is None or not self.cache_unchanged or bool(x.ne(x_seen).any()):
                    head = None  # let the last step's logits go before the model allocates the next ones
                    with V.unchecked():  # the sampler's own tokens and times: valid by construction
                        head = self.model(x, t.expand(B))
                    x_seen = x
                if n == 0:  # first step: check the model's output once (the run's last host sync)
                    head = check_head_shape("model", head, B, L, S)
                    V.check_finite("model output", head)
                if direct is not None and (S < COMPILE_MIN_STATES or compiled_block_log_mass(
                        head, kernel.mask_id, self.temperature, BLOCK_SIZE, dtype) is not None):
                    # x_θ straight from the logits: no (B, L, S) workspace, one fused pass over them
                    z = bayesian_step_from_logits(head, x, direct, t, s, generator, temperature=self.temperature,
                                                  dtype=dtype, block_size=BLOCK_SIZE)
                else:
                    if workspace is None:
                        workspace = torch.empty((B, L, S), dtype=dtype, device=dev)
                    w = x0_weights(head, workspace, mask_id=kernel.mask_id, temperature=self.temperature,
                                   top_k=self.top_k, top_p=self.top_p)
                    z = bayesian_step(w, x, kernel, t, s, generator, block_size=BLOCK_SIZE)
                x = apply_prompt(z, kept)
                if callback is not None and callback(n + 1, t_host[n + 1], x) is True:
                    break
        return x
