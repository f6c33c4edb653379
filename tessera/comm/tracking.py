"""How each collective is watched: numbered and recorded as this rank enters it (its group's
progress records, :mod:`tessera.comm.progress`), waited for under the watchdog timeout, and, when
the wait fails, turned into an error naming the rank, the op, the axis and the ranks that did not
arrive (read from the launcher's key-value store). :mod:`tessera.comm.ops` issues the
collectives; everything here is what a wait needs to end a hang with a clear message.
"""

from __future__ import annotations

import datetime
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tessera.comm import progress
from tessera.comm.group import AxisGroup
from tessera.comm.progress import Entered, GroupProgress
from tessera.errors import CommError, CommTimeoutError

_timeout_s: float = 300.0  # launch() sets it from config.comm.timeout_s


def set_timeout(seconds: float) -> None:
    """Set the watchdog timeout for every later collective on this rank."""
    global _timeout_s
    if seconds <= 0:
        raise ValueError(f"watchdog timeout must be positive, got {seconds}")
    _timeout_s = float(seconds)


def get_timeout() -> float:
    return _timeout_s


@contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Use a different watchdog timeout inside the ``with`` block."""
    previous = _timeout_s
    set_timeout(seconds)
    try:
        yield
    finally:
        set_timeout(previous)


@dataclass
class _Track:
    """What this rank keeps about one process group: whether it runs gloo (asked of torch once per
    group: p2p calls ask per message) and its progress records."""

    pg: weakref.ref[Any]
    gloo: bool
    progress: GroupProgress


# id(process group) -> its track; the reference is weak, because a process group kept alive past
# shutdown keeps its worker threads (see tessera.comm.group), and the track goes with the group
_tracks: dict[int, _Track] = {}
_tracks_lock = threading.Lock()  # two threads' first collectives on a group must share one count


def _track(group: AxisGroup) -> _Track:
    pg = group.pg
    entry = _tracks.get(id(pg))
    if entry is None or entry.pg() is not pg:
        with _tracks_lock:
            entry = _tracks.get(id(pg))
            if entry is None or entry.pg() is not pg:
                entry = _tracks[id(pg)] = _new_track(group)
    return entry


def _new_track(group: AxisGroup) -> _Track:
    key = id(group.pg)

    def forget(ref: weakref.ref[Any]) -> None:
        entry = _tracks.get(key)
        if entry is not None and entry.pg is ref:
            del _tracks[key]

    name = getattr(group.pg, "group_name", "") or "-".join(map(str, group.ranks))  # the same on every member
    store = _default_store() if progress.recording() else None
    return _Track(
        weakref.ref(group.pg, forget),
        dist.get_backend(group.pg) == "gloo",
        GroupProgress(store, name, group.global_rank),
    )


def _default_store() -> Any:
    """The key-value store init_process_group started (None when torch does not say)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def is_gloo(group: AxisGroup) -> bool:
    return _track(group).gloo


def enter(op: str, group: AxisGroup) -> Entered:
    """Number and record a collective this rank enters now on ``group``."""
    return _track(group).progress.enter(op, group.name, group.ranks)


def enter_transfer(kind: str, group: AxisGroup, peer: int) -> Entered:
    """Number and record a send or a receive (``kind``) this rank posts now to global rank
    ``peer`` on ``group`` (counted per peer and direction)."""
    return _track(group).progress.transfer(kind, group.name, group.ranks, peer)


def _describe(op: str, group: AxisGroup) -> str:
    rank = dist.get_rank() if dist.is_initialized() else group.global_rank
    return f"rank {rank}: {op} on axis '{group.name}' (group ranks {list(group.ranks)})"


def _is_timeout(text: str) -> bool:
    text = text.lower()
    return "timed out" in text or "timeout" in text


def failure(
    exc: BaseException, op: str, group: AxisGroup, entered: Entered | None, limit: str | None = None
) -> CommError:
    """The error to raise for a wait on ``op`` that failed with ``exc``; a timeout names the
    members that did not arrive, read from the store. ``limit`` says which timeout applied
    (default: the watchdog's)."""
    text = str(exc)
    found = None
    if entered is not None and group.pg is not None:
        found = progress.diagnose(entered, _track(group).progress.store)
    limit = limit or f"the watchdog timeout of {_timeout_s:g}s"
    error: CommError
    if _is_timeout(text):
        cause = found.text if found else "a peer rank died, hangs, or skipped this collective"
        error = CommTimeoutError(f"{_describe(op, group)} did not complete within {limit}: {cause}")
    elif found and found.missing:  # e.g. gloo's "connection closed by peer", where the peer is only the messenger
        error = CommError(f"{_describe(op, group)} failed: {found.text}; the backend said: {text}")
    else:
        error = CommError(f"{_describe(op, group)} failed: {text}")
    error.missing_ranks = found.missing if found else ()
    return error


def wait_for(work: Any, op: str, group: AxisGroup, entered: Entered | None = None) -> None:
    """Wait for ``work`` (``entered`` by this rank); on gloo under the watchdog timeout.

    NCCL work is left to its stream semantics (a timed wait would block the CPU on every
    collective); its hangs are ended by the process-group timeout that launch() sets from the
    same config value.
    """
    if work is None:
        return
    try:
        if is_gloo(group):
            work.wait(timeout=datetime.timedelta(seconds=_timeout_s))
        else:
            work.wait()
    except RuntimeError as exc:
        raise failure(exc, op, group, entered) from exc
