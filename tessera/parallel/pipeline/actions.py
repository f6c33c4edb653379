"""Pipeline actions: the vocabulary every schedule is written in.

The model is cut into ``p * v`` chunks (stages of the model), numbered ``0 .. p*v-1`` from input
to loss; rank ``r`` holds chunks ``r, r+p, ..., r+(v-1)p`` (``v = 1`` but for the interleaved
schedule). A schedule is ``list[list[Action]]``: ``schedule[r]`` is what rank ``r`` does, in
order, for one training step of ``m`` micro-batches. It holds the compute (forward; backward,
whole or split into its input-gradient part B and weight-gradient part W) and the point-to-point
transfers between ranks, so a runtime only walks its list.

Every action names a chunk held by the rank that runs it, so a runtime never reasons about
another rank's chunks. A transfer is therefore a pair of actions naming neighbouring chunks:
``SEND_ACT(c, i)`` on the rank of ``c`` pairs with ``RECV_ACT(c+1, i)`` on the rank of ``c+1``,
``SEND_GRAD(c, i)`` with ``RECV_GRAD(c-1, i)`` (:func:`partner`). Between two ranks, messages
are matched in posting order, as NCCL and gloo match them: the k-th send from ``a`` to ``b`` is
the k-th receive on ``b`` from ``a``.

This module also says what each action needs on its rank and leaves there (:func:`needs`,
:func:`makes`) and what it costs (:func:`parse_costs`, :func:`compute_cost`): the terms in which
:mod:`~tessera.parallel.pipeline.schedules` builds schedules,
:mod:`~tessera.parallel.pipeline.p2p_placement` places their transfers and
:mod:`~tessera.parallel.pipeline.simulate` checks and runs them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from tessera.errors import TesseraError


class ScheduleError(TesseraError, ValueError):
    """A schedule (or a request for one) breaks a rule; the message names the rank and action."""


class DeadlockError(ScheduleError):
    """Running the schedule would hang: every unfinished rank waits on a transfer that never comes."""


class Kind(enum.Enum):
    """What an action does. The value is the short name used in ``str(action)`` and timelines."""

    FORWARD = "F"
    BACKWARD = "BW"  # whole backward: input gradient and weight gradient together
    BACKWARD_INPUT = "B"  # input gradient only (zero-bubble "B"); frees what W does not need
    BACKWARD_WEIGHT = "W"  # weight gradient only (zero-bubble "W"); frees the activations
    SEND_ACT = "SEND_ACT"  # output activation of this chunk to the rank of the next chunk
    RECV_ACT = "RECV_ACT"  # input activation of this chunk from the rank of the previous chunk
    SEND_GRAD = "SEND_GRAD"  # gradient of this chunk's input to the rank of the previous chunk
    RECV_GRAD = "RECV_GRAD"  # gradient of this chunk's output from the rank of the next chunk

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_ACT, Kind.SEND_GRAD)


COMPUTE_KINDS = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
P2P_KINDS = frozenset({Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD})


@dataclass(frozen=True)
class Action:
    """One step of a rank: ``kind`` on model chunk ``chunk`` (held by this rank) for micro-batch
    ``microbatch``; ``peer`` is the other pipeline rank of a transfer, ``None`` for compute."""

    kind: Kind
    chunk: int
    microbatch: int
    peer: int | None = None

    def __str__(self) -> str:
        text = f"{self.kind.value}(c{self.chunk},m{self.microbatch})"
        if self.peer is None:
            return text
        return f"{text}{'->' if self.kind.is_send else '<-'}{self.peer}"


Schedule = list[list[Action]]
Token = tuple[str, int, int]  # ("act" | "grad" | "F" | "B", chunk, micro-batch): what a rank holds

_PARTNER = {
    Kind.SEND_ACT: (Kind.RECV_ACT, 1),
    Kind.RECV_ACT: (Kind.SEND_ACT, -1),
    Kind.SEND_GRAD: (Kind.RECV_GRAD, -1),
    Kind.RECV_GRAD: (Kind.SEND_GRAD, 1),
}


def partner(action: Action, rank: int) -> Action:
    """The action on ``action.peer`` that pairs with the transfer ``action`` run by ``rank``."""
    kind, step = _PARTNER[action.kind]
    return Action(kind, action.chunk + step, action.microbatch, rank)


def stage_rank(chunk: int, p: int) -> int:
    """The pipeline rank holding model chunk ``chunk``."""
    return chunk % p


# ---------------------------------------------------------------------------------------------
# What each action needs on its rank before it runs, and what it leaves there.


def needs(action: Action, last_chunk: int) -> tuple[Token, ...]:
    """Tokens that must be on the rank before ``action`` runs (its data dependencies)."""
    k, c, i = action.kind, action.chunk, action.microbatch
    if k is Kind.FORWARD:
        return () if c == 0 else (("act", c, i),)
    if k in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        return (("F", c, i),) if c == last_chunk else (("F", c, i), ("grad", c, i))
    if k is Kind.BACKWARD_WEIGHT:
        return (("B", c, i),)
    if k is Kind.SEND_ACT:
        return (("F", c, i),)
    if k is Kind.SEND_GRAD:
        return (("B", c, i),)
    return ()


def makes(action: Action) -> tuple[Token, ...]:
    """Tokens ``action`` leaves on its rank (a forward also leaves the next chunk's input, which a
    rank uses only when it holds that chunk too, with ``p = 1``)."""
    k, c, i = action.kind, action.chunk, action.microbatch
    if k is Kind.FORWARD:
        return (("F", c, i), ("act", c + 1, i))
    if k in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        return (("B", c, i), ("grad", c - 1, i))
    if k is Kind.RECV_ACT:
        return (("act", c, i),)
    if k is Kind.RECV_GRAD:
        return (("grad", c, i),)
    return ()


def describe(token: Token) -> str:
    what, c, i = token
    return {
        "act": f"the input activation of chunk {c}, micro-batch {i} (RECV_ACT or the forward of chunk {c - 1})",
        "grad": f"the output gradient of chunk {c}, micro-batch {i} (RECV_GRAD or the backward of chunk {c + 1})",
        "F": f"the forward of chunk {c}, micro-batch {i}",
        "B": f"the backward (input gradient) of chunk {c}, micro-batch {i}",
    }[what]


# ---------------------------------------------------------------------------------------------
# Costs.

Costs = Mapping[str, int | float | Fraction] | None  # {"F": .., "B": .., "W": .., "P2P": ..}; None: unit
COST_KEYS = ("F", "B", "W", "P2P")
UNIT_COSTS: Mapping[str, int] = {"F": 1, "B": 1, "W": 1, "P2P": 0}


def parse_costs(costs: Costs) -> dict[str, Fraction]:
    """Costs as exact fractions: ``F`` forward, ``B`` input-gradient backward, ``W`` weight-gradient
    backward (a whole BACKWARD costs ``B + W``), ``P2P`` one transfer. Missing keys take
    :data:`UNIT_COSTS`; an unknown key or a negative cost raises."""
    out = {key: Fraction(value) for key, value in UNIT_COSTS.items()}
    for key, value in (costs or {}).items():
        if key not in out:
            raise ScheduleError(f"unknown cost key {key!r}; known keys are {', '.join(COST_KEYS)}")
        out[key] = Fraction(value)
        if out[key] < 0:
            raise ScheduleError(f"cost {key}={value} must be at least 0")
    return out


def compute_cost(kind: Kind, costs: Mapping[str, Fraction]) -> Fraction:
    if kind is Kind.BACKWARD:
        return costs["B"] + costs["W"]
    return costs[{Kind.FORWARD: "F", Kind.BACKWARD_INPUT: "B", Kind.BACKWARD_WEIGHT: "W"}[kind]]
