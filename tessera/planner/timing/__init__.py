"""Step time of a layout: compute, communication per mesh axis, their overlap, the pipeline
bubble and the optimizer (docs/planner.md, "Step time").

Communication is counted first, without the cluster (:func:`step_traffic`,
:mod:`~tessera.planner.timing.traffic`, with the tensor modes' families in
:mod:`~tessera.planner.timing.tensor`): logical bytes and calls per (op, axis) of one optimizer
step on the busiest rank, exactly as the comm ledger (``tessera.comm.ledger``) counts them. The
formulas are the strategies' own (docs/tensor-parallel.md "Costs", docs/zero.md,
docs/sequence-parallel.md, docs/pipeline.md); ``tests/dist/test_planner_timing.py`` holds them to
the ledger of real steps. Then each entry becomes seconds over the link its group runs on
(:func:`axis_link`, :mod:`~tessera.planner.timing.links`), and :func:`predict_time`
(:mod:`~tessera.planner.timing.prediction`) decides what overlaps with compute and adds the
pipeline bubble (:mod:`~tessera.planner.timing.bubble`).

The names below are the package's interface. Every memoised helper is among them (``stages``,
``simulated_bubble``, ``stage_plans``): ``tessera bench plan --scenarios`` clears the caches it
finds here to time the planner cold.
"""

from tessera.planner.timing.bubble import bubble_closed_form, pipeline_bubble, simulated_bubble
from tessera.planner.timing.counting import BUCKET_BYTES, Traffic
from tessera.planner.timing.links import axis_link, axis_span, base_axis
from tessera.planner.timing.partition import Stage, StageWork, local_parameters, stage_work, stages
from tessera.planner.timing.prediction import (
    BASE_AXES,
    DEFAULT_HOST_OPTIMIZER_RATE,
    predict_time,
    ranks_per_core,
    stage_plans,
)
from tessera.planner.timing.traffic import replica_axis, stage_traffic, step_traffic, zero_chunks

__all__ = [
    "BASE_AXES",
    "BUCKET_BYTES",
    "DEFAULT_HOST_OPTIMIZER_RATE",
    "Stage",
    "StageWork",
    "Traffic",
    "axis_link",
    "axis_span",
    "base_axis",
    "bubble_closed_form",
    "local_parameters",
    "pipeline_bubble",
    "predict_time",
    "ranks_per_core",
    "replica_axis",
    "simulated_bubble",
    "stage_plans",
    "stage_traffic",
    "stage_work",
    "stages",
    "step_traffic",
    "zero_chunks",
]
