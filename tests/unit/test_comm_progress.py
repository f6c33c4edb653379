"""Progress records and the diagnosis of a hang (tessera.comm.progress), on a fake store, in one
process: who did not arrive at a collective or a transfer, and a store that cannot answer."""

from __future__ import annotations

import threading
import time

import pytest

from tessera.comm import progress
from tessera.comm.progress import Entered, GroupProgress, collective_key, transfer_key


class FakeStore:
    """The part of torch.distributed.Store that tessera uses, in a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.sets = 0

    def set(self, key: str, value: str | bytes) -> None:
        self.sets += 1
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


WORLD = (0, 1, 2, 3)


def ranks_at(store: FakeStore, steps: dict[int, list[tuple[str, str]]]) -> dict[int, GroupProgress]:
    """Let each rank enter its list of (op, axis) collectives on group "0"."""
    tracks = {rank: GroupProgress(store, "0", rank) for rank in WORLD}
    for rank, ops in steps.items():
        for op, axis in ops:
            tracks[rank].enter(op, axis, WORLD)
    return tracks


def test_each_collective_writes_one_short_record():
    store = FakeStore()
    track = GroupProgress(store, "3", 1)
    first = track.enter("all_reduce", "data", WORLD)
    second = track.enter("broadcast", "data+sequence", WORLD)
    assert (first.seq, second.seq) == (1, 2)
    assert store.sets == 2
    assert store.data == {"tsr/3/1": b"2 broadcast data+sequence"}
    assert collective_key("3", 1) == "tsr/3/1"


def test_transfers_count_per_peer_and_direction_apart_from_collectives():
    store = FakeStore()
    track = GroupProgress(store, "5", 2)
    assert track.transfer("send", "pipeline", WORLD, 3).seq == 1
    assert track.transfer("send", "pipeline", WORLD, 3).seq == 2
    assert track.transfer("recv", "pipeline", WORLD, 3).seq == 1
    assert track.transfer("send", "pipeline", WORLD, 1).seq == 1
    assert track.seq == 0  # transfers are not collectives
    assert store.data[transfer_key("5", 2, "send", 3)] == b"2"
    assert store.data[transfer_key("5", 2, "recv", 3)] == b"1"


def test_a_rank_that_did_not_arrive_is_named_with_its_last_collective():
    store = FakeStore()
    ops = [("all_reduce", "data")] * 37
    tracks = ranks_at(store, {0: ops, 1: ops, 2: ops[:36], 3: ops})
    entered = Entered("all_reduce", "data", "0", WORLD, 0, 37)
    found = progress.explain(entered, progress.read_keys(store, progress.keys_to_read(entered)))
    assert found.missing == (2,)
    assert found.text == (
        "rank 2 did not arrive at all_reduce #37 on this group (its last collective on this group was "
        "#36 all_reduce on axis 'data'); ranks 1, 3 arrived"
    )
    assert tracks[0].seq == 37


def test_several_late_ranks_and_one_that_never_entered_are_all_named():
    store = FakeStore()
    ops = [("all_reduce", "data"), ("barrier", "world")]
    ranks_at(store, {0: ops, 1: ops[:1], 2: [], 3: ops})
    entered = Entered("barrier", "world", "0", WORLD, 0, 2)
    found = progress.explain(entered, progress.read_keys(store, progress.keys_to_read(entered)))
    assert found.missing == (1, 2)
    assert found.text == (
        "ranks 1, 2 did not arrive at barrier #2 on this group (rank 1's last collective on this group was "
        "#1 all_reduce on axis 'data'; rank 2 has entered none on this group); rank 3 arrived"
    )


def test_a_rank_in_a_different_collective_is_named():
    store = FakeStore()
    ranks_at(store, {0: [("all_reduce", "data")], 1: [("broadcast", "data")], 2: [("all_reduce", "data")]})
    entered = Entered("all_reduce", "data", "0", WORLD[:3], 0, 1)
    found = progress.explain(entered, progress.read_keys(store, progress.keys_to_read(entered)))
    assert found.missing == (1,)
    assert found.text == "rank 1 entered a different collective at #1: broadcast on axis 'data'; rank 2 arrived"


def test_ranks_that_went_on_past_the_collective_arrived_at_it():
    store = FakeStore()
    ops = [("all_gather", "data")] * 5
    ranks_at(store, {0: ops[:3], 1: ops, 2: ops, 3: ops[:3]})  # async ops: others are ahead
    entered = Entered("all_gather", "data", "0", WORLD, 0, 3)
    found = progress.explain(entered, progress.read_keys(store, progress.keys_to_read(entered)))
    assert found.missing == ()
    assert found.text.startswith("every member entered all_gather #3 on this group, so it stalled inside the backend")


def test_a_receive_names_the_peer_that_has_not_sent():
    store = FakeStore()
    sender, receiver = GroupProgress(store, "7", 3), GroupProgress(store, "7", 2)
    sender.enter("all_reduce", "pipeline", WORLD)
    sender.transfer("send", "pipeline", WORLD, 2)
    receiver.transfer("recv", "pipeline", WORLD, 3)
    entered = receiver.transfer("recv", "pipeline", WORLD, 3)  # the second receive: not yet sent
    found = progress.explain(entered, progress.read_keys(store, progress.keys_to_read(entered)))
    assert found.missing == (3,)
    assert found.text == (
        "rank 3 did not arrive: this is recv #2 from rank 3 on this group, and rank 3 has posted 1 send to "
        "rank 2 (its last collective on this group was #1 all_reduce on axis 'pipeline')"
    )
    sender.transfer("send", "pipeline", WORLD, 2)
    found = progress.explain(entered, progress.read_keys(store, progress.keys_to_read(entered)))
    assert found.missing == () and "posted the matching send (#2)" in found.text


def test_a_send_names_the_peer_that_has_not_posted_its_receive():
    store = FakeStore()
    entered = GroupProgress(store, "7", 0).transfer("send", "pipeline", WORLD, 1)
    found = progress.diagnose(entered, store)
    assert found is not None and found.missing == (1,)
    assert "rank 1 has posted 0 receives from rank 0 (it has entered no collective on this group)" in found.text


class SilentStore(FakeStore):
    """A store whose host stopped answering: reads block."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.release.wait()
        return False


