"""Who reached which collective: each rank's progress on each process group, kept in the
launcher's key-value store, and the diagnosis of a watchdog timeout from it.

Every collective a rank enters on a process group gets the next sequence number of that group on
this rank (1, 2, ...); every rank calls a group's collectives in the same order, so the k-th one is
the same collective everywhere. Entering it writes one key, ``tsr/<group>/<rank>`` =
``"<seq> <op> <axis>"``, to the store that ``torch.distributed`` started at launch (a TCPStore:
``set`` is one message, no reply is awaited). Sends and receives count apart, per peer and
direction (``tsr/<group>/<rank>/s<peer>`` and ``.../r<peer>``): the k-th receive from a peer
matches that peer's k-th send here.

Nothing is read on the way. When a wait times out (or fails), the waiting rank reads the other
members' keys, under a short timeout of its own on a separate connection, and names the members
that did not arrive: their last sequence number is lower, or they entered a different op at this
number, or (for a transfer) they have not posted the matching half.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

PREFIX = "tsr"
READ_TIMEOUT_S = 3.0  # the diagnosis's own limit on reading the store

_enabled = True


def set_recording(enabled: bool) -> None:
    """Turn the writing of progress records on or off for groups first used after this call
    (for measuring what recording costs; timeouts then say less)."""
    global _enabled
    _enabled = bool(enabled)


def recording() -> bool:
    return _enabled


class KeyValueStore(Protocol):
    """What tessera uses of a ``torch.distributed.Store``."""

    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


def collective_key(group: str, rank: int) -> str:
    return f"{PREFIX}/{group}/{rank}"


def transfer_key(group: str, rank: int, kind: str, peer: int) -> str:
    return f"{PREFIX}/{group}/{rank}/{kind[0]}{peer}"


@dataclass(slots=True)  # one per collective: cheap to make
class Entered:
    """A collective this rank entered: the ``seq``-th on its process group ``group`` (a name all
    members share). For one half of a transfer (``op`` "send" or "recv"), ``seq`` counts this
    rank's transfers of that kind with ``peer`` (a global rank) on the group."""

    op: str
    axis: str
    group: str
    ranks: tuple[int, ...]  # global ranks of the group's members
    rank: int  # this rank (global)
    seq: int
    peer: int | None = None


class GroupProgress:
    """This rank's progress on one process group, mirrored into ``store`` (None: kept here only)."""

    def __init__(self, store: KeyValueStore | None, group: str, rank: int) -> None:
        self.store = store
        self.group = group
        self.rank = rank
        self.seq = 0
        self._key = collective_key(group, rank)
        self._transfers: dict[str, int] = {}  # transfer key -> count
        self._lock = threading.Lock()  # backward passes issue collectives from autograd threads

    def enter(self, op: str, axis: str, ranks: tuple[int, ...]) -> Entered:
        """Count a collective entered now and record it."""
        with self._lock:
            self.seq += 1
            seq = self.seq
            self._write(self._key, f"{seq} {op} {axis}")
        return Entered(op, axis, self.group, ranks, self.rank, seq)

    def transfer(self, kind: str, axis: str, ranks: tuple[int, ...], peer: int) -> Entered:
        """Count a send or receive (``kind``) with global rank ``peer`` posted now and record it."""
        key = transfer_key(self.group, self.rank, kind, peer)
        with self._lock:
            seq = self._transfers[key] = self._transfers.get(key, 0) + 1
            self._write(key, str(seq))
        return Entered(kind, axis, self.group, ranks, self.rank, seq, peer)

    def _write(self, key: str, value: str) -> None:
        if self.store is None:
            return
        try:
            self.store.set(key, value)
        except Exception:  # the store is gone (its host died): communication goes on without records
            self.store = None


# ---- reading, on a timeout -----------------------------------------------------------------


def read_keys(store: KeyValueStore, keys: Sequence[str], timeout_s: float = READ_TIMEOUT_S) -> dict[str, str | None]:
    """The values of ``keys`` (None for a key never written), read on a new connection to the
    store with a timeout of ``timeout_s``; in a thread of its own that is abandoned if it does not
    finish in time, so that this never hangs. Raises TimeoutError or the store's error."""
    result: dict[str, str | None] = {}
    failure: list[BaseException] = []

    def read() -> None:
        try:
            client: Any = store
            if hasattr(store, "clone"):  # a connection of its own: the shared one may be mid-call
                client = store.clone()
            if hasattr(client, "set_timeout"):
                client.set_timeout(datetime.timedelta(seconds=timeout_s))
            for key in keys:
                result[key] = client.get(key).decode() if client.check([key]) else None
        except BaseException as exc:
            failure.append(exc)

    reader = threading.Thread(target=read, name="tessera-progress-read", daemon=True)
    reader.start()
    reader.join(timeout_s + 1.0)
    if reader.is_alive():
        raise TimeoutError(f"no answer from the store within {timeout_s + 1.0:g}s")
    if failure:
        raise failure[0]
    return result


