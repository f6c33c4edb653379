"""What a prediction returns: a layout's memory per rank and its step time (made by
:mod:`tessera.planner.memory` and :mod:`tessera.planner.timing`, put together by
:func:`tessera.planner.estimate.estimate`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank on the device, on the rank that needs the most (a pipeline's first stage,
    usually): model states as the memory ledger counts them, activations kept for the backward
    pass at the step's fullest point, and the transient buffers alive at the peak (gathered
    parameters, communication buckets, the loss's logits, the optimizer's temporaries).
    ``host``: bytes kept in host memory (offloaded optimizer states). With LoRA adapters
    ``parameters``, ``gradients`` and ``optimizer_states`` are the trainable ones' and ``frozen``
    the frozen base's weights (quantized where the config says)."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    transient: int
    peak: int
    host: int = 0
    frozen: int = 0

    @property
    def model_states(self) -> int:
        return self.parameters + self.frozen + self.gradients + self.optimizer_states


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
