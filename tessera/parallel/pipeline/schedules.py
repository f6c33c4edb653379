"""Pipeline schedules as data: one ordered list of :class:`Action` per pipeline rank.

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

Where the transfers go (:func:`add_p2p`) is what makes a schedule safe to run with blocking
batched p2p. :mod:`tessera.parallel.pipeline.simulate` checks schedules and runs them on paper.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Mapping, Sequence
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


# ---------------------------------------------------------------------------------------------
# Compute orders of the schedules (no transfers yet; add_p2p adds them).


def _check_sizes(name: str, p: int, m: int, *, m_at_least_p: bool) -> None:
    if p < 1 or m < 1:
        raise ScheduleError(f"{name}: need p >= 1 stages and m >= 1 micro-batches (got p={p}, m={m})")
    if m_at_least_p and m < p:
        raise ScheduleError(
            f"{name}: m={m} micro-batches is fewer than p={p} stages; the schedule keeps up to p micro-batches "
            f"in flight and needs m >= p (use gpipe for m < p)"
        )


def _forward(c: int, i: int) -> Action:
    return Action(Kind.FORWARD, c, i)


def _backward(c: int, i: int) -> Action:
    return Action(Kind.BACKWARD, c, i)


def gpipe_order(p: int, m: int) -> Schedule:
    """All forwards, then all backwards, micro-batches in order, on every rank."""
    _check_sizes("gpipe", p, m, m_at_least_p=False)
    return [[_forward(r, i) for i in range(m)] + [_backward(r, i) for i in range(m)] for r in range(p)]


def one_f_one_b_order(p: int, m: int) -> Schedule:
    """Rank r: ``p - r - 1`` warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards."""
    _check_sizes("1f1b", p, m, m_at_least_p=True)
    orders = []
    for r in range(p):
        warmup = p - r - 1
        order = [_forward(r, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [_forward(r, warmup + i), _backward(r, i)]
        order += [_backward(r, i) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def interleaved_order(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B. Micro-batches go through a rank's chunks in groups of ``p``:
    the k-th forward of rank r is micro-batch ``(k // (p*v)) * p + k % p`` on its local chunk
    ``(k // p) % v``; backwards take the same micro-batches through the chunks in reverse. Rank r
    runs ``2 * (p - r - 1) + (v - 1) * p`` warm-up forwards, then one forward and one backward in
    turn. Needs ``m % p == 0``; ``v = 1`` is plain 1F1B."""
    if v < 1:
        raise ScheduleError(f"interleaved: v={v} chunks per rank must be at least 1")
    if v == 1:
        return one_f_one_b_order(p, m)
    _check_sizes("interleaved", p, m, m_at_least_p=True)
    if m % p != 0:
        raise ScheduleError(
            f"interleaved: m={m} micro-batches must be a multiple of p={p} stages (micro-batches go through "
            f"each rank's {v} chunks in groups of p)"
        )
    total = m * v
    orders = []
    for r in range(p):

        def step(k: int, backward: bool, r: int = r) -> Action:
            local = (k // p) % v
            micro = (k // (p * v)) * p + k % p
            if backward:
                return _backward((v - 1 - local) * p + r, micro)
            return _forward(local * p + r, micro)

        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [step(k, False) for k in range(warmup)]
        for k in range(total - warmup):
            order += [step(warmup + k, False), step(k, True)]
        order += [step(k, True) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def zero_bubble_h1_order(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into B and W. Rank r runs the same
    ``p - r - 1`` warm-up forwards as 1F1B, then F and B in turn, but starts its W passes ``r``
    steps late, so every rank holds ``p`` micro-batches at its peak (rank 0 as in 1F1B); the
    postponed W fill the cool-down, where 1F1B waits for gradients."""
    _check_sizes("zero_bubble", p, m, m_at_least_p=True)
    orders = []
    for r in range(p):
        warmup = p - r - 1
        order = [_forward(r, i) for i in range(warmup)]
        next_w = 0
        for i in range(m):
            if warmup + i < m:
                order.append(_forward(r, warmup + i))
            order.append(Action(Kind.BACKWARD_INPUT, r, i))
            if i >= r or warmup + i >= m:
                order.append(Action(Kind.BACKWARD_WEIGHT, r, next_w))
                next_w += 1
        order += [Action(Kind.BACKWARD_WEIGHT, r, i) for i in range(next_w, m)]
        orders.append(order)
    return orders


# ---------------------------------------------------------------------------------------------
# Placing the transfers.


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


# ---------------------------------------------------------------------------------------------
# The schedules, transfers included.


def gpipe(p: int, m: int, *, costs: Costs = None) -> Schedule:
    """GPipe: every rank runs all ``m`` forwards, then all ``m`` backwards. Any ``m >= 1``; peak
    in flight ``m`` on every rank. ``costs`` only guide where receives go (:func:`add_p2p`)."""
    return add_p2p(gpipe_order(p, m), p, costs)


def one_f_one_b(p: int, m: int, *, costs: Costs = None) -> Schedule:
    """1F1B (PipeDream-flush): ``p - r - 1`` warm-up forwards on rank r, then one forward and one
    backward in turn, then the cool-down backwards. Needs ``m >= p``; peak in flight ``p - r``."""
    return add_p2p(one_f_one_b_order(p, m), p, costs)


def interleaved_1f1b(p: int, m: int, v: int, *, costs: Costs = None) -> Schedule:
    """Interleaved 1F1B (Megatron): rank r holds chunks ``r, r+p, ..., r+(v-1)p``; see
    :func:`interleaved_order`. Needs ``m % p == 0``; ``v = 1`` is :func:`one_f_one_b`."""
    return add_p2p(interleaved_order(p, m, v), p, costs)


def zero_bubble_h1(p: int, m: int, *, costs: Costs = None) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): backward split into B and W,
    W postponed into the bubbles; peak in flight ``p`` on every rank. See
    :func:`zero_bubble_h1_order`. Needs ``m >= p``."""
    return add_p2p(zero_bubble_h1_order(p, m), p, costs)


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


def build_schedule(name: str, p: int, m: int, v: int = 1, *, costs: Costs = None) -> Schedule:
    """The schedule called ``name`` (as in the config's ``parallel.pipeline.schedule``) for ``p``
    ranks, ``m`` micro-batches and ``v`` chunks per rank (``v > 1`` only for "interleaved")."""
    if name == "interleaved":
        return interleaved_1f1b(p, m, v, costs=costs)
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if v != 1:
        raise ScheduleError(f"schedule {name!r} runs one chunk per rank; v={v} needs 'interleaved'")
    generator = {"gpipe": gpipe, "1f1b": one_f_one_b, "zero_bubble": zero_bubble_h1}[name]
    return generator(p, m, costs=costs)
