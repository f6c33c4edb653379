"""Checking schedules: :func:`validate` reads the action lists, :func:`simulate` runs them on paper.

The simulator walks every rank's list with blocking transfers, in exact time
(:class:`fractions.Fraction`), so bubble fractions compare equal to their formulas. Each maximal
run of transfers between two computes is one batch, posted at once, as a runtime with batched
p2p does it. A receive completes once its partner send is posted, at ``max(posted, send posted
+ P2P)``. A send completes at once (``blocking_p2p=False``: an isend waited later) or, with
``blocking_p2p=True``, once its partner receive is posted, at ``max(posted, receive posted) +
P2P`` (a rendezvous, the strictest runtime). A rank leaves a batch when all of its transfers
have completed. If no rank can move and some have not finished, the schedule deadlocks and
:class:`DeadlockError` names where each rank waits.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal, NamedTuple

from tessera.parallel.pipeline.actions import (
    COMPUTE_KINDS,
    Action,
    Costs,
    DeadlockError,
    Kind,
    ScheduleError,
    Token,
    compute_cost,
    describe,
    makes,
    needs,
    parse_costs,
    partner,
    stage_rank,
)

# ---------------------------------------------------------------------------------------------
# Checking a schedule without running it.


def validate(schedule: Sequence[Sequence[Action]], p: int, m: int, v: int = 1) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` (one action list per rank) runs every
    (chunk, micro-batch) of ``p * v`` chunks and ``m`` micro-batches exactly once forward and once
    backward (one BW, or one B and one W), each action after everything it needs on its rank, and
    every send met by its partner receive in the same per-pair order. It does not look for
    deadlocks: :func:`simulate` does."""
    if len(schedule) != p:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists for p={p} ranks")
    last = p * v - 1
    for r, actions in enumerate(schedule):
        for n, action in enumerate(actions):
            _check_fields(action, r, n, p, m, last)
    _check_counts(schedule, p, m, last)
    for r, actions in enumerate(schedule):
        have: set[Token] = set()
        for n, action in enumerate(actions):
            for token in needs(action, last):
                if token not in have:
                    raise ScheduleError(f"rank {r}, action {n}: {action} runs before {describe(token)}")
            have.update(makes(action))
    _check_pairs(schedule)


def _check_fields(action: Action, r: int, n: int, p: int, m: int, last: int) -> None:
    where = f"rank {r}, action {n} ({action})"
    if not 0 <= action.chunk <= last or stage_rank(action.chunk, p) != r:
        raise ScheduleError(f"{where}: chunk {action.chunk} is not held by rank {r} (chunks 0..{last})")
    if not 0 <= action.microbatch < m:
        raise ScheduleError(f"{where}: micro-batch {action.microbatch} is outside 0..{m - 1}")
    if action.kind.is_compute:
        if action.peer is not None:
            raise ScheduleError(f"{where}: a compute action has no peer")
        return
    neighbour = action.chunk + (1 if action.kind in (Kind.SEND_ACT, Kind.RECV_GRAD) else -1)
    if not 0 <= neighbour <= last:
        raise ScheduleError(f"{where}: chunk {action.chunk} has no neighbour chunk {neighbour} to talk to")
    if stage_rank(neighbour, p) == r:
        raise ScheduleError(f"{where}: chunk {neighbour} is on this rank too; no transfer is needed")
    if action.peer != stage_rank(neighbour, p):
        raise ScheduleError(f"{where}: peer must be rank {stage_rank(neighbour, p)}, which holds chunk {neighbour}")


def _check_counts(schedule: Sequence[Sequence[Action]], p: int, m: int, last: int) -> None:
    counts: Counter[tuple[Kind, int, int]] = Counter(
        (a.kind, a.chunk, a.microbatch) for actions in schedule for a in actions if a.kind.is_compute
    )
    for c in range(last + 1):
        for i in range(m):
            where = f"chunk {c}, micro-batch {i} (rank {stage_rank(c, p)})"
            n = {kind: counts[(kind, c, i)] for kind in COMPUTE_KINDS}
            if n[Kind.FORWARD] != 1:
                raise ScheduleError(f"{where}: forward runs {n[Kind.FORWARD]} times, not once")
            whole, inputs, weights = n[Kind.BACKWARD], n[Kind.BACKWARD_INPUT], n[Kind.BACKWARD_WEIGHT]
            if (whole, inputs, weights) not in ((1, 0, 0), (0, 1, 1)):
                raise ScheduleError(
                    f"{where}: backward runs {whole} whole (BW), {inputs} input-gradient (B) and {weights} "
                    f"weight-gradient (W) times; it needs one BW, or one B and one W"
                )


