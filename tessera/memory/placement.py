"""Placement policies for chunk parts: where each part starts and which one leaves a full tier.

- :class:`StaticPolicy`: fixed homes. A fraction of the parameter chunks and of the optimizer
  chunks (fp32 masters, optimizer states and gradients) lives off the device: in host memory
  while the host budget has room, on disk after that. A part used away from home goes back
  as soon as it is done with; only parts away from home are evicted.
- :class:`AutoPolicy`: no homes. Parts start on the device while the budget has room, then
  in host memory, then on disk, in the order the model uses them; when a tier is full, the part
  whose next use (from the warm-up trace) is furthest away leaves it (Belady's rule; the least
  recently used one before a trace exists).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from tessera.memory.budgets import WorkingSet
from tessera.memory.manager import ChunkMemory
from tessera.memory.tiers import BudgetError, Part, Residence, Tier

PARAM_KINDS = ("params", "frozen")  # "frozen": a frozen chunk's shard (no masters, gradients or states)
OPTIMIZER_KINDS = ("master", "states", "grads")


class StaticPolicy:
    """Homes fixed at start: ``params_offload`` and ``optimizer_offload`` are the shares (0..1)
    of parameter and optimizer chunks kept off the device, the last chunks in model order first."""

    name = "static"

    def __init__(self, params_offload: float, optimizer_offload: float) -> None:
        for key, value in (("params_offload", params_offload), ("optimizer_offload", optimizer_offload)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{key}={value} must be within [0, 1]")
        self.params_offload = params_offload
        self.optimizer_offload = optimizer_offload
        self._home: dict[str, Tier] = {}
        self.pinned: dict[str, Tier] = {}  # parts whose home is given (a frozen base's tier)
        self._nchunks = 0
        self._room: dict[Tier, float] = {Tier.DEVICE: 0.0, Tier.HOST: 0.0}

    def setup(self, nchunks: int, device_room: float, host_room: float) -> None:
        """Chunks at or past ``(1 - share) * nchunks`` of a kind live off the device; so does a
        part for which ``device_room`` (bytes of the device budget left for homes) is used up,
        and a part for which ``host_room`` is used up lives on disk."""
        self._nchunks = nchunks
        self._room = {Tier.DEVICE: device_room, Tier.HOST: host_room}

    def configure(self, need: WorkingSet, device_budget: int | None, host_budget: int | None) -> None:
        """Homes within what the budgets leave beside the working set."""
        inf = float("inf")
        self.setup(need.chunks, (device_budget or inf) - need.device, (host_budget or inf) - need.host)

    def initial(self, part: Part, memory: ChunkMemory) -> Tier:
        home = self.home(part)
        assert home is not None
        return home

    def step_tier(self, parts: dict[str, Part], memory: ChunkMemory, ungathered: Callable[[], int]) -> Tier:
        """Where a chunk is stepped: where its optimizer state's home's memory is."""
        states = parts.get("states") or parts.get("master") or parts["params"]
        if states.residence is Residence.DEVICE or self.home(states) not in (Tier.HOST, Tier.DISK):
            return Tier.DEVICE
        return Tier.HOST

    def keep_room_for(
        self, activations: int, chunks: Sequence[dict[str, Part]], ungathered: int, memory: ChunkMemory
    ) -> None:
        """Homes are fixed: activations take what the homes leave."""

    def home(self, part: Part) -> Tier | None:
        home = self.pinned.get(part.name) or self._home.get(part.name)
        if home is None:  # homes are given as parts appear (optimizer states at the first step)
            share = self.params_offload if part.kind in PARAM_KINDS else self.optimizer_offload
            on_device = part.chunk < math.ceil((1.0 - share) * self._nchunks)
            home = Tier.DISK
            for tier in (Tier.DEVICE, Tier.HOST) if on_device else (Tier.HOST,):
                if part.nbytes <= self._room[tier]:
                    self._room[tier] -= part.nbytes
                    home = tier
                    break
            self._home[part.name] = home
        return home

    def victim(self, tier: Tier, candidates: Sequence[Part], memory: ChunkMemory) -> Part | None:
        away = [p for p in candidates if self._home.get(p.name) is not tier]
        if not away:
            return None
        return furthest(away, memory)


class AutoPolicy:
    """Placement that follows use: see the module docstring."""

    name = "auto"

    def __init__(self) -> None:
        self.reserve = 0  # device bytes kept free for working buffers (and activations)
        self.host_reserve = 0  # host bytes kept free for parts passing through
        self.pinned: dict[str, Tier] = {}  # parts whose home is given (a frozen base's tier)

    def configure(self, need: WorkingSet, device_budget: int | None, host_budget: int | None) -> None:
        """Keep the working set's room free in each tier."""
        self.reserve, self.host_reserve = need.device, need.host

    def step_tier(self, parts: dict[str, Part], memory: ChunkMemory, ungathered: Callable[[], int]) -> Tier:
        """Device when the chunk's optimizer state is there, or when the device has room for
        all its parts beside every chunk kept gathered (``ungathered()``: the bytes the chunks not
        gathered now would take), else host memory.

        Device room goes to gathered chunks before optimizer states: a chunk kept gathered
        across steps saves an all-gather in every forward and backward pass, while states in
        host memory cost one move of the chunk's gradients and parameters (and nothing where
        the device is the host's memory)."""
        states = parts.get("states") or parts.get("master") or parts["params"]
        if states.residence is Residence.DEVICE:
            return Tier.DEVICE
        if states.residence is Residence.EMPTY:
            needed = sum(p.nbytes for p in parts.values() if p.residence is not Residence.DEVICE)
            if memory.ledger.free(Tier.DEVICE) - self.reserve - ungathered() >= needed:
                return Tier.DEVICE
        return Tier.HOST

    def keep_room_for(
        self, activations: int, chunks: Sequence[dict[str, Part]], ungathered: int, memory: ChunkMemory
    ) -> None:
        """After the warm-up: device room for the traced ``activations`` bytes from now on
        (``chunks``: each chunk's parts; ``ungathered``: the bytes of the chunks not gathered now).

        Optimizer parts leave the device first, last chunks first, while the device could not
        also hold every chunk gathered beside its reserve (device room is worth more to gathered
        chunks than to states, see :meth:`step_tier`), but only while host memory has room for
        them (a move to disk costs more than an all-gather)."""
        ledger = memory.ledger
        budget = ledger.budget[Tier.DEVICE]
        smallest = self.reserve + activations
        too_small = BudgetError(
            f"gemini.device_budget={budget} bytes cannot hold the traced activations ({activations} bytes) next to "
            f"one chunk's working set: give gemini.device_budget >= {smallest} bytes or use smaller micro-batches"
        )
        if budget is not None and budget < smallest:
            raise too_small
        short = activations + self.reserve + ungathered - ledger.free(Tier.DEVICE)
        for parts in reversed(chunks):
            for kind in ("states", "master"):
                part = parts.get(kind)
                if short <= 0 or part is None or ledger.free(Tier.HOST) - self.host_reserve < part.nbytes:
                    continue
                if memory.demote(part):
                    short -= part.nbytes
        try:
            memory.reserve(Tier.DEVICE, activations, "activations", "traced activations")
        except BudgetError as error:
            raise too_small from error

    def initial(self, part: Part, memory: ChunkMemory) -> Tier:
        """The first tier with room for ``part`` (device, host, disk), keeping ``reserve``
        bytes of the device free for working buffers; a pinned part: its home."""
        if part.name in self.pinned:
            return self.pinned[part.name]
        if memory.ledger.free(Tier.DEVICE) - self.reserve >= part.nbytes:
            return Tier.DEVICE
        if memory.ledger.free(Tier.HOST) - self.host_reserve >= part.nbytes or memory.disk is None:
            return Tier.HOST
        return Tier.DISK

    def home(self, part: Part) -> Tier | None:
        return self.pinned.get(part.name)

    def victim(self, tier: Tier, candidates: Sequence[Part], memory: ChunkMemory) -> Part | None:
        return furthest(candidates, memory)


def furthest(candidates: Sequence[Part], memory: ChunkMemory) -> Part:
    """The part needed furthest in the future by the trace (Belady's choice); among parts the
    trace does not need again, or before a trace exists, the least recently used."""
    return max(candidates, key=lambda p: (memory.next_use(p), -memory.last_use(p)))


__all__ = ["OPTIMIZER_KINDS", "PARAM_KINDS", "AutoPolicy", "StaticPolicy", "furthest"]
