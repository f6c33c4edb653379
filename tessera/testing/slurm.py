"""A Slurm cluster whose nodes are namespace hosts (:mod:`tessera.testing.hosts`), for tests of
jobs started by ``srun`` and ``sbatch`` as on a real cluster.

``slurmctld`` runs on the first host, one ``slurmd`` on each host (in its network namespace, under
its hostname, as that node), and one ``munged`` serves them all (its socket is a file, which every
namespace sees) with a key of the cluster's own. Everything the daemons write (config, key,
state, spool folders, logs) lives in one folder; nothing of the machine's own Slurm or munge
(``/etc/slurm``, ``/etc/munge``, ``/run/munge``) is read or changed. Clients find the cluster
through ``SLURM_CONF`` (:meth:`SlurmCluster.env`) and must run on one of the hosts
(:meth:`SlurmCluster.command`), since the cluster's addresses exist only there::

    with Hosts(2) as hosts, SlurmCluster(hosts, tmp) as slurm:
        out = hosts.run(0, ["srun", "-N2", "--ntasks-per-node", "2", "hostname"], env=slurm.env())

Daemons get SIGTERM when the process that started them dies (a killed test leaves none running);
:meth:`SlurmCluster.close` cancels what still runs and stops them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from tessera.testing.hosts import Hosts, find_tool, made_or_closed

#: job states after which a job no longer runs
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


class SlurmUnavailable(RuntimeError):
    """The cluster's daemons did not come up (the message holds their logs)."""


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class SlurmCluster:
    """``hosts`` as the nodes of a Slurm cluster (partition ``debug``, each node with ``cpus``
    CPUs), its files under ``folder``. Started on enter, stopped on exit."""

    def __init__(self, hosts: Hosts, folder: str | os.PathLike[str], *, cpus: int = 2, name: str = "tessera") -> None:
        self.hosts = hosts
        self.folder = Path(folder)
        self.cpus = cpus
        self.name = name
        self.conf = self.folder / "slurm.conf"
        self.socket = self.folder / "munge" / "munge.socket"
        self._daemons: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []

    # ---- the files ---------------------------------------------------------------------------

    def config_text(self) -> str:
        """The cluster's ``slurm.conf``: munge on this cluster's socket, no cgroups, no accounting."""
        f, h = self.folder, self.hosts
        nodes = "".join(
            f"NodeName={name} NodeAddr={h.address(k)} CPUs={self.cpus} State=UNKNOWN\n"
            for k, name in enumerate(h.hostnames)
        )
        return (
            f"ClusterName={self.name}\n"
            f"SlurmctldHost={h.hostnames[0]}({h.address(0)})\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={self.socket}\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
            "SwitchType=switch/none\nMpiDefault=none\nMailProg=/bin/true\n"
            "SchedulerType=sched/builtin\nSelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
            # the nodes share one machine: the config's CPUs count, not what slurmd detects
            "SlurmdParameters=config_overrides\nReturnToService=2\n"
            "SlurmctldPort=6817\nSlurmdPort=6818\nSlurmdTimeout=60\nMessageTimeout=20\nKillWait=5\n"
            f"StateSaveLocation={f / 'ctld'}\nSlurmdSpoolDir={f / 'spool-%n'}\n"
            f"SlurmctldPidFile={f / 'slurmctld.pid'}\nSlurmdPidFile={f / 'slurmd-%n.pid'}\n"
            f"SlurmctldLogFile={f / 'slurmctld.log'}\nSlurmdLogFile={f / 'slurmd-%n.log'}\n"
            f"{nodes}"
            f"PartitionName=debug Nodes={','.join(h.hostnames)} Default=YES MaxTime=INFINITE State=UP\n"
        )

    def _write_files(self) -> None:
        munge = self.folder / "munge"
        munge.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.folder / "ctld").mkdir(exist_ok=True)
        for name in self.hosts.hostnames:
            (self.folder / f"spool-{name}").mkdir(exist_ok=True)
        self.conf.write_text(self.config_text())

    # ---- the daemons -------------------------------------------------------------------------

    def _start(self, label: str, argv: Sequence[str], host: int | None = None) -> None:
        argv = [find_tool(argv[0]) or argv[0], *argv[1:]]  # daemons live in sbin
        log = open(self.folder / f"{label}.out", "wb")  # closed in close()
        command = list(argv) if host is None else self.hosts.command(host, argv)
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                preexec_fn=_die_with_parent)  # fmt: skip
        self._daemons.append((label, proc, log))

    def __enter__(self) -> SlurmCluster:
        made_or_closed(self._start_all, self.close)
        return self

    def _start_all(self) -> None:
        """munged, slurmctld on host 0 and a slurmd per host, until every node is idle."""
        self._write_files()
        munge = self.folder / "munge"
        files = {option: munge / f"munged.{option}" for option in ("pid", "log", "seed")}
        self._start("munged", ["munged", "--foreground", "--force", f"--socket={self.socket}",
                               f"--key-file={munge / 'munge.key'}",
                               *(f"--{option}-file={path}" for option, path in files.items())])  # fmt: skip
        self._wait_for(self.socket.exists, "munged's socket", 15)
        self._start("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)], host=0)
        for k, name in enumerate(self.hosts.hostnames):
            self._start(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)], host=k)
        self._wait_for(self._nodes_idle, "every node idle in sinfo", 60)

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _wait_for(self, ready: Any, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [(label, p.returncode) for label, p, _ in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{dead[0][0]} exited with {dead[0][1]}" if dead else f"no {what} after {timeout:.0f} s"
                raise SlurmUnavailable(f"the Slurm cluster did not start: {why}\n{self.logs()}")
            time.sleep(0.2)

    def _nodes_idle(self) -> bool:
        out = self.client(["sinfo", "-h", "-o", "%n %t"], check=False)
        states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(name) == "idle" for name in self.hosts.hostnames)

    def logs(self, lines: int = 30) -> str:
        """The end of every daemon's log (for a failure's message)."""
        parts = []
        for path in (
            sorted(self.folder.glob("*.log"))
            + sorted(self.folder.glob("*.out"))
            + [self.folder / "munge" / "munged.log"]
        ):
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def close(self) -> None:
        """Cancel every job still running, stop the daemons (slurmd first) and wait for them."""
        if any(label == "slurmctld" and p.poll() is None for label, p, _ in self._daemons):
            self.client(["scancel", "--full", "--partition", "debug"], check=False)
        for _label, proc, _log in reversed(self._daemons):
            if proc.poll() is None:
                proc.terminate()
        for _label, proc, log in reversed(self._daemons):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
        self._daemons.clear()

    # ---- clients -----------------------------------------------------------------------------

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with ``SLURM_CONF`` naming this cluster."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def command(self, argv: Sequence[str], host: int = 0) -> list[str]:
        """A client's ``argv`` run on host ``host`` (the cluster is reachable only there)."""
        return self.hosts.command(host, argv)

    def client(self, argv: Sequence[str], *, check: bool = True, timeout: float = 30,
               cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Run a Slurm client (``sinfo``, ``scontrol``, ``sbatch``...) on the first host."""
        out = subprocess.run(self.command(argv), capture_output=True, text=True, env=self.env(), timeout=timeout,
                             cwd=cwd)  # fmt: skip
        if check and out.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` exited with {out.returncode}: {out.stderr.strip()}")
        return out

    def sbatch(self, script: str | os.PathLike[str], cwd: str | os.PathLike[str]) -> int:
        """Submit the batch script ``script`` from the folder ``cwd``; its job id."""
        return int(self.client(["sbatch", "--parsable", str(script)], cwd=cwd).stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields of job ``job_id`` (JobState, NodeList, NumTasks, ...)."""
        out = self.client(["scontrol", "show", "job", "--oneliner", str(job_id)])
        return dict(word.split("=", 1) for word in out.stdout.split() if "=" in word)

    def wait(self, job_id: int, timeout: float) -> dict[str, str]:
        """Job ``job_id``'s fields once it has finished; one still running after ``timeout``
        seconds is cancelled (its state then says so)."""
        deadline = time.monotonic() + timeout
        while (fields := self.job(job_id))["JobState"] not in FINISHED:
            if time.monotonic() > deadline:
                self.client(["scancel", str(job_id)], check=False)
                self._wait_cancelled(job_id)
                return {**self.job(job_id), "TimedOutWaiting": f"{timeout:.0f}"}
            time.sleep(0.2)
        return fields

    def _wait_cancelled(self, job_id: int) -> None:
        for _ in range(100):
            if self.job(job_id)["JobState"] in FINISHED:
                return
            time.sleep(0.2)


__all__ = ["FINISHED", "SlurmCluster", "SlurmUnavailable"]
