"""Before a compiled run starts: can inductor build kernels on this machine?

Inductor writes C++ for CPU kernels and compiles it with the compiler named by ``CXX`` (else
``g++``); for CUDA kernels it needs triton. Without them the first compiled step fails deep
inside inductor with a long traceback. :func:`check_toolchain` asks first and raises one
:class:`ToolchainError` that names what is missing, how to get it, and the switches that run
without it (``compile.enabled=false``, or ``compile.backend='aot_eager'``, which captures the
graphs but runs torch's own kernels).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import torch

from tessera.errors import ToolchainError

_EAGER = "or train without compiling: --set compile.enabled=false (compile.backend='aot_eager' captures graphs without building kernels)"


def cpp_compiler() -> str:
    """The C++ compiler inductor will call: ``CXX`` when set, else the first of its config."""
    named = os.environ.get("CXX")
    if named:
        return named
    from torch._inductor import config

    candidates = [c for c in config.cpp.cxx if c] if isinstance(config.cpp.cxx, (list, tuple)) else [config.cpp.cxx]
    return str(candidates[-1]) if candidates else "g++"


def check_toolchain(device: torch.device | str, backend: str = "inductor") -> None:
    """Raise :class:`ToolchainError` when ``backend`` cannot build kernels for ``device`` here."""
    if backend != "inductor":
        return
    device = torch.device(device)
    compiler = cpp_compiler()
    found = shutil.which(compiler)
    problem = None
    if found is None:
        problem = (
            f"the C++ compiler {compiler!r} (from {'CXX' if os.environ.get('CXX') else 'the default'}) is not found"
        )
    else:
        try:
            subprocess.run([found, "--version"], check=True, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            problem = f"the C++ compiler {found} does not run ({exc})"
    if problem is not None:
        raise ToolchainError(
            f"compile.enabled with the inductor backend needs a working C++ compiler to build its kernels, but {problem}. "
            "Install one (Debian/Ubuntu: apt-get install g++) or point CXX at it, " + _EAGER
        )
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ToolchainError(
                "compile.enabled with the inductor backend on CUDA needs triton, which is not importable here. "
                "Install the triton release that matches this torch (pip install triton), " + _EAGER
            )
