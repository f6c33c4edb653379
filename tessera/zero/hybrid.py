"""Hybrid sharding (``zero.shard="host"``): the sharded optimizer shards parameters, gradients
and optimizer states over the replicas of each host only, and every host holds the same shards
(FSDP2's HSDP, ZeRO++'s hpZ, Colossal-AI's ``extra_dp_size``).

A chunk's gradients are reduce-scattered inside the host (``<axis>.host``, e.g. ``data.host``),
then each shard is all-reduced between the ranks holding it on the other hosts
(``<axis>.across``); parameters are all-gathered inside the host only. With ``N`` replicas on
``H`` hosts of ``G = N / H`` each and ``S`` elements of ``b`` bytes in this rank's shards
(``P / G`` and its padding), a backward pass sends ``2 (H-1)/H * S * b`` bytes per rank between
hosts (:func:`inter_host_bytes`) instead of the whole ring traffic of plain ZeRO over hosts.
"""

from __future__ import annotations

import warnings
from fractions import Fraction
from typing import TYPE_CHECKING

from tessera.comm import logical_bytes
from tessera.context import ParallelContext
from tessera.context.hosts import HostSplit
from tessera.errors import ConfigError

if TYPE_CHECKING:
    from tessera.memory.chunks import Chunk

SHARDS = ("all", "host")
_warned = False


class OneHostWarning(UserWarning):
    """``zero.shard="host"`` on a job whose data groups each lie on one host: plain sharding."""


def host_split(ctx: ParallelContext, shard: str) -> HostSplit | None:
    """The groups a sharded optimizer with ``zero.shard=shard`` shards over (``inside``) and
    all-reduces its shards over (``across``); None to shard over every replica (``"all"``, or
    every group of replicas on one host: warned once). Collective the first time on ``ctx``."""
    if shard not in SHARDS:
        raise ConfigError(f"zero.shard={shard!r} is not known; allowed: {', '.join(map(repr, SHARDS))}")
    if shard == "all":
        return None
    if ctx.dims.expert > 1:  # also a layout rule; the optimizer can be built without initialize
        raise ConfigError("zero.shard='host' with parallel.expert > 1 is not supported; use zero.shard='all'")
    split = ctx.host_split(ctx.replicas_axis)
    if split.across.size > 1:
        return split
    global _warned
    if not _warned and ctx.rank == 0:
        _warned = True
        warnings.warn(
            f"zero.shard='host': all {ctx.replicas.size} data ranks of each replica group are on one host "
            f"({len(set(ctx.hosts))} host(s) found at launch), so sharding inside a host is sharding over every "
            "data rank: training goes on as with zero.shard='all'",
            OneHostWarning,
            stacklevel=3,
        )
    return None


def inter_host_bytes(chunks: list[Chunk], across_size: int, element_size: int) -> Fraction:
    """Logical bytes per rank that one reduction of ``chunks``' gradients sends between hosts
    (one backward pass; stage 1: one step): each chunk's shard all-reduced over ``across_size``
    hosts, ``2 (H-1)/H * shard bytes`` (the comm ledger's measure)."""
    return sum((logical_bytes("all_reduce", c.shard_numel * element_size, across_size) for c in chunks), Fraction(0))
