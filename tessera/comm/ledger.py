"""The comm ledger: logical bytes and calls per op per axis on this rank.

"Logical bytes" are what the algorithm must move, averaged over the group: the total bytes a
ring (or, for p2p, a direct) implementation transfers between the members, divided by the
number of members. With ``n`` the bytes of the tensor handed to the op and ``P`` the group size:

==============  =======================  ==========================================
op              logical bytes per rank   ``n`` is
==============  =======================  ==========================================
all_reduce      2 (P-1)/P * n            the tensor reduced
all_gather      (P-1)/P * n              the gathered (output) tensor
reduce_scatter  (P-1)/P * n              the full (input) tensor
broadcast       (P-1)/P * n              the tensor broadcast
reduce          (P-1)/P * n              the tensor reduced to one rank
all_to_all      (P-1)/P * n              this rank's input tensor
send / recv     n                        the tensor sent or received
barrier         0                        -
==============  =======================  ==========================================

These are bandwidth terms, independent of what gloo or NCCL choose to send on the wire, so
tests can compare a strategy's ledger with its algorithm's formula.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction

# op: k in "k (P-1)/P * n" -- see the module table
_RING_FACTOR: dict[str, int] = {
    "all_reduce": 2,
    "all_gather": 1,
    "reduce_scatter": 1,
    "broadcast": 1,
    "reduce": 1,
    "all_to_all": 1,
}
P2P_OPS = ("send", "recv")
OPS = tuple(_RING_FACTOR) + P2P_OPS + ("barrier",)


def logical_bytes(op: str, payload_bytes: int, group_size: int) -> Fraction:
    """Logical bytes per rank of one ``op`` on ``payload_bytes`` in a group of ``group_size``."""
    if op in P2P_OPS:
        return Fraction(payload_bytes)
    if op == "barrier" or group_size <= 1:
        return Fraction(0)
    if op not in _RING_FACTOR:
        raise ValueError(f"unknown comm op {op!r}; known: {', '.join(OPS)}")
    return Fraction(_RING_FACTOR[op] * (group_size - 1) * payload_bytes, group_size)


@dataclass(frozen=True)
class CommRecord:
    """One communication call as the ledger saw it."""

    op: str
    axis: str
    group_size: int
    payload_bytes: int
    logical_bytes: Fraction


def _as_number(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else float(value)


class Ledger:
    """Records of the communication issued on this rank while the ledger was open."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def _select(self, op: str | None, axis: str | None) -> Iterator[CommRecord]:
        for rec in self.records:
            if (op is None or rec.op == op) and (axis is None or rec.axis == axis):
                yield rec

    def bytes(self, op: str | None = None, axis: str | None = None) -> int | float:
        """Logical bytes of the matching records (all ops / all axes when left None)."""
        return _as_number(sum((r.logical_bytes for r in self._select(op, axis)), Fraction(0)))

    def payload_bytes(self, op: str | None = None, axis: str | None = None) -> int:
        """Bytes of the tensors handed to the matching ops."""
        return sum(r.payload_bytes for r in self._select(op, axis))

    def calls(self, op: str | None = None, axis: str | None = None) -> int:
        return sum(1 for _ in self._select(op, axis))

    def summary(self) -> dict[tuple[str, str], dict[str, int | float]]:
        """``{(op, axis): {"calls": .., "bytes": .., "payload_bytes": ..}}``."""
        out: dict[tuple[str, str], dict[str, int | float]] = {}
        for key in sorted({(r.op, r.axis) for r in self.records}):
            out[key] = {
                "calls": self.calls(*key),
                "bytes": self.bytes(*key),
                "payload_bytes": self.payload_bytes(*key),
            }
        return out

    def clear(self) -> None:
        self.records.clear()

    def __repr__(self) -> str:
        rows = ", ".join(f"{op}@{axis}: {v['bytes']}B/{v['calls']}" for (op, axis), v in self.summary().items())
        return f"Ledger({rows})"


# Process-wide on purpose: on CUDA the backward pass runs in autograd's own threads, and its
# collectives belong to the same rank's ledger.
_OPEN: list[Ledger] = []
_LOCK = threading.Lock()


@contextmanager
def ledger() -> Iterator[Ledger]:
    """Count the communication issued in the ``with`` block on this rank (nestable)."""
    led = Ledger()
    with _LOCK:
        _OPEN.append(led)
    try:
        yield led
    finally:
        with _LOCK:
            _OPEN.remove(led)


def record(op: str, axis: str, group_size: int, payload_bytes: int) -> None:
    """Add one call to every open ledger."""
    if not _OPEN:
        return
    rec = CommRecord(op, axis, group_size, payload_bytes, logical_bytes(op, payload_bytes, group_size))
    with _LOCK:
        for led in _OPEN:
            led.records.append(rec)
