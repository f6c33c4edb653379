"""Which ranks share a host, and which axes' groups reach across hosts.

The link between hosts is the slow one (a network against a host's own memory, NVLink or
loopback), so the axes that talk most, every layer (tensor, sequence, expert), should keep each
group inside a host, and only data (then pipeline) span hosts. tessera's coordinates put tensor
innermost, then sequence, pipeline, expert and data outermost (:meth:`ParallelDims.
coordinate_sizes`), and launchers give a host consecutive ranks (torchrun, ``srun``'s block
distribution, ``mpirun --map-by slot``), so a tensor group of at most a host's ranks stays inside
one host by default. :func:`discover` learns the hosts at launch (each rank's hostname, gathered
once); a context whose tensor, sequence or expert groups reach across hosts says so once
(:func:`warn_crossing`), naming the axis and a group, since the layout still trains correctly.

Hybrid sharding (``zero.shard="host"``, docs/zero.md) splits each data group by host
(:func:`split_by_host`): the members on one host shard the model state among themselves, and the
members holding the same shard on the other hosts all-reduce it.
"""

from __future__ import annotations

import socket
import warnings
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context.dims import AxisSpec, ParallelDims, group_table
from tessera.errors import ConfigError

#: the axes whose collectives run every layer: a group of them across hosts is warned about
CHATTY_AXES = ("tensor", "sequence", "expert")

_host_of: tuple[int, ...] | None = None  # the host index of every job rank, once discovered
_hostnames: tuple[str, ...] = ()
_warned: set[tuple[str, ...]] = set()


class HostCrossingWarning(UserWarning):
    """A tensor, sequence or expert group has ranks on more than one host."""


def host_indices(names: Sequence[Hashable]) -> tuple[int, ...]:
    """Each rank's host (a name, or another host's index) as an index, hosts numbered in the
    order of their first rank."""
    order: dict[Hashable, int] = {}
    return tuple(order.setdefault(name, len(order)) for name in names)


def discover(hostname: str | None = None) -> tuple[int, ...]:
    """Gather every rank's hostname (collective over the job; ``hostname`` overrides this rank's
    own) and remember the host of every rank. A world of one is one host."""
    global _host_of, _hostnames
    mine = hostname if hostname is not None else socket.gethostname()
    if dist.is_initialized() and dist.get_world_size() > 1:
        world = AxisGroup("world", tuple(range(dist.get_world_size())), dist.get_rank(), dist.group.WORLD)
        _hostnames = tuple(str(n) for n in comm.all_gather_object(mine, world))
    else:
        _hostnames = (mine,)
    _host_of = host_indices(_hostnames)
    return _host_of


def forget() -> None:
    """Drop what :func:`discover` learnt (the process group it was learnt in is gone)."""
    global _host_of, _hostnames
    _host_of, _hostnames = None, ()


def host_of() -> tuple[int, ...] | None:
    """The host index of every job rank, or None before :func:`discover` (a process outside
    ``tessera.launch``: its groups are taken to be on one host)."""
    return _host_of


def hostnames() -> tuple[str, ...]:
    """Every job rank's hostname, as :func:`discover` gathered them."""
    return _hostnames


def crossing(
    dims: ParallelDims,
    job_ranks: Sequence[int],
    hosts: Sequence[int],
    axes: Iterable[AxisSpec] = CHATTY_AXES,
) -> dict[str, list[tuple[int, ...]]]:
    """For each of ``axes`` whose groups reach across hosts, those groups (as job ranks): the
    context's rank ``i`` is job rank ``job_ranks[i]``, on host ``hosts[job_ranks[i]]``."""
    found: dict[str, list[tuple[int, ...]]] = {}
    for axis in axes:
        name = axis if isinstance(axis, str) else "+".join(axis)
        if name == "expert" and dims.expert <= 1:
            continue
        groups = [tuple(job_ranks[i] for i in members) for members in group_table(dims, axis)]
        across = [g for g in groups if len({hosts[r] for r in g}) > 1]
        if across:
            found[name] = across
    return found


