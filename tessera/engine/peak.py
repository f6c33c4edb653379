"""The peak FLOP/s of one rank's device: the denominator of model FLOP utilisation.

A GPU the :data:`DATASHEET` table knows gets its vendor's dense peak (no structured sparsity)
for the compute dtype; fp32 matmuls count at the TF32 peak where torch lets them use TF32
(``torch.get_float32_matmul_precision() != "highest"``). Anything else, a CPU above all, is
measured: square matmuls of a few sizes in the dtype, each repeated for a short while, the best
sustained rate kept, with the intra-op threads torch has now (a CPU rank's own share of the
machine: ``launch.intra_op_threads``, one by default). A measurement is cached per machine in
``$XDG_CACHE_HOME/tessera/peak_flops.json`` (``~/.cache`` without the variable), keyed by the
device (the CPU's model name), the thread count, the torch version and the dtype, so a run
measures once and later runs read it; delete the file to measure again.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from tessera.files import write_atomically

Source = Literal["measured", "table", "cached"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Dense peaks in TFLOP/s from the vendors' data sheets (the figures without structured
# sparsity): bf16 and fp16 on the tensor (matrix) cores, tf32 on them, fp32 without them.
# Matched in order against torch.cuda.get_device_name(): the more specific names first. A device
# not listed (an A10G, whose figures NVIDIA does not publish, a consumer card) is measured.
DATASHEET: tuple[tuple[str, dict[str, float]], ...] = (
    (r"\bH100\b.*\bPCIe\b", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    (r"\bH100\b.*\bNVL\b", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH100\b", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0}),  # SXM5 ("H100 80GB HBM3")
    (r"\bG?H200\b", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0}),  # H200 SXM, GH200
    (r"\bA100\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bA30\b", {"bf16": 165.0, "fp16": 165.0, "tf32": 82.0, "fp32": 10.3}),
    (r"\bA40\b", {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bL40S\b", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL40\b", {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bV100\b.*\bPCIE\b", {"fp16": 112.0, "fp32": 14.0}),  # no bf16 or tf32 on Volta
    (r"\bV100\b", {"fp16": 125.0, "fp32": 15.7}),
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
    (r"\bMI300X\b", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
)


@dataclass(frozen=True)
class DevicePeak:
    """One rank's peak: ``flops_per_s`` in ``dtype`` (``"fp32"``, ``"tf32"``, ``"bf16"``,
    ``"fp16"``) on ``device`` (the GPU's name, or the CPU's model name and threads), found by
    ``source``: ``"table"`` (:data:`DATASHEET`), ``"measured"`` (now) or ``"cached"``
    (measured before, read from :func:`cache_file`)."""

    flops_per_s: float
    dtype: str
    source: Source
    device: str

    def describe(self) -> str:
        """``"52.3 GFLOP/s fp32 (Intel Xeon ..., 1 thread; measured)"``."""
        value, unit = (
            (self.flops_per_s / 1e12, "TFLOP/s") if self.flops_per_s >= 1e12 else (self.flops_per_s / 1e9, "GFLOP/s")
        )
        return f"{value:.4g} {unit} {self.dtype} ({self.device}; {self.source})"


def datasheet_peak(device_name: str, dtype: str) -> float | None:
    """The data sheet's dense FLOP/s of the GPU named ``device_name`` (as
    ``torch.cuda.get_device_name`` gives it) in ``dtype`` (``"bf16"``, ``"fp16"``, ``"tf32"``,
    ``"fp32"``); None for a device the table does not list or a dtype it does not run natively."""
    for pattern, peaks in DATASHEET:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            tflops = peaks.get(dtype)
            return tflops * 1e12 if tflops is not None else None
    return None


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as ``/proc/cpuinfo`` gives it (elsewhere, what ``platform`` knows)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def cache_file() -> Path:
    """Where measured peaks are kept: ``$XDG_CACHE_HOME/tessera/peak_flops.json``, with
    ``~/.cache`` when the variable is unset or empty (the XDG base directory rule)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tessera" / "peak_flops.json"


