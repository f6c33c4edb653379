"""``ParallelContext``: the process groups of a layout, seen from one rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context import hosts
from tessera.context.dims import AxisSpec, ParallelDims
from tessera.context.hosts import HostSplit
from tessera.context.job import (
    check_ranks,
    job_rank,
    job_table,
    job_world,
    process_group,
    side_process_group,
)
from tessera.context.rng import RNGStreams
from tessera.errors import ConfigError

REPLICA_AXES = ("data", "sequence")
EXPERT_REPLICA_AXES = ("expert_data", "sequence")


def _axis_name(axis: AxisSpec) -> str:
    return axis if isinstance(axis, str) else "+".join(axis)


def _built_axes(dims: ParallelDims, extra: Sequence[AxisSpec] = ()) -> list[AxisSpec]:
    """The axes whose groups a context builds at once, in the order it builds them."""
    axes: list[AxisSpec] = [*dims.axes, "world"]
    if dims.sequence > 1:  # the replicas of every parameter: data x sequence
        axes.append(REPLICA_AXES)
        if dims.expert > 1:  # and of an expert's
            axes.append(EXPERT_REPLICA_AXES)
    return axes + [a if isinstance(a, str) else tuple(a) for a in extra]


class ParallelContext:
    """Named axes, their process groups, this rank's place in them, and per-axis RNG streams.

    Building a context with more than one rank is collective: every rank of the job must build
    the same layout at the same point, because it creates the process groups.

    ``ParallelContext(dims)`` spans the whole job (``dims.world_size`` is torch.distributed's
    world size). :meth:`on_ranks` builds one over part of the job, so that several models of one
    job (an RLHF actor and critic) each have a layout of their own on ranks of their own. Inside a
    context everything is of its own world: ``rank`` (0..``world_size``-1) is this process's index
    among the context's ranks, and coordinates, RNG streams, ``is_first`` and checkpoint files
    follow it; the ``world`` axis and :meth:`side_group` span the context's ranks. Group members
    (``ctx.ranks(axis)``, ``AxisGroup.ranks``) are ranks of the job, as torch.distributed and
    ``tessera.comm`` take them; :attr:`job_ranks` lists the context's ranks in the job and
    :attr:`global_rank` is this process's.
    """

    def __init__(
        self,
        dims: ParallelDims,
        *,
        device: torch.device | None = None,
        seed: int = 42,
    ) -> None:
        world = job_world()
        if world != dims.world_size:
            raise ValueError(f"layout is for world size {dims.world_size} but the process group has {world} ranks")
        backend = dist.get_backend() if dist.is_initialized() else None
        self._lay_out(dims, tuple(range(world)), job_rank(), backend, device, seed)

    @classmethod
    def on_ranks(
        cls,
        ranks: Sequence[int],
        dims: ParallelDims,
        *,
        device: torch.device | str | None = None,
        seed: int = 42,
        groups: Sequence[AxisSpec] = (),
        side_groups: Sequence[str] = (),
    ) -> ParallelContext | None:
        """The context of layout ``dims`` over the job ranks ``ranks`` (ascending, as many as
        ``dims.world_size``) on the processes among them; None on the others.

        Collective over the whole job: every rank of torch.distributed's world calls it with the
        same arguments at the same point, members or not, because torch makes every rank take
        part in creating a process group. For the same reason the groups of a context over part
        of the job are all made here: the multi-axis groups it will need (``groups``, as for
        :meth:`new_group`) and its side groups (``side_groups``, as for :meth:`side_group`, e.g.
        ``"checkpoint"`` for background checkpoint saves) are named now, since the ranks outside
        it hold no context through which to make them later. Over every rank of the job it is
        ``ParallelContext(dims)``, whose groups may still be made later.

        Contexts may overlap (a job may hold one over every rank and one over ranks 0 and 1, or
        one over 0-1 and one over 1-3): each has process groups of its own. Raises ValueError
        for repeated ranks, ranks outside the job, ranks out of order, a count other than
        ``dims.world_size``, or several ranks without torch.distributed initialized.
        """
        job_ranks = check_ranks(ranks, dims)
        me = job_rank()
        axes = _built_axes(dims, groups)
        names = list(dict.fromkeys(side_groups))  # each name once, on members and others alike
        if me not in job_ranks:  # create the groups with the members, keep none of them
            created: set[tuple[int, ...]] = set()
            for axis in axes:
                for members in job_table(dims, job_ranks, axis):
                    if len(members) > 1 and members not in created:
                        created.add(members)
                        process_group(members)
            for _ in names:
                side_process_group(job_ranks)
            return None
        ctx = cls.__new__(cls)
        backend = dist.get_backend() if dist.is_initialized() else None
        ctx._lay_out(dims, job_ranks, me, backend, torch.device(device) if device is not None else None, seed, groups)
        for name in names:
            ctx._side[name] = ctx._make_side_group(name)
        return ctx

    @classmethod
    def alone(cls, device: torch.device | str | None = None, seed: int = 42) -> ParallelContext:
        """A context of this process alone: a world of one rank (rank 0), every axis of size 1,
        every group a single-rank group whose collectives return at once.

        It creates no process group and works whether or not torch.distributed is initialized;
        it does not become the current context. For work one rank does by itself while a
        multi-rank job runs, e.g. each data-parallel replica generating for its own prompts
        (``InferenceEngine(runner, ParallelContext.alone(device))``). Its ranks are of its own
        world: ``rank`` is 0 whatever this process's rank in the job is (its groups' one member,
        :attr:`global_rank`, is this process's rank in the job).
        """
        ctx = cls.__new__(cls)
        device = torch.device(device) if device is not None else None
        ctx._lay_out(ParallelDims(world_size=1), (job_rank(),), job_rank(), None, device, seed)
        return ctx

    def _lay_out(
        self,
        dims: ParallelDims,
        job_ranks: tuple[int, ...],
        me: int,
        backend: str | None,
        device: torch.device | None,
        seed: int,
        groups: Sequence[AxisSpec] = (),
    ) -> None:
        """Build the groups of ``dims`` over the job ranks ``job_ranks`` as seen from job rank
        ``me`` (collective when ``dims`` spans several ranks) and the RNG streams."""
        self.dims = dims
        self.job_ranks = job_ranks
        self.rank = job_ranks.index(me)
        self.world_size = dims.world_size
        self.device = device or torch.device("cpu")
        self.backend = backend
        self.coordinates = dims.coordinates(self.rank)
        self._whole_job = job_ranks == tuple(range(job_world()))
        self._groups: dict[AxisSpec, AxisGroup] = {}
        self._created: set[tuple[int, ...]] = set()  # member lists (job ranks) whose process group exists
        self._side: dict[str, AxisGroup] = {}  # side_group()
        self._host_of = hosts.host_of()  # the job's hosts as discovered when the context was built
        self._host_splits: dict[AxisSpec, HostSplit] = {}  # host_split()
        for axis in _built_axes(dims, groups):
            self._groups[axis] = self._build(axis)
        self.rng = RNGStreams(seed, dims, self.rank, self.device)
        if self.rank == 0 and len(job_ranks) > 1:
            hosts.warn_crossing(dims, job_ranks)

    @property
    def hosts(self) -> tuple[int, ...]:
        """The host of each of the context's ranks (an index, hosts numbered in the order of their
        first rank; :mod:`tessera.context.hosts`) as discovered when the context was built: all 0
        outside ``tessera.launch``."""
        known = self._host_of
        if known is None or len(known) <= max(self.job_ranks):
            return (0,) * self.world_size
        return hosts.host_indices([known[r] for r in self.job_ranks])

    def host_split(self, axis: AxisSpec, what: str = "zero.shard='host'") -> HostSplit:
        """This rank's group along ``axis`` split by host (:class:`~tessera.context.HostSplit`:
        ``<axis>.host`` inside this rank's host, ``<axis>.across`` between the hosts). Collective
        the first time for an axis, like :meth:`new_group`; raises ConfigError (naming ``what``)
        when the groups do not spread evenly over the hosts (``hosts.split_by_host``)."""
        key = axis if isinstance(axis, str) else tuple(axis)
        if key not in self._host_splits:
            host = dict(zip(self.job_ranks, self.hosts)).__getitem__
            inside, across = hosts.split_by_host(job_table(self.dims, self.job_ranks, key), host, what)
            if not self._whole_job and any(len(m) > 1 and m not in self._created for m in inside + across):
                raise ConfigError(
                    f"{what} on a context over part of the job (ranks {list(self.job_ranks)}): its groups by host "
                    "need every rank of the job to make them; use it on a context over the whole job"
                )
            name = _axis_name(key)
            self._host_splits[key] = HostSplit(self._make(f"{name}.host", inside),
                                                     self._make(f"{name}.across", across))  # fmt: skip
        return self._host_splits[key]

    @property
    def global_rank(self) -> int:
        """This process's rank in the job (torch.distributed's rank); :attr:`rank` is its rank in
        the context."""
        return self.job_ranks[self.rank]

    # ---- groups ---------------------------------------------------------------------------
    def _build(self, axis: AxisSpec) -> AxisGroup:
        """Create every group along ``axis`` (collectively) and keep the one holding this rank."""
        return self._make(_axis_name(axis), job_table(self.dims, self.job_ranks, axis))

    def _make(self, name: str, table: list[tuple[int, ...]]) -> AxisGroup:
        """Create every group of ``table`` (job ranks; collectively) and keep the one holding this
        rank as ``name`` (a group made before is shared)."""
        me = self.global_rank
        mine: tuple[int, ...] = (me,)
        pg: dist.ProcessGroup | None = None
        known = [*self._groups.values(), *(g for s in self._host_splits.values() for g in (s.inside, s.across))]
        for members in table:
            if len(members) > 1 and members not in self._created:
                self._created.add(members)  # every rank creates every group, in the same order
                made = process_group(members)
                if me in members:
                    pg = made
            elif len(members) > 1 and me in members:
                # made for an earlier axis; only AxisGroups hold process groups (shutdown lets them go)
                pg = next(g.pg for g in known if g.ranks == members)
            if me in members:
                mine = members
        return AxisGroup(name=name, ranks=mine, rank=mine.index(me), pg=pg)

    def _part_of_job(self, what: str, option: str) -> RuntimeError:
        return RuntimeError(
            f"{what}: this context spans part of the job (ranks {list(self.job_ranks)}), and a new process "
            "group needs every rank of the job, but the ranks outside it hold no context to make it with; "
            f"name it when the context is built: ParallelContext.on_ranks(..., {option})"
        )

    def new_group(self, axes: AxisSpec) -> AxisGroup:
        """The group varying over several axes at once, e.g. ``("data", "sequence")``.

        Collective: every rank must call it with the same axes in the same order. A context over
        part of the job makes no process group after it is built: its groups that need new ones
        are named in :meth:`on_ranks` (``groups=``).
        """
        key = axes if isinstance(axes, str) else tuple(axes)
        if key not in self._groups:
            if not self._whole_job and any(
                len(m) > 1 and m not in self._created for m in job_table(self.dims, self.job_ranks, key)
            ):
                raise self._part_of_job(f"ctx.new_group({key!r})", f"groups=[{key!r}]")
            self._groups[key] = self._build(key)
        return self._groups[key]

    def side_group(self, name: str) -> AxisGroup:
        """A second process group over every rank of the context, named ``name``, for
        collectives issued off the training thread (a background checkpoint writer): they never
        interleave with the training's, which would hang or mix up both. gloo (CPU tensors)
        whatever the backend.

        Collective the first time a name is asked for: every rank must ask at the same point. A
        context over part of the job has the side groups named in :meth:`on_ranks`
        (``side_groups=``) and no others.
        """
        if name not in self._side:
            if not self._whole_job and self.world_size > 1:
                raise self._part_of_job(f"ctx.side_group({name!r})", f"side_groups=[{name!r}]")
            self._side[name] = self._make_side_group(name)
        return self._side[name]

    def _make_side_group(self, name: str) -> AxisGroup:
        return AxisGroup(name=name, ranks=self.job_ranks, rank=self.rank, pg=side_process_group(self.job_ranks))

    def group(self, axis: AxisSpec) -> AxisGroup:
        """This rank's group along ``axis``; pass it to any ``tessera.comm`` function.

        ``ctx.group(axis).pg`` is the torch ProcessGroup (None for an axis of one rank).
        """
        key = axis if isinstance(axis, str) else tuple(axis)
        if key not in self._groups:
            if isinstance(key, str):
                self.dims.varied_coordinates(key)  # raises KeyError naming the axes that exist
            raise KeyError(f"group {key!r} was not built; call ctx.new_group({key!r}) on every rank")
        return self._groups[key]

    @property
    def replicas(self) -> AxisGroup:
        """The ranks that hold the same parameters and average their gradients (ZeRO shards
        over them): the data axis, times the sequence axis when the sequence is split (its
        ranks run the same model on other tokens of the same batch)."""
        return self._groups[self.replicas_axis]

    @property
    def replicas_axis(self) -> AxisSpec:
        """The axis (or axes) of :attr:`replicas`."""
        return REPLICA_AXES if self.dims.sequence > 1 else "data"

    @property
    def expert_replicas(self) -> AxisGroup:
        """The ranks that hold the same experts of an MoE layer (split over the ``expert`` axis)
        and average their gradients (ZeRO shards them over these): the replicas without the
        expert axis, i.e. ``expert_data`` (times ``sequence`` when the sequence is split). The
        same group as :attr:`replicas` when experts are not spread."""
        if self.dims.expert == 1:
            return self.replicas
        return self._groups[EXPERT_REPLICA_AXES] if self.dims.sequence > 1 else self._groups["expert_data"]

    def size(self, axis: AxisSpec) -> int:
        return self.group(axis).size

    def local_rank(self, axis: AxisSpec) -> int:
        """This rank's index inside its group along ``axis``."""
        return self.group(axis).rank

    def ranks(self, axis: AxisSpec) -> list[int]:
        """Ranks in the job (torch.distributed's) of this rank's group along ``axis``."""
        return list(self.group(axis).ranks)

    def is_first(self, axis: AxisSpec) -> bool:
        return self.local_rank(axis) == 0

    def is_last(self, axis: AxisSpec) -> bool:
        return self.local_rank(axis) == self.size(axis) - 1

    @property
    def axes(self) -> tuple[str, ...]:
        return self.dims.axes

    def __repr__(self) -> str:
        shown = [
            a for a in self.axes if self.size(a) > 1 and (self.dims.expert > 1 or a not in ("expert", "expert_data"))
        ]
        sizes = ", ".join(f"{a}={self.size(a)}" for a in shown) or "single rank"
        where = "" if self._whole_job else f" on job ranks {list(self.job_ranks)}"
        return f"ParallelContext(rank={self.rank}/{self.world_size}{where}, {sizes}, mode={self.dims.tensor_mode})"


_current: ParallelContext | None = None


def set_context(ctx: ParallelContext | None) -> None:
    """Make ``ctx`` the current context; axis names given to ``tessera.comm`` resolve through it."""
    global _current
    _current = ctx
    comm.set_axis_resolver(ctx.group if ctx is not None else None)


def get_context() -> ParallelContext:
    """The current parallel context (set by ``tessera.launch``)."""
    if _current is None:
        raise RuntimeError("no parallel context yet: call tessera.launch(...) or launch_from_torch(...)")
    return _current


def has_context() -> bool:
    return _current is not None
