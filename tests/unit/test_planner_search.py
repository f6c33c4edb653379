"""The layout search: its enumeration respects the model's divisibility and the world, its pruning
never drops a layout that fits (against a brute-force enumeration), its ranking and reasons, the
config it writes, and `tessera plan`."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from tessera.cli import main
from tessera.cli.plan import write_config
from tessera.config import load_config, parallel_dims
from tessera.errors import ConfigError
from tessera.planner import Cluster, Layout, Link, ModelSpec, Workload, estimate
from tessera.planner.estimate import Estimate, MemoryEstimate, TimeEstimate
from tessera.planner.search import (
    SEQUENCE_MODES,
    Limits,
    Plan,
    SearchStats,
    batch_parts,
    divisors,
    layout_problems,
    plan,
    rank_key,
    shapes,
    why,
)

MIB = 2**20
# a small decoder: 6 heads (so 4-way and 8-way splits of the heads fail), 4 layers
SMALL = ModelSpec(name="small", family="gpt", n_layers=4, d_model=96, n_heads=6, ff_dim=384, vocab_size=128, seq_len=32)


def cluster(devices: int, memory: float, per_node: int = 8) -> Cluster:
    return Cluster(devices=devices, device_memory=int(memory), flops=1e12, intra=Link(100e9, 1e-5),
                   inter=Link(10e9, 2e-5), devices_per_node=per_node)  # fmt: skip


def test_shapes_multiply_to_the_world_and_split_the_model_evenly():
    model = dataclasses.replace(SMALL, n_heads=12, d_model=96)  # 12 heads: 1d up to 12, q = 2 grids
    found = list(shapes(model, cluster(16, 1e12, per_node=16), Workload(global_batch=32), Limits(), within_node=True))
    assert found and all(s.world == 16 and not dataclasses.replace(s, schedule="gpipe").problems() for s in found)
    for s in found:
        assert s.pipeline <= model.n_layers and 32 % s.data == 0
        q = s.grid
        assert model.n_heads % q == 0 and model.d_model % (q * q if s.tensor_mode == "3d" else q) == 0
        if s.sequence > 1:
            assert s.tensor_mode == "1d" and model.seq_len % s.sequence == 0
    modes = {(s.tensor, s.tensor_mode, s.depth) for s in found}
    assert {(4, "2d", 1), (8, "2.5d", 2), (8, "3d", 1), (2, "1d", 1), (4, "1d", 1)} <= modes
    assert (8, "1d", 1) not in modes and (16, "1d", 1) not in modes  # 12 heads do not split 8 or 16 ways
    # 6 heads: no 4-way 1d split, and q = 2 grids need 2 | 6 (they run), 3d needs 4 | d_model
    small = {(s.tensor, s.tensor_mode) for s in shapes(SMALL, cluster(8, 1e12), Workload(global_batch=8), Limits(),
                                                        within_node=True)}  # fmt: skip
    assert (4, "1d") not in small and (2, "1d") in small and (4, "2d") in small


def test_tensor_groups_stay_within_a_node_unless_nothing_else_fits():
    model = dataclasses.replace(SMALL, n_heads=8, d_model=128)
    within = list(shapes(model, cluster(16, 1e12, per_node=4), Workload(global_batch=16), Limits(), within_node=True))
    assert max(s.tensor for s in within) == 4
    across = list(shapes(model, cluster(16, 1e12, per_node=4), Workload(global_batch=16), Limits(), within_node=False))
    assert max(s.tensor for s in across) == 16  # 2d with q = 4, 2.5d with q = 2 and depth 4


def brute_force(model: ModelSpec, clus: Cluster, work: Workload) -> list[Estimate]:
    """Every layout of the search's space (no pruning at all), estimated; those that fit."""
    world, out = clus.devices, []
    for t, s, p in itertools.product(divisors(world), repeat=3):
        if world % (t * s * p):
            continue
        d = world // (t * s * p)
        tensor = [("1d", 1, sp) for sp in (False, True)] + [("2d", 1, False), ("3d", 1, False)]
        tensor += [("2.5d", depth, False) for depth in divisors(t)]
        schedules = [("1f1b", 1)] if p == 1 else [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)]
        for (mode, depth, sp), seq_mode, (schedule, chunks) in itertools.product(tensor, SEQUENCE_MODES, schedules):
            for mb, zero, offload, ckpt in itertools.product(divisors(work.global_batch), range(4), (False, True),
                                                              ("none", "selective", "full")):  # fmt: skip
                if work.global_batch % (d * mb) or (s == 1 and seq_mode != "ring"):
                    continue
                layout = Layout(data=d, tensor=t, tensor_mode=mode, depth=depth, sequence_parallel=sp, pipeline=p,
                                schedule=schedule, microbatches=work.global_batch // (d * mb), chunks=chunks,
                                sequence=s, sequence_mode=seq_mode, zero=zero, offload=offload, checkpoint=ckpt,
                                micro_batch=mb)  # fmt: skip
                if not layout_problems(model, layout, work):
                    out.append(estimate(model, layout, work, clus))
    return [e for e in out if e.fits]


