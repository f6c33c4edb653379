"""The explicit layers of every mode (``Linear1D_Col``, ``Linear2D``, ``LayerNorm3D``, ...) as
``tessera.nn`` offers them: the classes of ``tessera.parallel.tensor`` whose ``ctx`` keyword
defaults to the current context. Each is a subclass of its mode's class, named like it, so
``isinstance`` checks against either hold. ``tp1d``, ``tp2d``, ``tp2p5d`` and ``tp3d`` hold each
mode's classes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, TypeVar

from torch import nn

from tessera.context import ParallelContext
from tessera.nn.layers import resolve_context
from tessera.parallel.tensor.modes import MODES

__all__ = ["EXPLICIT", "tp1d", "tp2d", "tp2p5d", "tp3d", "with_current_context"]

M = TypeVar("M", bound=nn.Module)


def with_current_context(cls: type[M]) -> type[M]:
    """``cls`` (whose constructor takes ``ctx=``) with ``ctx`` defaulting to the current context."""

    def __init__(self: nn.Module, *args: Any, ctx: ParallelContext | None = None, **kwargs: Any) -> None:
        resolved = resolve_context(ctx)
        if resolved is None:
            raise RuntimeError(f"{cls.__name__} needs a parallel context: pass ctx= or call tessera.launch(...) first")
        cls.__init__(self, *args, ctx=resolved, **kwargs)

    namespace = {"__init__": __init__, "__doc__": cls.__doc__, "__module__": __name__.rpartition(".")[0]}
    subclass = type(cls.__name__, (cls,), namespace)
    subclass.__qualname__ = cls.__name__
    return subclass


EXPLICIT: dict[str, type[nn.Module]] = {
    cls.__name__: with_current_context(cls) for mode in MODES.values() for cls in mode.classes
}


def _classes_of(mode: str) -> SimpleNamespace:
    return SimpleNamespace(**{cls.__name__: EXPLICIT[cls.__name__] for cls in MODES[mode].classes})


tp1d, tp2d, tp2p5d, tp3d = (_classes_of(mode) for mode in ("1d", "2d", "2.5d", "3d"))
