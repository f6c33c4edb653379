"""The buffers of parts in the device and host tiers: one pool of idle buffers per memory, so a
part that moves in takes the buffer a part of its size gave up (:class:`~tessera.memory.tiers.BufferPool`).
An idle buffer is memory held: it counts in the ledger (kind ``idle``) while kept, and is kept
only while the tier's budget has room for it; making room frees idle buffers first."""

from __future__ import annotations

import torch

from tessera.memory.tiers import BufferPool, Tier, TierLedger

_MIB = 2**20


class TierBuffers:
    """The device's and the host's pools of idle buffers and their count in ``ledger``. On a
    CPU ``device`` the device tier is host memory: one pool serves both tiers and its idle
    buffers count in the host tier."""

    def __init__(self, device: torch.device, ledger: TierLedger) -> None:
        self.ledger = ledger
        self.separate = device.type != "cpu"  # device and host memory are different memories
        self.device_pool = BufferPool(device)
        self.host_pool = (
            BufferPool(torch.device("cpu"), pin=device.type == "cuda") if self.separate else self.device_pool
        )

    def pool(self, tier: Tier) -> BufferPool:
        return self.device_pool if tier is Tier.DEVICE else self.host_pool

    def idle_tier(self, tier: Tier) -> Tier:
        """The tier whose budget a pool's idle buffers count in (host memory, where the device
        tier is host memory too)."""
        return tier if self.separate else Tier.HOST

    def take(self, tier: Tier, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer for a part about to be counted in ``tier``: an idle one of the pool (no longer
        counted as idle) or a new one."""
        pool = self.pool(tier)
        if pool.has(numel, dtype):
            buffer = pool.take(numel, dtype)
            self.ledger.credit(self.idle_tier(tier), buffer.numel() * buffer.element_size(), "idle", "pool take")
            return buffer
        return pool.take(numel, dtype)

    def give(self, tier: Tier, buffer: torch.Tensor) -> None:
        """A buffer a part no longer uses: kept idle for the next part of its size while the
        budget has room for it (idle buffers count as memory held), else freed."""
        idle = self.idle_tier(tier)
        nbytes = buffer.numel() * buffer.element_size()
        pool = self.pool(tier)
        if pool.room_for(buffer) and self.ledger.free(idle) >= nbytes:
            pool.give(buffer)
            self.ledger.charge(idle, nbytes, "idle", "pool give")

    def drop_idle(self, tier: Tier) -> bool:
        """Free the idle buffers counted in ``tier``; whether there were any."""
        freed = False
        for pool_tier in (Tier.DEVICE, Tier.HOST):
            pool = self.pool(pool_tier)
            if self.idle_tier(pool_tier) is tier and pool.idle_bytes():
                self.ledger.credit(tier, pool.idle_bytes(), "idle", "pool cleared")
                pool.clear()
                freed = True
        return freed


def mib(nbytes: float | None) -> str:
    """Bytes as a budget message writes them: ``"512 bytes"``, ``"3.00 MiB"``, ``"unbounded"``."""
    if nbytes is None:
        return "unbounded"
    return f"{nbytes:.0f} bytes" if nbytes < 2**16 else f"{nbytes / _MIB:.2f} MiB"
