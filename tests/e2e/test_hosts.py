"""Jobs across hosts: two hosts made of network namespaces (``tessera.testing.hosts``), each with
its own address and hostname, 2 ranks on each, started as on two machines by ``tessera run`` /
``tessera train`` on each host, under torchrun's static rendezvous and its c10d one. Every layout
trains to the single-process answer (losses and weights, fp32 1e-5 relative), and ``tessera train``
across the hosts to the losses of the same 4 ranks on one host."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tessera.testing import hosts as nshosts
from tessera.testing.pool import free_port
from tests.e2e.test_cli import run, tessera_cmd

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "hosts_layouts.py"
ELASTIC = ROOT / "tests" / "e2e" / "scripts" / "elastic_train.py"
LAYOUTS = ("dp4", "tp2-dp2", "pp2-tp2", "zero3-dp4", "sp2-ring-dp2")
TIMEOUT = 300


@pytest.fixture(scope="module")
def hosts():
    # a machine that cannot make namespace hosts fails here, saying why (HostsUnavailable): never skipped
    with nshosts.Hosts(2) as made:
        yield made


@pytest.fixture(scope="module")
def jobs(hosts, tmp_path_factory):
    """The module's three jobs, started side by side on the two hosts (each on a port of its own;
    much of each is waiting: rendezvous, a lost host's detection): each test waits for its own."""
    root = tmp_path_factory.mktemp("hosts")
    met = threading.Event()
    with ThreadPoolExecutor(max_workers=3) as pool:
        elastic = pool.submit(elastic_job, hosts, root / "elastic", met)
        # the others start once the elastic job's hosts have met: its rendezvous takes whichever
        # hosts arrive within 5 s of the first, and a loaded machine could make the second late
        met.wait(TIMEOUT)
        yield {
            "layouts": pool.submit(layouts_job, hosts, root / "layouts"),
            "train": pool.submit(train_job, hosts, root / "train"),
            "elastic": elastic,
        }


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def job(hosts: nshosts.Hosts, script: list[str], rendezvous: str, port: int, run_dir: Path, **kw) -> list:
    """Start ``script`` on both hosts (2 ranks each) under ``rendezvous``: the processes, by host."""
    procs = []
    for k in range(hosts.count):
        argv = nshosts.torchrun_argv(script, nnodes=hosts.count, nproc_per_node=2, node_rank=k,
                                     master=hosts.hostnames[0], port=port, rendezvous=rendezvous,
                                     run_id=f"job-{port}", extra=["--run-dir", str(run_dir / f"host{k}"), *kw.get(
                                         "extra", ())])  # fmt: skip
        procs.append(hosts.popen(k, argv, env=env(), cwd=ROOT))
    return procs


def checked(outputs: list[nshosts.HostOutput]) -> None:
    for out in outputs:
        assert out.returncode == 0, f"host {out.host} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"


def drift(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def layouts_job(hosts: nshosts.Hosts, tmp_path: Path) -> dict[str, Path]:
    # the two rendezvous side by side, each its own job on its own port
    tmp_path.mkdir(parents=True)
    outs = {kind: tmp_path / f"{kind}.pt" for kind in ("static", "c10d")}
    procs = {kind: job(hosts, [str(SCRIPT), str(out), *LAYOUTS], kind, free_port(), tmp_path / kind,
                       extra=["--no-dry-run"]) for kind, out in outs.items()}  # fmt: skip
    for kind in procs:
        checked(nshosts.Hosts.wait(procs[kind], TIMEOUT))
    return outs


def test_layouts_across_two_hosts_equal_single_process(jobs):
    for kind, out in jobs["layouts"].result().items():
        results = torch.load(out)
        # the ranks of a host are neighbours: 0-1 on one host, 2-3 on the other
        assert results["hosts"][0] == results["hosts"][1] != results["hosts"][2] == results["hosts"][3], results[
            "hosts"
        ]
        if kind == "static":
            assert results["hosts"] == ["host0", "host0", "host1", "host1"]
        single = results["single"]
        for name in LAYOUTS:
            got = results[name]
            torch.testing.assert_close(got["losses"], single["losses"], rtol=1e-5, atol=0, msg=f"{kind} {name}")
            for key, want in single["weights"].items():
                assert drift(got["weights"][key], want) <= 1e-5, (kind, name, key, drift(got["weights"][key], want))


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["loss"] for row in rows if "loss" in row]


def train_job(hosts: nshosts.Hosts, tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True)
    settings = ["--set", "trainer.steps=6", "--set", "trainer.eval_every=null", "--set", "trainer.log_every=3"]
    port = free_port()
    across = tmp_path / "across"
    procs = []
    for k in range(hosts.count):
        argv = [sys.executable, "-m", "tessera.cli", "train", "--nproc-per-node", "2", "--nnodes", "2",
                "--node-rank", str(k), "--master-addr", hosts.hostnames[0], "--master-port", str(port),
                "--output-dir", str(across), *settings]  # fmt: skip
        procs.append(hosts.popen(k, argv, env=env(), cwd=tmp_path))
    one = run([*tessera_cmd(), "train", "--nproc-per-node", "4", "--output-dir", str(tmp_path / "one"), *settings],
              timeout=TIMEOUT)  # fmt: skip
    checked(nshosts.Hosts.wait(procs, TIMEOUT))
    assert one.returncode == 0, one.stdout + one.stderr
    return tmp_path


