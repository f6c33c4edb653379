"""Where groups fall on hosts: with 2 hosts x 4 ranks (consecutive ranks a host, as launchers give
them), the default placement keeps every tensor, sequence and expert group inside one host and
lets data (then pipeline) span hosts; a layout whose tensor groups must cross hosts is warned
about once, naming the axis."""

from __future__ import annotations

import warnings

import pytest

from tessera.config import load_config, parallel_dims
from tessera.context import hosts
from tessera.context.dims import group_table
from tessera.errors import ConfigError

TWO_HOSTS = (0, 0, 0, 0, 1, 1, 1, 1)  # 2 hosts x 4 ranks


def dims_of(parallel: dict):
    return parallel_dims(load_config({"parallel": parallel}), 8)


FITTING = {
    "tp4-dp2": dict(data=2, tensor=dict(size=4)),
    "tp2d-tp4-dp2": dict(data=2, tensor=dict(size=4, mode="2d")),
    "tp2-sp2-dp2": dict(data=2, tensor=dict(size=2), sequence=dict(size=2)),
    "tp2-pp2-dp2": dict(data=2, pipeline=dict(size=2), tensor=dict(size=2)),
    "sp4-dp2": dict(data=2, sequence=dict(size=4)),
    "ep4-dp8": dict(data=8, expert=4),
    "tp2-pp4": dict(pipeline=dict(size=4), tensor=dict(size=2)),
    "dp8": dict(data=8),
}


@pytest.mark.parametrize("name", FITTING)
def test_default_placement_keeps_chatty_groups_inside_a_host(name):
    dims = dims_of(FITTING[name])
    assert hosts.crossing(dims, range(8), TWO_HOSTS) == {}
    for axis in ("tensor", "sequence"):
        for group in group_table(dims, axis):
            assert len({TWO_HOSTS[r] for r in group}) == 1, (name, axis, group)
    spanning = [a for a in ("data", "pipeline") if dims.axis_size(a) > 1]
    # the outer axes carry the job across the two hosts: some group of theirs reaches both
    assert any(len({TWO_HOSTS[r] for r in g}) == 2 for a in spanning for g in group_table(dims, a)), name


def test_data_spans_hosts_before_pipeline():
    dims = dims_of(dict(data=2, pipeline=2, tensor=dict(size=2)))
    assert group_table(dims, "data") == [(0, 4), (1, 5), (2, 6), (3, 7)]  # across the hosts
    assert group_table(dims, "pipeline") == [(0, 2), (1, 3), (4, 6), (5, 7)]  # inside each host


def test_a_tensor_group_across_hosts_is_warned_once_naming_the_axis():
    dims = dims_of(dict(tensor=dict(size=8)))
    assert hosts.crossing(dims, range(8), TWO_HOSTS) == {"tensor": [tuple(range(8))]}
    hosts._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hosts.warn_crossing(dims, range(8), TWO_HOSTS)
        hosts.warn_crossing(dims, range(8), TWO_HOSTS)  # the same layout again: no second warning
    assert len(caught) == 1 and caught[0].category is hosts.HostCrossingWarning
    message = str(caught[0].message)
    assert "parallel.tensor: 1 group(s) span hosts (e.g. ranks 0 on host 0, 1 on host 0" in message
    assert "keep tensor x sequence (and expert) within 4" in message
    # one host, or hosts unknown (outside tessera.launch): nothing to say
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        hosts._warned.clear()
        hosts.warn_crossing(dims, range(8), (0,) * 8)
    assert quiet == []


def test_hosts_are_numbered_in_the_order_of_their_first_rank():
    assert hosts.host_indices(["b", "b", "a", "a", "c"]) == (0, 0, 1, 1, 2)
    # a context over part of the job numbers its own hosts from its first rank
    assert hosts.host_indices([1, 1, 0]) == (0, 0, 1)


def test_a_sequence_group_across_hosts_is_named_too():
    dims = dims_of(dict(data=1, sequence=dict(size=8)))
    assert set(hosts.crossing(dims, range(8), TWO_HOSTS)) == {"sequence"}
    # interleaved hosts (a cyclic placement): even a 2-rank tensor group crosses
    dims = dims_of(dict(data=4, tensor=dict(size=2)))
    assert set(hosts.crossing(dims, range(8), (0, 1) * 4)) == {"tensor"}


# ---- hybrid sharding's groups (zero.shard="host") ------------------------------------------------


def test_data_groups_split_by_host_into_shard_groups_and_their_replicas():
    host = TWO_HOSTS.__getitem__
    # dp8 over 2 hosts x 4: each host's 4 data ranks shard; ranks at the same place on both hosts all-reduce
    inside, across = hosts.split_by_host([tuple(range(8))], host, "zero.shard='host'")
    assert inside == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert across == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # tp2 x dp4: the data groups (0, 2, 4, 6) and (1, 3, 5, 7) each split in two
    dims = dims_of(dict(data=4, tensor=dict(size=2)))
    inside, across = hosts.split_by_host(group_table(dims, "data"), host, "zero.shard='host'")
    assert inside == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert across == [(0, 4), (2, 6), (1, 5), (3, 7)]
    # one host: the data groups themselves, and nothing across
    inside, across = hosts.split_by_host([tuple(range(8))], lambda r: 0, "zero.shard='host'")
    assert inside == [tuple(range(8))] and across == [(r,) for r in range(8)]


@pytest.mark.parametrize(
    "host_of,words",
    [
        (
            (0, 0, 0, 1, 1, 1, 1, 1),
            "spread unevenly over hosts (host 0: ranks [0, 1, 2], host 1: ranks [3, 4, 5, 6, 7])",
        ),
        (
            (0, 1, 2, 3, 4, 5, 6, 7),
            "each host holds one rank of every data group, so sharding inside a host shards nothing",
        ),
    ],
)
def test_data_ranks_spread_unevenly_or_one_a_host_are_refused(host_of, words):
    with pytest.raises(ConfigError, match="zero.shard='host'") as caught:
        hosts.split_by_host([tuple(range(8))], host_of.__getitem__, "zero.shard='host'")
    assert words in str(caught.value)


def test_a_global_batch_decides_the_micro_batches_of_each_world():
    from tessera.config import load_config, resolve_batch
    from tessera.errors import ConfigError

    cfg = load_config({"data": {"micro_batch_size": 4, "global_batch_size": 16}})
    assert resolve_batch(cfg, 4).gradient_accumulation == 1
    assert resolve_batch(cfg, 2).gradient_accumulation == 2  # an elastic job on half the ranks
    assert resolve_batch(cfg, 1).gradient_accumulation == 4
    with pytest.raises(ConfigError, match="not a whole number of micro-batches"):
        resolve_batch(cfg, 3)
    with pytest.raises(ConfigError, match="gradient_accumulation=3 names another number"):
        resolve_batch(
            load_config({"data": {"micro_batch_size": 4, "global_batch_size": 16}, "gradient_accumulation": 3}), 2
        )
    piped = load_config(
        {"data": {"micro_batch_size": 2, "global_batch_size": 16}, "parallel": {"pipeline": {"size": 2}}}
    )
    assert resolve_batch(piped, 2).parallel.pipeline.microbatches == 4
    unset = load_config({})
    assert resolve_batch(unset, 2) is unset
