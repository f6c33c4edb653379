"""Running the server: uvicorn in the foreground (``run_server``), or in a thread for tests
(``serving``), and the check that keeps it on this machine unless asked otherwise (``check_host``).

uvicorn is imported when a server starts, so ``check_host`` works without the ``serve`` extra.
"""

from __future__ import annotations

import ipaddress
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from tessera.errors import ConfigError

if TYPE_CHECKING:
    import uvicorn

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
# After Ctrl-C, streams in flight get this long to finish before they are cancelled (and
# their requests aborted in the engine).
GRACEFUL_SHUTDOWN_SECONDS = 10


def require_uvicorn() -> Any:
    """The ``uvicorn`` module, or an ImportError that says how to install it."""
    try:
        import uvicorn
    except ImportError as error:
        raise ImportError("tessera serve needs uvicorn and FastAPI: pip install 'tessera[serve]'") from error
    return uvicorn


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine: ``localhost``, 127.0.0.0/8 or ``::1``."""
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve anywhere
        return False


def check_host(host: str, explicit: bool) -> str | None:
    """None for a loopback host. Any other host is reachable from other machines: refused
    (ConfigError) unless the user named it explicitly (``--host``), then a warning to print."""
    if is_loopback(host):
        return None
    if not explicit:
        raise ConfigError(
            f"refusing to listen on {host!r}, which other machines can reach; pass --host {host} "
            "explicitly to serve there (and set an API key), or use 127.0.0.1"
        )
    everywhere = " (every network interface)" if host.strip("[]") in {"0.0.0.0", "::"} else ""
    return (
        f"listening on {host}{everywhere}: other machines can reach this server; "
        "set an API key (--api-key) and keep it behind a firewall"
    )


def run_server(app: Any, host: str, port: int, *, warn_public: bool) -> None:
    """Serve ``app`` with uvicorn until Ctrl-C (blocks). ``warn_public``: print
    :func:`check_host`'s warning to stderr when ``host`` is not a loopback address."""
    uvicorn = require_uvicorn()
    if warn_public and (warning := check_host(host, explicit=True)):
        print(f"tessera serve: warning: {warning}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then raises it again: the normal end
        pass


def url_of(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets."""
    bare = host.strip("[]")
    return f"http://[{bare}]:{port}" if ":" in bare else f"http://{bare}:{port}"


@contextmanager
def serving(app: Any, host: str = "127.0.0.1", *, startup_timeout: float = 30.0) -> Iterator[str]:
    """Run ``app`` in a background thread on a free port of ``host`` and yield its base URL
    (``http://127.0.0.1:PORT``); on exit, shut the server down (lifespan shutdown included)
    and wait for its thread. For tests and notebooks."""
    uvicorn = require_uvicorn()
    config = uvicorn.Config(app, host=host, port=0, log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread, failures = _start_in_thread(server)
    try:
        _wait_until_started(server, thread, failures, startup_timeout)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield url_of(host, port)
    finally:
        server.should_exit = True
        thread.join(timeout=startup_timeout)


def _start_in_thread(server: uvicorn.Server) -> tuple[threading.Thread, list[BaseException]]:
    failures: list[BaseException] = []

    def run() -> None:
        try:
            server.run()  # uvicorn installs no signal handlers outside the main thread
        except BaseException as error:  # uvicorn exits with SystemExit when it cannot bind
            failures.append(error)

    thread = threading.Thread(target=run, name="tessera-serving", daemon=True)
    thread.start()
    return thread, failures


def _wait_until_started(
    server: uvicorn.Server, thread: threading.Thread, failures: list[BaseException], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server stopped while starting: {failures[0] if failures else 'no error'}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not start within {timeout} s")
        time.sleep(0.01)