def _check_pairs(schedule: Sequence[Sequence[Action]]) -> None:
    sent: dict[tuple[int, int], list[Action]] = {}
    received: dict[tuple[int, int], list[Action]] = {}
    for r, actions in enumerate(schedule):
        for a in actions:
            if a.peer is not None:
                if a.kind.is_send:
                    sent.setdefault((r, a.peer), []).append(a)
                else:
                    received.setdefault((a.peer, r), []).append(a)
    for src, dst in sorted(set(sent) | set(received)):
        outs, ins = sent.get((src, dst), []), received.get((src, dst), [])
        for k, (send, recv) in enumerate(zip(outs, ins)):
            if partner(send, src) != recv:
                raise ScheduleError(
                    f"message {k} from rank {src} to rank {dst}: rank {src} sends {send} but rank {dst} receives "
                    f"{recv}, expected {partner(send, src)} (two ranks match transfers in posting order)"
                )
        if len(outs) != len(ins):
            extra = outs[len(ins)] if len(outs) > len(ins) else ins[len(outs)]
            raise ScheduleError(
                f"rank {src} sends {len(outs)} messages to rank {dst}, which receives {len(ins)}: {extra} is unmatched"
            )


# ---------------------------------------------------------------------------------------------
# Running a schedule.


class Interval(NamedTuple):
    """One compute action of one rank, from ``start`` to ``end``."""

    start: Fraction
    end: Fraction
    action: Action


@dataclass(frozen=True)
class Simulation:
    """What :func:`simulate` found. ``busy[r]`` is rank r's compute time; ``makespan`` the time the
    last rank finishes; ``idle_fraction = 1 - sum(busy) / (p * makespan)`` (the bubble);
    ``peak_in_flight[r]`` the most (chunk, micro-batch) pairs rank r held at once, where a pair is
    held from the start of its forward to the end of its whole backward (BW), or of its W when
    the backward is split (B frees only part of the activations). With ``v`` chunks per rank a
    pair holds about ``1/v`` of a stage's activations. ``intervals[r]`` lists rank r's computes."""

    makespan: Fraction
    busy: tuple[Fraction, ...]
    idle_fraction: Fraction
    peak_in_flight: tuple[int, ...]
    intervals: tuple[tuple[Interval, ...], ...] = field(repr=False)


class _Op(NamedTuple):
    action: Action
    channel: tuple[int, int]  # (sender, receiver)
    seq: int  # index of the message on its channel


@dataclass
class _Batch:
    end: int  # index in the rank's list just past the batch
    posted: Fraction
    ops: list[_Op]


@dataclass
class _Rank:
    actions: Sequence[Action]
    at: int = 0
    clock: Fraction = Fraction(0)
    busy: Fraction = Fraction(0)
    in_flight: int = 0
    peak: int = 0
    have: set[Token] = field(default_factory=set)
    intervals: list[Interval] = field(default_factory=list)
    batch: _Batch | None = None
    receiving: dict[Token, _Op] = field(default_factory=dict)  # lazy receives posted, not yet read

    @property
    def done(self) -> bool:
        return self.at == len(self.actions)


