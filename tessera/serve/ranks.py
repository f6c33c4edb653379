"""The rank group behind the server: :class:`RankBackend` starts ``tensor x pipeline`` rank
processes that run ``tessera.inference`` and talks to rank 0 over a local connection.

The server process never holds the model. It listens on a loopback socket with a random key;
each rank is ``python -m tessera.serve.ranks`` (joined by ``tessera.launch``), builds its part
of the model, and rank 0 connects back and runs the engine's ``serve`` loop: between steps it
takes ``("add", id, prompt, params, adapter)``, ``("abort", id)`` and ``("stop",)`` messages, and after
each step it sends ``("out", [(id, token, finish_reason), ...], stats)``. A reader thread in the
server turns those into each request's chunks. When the ranks die, every open request ends
with an error and ``/health`` reports it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError, TesseraError
from tessera.inference.engine import CacheOptions
from tessera.inference.params import SamplingParams
from tessera.serve.backend import Chunk, ModelInfo
from tessera.serve.sources import ModelSource, load_tokenizer

ADDRESS_ENV = "TESSERA_SERVE_ADDRESS"
KEY_ENV = "TESSERA_SERVE_KEY"


class RanksFailed(TesseraError, RuntimeError):
    """The rank group did not start, or stopped."""


@dataclass(frozen=True)
class EngineOptions:
    """How the ranks run the model: the layout, the KV cache, the batch, int8 weights, and the
    LoRA adapters served over it (``(name, PEFT folder)`` pairs; adapter ``i`` is the ``i``-th)."""

    tensor: int = 1
    pipeline: int = 1
    num_blocks: int = 256
    block_size: int = 16
    max_batch: int = 32
    max_prefill_tokens: int = 512
    prefix_caching: bool = True
    quantize: str | None = None  # "int8": int8 weight-only linear layers
    max_model_len: int | None = None  # cap below the model's positions
    adapters: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        self.cache  # noqa: B018 (validated here, in the server, before any rank starts)
        object.__setattr__(self, "adapters", tuple((str(n), str(f)) for n, f in self.adapters))  # JSON gives lists
        names = [name for name, _ in self.adapters]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice or any(not name for name in names):
            raise ConfigError(f"adapter names must be distinct and non-empty; got {names} ({', '.join(twice)} twice)")

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.adapters)

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline

    @property
    def cache(self) -> CacheOptions:
        return CacheOptions(
            self.num_blocks, self.block_size, self.max_batch, self.max_prefill_tokens, self.prefix_caching
        )


def no_delay(conn: Connection) -> None:
    """Send each message at once: without TCP_NODELAY a small message right behind another waits
    for its acknowledgement (Nagle and delayed ACK), which held streamed tokens ~40 ms."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the same socket; closing the dup leaves it
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankBackend:
    """Starts the rank group for ``source`` and serves requests through it (the server's
    :class:`~tessera.serve.backend.Backend`). ``start`` blocks until the model is loaded."""

    def __init__(self, source: ModelSource, options: EngineOptions, *, log_dir: Path, start_timeout: float = 600.0):
        self.source, self.options, self.log_dir = source, options, Path(log_dir)
        self.tokenizer = load_tokenizer(source)
        self.info = ModelInfo(name=source.name, max_model_len=0, vocab_size=0, adapters=options.adapter_names)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Chunk]]] = {}
        self._stats: dict[str, float] = {
            "running": 0,
            "waiting": 0,
            "kv_blocks_used": 0,
            "kv_blocks_total": 0,
            "steps": 0,
        }
        self._ids = itertools.count()
        self.failure: str | None = None
        self._start_timeout = start_timeout

    # ---- start and stop ---------------------------------------------------------------------
    def start(self) -> RankBackend:
        key = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(
            {
                ADDRESS_ENV: f"{listener.address[0]}:{listener.address[1]}",
                KEY_ENV: key.hex(),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_free_port()),
                "WORLD_SIZE": str(self.options.world_size),
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            }
        )
        argv = [sys.executable, "-m", "tessera.serve.ranks", self.source.to_json(), json.dumps(asdict(self.options))]
        for rank in range(self.options.world_size):
            rank_env = env | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
            with open(self.log_dir / f"rank{rank}.log", "wb") as log:  # the process has its own copy
                self._procs.append(subprocess.Popen(argv, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
        self._conn = self._accept(listener)
        no_delay(self._conn)
        listener.close()
        hello = self._hello(self._conn)
        if hello[0] != "ready":
            self.close_now()
            raise RanksFailed(f"rank 0 failed to load the model: {hello[1]}")
        self.info = ModelInfo(
            name=self.source.name,
            max_model_len=int(hello[1]["max_model_len"]),
            vocab_size=int(hello[1]["vocab_size"]),
            adapters=self.options.adapter_names,
        )
        self._stats["kv_blocks_total"] = float(hello[1]["kv_blocks_total"])
        threading.Thread(target=self._read, name="tessera-serve-reader", daemon=True).start()
        return self

    def _accept(self, listener: Listener) -> Connection:
        """Rank 0's connection, or RanksFailed naming the rank that died and its last log lines."""
        deadline = time.monotonic() + self._start_timeout
        listener._listener._socket.settimeout(1.0)  # type: ignore[attr-defined]
        while time.monotonic() < deadline:
            for rank, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    self.close_now()
                    raise RanksFailed(
                        f"rank {rank} exited with code {proc.returncode} while loading:\n{self._tail(rank)}"
                    )
            try:
                return listener.accept()
            except TimeoutError:
                continue
        self.close_now()
        raise RanksFailed(f"the ranks did not load the model within {self._start_timeout:.0f} s (logs: {self.log_dir})")

    def _hello(self, conn: Connection) -> Any:
        """Rank 0's first message, waiting while every rank lives (another rank's failure to load
        would leave rank 0 in a collective)."""
        deadline = time.monotonic() + self._start_timeout
        while not conn.poll(1.0):
            for rank, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    self.close_now()
                    raise RanksFailed(
                        f"rank {rank} exited with code {proc.returncode} while loading:\n{self._tail(rank)}"
                    )
            if time.monotonic() > deadline:
                self.close_now()
                raise RanksFailed(f"the ranks did not load the model within {self._start_timeout:.0f} s")
        return conn.recv()

    def _tail(self, rank: int, lines: int = 15) -> str:
        path = self.log_dir / f"rank{rank}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close_now)

    def close_now(self, timeout: float = 20.0) -> None:
        """Stop the engine loop and wait for the ranks (killing those that do not end)."""
        if self._conn is not None:
            try:
                self._send(("stop",))
            except (OSError, RanksFailed):
                pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []

    # ---- messages -----------------------------------------------------------------------------
    def _send(self, message: tuple[Any, ...]) -> None:
        if self._conn is None or self.failure is not None:
            raise RanksFailed(self.failure or "the rank group is not running")
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        assert self._conn is not None
        try:
            while True:
                kind, outputs, stats = self._conn.recv()
                if kind == "out":
                    self._stats.update(stats)
                    for output in outputs:
                        self._deliver(*output)
        except (EOFError, OSError) as exc:
            self.failure = f"the rank group stopped ({type(exc).__name__}); logs: {self.log_dir}"
            for request_id in list(self._queues):
                self._put(request_id, Chunk((), "abort", error=self.failure))

    def _deliver(
        self,
        request_id: str,
        index: int,
        token: int | None,
        reason: str | None,
        logprob: float | None = None,
        top: tuple[tuple[int, float], ...] = (),
        prompt: tuple = (),
        sampled: int | None = None,
    ) -> None:
        if reason is not None and reason.startswith("error: "):
            self._put(request_id, Chunk((), "abort", error=reason[len("error: ") :]))
            return
        tokens = (token,) if token is not None else ()
        stop_token = sampled if token is None and reason == "stop" else None
        chosen = token if token is not None else stop_token
        logprobs = ((logprob, top),) if chosen is not None and logprob is not None else ()
        self._put(
            request_id, Chunk(tokens, reason, index=index, logprobs=logprobs, prompt=prompt, stop_token=stop_token)
        )

    def _put(self, request_id: str, chunk: Chunk) -> None:
        entry = self._queues.get(request_id)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, chunk)

    # ---- the Backend protocol -----------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[Chunk]:
        names = self.options.adapter_names
        if adapter is not None and adapter not in names:
            raise ValueError(f"no adapter named {adapter!r}; this backend serves {list(names)}")
        index = names.index(adapter) if adapter is not None else -1
        queue: asyncio.Queue[Chunk] = asyncio.Queue()
        key = f"{request_id}#{next(self._ids)}"  # unique on the wire even if a client reuses an id
        self._queues[key] = (asyncio.get_running_loop(), queue)
        done = False
        left = params.n  # the request's sequences still going
        try:
            self._send(("add", key, list(prompt_ids), params, index))
            while True:
                chunk = await queue.get()
                if chunk.finish_reason is not None:
                    left = 0 if chunk.finish_reason == "abort" else left - 1
                done = left == 0
                yield chunk
                if done:
                    return
        except RanksFailed as exc:
            done = True
            yield Chunk((), "abort", error=str(exc))
        finally:
            del self._queues[key]
            if not done:  # the client left (or a stop string ended it): free its blocks
                self._abort_key(key)

    def _abort_key(self, key: str) -> None:
        try:
            self._send(("abort", key))
        except (OSError, RanksFailed):
            pass

    async def abort(self, request_id: str) -> None:
        for key in [k for k in self._queues if k.rsplit("#", 1)[0] == request_id]:
            self._abort_key(key)

    def stats(self) -> dict[str, float]:
        return dict(self._stats)


# ---- the rank side -----------------------------------------------------------------------------
def rank_main(argv: Sequence[str] | None = None) -> int:
    """A rank of the group (``python -m tessera.serve.ranks SOURCE_JSON OPTIONS_JSON``)."""
    parser = argparse.ArgumentParser(prog="python -m tessera.serve.ranks")
    parser.add_argument("source")
    parser.add_argument("options")
    args = parser.parse_args(argv)
    source = ModelSource.from_json(args.source)
    options = EngineOptions(**json.loads(args.options))
    rank = int(os.environ["RANK"])
    conn: Connection | None = None
    if rank == 0:
        host, port = os.environ[ADDRESS_ENV].rsplit(":", 1)
        conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[KEY_ENV]))
        no_delay(conn)
    try:
        engine = _load(source, options, rank)
    except Exception as exc:
        if conn is not None:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise
    if conn is None:
        engine.follow()
        return 0
    scheduler = engine.scheduler
    assert scheduler is not None
    conn.send(
        (
            "ready",
            {
                "max_model_len": scheduler.max_len,
                "vocab_size": engine.runner.vocab_size,
                "kv_blocks_total": scheduler.blocks.num_blocks,
            },
        )
    )
    _serve(engine, conn)
    return 0


