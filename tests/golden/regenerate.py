"""Regenerate the golden files in ``tests/golden/curves/``.

    python -m tests.golden.regenerate            # every run
    python -m tests.golden.regenerate dp4 zero3-dp4
    python -m tests.golden.regenerate --list

Run from the repository root. Each run is computed twice and written only if both give the same
bits; the files are then checked by ``tests/dist/test_golden_curves.py`` and
``tests/e2e/test_golden_train.py`` (see docs/testing.md, "Golden loss curves").
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from tests.golden import default_train, strategies
from tests.golden.record import write_golden

PRODUCED_BY = "python -m tests.golden.regenerate"


def _twice(name: str, compute) -> dict:
    first, second = compute(), compute()
    if first != second:
        raise SystemExit(f"golden run {name!r} is not deterministic: two computations differ; nothing written")
    return first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.golden.regenerate", description=__doc__.split("\n")[1])
    parser.add_argument("runs", nargs="*", help="run names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the runs and exit")
    args = parser.parse_args(argv)
    known = [default_train.NAME, *strategies.RUNS]
    if args.list:
        print("\n".join(known))
        return 0
    unknown = [r for r in args.runs if r not in known]
    if unknown:
        parser.error(f"unknown run(s) {unknown}; known: {', '.join(known)}")
    wanted = args.runs or known
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if default_train.NAME in wanted:
        with tempfile.TemporaryDirectory() as tmp:
            counter = iter(range(2))
            numbers = _twice(default_train.NAME, lambda: default_train.compute(Path(tmp) / f"run{next(counter)}"))
        path = write_golden(default_train.NAME, default_train.definition(), numbers, PRODUCED_BY)
        print(f"wrote {path}", flush=True)
    names = [n for n in wanted if n in strategies.RUNS]
    if names:
        from tessera.testing import PoolSet

        pools = PoolSet()
        try:
            for name in sorted(names, key=lambda n: strategies.RUNS[n].ranks):  # one pool size at a time
                numbers = _twice(name, lambda: strategies.compute(pools, name))  # noqa: B023 -- called at once
                path = write_golden(name, strategies.RUNS[name].definition(), numbers, PRODUCED_BY)
                print(f"wrote {path}", flush=True)
        finally:
            pools.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
