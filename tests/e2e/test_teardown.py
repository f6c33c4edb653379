"""Short runs end cleanly, every time: no rank aborts at exit after training succeeded (a gloo
worker thread left running into the interpreter's exit used to abort about one run in seven on
a busy machine; see tessera.comm.group). benchmarks/teardown.py runs many more."""

from __future__ import annotations

from tessera.testing import free_port
from tests.e2e.test_cli import HERE, results, run, tessera_cmd

SHORT_RUN = HERE / "scripts" / "short_run.py"
RUNS = 4


def test_short_two_rank_runs_all_exit_zero():
    failures = []
    for attempt in range(RUNS):
        out = run([*tessera_cmd(), "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                   str(SHORT_RUN)], timeout=120)  # fmt: skip
        if out.returncode != 0:
            failures.append(f"run {attempt}: exit {out.returncode}\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
            continue
        rows = results(out.stdout)
        assert [r["rank"] for r in rows] == ["0", "1"], out.stdout
        assert rows[0]["loss"] == rows[1]["loss"], "the ranks agree on the loss"
    assert not failures, "\n".join(failures)