def _load(source: ModelSource, options: EngineOptions, rank: int) -> Any:
    import tessera
    from tessera.inference.engine import InferenceEngine
    from tessera.inference.models import prepare_model
    from tessera.serve.sources import build_model

    config = {"parallel": {"tensor": {"size": options.tensor, "mode": "1d"}, "pipeline": {"size": options.pipeline}}}
    ctx = tessera.launch(
        config,
        rank=rank,
        world_size=options.world_size,
        host=os.environ["MASTER_ADDR"],
        port=os.environ["MASTER_PORT"],
    )
    model, init = build_model(source)
    folders = [folder for _, folder in options.adapters]
    runner = prepare_model(model, ctx, init=init, quantize=options.quantize, adapters=folders)
    if options.max_model_len is not None:
        runner.max_len = min(runner.max_len, options.max_model_len)
    return InferenceEngine(runner, ctx, options.cache)


def _serve(engine: Any, conn: Connection) -> None:
    scheduler = engine.scheduler

    def receive(timeout: float) -> list[Any]:
        messages = []
        if conn.poll(timeout):
            while True:
                messages.append(conn.recv())
                if not conn.poll(0):
                    break
        return messages

    def emit(outputs: list[Any]) -> None:
        stats = {**scheduler.stats(), "steps": float(engine.steps)}
        wants = [
            (o.request_id, o.index, o.token, o.finish_reason, o.logprob, o.top, o.prompt, o.sampled) for o in outputs
        ]
        conn.send(("out", wants, stats))

    try:
        engine.serve(receive, emit)
    except (EOFError, OSError):  # the server went away: end the followers too
        engine.finish("stop")


if __name__ == "__main__":
    sys.exit(rank_main())
