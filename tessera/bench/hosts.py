"""``tessera bench hosts``: data parallelism, ZeRO-3 and hybrid sharding across two hosts over a
rate-limited link, measured against the planner's prediction of each.

Two hosts made of Linux network namespaces (:class:`tessera.testing.hosts.Hosts`; root needed),
each host's link to the other limited by ``tc`` to :data:`RATE`, loopback inside a host
unlimited. One job of 2 hosts x 2 ranks (``tessera run`` on each host, static rendezvous) trains
the same GPT under dp4, ZeRO-3 dp4 and ZeRO-3 dp4 with ``zero.shard="host"`` one after another
(:mod:`tessera.bench.hosts_rank`): per layout the median step time (slowest rank), the ledger's
bytes per step on groups spanning hosts, and what each host's link sent. Beside each, the
planner's step time for the layout on ``Cluster(devices=4, devices_per_node=2)`` whose compute
and links inside a host are this machine's calibration (:mod:`tessera.planner.calibrate`, 4 ranks
on loopback) and whose link between hosts is the ``tc`` rate, with the latency of a small
all-reduce measured across the hosts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from tessera.bench.report import Row, print_rows, write_rows
from tessera.planner.layout import Layout

RATE = "100mbit"
PRESET = "small"  # 4.9M parameters: its gradients take seconds over the limited link
SEQ = 128
MICRO_BATCH = 2
OVERRIDES: dict[str, Any] = {}  # GPT config fields over the preset's
WARMUP, TIMED = 1, 5
CALIBRATE = True  # the planner's compute and links inside a host from this machine
#: (label, layout): the anchor first
LAYOUTS: list[tuple[str, Layout]] = [
    ("dp4", Layout(data=4, micro_batch=MICRO_BATCH)),
    ("zero3 dp4", Layout(data=4, zero=3, micro_batch=MICRO_BATCH)),
    ("zero3 dp4 shard=host", Layout(data=4, zero=3, shard="host", micro_batch=MICRO_BATCH)),
]
HOSTS, PER_HOST = 2, 2
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def rate_bytes(rate: str) -> float:
    """A ``tc`` rate (``100mbit``, ``1gbit``, ``500kbit``) in bytes per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if match is None:
        raise ValueError(f"rate {rate!r}: give bits per second as tc does, e.g. 100mbit")
    return float(match.group(1)) * _UNITS[match.group(2)] / 8


def run_job(settings: dict[str, Any], rate: str, timeout: float = 900) -> dict[str, Any]:
    """The job on two namespace hosts with their link limited to ``rate``: the rank script's
    results (rank 0's JSON)."""
    import tessera
    from tessera.testing import hosts as nshosts

    root = Path(tessera.__file__).resolve().parents[1]
    script = Path(__file__).with_name("hosts_rank.py")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    with tempfile.TemporaryDirectory(prefix="tessera-bench-hosts-") as tmp, nshosts.Hosts(HOSTS, rate=rate) as hosts:
        out = Path(tmp) / "results.json"
        procs = []
        for k in range(HOSTS):
            argv = nshosts.torchrun_argv(
                [str(script), str(out), json.dumps(settings)], nnodes=HOSTS, nproc_per_node=PER_HOST, node_rank=k,
                master=hosts.hostnames[0], extra=["--no-dry-run", "--run-dir", str(Path(tmp) / f"host{k}")],
            )  # fmt: skip
            procs.append(hosts.popen(k, argv, env=env, cwd=tmp))
        outputs = nshosts.Hosts.wait(procs, timeout)
        for o in outputs:
            if o.returncode != 0:
                raise RuntimeError(f"host {o.host} exited {o.returncode}:\n{o.stdout[-4000:]}\n{o.stderr[-4000:]}")
        return dict(json.loads(out.read_text()))


