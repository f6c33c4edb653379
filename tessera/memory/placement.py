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
from collections.abc import Sequence

from tessera.memory.manager import ChunkMemory
from tessera.memory.tiers import Part, Tier

PARAM_KINDS = ("params",)
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
        self._nchunks = 0
        self._room: dict[Tier, float] = {Tier.DEVICE: 0.0, Tier.HOST: 0.0}

    def setup(self, nchunks: int, device_room: float, host_room: float) -> None:
        """Chunks at or past ``(1 - share) * nchunks`` of a kind live off the device; so does a
        part for which ``device_room`` (bytes of the device budget left for homes) is used up,
        and a part for which ``host_room`` is used up lives on disk."""
        self._nchunks = nchunks
        self._room = {Tier.DEVICE: device_room, Tier.HOST: host_room}

    def initial(self, part: Part, memory: ChunkMemory) -> Tier:
        home = self.home(part)
        assert home is not None
        return home

    def home(self, part: Part) -> Tier | None:
        home = self._home.get(part.name)
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

    def initial(self, part: Part, memory: ChunkMemory) -> Tier:
        """The first tier with room for ``part`` (device, host, disk), keeping ``reserve``
        bytes of the device free for working buffers."""
        if memory.ledger.free(Tier.DEVICE) - self.reserve >= part.nbytes:
            return Tier.DEVICE
        if memory.ledger.free(Tier.HOST) - self.host_reserve >= part.nbytes or memory.disk is None:
            return Tier.HOST
        return Tier.DISK

    def home(self, part: Part) -> Tier | None:
        return None

    def victim(self, tier: Tier, candidates: Sequence[Part], memory: ChunkMemory) -> Part | None:
        return furthest(candidates, memory)


def furthest(candidates: Sequence[Part], memory: ChunkMemory) -> Part:
    """The part needed furthest in the future by the trace (Belady's choice); among parts the
    trace does not need again, or before a trace exists, the least recently used."""
    return max(candidates, key=lambda p: (memory.next_use(p), -memory.last_use(p)))


__all__ = ["OPTIMIZER_KINDS", "PARAM_KINDS", "AutoPolicy", "StaticPolicy", "furthest"]
