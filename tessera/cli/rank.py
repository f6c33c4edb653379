"""What each rank of ``tessera run`` and ``tessera train`` runs: the user's script (or module)
as ``__main__``, with its failure written to the run folder instead of the terminal.

``python -m tessera.cli.rank --script PATH -- ARGS`` (or ``--module NAME -- ARGS``). When the
target raises, this rank writes ``<run folder>/logs/rank<N>.log`` (the whole traceback) and
``rank<N>.json`` (its type and message) and exits 2 for a tessera error, 1 otherwise; the
command that started the ranks prints each distinct error once, naming the ranks that raised it.
The engines the target left open are closed first (their offload files removed): the launcher
stops the other ranks soon after one fails, before they reach their interpreter's exit.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

RUN_DIR_ENV = "TESSERA_RUN_DIR"  # where the ranks write logs/ when they fail


def run_target(kind: str, target: str, args: Sequence[str]) -> None:
    """Run ``target`` as ``__main__`` with ``args`` as its command line, as ``python`` would."""
    sys.argv = [target, *args]
    if kind == "--module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.path[0] = str(Path(target).resolve().parent)  # python puts the script's folder first
    runpy.run_path(target, run_name="__main__")


def record_failure(exc: BaseException, log_dir: Path, rank: str) -> None:
    """Write this rank's traceback and a one-line summary of ``exc`` under ``log_dir``."""
    from tessera.errors import TesseraError

    log_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    (log_dir / f"rank{rank}.log").write_text(text)
    summary = {
        "rank": int(rank),
        "type": type(exc).__name__,
        "message": str(exc),
        "tessera": isinstance(exc, TesseraError),
    }
    (log_dir / f"rank{rank}.json").write_text(json.dumps(summary) + "\n")


def close_engines_after(exc: BaseException) -> None:
    """Close the engines the target left open when it raised ``exc`` (their offload files go),
    if it made any; a failure to close is warned of, ``exc`` stays the error reported."""
    lifecycle = sys.modules.get("tessera.engine.lifecycle")  # not imported: the target made no engine
    if lifecycle is None:
        return
    for engine in lifecycle.open_engines():
        lifecycle.close_after(engine, exc)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] not in ("--script", "--module"):
        print("usage: python -m tessera.cli.rank (--script PATH | --module NAME) -- [args]", file=sys.stderr)
        return 2
    kind, target, rest = argv[0], argv[1], argv[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        run_target(kind, target, rest)  # nowhere to write: python's own reporting
        return 0
    try:
        run_target(kind, target, rest)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            raise
        record_failure(RuntimeError(str(exc.code)), Path(run_dir) / "logs", os.environ.get("RANK", "0"))
        return 1
    except KeyboardInterrupt:
        raise  # the user stopped the job: nothing to report
    except BaseException as exc:
        from tessera.errors import TesseraError

        close_engines_after(exc)  # before the launcher, seeing a rank fail, stops the others
        record_failure(exc, Path(run_dir) / "logs", os.environ.get("RANK", "0"))
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            time.sleep(0.5)  # ranks that fail together all get to write before the launcher stops them
        return 2 if isinstance(exc, TesseraError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