def keys_to_read(entered: Entered) -> list[str]:
    """The store keys the diagnosis of ``entered`` needs."""
    if entered.peer is None:
        return [collective_key(entered.group, m) for m in entered.ranks if m != entered.rank]
    counterpart = "recv" if entered.op == "send" else "send"
    return [
        transfer_key(entered.group, entered.peer, counterpart, entered.rank),
        collective_key(entered.group, entered.peer),
    ]


@dataclass(frozen=True)
class Diagnosis:
    """Who held up a collective: ``missing`` are the global ranks that did not arrive (or
    entered a different op), ``text`` says so for an error message."""

    text: str
    missing: tuple[int, ...]


@dataclass(frozen=True)
class _Last:
    seq: int
    op: str
    axis: str

    @classmethod
    def parse(cls, value: str | None) -> _Last | None:
        if value is None:
            return None
        seq, op, axis = value.split(" ", 2)
        return cls(int(seq), op, axis)

    def __str__(self) -> str:
        return f"#{self.seq} {self.op} on axis '{self.axis}'"


def ranks_text(ranks: Iterable[int]) -> str:
    """ "rank 2", "ranks 1, 3", "ranks 4-7"."""
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _whereabouts(member: int, last: _Last | None, *, alone: bool) -> str:
    """Where a member that did not arrive was last seen ("its" when it is the only one)."""
    who = "it" if alone else f"rank {member}"
    if last is None:
        return f"{who} has entered none on this group"
    whose = "its" if alone else f"rank {member}'s"
    return f"{whose} last collective on this group was {last}"


def explain(entered: Entered, values: Mapping[str, str | None]) -> Diagnosis:
    """Who held up ``entered``, from the store values of :func:`keys_to_read` (pure)."""
    if entered.peer is not None:
        return _explain_transfer(entered, values)
    here = f"{entered.op} #{entered.seq}"
    late: list[tuple[int, _Last | None]] = []
    elsewhere: list[tuple[int, _Last]] = []
    arrived: list[int] = []
    for member in entered.ranks:
        if member == entered.rank:
            continue
        last = _Last.parse(values.get(collective_key(entered.group, member)))
        if last is None or last.seq < entered.seq:
            late.append((member, last))
        elif last.seq == entered.seq and last.op != entered.op:
            elsewhere.append((member, last))
        else:
            arrived.append(member)
    parts = []
    if late:
        said = [_whereabouts(m, last, alone=len(late) == 1) for m, last in late]
        parts.append(f"{ranks_text(m for m, _ in late)} did not arrive at {here} on this group ({'; '.join(said)})")
    for member, last in elsewhere:
        parts.append(f"rank {member} entered a different collective at #{entered.seq}: {last.op} on axis '{last.axis}'")
    if not parts:
        return Diagnosis(
            f"every member entered {here} on this group, so it stalled inside the backend "
            "(a member may have crashed in it, or the network failed)",
            (),
        )
    if arrived:
        parts.append(f"{ranks_text(arrived)} arrived")
    return Diagnosis("; ".join(parts), tuple(sorted(m for m, _ in [*late, *elsewhere])))


def _explain_transfer(entered: Entered, values: Mapping[str, str | None]) -> Diagnosis:
    peer, counterpart = entered.peer, "recv" if entered.op == "send" else "send"
    assert peer is not None
    posted = values.get(transfer_key(entered.group, peer, counterpart, entered.rank))
    count = int(posted) if posted is not None else 0
    last = _Last.parse(values.get(collective_key(entered.group, peer)))
    context = f"its last collective on this group was {last}" if last else "it has entered no collective on this group"
    direction = "to" if entered.op == "send" else "from"
    if count < entered.seq:
        back = ("receive" if counterpart == "recv" else "send") + ("" if count == 1 else "s")
        back += " from" if counterpart == "recv" else " to"
        return Diagnosis(
            f"rank {peer} did not arrive: this is {entered.op} #{entered.seq} {direction} rank {peer} on this "
            f"group, and rank {peer} has posted {count} {back} rank {entered.rank} ({context})",
            (peer,),
        )
    return Diagnosis(
        f"rank {peer} posted the matching {counterpart} (#{entered.seq}), so the transfer stalled inside "
        f"the backend ({context})",
        (),
    )


def diagnose(entered: Entered, store: KeyValueStore | None, timeout_s: float = READ_TIMEOUT_S) -> Diagnosis | None:
    """Read the other members' progress and explain who held up ``entered``; None when there
    is no store to read. Never raises, never waits much longer than ``timeout_s``."""
    if store is None:
        return None
    try:
        values = read_keys(store, keys_to_read(entered), timeout_s)
    except Exception as exc:
        return Diagnosis(
            f"the other members' progress could not be read from the store ({type(exc).__name__}: {exc}); "
            "a peer rank died, hangs, or skipped this collective",
            (),
        )
    return explain(entered, values)