def warn_crossing(dims: ParallelDims, job_ranks: Sequence[int], hosts: Sequence[int] | None = None) -> None:
    """Warn once per process and set of axes when ``dims``' tensor, sequence or expert groups
    reach across hosts (``hosts``: the host of every job rank; default :func:`host_of`)."""
    hosts = hosts if hosts is not None else _host_of
    if hosts is None or len(set(hosts)) < 2:
        return
    found = crossing(dims, job_ranks, hosts)
    key = tuple(sorted(found))
    if not found or key in _warned:
        return
    _warned.add(key)
    per_host = max(sum(1 for r in job_ranks if hosts[r] == h) for h in set(hosts))
    parts = []
    for axis, groups in found.items():
        example = groups[0]
        where = ", ".join(f"{r} on host {hosts[r]}" for r in example)
        parts.append(f"parallel.{axis}: {len(groups)} group(s) span hosts (e.g. ranks {where})")
    warnings.warn(
        "; ".join(parts) + ". Their collectives run every layer over the link between hosts, the slowest "
        f"one; with {per_host} rank(s) a host, keep tensor x sequence (and expert) within {per_host} so that "
        "each group stays on one host, and let data and pipeline span hosts",
        HostCrossingWarning,
        stacklevel=3,
    )


@dataclass(frozen=True)
class HostSplit:
    """A group split by host, seen from one member: ``inside``, its members on this rank's host
    (named ``<axis>.host``); ``across``, the members at this rank's position inside their hosts,
    one per host (``<axis>.across``). Over one host, ``across`` has this rank alone."""

    inside: AxisGroup
    across: AxisGroup


def split_by_host(
    groups: Sequence[tuple[int, ...]], host: Callable[[int], int], what: str
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Each of ``groups`` (job ranks, ascending) split by host: ``(inside, across)``, where
    ``inside`` are the members of a group on one host (in the order of their hosts' first
    members) and ``across`` the members at the same position inside their host, one per host.
    ``host(r)``: job rank ``r``'s host.

    Raises ConfigError (naming ``what``, the config key asking for it) unless every group has
    the same number of members on each of its hosts, and the same on every group, at least
    two (one member a host would shard nothing)."""
    inside: list[tuple[int, ...]] = []
    across: list[tuple[int, ...]] = []
    sizes: set[int] = set()
    for group in groups:
        by_host: dict[int, list[int]] = {}
        for r in group:
            by_host.setdefault(host(r), []).append(r)
        parts = list(by_host.values())
        counts = {len(part) for part in parts}
        if len(counts) > 1:
            spread = ", ".join(f"host {h}: ranks {part}" for h, part in by_host.items())
            raise ConfigError(
                f"{what}: the data ranks {list(group)} are spread unevenly over hosts ({spread}); each host must hold "
                "the same number of a data group's ranks, so that every host holds whole shard groups"
            )
        sizes |= counts
        inside += [tuple(part) for part in parts]
        across += [tuple(part[i] for part in parts) for i in range(len(parts[0]))]
    if len(sizes) > 1:
        raise ConfigError(f"{what}: data groups have {sorted(sizes)} ranks a host; every group needs the same number")
    if sizes == {1} and any(len(g) > 1 for g in groups):
        raise ConfigError(
            f"{what}: each host holds one rank of every data group, so sharding inside a host shards nothing (every "
            "rank would hold the whole model state); shard over all data ranks (zero.shard='all') instead"
        )
    return inside, across


__all__ = [
    "CHATTY_AXES",
    "HostCrossingWarning",
    "HostSplit",
    "crossing",
    "discover",
    "forget",
    "host_indices",
    "host_of",
    "hostnames",
    "split_by_host",
    "warn_crossing",
]