def cluster_of(rate: str, latency: float, calibrate: bool) -> tuple[Any, str]:
    """The planner's 2 nodes x 2 devices: compute and links inside a node from calibrating 4 ranks
    of this machine (or nominal figures without), between nodes ``rate`` and ``latency``."""
    from tessera.planner.spec import Cluster, Link

    inter = Link(bandwidth=rate_bytes(rate), latency=latency)
    devices = HOSTS * PER_HOST
    if not calibrate:
        cluster = Cluster(devices=devices, device_memory=2**32, flops=5e9, intra=Link(1e9, 1e-4), inter=inter,
                          devices_per_node=PER_HOST, ranks_per_core=2.0)  # fmt: skip
        return cluster, "nominal (not calibrated): 5 GFLOP/s, 1 GB/s and 100 us inside a host"
    from tessera.bench.calibrate import calibrate as measure
    from tessera.planner.calibrate import calibrated_cluster, describe

    calibration = measure(devices)
    cluster = dataclasses.replace(calibrated_cluster(calibration), devices_per_node=PER_HOST, inter=inter)
    return cluster, describe(calibration)


def predictions(layouts: list[Layout], settings: dict[str, Any], cluster: Any) -> list[float]:
    """The planner's step time of each layout for the settings' model and batch on ``cluster``."""
    from tessera.planner import Workload
    from tessera.planner.spec import from_gpt_preset
    from tessera.planner.timing import predict_time

    model = from_gpt_preset(settings["preset"], seq_len=settings["seq"], max_seq_len=settings["seq"],
                            **settings["overrides"])  # fmt: skip
    return [predict_time(model, layout, Workload(global_batch=layout.global_batch), cluster).step for layout in layouts]


def rows_of(labels: list[str], measured: list[dict[str, Any]], predicted: list[float], rate: str) -> list[Row]:
    """Step time and bytes across hosts of each layout against the first (dp4), and the planner's
    prediction against the measured step time."""
    anchor = measured[0]
    out = []
    for label, m, p in zip(labels, measured, predicted, strict=True):
        name = f"{label} 2x2 {rate}"
        out.append(Row(name, "step_time_s", m["step_s"], labels[0], anchor["step_s"]))
        out.append(Row(name, "inter_host_bytes", m["inter_host_bytes"], labels[0], anchor["inter_host_bytes"]))
        wire, anchor_wire = max(m["wire_bytes_per_host"]), max(anchor["wire_bytes_per_host"])
        out.append(Row(name, "wire_bytes", wire, labels[0], anchor_wire if anchor_wire else 1.0))
        out.append(Row(name, "predicted_step_s", p, "measured", m["step_s"]))
    return out


def run(
    rate: str = RATE,
    preset: str = PRESET,
    seq: int = SEQ,
    overrides: dict[str, Any] | None = None,
    warmup: int = WARMUP,
    timed: int = TIMED,
    calibrate: bool = True,
    report: dict[str, Any] | None = None,
) -> list[Row]:
    """Measure :data:`LAYOUTS` across two hosts limited to ``rate`` and predict each; ``report``
    (when given) receives the job's results, the cluster and the predictions."""
    labels = [label for label, _ in LAYOUTS]
    layouts = [layout for _, layout in LAYOUTS]
    settings = {"preset": preset, "seq": seq, "overrides": overrides or {}, "warmup": warmup, "timed": timed,
                "layouts": [dataclasses.asdict(layout) for layout in layouts]}  # fmt: skip
    # calibration first, on a quiet machine; the link between hosts is measured in the job
    cluster, described = cluster_of(rate, 0.0, calibrate)
    results = run_job(settings, rate)
    cluster = dataclasses.replace(cluster, inter=dataclasses.replace(cluster.inter, latency=results["latency_s"]))
    predicted = predictions(layouts, settings, cluster)
    if report is not None:
        report.update(results=results, cluster=described, predicted=predicted, settings=settings,
                      inter_link={"bandwidth": cluster.inter.bandwidth, "latency": cluster.inter.latency})  # fmt: skip
    return rows_of(labels, results["layouts"], predicted, rate)


def main(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {}
    rows = run(RATE, PRESET, SEQ, OVERRIDES, WARMUP, TIMED, CALIBRATE, report)
    print(f"link between hosts: {RATE} ({rate_bytes(RATE) / 1e6:.1f} MB/s) each way, "
          f"all-reduce latency across hosts {report['inter_link']['latency'] * 1e3:.2f} ms", file=sys.stderr)  # fmt: skip
    print(report["cluster"], file=sys.stderr)
    print_rows(rows)
    if args.out:
        write_rows(rows, args.out)
        details = Path(args.out).with_suffix(".details.json")
        details.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0