def test_a_store_that_does_not_answer_cannot_hang_the_diagnosis():
    store = SilentStore()
    entered = GroupProgress(store, "0", 0).enter("all_reduce", "data", WORLD)
    start = time.monotonic()
    found = progress.diagnose(entered, store, timeout_s=0.2)
    elapsed = time.monotonic() - start
    print(f"diagnosis with a silent store took {elapsed:.2f} s (store timeout 0.2 s)")
    store.release.set()  # let the abandoned reader end
    assert found is not None and found.missing == ()
    assert "could not be read from the store (TimeoutError" in found.text
    assert "a peer rank died, hangs, or skipped this collective" in found.text
    assert elapsed < 30, elapsed  # a liveness bound: the silent store would block forever


class BrokenStore(FakeStore):
    def set(self, key: str, value: str | bytes) -> None:
        raise RuntimeError("Connection reset by peer")

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Connection reset by peer")


def test_a_store_that_is_gone_stops_the_records_but_not_the_collectives():
    track = GroupProgress(BrokenStore(), "0", 1)
    assert track.enter("all_reduce", "data", WORLD).seq == 1  # no error
    assert track.store is None
    assert track.enter("all_reduce", "data", WORLD).seq == 2
    assert progress.diagnose(track.enter("barrier", "data", WORLD), None) is None
    found = progress.diagnose(Entered("barrier", "data", "0", WORLD, 1, 3), BrokenStore())
    assert found is not None and "RuntimeError: Connection reset by peer" in found.text


@pytest.mark.parametrize(
    ("ranks", "text"), [([2], "rank 2"), ([3, 1], "ranks 1, 3"), ([4, 5, 6, 7], "ranks 4-7"), ([0, 1], "ranks 0, 1")]
)
def test_rank_lists_read_as_text(ranks, text):
    assert progress.ranks_text(ranks) == text
