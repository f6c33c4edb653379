"""The planner's step-time model (tessera.planner.timing) without processes: communication per
(op, axis) against the formulas of the strategies' docs, bubbles against the schedule simulator,
the direction of every knob, and the links each axis runs over. The real ledger of real steps is
tests/dist/test_planner_timing.py."""

from __future__ import annotations

import dataclasses
import random
import time
from fractions import Fraction

import pytest

from tessera.parallel.pipeline.p2p_placement import post_early
from tessera.parallel.pipeline.schedules import build_schedule
from tessera.parallel.pipeline.simulate import simulate
from tessera.planner import Cluster, Layout, Link, Workload
from tessera.planner.spec import from_gpt_preset, resolve_model
from tessera.planner.timing import (
    axis_link,
    bubble_closed_form,
    pipeline_bubble,
    predict_time,
    stage_work,
    stages,
    step_traffic,
)
from tests.conftest import REPORT

E = 4  # fp32
B, S, H, FF, V = 4, 16, 32, 128, 64  # batch of the tensor group, sequence, width, MLP, vocabulary
FP32 = Workload(global_batch=B)
CLUSTER = Cluster(devices=8, device_memory=2**34, flops=1e11, intra=Link(1e10, 1e-5), inter=Link(1e9, 1e-4))


def gpt(layers: int = 2):
    return from_gpt_preset("tiny", vocab_size=V, max_seq_len=S, d_model=H, n_layers=layers, n_heads=4)


def per_axis(layers: int, layout: Layout, workload: Workload = FP32) -> dict[str, float]:
    """Logical bytes per ledger axis of one step."""
    out: dict[str, float] = {}
    for (_, axis), t in step_traffic(gpt(layers), layout, workload).items():
        out[axis] = out.get(axis, 0.0) + t.bytes
    return out


def per_block(layout: Layout) -> dict[str, float]:
    """Bytes one more block adds per axis: the block's own formula, boundaries aside."""
    more, less = per_axis(3, layout), per_axis(2, layout)
    return {axis: more[axis] - less.get(axis, 0.0) for axis in more if more[axis] != less.get(axis, 0.0)}


def ring(p: int) -> float:
    return (p - 1) / p


# ---- tensor parallelism: docs/tensor-parallel.md, "Costs" ------------------------------------------


def summa_linear(q: int, d: int, fin: int, fout: int, tokens: int) -> float:
    """The 2D line of its form ("abt" when out < in), T/d for 2.5D, plus the depth term."""
    t = tokens / d
    bias = 2 * ring(q) * E * fout / q
    if fout >= fin:
        c = 3 * (q - 1) * E * (t * fin + fin * fout) / q**2 + bias
    else:
        c = (q - 1) * E * (2 * t * fout + 3 * fin * fout) / q**2 + bias
    return c + 2 * ring(d) * E * (fin * fout / q**2 + fout / q)


def summa_norm(q: int, d: int, tokens: int) -> float:
    return 8 * ring(q) * E * tokens / (d * q) + 4 * ring(q) * E * H / q + 4 * ring(d) * E * H / q


LINEARS = [(H, 3 * H), (H, H), (H, FF), (FF, H)]


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (Layout(tensor=4, micro_batch=B), {"tensor": 4 * 2 * ring(4) * E * B * S * H}),
        (Layout(tensor=4, sequence_parallel=True, micro_batch=B), None),  # the same bytes, as AG + RS
        (Layout(tensor=4, tensor_mode="2d", micro_batch=B), ("2d", 2, 1)),
        (Layout(tensor=8, tensor_mode="2.5d", depth=2, micro_batch=B), ("2.5d", 2, 2)),
    ],
    ids=["1d-tp4", "1d-tp4-sp", "2d-tp4", "2.5d-tp8-d2"],
)
def test_a_block_moves_its_documented_bytes(layout, expected):
    got = per_block(layout)
    if expected is None:  # sequence-parallel regions: the 1D bytes, plus the replicated vectors' gradients
        vectors = 2 * ring(4) * E * (2 * 2 * H + 2 * H)
        assert got == pytest.approx({"tensor": 4 * 2 * ring(4) * E * B * S * H + vectors})
        return
    if isinstance(expected, dict):
        assert got == pytest.approx(expected)
        return
    mode, q, d = expected
    total = sum(summa_linear(q, d, fin, fout, B * S) for fin, fout in LINEARS) + 2 * summa_norm(q, d, B * S)
    assert sum(got.values()) == pytest.approx(total)
    assert set(got) == ({f"{mode}_row", f"{mode}_col"} | ({f"{mode}_dep"} if d > 1 else set()))


