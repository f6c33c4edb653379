"""A hung rank is named (issue #14): under ``tessera run``, a rank that stops calling collectives
ends the job within the watchdog timeout, and the terminal names it as the rank that did not
arrive, not the healthy ranks that waited for it (two of them, on 3 ranks). No process is left
behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tessera.testing import free_port
from tests.e2e.test_cli import HERE, tessera_cmd

HUNG_RANK_SCRIPT = HERE / "scripts" / "hung_rank.py"
TIMEOUT_S = 5


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # ended meanwhile
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def test_a_hung_rank_is_named_and_the_job_ends(tmp_path):
    marker = str(tmp_path / "hung-rank-marker")
    command = [*tessera_cmd(), "run", "--nproc-per-node", "3", "--master-port", str(free_port()), "--no-dry-run",
               "--set", f"comm.timeout_s={TIMEOUT_S}", "--run-dir", str(tmp_path / "run"),
               str(HUNG_RANK_SCRIPT), marker]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=240)
        ended = time.time()
        deadline = ended + 10  # the launcher reaps its ranks before it returns; allow the kernel a moment
        while processes_with(marker) and time.time() < deadline:
            time.sleep(0.2)
        left = processes_with(marker)
    finally:
        if proc.poll() is None or processes_with(marker):
            os.killpg(proc.pid, signal.SIGKILL)  # only this test's own session
            proc.wait()
    hung = re.search(r"HUNG rank=2 step=3 at=([\d.]+)", stdout)
    assert hung, stdout + stderr
    since_hang = ended - float(hung.group(1))
    print(f"tessera run with rank 2 hung: {ended - start:.1f}s in all, {since_hang:.1f}s from the hang to the "
          f"end of the job (watchdog timeout {TIMEOUT_S}s)")  # fmt: skip
    print(stderr[-3000:])
    assert proc.returncode != 0
    assert "DONE" not in stdout
    assert left == [], f"processes left behind: {left}"
    # the healthy ranks report, each naming rank 2; nobody blames a healthy rank
    assert re.search(r"rank 2 did not arrive at all_reduce #\d+ on this group \(its last collective on this group "
                     r"was #\d+ all_reduce on axis 'data'\)", stderr), stderr  # fmt: skip
    reporters = set(re.findall(r"rank (\d): all_reduce on axis 'data' \(group ranks \[0, 1, 2\]\)", stderr))
    assert reporters and reporters <= {"0", "1"}, stderr
    assert not re.search(r"rank [01] did not arrive", stderr), stderr
    assert since_hang < TIMEOUT_S + 60, "the watchdog, not something slower, ended the job"
