"""The world that a launcher describes in the environment of the processes it starts: torchrun
(``tessera run``), OpenMPI's ``mpirun`` and Slurm's ``srun``. ``launch_from_torch`` takes
whichever started this process (torchrun first: it may itself run inside a Slurm step);
``launch_from_openmpi`` and ``launch_from_slurm`` insist on theirs.

The process group's store listens on rank 0's host, so every rank must know that host's name:

- torchrun sets ``MASTER_ADDR`` and ``MASTER_PORT``.
- Slurm names the step's nodes (``SLURM_STEP_NODELIST``, a hostlist such as ``node[01-04]``);
  ``srun`` places task 0 on the first (block and cyclic distributions alike), so that is the
  host, and the port is ``29500 + SLURM_JOB_ID % 1000``, so that two jobs sharing a node do not
  meet. ``MASTER_ADDR`` / ``MASTER_PORT`` in the environment override both.
- OpenMPI names no hosts: the host is ``MASTER_ADDR`` (``mpirun -x MASTER_ADDR=node01``), or
  the loopback address when every rank runs on this one host; the port is ``MASTER_PORT``,
  else 29500.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from tessera.errors import ConfigError

TORCHRUN = "torchrun"
OPENMPI = "OpenMPI (mpirun)"
SLURM = "Slurm (srun)"
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class JobEnv:
    """This process's place in the job, as its launcher set it."""

    launcher: str  # TORCHRUN, OPENMPI or SLURM
    rank: int
    world_size: int
    local_rank: int
    host: str  # rank 0's host: where the process group's store listens
    port: int


def _int(env: Mapping[str, str], *names: str, launcher: str) -> int:
    for name in names:
        if name in env:
            try:
                return int(env[name])
            except ValueError:
                raise ConfigError(f"{name}={env[name]!r} (set by {launcher}) is not a whole number") from None
    hint = " (use `tessera run --nproc-per-node N script.py`)" if launcher == TORCHRUN else ""
    raise ConfigError(f"{' / '.join(names)} is not set: this process was not started by {launcher}{hint}")


def _port(env: Mapping[str, str], default: int) -> int:
    text = env.get("MASTER_PORT")
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"MASTER_PORT={text!r} is not a port number") from None


def torchrun_env(env: Mapping[str, str]) -> JobEnv:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, as torchrun sets them."""
    return JobEnv(
        TORCHRUN,
        rank=_int(env, "RANK", launcher=TORCHRUN),
        world_size=_int(env, "WORLD_SIZE", launcher=TORCHRUN),
        local_rank=_int(env, "LOCAL_RANK", launcher=TORCHRUN),
        host=env.get("MASTER_ADDR", "127.0.0.1"),
        port=_port(env, DEFAULT_PORT),
    )


def openmpi_env(env: Mapping[str, str], host: str | None = None, port: int | str | None = None) -> JobEnv:
    """OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK; the host and port as the module says."""
    world_size = _int(env, "OMPI_COMM_WORLD_SIZE", launcher=OPENMPI)
    if host is None:
        host = env.get("MASTER_ADDR")
    if host is None:
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE", launcher=OPENMPI)
        if local_size != world_size:
            raise ConfigError(
                f"mpirun started these {world_size} ranks on more than one host, and OpenMPI does not say "
                "which host rank 0 is on: name it in MASTER_ADDR (`mpirun -x MASTER_ADDR=<rank 0's host> ...`)"
            )
        host = "127.0.0.1"
    return JobEnv(
        OPENMPI,
        rank=_int(env, "OMPI_COMM_WORLD_RANK", launcher=OPENMPI),
        world_size=world_size,
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", launcher=OPENMPI),
        host=host,
        port=int(port) if port is not None else _port(env, DEFAULT_PORT),
    )


def slurm_env(env: Mapping[str, str], host: str | None = None, port: int | str | None = None) -> JobEnv:
    """SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS, SLURM_NPROCS) and SLURM_LOCALID; the
    host and port as the module says."""
    if host is None:
        host = env.get("MASTER_ADDR")
    if host is None:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ConfigError(
                "SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is not set, so rank 0's host is unknown: "
                "pass host= or set MASTER_ADDR"
            )
        host = expand_hostlist(nodelist)[0]
    if port is None:
        job = env.get("SLURM_JOB_ID", "")
        port = _port(env, DEFAULT_PORT + int(job) % 1000 if job.isdigit() else DEFAULT_PORT)
    return JobEnv(
        SLURM,
        rank=_int(env, "SLURM_PROCID", launcher=SLURM),
        world_size=_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", launcher=SLURM),
        local_rank=_int(env, "SLURM_LOCALID", launcher=SLURM),
        host=host,
        port=int(port),
    )


def detect(env: Mapping[str, str]) -> JobEnv | None:
    """The job of whichever launcher started this process, or None outside any: torchrun when
    RANK or WORLD_SIZE is set, else OpenMPI when OMPI_COMM_WORLD_SIZE is, else Slurm inside a
    job step (``srun`` sets SLURM_STEP_ID; a batch script's own shell is no step of tasks)."""
    if "RANK" in env or "WORLD_SIZE" in env:
        return torchrun_env(env)
    if "OMPI_COMM_WORLD_SIZE" in env:
        return openmpi_env(env)
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and env.get("SLURM_STEP_ID") not in _NOT_TASK_STEPS:
        return slurm_env(env)
    return None


# the step ids of a batch script's shell and of an allocation's interactive shell (not srun tasks)
_NOT_TASK_STEPS = ("batch", "extern", "interactive", "4294967294", "4294967295", "4294967293")

_BRACKET = re.compile(r"\[([^\]]*)\]")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax expanded: ``"node[01-03,7],login"`` ->
    ``["node01", "node02", "node03", "node7", "login"]`` (several bracket groups in one name
    multiply out, as ``scontrol show hostnames`` does)."""
    names: list[str] = []
    for item in _split_top_level(text):
        names += _expand_one(item)
    if not names:
        raise ConfigError(f"no host names in the Slurm hostlist {text!r}")
    return names


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_one(name: str) -> list[str]:
    found = _BRACKET.search(name)
    if found is None:
        return [name]
    head, tail = name[: found.start()], name[found.end() :]
    rests, out = _expand_one(tail), []
    for part in found.group(1).split(","):
        low, _, high = part.partition("-")
        if not high:
            values = [low]
        elif low.isdigit() and high.isdigit():
            values = [str(v).zfill(len(low)) for v in range(int(low), int(high) + 1)]
        else:
            raise ConfigError(f"cannot read the range {part!r} in the Slurm hostlist {name!r}")
        out += [f"{head}{value}{rest}" for value in values for rest in rests]
    return out


__all__ = ["JobEnv", "detect", "expand_hostlist", "openmpi_env", "slurm_env", "torchrun_env"]
