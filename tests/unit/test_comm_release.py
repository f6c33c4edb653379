"""The release of process groups at shutdown (tessera.comm.group), in one process: closed
AxisGroups refuse collectives, holders are told to let go."""

from __future__ import annotations

import pytest
import torch

from tessera import comm
from tessera.errors import CommError


def test_release_detaches_axis_groups_and_tells_holders():
    released: list[object] = []

    class Holder:
        pass

    owner = Holder()
    comm.hold_process_group(owner, released.append)
    fake_pg = object()  # stands for a ProcessGroup: releasing only looks at identity
    group = comm.AxisGroup("data", (0, 1), 0, fake_pg)  # type: ignore[arg-type]
    assert not group.closed
    assert fake_pg in comm.release_process_groups()
    assert group.closed and group.pg is None and released == [owner]
    assert comm.release_process_groups() == []  # nothing left attached
    with pytest.raises(CommError, match="was closed by tessera.shutdown"):
        comm.all_reduce(torch.ones(1), group)


def test_a_single_rank_group_is_never_closed():
    assert not comm.single_rank_group("tensor").closed
