"""Dispatch modes that do not import ``torch._dynamo`` before something compiles.

Torch disables dynamo in every ``TorchDispatchMode``'s ``__torch_dispatch__`` through
``torch._disable_dynamo``, which imports torch._dynamo (about a second of CPU) at the mode's first
op. tessera's modes (deferred init's recorder, selective recompute's) mark theirs with
:func:`tessera.graph_breaks.eager_in_compiled_code` instead: the same graph break once tessera's
compiling has installed it, nothing before. An inference rank that builds its model under
:func:`tessera.deferred_init` then starts without importing dynamo at all.
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from tessera.graph_breaks import eager_in_compiled_code


class EagerDispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` whose ``__torch_dispatch__`` runs eagerly inside compiled code, as
    torch's own wrapping would make it, but marked lazily."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's wrapping is off; the subclass's dispatch is marked below instead

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        raw = cls.__dict__.get("__torch_dispatch__")
        if raw is not None and not isinstance(raw, classmethod):
            cls.__torch_dispatch__ = eager_in_compiled_code(raw)  # type: ignore[method-assign]
