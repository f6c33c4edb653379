"""The ranks of ``tessera bench hosts``: one job started by ``tessera run`` on each namespace host
(2 hosts x 2 ranks). It trains the same GPT under each layout of the settings one after another
(``use_layout`` switches the layout inside the job), and per layout reports the median step time
(each step timed between barriers, its slowest rank's time), the comm ledger's logical bytes per
step on this rank by (op, axis) and whether each axis's group spans hosts, and the bytes each
host's ``eth0`` sent per step (the wire: what crossed to the other host, headers included).

Usage (on each host): ``tessera run --nnodes 2 ... hosts_rank.py OUT SETTINGS_JSON``; rank 0
writes the results as JSON to ``OUT``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# this process's network namespace's interfaces: /proc/net is per namespace, where /sys/class/net
# shows the namespace that mounted /sys (the machine's, for a host entered with nsenter --net)
NET_DEV = Path("/proc/net/dev")
LINK = "eth0"  # a namespace host's link to the others


def wire_bytes() -> int:
    """Bytes this host has sent on its link to the other hosts (0 where there is none)."""
    try:
        lines = NET_DEV.read_text().splitlines()
    except OSError:
        return 0
    for line in lines[2:]:  # two header lines, then "  name: rx_bytes packets ... tx_bytes ..."
        name, _, counters = line.partition(":")
        if name.strip() == LINK:
            return int(counters.split()[8])  # the 9th counter: bytes transmitted
    return 0


def spans_hosts(ctx: Any, axis: str) -> bool | None:
    """Whether this rank's group of ``axis`` (a ledger axis name) has ranks on several hosts; None
    for a group the context does not name."""
    if axis.endswith((".host", ".across")):
        split = ctx.host_split(ctx.replicas_axis)
        group = split.inside if axis.endswith(".host") else split.across
    else:
        try:
            group = ctx.group(axis)
        except KeyError:
            return None
    return len({ctx.hosts[r] for r in group.ranks}) > 1


def _latency(world: Any, calls: int = 20) -> float:
    """Median seconds of a 4-byte all-reduce over the whole job (across hosts)."""
    from tessera import comm

    t = torch.zeros(1)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        comm.all_reduce(t, world)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(layout_fields: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """Train ``layout`` for the settings' warm-up and timed steps on every rank of the job; the
    step times (slowest rank), this rank's ledger per step, and this host's wire bytes per step."""
    import tessera
    from tessera import comm
    from tessera.bench.plan import use_planned_layout
    from tessera.models import NextTokenLoss, gpt
    from tessera.models.gpt import PRESETS
    from tessera.planner.layout import Layout

    layout = Layout(**layout_fields)
    ctx = use_planned_layout(layout)
    world = ctx.group("world")
    torch.manual_seed(0)
    model = gpt(settings["preset"], max_seq_len=settings["seq"], **settings["overrides"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
    g = torch.Generator().manual_seed(1 + ctx.group("data").rank)
    vocab = settings["overrides"].get("vocab_size", PRESETS[settings["preset"]].vocab_size)

    def batches() -> Any:
        while True:
            tokens = torch.randint(0, vocab, (layout.micro_batch, settings["seq"] + 1), generator=g)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    it = batches()
    for _ in range(settings["warmup"]):
        engine.train_batch(it)
    times, ledgers, wire = [], [], 0
    for _ in range(settings["timed"]):
        comm.barrier(world)
        sent = wire_bytes()
        start = time.perf_counter()
        with comm.ledger() as led:
            engine.train_batch(it)
        elapsed = torch.tensor([time.perf_counter() - start])
        wire += wire_bytes() - sent
        comm.all_reduce(elapsed, world, op="max")
        times.append(float(elapsed))
        ledgers.append(led.summary())
    steps = settings["timed"]
    per_step: dict[str, dict[str, Any]] = {}
    for summary in ledgers:
        for (op, axis), entry in summary.items():
            row = per_step.setdefault(f"{op}@{axis}", {"op": op, "axis": axis, "bytes": 0.0, "calls": 0.0})
            row["bytes"] += float(entry["bytes"]) / steps
            row["calls"] += entry["calls"] / steps
    for row in per_step.values():
        row["spans_hosts"] = spans_hosts(ctx, row["axis"])
    engine.close()
    return {
        "layout": layout.name(),
        "step_s": statistics.median(times),
        "times": times,
        "ledger": per_step,
        "inter_host_bytes": sum(r["bytes"] for r in per_step.values() if r["spans_hosts"]),
        "wire_bytes": wire / steps,
    }


def main(out: str, settings_json: str) -> None:
    import torch.distributed as dist

    import tessera
    from tessera import comm

    settings = json.loads(settings_json)
    torch.set_num_threads(1)
    ctx = tessera.launch_from_torch()
    world = ctx.group("world")
    results: dict[str, Any] = {"hosts": list(ctx.hosts), "latency_s": _latency(world), "layouts": []}
    for fields in settings["layouts"]:
        mine = measure(fields, settings)
        every = comm.all_gather_object(mine, world)
        # the wire: each host's link, read by every rank of it: count each host once
        by_host: dict[int, float] = {}
        for rank, result in enumerate(every):
            by_host.setdefault(ctx.hosts[rank], result["wire_bytes"])
        mine["wire_bytes_per_host"] = [by_host[h] for h in sorted(by_host)]
        mine["inter_host_bytes_per_rank"] = [r["inter_host_bytes"] for r in every]
        results["layouts"].append(mine)
    comm.barrier(world)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
    tessera.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
