"""Start the process group and the parallel context, from explicit arguments or from the
environment that torchrun, Slurm or OpenMPI set; outside any launcher, as a world of one.

The config is loaded and validated, and the layout checked against the world size, before any
process group starts: a bad config fails at once on every rank with the same message.
``tessera run`` also starts the script once in a dry validation (``TESSERA_DRY_RUN``): the
script's ``launch_from_torch`` then only checks its config against the world it will get,
writes the verdict and ends the process, so a bad layout fails before any rank is spawned.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import socket
import sys
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tessera import comm, job_env
from tessera.config import (
    Config,
    ConfigSource,
    load_config,
    parallel_dims,
    require_available,
    resolve_auto,
    resolve_batch,
)
from tessera.context import ParallelContext, hosts, seed_all
from tessera.engine.lifecycle import close_open_engines
from tessera.errors import ConfigError, TesseraError
from tessera.session import set_session

# Set by ``tessera run`` for the ranks and for its dry validation (see the module docstring).
CONFIG_ENV = "TESSERA_CONFIG"  # the config named by `tessera run --config`
OVERRIDES_ENV = "TESSERA_OVERRIDES"  # JSON list of --set items, applied after the script's own
DRY_RUN_ENV = "TESSERA_DRY_RUN"  # JSON {"world_size": N, "result": path}


def resolve_backend(requested: str | None) -> str:
    """``nccl`` when CUDA is present, else ``gloo``; an explicit choice is checked."""
    if requested in (None, "auto"):
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ConfigError("launch.backend='nccl' needs CUDA, and no GPU is visible; use 'gloo' or 'auto'")
    if requested not in ("gloo", "nccl", "mpi"):
        raise ConfigError(f"backend {requested!r} is not supported; allowed: auto, gloo, nccl, mpi")
    return requested


def launch(
    config: ConfigSource = None,
    *,
    rank: int,
    world_size: int,
    host: str = "127.0.0.1",
    port: int | str = 29500,
    backend: str | None = None,
    local_rank: int | None = None,
    overrides: Sequence[str] = (),
) -> ParallelContext:
    """Start this rank: validate ``config``, join the process group, build and return the
    parallel context (also made the current one, see ``tessera.get_context()``).

    ``config`` is a path (.py, .yaml, .toml, .json), a dict, a Config, or None for defaults.
    """
    cfg = load_config(config, overrides)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world size {world_size}")
    # parallel="auto": every rank makes the same plan; rank 0 says what it chose and why
    cfg = resolve_auto(cfg, world_size, announce=_announce if rank == 0 else None)
    dims = parallel_dims(cfg, world_size)  # fails before any process group starts
    cfg = resolve_batch(cfg, dims.data_size)  # data.global_batch_size: the micro-batches a step on this world
    backend = resolve_backend(backend or cfg.launch.backend)
    local_rank = rank if local_rank is None else local_rank

    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if cfg.launch.intra_op_threads > 0:
            torch.set_num_threads(cfg.launch.intra_op_threads)

    timeout = datetime.timedelta(seconds=cfg.comm.timeout_s)
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"a process group is already running as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}"
            )
    else:
        store = _restart_store(host, port, world_size, timeout)
        if store is not None:
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{host}:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
    comm.set_timeout(cfg.comm.timeout_s)
    hosts.discover()  # which ranks share a host: the context warns of chatty groups across hosts
    seed_all(cfg.seed)
    ctx = ParallelContext(dims, device=device, seed=cfg.seed)
    set_session(ctx, cfg)
    return ctx


def _announce(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _restart_store(host: str, port: int | str, world_size: int, timeout: datetime.timedelta) -> Any:
    """Under torchrun's agent store (which outlives restarts: ``--max-restarts``), a view of it
    with keys of this attempt only; otherwise None (the process group makes its own store).
    Without the prefix, ranks restarted after a failure would read the addresses the previous
    attempt's ranks published there and fail to connect."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"tessera/attempt{attempt}", agent)


def env_overrides(env: Mapping[str, str] | None = None) -> list[str]:
    """The ``--set`` items that ``tessera run`` passes to every rank."""
    text = (os.environ if env is None else env).get(OVERRIDES_ENV)
    return list(json.loads(text)) if text else []


def launch_from_torch(
    config: ConfigSource = None, *, backend: str | None = None, overrides: Sequence[str] = ()
) -> ParallelContext:
    """Launch from the environment of whichever launcher started this process: torchrun
    (``tessera run``: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), else OpenMPI's
    ``mpirun``, else a Slurm ``srun`` step (see ``tessera.job_env`` for what each sets and how
    rank 0's host is found). Without any (``python my_train.py``) the process runs as a world
    of one, on gloo or the first GPU."""
    env = os.environ
    overrides = [*overrides, *env_overrides()]
    config = _with_named_config(config, env.get(CONFIG_ENV))
    if DRY_RUN_ENV in env:
        _dry_validation(config, overrides, json.loads(env[DRY_RUN_ENV]))
    cfg = load_config(config, overrides)  # a bad config is reported before anything else
    job = job_env.detect(env)
    if job is None:
        return launch_alone(cfg, backend=backend)
    if job.world_size == 1 and job.launcher != job_env.TORCHRUN:
        # one task of mpirun or srun: a world of one on a free port (two such jobs may share a node)
        return launch(cfg, rank=0, world_size=1, local_rank=0, port=_free_port(), backend=backend)
    return _launch_job(cfg, job, backend)


def _launch_job(cfg: Config, job: job_env.JobEnv, backend: str | None) -> ParallelContext:
    return launch(
        cfg,
        rank=job.rank,
        world_size=job.world_size,
        local_rank=job.local_rank,
        host=job.host,
        port=job.port,
        backend=backend,
    )