def test_a_3d_block_moves_its_documented_bytes_with_the_weight_gathered_again():
    q, tokens = 2, B * S
    linear = sum(
        2 * (q - 1) / q**3 * E * (tokens * (i + o) + i * o + o) + (q - 1) / q**3 * E * i * o for i, o in LINEARS
    )
    norm = 2 * 8 * ring(q) * E * tokens / q + 4 * ring(q) * E * H / q**2
    got = per_block(Layout(tensor=8, tensor_mode="3d", micro_batch=B))
    assert sum(got.values()) == pytest.approx(linear + 2 * norm)
    assert set(got) == {"3d_input", "3d_weight", "3d_output"}


def test_full_checkpointing_repeats_a_blocks_forward_collectives_but_the_last():
    plain = per_block(Layout(tensor=4, micro_batch=B))["tensor"]
    kept = per_block(Layout(tensor=4, checkpoint="full", micro_batch=B))["tensor"]
    assert kept == pytest.approx(plain * 5 / 4)  # the attention output's all-reduce again, not the MLP's


# ---- data parallelism and ZeRO: docs/zero.md ---------------------------------------------------------


def test_ddp_all_reduces_the_gradients_and_the_loss():
    model = gpt()
    got = step_traffic(model, Layout(data=4, micro_batch=1), FP32)
    assert list(got) == [("all_reduce", "data")]
    assert got["all_reduce", "data"].bytes == pytest.approx(2 * ring(4) * (4 * model.num_parameters() + 4))


