"""The layout rules (``tessera.context.rules``) are one table: each combination it refuses is
refused with the same words by config loading, by ``initialize`` (its choice of strategy, or
``ParallelDims``, which its context is built from, for the rules of the mesh itself), and by the
planner (``Layout.problems`` and ``tessera plan --set``); and the search never proposes what the
table refuses."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from tessera.cli import main
from tessera.config import load_config
from tessera.context import ParallelContext, ParallelDims
from tessera.context.rules import DIMS_PARTS, PARTS, RULES, Combination, check_combination, refusals
from tessera.engine.initialize import initialize
from tessera.engine.options import TrainingOptions
from tessera.errors import ConfigError
from tessera.gemini.options import GeminiOptions
from tessera.parallel.pipeline.stage import PipelineOptions
from tessera.planner import Cluster, Layout, Link, ModelSpec, Workload
from tessera.planner.search import Limits, shapes
from tessera.zero.policy import ZeroOptions, ZeroPolicy


def zero(stage: int) -> ZeroOptions:
    return ZeroOptions(policy=ZeroPolicy.for_stage(stage))


@dataclasses.dataclass(frozen=True)
class Case:
    """One refused combination, as the rules read it and as each part of tessera is given it: a
    config, the layout ``ParallelDims`` is given (with ``options``: ``initialize`` on it), a planner
    ``Layout``, and ``tessera plan --set`` assignments. None where that part cannot express the
    combination (the planner has no expert axis, no Gemini, no ``keep_blocks``)."""

    combination: Combination
    config: dict
    dims: dict | None = None
    options: TrainingOptions | None = None
    layout: dict | None = None
    plan_set: tuple[str, ...] = ()


CASES: dict[str, Case] = {
    "depth_is_2.5d_only": Case(
        Combination(tensor=4, tensor_depth=2),
        {"parallel": {"tensor": {"size": 4, "depth": 2}}},
        dims=dict(world_size=4, tensor=4, tensor_depth=2),
        layout=dict(tensor=4, depth=2),
        plan_set=("parallel.tensor.size=4", "parallel.tensor.depth=2"),
    ),
    "tensor_size_fits_the_grid": Case(
        Combination(tensor=8, tensor_mode="2d"),
        {"parallel": {"tensor": {"size": 8, "mode": "2d"}}},
        dims=dict(world_size=8, tensor=8, tensor_mode="2d"),
        layout=dict(tensor=8, tensor_mode="2d"),
        plan_set=("parallel.tensor.size=8", "parallel.tensor.mode=2d"),
    ),
    "sequence_parallel_regions_are_1d": Case(
        Combination(tensor=4, tensor_mode="2d", sequence_parallel=True),
        {"parallel": {"tensor": {"size": 4, "mode": "2d", "sequence_parallel": True}}},
        dims=dict(world_size=4, tensor=4, tensor_mode="2d", sequence_parallel=True),
        layout=dict(tensor=4, tensor_mode="2d", sequence_parallel=True),
        plan_set=("parallel.tensor.size=4", "parallel.tensor.mode=2d", "parallel.tensor.sequence_parallel=true"),
    ),
    "keep_blocks_is_for_grid_modes": Case(
        Combination(tensor=2, keep_blocks=True),
        {"parallel": {"tensor": {"size": 2, "keep_blocks": True}}},
        dims=dict(world_size=2, tensor=2, keep_blocks=True),
        plan_set=("parallel.tensor.size=2", "parallel.tensor.keep_blocks=true"),
    ),
    "chunks_need_interleaved": Case(
        Combination(pipeline=2, schedule="1f1b", microbatches=2, chunks=2),
        {"parallel": {"pipeline": {"size": 2, "chunks": 2}}},
        dims=dict(world_size=2, pipeline=2),
        options=TrainingOptions(pipeline=PipelineOptions(chunks=2)),
        layout=dict(pipeline=2, microbatches=2, chunks=2),
        plan_set=("parallel.pipeline.size=2", "parallel.pipeline.chunks=2"),
    ),
    "a_microbatch_per_stage": Case(
        Combination(pipeline=4, schedule="1f1b", microbatches=2),
        {"parallel": {"pipeline": {"size": 4, "microbatches": 2}}},
        dims=dict(world_size=4, pipeline=4),
        options=TrainingOptions(pipeline=PipelineOptions(microbatches=2)),
        layout=dict(pipeline=4, microbatches=2),
        plan_set=("parallel.pipeline.size=4", "parallel.pipeline.microbatches=2"),
    ),
    "interleaved_microbatches_in_groups_of_stages": Case(
        Combination(pipeline=2, schedule="interleaved", microbatches=3, chunks=2),
        {"parallel": {"pipeline": {"size": 2, "schedule": "interleaved", "chunks": 2, "microbatches": 3}}},
        dims=dict(world_size=2, pipeline=2),
        options=TrainingOptions(pipeline=PipelineOptions(schedule="interleaved", chunks=2, microbatches=3)),
        layout=dict(pipeline=2, schedule="interleaved", chunks=2, microbatches=3),
        plan_set=(
            "parallel.pipeline.size=2",
            "parallel.pipeline.schedule=interleaved",
            "parallel.pipeline.chunks=2",
            "parallel.pipeline.microbatches=3",
        ),
    ),
    "expert_divides_data": Case(
        Combination(data=3, expert=2),
        {"parallel": {"data": 3, "expert": 2}},
        dims=dict(world_size=3, data=3, expert=2),
        plan_set=("parallel.data=3", "parallel.expert.size=2"),
    ),
    "expert_with_1d_tensor": Case(
        Combination(data=2, expert=2, tensor=4, tensor_mode="2d"),
        {"parallel": {"data": 2, "expert": 2, "tensor": {"size": 4, "mode": "2d"}}},
        dims=dict(world_size=8, data=2, expert=2, tensor=4, tensor_mode="2d"),
        options=TrainingOptions(),
        plan_set=("parallel.expert.size=2", "parallel.tensor.size=4", "parallel.tensor.mode=2d"),
    ),
    "expert_without_sequence_parallel_regions": Case(
        Combination(data=2, expert=2, tensor=2, sequence_parallel=True),
        {"parallel": {"data": 2, "expert": 2, "tensor": {"size": 2, "sequence_parallel": True}}},
        dims=dict(world_size=4, data=2, expert=2, tensor=2, sequence_parallel=True),
        options=TrainingOptions(),
        plan_set=("parallel.expert.size=2", "parallel.tensor.size=2", "parallel.tensor.sequence_parallel=true"),
    ),
    "sequence_with_1d_tensor": Case(
        Combination(sequence=2, tensor=4, tensor_mode="2d"),
        {"parallel": {"sequence": 2, "tensor": {"size": 4, "mode": "2d"}}},
        dims=dict(world_size=8, sequence=2, tensor=4, tensor_mode="2d"),
        options=TrainingOptions(),
        layout=dict(data=1, tensor=4, tensor_mode="2d", sequence=2),
        plan_set=("parallel.tensor.size=4", "parallel.tensor.mode=2d", "parallel.sequence.size=2"),
    ),
    "offload_needs_zero": Case(
        Combination(offload=True),
        {"zero": {"offload_optimizer": "cpu"}},
        layout=dict(data=2, offload=True),
        plan_set=("zero.offload_optimizer=cpu",),
    ),
    "gemini_is_not_planned": Case(
        Combination(auto=True, gemini=True), {"parallel": "auto", "gemini": {"enabled": True}}
    ),
    "gemini_is_its_own_zero": Case(
        Combination(zero=1, gemini=True),
        {"zero": {"stage": 1}, "gemini": {"enabled": True}},
        dims=dict(world_size=1),
        options=TrainingOptions(zero=zero(1), gemini=GeminiOptions()),
        plan_set=("zero.stage=1", "gemini.enabled=true"),
    ),
    "gemini_without_pipeline": Case(
        Combination(pipeline=2, gemini=True),
        {"parallel": {"pipeline": 2}, "gemini": {"enabled": True}},
        dims=dict(world_size=2, pipeline=2),
        options=TrainingOptions(gemini=GeminiOptions()),
        plan_set=("parallel.pipeline.size=2", "gemini.enabled=true"),
    ),
    "zero_2_3_without_pipeline": Case(
        Combination(pipeline=2, zero=2),
        {"parallel": {"pipeline": 2}, "zero": {"stage": 2}},
        dims=dict(world_size=2, pipeline=2),
        options=TrainingOptions(zero=zero(2)),
        layout=dict(pipeline=2, microbatches=2, zero=2),
        plan_set=("parallel.pipeline.size=2", "zero.stage=2"),
    ),
    "host_shard_needs_sharding": Case(Combination(host_shard=True), {"zero": {"shard": "host"}}),
    "host_shard_without_experts": Case(
        Combination(data=4, expert=2, zero=3, host_shard=True),
        {"parallel": {"data": 4, "expert": 2}, "zero": {"stage": 3, "shard": "host"}},
        dims=dict(world_size=4, data=4, expert=2),
        options=TrainingOptions(zero=ZeroOptions(policy=ZeroPolicy.for_stage(3), shard="host")),
    ),
    "host_shard_without_pipeline": Case(
        Combination(pipeline=2, zero=1, host_shard=True),
        {"parallel": {"pipeline": 2}, "zero": {"stage": 1, "shard": "host"}},
        dims=dict(world_size=2, pipeline=2),
        options=TrainingOptions(zero=ZeroOptions(policy=ZeroPolicy.for_stage(1), shard="host")),
    ),
}


def refusal(action) -> str:
    """The message of the ConfigError ``action()`` raises."""
    with pytest.raises(ConfigError) as caught:
        action()
    return str(caught.value)


def context_of(dims: ParallelDims) -> ParallelContext:
    """A one-process context that reports ``dims`` as its layout (as ``tessera.testing`` lends one
    a layout's options): enough for ``initialize``, which checks the layout before it uses a group."""
    ctx = copy.copy(ParallelContext.alone("cpu"))
    ctx.dims = dims
    return ctx


def plan_error(capsys, assignments: tuple[str, ...]) -> str:
    """The error ``tessera plan --set ...`` ends with."""
    argv = ["plan", "--model", "llama:7b", "--devices", "8"]
    assert main([*argv, *(arg for item in assignments for arg in ("--set", item))]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("tessera plan: error: ")
    return last.removeprefix("tessera plan: error: ")


def test_every_rule_has_a_case_and_a_part():
    assert [rule.name for rule in RULES] == list(CASES)  # a new rule brings its case, in the table's order
    assert len({rule.name for rule in RULES}) == len(RULES)
    assert {rule.part for rule in RULES} == set(PARTS) and set(DIMS_PARTS) < set(PARTS)
    for name, case in CASES.items():  # ParallelDims refuses the rules of its parts, initialize the others
        part = next(rule.part for rule in RULES if rule.name == name)
        assert case.dims is None or (case.options is None) == (part in DIMS_PARTS), name


@pytest.mark.parametrize("name", list(CASES))
def test_a_refused_combination_has_the_same_words_everywhere(name, capsys):
    case, rule = CASES[name], next(rule for rule in RULES if rule.name == name)
    assert [r.name for r in refusals(case.combination)] == [name]
    message = rule.message(case.combination)
    assert refusal(lambda: check_combination(case.combination)) == message
    assert refusal(lambda: load_config(case.config)) == message
    if case.dims is not None and case.options is None:  # the mesh's own rules: ParallelDims, initialize's context
        assert refusal(lambda: ParallelDims(**case.dims)) == message
    if case.options is not None:  # the other rules: initialize's choice of strategy
        model = nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx = context_of(ParallelDims(**case.dims))
        assert refusal(lambda: initialize(model, optimizer, ctx=ctx, options=case.options)) == message
    if case.layout is not None:  # the planner's candidate filter and its explanations
        layout = Layout(**case.layout)
        assert layout.problems() == [message]
        assert [r.name for r in refusals(layout.combination())] == [name]
    if case.plan_set:
        assert plan_error(capsys, case.plan_set) == message


def test_a_2d_layout_with_sequence_parallelism_reads_the_same_from_plan_and_initialize(capsys):
    words = (
        "sequence parallelism composes with 1d tensor parallelism, not '2d': use parallel.tensor.mode='1d' or "
        "parallel.sequence.size=1"
    )
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = context_of(ParallelDims(8, sequence=2, tensor=4, tensor_mode="2d"))  # a mesh of any shape has groups
    assert refusal(lambda: initialize(model, optimizer, ctx=ctx, options=TrainingOptions())) == words
    assert refusal(lambda: load_config(None, ["parallel.sequence.size=2", "parallel.tensor.size=4",
                                              "parallel.tensor.mode=2d"])) == words  # fmt: skip
    assert (
        plan_error(capsys, ("parallel.sequence.size=2", "parallel.tensor.size=4", "parallel.tensor.mode=2d")) == words
    )
    assert Layout(tensor=4, tensor_mode="2d", sequence=2).problems() == [words]


def test_combinations_the_table_allows_pass_everywhere():
    check_combination(Combination(pipeline=2, schedule="gpipe", microbatches=1, zero=1))
    assert load_config({"parallel": {"pipeline": 2}, "zero": {"stage": 1}}).zero.stage == 1
    assert not Layout(pipeline=2, microbatches=2, zero=1).problems()
    assert ParallelDims(8, data=4, expert=2, sequence=2).expert == 2
    assert load_config({"parallel": {"data": 4, "expert": 2, "sequence": 2}, "gemini": {"enabled": True}}).gemini.active
    # interleaved with one chunk a rank is plain 1F1B: no groups of p to keep
    check_combination(Combination(pipeline=2, schedule="interleaved", microbatches=3, chunks=1))
    # an unknown field is not judged: the config knows no world size, ParallelDims no schedule
    check_combination(Combination(expert=2, data=None))
    check_combination(Combination(pipeline=4, schedule=None, microbatches=None))


SMALL = ModelSpec(name="small", family="gpt", n_layers=4, d_model=96, n_heads=6, ff_dim=384, vocab_size=128, seq_len=32)


def cluster(devices: int) -> Cluster:
    return Cluster(devices=devices, device_memory=2**40, flops=1e12, intra=Link(100e9, 1e-5),
                   inter=Link(10e9, 2e-5), devices_per_node=devices)  # fmt: skip


def test_the_search_proposes_nothing_the_table_refuses():
    found = list(shapes(SMALL, cluster(8), Workload(global_batch=8), Limits(), within_node=True))
    assert found and not any(refusals(dataclasses.replace(s, schedule="gpipe").combination()) for s in found)
    assert {"2d", "2.5d", "3d"} <= {s.tensor_mode for s in found} and any(s.sequence > 1 for s in found)
    assert not any(s.sequence > 1 and s.tensor > 1 and s.tensor_mode != "1d" for s in found)
    assert not any(s.sequence_parallel and s.tensor_mode != "1d" for s in found)


def test_tessera_plan_set_fixes_the_layout_and_refuses_keys_it_does_not_choose(capsys):
    argv = ["plan", "--model", "llama:7b", "--devices", "16", "--nodes", "2", "--device-memory", "40GiB",
            "--global-batch", "64", "--top", "3"]  # fmt: skip
    assert main([*argv, "--set", "parallel.tensor.size=4", "--set", "zero.stage=1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ranked = lines[1:4]
    assert [line.split()[0] for line in ranked] == ["1", "2", "3"]
    assert all("tp4(" in line and " z1" in line for line in ranked), ranked
    error = plan_error(capsys, ("trainer.steps=5",))
    assert error.startswith("--set trainer.steps: not a choice the planner makes; it fixes parallel.data, ")
