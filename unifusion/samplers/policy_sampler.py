"""Block decoding with a decoding policy: LLaDA's semi-autoregressive low-confidence decoding, Dream's margin and
entropy orders, Fast-dLLM's threshold parallel decoding and DiffusionGemma's entropy-bound sampler, on any x0 model.

The generated region of each row (from its first position the prompt does not keep) is cut into blocks of
``block_size`` positions, decoded left to right. Within a block every step runs the model, draws a candidate token per
position from x_θ (after temperature, top-k, top-p) and lets the policy (:mod:`unifusion.samplers.policies`) decide:

* mask kernels: the policy commits some masked positions of the block (final); the block is done when none is left.
  Positions of later blocks stay masked — the model sees them as mask tokens (LLaDA).
* uniform kernels (:class:`~unifusion.samplers.policies.EntropyBound`): every step resamples the block (accepted
  draws, uniform noise elsewhere) until the block is stable and confident or ``num_steps`` steps have run; the
  block's tokens are the last argmax. Later blocks hold uniform noise.

``num_steps`` is the number of steps per block: fixed-count policies commit ⌈r / steps left⌉ of the r masked
positions per step (LLaDA's even split), adaptive ones may finish a block in fewer.

Two ways to run the model:

* any x0 callable ``model(x_t (B, L), t (B,)) → logits (B, L, S)`` (``attention_mask=`` is passed along when the
  call gets one): every step runs the whole sequence;
* a :class:`BlockDenoiser` (a model with its own "denoise this block against the clean prefix" path, e.g. a KV
  cache): the prefix is handed over once, each step runs the current block only, and each finished block is
  appended. The sampler's draws are the same on both paths.

Example::

    sampler = uf.samplers.PolicySampler(model, uf.MaskKernel(V, mask_id), LowConfidence(), num_steps=8,
                                        block_size=32)
    out = sampler.sample(4, 160, prompt=prompt, generator=[torch.Generator().manual_seed(s) for s in range(4)],
                         eos_token_id=eos, return_dict=True)
    out.sequences, out.num_forwards, out.tokens_per_forward
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from .. import _validation as V
from .._device import host_to_device
from ..denoiser import BlockDenoiser, HiddenStateBlockDenoiser, HiddenStateModel, X0Model
from ..kernels import Kernel, check_kernel
from . import _policy_run as R
from ._setup import (
    check_devices,
    check_head_shape,
    check_sampling_options,
    resolve_device,
    resolve_prompt,
)
from .policies.mask import mask_step_with_probs
from .policies.protocol import BlockStep, DecodingPolicy, MaskPolicy
from .policies.uniform import EntropyBound, entropy_bound_step
from .policy_output import PolicyOutput

__all__ = ["BlockDenoiser", "PolicyOutput", "PolicySampler"]


class PolicySampler:
    """Block decoding with a decoding policy (see the module docstring).

    Args:
        model: an x0 callable ``(x_t (B, L) int64, t (B,) float) → logits (B, L, S)``, or a :class:`BlockDenoiser`.
        kernel: the forward kernel: a :class:`~unifusion.MaskKernel` for the mask policies, a
            :class:`~unifusion.UniformKernel` for :class:`~unifusion.samplers.policies.EntropyBound`.
        policy: a :class:`~unifusion.samplers.policies.DecodingPolicy`.
        num_steps: steps per block (per sequence without blocks); default: the block size (one position per step for
            fixed-count policies). At most ``block_size`` for fixed-count policies, unless their schedule may commit
            nothing on a step (``policy.max_steps``: Dream's :class:`~unifusion.samplers.policies.TimeGrid`).
        block_size: positions per block; ``None``: one block over each row's generated region.
        temperature: T > 0; x_θ = softmax(logits / T) (for EntropyBound it multiplies the schedule).
        top_k, top_p: truncation of x_θ after the temperature (as :class:`~unifusion.BayesianSampler`).
        use_cache: use a :class:`BlockDenoiser` model's block path (``False``: call it as an x0 callable).
        do_sample: ``False``: greedy decoding — each committed token is the argmax of x_θ (mask policies only; the
            policy still ranks positions by x_θ). The random draws are made either way.

    Randomness: one generator (or ``None``, the global one) draws every random tensor with the whole batch's shape,
    rows that have finished included (the reference implementations' order); a list of ``batch_size`` generators
    draws row by row, and then a row's tokens equal those of the row run alone, whatever its neighbours (with
    left-padded prompts: the row without its padding). The model sees the running rows only; the times ``t`` it gets
    are the noise levels of x_t (the fraction of a row's generated positions still at the noise state, through the
    kernel's schedule, clamped to [1e-3, 1 − 1e-3]). One host sync per step (which rows still run).
    """

    def __init__(self, model: X0Model | BlockDenoiser, kernel: Kernel, policy: DecodingPolicy, *,
                 num_steps: int | None = None, block_size: int | None = None, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, use_cache: bool = True,
                 do_sample: bool = True) -> None:
        self.kernel = check_kernel(kernel)
        if not isinstance(do_sample, bool):
            raise TypeError(f"do_sample: expected a bool, got {type(do_sample).__name__}")
        if not do_sample and getattr(policy, "family", None) != "mask":
            raise ValueError(f"do_sample: greedy decoding (False) is defined for the mask policies, got "
                             f"{type(policy).__name__} (which already keeps each block's argmax)")
        self.do_sample = do_sample
        if not isinstance(policy, DecodingPolicy):
            raise TypeError(f"policy: expected a DecodingPolicy (uf.samplers.policies: LowConfidence(), "
                            f"EntropyBound(bound), ...), got {type(policy).__name__}")
        policy.check_kernel(self.kernel)
        self.policy = policy
        self.block_size = None if block_size is None else V.check_positive_int("block_size", block_size)
        self.num_steps = None if num_steps is None else V.check_positive_int("num_steps", num_steps)
        bound = None if self.block_size is None else policy.max_steps(self.block_size)
        if self.num_steps is not None and bound is not None and self.num_steps > bound:
            raise ValueError(f"num_steps: {type(policy).__name__} commits a fixed count per step, so a block of "
                             f"block_size = {self.block_size} takes at most {bound} steps, got {self.num_steps}")
        self.temperature, self.top_k, self.top_p = check_sampling_options(temperature, top_k, top_p,
                                                                          self.kernel.num_states)
        if not isinstance(use_cache, bool):
            raise TypeError(f"use_cache: expected a bool, got {type(use_cache).__name__}")
        # the block path (a BlockDenoiser, use_cache) or the x0 path (model called on the whole sequence)
        self.block_model: BlockDenoiser | None = model if use_cache and isinstance(model, BlockDenoiser) else None
        self.blockwise = self.block_model is not None
        if not self.blockwise and not callable(model):
            raise TypeError("model: expected an x0 callable (x_t (B, L), t (B,)) -> logits or a BlockDenoiser, got "
                            f"{type(model).__name__}")
        V.check_model_kernel(model, self.kernel, who="PolicySampler")
        if policy.reads_hidden:
            needs = ("denoise_block_hidden", "logits_from_hidden") if self.blockwise else ("hidden_states",
                                                                                            "logits_from_hidden")
            missing = [name for name in needs if not callable(getattr(model, name, None))]
            if missing:
                raise ValueError(f"policy: {type(policy).__name__} reads the model's hidden states, and this "
                                 f"{'block decoder' if self.blockwise else 'model'} ({type(model).__name__}) has no "
                                 f"{' or '.join(missing)} to give them")
        self.model = model

    def __repr__(self) -> str:
        return (f"PolicySampler(kernel={self.kernel!r}, policy={self.policy!r}, num_steps={self.num_steps}, "
                f"block_size={self.block_size}, temperature={self.temperature}, top_k={self.top_k}, "
                f"top_p={self.top_p})")

    def sample(self, batch_size: int, seq_len: int, *, prompt: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
               | None = None, attention_mask: torch.Tensor | None = None,
               generator: torch.Generator | Sequence[torch.Generator] | None = None,
               eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
               return_dict: bool = False, return_trace: bool = False, return_logits: bool = False,
               progress: bool = False,
               stopping: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None,
               on_block: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
               block_start: int | None = None) -> torch.Tensor | PolicyOutput:
        """Generate ``(batch_size, seq_len)`` int64 token ids (or a :class:`PolicyOutput`).

        Args:
            batch_size, seq_len: B and L.
            prompt: as :meth:`BayesianSampler.sample`: a ``(B, L)`` tensor with ``-1`` where tokens are generated,
                or a pair ``(ids, keep_mask)``; ``(L,)`` and ``(1, L)`` broadcast. Kept tokens never change.
            attention_mask: for left-padded prompts of different lengths: ``(B, P)`` (P ≤ L, a tokenizer's mask over
                the prompt columns; later columns count as real) or ``(B, L)``, 1 = real token, 0 = padding (at kept
                prompt positions, on the left). Passed to the model as ``attention_mask=`` (``(B, L)`` bool).
            generator: a ``torch.Generator``, ``None`` (the global generator) or ``batch_size`` of them, one per row.
            eos_token_id: one id or a list of ids: a row stops once a generated position holds EOS (any of them) and
                every generated position before it is decided (mask policies: after any step; EntropyBound: when a
                block ends); every later generated position becomes EOS (the first id), or ``pad_token_id`` if given,
                and the row takes no further model calls.
            pad_token_id: the fill after EOS (needs ``eos_token_id``, or ``stopping``).
            return_dict: return a :class:`PolicyOutput` (sequences, num_forwards, tokens_per_forward).
            return_trace: also record, per generated position, the step it was committed at and its log-probability
                (:attr:`PolicyOutput.commit_step`, :attr:`PolicyOutput.commit_logprob`); implies ``return_dict``.
                Mask policies only: :class:`~unifusion.samplers.policies.EntropyBound` decides a whole block at once
                from resampled canvases, so no token has a commit step (``ValueError``).
            return_logits: also record the raw logits of the model call that committed each generated position
                (:attr:`PolicyOutput.commit_logits`, with the trace); implies ``return_dict``; mask policies only.
            progress: a tqdm bar over the blocks.
            stopping: called after each block ``b`` is decided as ``stopping(b, tokens (B, L), cols (B, K_b))``
                (``cols``: the block's columns per row, values ``≥ L`` past a row's end); it returns ``None`` or a
                ``(B,)`` int64 column per row: ``≥ 0`` stops that row there, as EOS does (every later generated
                position becomes ``pad_token_id``, else the first EOS id; one of them is needed), ``-1`` lets it
                run (e.g. stop strings).
            on_block: called after each block is decided (and ``stopping`` applied) as ``on_block(b, tokens (B, L),
                cols (B, K_b))``: the block's tokens are final (e.g. a streamer).
            block_start: with ``block_size``, the first column of the first block for every row (default: each
                row's generated start): blocks counted from a model's block origin before the generated start
                (:mod:`unifusion.block_partition`, a ``"sequence_start"`` kind). The kept prompt columns of the first
                block stay fixed and count as context of that block (a :class:`BlockDenoiser` gets the prefix before
                ``block_start`` and runs them with the block). It must lie at most ``block_size − 1`` columns before
                every row's generated start.
        """
        B = V.check_positive_int("batch_size", batch_size)
        L = V.check_positive_int("seq_len", seq_len)
        generators = V.check_generators(generator, B)
        eos = R.check_eos_ids("eos_token_id", eos_token_id, self.kernel)
        pad = R.check_token_id("pad_token_id", pad_token_id, self.kernel)
        if pad is not None and eos is None and stopping is None:
            raise ValueError("pad_token_id: fills the positions after EOS; pass eos_token_id too")
        if stopping is not None and pad is None and eos is None:
            raise ValueError("stopping: a stopped row's later positions need a fill; pass pad_token_id or "
                             "eos_token_id")
        for name, fn in (("stopping", stopping), ("on_block", on_block)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name}: expected a callable (block, tokens, cols) or None, got {type(fn).__name__}")
        for name, flag in (("return_dict", return_dict), ("return_trace", return_trace),
                           ("return_logits", return_logits)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
        traced = "return_trace" if return_trace else "return_logits" if return_logits else None
        if traced is not None and self.policy.family != "mask":
            raise ValueError(f"{traced}: records the step at which each masked position is committed, which "
                             f"the mask policies do; {type(self.policy).__name__} resamples whole blocks and keeps "
                             "the last argmax, so its tokens have no commit step")
        dev, source = resolve_device(self.model, prompt, generators, None)
        check_devices(self.model, generators, dev, source)
        with torch.no_grad():
            run = self._start(B, L, prompt, attention_mask, generators, dev, block_start)
            if traced is not None:
                run.commit_step = torch.full((B, L + 1), -1, dtype=torch.long, device=dev)
                run.commit_logprob = torch.zeros((B, L + 1), dtype=torch.float32, device=dev)
            if return_logits:
                run.commit_logits = torch.zeros((B, L + 1, self.kernel.num_states), dtype=torch.float32, device=dev)
            blocks: Any = range(run.grid.num_blocks)
            if progress:
                from tqdm.auto import tqdm

                blocks = tqdm(blocks, desc="blocks", total=run.grid.num_blocks)
            for b in blocks:
                if self.policy.family == "mask":
                    self._mask_block(run, b, eos, pad)
                else:
                    self._uniform_block(run, b, eos, pad)
                if stopping is not None or on_block is not None:
                    cols, _ = run.grid.columns(b)
                    if stopping is not None:
                        fill = pad if pad is not None else R.first_id(cast(Any, eos))
                        self._stop_at(run, stopping(b, run.x[:, :L], cols), fill)
                    if on_block is not None:
                        on_block(b, run.x[:, :L], cols)
                if run.block_state is not None and b + 1 < run.grid.num_blocks:
                    self._commit(run, b)
        sequences = run.x[:, :L].contiguous()
        if not (return_dict or traced):
            return sequences
        extra = getattr(run.block_state, "extra_forwards", None)
        if extra is not None:  # the denoiser's calls outside the steps (prefill, commits)
            run.forwards += extra
        col = torch.arange(L, device=dev)
        tokens = (run.generated & (col <= run.eos_at.unsqueeze(-1))).sum(-1)
        rate = tokens.float() / run.forwards.clamp_min(1).float()
        trace: dict[str, Any] = {}
        if run.commit_step is not None and run.commit_logprob is not None:
            trace = {"commit_step": run.commit_step[:, :L].contiguous(),
                     "commit_logprob": run.commit_logprob[:, :L].contiguous()}
        if run.commit_logits is not None:
            trace["commit_logits"] = run.commit_logits[:, :L].contiguous()
        return PolicyOutput(sequences=sequences, num_forwards=run.forwards, tokens_per_forward=rate, **trace)

    # -- setup

    def _start(self, B: int, L: int, prompt: object, attention_mask: object, generators: Any,
               dev: torch.device, block_start: int | None = None) -> R.PolicyRun:
        kernel = self.kernel
        with V.batched_checks():  # the run's value checks, read back once
            kept = resolve_prompt(prompt, B, L, kernel, dev)
            ids = kept[0] if kept is not None else torch.zeros((B, L), dtype=torch.long, device=dev)
            keep = kept[1] if kept is not None else torch.zeros((B, L), dtype=torch.bool, device=dev)
            mask = R.resolve_attention_mask(attention_mask, B, L, keep, dev)
        if mask is not None and not self.blockwise and not R.takes_attention_mask(self.model):
            raise TypeError("attention_mask: the model does not take an attention_mask= keyword, so it cannot ignore "
                            "the padding; pass prompts without padding or a model that takes the mask")
        generated = ~keep
        starts, starts_host = R.row_starts(generated)  # the run's setup sync
        if block_start is not None:
            starts, starts_host = R.block_starts(block_start, self.block_size, starts_host, dev)
        region = L - min(starts_host)
        width = self.block_size if self.block_size is not None else max(region, 1)
        bound = self.policy.max_steps(region) if self.block_size is None and region > 0 else None
        if self.num_steps is not None and bound is not None and self.num_steps > bound:
            raise ValueError(f"num_steps: {type(self.policy).__name__} commits a fixed count per step and, without "
                             f"block_size, the block is the generated region ({region} positions), so it takes at "
                             f"most {bound} steps, got {self.num_steps}")
        num_blocks = max((L - s + width - 1) // width for s in starts_host)
        grid = R.BlockGrid(starts, starts_host, width, num_blocks, L)
        noise = kernel.mask_id if kernel.mask_id is not None else 0
        x = torch.cat([torch.where(generated, noise, ids), ids.new_zeros((B, 1))], dim=1)
        undecided = torch.cat([generated, generated.new_zeros((B, 1))], dim=1)
        run = R.PolicyRun(x=x, undecided=undecided, generated=generated, num_generated=generated.sum(-1).float(),
                   finished=torch.zeros(B, dtype=torch.bool, device=dev),
                   eos_at=torch.full((B,), L, dtype=torch.long, device=dev),
                   forwards=torch.zeros(B, dtype=torch.long, device=dev), attention_mask=mask, grid=grid,
                   generator=generators)
        if self.block_model is not None:
            if len(set(starts_host)) > 1:
                raise ValueError("prompt: the block path of a BlockDenoiser needs every row's generated region to "
                                 f"start at the same column, got {sorted(set(starts_host))[:4]}; left-pad prompts of "
                                 "different lengths (attention_mask)")
            P = starts_host[0]
            prefix_mask = mask[:, :P] if mask is not None else keep.new_ones((B, P))
            with V.unchecked():
                run.block_state = self.block_model.start_blocks(ids[:, :P], prefix_mask)
        elif self.policy.family == "uniform" and num_blocks > 1:
            self._fill_later_blocks(run)
        return run

    def _fill_later_blocks(self, run: R.PolicyRun) -> None:
        """Uniform noise at the generated positions after each row's first block, on the x0 path (the model sees the
        whole sequence; each block's own canvas is drawn when the block starts). The filler comes from a generator
        seeded by a hash of the run's generator state (per row with per-row generators), so it consumes none of the
        run's draws: both model paths, and DiffusionGemma's reference, see the same random stream."""
        grid, L, dev = run.grid, run.grid.seq_len, run.x.device
        counts = [max(L - s - grid.width, 0) for s in grid.starts_host]
        n, S = max(counts), self.kernel.num_states
        g = run.generator
        if g is None or isinstance(g, torch.Generator):
            filler = _derived_generator(g, dev)
            noise = torch.randint(0, S, (len(counts), n), generator=filler, device=dev)
        else:  # each row draws its own count: the same draws as the row alone
            noise = torch.stack([torch.nn.functional.pad(torch.randint(
                0, S, (1, c), generator=_derived_generator(gr, dev), device=dev)[0], (0, n - c)) for c, gr in
                zip(counts, g)])
        cols = (grid.starts + grid.width).unsqueeze(-1) + torch.arange(n, device=dev)
        ok = (cols < L) & run.generated.gather(1, cols.clamp_max(L - 1))
        current = run.x.gather(1, cols.clamp_max(L))
        run.x.scatter_(1, torch.where(ok, cols, L), torch.where(ok, noise, current))

    # -- model calls

    def _logits(self, run: R.PolicyRun, rows: torch.Tensor, cols: torch.Tensor, t: torch.Tensor,
                self_condition: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x0 logits ``(B_a, K, S)`` at the block columns ``cols`` of ``rows`` (with ``positions``, a
        :class:`BlockDenoiser` may leave the others at any finite value)."""
        S, L = self.kernel.num_states, run.grid.seq_len
        Ba, K = cols.shape
        with V.unchecked():  # the sampler's own tokens and times: valid by construction
            if run.block_state is not None:
                assert self.block_model is not None  # a block state comes from it
                head = self.block_model.denoise_block(run.block_state, run.x[rows].gather(1, cols), t, rows,
                                                      self_condition, positions=positions)
                shape = (Ba, K)
            else:
                kwargs = {} if run.attention_mask is None else {"attention_mask": run.attention_mask[rows]}
                assert callable(self.model)  # checked in __init__ (the x0 path)
                head = self.model(run.x[rows, :L], t, **kwargs)
                shape = (Ba, L)
        if not run.checked:  # the first output: checked once (a host sync)
            head = check_head_shape("model", head, *shape, S)
            V.check_finite("model output", head)
            run.checked = True
        if run.block_state is None:
            head = head.gather(1, cols.clamp_max(L - 1).unsqueeze(-1).expand(-1, -1, S))
        return head

    def _logits_and_hidden(self, run: R.PolicyRun, rows: torch.Tensor, cols: torch.Tensor, t: torch.Tensor,
                           self_condition: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x0 logits ``(B_a, K, S)`` and the final hidden states ``(B_a, K, d)`` they come from, at the block columns
        ``cols`` of ``rows``, for a policy that reads hidden states (checked in ``__init__``: the model offers
        them)."""
        S, L = self.kernel.num_states, run.grid.seq_len
        with V.unchecked():
            if run.block_state is not None:
                decoder = cast(HiddenStateBlockDenoiser, self.model)
                h = decoder.denoise_block_hidden(run.block_state, run.x[rows].gather(1, cols), t, rows,
                                                 self_condition)
                head = decoder.logits_from_hidden(h)  # (B_a, K, S)
            else:
                x0_model = cast(HiddenStateModel, self.model)
                kwargs = {} if run.attention_mask is None else {"attention_mask": run.attention_mask[rows]}
                h_all = x0_model.hidden_states(run.x[rows, :L], t, **kwargs)  # (B_a, L, d)
                h = h_all.gather(1, cols.clamp_max(L - 1).unsqueeze(-1).expand(-1, -1, h_all.shape[-1]))
                head = x0_model.logits_from_hidden(h)  # (B_a, K, S)
        if not run.checked:
            head = check_head_shape("model", head, cols.shape[0], cols.shape[1], S)
            V.check_finite("model output", head)
            run.checked = True
        return head, h

    def _commit(self, run: R.PolicyRun, b: int) -> None:
        cols, _ = run.grid.columns(b)
        rows, rows_host = run.running(~run.finished)
        if rows_host and self.block_model is not None:
            with V.unchecked():
                run.block_state = self.block_model.commit_block(run.block_state, run.x[rows].gather(1, cols[rows]),
                                                                rows)

    def _times(self, run: R.PolicyRun, rows: torch.Tensor, clean_in_block: torch.Tensor | None = None) -> torch.Tensor:
        noised = run.undecided[rows].sum(-1).float()
        if clean_in_block is not None:
            noised = noised - clean_in_block.sum(-1).float()
        return R.noise_time(self.kernel, noised / run.num_generated[rows].clamp_min(1.0))

    def _stop_at(self, run: R.PolicyRun, stop: torch.Tensor | None, fill: int) -> None:
        """Rows with ``stop[b] ≥ 0`` end at that column: later generated positions become ``fill`` and are decided."""
        if stop is None:
            return
        L = run.grid.seq_len
        stop = stop.to(run.x.device, torch.long)
        if tuple(stop.shape) != (run.x.shape[0],):
            raise ValueError(f"stopping: expected a ({run.x.shape[0]},) column per row or None, got shape "
                             f"{tuple(stop.shape)}")
        done = (stop >= 0) & ~run.finished
        after = done.unsqueeze(-1) & run.generated & (torch.arange(L, device=run.x.device) > stop.unsqueeze(-1))
        run.x[:, :L] = torch.where(after, fill, run.x[:, :L])
        run.undecided[:, :L] &= ~after
        run.forget_commits(None, after)
        run.finished |= done
        run.eos_at = torch.where(done, stop, run.eos_at)

    def _finish_eos(self, run: R.PolicyRun, rows: torch.Tensor, eos: int | tuple[int, ...] | None,
                    pad: int | None) -> None:
        if eos is None:
            return
        L = run.grid.seq_len
        done, first, tokens, undecided = R.eos_stop(run.x[rows, :L], run.undecided[rows, :L], run.generated[rows],
                                                    eos, pad if pad is not None else R.first_id(eos))
        if run.commit_step is not None:  # the fill replaces whatever was committed after the EOS
            col = torch.arange(L, device=tokens.device)
            run.forget_commits(rows, done[:, None] & run.generated[rows] & (col > first[:, None]))
        run.x[rows, :L] = tokens
        run.undecided[rows, :L] = undecided
        run.finished[rows] |= done
        run.eos_at[rows] = torch.where(done, first, run.eos_at[rows])

    # -- the two families

    def _mask_block(self, run: R.PolicyRun, b: int, eos: int | tuple[int, ...] | None, pad: int | None) -> None:
        policy = cast(MaskPolicy, self.policy)
        cols, K_b = run.grid.columns(b)
        fixed = policy.fixed_count or self.num_steps is not None
        max_steps = (self.num_steps or K_b) if fixed else K_b
        previous: tuple[torch.Tensor, list[int]] | None = None
        for n in range(max_steps):
            block_und = run.undecided.gather(1, cols)
            rows, rows_host, most = run.running_counts(block_und.sum(-1).masked_fill_(run.finished, 0))
            if not rows_host:
                return
            cols_r, und_r = cols[rows], block_und[rows]
            left = und_r.sum(-1)
            num_commit = policy.commit_counts(left, n, max_steps) if fixed else torch.ones_like(left)
            if fixed and policy.schedule.skips_empty_steps and int(num_commit.max()) == 0:
                continue  # a step that commits nothing is skipped, model call included (dllm's MDLM sampler)
            hidden = None
            if policy.reads_hidden:
                logits, hidden = self._logits_and_hidden(run, rows, cols_r, self._times(run, rows),
                                                         _carry(previous, rows_host))
            else:
                positions = None  # a block denoiser needs logits at the masked positions only
                if run.block_state is not None and most < K_b:
                    positions = und_r.int().sort(dim=-1, descending=True, stable=True).indices[:, :most]
                logits = self._logits(run, rows, cols_r, self._times(run, rows), _carry(previous, rows_host),
                                      positions)
            run.forwards[rows] += 1
            where = BlockStep(n, max_steps, cols_r, run.grid.seq_len)
            tokens, commit, p = mask_step_with_probs(policy, logits, und_r, num_commit,
                                                     run.randomness(rows, rows_host), mask_id=self.kernel.mask_id,
                                                     temperature=self.temperature, top_k=self.top_k,
                                                     top_p=self.top_p, do_sample=self.do_sample, hidden=hidden,
                                                     where=where)
            x_r, u_r = run.x[rows], run.undecided[rows]
            x_r.scatter_(1, cols_r, torch.where(commit, tokens, x_r.gather(1, cols_r)))
            u_r.scatter_(1, cols_r, und_r & ~commit)
            run.x[rows], run.undecided[rows] = x_r, u_r
            if run.commit_step is not None:
                self._record(run, rows, cols_r, commit, p, logits)
            self._finish_eos(run, rows, eos, pad)
            if run.block_state is not None:
                previous = (logits.float() / self.temperature, rows_host)

    def _record(self, run: R.PolicyRun, rows: torch.Tensor, cols: torch.Tensor, commit: torch.Tensor, p: torch.Tensor,
                logits: torch.Tensor) -> None:
        """The trace of one step: the committed positions ``commit`` ``(B_a, K)`` at ``cols`` of ``rows`` get the
        index of the model call just made (the row's calls so far, the denoiser's own ones included, minus one) and
        the log of their probability ``p`` ``(B_a, K)``."""
        assert run.commit_step is not None and run.commit_logprob is not None
        index = run.forwards[rows] - 1
        extra = getattr(run.block_state, "extra_forwards", None)
        if extra is not None:  # the prefill and separate commit passes so far
            index = index + extra[rows]
        if run.commit_logits is not None:
            kept = run.commit_logits[rows]
            S = kept.shape[-1]
            index3 = cols.unsqueeze(-1).expand(-1, -1, S)
            chosen = torch.where(commit.unsqueeze(-1), logits.float(), kept.gather(1, index3))
            run.commit_logits[rows] = kept.scatter(1, index3, chosen)
        step_r, logp_r = run.commit_step[rows], run.commit_logprob[rows]
        step_r.scatter_(1, cols, torch.where(commit, index[:, None], step_r.gather(1, cols)))
        logp_r.scatter_(1, cols, torch.where(commit, p.log(), logp_r.gather(1, cols)))
        run.commit_step[rows], run.commit_logprob[rows] = step_r, logp_r

    def _uniform_block(self, run: R.PolicyRun, b: int, eos: int | tuple[int, ...] | None, pad: int | None) -> None:
        policy = cast(EntropyBound, self.policy)
        B = run.x.shape[0]
        cols, K_b = run.grid.columns(b)
        eligible = run.undecided.gather(1, cols)  # (B, K_b)
        alive, alive_host = run.running(~run.finished & eligible.any(-1))
        if not alive_host:
            return
        S = self.kernel.num_states
        canvas = run.randomness(alive, alive_host).randint(S, (K_b,), run.x.device)  # the block's x_t at t = 1
        x_a, cols_a = run.x[alive], cols[alive]
        x_a.scatter_(1, cols_a, torch.where(eligible[alive], canvas, x_a.gather(1, cols_a)))
        run.x[alive] = x_a
        num_steps = self.num_steps or K_b
        history = policy.initial_history(B, K_b, run.x.device)
        stopped = torch.zeros(B, dtype=torch.bool, device=run.x.device)
        argmax = run.x.gather(1, cols)
        accepted = torch.zeros_like(eligible)
        previous: tuple[torch.Tensor, list[int]] | None = None
        alive_mask = torch.zeros_like(stopped).index_fill_(0, alive, True)
        for n in range(num_steps):
            rows, rows_host = run.running(alive_mask & ~stopped)
            if not rows_host:
                break
            cols_r, x_r = cols[rows], run.x[rows]
            logits = self._logits(run, rows, cols_r, self._times(run, rows, accepted[rows]),
                                  _carry(previous, rows_host))
            run.forwards[rows] += 1
            step = entropy_bound_step(policy, logits, x_r.gather(1, cols_r), eligible[rows], history[rows],
                                      run.randomness(rows, rows_host), step=n, num_steps=num_steps,
                                      temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
            x_r.scatter_(1, cols_r, step.canvas)
            run.x[rows] = x_r
            argmax[rows], history[rows] = step.argmax, step.history
            stopped[rows], accepted[rows] = step.stop, step.accepted & eligible[rows]
            if run.block_state is not None:
                previous = (step.logits, rows_host)
        # the block's tokens: the argmax of each row's last step
        x_a, u_a, el_a = run.x[alive], run.undecided[alive], eligible[alive]
        x_a.scatter_(1, cols_a, torch.where(el_a, argmax[alive], x_a.gather(1, cols_a)))
        u_a.scatter_(1, cols_a, u_a.gather(1, cols_a) & ~el_a)
        run.x[alive], run.undecided[alive] = x_a, u_a
        self._finish_eos(run, alive, eos, pad)


def _carry(previous: tuple[torch.Tensor, list[int]] | None, rows_host: list[int]) -> torch.Tensor | None:
    """The previous step's scaled logits for the rows running now (a subset of the previous step's rows)."""
    if previous is None:
        return None
    logits, before = previous
    if before == rows_host:
        return logits
    where = {r: i for i, r in enumerate(before)}
    return logits[host_to_device(torch.tensor([where[r] for r in rows_host]), logits.device)]


def _derived_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded by a hash of ``generator``'s current state (the global one's for ``None``):
    a function of that state that draws nothing from it."""
    if generator is not None:
        state = generator.get_state()
    elif device.type == "cuda":
        state = torch.cuda.get_rng_state(device)
    else:
        state = torch.get_rng_state()
    seed = int.from_bytes(hashlib.blake2b(state.numpy().tobytes(), digest_size=8).digest(), "little") >> 1
    return torch.Generator(device=device).manual_seed(seed)