def test_tessera_train_across_two_hosts_matches_one_host(jobs):
    tmp_path = jobs["train"].result()
    across = tmp_path / "across"
    expected = _losses(tmp_path / "one")
    assert len(expected) == 6
    torch.testing.assert_close(_losses(across), expected, rtol=1e-5, atol=0)


def test_train_across_hosts_needs_its_rendezvous_and_one_run_folder(tmp_path):
    out = run([*tessera_cmd(), "train", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "0",
               "--master-addr", "h", "--master-port", "1"], timeout=60)  # fmt: skip
    assert out.returncode != 0 and "needs --output-dir" in out.stderr
    out = run([*tessera_cmd(), "train", "--node-rank", "0", "--master-addr", "h"], timeout=60)
    assert out.returncode != 0 and "needs --nnodes" in out.stderr
    out = run([*tessera_cmd(), "train", "--nnodes", "2", "--node-rank", "0", "--rdzv-backend", "c10d"], timeout=60)
    assert out.returncode != 0 and "not both" in out.stderr


def elastic_job(hosts: nshosts.Hosts, tmp_path: Path, met: threading.Event) -> tuple[Path, list[nshosts.HostOutput]]:
    try:
        return _elastic_job(hosts, tmp_path, met)
    finally:
        met.set()  # also when the job failed before the hosts met: the other jobs start anyway


def _elastic_job(hosts: nshosts.Hosts, tmp_path: Path, met: threading.Event) -> tuple[Path, list[nshosts.HostOutput]]:
    tmp_path.mkdir(parents=True)
    port, elastic = free_port(), tmp_path / "elastic"
    procs = []
    for k in range(hosts.count):
        argv = nshosts.torchrun_argv(
            [str(ELASTIC), str(elastic), "20", hosts.hostnames[1], "12"], nnodes="1:2", nproc_per_node=2,
            node_rank=None, master=hosts.hostnames[0], port=port, rendezvous="c10d", run_id=f"elastic-{port}",
            extra=["--max-restarts", "1", "--rdzv-conf", "last_call_timeout=5", "--no-dry-run",
                   "--run-dir", str(tmp_path / f"logs{k}")],
        )  # fmt: skip
        procs.append(hosts.popen(k, argv, env=env(), cwd=ROOT))
    # the reference: 10 steps on 4 ranks on one host, saved; 10 more on 2 ranks from that
    # checkpoint. It runs beside the job once the hosts have met (so that it cannot delay the
    # first round's rendezvous); the results are bitwise whatever the timing.
    deadline = time.monotonic() + TIMEOUT
    while not (elastic / "attempt-0.json").exists() and all(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, "the hosts never met"
        time.sleep(0.2)
    met.set()
    reference = tmp_path / "reference"
    for ranks, steps in ((4, 10), (2, 20)):
        out = run([*tessera_cmd(), "run", "--nproc-per-node", str(ranks), "--no-dry-run", str(ELASTIC), str(reference),
                   str(steps)], env={"PYTHONPATH": str(ROOT)}, timeout=TIMEOUT)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
    return tmp_path, nshosts.Hosts.wait(procs, TIMEOUT)


def test_a_lost_host_leaves_the_other_to_finish_from_the_last_checkpoint_on_fewer_ranks(jobs):
    """`tessera run --nnodes 1:2 --max-restarts 1` on two hosts; at step 12 host 1 is lost (its
    agent and ranks SIGKILLed); host 0's agent restarts its ranks alone, they load step 10's
    checkpoint into a world of 2 (ZeRO-1 resharded, the global batch kept by accumulating 2
    micro-batches) and finish 20 steps: the weights of 10 steps on 4 ranks, saved, then 10 on 2."""
    tmp_path, (survivor, lost) = jobs["elastic"].result()
    elastic, reference = tmp_path / "elastic", tmp_path / "reference"
    assert survivor.returncode == 0, survivor.stdout + survivor.stderr
    assert lost.returncode == -9 and "SIGKILLed at step 12" in lost.stderr, lost.stderr
    first, second = (json.loads((elastic / f"attempt-{n}.json").read_text()) for n in (0, 1))
    assert (first["world_size"], second["world_size"]) == (4, 2), "the hosts met in the first round, one in the second"
    finished = json.loads((elastic / "finished.json").read_text())
    assert (finished["first_step"], finished["last_step"], finished["accumulation"]) == (11, 20, 2)
    assert json.loads((reference / "finished.json").read_text())["first_step"] == 11
    ours, theirs = (load_file(str(d / "final.safetensors")) for d in (elastic, reference))
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key  # bitwise
