"""Pipeline schedules as data: generated lists are complete and ordered, the checker rejects broken
ones, and the simulator gives the textbook bubble fractions exactly and finds deadlocks.

Costs: every test states them. Unless a test says otherwise they are the simulator's default,
F = B = W = 1 per chunk (a whole backward BW costs B + W = 2), P2P = 0. For interleaved
schedules the costs are per chunk, so a rank's stage (v chunks) costs v times as much; the idle
fraction does not depend on that scale.
"""

from __future__ import annotations

import random
import re
import typing
from fractions import Fraction
from pathlib import Path

import pytest

from tessera.config.schema import PipelineConfig
from tessera.parallel.pipeline import (
    SCHEDULES,
    Action,
    DeadlockError,
    Kind,
    ScheduleError,
    add_p2p,
    build_schedule,
    format_timeline,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    partner,
    simulate,
    validate,
    zero_bubble_h1,
)
from tessera.parallel.pipeline.actions import makes, needs, parse_costs
from tessera.parallel.pipeline.p2p_placement import post_early, reference_times

F, BW, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD


def cases() -> list[tuple[str, int, int, int]]:
    """(name, p, m, v) for p in 2, 4, 8 and m in p, 2p, 8 (m >= p); v in 2, 3 for interleaved."""
    out = []
    for p in (2, 4, 8):
        for m in sorted({p, 2 * p, 8}):
            if m < p:
                continue
            out += [("gpipe", p, m, 1), ("1f1b", p, m, 1), ("zero_bubble", p, m, 1)]
            out += [("interleaved", p, m, v) for v in (2, 3)]
    return out


CASES = cases()
IDS = [f"{name}-p{p}-m{m}-v{v}" for name, p, m, v in CASES]


def expected_idle(name: str, p: int, m: int, v: int) -> Fraction:
    """The textbook bubble under F = B = W = 1: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm+p-1)
    for interleaved (per-chunk costs), (p-1)/(3m+p-1) for ZB-H1 (bubble (p-1)(F+B-W) in a step
    of 3m)."""
    if name == "zero_bubble":
        return Fraction(p - 1, 3 * m + p - 1)
    return Fraction(p - 1, v * m + p - 1)


# ---------------------------------------------------------------------------------------------
# 1. Every pass runs once, in dependency order.


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES, ids=IDS)
def test_every_pass_runs_once_in_order(name: str, p: int, m: int, v: int) -> None:
    schedule = build_schedule(name, p, m, v)
    validate(schedule, p, m, v)
    backward_kinds = {B, W} if name == "zero_bubble" else {BW}
    for c in range(p * v):
        actions = schedule[c % p]
        for i in range(m):
            where = {
                kind: [n for n, a in enumerate(actions) if (a.kind, a.chunk, a.microbatch) == (kind, c, i)]
                for kind in (F, BW, B, W)
            }
            for kind in {F} | backward_kinds:
                assert len(where[kind]) == 1, (c, i, kind)
            for kind in {BW, B, W} - backward_kinds:
                assert where[kind] == [], (c, i, kind)
            if name == "zero_bubble":
                assert where[F][0] < where[B][0] < where[W][0]
            else:
                assert where[F][0] < where[BW][0]


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES, ids=IDS)
def test_transfers_pair_up_in_order(name: str, p: int, m: int, v: int) -> None:
    """Each send has its partner receive at the peer, and two ranks post their transfers to each
    other in the same order (they are matched in posting order)."""
    schedule = build_schedule(name, p, m, v)
    for src in range(p):
        for dst in range(p):
            sent = [partner(a, src) for a in schedule[src] if a.kind.is_send and a.peer == dst]
            received = [a for a in schedule[dst] if a.peer == src and not a.kind.is_send]
            assert sent == received


def two_rank_gpipe(first_send: int) -> list[list[Action]]:
    """GPipe for p = 2, m = 2, written by hand; rank 0 sends micro-batch ``first_send`` first."""
    order = (first_send, 1 - first_send)
    rank0 = [Action(F, 0, 0), Action(F, 0, 1), *(Action(SEND_ACT, 0, i, 1) for i in order)]
    rank0 += [Action(RECV_GRAD, 0, 0, 1), Action(RECV_GRAD, 0, 1, 1), Action(BW, 0, 0), Action(BW, 0, 1)]
    rank1 = [Action(RECV_ACT, 1, 0, 0), Action(RECV_ACT, 1, 1, 0), Action(F, 1, 0), Action(F, 1, 1)]
    rank1 += [Action(BW, 1, 0), Action(SEND_GRAD, 1, 0, 0), Action(BW, 1, 1), Action(SEND_GRAD, 1, 1, 0)]
    return [rank0, rank1]


