"""``tessera bench zero``: tessera's ZeRO stages against torch FSDP2 and DeepSpeed ZeRO, on CPU.

Every side trains its own copy of the same GPT (same seed, so the same initial weights) with
``torch.optim.AdamW`` on the same micro-batches, on the same ranks (gloo, one intra-op thread per
rank), used the way its users use it:

- tessera: ``use_layout(config={"parallel": {"data": N}, "zero": {...}, "mixed_precision": {...}})``,
  ``tessera.initialize(model, AdamW, criterion)``, ``engine.train_batch(iter([(x, y)]))``;
- torch FSDP2: ``fully_shard`` on every block, then on the root (ZeRO-3); with
  ``reshard_after_forward=False`` the parameters stay gathered from forward to backward, which
  is what ZeRO-2 keeps (sharded gradients and optimizer states, whole parameters in the step);
- DeepSpeed: ``deepspeed.initialize`` with a config dict (``zero_optimization.stage`` 1/2/3;
  ZeRO-Offload is stage 2 with ``offload_optimizer.device = "cpu"`` and DeepSpeed's own
  ``DeepSpeedCPUAdam``, torch AdamW where that op cannot be built), its CPU accelerator
  (``DS_ACCELERATOR=cpu``) on the process group tessera already started.

Rows, for each world size N: ``zero1 dpN`` (tessera stage 1 vs DeepSpeed ZeRO-1), ``zero2 dpN``
(stage 2 vs DeepSpeed ZeRO-2 and FSDP2 without resharding), ``zero3 dpN`` (stage 3 vs FSDP2 and
DeepSpeed ZeRO-3), ``offload dpN`` (stage 2 with the optimizer on the host vs DeepSpeed
ZeRO-Offload). DeepSpeed is optional (``pip install 'tessera[bench]'``): without it its rows
are absent and the run says so.

Step time: the sides of one row group are built in one rank pool and run in alternating blocks
of steps (ABAB, then BABA; ``tessera.bench.timing``), each block timed between barriers with the
slowest rank's time; the value is the median over blocks of the time per step.

Peak memory, per rank above a baseline, the largest over the ranks (``reset_peak_rss`` then
``peak_rss_bytes``, i.e. VmHWM): ``peak_rss_setup_bytes`` while the side sets up (the user code
builds the full model, the side shards or wraps it and makes its optimizer), and
``peak_rss_train_bytes`` while it then trains a few steps: what stays after set-up (sharded
parameters, gradient buffers, optimizer states once they exist) plus what training adds
(activations, gathered parameters, communication buffers). Before the baseline and again before
training, garbage is collected and glibc's ``malloc_trim`` returns freed heap to the system, so
that the full model a sharding side lets go of after set-up does not count against training.
Each side is measured in a fresh rank pool of its own, because a process that has already run
another side keeps that side's freed memory in its allocator and would hand it to the next side
without raising the RSS: measured in turn in one process, whichever side comes later looks
smaller. Before the baseline, the fresh process runs the same side once on a miniature GPT (one
block of width 16), so that imports and lazy one-time set-up (DeepSpeed's comm backend and
JIT-built ops, autograd's and gloo's threads) are paid outside the measurement while the
miniature leaves next to nothing behind.

After the timed blocks every side has taken the same steps on the same data; each evaluates its
loss on one micro-batch, and the run reports those losses, so a side that trained something
else is seen at once (fp32: they agree to about 1e-5).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import importlib.util
import logging
import os
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.timing import alternate

StepFn = Callable[[torch.Tensor, torch.Tensor], None]
LossFn = Callable[[torch.Tensor, torch.Tensor], float]


@dataclass(frozen=True)
class Workload:
    """The model and data every side trains: GPT ``preset`` (``max_seq_len=seq_len``), one
    micro-batch ``[micro_batch, seq_len]`` of byte tokens per rank and step, AdamW(``lr``)."""

    preset: str = "small"
    seq_len: int = 64
    micro_batch: int = 4
    dtype: str = "fp32"  # or "bf16": tessera mixed_precision, FSDP2 MixedPrecisionPolicy, DeepSpeed bf16
    lr: float = 1e-3
    miniature: bool = False  # a one-block GPT of width 16: warms a process up before measuring

    @property
    def tag(self) -> str:
        return f"gpt-{self.preset} b{self.micro_batch}x{self.seq_len}" + (
            "" if self.dtype == "fp32" else f" {self.dtype}"
        )


@dataclass(frozen=True)
class Side:
    """One system at one ZeRO stage: ``system`` is "tessera", "fsdp2" or "deepspeed"."""

    system: str
    stage: int
    offload: bool = False

    @property
    def label(self) -> str:
        if self.system == "tessera":
            return f"tessera zero{self.stage}" + ("-offload" if self.offload else "")
        if self.system == "fsdp2":
            return "torch FSDP2" + ("" if self.stage == 3 else " no-reshard")
        return "DeepSpeed ZeRO-Offload" if self.offload else f"DeepSpeed ZeRO-{self.stage}"


# row group -> (tessera's side, its anchors)
GROUPS: dict[str, tuple[Side, tuple[Side, ...]]] = {
    "zero1": (Side("tessera", 1), (Side("deepspeed", 1),)),
    "zero2": (Side("tessera", 2), (Side("deepspeed", 2), Side("fsdp2", 2))),
    "zero3": (Side("tessera", 3), (Side("fsdp2", 3), Side("deepspeed", 3))),
    "offload": (Side("tessera", 2, offload=True), (Side("deepspeed", 2, offload=True),)),
}


def deepspeed_available() -> bool:
    """Whether DeepSpeed is installed (the ``bench`` extra); its import is left to the ranks."""
    return importlib.util.find_spec("deepspeed") is not None


def _sides(group: str, with_deepspeed: bool) -> list[Side]:
    ours, anchors = GROUPS[group]
    return [ours, *(a for a in anchors if with_deepspeed or a.system != "deepspeed")]


# ---- on every rank --------------------------------------------------------------------------


def _model(w: Workload) -> torch.nn.Module:
    from tessera.models import gpt

    torch.manual_seed(0)  # every side starts from the same weights
    if w.miniature:
        return gpt(w.preset, max_seq_len=w.seq_len, d_model=16, n_heads=2, n_layers=1)
    return gpt(w.preset, max_seq_len=w.seq_len)


def _batches(w: Workload, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` micro-batches (inputs, next-token targets) ``[micro_batch, seq_len]`` of this rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = [torch.randint(0, 256, (w.micro_batch, w.seq_len + 1), generator=g) for _ in range(count)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _prepare(side: Side) -> None:
    """Imports and one-time setup of ``side`` (kept out of its memory measurement)."""
    if side.system == "fsdp2":
        import torch.distributed.fsdp  # noqa: F401
    elif side.system == "deepspeed":
        _deepspeed(load_cpu_adam=side.offload)


_cpu_adam: dict[str, bool] = {}


def _deepspeed(load_cpu_adam: bool = False) -> Any:
    """DeepSpeed on its CPU accelerator, joined to the process group that is already running."""
    import torch.distributed as dist

    os.environ["DS_ACCELERATOR"] = "cpu"  # its CPU accelerator; gloo is its comm backend there
    # DeepSpeed's engine asks the launcher's variables; the pool is one node
    for key, value in (("LOCAL_RANK", dist.get_rank()), ("RANK", dist.get_rank()),
                       ("WORLD_SIZE", dist.get_world_size()), ("LOCAL_SIZE", dist.get_world_size())):  # fmt: skip
        os.environ[key] = str(value)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated")
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")  # wraps the existing default group
    if load_cpu_adam and "ok" not in _cpu_adam:
        try:  # a JIT-compiled C++ op (ninja, a C++ compiler); built once into the torch extensions cache
            from deepspeed.ops.op_builder import CPUAdamBuilder

            CPUAdamBuilder().load()
            _cpu_adam["ok"] = True
        except Exception as exc:
            logger.warning(f"DeepSpeedCPUAdam cannot be built here ({exc}); ZeRO-Offload steps torch AdamW")
            _cpu_adam["ok"] = False
    return deepspeed


def _build_tessera(side: Side, w: Workload, world: int) -> tuple[StepFn, LossFn, str]:
    import tessera
    from tessera.models import NextTokenLoss
    from tessera.testing import use_layout

    config = {
        "parallel": {"data": world},
        "zero": {"stage": side.stage, "offload_optimizer": "cpu" if side.offload else "none"},
        "mixed_precision": {"dtype": w.dtype},
    }
    use_layout(config=config)
    model = _model(w)
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=w.lr), NextTokenLoss())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.train_batch(iter([(x, y)]))

    def loss(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return float(engine.criterion(engine(x), y))

    return step, loss, side.label


def _build_fsdp2(side: Side, w: Workload) -> tuple[StepFn, LossFn, str]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tessera.models import NextTokenLoss

    model = _model(w)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if w.dtype == "bf16"
        else MixedPrecisionPolicy()
    )
    reshard = side.stage == 3
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=w.lr)
    criterion = NextTokenLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        optimizer.step()

    def loss(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return float(criterion(model(x), y).float())

    return step, loss, side.label


def _build_deepspeed(side: Side, w: Workload, world: int) -> tuple[StepFn, LossFn, str]:
    from tessera.models import NextTokenLoss

    deepspeed = _deepspeed(load_cpu_adam=side.offload)
    model = _model(w)
    zero: dict[str, Any] = {"stage": side.stage}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": w.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": w.micro_batch * world,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch's AdamW, as on the other sides
        "gradient_clipping": 0.0,  # DeepSpeed clips to norm 1.0 unless told; the other sides do not clip
        "bf16": {"enabled": w.dtype == "bf16"},
        "steps_per_print": 2**31 - 1,
    }
    label = side.label
    if side.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if side.offload and _cpu_adam.get("ok"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer: torch.optim.Optimizer = DeepSpeedCPUAdam(
            model.parameters(), lr=w.lr, weight_decay=0.01, adamw_mode=True
        )
        label += " (DeepSpeedCPUAdam)"
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=w.lr)
        if side.offload:
            config["zero_force_ds_cpu_optimizer"] = False
            label += " (torch AdamW)"
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    criterion = NextTokenLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.backward(criterion(engine(x), y))
        engine.step()

    def loss(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return float(criterion(engine(x), y).float())

    return step, loss, label


def _build(side: Side, w: Workload) -> tuple[StepFn, LossFn, str]:
    """Build ``side`` on this rank: one training step ``step(x, y)``, the loss of a batch, and the
    anchor's name as reported (DeepSpeed's names the optimizer ZeRO-Offload steps with)."""
    world = torch.distributed.get_world_size()
    if side.system == "tessera":
        return _build_tessera(side, w, world)
    if side.system == "fsdp2":
        return _build_fsdp2(side, w)
    return _build_deepspeed(side, w, world)


def _timing_body(sides: list[Side], w: Workload, blocks: int, steps: int) -> dict[str, Any]:
    """Build every side of a row group, time them in alternating blocks, then evaluate each."""
    from tessera.testing import use_layout

    world = use_layout(config={}).group("world")
    for side in sides:
        _prepare(side)
    built = {side: _build(side, w) for side in sides}
    batches = _batches(w, world.rank, steps)

    def block_of(step: StepFn) -> Callable[[], None]:
        def block() -> None:
            for x, y in batches:
                step(x, y)

        return block

    blocks_by_side = {side.label: block_of(step) for side, (step, _, _) in built.items()}
    for block in blocks_by_side.values():  # warm-up: buffers, hooks and optimizer states appear
        block()
    times = alternate(blocks_by_side, blocks, steps, world)
    x, y = batches[0]
    losses = {side.label: loss(x, y) for side, (_, loss, _) in built.items()}
    names = {side.label: name for side, (_, _, name) in built.items()}
    return {"times": times, "losses": losses, "names": names}


def _trim_heap() -> None:
    """Collect garbage and hand freed heap memory back to the system (glibc's ``malloc_trim``),
    so that the resident size counts what is alive, not what the allocator keeps in reserve."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the reading keeps the allocator's reserve
        pass


def _memory_body(side: Side, w: Workload, steps: int) -> dict[str, int] | None:
    """This rank's peak RSS above its baseline while ``side`` is set up (model built, wrapped)
    and while it trains ``steps`` steps; run in a fresh pool (see the module docstring)."""
    from tessera.memory.report import peak_rss_bytes, reset_peak_rss
    from tessera.testing import use_layout

    world = use_layout(config={}).group("world")
    _prepare(side)
    batches = _batches(w, world.rank, steps)
    step, _, _ = _build(side, dataclasses.replace(w, miniature=True))
    for x, y in batches:  # the same code paths once: lazy imports and one-time set-up happen here
        step(x, y)
    del step
    _trim_heap()
    if not reset_peak_rss():
        return None
    base = peak_rss_bytes()  # right after the reset, the peak is the current RSS
    step, _, _ = _build(side, w)
    setup = peak_rss_bytes()
    _trim_heap()  # what setting up freed (the full model a sharding side let go) does not count
    reset_peak_rss()
    for x, y in batches:
        step(x, y)
    train = peak_rss_bytes()
    if base is None or setup is None or train is None:
        return None
    return {"setup": setup - base, "train": train - base}


# ---- in the launching process -----------------------------------------------------------------

MEMORY_METRICS = {"setup": "peak_rss_setup_bytes", "train": "peak_rss_train_bytes"}


@dataclass
class Result:
    """What one world size measured: per side label, the block times, the memory growth, the
    loss after training, and the anchor names as reported."""

    times: dict[str, list[float]]
    memory: dict[str, dict[str, int]]
    losses: dict[str, float]
    names: dict[str, str]


def measure(
    world_size: int, groups: list[str], w: Workload, blocks: int, steps: int, memory_steps: int, with_deepspeed: bool
) -> Result:
    from tessera.testing import RankPool

    result = Result({}, {}, {}, {})
    pool = RankPool(world_size)
    try:
        for group in groups:
            out = pool.run(_timing_body, _sides(group, with_deepspeed), w, blocks, steps, timeout=1800)[0]
            result.times.update(out["times"])
            result.losses.update(out["losses"])
            result.names.update(out["names"])
    finally:
        pool.close()
    for group in groups:
        for side in _sides(group, with_deepspeed):
            pool = RankPool(world_size)  # fresh processes: see the module docstring
            try:
                grown = pool.run(_memory_body, side, w, memory_steps, timeout=900)
            finally:
                pool.close()
            if all(g is not None for g in grown):  # the largest over the ranks
                result.memory[side.label] = {k: max(g[k] for g in grown if g is not None) for k in MEMORY_METRICS}
    return result


def rows_of(world_size: int, groups: list[str], w: Workload, result: Result, with_deepspeed: bool) -> list[Row]:
    rows: list[Row] = []
    for group in groups:
        ours, *anchors = _sides(group, with_deepspeed)
        name = f"{group} dp{world_size} {w.tag}"
        for anchor in anchors:
            anchor_name = result.names.get(anchor.label, anchor.label)
            rows.append(Row(name, "step_time_s", statistics.median(result.times[ours.label]), anchor_name,
                            statistics.median(result.times[anchor.label])))  # fmt: skip
            ours_rss, theirs_rss = result.memory.get(ours.label), result.memory.get(anchor.label)
            if ours_rss is not None and theirs_rss is not None:
                for key, metric in MEMORY_METRICS.items():
                    rows.append(Row(name, metric, float(ours_rss[key]), anchor_name, float(theirs_rss[key])))
                # the process's peak over the whole run: the larger of the two phases
                rows.append(Row(name, "peak_rss_bytes", float(max(ours_rss.values())), anchor_name,
                                float(max(theirs_rss.values()))))  # fmt: skip
    return rows


def run(
    ranks: list[int] | None = None,
    groups: tuple[str, ...] = tuple(GROUPS),
    preset: str = "small",
    seq_len: int = 64,
    micro_batch: int = 4,
    dtype: str = "fp32",
    blocks: int = 8,
    steps: int = 2,
    memory_steps: int = 3,
    with_deepspeed: bool | None = None,
    losses: dict[str, float] | None = None,
) -> list[Row]:
    """Rows for every row group on every world size in ``ranks`` (default 4). ``with_deepspeed``
    defaults to whether DeepSpeed is installed. ``losses``, when given, receives each side's loss
    on one micro-batch after training, keyed ``"<label> dpN"`` (the sides should agree)."""
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise ValueError(f"unknown row group(s) {', '.join(unknown)}; groups: {', '.join(GROUPS)}")
    if with_deepspeed is None:
        with_deepspeed = deepspeed_available()
    w = Workload(preset, seq_len, micro_batch, dtype)
    rows: list[Row] = []
    for world_size in ranks or [4]:
        result = measure(world_size, list(groups), w, blocks, steps, memory_steps, with_deepspeed)
        rows += rows_of(world_size, list(groups), w, result, with_deepspeed)
        if losses is not None:
            losses.update({f"{label} dp{world_size}": value for label, value in result.losses.items()})
    return rows


def main(args: argparse.Namespace) -> int:
    ranks = getattr(args, "ranks", None)
    with_deepspeed = deepspeed_available()
    losses: dict[str, float] = {}
    rows = run(ranks=[ranks] if isinstance(ranks, int) else None, with_deepspeed=with_deepspeed, losses=losses)
    print_rows(rows)
    print("loss on one micro-batch after training (the sides should agree):")
    for label, value in losses.items():
        print(f"  {label:<44} {value:.6f}")
    if not with_deepspeed:
        print("DeepSpeed is not installed: its rows are absent (pip install 'tessera[bench]' to add them)")
    if args.out:
        write_rows(rows, args.out)
    return 0