def _read_cache(path: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measure
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, entry: dict[str, object]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[key] = entry
        write_atomically(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError:  # a read-only home: the measurement still counts for this run
        pass


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(
    device: torch.device | str = "cpu",
    dtype: str = "fp32",
    sizes: Sequence[int] = (256, 512, 1024),
    seconds: float = 0.25,
) -> float:
    """Best sustained FLOP/s of square ``[n, n] @ [n, n]`` products (``2 n^3`` FLOPs each) in
    ``dtype`` on ``device``, over ``sizes``: each size is warmed up once, then repeated for about
    ``seconds`` of wall time, and its rate is the products done over the time they took. On a
    CPU it runs with torch's current intra-op threads. The global random generators are not
    touched."""
    device = torch.device(device)
    dt = DTYPES[dtype]
    draws = torch.Generator(device).manual_seed(0)  # its own: a run's random streams stay as they were
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, generator=draws).to(dt)
        b = torch.randn(n, n, device=device, generator=draws).to(dt)
        out = torch.empty(n, n, device=device, dtype=dt)
        torch.mm(a, b, out=out)  # warm up: kernel choice, caches, lazy allocations
        _synchronize(device)
        count, start = 0, time.perf_counter()
        while True:
            for _ in range(4 if device.type == "cuda" else 1):  # a few launches between waits
                torch.mm(a, b, out=out)
                count += 1
            _synchronize(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
        best = max(best, 2.0 * n**3 * count / elapsed)
    return best


def _matmul_dtype(device: torch.device, dtype: str) -> str:
    """What a GPU's fp32 product runs as: TF32 where torch allows it."""
    if device.type == "cuda" and dtype == "fp32" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return dtype


def device_peak(
    device: torch.device | str = "cpu",
    dtype: str = "fp32",
    *,
    sizes: Sequence[int] = (256, 512, 1024),
    seconds: float = 0.25,
    use_cache: bool = True,
) -> DevicePeak:
    """The peak FLOP/s of ``device`` in ``dtype`` (``"fp32"``, ``"bf16"``, ``"fp16"``): the data
    sheet's for a GPU it lists, else a measurement (:func:`measure_matmul_peak` with ``sizes``
    and ``seconds``) read from the cache when one was made before under the same key (device,
    threads on a CPU, torch version, dtype), or made now and written there. ``use_cache=False``
    measures now and leaves the cache alone."""
    if dtype not in DTYPES:
        raise ValueError(f"device_peak: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    device = torch.device(device)
    runs_as = _matmul_dtype(device, dtype)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        listed = datasheet_peak(name, runs_as)
        if listed is not None:
            return DevicePeak(listed, runs_as, "table", name)
        key = f"{device.type}|{name}|torch {torch.__version__}|{runs_as}"
    else:
        threads = torch.get_num_threads()
        name = f"{cpu_model_name()}, {threads} thread{'s' if threads > 1 else ''}"
        key = f"{device.type}|{cpu_model_name()}|{threads} threads|torch {torch.__version__}|{runs_as}"
    path = cache_file()
    if use_cache:
        entry = _read_cache(path).get(key)
        value = entry.get("flops_per_s") if isinstance(entry, dict) else None
        if isinstance(value, (int, float)) and value > 0:
            return DevicePeak(float(value), runs_as, "cached", name)
    measured = measure_matmul_peak(device, dtype, sizes, seconds)
    if use_cache:
        entry = {
            "flops_per_s": measured,
            "sizes": list(sizes),
            "seconds": seconds,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        _write_cache(path, key, entry)
    return DevicePeak(measured, runs_as, "measured", name)


__all__ = [
    "DATASHEET",
    "DevicePeak",
    "cache_file",
    "cpu_model_name",
    "datasheet_peak",
    "device_peak",
    "measure_matmul_peak",
]
