"""Where a schedule's transfers go: :func:`add_p2p` inserts the sends and receives into
compute-only orders so that the schedule cannot deadlock, even with blocking batched p2p, and
:func:`post_early` reorders one rank's list for a runtime whose transfers do not block.

Both work on the reference timeline of the compute orders (:func:`reference_times`); why the
placement is deadlock-free is argued in :func:`add_p2p` and in ``docs/pipeline.md`` ("For
runtime authors"). :mod:`tessera.parallel.pipeline.simulate` checks the result.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction

from tessera.parallel.pipeline.actions import (
    Action,
    Costs,
    DeadlockError,
    Kind,
    Schedule,
    ScheduleError,
    Token,
    compute_cost,
    makes,
    needs,
    parse_costs,
    partner,
    stage_rank,
)


def reference_times(orders: Sequence[Sequence[Action]], costs: Mapping[str, Fraction]) -> list[list[Fraction]]:
    """Start time of every compute action in ``orders`` (compute only, no transfers) when each
    rank runs its list in order and every input arrives the moment it is made. Raises
    :class:`DeadlockError` if the orders cannot all run."""
    last = max((a.chunk for order in orders for a in order), default=0)
    done: dict[Token, Fraction] = {}  # ("F"|"B", chunk, micro-batch) -> end time
    starts: list[list[Fraction]] = [[] for _ in orders]
    clock = [Fraction(0)] * len(orders)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while len(starts[r]) < len(order):
                action = order[len(starts[r])]
                producers = [_producer(t) for t in needs(action, last)]
                if any(key not in done for key in producers):
                    break
                start = max([clock[r], *(done[key] for key in producers)])
                starts[r].append(start)
                clock[r] = start + compute_cost(action.kind, costs)
                for what, c, i in makes(action):
                    if what in ("F", "B"):
                        done[(what, c, i)] = clock[r]
                progress = True
    stuck = [f"rank {r} at {orders[r][len(s)]}" for r, s in enumerate(starts) if len(s) < len(orders[r])]
    if stuck:
        raise DeadlockError(f"compute orders cannot run, each waits on another: {'; '.join(stuck)}")
    return starts


def _producer(token: Token) -> Token:
    """The compute whose end makes ``token`` available (inputs arrive from the neighbour chunk)."""
    what, c, i = token
    return {"act": ("F", c - 1, i), "grad": ("B", c + 1, i)}.get(what, token)


def add_p2p(orders: Sequence[Sequence[Action]], p: int, costs: Costs = None) -> Schedule:
    """Insert the transfers into compute-only ``orders`` (one list per rank) and return the schedule.

    Gap g of a rank is the place just before its compute g (the last gap: after its last compute);
    the transfers in one gap form one batch, which a runtime posts at once and waits for. Each
    transfer gets a hand-over time ``t`` in the timeline of :func:`reference_times` under ``costs``
    (default: unit F, B, W): the earliest time, not before its data is made nor before the
    previous hand-over between the same two ranks, at which both ranks sit between computes; if
    there is none before the data is needed, the time the data is made. The send goes in the
    sender's first gap that ends at or after ``t``, the receive in the receiver's. Then:

    - no deadlock, whatever the actual costs: a rank reaches a batch once its earlier batches
      are done, and each of those waits only for partner batches whose preceding compute
      started, in the reference timeline, before the compute that follows it; so a chain of
      waits always goes back in reference time and cannot close into a cycle;
    - transfers between two ranks are posted in the same order on both (they are matched in order);
    - under the reference costs no rank ever waits longer than its data takes to be made, even
      when each send blocks until its receive is posted (as long as a common free time exists).
    """
    ref = parse_costs(costs)
    for kind in {a.kind for order in orders for a in order}:
        if not kind.is_compute:
            raise ScheduleError(f"add_p2p takes compute actions only, not {kind.name}")
        if compute_cost(kind, ref) <= 0:
            raise ScheduleError(f"add_p2p: {kind.name} has cost 0 under {dict(ref)}; reference costs must be positive")
    starts = reference_times(orders, ref)
    timeline = [_Gaps(order, rank_starts, ref) for order, rank_starts in zip(orders, starts)]
    last = max((a.chunk for order in orders for a in order), default=0)
    position = [{_key(a): k for k, a in enumerate(order)} for order in orders]
    channels: dict[tuple[int, int], list[tuple[Fraction, Fraction, Action, Action]]] = {}
    for src, order in enumerate(orders):
        for k, action in enumerate(order):
            transfer = _outgoing(action, src, p, last)
            if transfer is not None:
                send, recv, consumer = transfer
                dst = stage_rank(recv.chunk, p)
                made, needed = timeline[src].ends[k], starts[dst][position[dst][consumer]]
                channels.setdefault((src, dst), []).append((made, needed, send, recv))
    batches: dict[tuple[int, int], list[tuple[bool, Fraction, int, int, Action]]] = {}  # (rank, gap) -> ops
    for (src, dst), messages in channels.items():
        deadline = [needed for _, needed, _, _ in messages]
        for k in reversed(range(len(messages) - 1)):  # a hand-over may not come after a later one's deadline
            deadline[k] = min(deadline[k], deadline[k + 1])
        previous = Fraction(0)
        for k, (made, _, send, recv) in enumerate(messages):
            earliest = max(made, previous)
            t = _common_free_time(timeline[src], timeline[dst], earliest, deadline[k])
            previous = earliest if t is None else t
            batches.setdefault((src, timeline[src].first_gap(previous)), []).append((False, previous, dst, k, send))
            batches.setdefault((dst, timeline[dst].first_gap(previous)), []).append((True, previous, src, k, recv))
    schedule: Schedule = []
    for r, order in enumerate(orders):
        out: list[Action] = []
        for g in range(len(order) + 1):
            out += [op[-1] for op in sorted(batches.get((r, g), []), key=lambda op: op[:4])]
            if g < len(order):
                out.append(order[g])
        schedule.append(out)
    return schedule


class _Gaps:
    """The gaps of one rank in a reference timeline: gap g spans ``[end of compute g-1, start of
    compute g]`` (from 0; to infinity for the last)."""

    def __init__(self, order: Sequence[Action], starts: Sequence[Fraction], costs: Mapping[str, Fraction]) -> None:
        self.starts = list(starts)
        self.ends = [t + compute_cost(a.kind, costs) for a, t in zip(order, starts)]

    def first_gap(self, t: Fraction) -> int:
        """The first gap ending at or after ``t``: the one ``t`` falls in, or the next."""
        return bisect.bisect_left(self.starts, t)

    def span(self, g: int) -> tuple[Fraction, Fraction | float]:
        return (self.ends[g - 1] if g > 0 else Fraction(0)), (self.starts[g] if g < len(self.starts) else math.inf)


def _common_free_time(a: _Gaps, b: _Gaps, earliest: Fraction, latest: Fraction) -> Fraction | None:
    """The earliest time in ``[earliest, latest]`` at which both ranks sit in a gap, or ``None``."""
    ga, gb = a.first_gap(earliest), b.first_gap(earliest)
    while True:
        (a_from, a_to), (b_from, b_to) = a.span(ga), b.span(gb)
        t = max(earliest, a_from, b_from)
        if t > latest:
            return None
        if t <= a_to and t <= b_to:
            return t
        if a_to < b_to:
            ga += 1
        else:
            gb += 1


def _key(action: Action) -> Token:
    """The key of a compute in :func:`reference_times`' terms: which pass of which (chunk, micro-batch)."""
    kind = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.BACKWARD_INPUT: "B"}.get(action.kind, "W")
    return (kind, action.chunk, action.microbatch)


