"""The Gemini memory manager's settings, as the top layer builds them from the config's
``gemini`` section (budgets already in bytes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class GeminiOptions:
    """``placement``: ``"static"`` (fixed shares off the device: ``params_offload``,
    ``optimizer_offload``) or ``"auto"`` (driven by the warm-up trace); ``device_budget`` and
    ``host_budget``: bytes of model state (and, for ``auto``, activations) allowed in each tier
    (None: unbounded); ``offload_dir``: the disk tier's folder (None: no disk tier);
    ``chunk_mb``: the chunk capacity (None: searched for the least waste); ``precision``: the
    parameters' dtype; ``prefetch``: uses ahead that parts on disk are read in the background;
    ``keep_samples``: keep the ledger after every move (tests); ``map_large_buffers``: give
    every allocation of 256 KiB or more its own mapping, returned to the system when freed
    (process-wide; None: when there is a host budget) and trim the heap after each backward
    pass and step, so that the resident set follows what is alive, at the cost of page faults
    on every new activation; ``frozen_tier``: where the frozen tensors' shards live (a LoRA
    adapter's base): ``"auto"`` (placed as parameters are), ``"device"``, ``"host"`` or
    ``"disk"`` (streamed in for each use; needs ``offload_dir``); ``shard``: which replicas
    share the chunks' shards (``"all"``; ``"host"``: those of each host, as ``zero.shard`` says:
    ``tessera.zero.hybrid``)."""

    placement: Literal["static", "auto"] = "auto"
    device_budget: int | None = None
    host_budget: int | None = None
    offload_dir: str | None = None
    chunk_mb: float | None = None
    params_offload: float = 0.0
    optimizer_offload: float = 0.0
    precision: str = "fp32"
    prefetch: int = 4
    keep_samples: bool = False
    map_large_buffers: bool | None = None
    frozen_tier: Literal["auto", "device", "host", "disk"] = "auto"
    shard: Literal["all", "host"] = "all"