@pytest.mark.parametrize(("stage", "volumes"), [(1, 2), (2, 2), (3, 3)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero_moves_two_or_three_parameter_volumes(stage, volumes, dtype):
    model, work = gpt(), Workload(global_batch=4, dtype=dtype)
    got = step_traffic(model, Layout(data=4, zero=stage, micro_batch=1), work)
    moved = got["reduce_scatter", "data"].bytes + got["all_gather", "data"].bytes
    assert moved == pytest.approx(volumes * ring(4) * work.element_bytes * model.num_parameters())
    assert got["all_reduce", "data"].bytes == pytest.approx(2 * ring(4) * 4)  # the loss


def test_zero_2_and_3_reduce_every_micro_step():
    model = gpt()
    one = step_traffic(model, Layout(data=4, zero=3, micro_batch=1), FP32)
    four = step_traffic(model, Layout(data=4, zero=3, microbatches=4, micro_batch=1), FP32)
    for op in ("reduce_scatter", "all_gather"):
        assert four[op, "data"].bytes == pytest.approx(4 * one[op, "data"].bytes)


# ---- pipeline and sequence: docs/pipeline.md, docs/sequence-parallel.md ------------------------------


def test_pipeline_ranks_pass_two_activations_per_micro_batch_and_boundary():
    model = gpt(4)
    m, mb = 8, 2
    got = step_traffic(model, Layout(pipeline=4, microbatches=m, micro_batch=mb), FP32)
    act = mb * S * H * E
    assert got["send", "pipeline"].bytes == m * 2 * act + 8  # a middle stage: forward and back, the loss
    assert got["recv", "pipeline"].bytes == m * 2 * act + 8
    assert got["all_reduce", "pipeline"].bytes == pytest.approx(2 * ring(4) * V * H * E)  # the tied embedding


def test_ring_attention_sends_key_value_blocks_around_and_gradients_home():
    n, layers = 2, 2
    local = B * S // n
    got = step_traffic(gpt(layers), Layout(sequence=n, micro_batch=B), FP32)
    kv = 2 * local * H * E  # one rank's keys and values
    # forward N-1 hops, backward N-1 hops again and N-1 hops of their fp32 gradient sums
    assert got["send", "sequence"].bytes == layers * 3 * (n - 1) * kv
    a2a = step_traffic(gpt(layers), Layout(sequence=4, sequence_mode="all_to_all", micro_batch=B), FP32)
    assert a2a["all_to_all", "sequence"].bytes == pytest.approx(layers * 8 * ring(4) * (B * S // 4) * H * E)


# ---- the bubble ------------------------------------------------------------------------------------------


def simulated(schedule: str, p: int, m: int, v: int, f: int, b: int, w: int) -> Fraction:
    costs = {"F": f, "B": b, "W": w}
    actions = [post_early(rank) for rank in build_schedule(schedule, p, m, v, costs=costs)]
    return simulate(actions, costs, lazy_receive=True).makespan - m * v * (f + b + w)


CASES = [
    (schedule, p, m, v, costs)
    for p in (2, 4)
    for m in (p, 2 * p, 3 * p)
    for schedule, v, costs in [
        ("gpipe", 1, (1, 2, 0)),
        ("1f1b", 1, (1, 2, 0)),
        ("1f1b", 1, (1, 3, 0)),  # full recomputation in the backward
        ("interleaved", 2, (1, 2, 0)),
        ("interleaved", 2, (2, 5, 0)),
        ("zero_bubble", 1, (1, 1, 1)),
        ("zero_bubble", 1, (1, 2, 1)),
        ("zero_bubble", 1, (4, 5, 4)),
    ]
    if schedule != "interleaved" or m % p == 0
]


@pytest.mark.parametrize(("schedule", "p", "m", "v", "costs"), CASES)
def test_closed_form_bubbles_are_the_simulators(schedule, p, m, v, costs):
    f, b, w = costs  # per chunk (w = 0: b is the whole backward); the closed form takes a stage's v chunks
    assert bubble_closed_form(schedule, p, m, v, v * f, v * b, v * w) == simulated(schedule, p, m, v, f, b, w)


def test_without_a_closed_form_the_cached_simulator_answers():
    # weight gradients dearer than the forward: outside ZB-H1's closed form
    assert bubble_closed_form("zero_bubble", 4, 8, 1, 1.0, 1.0, 2.0) is None
    got = pipeline_bubble("zero_bubble", 4, 8, 1, 1.0, 1.0, 2.0)
    assert got == pytest.approx(float(simulated("zero_bubble", 4, 8, 1, 16, 16, 32)) / 16)


def test_more_micro_batches_shrink_the_bubble_share():
    model, shares = gpt(8), []
    for m in (4, 8, 16, 32):
        layout = Layout(pipeline=4, microbatches=m, micro_batch=1)
        t = predict_time(model, layout, Workload(global_batch=m), CLUSTER)
        shares.append(t.bubble / t.step)
    assert shares == sorted(shares, reverse=True) and shares[0] > 2 * shares[-1]


def test_interleaving_and_zero_bubble_shrink_the_bubble():
    model, w = gpt(8), Workload(global_batch=8)
    schedules = {"1f1b": {}, "interleaved": {"schedule": "interleaved", "chunks": 2}, "zb": {"schedule": "zero_bubble"}}
    bubble = {
        name: predict_time(model, Layout(pipeline=4, microbatches=8, micro_batch=1, **kw), w, CLUSTER).bubble
        for name, kw in schedules.items()
    }
    assert bubble["1f1b"] > bubble["interleaved"] > 0 and bubble["1f1b"] > bubble["zb"] > 0


# ---- compute, optimizer, links ---------------------------------------------------------------------------


def test_checkpointing_adds_compute_full_more_than_selective():
    model, w = resolve_model("llama:7b"), Workload(global_batch=8, dtype="bf16")
    compute = {
        c: predict_time(model, Layout(data=8, checkpoint=c), w, CLUSTER).compute for c in ("none", "selective", "full")
    }
    assert compute["none"] < compute["selective"] < compute["full"] == pytest.approx(compute["none"] * 4 / 3, rel=0.02)


def test_compute_splits_over_tensor_sequence_and_stages():
    model = gpt(8)
    one = stage_work(model, Layout(), FP32, stages(model, 1)[0]).total
    for layout in (Layout(tensor=4), Layout(sequence=4), Layout(tensor=2, sequence=2)):
        assert stage_work(model, layout, FP32, stages(model, 1)[0]).total == pytest.approx(one / 4)
    cut = stages(model, 4)
    assert sum(st.blocks for st in cut) == 8 and cut[0].embedding and cut[-1].head


def test_zero_shards_the_optimizer_step_and_offload_moves_it_to_the_host():
    model, w = resolve_model("llama:7b"), Workload(global_batch=8, dtype="bf16")
    step = {z: predict_time(model, Layout(data=8, zero=z), w, CLUSTER).optimizer for z in (0, 1, 3)}
    assert step[0] == pytest.approx(8 * step[1]) and step[1] == pytest.approx(step[3])
    host = predict_time(model, Layout(data=8, zero=3, offload=True), w, CLUSTER).optimizer
    assert host > step[3]


def test_each_axis_runs_over_the_link_its_group_spans():
    cluster = dataclasses.replace(CLUSTER, devices=16, devices_per_node=8)
    layout = Layout(data=2, tensor=4, pipeline=2)
    assert axis_link(cluster, layout, "tensor") == cluster.intra
    assert axis_link(cluster, layout, "pipeline") == cluster.intra  # 8 ranks: one node
    assert axis_link(cluster, layout, "data") == cluster.inter
    assert axis_link(cluster, Layout(tensor=16, tensor_mode="2d"), "2d_row") == cluster.intra
    assert axis_link(cluster, Layout(tensor=16, tensor_mode="2d"), "2d_col") == cluster.inter
    fast, measured = Link(1e12, 0.0), Link(5e9, 2e-5)
    tuned = dataclasses.replace(cluster, axis_links={"data": fast, "all_reduce:4": measured})
    assert axis_link(tuned, layout, "data") == fast
    assert axis_link(tuned, layout, "tensor", "all_reduce", 4) == measured
    assert axis_link(tuned, layout, "tensor", "all_reduce", 8) == measured  # the nearest size measured


def test_the_step_adds_up_and_slower_links_cost_time():
    model, w = resolve_model("llama:7b"), Workload(global_batch=64, dtype="bf16")
    layout = Layout(data=2, tensor=4, pipeline=2, microbatches=8, micro_batch=4)
    t = predict_time(model, layout, w, CLUSTER)
    assert t.step == pytest.approx(t.compute + t.exposed_comm + t.bubble + t.optimizer)
    assert 0 < t.exposed_comm <= sum(t.comm.values()) and t.comm["tensor"] > 0 and t.comm["pipeline"] > 0
    slow = dataclasses.replace(CLUSTER, intra=Link(1e8, 1e-4))
    assert predict_time(model, layout, w, slow).step > t.step


def test_predictions_are_fast_enough_for_the_search():
    """Not a timed assertion: prints the cost of 10,000 predictions of a 70B model."""
    model, w = resolve_model("llama:70b"), Workload(global_batch=1024, dtype="bf16")
    cluster = Cluster(
        devices=1024, device_memory=80 * 2**30, flops=4e14, intra=Link(3e11, 5e-6), inter=Link(2.5e10, 1e-5)
    )
    rng, layouts = random.Random(0), []
    while len(layouts) < 10_000:
        tp, pp, mb = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8, 16]), rng.choice([1, 2])
        dp = 1024 // (tp * pp)
        m = 1024 // (dp * mb)
        layout = Layout(data=dp, tensor=tp, pipeline=pp, microbatches=m, micro_batch=mb, zero=rng.choice([0, 1]),
                        checkpoint=rng.choice(["none", "full"]), schedule=rng.choice(["1f1b", "zero_bubble"]))  # fmt: skip
        if not layout.problems():
            layouts.append(layout)
    start = time.perf_counter()
    steps = [predict_time(model, layout, w, cluster).step for layout in layouts]
    took = time.perf_counter() - start
    REPORT.append(f"planner: 10,000 step-time predictions of llama:70b on 1,024 GPUs in {took:.2f} s")
    assert all(s > 0 for s in steps)


def shared(cluster: Cluster, ranks_per_core: float) -> Cluster:
    """``cluster`` with ranks sharing cores."""
    return dataclasses.replace(cluster, ranks_per_core=ranks_per_core)


def test_on_shared_cores_waiting_is_cheap_and_overlap_is_gone():
    """A waiting rank's core runs the others' work (the bubble nearly vanishes); but no idle
    hardware moves the bytes, so what hid behind the backward (DDP's buckets) now adds."""
    model, w = gpt(8), Workload(global_batch=8)
    pipe, data = Layout(pipeline=4, microbatches=8, micro_batch=1), Layout(data=4, micro_batch=2)
    alone = {name: predict_time(model, lay, w, CLUSTER) for name, lay in (("pp", pipe), ("dp", data))}
    two = {name: predict_time(model, lay, w, shared(CLUSTER, 2.0)) for name, lay in (("pp", pipe), ("dp", data))}
    assert alone["pp"].bubble > 0 and alone["pp"].step > alone["dp"].step  # own cores: the bubble costs
    assert two["pp"].bubble < alone["pp"].bubble  # (its transfers add instead: the next test)
    assert two["dp"].compute == pytest.approx(alone["dp"].compute)
    assert alone["dp"].exposed_comm < alone["dp"].comm["data"]  # behind the backward but the last bucket
    assert two["dp"].exposed_comm == pytest.approx(two["dp"].comm["data"])  # all of it
    for t in two.values():
        assert t.step == pytest.approx(t.compute + t.exposed_comm + t.bubble + t.optimizer)


def test_a_blocks_fixed_cost_is_paid_once_per_micro_batch():
    """``block_overhead`` adds its seconds per block and micro-batch on the rank: accumulation
    over smaller micro-batches (same flops) pays it more often."""
    model, w = gpt(4), Workload(global_batch=8)
    one, two = Layout(data=4, micro_batch=2), Layout(data=4, micro_batch=1, microbatches=2)
    cost = 1e-3
    paying = dataclasses.replace(CLUSTER, block_overhead=cost)
    for layout, passes in ((one, 1), (two, 2)):
        extra = predict_time(model, layout, w, paying).compute - predict_time(model, layout, w, CLUSTER).compute
        assert extra == pytest.approx(4 * passes * cost)
    assert predict_time(model, two, w, CLUSTER).compute == pytest.approx(predict_time(model, one, w, CLUSTER).compute)


def test_checkpointing_costs_what_calibration_measured():
    """With ``recompute_cost`` for a mode, each block's pass (flops and fixed cost) takes that
    factor of its time without checkpointing; without it, the recomputed flops."""
    model, w = gpt(4), Workload(global_batch=4)
    plain, full = Layout(micro_batch=4), Layout(micro_batch=4, checkpoint="full")
    cluster = dataclasses.replace(CLUSTER, block_overhead=2e-4)
    base = predict_time(model, plain, w, cluster).compute
    block = stage_work(model, plain, w, stages(model, 1)[0]).block
    by_flops = predict_time(model, full, w, cluster).compute
    assert by_flops - base == pytest.approx(4 * block / cluster.flops)  # one more forward of each block
    measured = dataclasses.replace(cluster, recompute_cost={"full": 1.5})
    got = predict_time(model, full, w, measured).compute - base
    assert got == pytest.approx(4 * 0.5 * (3 * block / cluster.flops + 2e-4))


def test_on_shared_cores_a_pipelines_transfers_all_add():
    """With cores of their own, steady-state sends overlap compute (the fill and drain do not);
    on shared cores every transfer takes its time from the compute (two stages: each sends and
    receives as much as the other)."""
    model, w = gpt(8), Workload(global_batch=8)
    pipe = Layout(pipeline=2, microbatches=8, micro_batch=1)
    alone, two = predict_time(model, pipe, w, CLUSTER), predict_time(model, pipe, w, shared(CLUSTER, 2.0))
    assert alone.exposed_comm < alone.comm["pipeline"]
    assert two.exposed_comm == pytest.approx(two.comm["pipeline"])
