"""What asynchronous saves run on: the host buffer a snapshot is copied into, the thread that
writes the files, and the handle a caller waits on."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tessera.checkpoint.format import CheckpointError
from tessera.checkpoint.holding import dtypes, shapes


class Staging:
    """Host memory for an asynchronous save's snapshot: one buffer holding a tensor of each
    ``(dtype, shape)`` of ``layout`` (64-byte aligned), kept between saves of the same share (no
    allocation, no page faults), filled in one call. ``pin``: page-locked (for copies from a
    GPU; ignored without CUDA). ``touch``: write every page now (so that the first copy into it
    does not fault them in while training waits)."""

    def __init__(self, layout: Sequence[tuple[torch.dtype, torch.Size]], pin: bool = False, touch: bool = False):
        offsets, total = [], 0
        for dtype, shape in layout:
            total = -(-total // 64) * 64
            offsets.append(total)
            total += shape.numel() * dtype.itemsize
        self.pinned = pin and torch.cuda.is_available()
        self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=self.pinned)
        if touch:
            self.buffer.zero_()
        self.views = [
            self.buffer[o : o + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            for o, (dtype, shape) in zip(offsets, layout)
        ]
        self.layout = list(layout)
        self.dtypes = [dtype for dtype, _ in self.layout]
        self.shapes = [shape for _, shape in self.layout]

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` have the dtypes and shapes this buffer was laid out for."""
        return dtypes(tensors) == self.dtypes and shapes(tensors) == self.shapes

    def copy(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The values of ``tensors`` now, in host memory (valid until the next copy)."""
        if tensors:
            with torch.no_grad():  # a tensor on another device takes torch's per-tensor path
                torch._foreach_copy_(self.views, list(tensors), non_blocking=self.pinned)
            if self.pinned:  # copies from the GPU into page-locked memory: wait for them
                torch.cuda.synchronize()
        return self.views


class SaveHandle:
    """A save in progress (``blocking=False``) or done: :meth:`wait` returns when this rank's
    part is written (and, on rank 0, the checkpoint is complete), raising what the writer raised."""

    def __init__(self, path: Path, finished: threading.Event | None = None) -> None:
        self.path = path
        self._finished = finished
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._finished is None or self._finished.is_set()

    def wait(self) -> Path:
        if self._finished is not None:
            self._finished.wait()
            self._finished = None
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(f"saving {self.path} failed: {error}") from error
        return self.path


class _Writer:
    """The thread that writes asynchronous saves, one after another; started once per process
    and kept (starting a thread per save would add its start-up to the time training waits)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="tessera-checkpoint", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        _lower_thread_priority()
        while True:
            self._jobs.get()()


def _lower_thread_priority(niceness: int = 10) -> None:
    """Run the calling thread at a lower CPU priority (Linux: per thread), so that writing a
    checkpoint in the background yields the cores to training. Elsewhere, or if refused,
    nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):
        pass


_writer = _Writer()
_pending: list[SaveHandle] = []


def submit(path: Path, job: Callable[[], None]) -> SaveHandle:
    """Run ``job`` (which writes ``path``) on the writer thread; the handle reports its end."""
    finished = threading.Event()
    handle = SaveHandle(path, finished)

    def run() -> None:
        try:
            job()
        except BaseException as exc:  # reported by wait()
            handle.error = exc
        finally:
            finished.set()

    _writer.submit(run)
    _pending.append(handle)
    return handle


def wait_for_saves() -> None:
    """Wait for this process's asynchronous saves to finish."""
    while _pending:
        _pending.pop(0).wait()