def drop(schedule: list[list[Action]], rank: int, action: Action) -> list[list[Action]]:
    out = [list(actions) for actions in schedule]
    out[rank].remove(action)
    return out


def swap(schedule: list[list[Action]], rank: int, a: Action, b: Action) -> list[list[Action]]:
    out = [list(actions) for actions in schedule]
    i, j = out[rank].index(a), out[rank].index(b)
    out[rank][i], out[rank][j] = out[rank][j], out[rank][i]
    return out


def test_validate_accepts_a_hand_written_schedule() -> None:
    validate(two_rank_gpipe(first_send=0), 2, 2)
    # Both activations go in one batch after both forwards and both gradients come in one batch
    # before the backwards: rank 1 starts at 2, rank 0 at 8, which the generated GPipe avoids.
    assert simulate(two_rank_gpipe(first_send=0)).makespan == 12
    assert simulate(gpipe(2, 2)).makespan == (2 + 2 - 1) * (1 + 2)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        pytest.param(
            lambda: drop(one_f_one_b(2, 2), 1, Action(BW, 1, 0)),
            r"chunk 1, micro-batch 0 \(rank 1\): backward runs 0 whole \(BW\), 0 input-gradient \(B\) and 0",
            id="dropped-backward",
        ),
        pytest.param(
            lambda: [*one_f_one_b(2, 2)[:1], [*one_f_one_b(2, 2)[1], Action(F, 1, 1)]],
            r"chunk 1, micro-batch 1 \(rank 1\): forward runs 2 times, not once",
            id="duplicated-forward",
        ),
        pytest.param(
            lambda: swap(gpipe(2, 2), 0, Action(F, 0, 1), Action(BW, 0, 1)),
            r"rank 0, action \d+: BW\(c0,m1\) runs before the forward of chunk 0, micro-batch 1",
            id="backward-before-forward",
        ),
        pytest.param(
            lambda: swap(zero_bubble_h1(2, 2), 1, Action(B, 1, 1), Action(W, 1, 1)),
            r"W\(c1,m1\) runs before the backward \(input gradient\) of chunk 1, micro-batch 1",
            id="weight-before-input-gradient",
        ),
        pytest.param(
            lambda: drop(one_f_one_b(2, 2), 1, Action(RECV_ACT, 1, 1, 0)),
            r"F\(c1,m1\) runs before the input activation of chunk 1, micro-batch 1",
            id="missing-receive",
        ),
        pytest.param(
            lambda: [[*one_f_one_b(2, 2)[0], Action(SEND_ACT, 0, 1, 1)], one_f_one_b(2, 2)[1]],
            r"rank 0 sends 3 messages to rank 1, which receives 2: SEND_ACT\(c0,m1\)->1 is unmatched",
            id="unmatched-send",
        ),
        pytest.param(
            lambda: two_rank_gpipe(first_send=1),
            r"message 0 from rank 0 to rank 1: rank 0 sends SEND_ACT\(c0,m1\)->1 but rank 1 receives "
            r"RECV_ACT\(c1,m0\)<-0, expected RECV_ACT\(c1,m1\)<-0",
            id="sends-and-receives-in-different-orders",
        ),
        pytest.param(
            lambda: [[Action(SEND_ACT, 0, 0, 0), *one_f_one_b(2, 2)[0]], one_f_one_b(2, 2)[1]],
            "peer must be rank 1, which holds chunk 1",
            id="wrong-peer",
        ),
        pytest.param(
            lambda: [[Action(F, 1, 0), *one_f_one_b(2, 2)[0]], one_f_one_b(2, 2)[1]],
            "chunk 1 is not held by rank 0",
            id="chunk-on-wrong-rank",
        ),
        pytest.param(lambda: one_f_one_b(2, 2)[:1], "schedule has 1 rank lists for p=2 ranks", id="missing-rank"),
    ],
)
def test_validate_rejects_broken_schedules(broken: typing.Callable[[], list[list[Action]]], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(broken(), 2, 2)


def test_simulate_rejects_a_compute_without_its_input() -> None:
    schedule = drop(one_f_one_b(2, 2), 1, Action(RECV_ACT, 1, 1, 0))
    schedule = [[a for a in actions if a != Action(SEND_ACT, 0, 1, 1)] for actions in schedule]
    with pytest.raises(ScheduleError, match=r"rank 1, action \d+: F\(c1,m1\) runs before the input activation"):
        simulate(schedule)


# ---------------------------------------------------------------------------------------------
# 2. Peak micro-batches in flight.


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES, ids=IDS)
def test_peak_in_flight(name: str, p: int, m: int, v: int) -> None:
    peak = simulate(build_schedule(name, p, m, v)).peak_in_flight
    if name == "gpipe":
        assert peak == (m,) * p
    elif name == "1f1b":
        assert peak == tuple(p - r for r in range(p))  # stage 0 holds p, stage r holds p - r
    elif name == "zero_bubble":
        assert peak == (p,) * p  # W postponed: every stage holds p, none more than 1F1B's stage 0
    else:  # Megatron: warm-up forwards plus one, counted in (chunk, micro-batch) pairs
        assert peak == tuple(min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p))


