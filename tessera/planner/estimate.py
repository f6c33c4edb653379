"""A layout's predicted cost: peak memory per rank (:mod:`tessera.planner.memory`) and step time
(:mod:`tessera.planner.timing`), put together by :func:`estimate`."""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.planner.layout import Layout
from tessera.planner.spec import Cluster, ModelSpec, Workload


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank on the device, on the rank that needs the most (a pipeline's first stage,
    usually): model states as the memory ledger counts them, activations kept for the backward
    pass at the step's fullest point, and the transient buffers alive at the peak (gathered
    parameters, communication buckets, the loss's logits, the optimizer's temporaries).
    ``host``: bytes kept in host memory (offloaded optimizer states)."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    transient: int
    peak: int
    host: int = 0

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds of one optimizer step: ``compute`` (forward and backward, recomputation
    included), ``comm`` per mesh axis (``data``, ``tensor``, ``pipeline``, ``sequence``) before
    overlap, ``exposed_comm`` (what is not hidden behind compute), ``bubble`` (pipeline idle
    time), ``optimizer`` (the update, and host copies under offload) and ``step``: the total."""

    compute: float
    comm: dict[str, float]
    exposed_comm: float
    bubble: float
    optimizer: float
    step: float


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
