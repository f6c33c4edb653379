"""Random streams per axis, on CPU and GPU alike.

A stream ``fork("tensor")`` gives ranks that differ along the tensor axis different random
numbers and ranks that agree on it (replicas along data or pipeline, say) the same ones: the
seed mixes the base seed with the rank's index along exactly the named axes. Dropout inside a
tensor-parallel region draws from such a stream; dropout on replicated activations draws from
the default stream, which every rank seeds alike.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tessera.context.dims import ParallelDims


def seed_all(seed: int) -> None:
    """Seed Python, torch (every device) and numpy, if present, with the same seed."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        return
    np.random.seed(seed % 2**32)


def _device_state(device: torch.device) -> torch.Tensor | None:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def _set_device_state(device: torch.device, state: torch.Tensor | None) -> None:
    if device.type == "cuda" and state is not None:
        torch.cuda.set_rng_state(state, device)


class RNGStreams:
    """Named random streams whose seeds differ exactly along chosen axes."""

    def __init__(self, base_seed: int, dims: ParallelDims, rank: int, device: torch.device) -> None:
        self.base_seed = base_seed
        self.dims = dims
        self.rank = rank
        self.device = device
        self._states: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._enclosing: tuple[str, ...] = ()

    def seed_for(self, *distinct_along: str) -> int:
        """Seed that differs between ranks whose index differs along any of ``distinct_along``."""
        parts = [str(self.base_seed)]
        for axis in sorted(distinct_along):
            parts.append(f"{axis}={self.dims.axis_index(axis, self.rank)}")
        digest = hashlib.sha256(";".join(parts).encode()).digest()
        return int.from_bytes(digest[:8], "little") % 2**63

    def snapshot(self) -> dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor | None]]:
        """Where every stream stands now (for a recompute that must draw the same numbers)."""
        return dict(self._states)

    def restore(self, snapshot: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Put every stream back where :meth:`snapshot` found it (a stream not begun then
        begins again from its seed)."""
        self._states = dict(snapshot)

    @property
    def enclosing(self) -> tuple[str, ...]:
        """The axes of the forks the caller is inside (a fork inside them differs along them too)."""
        return self._enclosing

    @contextmanager
    def inside(self, axes: tuple[str, ...]) -> Iterator[None]:
        """Forks in the block differ along ``axes`` as if inside a fork of them (a recompute
        re-entering the forks its forward ran in)."""
        outer, self._enclosing = self._enclosing, axes
        try:
            yield
        finally:
            self._enclosing = outer

    @contextmanager
    def fork(self, *distinct_along: str) -> Iterator[None]:
        """Draw from the stream of ``distinct_along`` inside the block; the default stream is
        restored after it, and the stream continues where it stopped at its next use. A fork
        inside another differs along both's axes."""
        key = tuple(sorted(set(distinct_along) | set(self._enclosing)))
        saved = (torch.get_rng_state(), _device_state(self.device))
        if key in self._states:
            cpu, dev = self._states[key]
            torch.set_rng_state(cpu)
            _set_device_state(self.device, dev)
        else:
            seed = self.seed_for(*key)
            torch.random.default_generator.manual_seed(seed)
            if self.device.type == "cuda":
                torch.cuda.default_generators[self.device.index or 0].manual_seed(seed)
        outer, self._enclosing = self._enclosing, key
        try:
            yield
        finally:
            self._enclosing = outer
            self._states[key] = (torch.get_rng_state(), _device_state(self.device))
            torch.set_rng_state(saved[0])
            _set_device_state(self.device, saved[1])