def simulate(
    schedule: Sequence[Sequence[Action]],
    costs: Costs = None,
    *,
    blocking_p2p: bool = False,
    lazy_receive: bool = False,
) -> Simulation:
    """Run ``schedule`` (one action list per rank) under ``costs`` (keys ``F``, ``B``, ``W``,
    ``P2P``; default 1, 1, 1, 0; a whole backward BW costs ``B + W``) and return the
    :class:`Simulation`. Raises :class:`DeadlockError` if the ranks hang, :class:`ScheduleError`
    if an action runs before its data is on its rank or a transfer meets the wrong partner.

    With ``lazy_receive`` a rank does not wait for a batch's receives: a compute that reads one
    waits until its send was posted (+ ``P2P``), as the runtime does (sends never wait then)."""
    if lazy_receive and blocking_p2p:
        raise ValueError("lazy_receive models a runtime whose sends do not block; drop blocking_p2p")
    cost = parse_costs(costs)
    last = max((a.chunk for actions in schedule for a in actions), default=0)
    ranks = [_Rank(actions) for actions in schedule]
    posted: dict[tuple[bool, tuple[int, int]], list[tuple[Action, Fraction]]] = {}  # (is send, channel)
    progress = True
    while progress:
        progress = False
        for r, rank in enumerate(ranks):
            while _step(r, rank, last, cost, posted, blocking_p2p, lazy_receive):
                progress = True
    stuck = [r for r, rank in enumerate(ranks) if not rank.done]
    if stuck:
        waits = "; ".join(_waiting(r, ranks[r], posted, blocking_p2p) for r in stuck)
        raise DeadlockError(f"schedule deadlocks: {waits}")
    for (is_send, (src, dst)), entries in posted.items():
        other = posted.get((not is_send, (src, dst)), [])
        if len(entries) > len(other):
            raise ScheduleError(f"rank {src if is_send else dst}: {entries[len(other)][0]} is never matched")
    makespan = max((rank.clock for rank in ranks), default=Fraction(0))
    total = sum((rank.busy for rank in ranks), Fraction(0))
    idle = 1 - total / (len(ranks) * makespan) if makespan > 0 else Fraction(0)
    return Simulation(
        makespan=makespan,
        busy=tuple(rank.busy for rank in ranks),
        idle_fraction=idle,
        peak_in_flight=tuple(rank.peak for rank in ranks),
        intervals=tuple(tuple(rank.intervals) for rank in ranks),
    )


def _step(
    r: int,
    rank: _Rank,
    last: int,
    cost: Mapping[str, Fraction],
    posted: dict[tuple[bool, tuple[int, int]], list[tuple[Action, Fraction]]],
    blocking: bool,
    lazy: bool = False,
) -> bool:
    """Move rank ``r`` one action (or one batch) on; False if it is done or must wait."""
    if rank.done:
        return False
    action = rank.actions[rank.at]
    if action.kind.is_compute:
        for token in needs(action, last):
            if token in rank.receiving:  # a lazy receive: wait here for its send
                op = rank.receiving[token]
                arrived = _match(op, posted)
                if arrived is None:
                    return False
                rank.clock = max(rank.clock, arrived + cost["P2P"])
                rank.have.add(token)
                del rank.receiving[token]
        _require(r, rank, action, last)
        duration = compute_cost(action.kind, cost)
        rank.intervals.append(Interval(rank.clock, rank.clock + duration, action))
        rank.clock += duration
        rank.busy += duration
        rank.have.update(makes(action))
        if action.kind is Kind.FORWARD:
            rank.in_flight += 1
            rank.peak = max(rank.peak, rank.in_flight)
        elif action.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            rank.in_flight -= 1
        rank.at += 1
        return True
    moved = False
    if rank.batch is None:  # post every transfer of the batch at once
        end, ops = rank.at, []
        while end < len(rank.actions) and not rank.actions[end].kind.is_compute:
            a = rank.actions[end]
            _require(r, rank, a, last)
            if a.peer is None:
                raise ScheduleError(f"rank {r}, action {end}: {a} names no peer")
            channel = (r, a.peer) if a.kind.is_send else (a.peer, r)
            entries = posted.setdefault((a.kind.is_send, channel), [])
            ops.append(_Op(a, channel, len(entries)))
            entries.append((a, rank.clock))
            end += 1
        rank.batch = _Batch(end, rank.clock, ops)
        moved = True
    batch = rank.batch
    finish = batch.posted
    for op in batch.ops:
        is_send = op.action.kind.is_send
        if (is_send and not blocking) or (lazy and not is_send):
            continue
        other_posted = _match(op, posted)
        if other_posted is None:
            return moved  # the partner is not posted yet
        if blocking:
            finish = max(finish, max(batch.posted, other_posted) + cost["P2P"])
        else:
            finish = max(finish, other_posted + cost["P2P"])
    for op in batch.ops:
        if lazy and not op.action.kind.is_send:
            rank.receiving.update((token, op) for token in makes(op.action))
        else:
            rank.have.update(makes(op.action))
    rank.clock, rank.at, rank.batch = finish, batch.end, None
    return True


