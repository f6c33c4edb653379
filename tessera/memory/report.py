"""How many bytes of model state a rank holds, and its peak resident memory."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from tessera.memory.manager import ChunkMemory
    from tessera.memory.tiers import Part


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct tensors (a tensor met twice, e.g. a tied weight, counts once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if t.is_meta:  # a deferred model's tensor this rank does not hold
            continue
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key in seen:
            continue
        seen.add(key)
        total += key[1]
    return total


@runtime_checkable
class ReportsMemory(Protocol):
    """An optimizer that knows which model-state tensors this rank holds (ZeRO's and Gemini's
    sharded optimizer, whose pieces are not the model's parameters)."""

    def memory_parts(self) -> dict[str, list[torch.Tensor]]:
        """``{"parameters", "gradients", "optimizer_states"}``: the tensors this rank holds of
        each kind (on any tier)."""
        ...


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | ReportsMemory | None = None
) -> dict[str, int]:
    """``{"parameters", "gradients", "optimizer_states", "total"}`` in bytes on this rank.

    Optimizer states are every tensor the optimizer keeps per parameter (Adam's moments and
    step counters, say), and fp32 master weights where they are kept apart (ZeRO with bf16/fp16).
    An optimizer that :class:`ReportsMemory` (a sharded one) says itself what this rank holds.
    """
    if isinstance(optimizer, ReportsMemory):
        held = optimizer.memory_parts()
        out = {
            "parameters": _tensor_bytes(held["parameters"]),
            "gradients": _tensor_bytes(held["gradients"]),
            "optimizer_states": _tensor_bytes(held["optimizer_states"]),
        }
        out["total"] = sum(out.values())
        return out
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states: list[torch.Tensor] = []
    if optimizer is not None:
        for state in optimizer.state.values():
            states.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    out = {
        "parameters": _tensor_bytes(params),
        "gradients": _tensor_bytes(grads),
        "optimizer_states": _tensor_bytes(states),
    }
    out["total"] = sum(out.values())
    return out


_STATUS = Path("/proc/self/status")


def tiered_report(memory: ChunkMemory) -> dict[str, Any]:
    """The memory manager's policy, the bytes of each tier (now and at their peak) and the
    disk's traffic."""
    disk = memory.disk
    return {
        "policy": memory.policy.name,
        **memory.ledger.summary(),
        "disk_written_bytes": disk.bytes_written if disk else 0,
        "disk_read_bytes": disk.bytes_read if disk else 0,
    }


def parts_by_kind(parts: Iterable[Part]) -> dict[str, list[torch.Tensor]]:
    """The tensors of ``parts`` held in memory now (those on disk are not), by what
    :func:`model_state_bytes` counts them as."""
    out: dict[str, list[torch.Tensor]] = {"parameters": [], "gradients": [], "optimizer_states": []}
    for part in parts:
        if part.tensor is not None:
            out[_REPORTED_AS[part.kind]].append(part.tensor)
    return out


_REPORTED_AS = {
    "params": "parameters",
    "grads": "gradients",
    "master": "optimizer_states",
    "states": "optimizer_states",
}


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process (VmHWM), or None where /proc is missing."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux); returns whether it could."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def trim_heap() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``; nothing elsewhere),
    so that the resident size counts what is alive, not what the allocator keeps in reserve.
    glibc keeps freed blocks of a few MB in its heap and does not always reuse them for the
    next block of the same size (alignment): a replay drawing and freeing full tensors one after
    another would otherwise stay resident at several of them."""
    malloc_trim = _libc("malloc_trim")
    if malloc_trim:
        malloc_trim(0)


_libc_functions: dict[str, Any] = {}


def _libc(name: str) -> Any:
    """glibc's function ``name``, or None where there is no glibc (looked up once)."""
    if name not in _libc_functions:
        try:
            _libc_functions[name] = getattr(ctypes.CDLL("libc.so.6"), name)
        except (OSError, AttributeError):
            _libc_functions[name] = None
    return _libc_functions[name]


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def map_large_allocations(threshold: int = 256 * 1024) -> bool:
    """Serve every allocation of ``threshold`` bytes or more with its own memory mapping, which
    goes back to the system as soon as it is freed (glibc; returns whether it could). glibc
    starts so, but raises the threshold each time such a block is freed, after which large
    blocks come from the heap and, freed, stay resident in its holes: a process that keeps
    taking and freeing buffers of a few MB (activations, chunks read from disk) then creeps
    above what it holds alive. Setting the threshold fixes it."""
    mallopt = _libc("mallopt")
    return bool(mallopt and mallopt(_M_MMAP_THRESHOLD, threshold))
