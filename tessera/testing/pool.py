"""A pool of ranks kept alive across many tests.

Starting a world of processes costs seconds (each imports torch), so a test suite starts one
pool per world size and sends each test body to it. With ``start_method="forkserver"`` the ranks
are forked from a server process that imported torch and tessera once, so that a new or
replaced pool costs a fork per rank instead of an import (the test suite's pools); the default,
``"spawn"``, starts each rank from nothing (the benchmarks, whose memory baselines and timings
were measured that way). A body is a module-level function that runs
on every rank; its return values come back as a list indexed by rank. An exception on any rank
fails the call and names the rank; a body that does not finish in time fails the call naming
the ranks still running. After either, the pool is marked broken (its process group may hold
an unmatched collective) and :class:`PoolSet` replaces it on next use.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from tessera.errors import TesseraError


class RankFailure(TesseraError, AssertionError):
    """A test body raised on one or more ranks, or did not finish in time."""


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any, config: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        import tessera

        tessera.launch(config, rank=rank, world_size=world_size, port=port, backend="gloo")
        results.put(("ready", rank, None))
    except BaseException:
        results.put(("ready", rank, ("error", traceback.format_exc())))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, fn, args, kwargs = item
        try:
            outcome = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # report everything, KeyboardInterrupt included
            outcome = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            results.put((task_id, rank, outcome))
        except Exception:  # an unpicklable return value
            results.put((task_id, rank, ("error", f"return value could not be sent:\n{traceback.format_exc()}")))
    try:
        tessera.shutdown()
    except Exception:
        pass


START_METHODS = ("spawn", "forkserver")
#: what the fork server imports once, before it forks any rank
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "tessera", "tessera.testing"]


class RankPool:
    """``world_size`` processes joined in one gloo process group, waiting for test bodies."""

    def __init__(
        self, world_size: int, *, config: Any = None, start_timeout: float = 180.0, start_method: str = "spawn"
    ) -> None:
        if start_method not in START_METHODS:
            raise ValueError(f"RankPool: start_method must be one of {START_METHODS}, got {start_method!r}")
        self.world_size = world_size
        self.broken = False
        self._task_id = 0
        context: Any = mp.get_context(start_method)  # SpawnContext or ForkServerContext
        if start_method == "forkserver":  # takes effect when the server starts, once per process
            context.set_forkserver_preload(FORKSERVER_PRELOAD)
        port = free_port()
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(world_size)]
        self._procs = [
            context.Process(
                target=_worker,
                args=(rank, world_size, port, self._tasks[rank], self._results, config),
                name=f"tessera-rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        ready = self._collect("ready", start_timeout, "start")
        errors = {r: v[1] for r, v in ready.items() if v is not None}
        if errors:
            self.close()
            raise RankFailure(self._format("starting the pool", errors))

    def _collect(self, task_id: Any, timeout: float, what: str, grace: float = 10.0) -> dict[int, Any]:
        """Gather one answer per rank for ``task_id``; stop early once a rank fails and the
        others have had ``grace`` seconds to follow."""
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                tid, rank, outcome = self._results.get(timeout=min(0.5, deadline - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None and r not in answers]
                if dead:
                    for r in dead:
                        answers[r] = ("error", f"process exited with code {self._procs[r].exitcode}")
                    deadline = min(deadline, time.monotonic() + grace)
                continue
            if tid != task_id:
                continue  # a late answer to an earlier, abandoned task
            answers[rank] = outcome
            if outcome is not None and outcome[0] == "error":
                deadline = min(deadline, time.monotonic() + grace)
        missing = [r for r in range(self.world_size) if r not in answers]
        if missing:
            self.broken = True
            for r in missing:
                answers[r] = ("error", f"did not finish {what} within the time allowed (hung?)")
        return answers

    @staticmethod
    def _format(what: str, errors: dict[int, str]) -> str:
        parts = [f"{what} failed on rank(s) {sorted(errors)}"]
        for rank in sorted(errors):
            parts.append(f"--- rank {rank} ---\n{errors[rank]}")
        return "\n".join(parts)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank and return the results by rank.

        ``fn`` must be importable by name (a module-level function).
        """
        if self.broken:
            raise RankFailure(f"the {self.world_size}-rank pool is broken; use PoolSet to get a new one")
        self._task_id += 1
        task_id = self._task_id
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        answers = self._collect(task_id, timeout, f"{getattr(fn, '__name__', fn)}")
        errors = {r: o[1] for r, o in answers.items() if o[0] == "error"}
        if errors:
            self.broken = True  # an unmatched collective may be pending in the process group
            raise RankFailure(self._format(f"{getattr(fn, '__qualname__', fn)}", errors))
        return [answers[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + (2.0 if not self.broken else 0.0)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.broken = True


class PoolSet:
    """One live pool per world size, replaced when broken."""

    def __init__(self, config: Any = None, *, start_method: str = "spawn") -> None:
        self.config = config
        self.start_method = start_method
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = RankPool(world_size, config=self.config, start_method=self.start_method)
            self._pools[world_size] = pool
        return pool

    def run(
        self, world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        return self.get(world_size).run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