# ---------------------------------------------------------------------------------------------
# 3. Bubbles, exactly.


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES, ids=IDS)
def test_idle_fraction_matches_the_formula(name: str, p: int, m: int, v: int) -> None:
    """F = B = W = 1 (per chunk), so BW = 2; P2P = 0."""
    result = simulate(build_schedule(name, p, m, v), {"F": 1, "B": 1, "W": 1})
    assert result.idle_fraction == expected_idle(name, p, m, v)
    assert result.busy == (v * m * 3,) * p
    assert result.makespan == result.busy[0] / (1 - result.idle_fraction)


@pytest.mark.parametrize(
    ("name", "p", "m", "v"),
    [c for c in CASES if c[0] != "zero_bubble"],
    ids=[i for i, c in zip(IDS, CASES) if c[0] != "zero_bubble"],
)
@pytest.mark.parametrize("blocking_p2p", [False, True], ids=["isend", "blocking"])
def test_idle_fraction_with_unit_forward_and_backward(name: str, p: int, m: int, v: int, blocking_p2p: bool) -> None:
    """F = 1 and a whole backward BW = 1 (B = 1, W = 0), the schedule's transfers placed for those
    costs: the same formula, also when every send blocks until its receive is posted."""
    costs = {"F": 1, "B": 1, "W": 0}
    result = simulate(build_schedule(name, p, m, v, costs=costs), costs, blocking_p2p=blocking_p2p)
    assert result.idle_fraction == Fraction(p - 1, v * m + p - 1)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [8, 16])
def test_zero_bubble_h1_beats_1f1b(p: int, m: int) -> None:
    """F = B = W = 1: ZB-H1's bubble is a third of 1F1B's, (p-1) units in a step of 3m + p - 1."""
    zb, base = simulate(zero_bubble_h1(p, m)), simulate(one_f_one_b(p, m))
    assert zb.idle_fraction < base.idle_fraction
    assert zb.makespan == 3 * m + p - 1
    assert base.makespan - 3 * m == 3 * (zb.makespan - 3 * m)
    assert max(zb.peak_in_flight) == max(base.peak_in_flight) == p


def test_idle_fraction_table() -> None:
    """The table in docs/pipeline.md, F = B = W = 1."""
    rows = {
        (name, p, m, v): str(simulate(build_schedule(name, p, m, v)).idle_fraction)
        for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1))
        for p, m in ((4, 4), (4, 8), (8, 8), (8, 16))
    }
    assert rows == {
        ("gpipe", 4, 4, 1): "3/7",
        ("gpipe", 4, 8, 1): "3/11",
        ("gpipe", 8, 8, 1): "7/15",
        ("gpipe", 8, 16, 1): "7/23",
        ("1f1b", 4, 4, 1): "3/7",
        ("1f1b", 4, 8, 1): "3/11",
        ("1f1b", 8, 8, 1): "7/15",
        ("1f1b", 8, 16, 1): "7/23",
        ("interleaved", 4, 4, 2): "3/11",
        ("interleaved", 4, 8, 2): "3/19",
        ("interleaved", 8, 8, 2): "7/23",
        ("interleaved", 8, 16, 2): "7/39",
        ("zero_bubble", 4, 4, 1): "1/5",
        ("zero_bubble", 4, 8, 1): "1/9",
        ("zero_bubble", 8, 8, 1): "7/31",
        ("zero_bubble", 8, 16, 1): "7/55",
    }


