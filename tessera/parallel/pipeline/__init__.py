"""Pipeline parallelism. Schedules are data, built and checked without torch or processes:
``actions.py`` defines the actions a schedule is made of (and what each needs, makes and
costs); ``schedules.py`` builds one action list per rank (GPipe, 1F1B, interleaved 1F1B,
ZB-H1); ``p2p_placement.py`` places their sends and receives so that no schedule can deadlock;
``simulate.py`` checks schedules and runs them on paper, finding deadlocks, bubbles and peak
activations.

``partition.py`` cuts a model's blocks into stages; ``runtime.py`` executes a rank's action
list on its chunks (a dispatch over the actions) with batched point-to-point transfers through
``tessera.comm``, whose messages ``wire.py`` lays out (shape headers, receive buffers, the loss
riding on the last gradient); ``backward.py`` splits a backward into B and W; ``measure.py``
records a step's busy time and saved activations; ``stage.py`` puts it together for the engine
(import these from their modules: they need torch)."""

from tessera.parallel.pipeline.actions import (
    Action,
    DeadlockError,
    Kind,
    Schedule,
    ScheduleError,
    partner,
    stage_rank,
)
from tessera.parallel.pipeline.p2p_placement import add_p2p, post_early
from tessera.parallel.pipeline.schedules import (
    SCHEDULES,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
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
