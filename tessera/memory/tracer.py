"""The memory tracer: what a warm-up step needs besides model state, and in what order it uses
the chunks.

During the traced passes, saved-tensor hooks count the bytes autograd keeps for the backward
pass (each storage once; tensors of the model's chunks are not counted: they are model state),
and a hook before every module call records the module, the saved bytes so far and, on a
device with allocator statistics (CUDA), the bytes allocated there besides the chunk ledger's.
The chunk order comes from the memory manager (every use of a part, in order).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tessera.memory.chunks import Chunk
from tessera.memory.manager import ChunkMemory
from tessera.memory.tiers import Tier


@dataclass(slots=True)
class ModuleCall:
    """One module call of the traced passes: the saved activation bytes alive when it began,
    and the device's allocated bytes that are not counted model state (None without allocator
    statistics)."""

    module: str
    saved_bytes: int
    non_model_bytes: int | None


@dataclass
class Trace:
    """What the tracer saw: module calls, the saved-activation peak, and the order of uses."""

    calls: list[ModuleCall] = field(default_factory=list)
    peak_saved_bytes: int = 0
    peak_non_model_bytes: int | None = None
    uses: list[str] = field(default_factory=list)

    @property
    def activation_bytes(self) -> int:
        """The most non-model memory any point of the step needed (allocator statistics where
        there are, else saved activations)."""
        return max(self.peak_saved_bytes, self.peak_non_model_bytes or 0)


class MemoryTracer:
    """Traces the passes run inside :meth:`tracing` (see the module docstring) over ``memory``,
    whose ``chunks`` hold ``model``'s parameters: a saved tensor of their gathered buffers (or a
    parameter) is model state, and so are the device bytes the memory's ledger holds."""

    def __init__(self, model: nn.Module, memory: ChunkMemory, chunks: Sequence[Chunk]) -> None:
        self.memory = memory
        self.chunks = chunks
        self.trace = Trace()
        self._saved = 0
        self._seen: set[int] = set()
        self._names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}

    def is_model(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.untyped_storage().data_ptr()
        return isinstance(tensor, nn.Parameter) or any(ptr == c.full.untyped_storage().data_ptr() for c in self.chunks)

    @contextmanager
    def tracing(self) -> Iterator[None]:
        """Trace the forward passes (and the saved tensors they keep) run inside the block, and
        from the first such block on, the memory's uses."""
        if self.memory.recording is None:
            self.memory.start_trace()
        self._saved = 0
        self._seen.clear()
        handle = nn.modules.module.register_module_forward_pre_hook(self._before_call)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            handle.remove()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.is_model(tensor):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self._saved += storage.nbytes()
                self.trace.peak_saved_bytes = max(self.trace.peak_saved_bytes, self._saved)
        return tensor

    def _before_call(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is None:  # not one of the model's modules
            return
        non_model = None
        device = self.memory.device
        if device.type == "cuda":
            non_model = max(0, torch.cuda.memory_allocated(device) - self.memory.ledger.held[Tier.DEVICE])
            self.trace.peak_non_model_bytes = max(self.trace.peak_non_model_bytes or 0, non_model)
        self.trace.calls.append(ModuleCall(name, self._saved, non_model))

    def finish(self) -> Trace:
        """The trace, with the order of uses the memory manager recorded."""
        self.trace.uses = self.memory.stop_trace()
        return self.trace


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


__all__ = ["MemoryTracer", "ModuleCall", "Trace"]
