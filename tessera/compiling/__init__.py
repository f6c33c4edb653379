"""Compiled training: regional ``torch.compile`` of a model's blocks (or its whole forward) in
every layout, with a report of graphs, breaks and recompilations, and a check of the C++
toolchain that inductor needs (docs/compile.md)."""

from tessera.compiling.options import CompileOptions
from tessera.compiling.regions import CompiledRegion, compile_blocks, compile_loss, find_blocks
from tessera.compiling.report import CompileReport, RegionStats
from tessera.compiling.toolchain import check_toolchain

__all__ = [
    "CompileOptions",
    "CompileReport",
    "CompiledRegion",
    "RegionStats",
    "check_toolchain",
    "compile_blocks",
    "compile_loss",
    "find_blocks",
]