def _outgoing(action: Action, rank: int, p: int, last: int) -> tuple[Action, Action, Token] | None:
    """(send, its matching receive, key of the compute that consumes it) if ``action`` makes data
    that another rank needs; else ``None``."""
    c, i = action.chunk, action.microbatch
    if action.kind is Kind.FORWARD and c < last and stage_rank(c + 1, p) != rank:
        send = Action(Kind.SEND_ACT, c, i, stage_rank(c + 1, p))
        return send, partner(send, rank), ("F", c + 1, i)
    if action.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and c > 0 and stage_rank(c - 1, p) != rank:
        send = Action(Kind.SEND_GRAD, c, i, stage_rank(c - 1, p))
        return send, partner(send, rank), ("B", c - 1, i)
    return None


def post_early(actions: Sequence[Action], lookahead: int | None = None) -> list[Action]:
    """One rank's list reordered for a runtime whose transfers do not block: it waits for a
    receive only at the compute that reads it, and for its sends at the end of the step.

    Each send moves to just after the compute that makes its data, so the data leaves at once.
    Each receive moves as early as it can (with ``lookahead``: to at most that many computes
    before the compute that reads it; a gradient not before the forward it belongs to, whose
    output gives its shape), so that it is posted before its send: gloo moves a message at the
    send when the receive is already posted, and needs a round trip more when it is not.
    Nothing moves later, and the sends to a peer, and the receives from it, keep their order,
    so transfers still pair (:func:`validate` accepts the result whenever it accepted
    ``actions``). A runtime of that kind cannot deadlock on the result if it cannot on
    ``actions``: every send is posted no later, relative to the sender's computes, and no wait
    comes earlier. Not for a runtime that waits for each batch, nor for NCCL, which runs the
    transfers between two ranks one after another in posting order (an early receive would hold
    up the sends behind it).
    """
    if lookahead is not None and lookahead < 0:
        raise ScheduleError(f"post_early: lookahead must be >= 0, got {lookahead}")
    computes = [a for a in actions if a.kind.is_compute]
    index = {_key(a): k for k, a in enumerate(computes)}  # F and B/BW of each (chunk, micro-batch)
    moved: list[tuple[int, int, Action]] = []  # (gap, original position, transfer)
    queue_gap: dict[tuple[bool, int | None], int] = {}  # (is send, peer) -> gap of its latest transfer
    gap = 0
    for position, action in enumerate(actions):
        if action.kind.is_compute:
            gap += 1
            continue
        c, i, queue = action.chunk, action.microbatch, (action.kind.is_send, action.peer)
        if action.kind is Kind.SEND_ACT:
            target = index.get(("F", c, i), gap - 1) + 1
        elif action.kind is Kind.SEND_GRAD:
            target = index.get(("B", c, i), gap - 1) + 1
        else:
            consumer = index.get(("F", c, i) if action.kind is Kind.RECV_ACT else ("B", c, i), gap)
            target = 0 if lookahead is None else consumer - lookahead
            if action.kind is Kind.RECV_GRAD:  # its buffer takes the shape of the forward's output
                target = max(target, index.get(("F", c, i), -1) + 1)
        new_gap = min(gap, max(target, queue_gap.get(queue, 0)))
        queue_gap[queue] = new_gap
        moved.append((new_gap, position, action))
    moved.sort(key=lambda entry: entry[:2])
    out: list[Action] = []
    k = 0
    for g in range(len(computes) + 1):
        while k < len(moved) and moved[k][0] == g:
            out.append(moved[k][2])
            k += 1
        if g < len(computes):
            out.append(computes[g])
    return out
