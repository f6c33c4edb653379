"""Functions that run eagerly inside ``torch.compile``d code: deliberate graph breaks, made lazily.

``torch.compiler.disable`` imports torch._dynamo, which costs every process over a second of
start-up, compiled or not. :func:`eager_in_compiled_code` marks a function at import time for
nothing: it calls the plain function until :func:`install` (run by tessera's compiling before
anything is compiled) swaps in its disabled form, which dynamo does not trace (docs/compile.md).
tessera's dispatch modes are marked the same way (:class:`tessera._lazy_dynamo.EagerDispatchMode`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

_F = TypeVar("_F", bound=Callable[..., Any])

_plain: dict[str, Callable[..., Any]] = {}  # every marked function, by module and name
_disabled: dict[str, Callable[..., Any]] = {}  # their disabled forms, once installed


def eager_in_compiled_code(fn: _F) -> _F:
    """``fn``, run eagerly inside compiled code once :func:`install` has run (a graph break at
    its call); the same function everywhere else."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    _plain[name] = fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return _disabled.get(name, fn)(*args, **kwargs)

    return cast(_F, call)


def install() -> None:
    """Disable every marked function in compiled code (idempotent; imports torch._dynamo)."""
    import torch

    for name, fn in _plain.items():
        if name not in _disabled:
            _disabled[name] = torch.compiler.disable(fn, recursive=True)


__all__ = ["eager_in_compiled_code", "install"]
