"""Short runs end cleanly, every time: no rank aborts at exit after training succeeded (a gloo
worker thread left running into the interpreter's exit used to abort about one run in seven on
a busy machine; see tessera.comm.group). The runs start together, so that each ends on a machine
the others keep busy. benchmarks/teardown.py runs many more."""

from __future__ import annotations

import os
import signal
import subprocess

from tessera.testing import free_port
from tests.e2e.test_cli import HERE, results, tessera_cmd

SHORT_RUN = HERE / "scripts" / "short_run.py"
RUNS = 3  # six ranks and three launchers ending together on the machine's two cores


def test_short_two_rank_runs_all_exit_zero(tmp_path):
    ports: set[int] = set()
    while len(ports) < RUNS:
        ports.add(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for attempt, port in enumerate(sorted(ports)):
        with open(tmp_path / f"run{attempt}.out", "w") as out, open(tmp_path / f"run{attempt}.err", "w") as err:
            procs.append(subprocess.Popen(
                [*tessera_cmd(), "run", "--nproc-per-node", "2", "--master-port", str(port), "--no-dry-run",
                 "--run-dir", str(tmp_path / f"run{attempt}"), str(SHORT_RUN)],
                stdout=out, stderr=err, text=True, env=env, start_new_session=True,
            ))  # fmt: skip
    try:
        codes = [proc.wait(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:  # timed out: its ranks too (each run is a session of its own)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    failures = []
    for attempt, code in enumerate(codes):
        stdout, stderr = ((tmp_path / f"run{attempt}.{kind}").read_text() for kind in ("out", "err"))
        if code != 0:
            failures.append(f"run {attempt}: exit {code}\n{stdout[-2000:]}{stderr[-2000:]}")
            continue
        rows = results(stdout)
        assert [r["rank"] for r in rows] == ["0", "1"], stdout
        assert rows[0]["loss"] == rows[1]["loss"], "the ranks agree on the loss"
    assert not failures, "\n".join(failures)
