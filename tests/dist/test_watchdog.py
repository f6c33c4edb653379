"""A hang names the rank that did not arrive, on real gloo ranks: a skipped collective, a
transfer never sent, and the waits that run under the process-group timeout (broadcast_object,
all_reduce_async). Each case runs on a process group of its own, made for it, because a timed-out
collective leaves its group unusable."""

from __future__ import annotations

import datetime
import gc
import re

import torch
import torch.distributed as dist

from tessera import comm
from tessera.comm import progress
from tessera.errors import CommError
from tessera.testing import use_layout

WATCHDOG_S = 2.0
HUNG = 2


def _fresh_group(name: str, members: list[int], timeout_s: float | None = None) -> comm.AxisGroup | None:
    """A new process group over ``members`` (collective over the world); None off it."""
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    pg = dist.new_group(members, timeout=timeout)
    rank = dist.get_rank()
    if rank not in members:
        return None
    return comm.AxisGroup(name, tuple(members), members.index(rank), pg)


def _caught(call) -> tuple[str, str, tuple[int, ...]] | None:
    try:
        call()
    except CommError as exc:
        return type(exc).__name__, str(exc), exc.missing_ranks
    return None


def body_hangs():
    ctx = use_layout()  # 4 ranks
    rank, out = ctx.rank, {}
    # the groups first, while every rank is here (a group's set-up waits for all its members)
    probe = _fresh_group("probe", [0, 1, 2, 3])
    pair = _fresh_group("pipeline", [0, 3])
    objects = _fresh_group("objects", [0, 1, 2, 3], timeout_s=WATCHDOG_S)
    buckets = _fresh_group("buckets", [0, 1, 2, 3], timeout_s=WATCHDOG_S)
    gone = _fresh_group("gone", [0, 1, 2, 3])
    assert probe is not None and objects is not None and buckets is not None and gone is not None
    # -- a skipped all_reduce: rank 2 does two and stops
    for _ in range(2):
        comm.all_reduce(torch.ones(3), probe)
    key = f"tsr/{probe.pg.group_name}/{rank}"  # this rank's record (the others' may be at #3 already)
    out["record"] = progress.read_keys(dist.distributed_c10d._get_default_store(), [key])[key]
    if rank != HUNG:
        with comm.watchdog(WATCHDOG_S):
            out["all_reduce"] = _caught(lambda: comm.all_reduce(torch.ones(3), probe))
    world = ctx.group("world")
    comm.barrier(world)  # each case starts together, so that only rank 2 (or 3) is late
    # -- a receive that rank 3 never sends (one transfer did arrive before it)
    if rank == 3:
        comm.send(torch.ones(2), pair, 0)
    elif rank == 0:
        comm.recv(torch.empty(2), pair, 1)
        with comm.watchdog(WATCHDOG_S):
            out["recv"] = _caught(lambda: comm.recv(torch.empty(2), pair, 1))
    # -- waits inside torch, under the group's own timeout: rank 2 is the source and skips
    comm.barrier(world)
    if rank != HUNG:
        out["broadcast_object"] = _caught(lambda: comm.broadcast_object(None, objects, src=HUNG))
    comm.barrier(world)
    if rank != HUNG:
        future = comm.all_reduce_async(torch.ones(3), buckets)
        try:
            future.wait()
        except RuntimeError as exc:  # torch wraps the callback's error in its own
            out["all_reduce_async"] = str(exc)
    # -- rank 2 leaves a group, as a rank that died would: its peers see the connection close
    comm.barrier(world)
    if rank == HUNG:  # free the group, which closes its connections
        dist.destroy_process_group(gone.pg)
        object.__setattr__(gone, "pg", None)
        gc.collect()
    else:
        with comm.watchdog(WATCHDOG_S):
            out["gone"] = _caught(lambda: comm.all_reduce(torch.ones(3), gone))
    comm.barrier(world)  # rank 2 keeps its groups open until the others are done
    return out


def test_the_rank_that_did_not_arrive_is_named(pools):
    try:
        results = pools.run(4, body_hangs, timeout=120)
    finally:
        # timed-out collectives are left in those groups: have the next test get a new pool
        pools.get(4).broken = True
    for rank, out in enumerate(results):
        assert out["record"] == "2 all_reduce probe"
        if rank == HUNG:
            assert set(out) == {"record"}
            continue
        kind, message, missing = out["all_reduce"]
        print(message)
        assert (kind, missing) == ("CommTimeoutError", (HUNG,))
        others = ", ".join(str(r) for r in (0, 1, 3) if r != rank)
        assert message == (
            f"rank {rank}: all_reduce on axis 'probe' (group ranks [0, 1, 2, 3]) did not complete within the "
            "watchdog timeout of 2s: rank 2 did not arrive at all_reduce #3 on this group (its last collective on "
            f"this group was #2 all_reduce on axis 'probe'); ranks {others} arrived"
        )
        # under the group's own timeout gloo closes a pair that timed out, so a rank may hear of it first as
        # a connection its peer closed: either way, rank 2 is named
        for case, op in (("broadcast_object", "broadcast"), ("gone", "all_reduce")):
            kind, message, missing = out[case]
            assert missing == (HUNG,), message
            assert kind in ("CommError", "CommTimeoutError")
            assert f"rank 2 did not arrive at {op} #1 on this group (it has entered none on this group)" in message
        print(out["gone"][1])
        assert "rank 2 did not arrive at all_reduce #1 on this group" in out["all_reduce_async"]
        assert re.search(r"Comm(Timeout)?Error: rank \d: all_reduce on axis 'buckets'", out["all_reduce_async"])
    kind, message, missing = results[0]["recv"]
    print(message)
    assert (kind, missing) == ("CommTimeoutError", (3,))
    assert message == (
        "rank 0: recv (peer 1) on axis 'pipeline' (group ranks [0, 3]) did not complete within the watchdog "
        "timeout of 2s: rank 3 did not arrive: this is recv #2 from rank 3 on this group, and rank 3 has "
        "posted 1 send to rank 0 (it has entered no collective on this group)"
    )