def test_transfer_latency_lengthens_the_step() -> None:
    schedule = one_f_one_b(4, 8)
    fast, slow = simulate(schedule), simulate(schedule, {"P2P": Fraction(1, 2)})
    assert slow.busy == fast.busy
    assert slow.makespan > fast.makespan
    assert simulate(schedule, {"P2P": Fraction(1, 2)}, blocking_p2p=True).makespan >= slow.makespan


def test_timeline() -> None:
    """1F1B, p = 2, m = 4, F = 1 and BW = 2: one character per time unit."""
    result = simulate(one_f_one_b(2, 4))
    assert format_timeline(result) == "rank 0: FF..BBFBBFBB.BB\nrank 1: .FBBFBBFBBFBB.."
    assert format_timeline(result, label="microbatch") == "rank 0: 01..00211322.33\nrank 1: .000111222333.."
    assert format_timeline(simulate(one_f_one_b(2, 4), {"B": Fraction(1, 2), "W": Fraction(1, 2)})) == (
        "rank 0: FF.BFBFB.B\nrank 1: .FBFBFBFB."
    )


# ---------------------------------------------------------------------------------------------
# 4. Deadlocks.


def both_receive_first() -> list[list[Action]]:
    """p = 2, m = 1: rank 0 waits for a gradient before its forward, rank 1 for the activation."""
    return [
        [Action(RECV_GRAD, 0, 0, 1), Action(F, 0, 0), Action(SEND_ACT, 0, 0, 1), Action(BW, 0, 0)],
        [Action(RECV_ACT, 1, 0, 0), Action(F, 1, 0), Action(BW, 1, 0), Action(SEND_GRAD, 1, 0, 0)],
    ]


@pytest.mark.parametrize("blocking_p2p", [False, True], ids=["isend", "blocking"])
def test_simulate_finds_a_deadlock(blocking_p2p: bool) -> None:
    validate(both_receive_first(), 2, 1)  # well formed, yet it hangs
    with pytest.raises(DeadlockError, match=r"rank 0 at action 0 waits for the partners of RECV_GRAD\(c0,m0\)<-1"):
        simulate(both_receive_first(), blocking_p2p=blocking_p2p)


def blocking_only_deadlock() -> list[list[Action]]:
    """p = 2, m = 3. Rank 0 sends activation 1 alone, then computes before it receives gradient 0;
    rank 1 sends gradient 0 alone, then computes before it receives activation 1. With isends
    this runs; with sends that wait for their receive, each rank waits for the other."""
    rank0 = [Action(F, 0, 0), Action(SEND_ACT, 0, 0, 1), Action(F, 0, 1), Action(SEND_ACT, 0, 1, 1)]
    rank0 += [Action(F, 0, 2), Action(SEND_ACT, 0, 2, 1)]
    rank0 += [a for i in range(3) for a in (Action(RECV_GRAD, 0, i, 1), Action(BW, 0, i))]
    rank1 = []
    for i in range(3):
        rank1 += [Action(RECV_ACT, 1, i, 0), Action(F, 1, i), Action(B, 1, i), Action(SEND_GRAD, 1, i, 0)]
        rank1 += [Action(W, 1, i)]
    return [rank0, rank1]


def test_blocking_sends_can_deadlock_where_isends_do_not() -> None:
    schedule = blocking_only_deadlock()
    validate(schedule, 2, 3)
    simulate(schedule)
    with pytest.raises(DeadlockError, match=r"rank 0 at action 3 waits for the partners of SEND_ACT\(c0,m1\)->1"):
        simulate(schedule, blocking_p2p=True)


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES, ids=IDS)
@pytest.mark.parametrize("costs", [{"F": 1, "B": 2, "W": 1, "P2P": 1}, {"F": 3, "B": 1, "W": Fraction(1, 2)}])
def test_generated_schedules_never_deadlock(name: str, p: int, m: int, v: int, costs: dict) -> None:
    """Transfers are placed for unit costs; running with other costs and sends that wait for their
    receive still never hangs."""
    simulate(build_schedule(name, p, m, v), costs, blocking_p2p=True)


