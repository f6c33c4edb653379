"""Hosts made of Linux network namespaces, for starting one job across several "machines" on one.

Each host is a network namespace with its own interface (``eth0``), address (``10.<net>.0.<k+1>``
on a /24) and hostname (a UTS namespace per started process), joined to the others by a bridge
in a namespace of its own (the switch), so that nothing of the machine's own network changes.
Every host resolves every other's name (``/etc/netns/<ns>/hosts``, which each started process
sees as ``/etc/hosts``), as on a cluster whose hosts share a hosts file or DNS. ``rate``
limits what each host sends on ``eth0`` with ``tc``'s token-bucket filter: the slow link
between hosts; loopback inside a host stays fast.

Needs root (``ip netns``), as the test machines and CI run. :func:`available` says whether this
machine can make them, and why not::

    with Hosts(2, rate="200mbit") as hosts:
        procs = [hosts.popen(k, ["tessera", "run", "--nnodes", "2", "--node-rank", str(k), ...])
                 for k in range(2)]
        outputs = hosts.wait(procs, timeout=300)

:func:`torchrun_argv` builds the ``tessera run`` command line of one host of a job.
:meth:`Hosts.launch_agent` writes the ``ssh`` stand-in through which OpenMPI's ``mpirun`` starts
its daemons on the other hosts; :mod:`tessera.testing.slurm` makes a Slurm cluster of the hosts.
:func:`missing_tools` says which of the system's tools that those jobs need are not installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NETNS_ETC = Path("/etc/netns")
PORT = 29400  # the rendezvous port on the first host (each host has its own ports)

#: the system packages (Debian's names) that jobs under OpenMPI and Slurm need, and their commands;
#: ``make setup`` installs them with apt when run as root (the Makefile's SYSTEM_PACKAGES)
SYSTEM_PACKAGES: dict[str, tuple[str, ...]] = {
    "openmpi-bin": ("mpirun",),
    "slurmctld": ("slurmctld",),
    "slurmd": ("slurmd", "slurmstepd"),
    "slurm-client": ("srun", "sbatch", "scontrol", "sinfo"),
    "munge": ("munged",),
}
INSTALL = "apt-get install --no-install-recommends"


class HostsUnavailable(RuntimeError):
    """This machine cannot make namespace hosts (not root, no ``ip``, no network namespaces)."""


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise HostsUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def available() -> str | None:
    """None when namespace hosts can be made here, else why not."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces are a Linux feature"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    return None


def missing_tools(packages: Sequence[str]) -> str | None:
    """None when the commands of ``packages`` (keys of :data:`SYSTEM_PACKAGES`) are installed,
    else what is missing and the command that installs it."""
    lacking = [p for p in packages if any(find_tool(tool) is None for tool in SYSTEM_PACKAGES[p])]
    if not lacking:
        return None
    tools = [tool for p in lacking for tool in SYSTEM_PACKAGES[p] if find_tool(tool) is None]
    return (
        f"{', '.join(tools)} not installed: run `make setup` as root, or `{INSTALL} {' '.join(lacking)}` "
        "(Debian/Ubuntu; on other systems the same packages of OpenMPI, Slurm and munge)"
    )


def find_tool(tool: str) -> str | None:
    """The path of the command ``tool``: on PATH, else in the sbin folders (where daemons live,
    which a user's PATH may lack)."""
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/usr/local/sbin:/sbin")


@dataclass
class HostOutput:
    """What one started process printed, and how it ended."""

    host: int
    returncode: int
    stdout: str
    stderr: str


def made_or_closed(make: Callable[[], None], close: Callable[[], None]) -> None:
    """``make()``; if it fails (or is interrupted), ``close()`` what it made so far, then re-raise."""
    try:
        make()
    except BaseException:
        close()
        raise


