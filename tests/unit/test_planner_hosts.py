"""The planner across nodes: hybrid sharding (``zero.shard="host"``) in the traffic and time
models against the formula of ``tessera.zero.hybrid`` over the chunks the sharded optimizer
would pack, and the link each of its groups (and plain DP's and ZeRO-3's data groups spanning
nodes) is charged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.comm.group import AxisGroup
from tessera.memory.chunks import ChunkStore
from tessera.memory.search import packing_labels
from tessera.models import gpt
from tessera.planner import Cluster, Layout, Link, Workload
from tessera.planner.spec import from_gpt_preset
from tessera.planner.timing import axis_link, predict_time, step_traffic
from tessera.planner.timing.counting import BUCKET_BYTES
from tessera.planner.timing.traffic import shard_ranks
from tessera.zero import hybrid

SIZES = dict(vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)
WORK = Workload(global_batch=4)
HYBRID = Layout(data=4, zero=3, shard="host")
#: 2 nodes x 2 ranks: a fast link inside a node, a slow one between them
CLUSTER = Cluster(devices=4, devices_per_node=2, device_memory=2**34, flops=1e10,
                  intra=Link(1e10, 1e-5), inter=Link(1e7, 1e-4))  # fmt: skip


def chunks_of(model: torch.nn.Module, group: AxisGroup) -> list:
    """The chunks ZeRO would pack ``model``'s parameters into (a chunk per block, the planner's
    chunk size), sharded over ``group``."""
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    labels = packing_labels(model, [n for n, _ in named], [0] * len(named))
    return ChunkStore(named, group, chunk_numel=BUCKET_BYTES // 4, bins=labels).chunks


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_sharding_sends_the_formulas_bytes_between_nodes(stage):
    torch.manual_seed(0)
    model = gpt("tiny", **SIZES)
    host = AxisGroup("data.host", (0, 1), 0, None)  # this rank's host's two data ranks
    chunks = chunks_of(model, host)
    expected = hybrid.inter_host_bytes(chunks, 2, 4)  # one reduction: 2 (H-1)/H (P/G) b
    traffic = step_traffic(from_gpt_preset("tiny", **SIZES), dataclasses.replace(HYBRID, zero=stage), WORK, per_node=2)
    across = traffic["all_reduce", "data.across"]
    assert (across.group, across.calls) == (2, len(chunks))
    assert across.bytes == pytest.approx(float(expected), rel=1e-3)  # the chunks' padding aside
    params = sum(p.numel() for p in model.parameters())
    assert across.bytes == pytest.approx(0.5 * params * 4, rel=1e-3)  # 2 hosts x 2: 0.5 P b
    # inside the node: reduce-scatter once, all-gather once (stages 1, 2) or twice (stage 3)
    gathers = 2 if stage == 3 else 1
    assert traffic["reduce_scatter", "data.host"].bytes == pytest.approx(0.5 * params * 4, rel=1e-3)
    assert traffic["all_gather", "data.host"].bytes == pytest.approx(gathers * 0.5 * params * 4, rel=1e-3)
    assert not [key for key in traffic if key[1] == "data" and key[0] != "all_reduce"]  # only the loss over all
    assert traffic["all_reduce", "data"].bytes == pytest.approx(2 * 3 / 4 * 4)


def test_hybrid_sharding_on_one_node_is_plain_sharding():
    model = from_gpt_preset("tiny", **SIZES)
    plain = step_traffic(model, Layout(data=4, zero=3), WORK)
    assert step_traffic(model, HYBRID, WORK) == plain  # nodes unknown
    assert step_traffic(model, HYBRID, WORK, per_node=4) == plain
    assert shard_ranks(HYBRID, 2) == 2 and shard_ranks(HYBRID, 4) == 4
    assert shard_ranks(Layout(data=2, tensor=2, zero=3, shard="host"), 2) == 1


def test_groups_spanning_nodes_are_charged_the_link_between_them():
    calibrated = dataclasses.replace(
        CLUSTER, axis_links={"all_reduce:2": Link(5e9, 2e-5), "all_gather:4": Link(4e9, 0)}
    )
    for cluster in (CLUSTER, calibrated):  # a measured one-node link never stands for the link between nodes
        for layout in (Layout(data=4), Layout(data=4, zero=3)):
            assert axis_link(cluster, layout, "data", "all_gather", 4) == cluster.inter
        assert axis_link(cluster, HYBRID, "data.across", "all_reduce", 2) == cluster.inter
        assert axis_link(cluster, Layout(data=2, tensor=2), "tensor", "all_reduce", 2) != cluster.inter
    assert axis_link(CLUSTER, HYBRID, "data.host", "reduce_scatter", 2) == CLUSTER.intra
    assert axis_link(calibrated, HYBRID, "data.host", "all_reduce", 2) == Link(5e9, 2e-5)
    one_node = dataclasses.replace(calibrated, devices_per_node=4)
    assert axis_link(one_node, Layout(data=4), "data", "all_gather", 4) == Link(4e9, 0)


def test_over_a_slow_link_hybrid_sharding_is_predicted_faster_than_zero3_and_dp():
    model, work = from_gpt_preset("small"), Workload(global_batch=8)
    step = {
        name: predict_time(model, layout, work, CLUSTER)
        for name, layout in (("dp", Layout(data=4, micro_batch=2)), ("z3", Layout(data=4, zero=3, micro_batch=2)),
                             ("hybrid", dataclasses.replace(HYBRID, micro_batch=2)))
    }  # fmt: skip
    assert step["hybrid"].step < step["dp"].step < step["z3"].step
    assert step["hybrid"].comm["data"] < step["dp"].comm["data"] / 2
    assert step["hybrid"].optimizer == pytest.approx(2 * step["z3"].optimizer)  # shards over 2, not 4
    fast = dataclasses.replace(CLUSTER, inter=CLUSTER.intra)
    assert predict_time(model, HYBRID, work, fast).step < predict_time(model, HYBRID, work, CLUSTER).step


def test_a_hybrid_layout_names_itself_and_writes_its_config():
    assert HYBRID.name() == "dp4 z3(host) mb1"
    assert HYBRID.to_config()["zero"] == {"stage": 3, "offload_optimizer": "none", "shard": "host"}
    assert Layout(data=4, shard="host").problems()  # nothing to shard: the layout rules refuse it
    assert not HYBRID.problems()
