"""Run many short multi-rank training runs in a row and count those that do not exit 0.

Each run is ``tessera train`` (the tiny GPT, ZeRO-1, a few steps) on ``--nproc`` local ranks, the
run the teardown abort was first seen in: a rank that died at exit ("terminate called without an
active exception") after training succeeded made about one run in seven fail on a busy machine.
Prints each run's exit code and time, then a summary; exits 1 if any run failed.

    python benchmarks/teardown.py                # 50 runs of 4 ranks
    python benchmarks/teardown.py --runs 10 --nproc 2 --set zero.stage=2
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time

SHORT_RUN = [
    "zero.stage=1",
    "trainer.steps=3",
    "trainer.eval_batches=1",
    "trainer.progress_bar=false",
    "data.max_bytes=200000",
    "data.micro_batch_size=4",
]


def one_run(nproc: int, overrides: list[str], timeout: float) -> tuple[int, float, str]:
    """Exit code, seconds and the output's tail of one ``tessera train`` run."""
    with tempfile.TemporaryDirectory(prefix="tessera-teardown-") as out_dir:
        cmd = [sys.executable, "-m", "tessera.cli", "train", "--nproc", str(nproc), "--output-dir", out_dir]
        for item in [*SHORT_RUN, *overrides]:
            cmd += ["--set", item]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            parts = [p.decode(errors="replace") if isinstance(p, bytes) else p or "" for p in (exc.stdout, exc.stderr)]
            code, output = -1, f"timed out after {timeout:g} s\n" + "".join(parts)
        return code, time.perf_counter() - start, output[-1500:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="consecutive runs (default 50)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks per run (default 4)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    args = parser.parse_args(argv)

    codes: collections.Counter[int] = collections.Counter()
    seconds = []
    for n in range(1, args.runs + 1):
        code, took, tail = one_run(args.nproc, args.set, args.timeout)
        codes[code] += 1
        seconds.append(took)
        print(f"run {n:3d}/{args.runs}: exit {code} ({took:.1f} s)", flush=True)
        if code != 0:
            print("    " + tail.replace("\n", "\n    "), flush=True)
    failed = args.runs - codes[0]
    print(
        f"{args.runs} runs of {args.nproc} ranks: {codes[0]} exited 0, {failed} failed "
        f"(exit codes {dict(sorted(codes.items()))}); {sum(seconds) / len(seconds):.1f} s per run",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