def _match(op: _Op, posted: dict[tuple[bool, tuple[int, int]], list[tuple[Action, Fraction]]]) -> Fraction | None:
    """When ``op``'s partner was posted (``None``: not yet); raises if the partner is the wrong transfer."""
    is_send = op.action.kind.is_send
    others = posted.get((not is_send, op.channel), [])
    if len(others) <= op.seq:
        return None
    other, other_posted = others[op.seq]
    send, recv = (op.action, other) if is_send else (other, op.action)
    if partner(send, op.channel[0]) != recv:
        raise ScheduleError(
            f"message {op.seq} from rank {op.channel[0]} to rank {op.channel[1]}: {send} meets {recv}, "
            f"expected {partner(send, op.channel[0])}"
        )
    return other_posted


def _require(r: int, rank: _Rank, action: Action, last: int) -> None:
    for token in needs(action, last):
        if token not in rank.have:
            raise ScheduleError(f"rank {r}, action {rank.at}: {action} runs before {describe(token)}")


def _waiting(
    r: int, rank: _Rank, posted: dict[tuple[bool, tuple[int, int]], list[tuple[Action, Fraction]]], blocking: bool
) -> str:
    """Where rank ``r`` is stuck, for the deadlock message."""
    if rank.batch is None:
        pending = [
            str(op.action) for op in rank.receiving.values() if len(posted.get((True, op.channel), [])) <= op.seq
        ]
        if pending:
            return (
                f"rank {r} at action {rank.at} ({rank.actions[rank.at]}) waits for the partners of {', '.join(pending)}"
            )
        return f"rank {r} at action {rank.at} ({rank.actions[rank.at]})"
    missing = [
        str(op.action)
        for op in rank.batch.ops
        if (blocking or not op.action.kind.is_send)
        and len(posted.get((not op.action.kind.is_send, op.channel), [])) <= op.seq
    ]
    return f"rank {r} at action {rank.at} waits for the partners of {', '.join(missing)}"


_LETTER = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.BACKWARD_INPUT: "B", Kind.BACKWARD_WEIGHT: "W"}
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def format_timeline(
    result: Simulation, unit: Fraction | int | None = None, label: Literal["kind", "microbatch", "chunk"] = "kind"
) -> str:
    """An ASCII chart of ``result``: one row per rank, one character per ``unit`` of time (default:
    the largest unit that divides every start and end), ``.`` where the rank computes nothing.
    ``label`` picks the character: the pass (``F``; ``B`` for a whole or input-gradient backward;
    ``W``), the micro-batch, or the chunk (digits, then letters)."""
    intervals = [iv for row in result.intervals for iv in row]
    if unit is None:
        unit = _common_unit([t for iv in intervals for t in (iv.start, iv.end)])
    step = Fraction(unit)
    width = math.ceil(result.makespan / step)
    lines = []
    for r, row in enumerate(result.intervals):
        cells = ["."] * width
        for start, end, action in row:
            char = {
                "kind": _LETTER[action.kind],
                "microbatch": _DIGITS[action.microbatch % 36],
                "chunk": _DIGITS[action.chunk % 36],
            }[label]
            for t in range(math.floor(start / step), math.ceil(end / step)):
                cells[t] = char
        lines.append(f"rank {r}: {''.join(cells)}")
    return "\n".join(lines)


def _common_unit(times: Sequence[Fraction]) -> Fraction:
    """The largest fraction dividing every time in ``times`` (1 if there are none)."""
    nonzero = [t for t in times if t]
    if not nonzero:
        return Fraction(1)
    scale = math.lcm(*(t.denominator for t in nonzero))
    return Fraction(math.gcd(*(int(t * scale) for t in nonzero)), scale)
