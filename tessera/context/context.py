"""``ParallelContext``: the process groups of a layout, seen from one rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera import comm
from tessera.comm import AxisGroup
from tessera.context.dims import AxisSpec, ParallelDims, group_table
from tessera.context.rng import RNGStreams

REPLICA_AXES = ("data", "sequence")
EXPERT_REPLICA_AXES = ("expert_data", "sequence")


def _axis_name(axis: AxisSpec) -> str:
    return axis if isinstance(axis, str) else "+".join(axis)


class ParallelContext:
    """Named axes, their process groups, this rank's place in them, and per-axis RNG streams.

    Building a context with more than one rank is collective: every rank of the world must
    build the same layout at the same point, because it creates the process groups.
    """

    def __init__(
        self,
        dims: ParallelDims,
        *,
        device: torch.device | None = None,
        seed: int = 42,
    ) -> None:
        if dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = 0, 1
        if world != dims.world_size:
            raise ValueError(f"layout is for world size {dims.world_size} but the process group has {world} ranks")
        self._lay_out(dims, rank, dist.get_backend() if dist.is_initialized() else None, device, seed)

    @classmethod
    def alone(cls, device: torch.device | str | None = None, seed: int = 42) -> ParallelContext:
        """A context of this process alone: a world of one rank (rank 0), every axis of size 1,
        every group a single-rank group whose collectives return at once.

        It creates no process group and works whether or not torch.distributed is initialized;
        it does not become the current context. For work one rank does by itself while a
        multi-rank job runs, e.g. each data-parallel replica generating for its own prompts
        (``InferenceEngine(runner, ParallelContext.alone(device))``). Its ranks are of its own
        world: ``rank`` is 0 whatever this process's rank in the job is.
        """
        ctx = cls.__new__(cls)
        ctx._lay_out(ParallelDims(world_size=1), 0, None, torch.device(device) if device is not None else None, seed)
        return ctx

    def _lay_out(
        self, dims: ParallelDims, rank: int, backend: str | None, device: torch.device | None, seed: int
    ) -> None:
        """Build the groups of ``dims`` as seen from ``rank`` (collective when ``dims`` spans
        several ranks) and the RNG streams."""
        self.dims = dims
        self.rank = rank
        self.world_size = dims.world_size
        self.device = device or torch.device("cpu")
        self.backend = backend
        self.coordinates = dims.coordinates(rank)
        self._groups: dict[AxisSpec, AxisGroup] = {}
        self._created: set[tuple[int, ...]] = set()  # member lists whose process group exists
        self._side: dict[str, AxisGroup] = {}  # side_group()
        for axis in (*dims.axes, "world"):
            self._groups[axis] = self._build(axis)
        if dims.sequence > 1:  # the replicas of every parameter: data x sequence
            self._groups[REPLICA_AXES] = self._build(REPLICA_AXES)
            if dims.expert > 1:  # and of an expert's
                self._groups[EXPERT_REPLICA_AXES] = self._build(EXPERT_REPLICA_AXES)
        self.rng = RNGStreams(seed, dims, rank, self.device)

    # ---- groups ---------------------------------------------------------------------------
    def _build(self, axis: AxisSpec) -> AxisGroup:
        """Create every group along ``axis`` (collectively) and keep the one holding this rank."""
        mine: tuple[int, ...] = (self.rank,)
        pg: dist.ProcessGroup | None = None
        for members in group_table(self.dims, axis):
            if len(members) > 1 and members not in self._created:
                self._created.add(members)  # every rank creates every group, in the same order
                made = dist.group.WORLD if len(members) == self.world_size else dist.new_group(list(members))
                if self.rank in members:
                    pg = made
            elif len(members) > 1 and self.rank in members:
                # made for an earlier axis; only AxisGroups hold process groups (shutdown lets them go)
                pg = next(g.pg for g in self._groups.values() if g.ranks == members)
            if self.rank in members:
                mine = members
        return AxisGroup(name=_axis_name(axis), ranks=mine, rank=mine.index(self.rank), pg=pg)

    def new_group(self, axes: AxisSpec) -> AxisGroup:
        """The group varying over several axes at once, e.g. ``("data", "sequence")``.

        Collective: every rank must call it with the same axes in the same order.
        """
        key = axes if isinstance(axes, str) else tuple(axes)
        if key not in self._groups:
            self._groups[key] = self._build(key)
        return self._groups[key]

    def side_group(self, name: str) -> AxisGroup:
        """A second process group over every rank, named ``name``, for collectives issued off the
        training thread (a background checkpoint writer): they never interleave with the
        training's, which would hang or mix up both. gloo (CPU tensors) whatever the backend.

        Collective the first time a name is asked for: every rank must ask at the same point.
        """
        if name not in self._side:
            ranks = tuple(range(self.world_size))
            pg = dist.new_group(list(ranks), backend="gloo") if self.world_size > 1 else None
            self._side[name] = AxisGroup(name=name, ranks=ranks, rank=self.rank, pg=pg)
        return self._side[name]

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
        return self._groups[REPLICA_AXES] if self.dims.sequence > 1 else self._groups["data"]

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
        """Global ranks of this rank's group along ``axis``."""
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
        return f"ParallelContext(rank={self.rank}/{self.world_size}, {sizes}, mode={self.dims.tensor_mode})"


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