def _with_named_config(config: ConfigSource, named: str | None) -> ConfigSource:
    """The script's config, or the one ``tessera run --config`` named; both only if the same file."""
    if named is None:
        return config
    if config is None:
        return named
    if isinstance(config, (str, os.PathLike)) and os.path.realpath(config) == os.path.realpath(named):
        return config
    raise ConfigError(
        f"tessera run --config {named} names a config, and the script launches with its own ({config!r}): "
        "drop one of them"
    )


def ranks_needed(cfg: Config) -> int:
    """The smallest world ``cfg``'s layout fits: the product of its axis sizes."""
    p = cfg.parallel
    return (p.data or 1) * p.pipeline.size * p.tensor.size * p.sequence.size


def launch_alone(cfg: Config, *, backend: str | None = None) -> ParallelContext:
    """A world of one: this process is rank 0 of 1, on a free local port."""
    needed = ranks_needed(cfg)
    if needed > 1:
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "script.py"
        raise ConfigError(
            f"this config's layout needs {needed} processes, and no launcher started this one (RANK is "
            f"not set), so it runs alone: start it with `tessera run --nproc-per-node {needed} {script}`"
        )
    port = _free_port()
    print(
        "tessera: no launcher (RANK is not set): running as one process; "
        "for more, `tessera run --nproc-per-node N script.py`",
        file=sys.stderr,
        flush=True,
    )
    return launch(cfg, rank=0, world_size=1, local_rank=0, port=port, backend=backend)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _dry_validation(config: ConfigSource, overrides: Sequence[str], request: Mapping[str, object]) -> None:
    """Check the script's config against the world ``tessera run`` will start, write the verdict
    to ``request["result"]`` and end this process (it was started only to be asked)."""
    verdict: dict[str, object] = {"ok": True}
    try:
        cfg = load_config(config, overrides)
        world_size = int(str(request["world_size"]))
        resolved = resolve_auto(cfg, world_size)
        resolve_batch(resolved, parallel_dims(resolved, world_size).data_size)
        require_available(cfg)
    except TesseraError as exc:
        verdict = {"ok": False, "error": str(exc), "type": type(exc).__name__}
    with open(str(request["result"]), "w") as out:
        json.dump(verdict, out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch_from_slurm(
    config: ConfigSource = None,
    host: str | None = None,
    port: int | str | None = None,
    *,
    backend: str | None = None,
    overrides: Sequence[str] = (),
) -> ParallelContext:
    """Launch under ``srun``: rank, world size and local rank from SLURM_PROCID,
    SLURM_STEP_NUM_TASKS (or SLURM_NTASKS, SLURM_NPROCS) and SLURM_LOCALID. ``host`` (rank 0's
    host) defaults to MASTER_ADDR, else the first node of SLURM_STEP_NODELIST; ``port`` to
    MASTER_PORT, else ``29500 + SLURM_JOB_ID % 1000``."""
    cfg = load_config(config, overrides)
    return _launch_job(cfg, job_env.slurm_env(os.environ, host, port), backend)


def launch_from_openmpi(
    config: ConfigSource = None,
    host: str | None = None,
    port: int | str | None = None,
    *,
    backend: str | None = None,
    overrides: Sequence[str] = (),
) -> ParallelContext:
    """Launch under ``mpirun`` (OpenMPI): OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK. ``host``
    (rank 0's host) defaults to MASTER_ADDR, else the loopback address when every rank is on this
    host (across hosts it must be named); ``port`` to MASTER_PORT, else 29500."""
    cfg = load_config(config, overrides)
    return _launch_job(cfg, job_env.openmpi_env(os.environ, host, port), backend)


def shutdown() -> None:
    """Close this process's engines, leave the process group and forget the current context.

    Every engine made in this process and not yet closed is closed first (``Engine.close``:
    Gemini's offload files are removed), on this rank alone, so that a rank whose peers failed
    releases its files before it waits for them. Then collective: every rank waits for the
    others, because a gloo process that tears its connections down while a peer still uses
    them aborts the peer. Then tessera's objects let go of their process groups before torch
    destroys them, so that each group's worker threads are joined here, while Python still
    runs (see ``tessera.comm.group``).
    """
    saving = sys.modules.get("tessera.checkpoint.background")
    if saving is not None:
        saving.wait_for_saves()  # a save still being written finishes (its writer uses process groups)
    closing_failed: Exception | None = None
    try:
        close_open_engines()
    except Exception as error:  # raised once the group is left: the other ranks wait for this one
        closing_failed = error
    if dist.is_initialized():
        comm.barrier(comm.AxisGroup("world", tuple(range(dist.get_world_size())), dist.get_rank(), dist.group.WORLD))
        set_session(None, None)
        released = [weakref.ref(pg) for pg in comm.release_process_groups()]
        if "torch._dynamo" in sys.modules:  # compiled code and its guards keep the groups they saw
            torch._dynamo.reset()
        dist.destroy_process_group()
        hosts.forget()
        if any(ref() is not None for ref in released):
            gc.collect()  # groups kept only by reference cycles
        kept = sum(ref() is not None for ref in released)
        if kept:
            warnings.warn(
                f"{kept} process group(s) are still referenced after tessera.shutdown(), so their gloo "
                "worker threads outlive it and may abort the process at exit; drop other references "
                "to process groups (such as ctx.group(axis).pg) before shutting down",
                RuntimeWarning,
                stacklevel=2,
            )
    set_session(None, None)
    if closing_failed is not None:
        raise closing_failed


__all__ = ["Config", "launch", "launch_from_openmpi", "launch_from_slurm", "launch_from_torch", "shutdown"]
