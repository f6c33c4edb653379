"""The layout rules: which axes, tensor modes, pipeline schedules and strategies combine, as one
table of data.

Each :class:`Rule` is a predicate over a :class:`Combination` (a parallel layout and the strategy
choices made on it) and the message that refuses it. Every part of tessera that accepts or
refuses a layout reads this table through :func:`check_combination` or :func:`refusals`: the
config's ``validate`` methods, ``initialize``'s choice of strategy, the planner's search and its
explanations (``tessera plan``), and :class:`~tessera.context.dims.ParallelDims` for the rules of
its own mesh (:data:`DIMS_PARTS`). So one combination is refused in one place, with the same
words everywhere.

What is not here: the range of each value on its own (a size of at least 1, a known mode name:
checked where the value is read), whether the layout fits the world (needs the world size:
``ParallelDims``), and whether a model splits that way (needs the model: the planner's
enumeration, ``initialize``'s ``check_model_fits_layout``, the config's layer count).

A field left unknown (``data=None``, ``schedule=None``, ``microbatches=None``) is not judged:
the config knows no world size, and ``ParallelDims`` no pipeline schedule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from tessera.errors import ConfigError


def integer_root(value: int, power: int) -> int | None:
    """Return ``r`` with ``r**power == value``, or None when there is none."""
    if value < 1:
        return None
    root = round(value ** (1.0 / power))
    for candidate in (root - 1, root, root + 1):
        if candidate >= 1 and candidate**power == value:
            return candidate
    return None


class Combination(NamedTuple):
    """A parallel layout and the strategy choices run on it, as the layout rules read them.

    Axis sizes and tensor options mean what they mean in ``ParallelDims``; ``schedule``,
    ``microbatches`` and ``chunks`` are the pipeline's (``microbatches`` per step); ``zero`` is
    the ZeRO stage (0: off), ``offload`` whether optimizer states live on the host, ``gemini``
    whether Gemini manages the model states, ``auto`` whether the planner chooses the layout,
    ``host_shard`` whether the model states are sharded over each host's data ranks
    (``zero.shard="host"``).
    A named tuple (change fields with ``_replace``): the planner's search makes one per
    candidate, and a tuple is made four times as fast as a frozen dataclass.
    """

    data: int | None = None
    pipeline: int = 1
    sequence: int = 1
    tensor: int = 1
    tensor_mode: str = "1d"
    tensor_depth: int = 1
    sequence_parallel: bool = False
    keep_blocks: bool = False
    expert: int = 1
    schedule: str | None = None
    microbatches: int | None = None
    chunks: int = 1
    zero: int = 0
    offload: bool = False
    gemini: bool = False
    auto: bool = False
    host_shard: bool = False


@dataclass(frozen=True)
class Rule:
    """One layout rule: ``refuses(c)`` is true for the combinations it refuses, and ``message(c)``
    says why, naming the config keys to change. ``name`` identifies it in tests and docs;
    ``part`` is what it constrains (one of :data:`PARTS`)."""

    name: str
    part: str
    refuses: Callable[[Combination], bool]
    message: Callable[[Combination], str]


#: what a rule constrains: the tensor mode and its options, the pipeline's schedule, the mesh of
#: ranks (how the expert axis splits the data axis), how the axes combine in tessera's layers,
#: and how the strategies combine with the layout and with each other
PARTS: tuple[str, ...] = ("tensor", "pipeline", "mesh", "axes", "strategy")
#: the parts ``ParallelDims`` checks: its own tensor options and the mesh it lays ranks out on.
#: Group tables exist for any such mesh (tests build them for every shape); whether tessera's
#: layers and strategies run on it is checked by what runs them: the config, ``initialize``, the
#: planner
DIMS_PARTS: tuple[str, ...] = ("tensor", "mesh")


# ---- the rules' predicates (a field that is None is unknown: not judged) ------------------------


def _grid_mode_off_shape(c: Combination) -> bool:
    """A grid tensor mode whose size is not its grid's: 2d q^2, 2.5d depth x q^2, 3d q^3."""
    if c.tensor_mode == "2d":
        return integer_root(c.tensor, 2) is None
    if c.tensor_mode == "2.5d":
        return c.tensor % c.tensor_depth != 0 or integer_root(c.tensor // c.tensor_depth, 2) is None
    if c.tensor_mode == "3d":
        return integer_root(c.tensor, 3) is None
    return False


def _grid_shape_message(c: Combination) -> str:
    if c.tensor_mode == "2d":
        return (
            f"parallel.tensor.size={c.tensor} is not allowed for mode '2d': 2D (SUMMA) tensor "
            "parallelism runs on a q x q grid, so the size must be a square (1, 4, 9, 16, ...)"
        )
    if c.tensor_mode == "2.5d":
        depth = c.tensor_depth
        return (
            f"parallel.tensor.size={c.tensor} with depth={depth} is not allowed for mode '2.5d': "
            "2.5D (Tesseract) stacks `depth` q x q grids, so the size must be depth * q^2 "
            f"(with depth={depth}: {', '.join(str(depth * q * q) for q in range(1, 5))}, ...)"
        )
    return (
        f"parallel.tensor.size={c.tensor} is not allowed for mode '3d': 3D tensor parallelism "
        "runs on a q x q x q cube, so the size must be a cube (1, 8, 27, 64, ...)"
    )


def _grid_tensor(c: Combination) -> bool:
    """More than one tensor rank in a mode other than 1d."""
    return c.tensor > 1 and c.tensor_mode != "1d"


def _too_few_microbatches(c: Combination) -> bool:
    if c.schedule is None or c.microbatches is None:
        return False
    return c.pipeline > 1 and c.schedule != "gpipe" and c.microbatches < c.pipeline


def _interleaved_groups_broken(c: Combination) -> bool:
    if c.schedule != "interleaved" or c.microbatches is None:
        return False
    return c.pipeline > 1 and c.chunks > 1 and c.microbatches % c.pipeline != 0


RULES: tuple[Rule, ...] = (
    # ---- the tensor mode and its options
    Rule(
        "depth_is_2.5d_only",
        "tensor",
        lambda c: c.tensor_mode != "2.5d" and c.tensor_depth != 1,
        lambda c: (
            f"parallel.tensor.depth={c.tensor_depth} is only used by mode '2.5d' (mode is {c.tensor_mode!r}); "
            "leave depth at 1"
        ),
    ),
    Rule("tensor_size_fits_the_grid", "tensor", _grid_mode_off_shape, _grid_shape_message),
    Rule(
        "sequence_parallel_regions_are_1d",
        "tensor",
        lambda c: c.sequence_parallel and c.tensor_mode != "1d",
        lambda c: f"parallel.tensor.sequence_parallel=True needs mode '1d' (mode is {c.tensor_mode!r})",
    ),
    Rule(
        "keep_blocks_is_for_grid_modes",
        "tensor",
        lambda c: c.keep_blocks and c.tensor_mode == "1d",
        lambda c: (
            "parallel.tensor.keep_blocks=True keeps the weight and activation blocks that modes '2d', '2.5d' "
            "and '3d' move in the forward; mode '1d' moves none"
        ),
    ),
    # ---- the pipeline schedule
    Rule(
        "chunks_need_interleaved",
        "pipeline",
        lambda c: c.schedule is not None and c.schedule != "interleaved" and c.chunks != 1,
        lambda c: f"parallel.pipeline.chunks={c.chunks} needs schedule='interleaved' (schedule is {c.schedule!r})",
    ),
    Rule(
        "a_microbatch_per_stage",
        "pipeline",
        _too_few_microbatches,
        lambda c: (
            f"parallel.pipeline.microbatches={c.microbatches} is fewer than the {c.pipeline} stages: schedule "
            f"{c.schedule!r} needs at least one micro-batch per stage in flight (use >= {c.pipeline}, or 'gpipe')"
        ),
    ),
    Rule(
        "interleaved_microbatches_in_groups_of_stages",
        "pipeline",
        _interleaved_groups_broken,
        lambda c: (
            f"parallel.pipeline.microbatches={c.microbatches} is not a multiple of the {c.pipeline} stages: "
            f"schedule 'interleaved' sends micro-batches through each rank's {c.chunks} chunks in groups of "
            f"{c.pipeline}"
        ),
    ),
    # ---- how the axes combine
    Rule(
        "expert_divides_data",
        "mesh",
        lambda c: c.data is not None and c.expert > 1 and c.data % c.expert != 0,
        lambda c: (
            f"parallel.expert.size={c.expert} must divide the data-parallel degree {c.data}: experts are "
            "spread over data ranks (each group of `expert` data ranks holds every expert once)"
        ),
    ),
    Rule(
        "expert_with_1d_tensor",
        "axes",
        lambda c: c.expert > 1 and _grid_tensor(c),
        lambda c: (
            "expert parallelism composes with 1d tensor parallelism (inside each expert), not "
            f"{c.tensor_mode!r}: use parallel.tensor.mode='1d' or parallel.expert.size=1"
        ),
    ),
    Rule(
        "expert_without_sequence_parallel_regions",
        "axes",
        lambda c: c.expert > 1 and c.sequence_parallel,
        lambda c: (
            f"parallel.expert.size={c.expert} with parallel.tensor.sequence_parallel=True: MoE layers route "
            "whole tokens on every tensor rank; turn sequence_parallel off"
        ),
    ),
    Rule(
        "sequence_with_1d_tensor",
        "axes",
        lambda c: c.sequence > 1 and _grid_tensor(c),
        lambda c: (
            f"sequence parallelism composes with 1d tensor parallelism, not {c.tensor_mode!r}: "
            "use parallel.tensor.mode='1d' or parallel.sequence.size=1"
        ),
    ),
    # ---- how the strategies combine with the layout and with each other
    Rule(
        "offload_needs_zero",
        "strategy",
        lambda c: c.offload and c.zero == 0,
        lambda c: "zero.offload_optimizer='cpu' needs stage >= 1",
    ),
    Rule(
        "gemini_is_not_planned",
        "strategy",
        lambda c: c.gemini and c.auto,
        lambda c: (
            "gemini with parallel='auto': the planner chooses ZeRO stages and offload, not Gemini's chunks; "
            "set the layout by hand with gemini, or turn gemini off"
        ),
    ),
    Rule(
        "gemini_is_its_own_zero",
        "strategy",
        lambda c: c.gemini and c.zero > 0,
        lambda c: (
            f"gemini with zero.stage={c.zero}: Gemini is ZeRO-3 over the data axis with chunks placed on "
            "device, host and disk; set zero.stage=0 (or turn gemini off)"
        ),
    ),
    Rule(
        "gemini_without_pipeline",
        "strategy",
        lambda c: c.gemini and c.pipeline > 1,
        lambda c: (
            f"gemini with parallel.pipeline.size={c.pipeline}: Gemini does not run pipeline stages; use it "
            "with data, tensor, sequence and expert parallelism"
        ),
    ),
    Rule(
        "zero_2_3_without_pipeline",
        "strategy",
        lambda c: c.zero >= 2 and c.pipeline > 1,
        lambda c: (
            f"zero.stage={c.zero} with parallel.pipeline.size={c.pipeline}: stages 2 and 3 reduce (and free) "
            "gradients during every backward pass, but a pipeline step runs many backward passes and sums tied "
            "weights' gradients across stages afterwards; use zero.stage=1 with pipeline stages"
        ),
    ),
    Rule(
        "host_shard_needs_sharding",
        "strategy",
        lambda c: c.host_shard and c.zero == 0 and not c.gemini,
        lambda c: (
            "zero.shard='host' shards the model state over the data ranks of each host, but nothing is sharded: "
            "set zero.stage >= 1 (or turn gemini on), or leave zero.shard='all'"
        ),
    ),
    Rule(
        "host_shard_without_experts",
        "strategy",
        lambda c: c.host_shard and c.expert > 1,
        lambda c: (
            f"zero.shard='host' with parallel.expert.size={c.expert}: an MoE layer's experts are sharded over the "
            "ranks holding the same experts, which hybrid sharding does not split by host; use zero.shard='all'"
        ),
    ),
    Rule(
        "host_shard_without_pipeline",
        "strategy",
        lambda c: c.host_shard and c.pipeline > 1,
        lambda c: (
            f"zero.shard='host' with parallel.pipeline.size={c.pipeline}: hybrid sharding is not run with "
            "pipeline stages; use zero.shard='all' with pipelines"
        ),
    ),
)


@functools.cache
def rules_of(parts: tuple[str, ...]) -> tuple[Rule, ...]:
    """The rules of ``parts``, in the table's order (the planner asks for a few parts per candidate)."""
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"no layout rules constrain {sorted(unknown)}; parts: {', '.join(PARTS)}")
    return tuple(rule for rule in RULES if rule.part in parts)


def refusals(combination: Combination, parts: tuple[str, ...] = PARTS) -> list[Rule]:
    """The rules of ``parts`` that refuse ``combination``, in the table's order (empty: it may run)."""
    return [rule for rule in rules_of(parts) if rule.refuses(combination)]


def problems(combination: Combination, parts: tuple[str, ...] = PARTS) -> list[str]:
    """The messages of every rule of ``parts`` that refuses ``combination`` (empty: it may run)."""
    return [rule.message(combination) for rule in refusals(combination, parts)]


def check_combination(combination: Combination, parts: tuple[str, ...] = PARTS) -> None:
    """Raise ConfigError with the message of the first rule of ``parts`` that refuses ``combination``."""
    for rule in rules_of(parts):
        if rule.refuses(combination):
            raise ConfigError(rule.message(combination))