class Hosts:
    """``count`` namespace hosts joined by a bridge; made on enter, removed on exit (also after a
    failure: every namespace, veth and hosts file this object made)."""

    def __init__(self, count: int, *, rate: str | None = None, net: int = 231, name: str | None = None) -> None:
        if count < 1:
            raise ValueError(f"Hosts: count must be at least 1, got {count}")
        if not 1 <= net <= 254:
            raise ValueError(f"Hosts: net must be in 1..254 (the address's second byte), got {net}")
        self.count = count
        self.rate = rate
        self.net = net
        self.tag = name or uuid.uuid4().hex[:6]
        self.switch = f"tsw-{self.tag}"
        self.namespaces = [f"th{k}-{self.tag}" for k in range(count)]
        self.hostnames = [f"host{k}" for k in range(count)]
        self._made: list[str] = []

    def address(self, host: int) -> str:
        """Host ``host``'s address on the bridge."""
        return f"10.{self.net}.0.{host + 1}"

    def __enter__(self) -> Hosts:
        why = available()
        if why is not None:
            raise HostsUnavailable(why)
        made_or_closed(self._make, self.close)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{self.address(k)} {name}\n" for k, name in enumerate(self.hostnames)
        )
        for k, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            self._made.append(ns)
            # the veth pair: eth0 in the host, port<k> on the switch's bridge
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"port{k}", "netns", self.switch)
            _ip("link", "set", f"port{k}", "master", "br0", ns=self.switch)
            _ip("link", "set", f"port{k}", "up", ns=self.switch)
            _ip("addr", "add", f"{self.address(k)}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            etc = NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            (etc / "hostname").write_text(self.hostnames[k] + "\n")
            if self.rate:
                self._limit(ns, self.rate)

    @staticmethod
    def _limit(ns: str, rate: str) -> None:
        done = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                               "rate", rate, "burst", "256kbit", "latency", "100ms"],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise HostsUnavailable(f"tc could not limit {ns}'s link to {rate}: {done.stderr.strip()}")

    def close(self) -> None:
        """Remove every namespace made (their interfaces go with them) and their hosts files."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        self._made.clear()

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on host ``host``: in its network namespace, under its hostname, with its
        hosts file. Like ``ip netns exec``, but the machine's ``/sys`` stays as it is (``ip netns
        exec`` mounts a new sysfs, which hides the cgroup file systems that ``slurmd`` needs)."""
        ns, name = self.namespaces[host], self.hostnames[host]
        return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "--propagation", "private",
                "sh", "-c", f'mount --bind {NETNS_ETC / ns / "hosts"} /etc/hosts && hostname {name} && exec "$@"',
                "sh", *argv]  # fmt: skip

    def launch_agent(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``folder/tessera-rsh``, an ``ssh`` stand-in for these hosts, and return its path:
        ``tessera-rsh HOST COMMAND...`` runs the shell command line ``COMMAND...`` (its words
        joined by spaces, as ssh joins them) on HOST, a hostname or address of these hosts. OpenMPI's
        ``mpirun`` starts its daemon on each other host through it (``--mca plm_rsh_agent PATH``, or
        ``OMPI_MCA_plm_rsh_agent=PATH``). Unlike ssh it passes the caller's environment on."""
        cases = "".join(
            f"  {name}|{self.address(k)}) ns={self.namespaces[k]}; name={name} ;;\n"
            for k, name in enumerate(self.hostnames)
        )
        agent = Path(folder) / "tessera-rsh"
        agent.write_text(
            "#!/bin/sh\n"
            "# written by tessera.testing.hosts: `tessera-rsh HOST COMMAND...` runs COMMAND on namespace host HOST\n"
            f'case "$1" in\n{cases}'
            '  *) echo "tessera-rsh: no namespace host named $1" >&2; exit 255 ;;\n'
            "esac\n"
            "shift\n"
            'exec nsenter --net=/run/netns/"$ns" unshare --mount --uts --propagation private sh -c \\\n'
            f'  \'mount --bind {NETNS_ETC}/"$1"/hosts /etc/hosts && hostname "$2" && shift 2 && exec sh -c "$*"\' \\\n'
            '  sh "$ns" "$name" "$@"\n'
        )
        agent.chmod(0o755)
        return agent

    def popen(self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None) -> subprocess.Popen[str]:  # fmt: skip
        """Start ``argv`` on host ``host`` (output captured as text)."""
        return subprocess.Popen(self.command(host, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ if env is None else env), cwd=cwd)  # fmt: skip

    def run(self, host: int, argv: Sequence[str], timeout: float = 60, **kwargs: Any) -> HostOutput:
        """Run ``argv`` on host ``host`` to its end."""
        proc = self.popen(host, argv, **kwargs)
        return self.wait([proc], timeout)[0]

    @staticmethod
    def wait(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[HostOutput]:
        """Wait for every process (one per host, in host order); one still running after
        ``timeout`` seconds (all of them together) is killed and reported with returncode -9."""
        import time

        deadline = time.monotonic() + timeout
        outputs = []
        for host, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                err += f"\n[killed: still running after {timeout:.0f} s]"
            outputs.append(HostOutput(host, proc.returncode, out, err))
        return outputs


def torchrun_argv(
    script: Sequence[str],
    *,
    nnodes: int | str,
    nproc_per_node: int,
    node_rank: int | None,
    master: str,
    port: int = PORT,
    rendezvous: str = "static",
    run_id: str = "tessera",
    python: str = sys.executable,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``tessera run`` command line of one host of a job: ``rendezvous="static"``
    (``--node-rank K --master-addr A --master-port P``) or ``"c10d"`` (``--rdzv-backend c10d
    --rdzv-endpoint A:P --rdzv-id``; the agents agree on the node ranks)."""
    argv = [python, "-m", "tessera.cli", "run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node)]
    if rendezvous == "static":
        if node_rank is None:
            raise ValueError("torchrun_argv: a static rendezvous needs node_rank")
        argv += ["--node-rank", str(node_rank), "--master-addr", master, "--master-port", str(port)]
    elif rendezvous == "c10d":
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{port}", "--rdzv-id", run_id]
    else:
        raise ValueError(f"torchrun_argv: rendezvous must be 'static' or 'c10d', got {rendezvous!r}")
    return [*argv, *extra, *script]


__all__ = [
    "INSTALL",
    "SYSTEM_PACKAGES",
    "HostOutput",
    "Hosts",
    "HostsUnavailable",
    "available",
    "find_tool",
    "missing_tools",
    "torchrun_argv",
]
