"""Regional compilation: each repeated block of a model compiled on its own.

A block's ``forward`` is replaced by a :class:`CompiledRegion` over ``torch.compile(forward)``.
The module's hooks stay outside the compiled code: the strategies' hooks (ZeRO-3's gather and
release, data parallelism's gradient hooks, activation checkpointing) run eagerly around the
block, which gets whole parameters, while the collectives of tensor, sequence and expert
parallelism inside it run as ops of the compiled graph (``tessera.comm.traced``). Blocks of one
shape share one compiled graph (dynamo caches per code object: the first block compiles, the
others reuse it).

Which modules are blocks: those marked with ``tessera.nn.mark_block`` (tessera's transformer
blocks), else the members of the model's longest ``nn.ModuleList`` of one class (the layers of
a Hugging Face model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tessera import graph_breaks
from tessera.compiling.options import CompileOptions
from tessera.compiling.report import CompileReport
from tessera.errors import ConfigError
from tessera.memory.release import gather_as_unit
from tessera.nn.recompute import is_block


def _trace_collectives() -> None:
    """Register the collectives compiled code calls (:mod:`tessera.comm.traced`): imported when
    something is first compiled, since it imports torch._dynamo (over a second of start-up);
    and the functions that stay eager in compiled code, a deliberate break each."""
    import tessera.comm.traced  # noqa: F401

    graph_breaks.install()


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, by name: marked blocks, else its longest ModuleList of one class."""
    marked = [(name, m) for name, m in model.named_modules() if name and is_block(name, m)]
    if marked:
        return marked
    lists = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1
    ]
    if not lists:
        return []
    prefix, longest = max(lists, key=lambda item: len(item[1]))
    return [(f"{prefix}.{i}" if prefix else str(i), m) for i, m in enumerate(longest)]


class CompiledRegion:
    """A module's forward, compiled; every call is noted in ``report`` under ``name`` (graphs
    captured, graph breaks and their reasons, recompilations)."""

    def __init__(self, name: str, forward: Callable[..., Any], options: CompileOptions, report: CompileReport) -> None:
        self.name = name
        self.original = forward
        self.compiled = torch.compile(forward, **options.torch_options())  # type: ignore[call-overload]
        self.report = report

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.report.watching(self.name):
            return self.compiled(*args, **kwargs)


def compile_blocks(model: nn.Module, options: CompileOptions, report: CompileReport) -> list[str]:
    """Compile ``model`` per ``options`` in place: each block's forward (scope ``"blocks"``) or
    the model's (``"model"``). Returns the names of the compiled regions."""
    _trace_collectives()
    if options.scope == "model":
        _compile_forward(model, "model", options, report)
        return ["model"]
    blocks = find_blocks(model)
    if not blocks:
        raise ConfigError(
            f"compile.scope='blocks': {type(model).__name__} has no blocks to compile (no module marked with "
            "tessera.nn.mark_block and no nn.ModuleList of one class); mark its blocks or set compile.scope='model'"
        )
    for name, block in blocks:
        _compile_forward(block, name, options, report)
        gather_as_unit(block)  # ZeRO-3 and Gemini gather the block's chunks at once, outside its graph
    return [name for name, _ in blocks]


def _compile_forward(module: nn.Module, name: str, options: CompileOptions, report: CompileReport) -> None:
    if isinstance(module.forward, CompiledRegion):
        raise ValueError(f"{name} is already compiled")
    module.forward = CompiledRegion(name, module.forward, options, report)  # type: ignore[method-assign]


def compile_loss(criterion: Callable[..., torch.Tensor], options: CompileOptions) -> Callable[..., torch.Tensor]:
    """The criterion compiled as one region (``compile.loss``)."""
    _trace_collectives()
    return torch.compile(criterion, **options.torch_options())  # type: ignore[call-overload, no-any-return]
