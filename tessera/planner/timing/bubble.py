"""The pipeline bubble: a rank's idle time in one step, in closed form where one is known to hold,
else from the schedule simulator (tessera's runtime model)."""

from __future__ import annotations

from functools import lru_cache


def bubble_closed_form(schedule: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """Idle time of a rank in one step, with ``f``, ``b``, ``w`` a stage's forward, input-gradient
    and weight-gradient time per micro-batch: ``(p-1)(f+b+w)/v`` for GPipe, 1F1B and interleaved
    (``v`` chunks), ``(p-1)(f+b-w)`` for ZB-H1 where ``w <= min(f, b)``; None where no closed form
    is known to hold. Transfers free; tessera's runtime (receives posted early and waited for
    lazily) meets these for any costs, which ``tests/unit/test_planner_timing.py`` checks
    against the simulator."""
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b", "interleaved"):
        return (p - 1) * (f + b + w) / (v if schedule == "interleaved" else 1)
    if schedule == "zero_bubble" and w <= min(f, b):
        return (p - 1) * (f + b - w)
    return None


@lru_cache(maxsize=1024)
def simulated_bubble(schedule: str, p: int, m: int, v: int, f: int, b: int, w: int) -> float:
    """Idle time of a rank in one step from the schedule simulator (tessera's runtime model:
    ``post_early`` lists, lazy receives), in the units of the integer costs ``f``, ``b``, ``w``
    (per chunk and micro-batch). Cached: the search asks for the same few shapes again and again."""
    from tessera.parallel.pipeline.p2p_placement import post_early
    from tessera.parallel.pipeline.schedules import build_schedule
    from tessera.parallel.pipeline.simulate import simulate

    costs = {"F": f, "B": b, "W": w}
    actions = [post_early(rank) for rank in build_schedule(schedule, p, m, v, costs=costs)]
    result = simulate(actions, costs, lazy_receive=True)
    return float(result.makespan) - m * v * (f + b + w)


def pipeline_bubble(schedule: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Idle seconds of a pipeline rank in one step (:func:`bubble_closed_form`, else the cached
    simulator on costs rounded to 1/16 of the forward)."""
    closed = bubble_closed_form(schedule, p, m, v, f, b, w)
    if closed is not None or f <= 0:
        return closed or 0.0
    unit = f / v / 16  # the simulator's costs are per chunk
    fq, bq, wq = max(1, round(f / v / unit)), max(1, round(b / v / unit)), round(w / v / unit)
    return simulated_bubble(schedule, p, m, v, fq, bq, wq) * unit
