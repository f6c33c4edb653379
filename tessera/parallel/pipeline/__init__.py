"""Pipeline parallelism. Schedules are data: ``schedules.py`` builds one action list per rank
(GPipe, 1F1B, interleaved 1F1B, ZB-H1); ``simulate.py`` checks them and runs them on paper,
finding deadlocks, bubbles and peak activations. Neither needs torch or processes.

``partition.py`` cuts a model's blocks into stages; ``runtime.py`` executes a rank's action list
on its chunks with batched point-to-point transfers through ``tessera.comm`` (import them from
their modules: they need torch)."""

from tessera.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    DeadlockError,
    Kind,
    Schedule,
    ScheduleError,
    add_p2p,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    partner,
    post_early,
    stage_rank,
    zero_bubble_h1,
)
from tessera.parallel.pipeline.simulate import Interval, Simulation, format_timeline, simulate, validate

__all__ = [
    "SCHEDULES",
    "Action",
    "DeadlockError",
    "Interval",
    "Kind",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "add_p2p",
    "build_schedule",
    "format_timeline",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "partner",
    "post_early",
    "simulate",
    "stage_rank",
    "validate",
    "zero_bubble_h1",
]
