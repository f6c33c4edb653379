"""Regenerate the golden files in ``tests/golden/curves/``.

    python -m tests.golden.regenerate                 # every run, in every class this machine can force
    python -m tests.golden.regenerate dp4 zero3-dp4   # some runs
    python -m tests.golden.regenerate --this-class    # only this process's numerics class
    python -m tests.golden.regenerate --list

Run from the repository root. A file keeps its numbers per numerics class (tests/golden/numerics.py).
By default the runs are recorded in this machine's own class and then, in fresh processes, in
each lower class of :data:`tests.golden.numerics.FORCINGS`; the classes recorded before are
dropped, since regenerating means the numerics changed. ``--this-class`` records the class of
the calling process (its environment may force one), and with ``--add-class`` keeps the others.
Each run is computed twice and written only if both give the same bits; the tolerance for
classes not recorded is measured anew from the recorded ones (docs/testing.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.golden import default_train, strategies
from tests.golden.numerics import FORCINGS
from tests.golden.record import write_golden

PRODUCED_BY = "python -m tests.golden.regenerate"


def _twice(name: str, compute) -> tuple[str, dict]:
    first, second = compute(), compute()
    if first != second:
        raise SystemExit(f"golden run {name!r} is not deterministic: two computations differ; nothing written")
    return first


def _record_this_class(wanted: list[str], keep_classes: bool) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if default_train.NAME in wanted:
        with tempfile.TemporaryDirectory() as tmp:
            counter = iter(range(2))
            numerics, numbers = _twice(
                default_train.NAME, lambda: default_train.compute(Path(tmp) / f"run{next(counter)}")
            )
        path = write_golden(
            default_train.NAME, default_train.definition(), numbers, PRODUCED_BY, numerics, keep_classes
        )
        print(f"wrote {path} ({numerics})", flush=True)
    names = [n for n in wanted if n in strategies.RUNS]
    if names:
        from tessera.testing import PoolSet

        pools = PoolSet()
        try:
            for name in sorted(names, key=lambda n: strategies.RUNS[n].ranks):  # one pool size at a time
                run = strategies.RUNS[name]
                numerics, numbers = _twice(name, lambda: strategies.compute(pools, name))  # noqa: B023 -- called at once
                path = write_golden(name, run.definition(), numbers, PRODUCED_BY, numerics, keep_classes)
                print(f"wrote {path} ({numerics})", flush=True)
        finally:
            pools.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.golden.regenerate", description=__doc__.split("\n")[1])
    parser.add_argument("runs", nargs="*", help="run names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the runs and exit")
    parser.add_argument("--this-class", action="store_true", help="record only this process's numerics class")
    parser.add_argument("--add-class", action="store_true", help="with --this-class: keep the classes recorded before")
    args = parser.parse_args(argv)
    known = [default_train.NAME, *strategies.RUNS]
    if args.list:
        print("\n".join(known))
        return 0
    unknown = [r for r in args.runs if r not in known]
    if unknown:
        parser.error(f"unknown run(s) {unknown}; known: {', '.join(known)}")
    if args.add_class and not args.this_class:
        parser.error("--add-class goes with --this-class")
    wanted = args.runs or known
    if args.this_class:
        _record_this_class(wanted, keep_classes=args.add_class)
        return 0
    _record_this_class(wanted, keep_classes=False)
    for label, forcing in FORCINGS.items():
        print(f"-- recording the forced class {label!r}: {forcing}", flush=True)
        command = [sys.executable, "-m", "tests.golden.regenerate", "--this-class", "--add-class", *wanted]
        subprocess.run(command, env={**os.environ, **forcing}, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
