"""The numerics class of this process: what decides how the golden runs' kernels round.

Two machines give bitwise equal golden runs when they run the same torch build and their kernels
round alike. Three things pick those kernels on CPU: the torch build, ATen's vector-kernel class
(``torch.backends.cpu.get_cpu_capability()``: DEFAULT, AVX2, AVX512; forced lower with
``ATEN_CPU_CAPABILITY``), and the code paths that MKL and oneDNN choose for the CPU at hand
(forced lower with ``MKL_ENABLE_INSTRUCTIONS`` / ``MKL_CBWR`` and ``ONEDNN_MAX_CPU_ISA``), which
torch does not report. The class therefore names the first two and adds a fingerprint of the
third: the SHA-256 of the bits of a fixed set of operations (matrix products of the shapes the
golden models use and their neighbours, in fp32 and bf16; softmax, layer norm, GELU, exp, log,
tanh on sizes with scalar tails), computed on one thread.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

# Matrix sizes around those of the golden models (d_model 32 and 128, their tensor-parallel
# splits, token counts per micro-batch), plus odd ones that exercise kernels' tails.
_ROWS = (4, 16, 32, 64, 256)
_INNER = (8, 16, 32, 48, 64, 128, 512)
_COLS = (8, 16, 32, 64, 96, 128, 256, 384)


def _probe_tensors() -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    for m in _ROWS:
        for k in _INNER:
            for n in _COLS:
                a = torch.randn(m, k, generator=g)
                b = torch.randn(k, n, generator=g)
                yield a @ b
                yield a.t().contiguous().t() @ b  # column-major left operand (linear backward)
                yield a @ b.t().contiguous().t()  # column-major right operand
    for m, k, n in ((16, 32, 96), (64, 128, 384), (32, 16, 64)):
        a = torch.randn(m, k, generator=g).bfloat16()
        b = torch.randn(k, n, generator=g).bfloat16()
        yield a @ b
        yield F.linear(a, b.t().contiguous(), torch.randn(n, generator=g).bfloat16())
    for size in (7, 33, 129, 1000):
        x = torch.randn(3, size, generator=g) * 4
        yield torch.softmax(x, -1)
        yield torch.log_softmax(x, -1)
        yield F.layer_norm(x, (size,), torch.randn(size, generator=g), torch.randn(size, generator=g))
        yield F.gelu(x)
        yield F.gelu(x, approximate="tanh")
        yield x.exp()
        yield x.abs().add(1e-3).log()
        yield x.tanh()
        yield x.sum(-1)
        yield x.bfloat16().softmax(-1)


def fingerprint() -> str:
    """Eight hex digits: the SHA-256 of the probe's bits (one intra-op thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        digest = hashlib.sha256()
        with torch.no_grad():
            for tensor in _probe_tensors():
                digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:8]
    finally:
        torch.set_num_threads(threads)


@functools.cache
def numerics_class() -> str:
    """For example ``"torch 2.13.0+cpu, ATen AVX512, kernels 3f9c02ab"``."""
    return f"torch {torch.__version__}, ATen {torch.backends.cpu.get_cpu_capability()}, kernels {fingerprint()}"


#: The lower kernel classes that ``python -m tests.golden.regenerate`` records besides the machine's
#: own, each as the environment that forces it on a machine of a higher class. Each library alone
#: changes the golden runs' bits (measured: docs/testing.md), so besides the whole machine forced
#: down, each library is forced down alone: the mixes that other CPUs may run (MKL, for one, may
#: take another path on another vendor's CPU than ATen and oneDNN do). On a machine without a
#: forcing's instructions the forcing falls back to the CPU's own paths and records nothing new.
FORCINGS: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}