def random_compute_orders(rng: random.Random, p: int, m: int, v: int) -> list[list[Action]]:
    """Some order of all passes that can run: ready passes picked at random, split backward or not."""
    last = p * v - 1
    todo = []
    for c in range(p * v):
        for i in range(m):
            split = rng.random() < 0.5
            todo += [Action(F, c, i), *((Action(B, c, i), Action(W, c, i)) if split else (Action(BW, c, i),))]
    done: set[tuple[str, int, int]] = set()
    orders: list[list[Action]] = [[] for _ in range(p)]

    def producer(token: tuple[str, int, int]) -> tuple[str, int, int]:
        what, c, i = token
        return {"act": ("F", c - 1, i), "grad": ("B", c + 1, i)}.get(what, token)

    def ready(action: Action) -> bool:  # every input made, on any rank (transfers come later)
        return all(producer(token) in done for token in needs(action, last))

    while todo:
        action = rng.choice([a for a in todo if ready(a)])
        todo.remove(action)
        orders[action.chunk % p].append(action)
        done.update(t for t in makes(action) if t[0] in ("F", "B"))
    return orders


@pytest.mark.parametrize("seed", range(40))
def test_placement_is_deadlock_free_for_any_order_and_costs(seed: int) -> None:
    """add_p2p on random runnable compute orders and random reference costs: the schedule is
    valid, runs at the reference costs exactly as the reference timeline, and never hangs under
    other costs, even with sends that wait for their receive."""
    rng = random.Random(seed)
    p, v, m = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 5])
    orders = random_compute_orders(rng, p, m, v)
    reference = {key: rng.choice([1, 2, 3]) for key in ("F", "B", "W")}
    schedule = add_p2p(orders, p, reference)
    validate(schedule, p, m, v)
    result = simulate(schedule, reference)
    assert [[iv.start for iv in row] for row in result.intervals] == reference_times(orders, parse_costs(reference))
    for _ in range(3):
        costs = {key: rng.choice([Fraction(1, 2), 1, 2, 5]) for key in ("F", "B", "W")}
        simulate(schedule, {**costs, "P2P": rng.choice([0, Fraction(1, 3), 1])}, blocking_p2p=True)


# ---------------------------------------------------------------------------------------------
# Transfers posted early, for a runtime whose transfers do not block (post_early, lazy_receive).


def transfer_queues(actions: list[Action]) -> dict[tuple[bool, int | None], list[Action]]:
    """A rank's sends to each peer and receives from each peer, in list order."""
    queues: dict[tuple[bool, int | None], list[Action]] = {}
    for a in actions:
        if not a.kind.is_compute:
            queues.setdefault((a.kind.is_send, a.peer), []).append(a)
    return queues


def gaps(actions: list[Action]) -> dict[Action, int]:
    """Each transfer -> the number of computes before it."""
    out, computes = {}, 0
    for a in actions:
        if a.kind.is_compute:
            computes += 1
        else:
            out[a] = computes
    return out


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES, ids=IDS)
def test_post_early_keeps_computes_and_pairing_and_moves_nothing_later(name: str, p: int, m: int, v: int) -> None:
    schedule = build_schedule(name, p, m, v)
    early = [post_early(actions) for actions in schedule]
    validate(early, p, m, v)
    for before, after in zip(schedule, early, strict=True):
        assert [a for a in after if a.kind.is_compute] == [a for a in before if a.kind.is_compute]
        assert transfer_queues(after) == transfer_queues(before)  # same order per peer and direction
        old, new = gaps(before), gaps(after)
        assert all(new[a] <= old[a] for a in old)
        computes = [a for a in after if a.kind.is_compute]
        for a, g in new.items():
            if a.kind is SEND_ACT:  # right after the forward that makes it
                assert computes[g - 1] == Action(F, a.chunk, a.microbatch)
            elif a.kind is SEND_GRAD:
                assert computes[g - 1] in (Action(BW, a.chunk, a.microbatch), Action(B, a.chunk, a.microbatch))


def test_post_early_posts_receives_as_early_as_pairing_allows() -> None:
    """1F1B's last rank receives activations only: all of them before its first compute; a
    gradient receive goes right after the forward whose output shape it takes."""
    last = post_early(one_f_one_b(4, 8)[3])
    assert all(g == 0 for a, g in gaps(last).items() if a.kind is RECV_ACT)
    first = post_early(one_f_one_b(4, 8)[0])
    computes = [a for a in first if a.kind.is_compute]
    for a, g in gaps(first).items():
        if a.kind is RECV_GRAD:
            assert computes[g - 1] == Action(F, a.chunk, a.microbatch)
    one_ahead = post_early(one_f_one_b(4, 8)[3], lookahead=1)  # one compute ahead of its forward
    computes = [a for a in one_ahead if a.kind.is_compute]
    for a, g in gaps(one_ahead).items():
        if a.kind is RECV_ACT:
            assert g == max(0, computes.index(Action(F, a.chunk, a.microbatch)) - 1)


