"""Measuring a pipeline step (``PipelineRuntime.run(..., measure=True)``): one rank's busy time
and the bytes its chunks' forwards save for backward. Off by default; when off, no timer or hook
runs. ``tessera bench pp`` compares the measured bubble with the simulator's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class StepMeasure:
    """One rank's measurements of one step (``run(..., measure=True)``). ``busy_s``: wall time in
    compute actions (F, BW, B, W); ``step_s``: wall time from the start barrier to the end of the
    rank's action list; ``saved_bytes[(chunk, mb)]``: bytes the forward of that pair saved for
    backward (parameters excluded, each tensor counted once); ``peak_saved_bytes``: the most such
    bytes live at once, a pair's released at the end of its BW, or of its W when split."""

    busy_s: float = 0.0
    step_s: float = 0.0
    saved_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    peak_saved_bytes: int = 0
    live_saved_bytes: int = 0

    def hold(self, key: tuple[int, int], nbytes: int) -> None:
        self.saved_bytes[key] = nbytes
        self.live_saved_bytes += nbytes
        self.peak_saved_bytes = max(self.peak_saved_bytes, self.live_saved_bytes)

    def release(self, key: tuple[int, int]) -> None:
        self.live_saved_bytes -= self.saved_bytes[key]


class SavedBytes:
    """Counts the bytes of tensors saved for backward inside the ``with`` (saved_tensors_hooks),
    skipping views of ``params``' storages and counting each tensor (pointer, shape, strides) once."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._skip = {q.untyped_storage().data_ptr() for q in params}
        self._seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        self.nbytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        view = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.untyped_storage().data_ptr() not in self._skip and view not in self._seen:
            self._seen.add(view)
            self.nbytes += tensor.numel() * tensor.element_size()
        return tensor

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
