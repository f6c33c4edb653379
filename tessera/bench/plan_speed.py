"""``tessera bench plan --scenarios``: how long the planner takes on the At-scale scenarios.

For each scenario of :data:`tessera.planner.scenarios.SCENARIOS` (LLaMA 70B on 1,024 A100s and
Colossal-AI's two 64-GPU settings) the planner runs ``repeats`` times and the median wall time is
kept, each run cold: the planner's memoised helpers are cleared before it, as in a fresh
``tessera plan`` process. Two rows per scenario: the time against the planner's bar (10 s for the 70B case, issue #20,
the same bar for the others), and against the anchor measured in the same run, one estimate of
the scenario's best layout (so the ratio, the planning time in single-layout estimates, does not
depend on how fast the machine is). Nothing here is asserted; docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tessera.bench.report import Row, print_rows, write_rows

BAR_S = 10.0  # the planner's bar for planning one scenario


def _clear_planner_caches() -> None:
    from tessera.planner import memory, search, timing

    for module in (memory, search, timing):
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _clear_planner_caches()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def scenario_rows(names: list[str] | None = None, repeats: int = 3, estimate_repeats: int = 50) -> list[Row]:
    """Rows ``plan <scenario>``: ``plan_time_s`` against the bar and against one estimate, and
    ``layouts_estimated`` against the shapes enumerated."""
    from tessera.planner.estimate import estimate
    from tessera.planner.scenarios import SCENARIOS

    rows: list[Row] = []
    for name in names or list(SCENARIOS):
        scenario = SCENARIOS[name]
        result = scenario.run()
        seconds = _median_seconds(scenario.run, repeats)
        model, best = scenario.model(), result.best.layout
        one = _median_seconds(lambda: estimate(model, best, scenario.workload, scenario.cluster), estimate_repeats)  # noqa: B023
        label = f"plan {name}"
        rows += [
            Row(label, "plan_time_s", seconds, f"bar {BAR_S:g} s", BAR_S),
            Row(label, "plan_time_s", seconds, "one estimate", one),
            Row(label, "layouts_estimated", result.stats.estimated, "shapes", result.stats.shapes),
        ]
    return rows


def main(args: argparse.Namespace) -> int:
    rows = scenario_rows()
    print_rows(rows)
    if args.out:
        write_rows(rows, args.out)
    return 0
