"""What a chunk layout needs of the device and host budgets, checked before any chunk takes
memory: the smallest budgets that work are named in the error."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tessera.memory.disk import DiskIO
from tessera.memory.search import pack
from tessera.memory.tiers import BudgetError

_MIB = 2**20


@dataclass(frozen=True)
class WorkingSet:
    """Bytes of one rank's chunk layout: ``device``, what the largest layer needs on the device
    while it runs (its gathered chunks and their shards, a gradient bucket and the chunk's fp32
    gradient); ``host``, what one chunk's parts need in host memory while it is stepped (with a
    disk tier; else 0); ``total``, the whole model state; ``chunk``, the largest gathered chunk;
    ``chunks``, how many chunks."""

    device: int
    host: int
    total: int
    chunk: int
    chunks: int


def working_set(
    numels: Sequence[int],
    labels: Sequence[int],
    sizes: Sequence[int],
    chunk_numel: int,
    element: int,
    fp32_per_element: int,
    disk: bool,
) -> WorkingSet:
    """The working set of tensors of ``numels`` packed under ``labels`` into chunks of
    ``chunk_numel`` (``sizes``: the size of the group each tensor is sharded over), parameters of
    ``element`` bytes and ``fp32_per_element`` fp32 values per parameter element beside them
    (gradients, masters, optimizer states)."""
    chunks = pack(numels, labels, chunk_numel)
    shards = [-(-sum(numels[i] for i in c) // sizes[c[0]]) for c in chunks]
    largest = max(range(len(chunks)), key=lambda k: shards[k] * sizes[chunks[k][0]])
    shard = shards[largest]
    full = shard * sizes[chunks[largest][0]]
    per_chunk_full = full * element + shard * element  # gathered buffer + the shard it came from
    modules = 2 if len(numels) > 1 else 1  # a module's parameters may straddle two chunks
    device = modules * per_chunk_full + full * element + shard * element + shard * 4
    host = shard * (4 * fp32_per_element + element) if disk else 0
    total = sum(shards) * (element + 4 * fp32_per_element)
    return WorkingSet(device, host, total, full * element, len(chunks))


def check_budgets(need: WorkingSet, device_budget: int | None, host_budget: int | None, disk: DiskIO | None) -> None:
    """Raise :class:`BudgetError`, naming the smallest budget that works, when ``need`` cannot
    fit; check that the disk has room for what the budgets leave to it."""
    for key, budget, least in (("device_budget", device_budget, need.device), ("host_budget", host_budget, need.host)):
        if budget is not None and budget < least:
            enough = math.ceil(least / _MIB * 100) / 100  # rounded up: the named budget works
            raise BudgetError(
                f"gemini.{key}={budget / _MIB:.2f} MiB is too small: one chunk of {need.chunk / _MIB:.2f} MiB "
                f"plus the largest layer's working set need at least {enough:.2f} MiB; give "
                f"gemini.{key} >= {enough:.2f} MiB (or a smaller gemini.chunk_mb)"
            )
    in_memory = sum(b or 0 for b in (device_budget, host_budget))
    if host_budget is not None and disk is None and need.total > in_memory:
        raise BudgetError(
            f"gemini: the model state needs {need.total / _MIB:.2f} MiB on this rank but the device and host budgets "
            f"hold {in_memory / _MIB:.2f} MiB and there is no disk tier: give gemini.offload_dir or larger budgets"
        )
    if disk is not None:
        disk.check_room(max(0, need.total - in_memory) if host_budget is not None else 0)


__all__ = ["WorkingSet", "check_budgets", "working_set"]
