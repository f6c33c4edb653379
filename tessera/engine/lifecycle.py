"""The end of an engine's life: what closes it, and the engines of this process not yet closed.

``Engine.close()`` releases what its strategy holds outside the process (Gemini's offload
files). It is called by ``Trainer.fit`` at its end (also when it raises), at the end of a
``with engine:`` block, by ``tessera.shutdown()`` for every engine still open, and by the rank
of ``tessera run``/``tessera train`` whose script raised, before it reports the error (a
launcher stops the other ranks soon after). The engines are kept here weakly: an engine the
user dropped is not kept alive by being open.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Protocol


class Closable(Protocol):
    """What this registry keeps: an engine, closed once."""

    def close(self) -> None: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()


def track(engine: Closable) -> None:
    """Count ``engine`` among the open ones (its constructor calls this)."""
    _open.add(engine)


def untrack(engine: Closable) -> None:
    """Count ``engine`` no more among the open ones (it is closed)."""
    _open.discard(engine)


def open_engines() -> list[Closable]:
    """The engines of this process that are not closed."""
    return list(_open)


def close_open_engines() -> None:
    """Close every engine of this process that is not closed (not collective: each rank closes
    its own). Every one is closed even when one fails; the first failure is raised after."""
    failures: list[BaseException] = []
    for engine in open_engines():
        try:
            engine.close()
        except Exception as error:  # each engine gets its turn
            failures.append(error)
    if failures:
        raise failures[0]


def close_after(engine: Closable, error: BaseException) -> None:
    """Close ``engine`` while ``error`` ends the run: a failure to close is only warned of, so
    that ``error``, what the user must see, stays the one raised."""
    try:
        engine.close()
    except Exception as closing:
        warnings.warn(
            f"closing the engine after {type(error).__name__} failed too: {type(closing).__name__}: {closing}",
            RuntimeWarning,
            stacklevel=2,
        )


__all__ = ["close_after", "close_open_engines", "open_engines", "track", "untrack"]
