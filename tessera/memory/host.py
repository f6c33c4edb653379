"""Host (CPU) copies of device tensors, for state that is offloaded to host memory.

A copy between a CUDA device and host memory runs asynchronously, and at full bus speed, only
when the host side is page-locked ("pinned"). Offloaded model state (ZeRO's fp32 masters and
gradient pieces) crosses the bus every step, so these helpers put it in pinned memory when the
other side is a CUDA tensor and issue the copies without blocking; on CPU they are plain copies.

A non-blocking copy is not finished when the call returns:

- device to host (:func:`host_copy` with ``wait=False``): call :func:`wait_for_device` before the
  host reads the copy (issue every copy of a step first, then wait once);
- host to device (:func:`copy_to_device_`): the host sources must not be written again until the
  device's stream has passed the copies (a later :func:`wait_for_device` orders that).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pins_for(device: torch.device) -> bool:
    """Whether host buffers exchanged with ``device`` are pinned (CUDA devices only)."""
    return device.type == "cuda"


def host_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None, *, wait: bool = True) -> torch.Tensor:
    """A new host tensor holding ``tensor``'s values as ``dtype`` (default: its own), same shape.

    From a CUDA tensor: the result is pinned and filled by a non-blocking copy; with ``wait``
    (default) the call returns once the values have arrived, else call
    :func:`wait_for_device` (``tensor.device``) before reading them. From a host tensor: a plain
    copy (never pinned, never aliasing ``tensor``). The result does not require grad.
    """
    dtype = dtype or tensor.dtype
    source = tensor.detach()
    if not pins_for(source.device):
        return source.to("cpu", dtype, copy=True)
    out = torch.empty(source.shape, dtype=dtype, device="cpu", pin_memory=True)
    out.copy_(source, non_blocking=True)
    if wait:
        wait_for_device(source.device)
    return out


def copy_to_device_(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``destinations[i].copy_(sources[i])`` for every i, in one multi-tensor call.

    Non-blocking when every destination is on a CUDA device and every source is pinned host
    memory (the sources must then stay unchanged until the device's stream has passed the
    copies, see the module docstring); otherwise an ordinary (blocking) copy.
    """
    if len(destinations) != len(sources):
        raise ValueError(f"copy_to_device_: {len(destinations)} destinations for {len(sources)} sources")
    if not destinations:
        return
    non_blocking = all(pins_for(d.device) for d in destinations) and all(s.is_pinned() for s in sources)
    with torch.no_grad():
        torch._foreach_copy_(list(destinations), list(sources), non_blocking=non_blocking)


def wait_for_device(device: torch.device) -> None:
    """Block until every copy and kernel issued so far on ``device``'s current stream has
    finished (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


__all__ = ["copy_to_device_", "host_copy", "pins_for", "wait_for_device"]