@pytest.mark.parametrize("seed", range(40))
def test_post_early_runs_every_compute_as_soon_as_its_inputs_exist(seed: int) -> None:
    """With receives waited at the compute that reads them and sends that never wait, the early
    schedule runs every compute at its reference time under any costs: nothing waits for a transfer
    more than for the compute that makes its data. The same schedule never hangs."""
    rng = random.Random(seed)
    p, v, m = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 5])
    orders = random_compute_orders(rng, p, m, v)
    schedule = add_p2p(orders, p, {key: rng.choice([1, 2, 3]) for key in ("F", "B", "W")})
    for lookahead in (None, 0, 1, 2):
        early = [post_early(actions, lookahead) for actions in schedule]
        validate(early, p, m, v)
        costs = {key: rng.choice([Fraction(1, 2), 1, 2, 5]) for key in ("F", "B", "W")}
        result = simulate(early, costs, lazy_receive=True)
        assert [[iv.start for iv in row] for row in result.intervals] == reference_times(orders, parse_costs(costs))


def test_lazy_receives_recover_what_batch_waits_lose() -> None:
    """ZB-H1 placed for unit costs but run with B = 2, W = 0: waiting for each batch's receives
    idles ranks (33 units), waiting at the compute that reads them does not (27, its critical path)."""
    schedule, costs = zero_bubble_h1(2, 8), {"F": 1, "B": 2, "W": 0}
    assert simulate(schedule, costs).makespan == 33
    assert simulate(schedule, costs, lazy_receive=True).makespan == 27
    with pytest.raises(ValueError, match="lazy_receive"):
        simulate(schedule, costs, blocking_p2p=True, lazy_receive=True)


def test_early_receives_need_lazy_waits() -> None:
    """A runtime that waits for each batch must not post receives early: GPipe's first rank would
    wait for its first gradient before sending its last activation."""
    early = [post_early(actions) for actions in gpipe(2, 4)]
    with pytest.raises(DeadlockError, match=r"rank 0 at action \d+ waits for the partners of RECV_GRAD\(c0,m0\)"):
        simulate(early)
    simulate(early, lazy_receive=True)
    with pytest.raises(ScheduleError, match="lookahead"):
        post_early(gpipe(2, 4)[0], -1)


# ---------------------------------------------------------------------------------------------
# Arguments, names, boundaries.


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match=r"1f1b: m=2 micro-batches is fewer than p=4 stages"):
        one_f_one_b(4, 2)
    with pytest.raises(ValueError, match=r"zero_bubble: m=3 micro-batches is fewer than p=4"):
        zero_bubble_h1(4, 3)
    with pytest.raises(ValueError, match=r"interleaved: m=6 micro-batches must be a multiple of p=4"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'pipedream'"):
        build_schedule("pipedream", 2, 2)
    with pytest.raises(ValueError, match=r"schedule '1f1b' runs one chunk per rank; v=2 needs 'interleaved'"):
        build_schedule("1f1b", 2, 2, v=2)
    with pytest.raises(ValueError, match=r"unknown cost key 'Bw'"):
        simulate(gpipe(2, 2), {"Bw": 1})
    assert gpipe(4, 2)  # GPipe takes fewer micro-batches than stages
    assert interleaved_1f1b(2, 3, 1) == one_f_one_b(2, 3)


def test_names_match_the_config() -> None:
    assert SCHEDULES == typing.get_args(typing.get_type_hints(PipelineConfig)["schedule"])


def test_actions_print_and_pair() -> None:
    send = Action(SEND_ACT, 4, 1, peer=1)
    assert str(send) == "SEND_ACT(c4,m1)->1"
    assert str(partner(send, 0)) == "RECV_ACT(c5,m1)<-0"
    assert partner(partner(send, 0), 1) == send
    assert str(Action(SEND_GRAD, 1, 2, 0)) == "SEND_GRAD(c1,m2)->0"
    assert partner(Action(SEND_GRAD, 1, 2, 0), 1) == Action(RECV_GRAD, 0, 2, 1)


def test_schedules_need_no_torch() -> None:
    package = Path(__file__).resolve().parents[2] / "tessera" / "parallel" / "pipeline"
    for name in ("__init__.py", "schedules.py", "simulate.py"):
        text = (package / name).read_text()
        assert not re.search(r"^\s*(import|from)\s+torch\b", text, re.MULTILINE), name
