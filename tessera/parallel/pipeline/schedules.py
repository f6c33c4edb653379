"""The pipeline schedules: GPipe, 1F1B, interleaved 1F1B and ZB-H1, each as one ordered list of
:class:`~tessera.parallel.pipeline.actions.Action` per pipeline rank.

Each schedule is first a compute order per rank (``*_order``: forwards and backwards only);
:func:`~tessera.parallel.pipeline.p2p_placement.add_p2p` then inserts the transfers, which is
what makes a schedule safe to run with blocking batched p2p. :func:`build_schedule` picks a
schedule by its config name. :mod:`tessera.parallel.pipeline.simulate` checks schedules and runs
them on paper.
"""

from __future__ import annotations

from tessera.parallel.pipeline.actions import Action, Costs, Kind, Schedule, ScheduleError
from tessera.parallel.pipeline.p2p_placement import add_p2p

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