def test_pruning_never_drops_a_layout_that_fits():
    work = Workload(global_batch=8, dtype="fp32")
    probe = plan(SMALL, cluster(4, 1e12), work, limits=Limits(exhaustive=True))
    peaks = sorted(e.memory.peak for e in probe.ranked)
    clus = cluster(4, peaks[len(peaks) // 3])  # about a third of the layouts fit
    everything = Limits(exhaustive=True, sequence_modes=SEQUENCE_MODES, max_sequence=4)
    searched = plan(SMALL, clus, work, limits=everything)
    expected = brute_force(SMALL, clus, work)
    assert 20 < len(expected) < len(probe.ranked)
    assert {e.layout for e in searched.ranked} == {e.layout for e in expected}
    assert searched.stats.pruned_states + searched.stats.too_big > 0  # the bounds did prune
    # without `exhaustive`, dominated layouts are skipped but the ranking's head is the same
    quick = plan(SMALL, clus, work, limits=dataclasses.replace(everything, exhaustive=False))
    assert quick.stats.estimated < searched.stats.estimated
    full = sorted(expected, key=rank_key)
    assert quick.best.layout == full[0].layout
    positions = [[e.layout for e in full].index(q.layout) for q in quick.ranked]
    assert positions == sorted(positions)


def test_ranking_is_by_step_time_then_memory_and_every_row_fits():
    result = plan(SMALL, cluster(8, 64 * MIB), Workload(global_batch=16))
    assert result.ranked and all(e.fits for e in result.ranked)
    assert result.ranked == sorted(result.ranked, key=rank_key)
    assert result.best is result.ranked[0]
    assert set(result.baselines) == {"pure ZeRO-3", "pure 1D tp2"}
    zero3 = result.baselines["pure ZeRO-3"]
    assert zero3 is not None and zero3.layout.data == 8 and zero3.layout.zero == 3
    for est in result.ranked:
        assert est.layout.global_batch == 16 and est.layout.world == 8 and not est.layout.problems()
    rows = result.rows()
    assert [r.rank for r in rows[: result.top]] == list(range(1, min(result.top, len(result.ranked)) + 1))
    table = result.table()
    assert table.splitlines()[0].split()[:4] == ["rank", "layout", "peak", "mem/rank"]
    assert "pure ZeRO-3" in table and "| rank | layout |" in result.table(markdown=True)


def _est(layout: Layout, peak: float, step: float, exposed: float, comm: dict[str, float], fits: bool = True):
    memory = MemoryEstimate(0, 0, 0, 0, 0, int(peak))
    time = TimeEstimate(compute=step - exposed, comm=comm, exposed_comm=exposed, bubble=0.0, optimizer=0.0, step=step)
    return Estimate(layout, memory, time, fits)


def test_reasons_name_the_parts_that_differ():
    clus = cluster(16, 80 * 2**30)
    work = Workload(global_batch=16)
    zero3 = Layout(data=16, zero=3)
    hybrid = Layout(data=2, tensor=8, zero=1)
    ours = _est(hybrid, 40 * 2**30, 1.0, 0.1, {"tensor": 0.3, "data": 0.05})
    theirs = _est(zero3, 30 * 2**30, 1.7, 0.8, {"data": 1.5})
    huge = _est(Layout(data=2, tensor=8), 300 * 2**30, 0.9, 0.05, {"tensor": 0.3}, fits=False)
    holder = Plan(SMALL, clus, work, [ours], {}, SearchStats())
    text = why(ours, theirs, "pure ZeRO-3", holder)
    assert text.startswith(
        "vs pure ZeRO-3: 41% shorter step (1.00 s vs 1.70 s): exposed communication 100.0 ms vs 800.0 ms"
    )
    assert "(data-axis traffic 50.0 ms vs 1.50 s: all-gathers of" in text and text.endswith("a step across nodes)")
    assert why(ours, huge, "pure 1D tp8", holder) == (
        "vs pure 1D tp8: fits (pure 1D tp8 needs 300.0 GiB per rank, 80.0 GiB available)"
    )
    same = _est(zero3, 50 * 2**30, 1.0, 0.1, {"data": 0.3})
    assert why(ours, same, "#2", holder) == "vs #2: the same step time, 10.0 GiB less memory per rank"
    assert why(ours, ours, "x", holder) == "it is the x layout"


def test_nothing_fits_says_by_how_much_the_nearest_misses():
    result = plan(SMALL, cluster(4, 64 * 2**10), Workload(global_batch=8))
    assert not result.ranked and result.nearest is not None
    with pytest.raises(ConfigError, match=r"nearest, .*, needs .* per rank \(.* over"):
        _ = result.best


@pytest.mark.parametrize("suffix", [".py", ".toml", ".yaml", ".json"])
def test_the_written_config_loads_with_the_layout(tmp_path, suffix):
    result = plan(SMALL, cluster(8, 24 * MIB), Workload(global_batch=16, seq_len=32, dtype="bf16"))
    layout = dataclasses.replace(result.best.layout)
    path = write_config(
        layout, "gpt:tiny", Workload(global_batch=16, seq_len=32, dtype="bf16"), tmp_path / f"best{suffix}"
    )
    cfg = load_config(path)
    dims = parallel_dims(cfg, 8)
    assert (dims.data, dims.tensor, dims.tensor_mode, dims.pipeline, dims.sequence) == (
        layout.data, layout.tensor, layout.tensor_mode, layout.pipeline, layout.sequence)  # fmt: skip
    assert cfg.zero.stage == layout.zero and cfg.data.micro_batch_size == layout.micro_batch
    assert cfg.activation_checkpoint.mode == layout.checkpoint and cfg.mixed_precision.dtype == "bf16"
    assert (cfg.model.name, cfg.model.preset, cfg.data.seq_len) == ("gpt", "tiny", 32)
    per_step = layout.microbatches if layout.pipeline > 1 else cfg.gradient_accumulation
    assert cfg.data.micro_batch_size * dims.data * per_step == 16


def test_tessera_plan_prints_the_table_and_writes_the_best(tmp_path, capsys):
    out = tmp_path / "best.toml"
    code = main(["plan", "--model", "llama:7b", "--devices", "16", "--nodes", "2", "--device-memory", "40GiB",
                 "--global-batch", "64", "--top", "3", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    lines = printed.out.splitlines()
    assert lines[0].startswith("rank") and [line.split()[0] for line in lines[1:4]] == ["1", "2", "3"]
    assert "pure ZeRO-3" in printed.out and "best: " in printed.out
    assert load_config(out).parallel.data is not None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt:nope", "--devices", "4"], "unknown GPT preset 'nope'"),
        (["--model", "llama:70b", "--devices", "12", "--nodes", "5"], "--devices=12 is not a multiple of --nodes=5"),
        (["--model", "llama:70b", "--devices", "8", "--device-memory", "1GiB"], "GiB over"),
        (["--model", "tiny", "--devices", "4"], "give gpt:PRESET"),
    ],
)
def test_tessera_plan_errors_are_one_line(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("tessera plan: error:") and message in last


def test_batch_parts_follow_the_tensor_mode():
    assert batch_parts(Layout(tensor=4, tensor_mode="2d")) == 2
    assert batch_parts(Layout(tensor=8, tensor_mode="2.5d", depth=2)) == 4
    assert batch_parts(Layout(tensor=8, tensor_mode="3d")) == 2
    assert batch_parts(Layout(tensor=4)) == 1


def test_tessera_plan_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as done:
        main(["plan", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--devices", "--nodes", "--device-memory", "--global-batch", "--seq-len", "--dtype",
                 "--calibrate", "--top", "--out", "--flops", "--intra-bw", "--inter-bw", "50% of peak"):  # fmt: skip
        assert flag in text


def test_a_mixture_of_experts_preset_is_refused_rather_than_planned_as_dense():
    from tessera.planner.spec import from_gpt_preset

    with pytest.raises(ConfigError, match="mixture-of-experts blocks .8 experts.*parallel.expert"):
        from_gpt_preset("tiny-moe")
