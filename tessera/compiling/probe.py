"""A quick check that compiling works here (``tessera check --compile``): a small model's blocks
compiled, run forward and backward against eager, then compiled again from the compile cache."""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tessera.compiling.options import CompileOptions
from tessera.compiling.regions import compile_blocks
from tessera.compiling.report import CompileReport
from tessera.compiling.toolchain import check_toolchain

_CACHE = "TORCHINDUCTOR_CACHE_DIR"


@dataclass(frozen=True)
class ProbeResult:
    cold_s: float  # the first compiled step: tracing and building the kernels
    warm_s: float  # the same after dynamo forgot it: kernels from the compile cache
    cache_hits: int  # graphs the second compile found in the cache
    max_diff: float  # the largest difference of a gradient, compiled vs eager
    report: CompileReport


class _Blocks(nn.Module):
    """Four pre-norm MLP blocks: enough to show sharing of one graph between blocks."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _step(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def _fresh_compile_cache() -> Iterator[None]:
    """Inductor's caches in a new folder for the ``with`` block (a cold start), then as before."""
    before = os.environ.get(_CACHE)
    with tempfile.TemporaryDirectory(prefix="tessera-compile-cache-") as folder:
        os.environ[_CACHE] = folder
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(_CACHE, None)
            else:
                os.environ[_CACHE] = before


def probe_compile(model: nn.Module | None = None, backend: str = "inductor") -> ProbeResult:
    """Compile ``model``'s blocks (default: a small stack of blocks), compare one step with eager,
    and time the compile cold (an empty compile cache) and warm (from that cache)."""
    check_toolchain("cpu", backend)
    with _fresh_compile_cache():
        return _probe(model, backend)


def _probe(model: nn.Module | None, backend: str) -> ProbeResult:
    torch.manual_seed(0)
    eager = model if model is not None else _Blocks()
    x = torch.randn(4, 16, 64)
    expected = _step(eager, x)
    options = CompileOptions(backend=backend)
    times, hits, report = [], 0, CompileReport()
    for attempt in range(2):
        torch._dynamo.reset()
        compiled = copy.deepcopy(eager)
        report = CompileReport()
        compile_blocks(compiled, options, report)
        start = time.perf_counter()
        got = _step(compiled, x)
        times.append(time.perf_counter() - start)
        if attempt == 1:
            hits = sum(s.cache_hits for s in report.regions.values())
    diff = max(float((got[n] - g).abs().max()) for n, g in expected.items())
    return ProbeResult(times[0], times[1], hits, diff, report)
