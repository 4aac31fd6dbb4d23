"""Work on a device that never makes the host wait (private): categorical draws and copies of host-built data.

A GPU runs kernels asynchronously; the host only waits where it reads a value back or copies pageable host memory
with ``non_blocking=False`` (CUDA's ``memcpy_and_sync``: a ``cudaMemcpy`` followed by a stream synchronisation, so
the host waits for every queued kernel first). ``torch.multinomial`` is avoided for the same reason: its input checks
read the probabilities back with ``.item()`` in the torch versions unifusion supports (torch ≥ 2.4; 2.14 makes them
asynchronous).
"""

from __future__ import annotations

import torch

__all__ = ["categorical", "host_to_device", "rand", "randint"]


def rand(shape: tuple[int, ...] | torch.Size, *, generator: torch.Generator | None,
         device: torch.device | str | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.rand(shape, ...)`` that passes ``generator=`` only when one is given: Dynamo traces the generator-free
    call with symbolic sizes (a compiled step whose batch length changes), while ``generator=None`` selects an
    overload it cannot trace with them. Eagerly the two calls draw the same numbers."""
    if generator is None:
        return torch.rand(shape, device=device, dtype=dtype)
    return torch.rand(shape, generator=generator, device=device, dtype=dtype)


def randint(high: int, shape: tuple[int, ...] | torch.Size, *, generator: torch.Generator | None,
            device: torch.device) -> torch.Tensor:
    """``torch.randint(0, high, shape, ...)`` int64, passing ``generator=`` only when one is given (:func:`rand`)."""
    if generator is None:
        return torch.randint(0, high, shape, device=device)
    return torch.randint(0, high, shape, generator=generator, device=device)


def categorical(weights: torch.Tensor, num_samples: int, generator: torch.Generator | None) -> torch.Tensor:
    """``num_samples`` independent draws per row of non-negative ``weights`` ``(..., S)``, int64
    ``(..., num_samples)``: index i with probability w_i / Σ_j w_j (rows need not be normalised).

    Inverse CDF: with c_i = Σ_{j ≤ i} w_j and u ~ U[0, 1), the draw is the smallest i with c_i > u · c_S. The same
    distribution as ``torch.multinomial(weights, num_samples, replacement=True)`` (another random stream), with no
    read back to the host: no input checks (a row that sums to 0 or holds NaN gives an arbitrary index in [0, S)).
    A state of weight 0 is never drawn: its c_i equals its predecessor's. The sums run in float64 (float32 on MPS),
    so rounding shifts a probability by at most ~S · 10⁻¹⁶ of the row's mass.
    """
    S = weights.shape[-1]
    dtype = torch.float32 if weights.device.type == "mps" else torch.float64
    cdf = weights.to(dtype).cumsum(-1)  # (..., S), non-decreasing
    total = cdf[..., -1:]
    u = torch.rand((*weights.shape[:-1], num_samples), generator=generator, device=weights.device, dtype=dtype)
    v = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # u · c_S < c_S even after rounding
    return torch.searchsorted(cdf, v, right=True).clamp_max(S - 1)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without making the host wait, for data of one call (a prompt, times, a batch).

    From the CPU to a CUDA device the data are copied into a fresh pinned buffer and sent with ``non_blocking=True``:
    the host goes on at once (the caching host allocator keeps the buffer until the copy has run, and the caller may
    write ``host`` straight away). A tensor already on ``device`` is returned as is; any other move is a plain
    ``tensor.to(device)`` (a device to the host, a tensor that requires grad, or a backend whose asynchronous copies
    unifusion does not rely on).
    """
    if host.device == device:
        return host
    if host.device.type == "cpu" and device.type == "cuda" and not host.requires_grad:
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        pinned.copy_(host)
        return pinned.to(device, non_blocking=True)
    return host.to(device)
