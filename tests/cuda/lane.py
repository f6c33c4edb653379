"""What the CUDA lane runs on, and the few probes that only a GPU can answer.

The lane runs on ``cuda:0``. ``TESSERA_TEST_DEVICE=cpu`` runs the same test bodies on CPU (a dry
run of the test code on a machine without a GPU, never a substitute for the lane): the probes
below then answer for CPU (nothing is pinned, no allocator counts, no stream to keep busy), so
the checks that need a GPU check their CPU counterpart instead.
"""

from __future__ import annotations

import os

import torch

DEVICE_VARIABLE = "TESSERA_TEST_DEVICE"


def lane_device() -> torch.device:
    """``cuda:0``, or the device named by TESSERA_TEST_DEVICE."""
    device = torch.device(os.environ.get(DEVICE_VARIABLE, "cuda:0"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


def lane_unavailable_reason(device: torch.device) -> str | None:
    """Why the lane cannot run on ``device`` here, or None when it can."""
    if device.type != "cuda" or torch.cuda.is_available():
        return None
    return (
        f"the CUDA lane needs a GPU, and torch.cuda.is_available() is False here "
        f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). Run it on a machine with "
        f"a GPU and a CUDA build of torch; {DEVICE_VARIABLE}=cpu dry-runs the lane's test code on CPU."
    )


def allocated_bytes(device: torch.device) -> int | None:
    """Bytes the CUDA caching allocator has handed out on ``device`` (None on CPU)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def keep_stream_busy(device: torch.device, seconds: float = 0.2) -> None:
    """Queue a kernel that spins for about ``seconds`` on ``device``'s current stream (CUDA),
    so that a copy queued after it cannot have finished when the host looks right after."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda._sleep(int(seconds * 2e9))  # cycles; data-centre GPUs clock at 1-2 GHz


def stream_finished(device: torch.device) -> bool:
    """Whether all work queued on ``device``'s current stream is done (always True on CPU)."""
    return torch.cuda.current_stream(device).query() if device.type == "cuda" else True
