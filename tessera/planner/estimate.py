"""A layout's predicted cost: peak memory per rank (:mod:`tessera.planner.memory`) and step time
(:mod:`tessera.planner.timing`), put together by :func:`estimate`."""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.planner.layout import Layout
from tessera.planner.results import MemoryEstimate, TimeEstimate
from tessera.planner.spec import Cluster, ModelSpec, Workload

__all__ = ["Estimate", "MemoryEstimate", "TimeEstimate", "estimate"]


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: MemoryEstimate
    time: TimeEstimate
    fits: bool
    notes: list[str] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return 0.0 if self.time.step <= 0 else self.layout.global_batch / self.time.step


def estimate(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster) -> Estimate:
    """Predict ``layout``'s memory and step time for ``model`` on ``cluster``."""
    from tessera.planner.memory import predict_memory
    from tessera.planner.timing import predict_time

    memory = predict_memory(model, layout, workload)
    time = predict_time(model, layout, workload, cluster)
    fits = memory.peak <= cluster.device_memory and (cluster.host_memory is None or memory.host <= cluster.host_memory)
    return Estimate(layout, memory, time, fits)
