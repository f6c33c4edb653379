"""Calibration on 4 ranks with tiny sizes (a few seconds): every figure is positive, each sample's
bytes are the ledger's for its collective, the fitted links reproduce the measured times, and the
calibrated cluster gives the planner those links. No timing is asserted otherwise: the machine is
shared."""

from __future__ import annotations

import pytest

from tessera.bench.calibrate import calibrate, cpu_cores
from tessera.planner import Layout, Workload
from tessera.planner.calibrate import OPS, calibrated_cluster, describe, fit_link
from tessera.planner.spec import from_gpt_preset
from tessera.planner.timing import axis_link, predict_time, ranks_per_core

MESSAGES = (1024, 8192, 65536)


@pytest.fixture(scope="module")
def calibration(pools):
    return calibrate(4, pool=pools.get(4), message_bytes=MESSAGES, matmul=(64, 64, 64), block=(32, 4, 16, 2),
                     seconds=0.05, repeats=2)  # fmt: skip


def test_every_figure_is_positive(calibration):
    assert calibration.world_size == 4
    for value in (calibration.flops, calibration.matmul_flops, calibration.optimizer_rate, calibration.copy_rate):
        assert value > 0
    assert set(calibration.links) == {f"{op}:{g}" for op in OPS for g in (2, 4)}
    for link in calibration.links.values():
        assert link.bandwidth > 0 and link.latency >= 0
    assert calibration.block_overhead >= 0
    assert set(calibration.recompute_cost) == {"full", "selective"}
    assert all(cost >= 1.0 for cost in calibration.recompute_cost.values())  # a recompute never saves time
    assert "all_reduce:4" in describe(calibration)


def test_samples_count_the_ledgers_bytes(calibration):
    """Each message is a float32 tensor of its size (a multiple of 2 x group elements): per call
    the ledger counts 2 (g-1)/g of it for an all-reduce, (g-1)/g for the other collectives, and
    half of it for a send or a receive (p2p exchanges the halves)."""
    for op in OPS:
        for g in (2, 4):
            factor = {"all_reduce": 2 * (g - 1) / g, "p2p": 0.5}.get(op, (g - 1) / g)
            expected = {factor * 4 * (m // 4 // (2 * g) * (2 * g)) for m in MESSAGES}
            got = [s for s in calibration.samples if (s.op, s.group) == (op, g)]
            assert sorted(s.bytes / s.calls for s in got) == pytest.approx(sorted(expected)), (op, g)
            assert all(s.seconds > 0 for s in got)


def test_the_fitted_links_reproduce_the_measured_times(calibration):
    measured = sum(s.seconds / s.calls for s in calibration.samples)
    fitted = sum(calibration.predict(s) / s.calls for s in calibration.samples)
    assert fitted == pytest.approx(measured, rel=0.5)
    for op in OPS:  # a least-squares line keeps each collective's mean time per call
        mine = [s for s in calibration.samples if s.op == op and s.group == 4]
        link = fit_link(mine)
        if link.latency > 0 and link.bandwidth < 1e15:
            mean = sum(s.seconds / s.calls for s in mine) / len(mine)
            assert sum(link.time(s.bytes / s.calls) for s in mine) / len(mine) == pytest.approx(mean, rel=1e-6)


def test_the_calibrated_cluster_carries_the_links_to_the_planner(calibration):
    cluster = calibrated_cluster(calibration, device_memory=2**30)
    assert (cluster.devices, cluster.devices_per_node, cluster.device_memory) == (4, 4, 2**30)
    assert cluster.flops == calibration.flops and cluster.optimizer_rate == calibration.optimizer_rate
    assert ranks_per_core(cluster) == calibration.ranks_per_core == max(1.0, 4 / cpu_cores())
    assert cluster.block_overhead == calibration.block_overhead
    assert cluster.recompute_cost == calibration.recompute_cost
    assert axis_link(cluster, Layout(data=4), "data", "all_reduce", 4) == calibration.links["all_reduce:4"]
    assert axis_link(cluster, Layout(tensor=2, data=2), "tensor", "all_reduce", 2) == calibration.links["all_reduce:2"]
    model = from_gpt_preset("tiny")
    t = predict_time(model, Layout(data=2, tensor=2, micro_batch=2), Workload(global_batch=4), cluster)
    assert t.step > 0 and t.comm["tensor"] > 0 and t.comm["data"] > 0
