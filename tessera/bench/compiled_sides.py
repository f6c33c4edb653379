"""``tessera bench compile``, what is compared and what every rank runs: the workload, the layouts,
tessera's compiled engine (timed compiled and with its compiled code forced eager), torch FSDP2
with each block compiled first (torchtitan's recipe), and the rank bodies of the timed run and
of the warm-cache run (the method is described in :mod:`tessera.bench.compiled`)."""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from tessera.bench.checks import built_sides
from tessera.bench.timing import alternate, step_block, time_block

if TYPE_CHECKING:
    from tessera.context import ParallelContext
    from tessera.models.gpt import GPT

StepFn = Callable[[torch.Tensor, torch.Tensor], float]

EAGER = "tessera eager"
COMPILED = "tessera compiled"
FSDP2 = "torch FSDP2 + per-block compile"
STARTUP = "compiler start-up"  # a small compile before the sides' first: see compiler_startup

#: each layout and the axis its two ranks form
AXIS = {"dp2": "data", "zero3-dp2": "data", "tp1d-tp2": "tensor", "pp2-1f1b": "pipeline", "sp2-ring": "sequence"}
LAYOUTS = tuple(AXIS)
RANKS = 2
FIRST_LOSS_RTOL = 1e-4  # the same weights and batch, eager on both systems: only the order of sums differs


@dataclass(frozen=True)
class Workload:
    """GPT ``preset`` (``max_seq_len=seq_len``, fields replaced by ``overrides``) trained with
    fused AdamW(``lr``) on ``global_batch`` sequences of ``seq_len`` byte tokens a step, split
    as the layout splits them (module docstring of :mod:`tessera.bench.compiled`); compiled by
    ``backend``."""

    preset: str = "gpt2"
    seq_len: int = 128
    global_batch: int = 4
    lr: float = 1e-4
    backend: str = "inductor"
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def tag(self) -> str:
        return f"gpt-{self.preset} b{self.global_batch}x{self.seq_len}" + (
            "" if self.backend == "inductor" else f" {self.backend}"
        )

    def model(self) -> GPT:
        from tessera.models import gpt

        torch.manual_seed(0)  # every side starts from the same weights
        return gpt(self.preset, max_seq_len=self.seq_len, **self.overrides)


def use(layout: str, w: Workload) -> ParallelContext:
    """Make ``layout``'s context, with compiling on, current on this rank (collective)."""
    from tessera.testing import use_layout

    size = {axis: RANKS if AXIS[layout] == axis else 1 for axis in ("data", "tensor", "pipeline", "sequence")}
    return use_layout(data=size["data"], tensor=size["tensor"], pipeline=size["pipeline"], sequence=size["sequence"],
                      config=layout_config(layout, w))  # fmt: skip


def layout_config(layout: str, w: Workload) -> dict[str, Any]:
    """The config of ``layout`` with compiling on: data parallelism, ZeRO-3, 1D tensor
    parallelism, a 1F1B pipeline of ``global_batch`` one-sequence micro-batches, ring attention."""
    sections: dict[str, dict[str, Any]] = {
        "dp2": {"data": RANKS},
        "zero3-dp2": {"data": RANKS},
        "tp1d-tp2": {"tensor": {"size": RANKS, "mode": "1d"}},
        "pp2-1f1b": {"pipeline": {"size": RANKS, "schedule": "1f1b", "microbatches": w.global_batch}},
        "sp2-ring": {"sequence": {"size": RANKS, "mode": "ring"}},
    }
    config: dict[str, Any] = {"parallel": sections[layout], "compile": {"enabled": True, "backend": w.backend}}
    if layout == "zero3-dp2":
        config["zero"] = {"stage": 3}
    return config


def batches_of(w: Workload, layout: str, data_rank: int, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` steps' batches (inputs, next-token targets) of this rank: each data-parallel
    rank its ``global_batch / 2`` sequences, the ranks of a tensor, pipeline or sequence group
    the same ``global_batch``."""
    rows = w.global_batch // RANKS if AXIS[layout] == "data" else w.global_batch
    g = torch.Generator().manual_seed(1000 + data_rank)
    tokens = [torch.randint(0, 256, (rows, w.seq_len + 1), generator=g) for _ in range(count)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


@contextlib.contextmanager
def inductor_cache(directory: str) -> Iterator[None]:
    """Inductor's on-disk caches (FX graphs, AOT autograd) in ``directory``, its in-memory ones
    emptied first, so that what compiles in the block finds only what ``directory`` holds."""
    from torch._inductor.utils import clear_caches

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    clear_caches()
    try:
        yield
    finally:
        clear_caches()
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def force_eager(fn: StepFn) -> StepFn:
    """``fn`` with every ``torch.compile``'d function it calls run as plain eager code."""

    def eager(x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.compiler.set_stance("force_eager"):
            return fn(x, y)

    return eager


def build_tessera(w: Workload, layout: str) -> tuple[StepFn, Any]:
    """tessera's engine with the model's blocks compiled (``compile.enabled``); its step, and the
    engine (for its compile report)."""
    import tessera
    from tessera.models import NextTokenLoss

    model = w.model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=w.lr, fused=True)
    engine, *_ = tessera.initialize(model, optimizer, NextTokenLoss())
    pipeline = layout.startswith("pp")

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        if pipeline:  # one micro-batch per sequence
            return engine.train_batch(zip(x.split(1), y.split(1), strict=True))
        return engine.train_batch(iter([(x, y)]))

    return step, engine


def build_fsdp2(w: Workload) -> tuple[StepFn, None]:
    """torchtitan's recipe: each block ``torch.compile``'d, then ``fully_shard`` on every block
    (resharded after forward but the last, which the backward needs at once) and on the root."""
    from torch.distributed.fsdp import fully_shard

    from tessera import comm
    from tessera.context import get_context
    from tessera.models import NextTokenLoss

    model = w.model()
    blocks = model.blocks
    assert isinstance(blocks, torch.nn.ModuleList)
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, backend=w.backend)  # type: ignore[assignment]
    for i, block in enumerate(blocks):
        fully_shard(block, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=w.lr, fused=True)
    criterion = NextTokenLoss()
    group = get_context().group("world")

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        return float(comm.all_reduce(loss.detach().clone(), group, op="avg"))  # the loss tessera reports

    return step, None


def _sides(w: Workload, layout: str, group: Any) -> tuple[dict[str, StepFn], Any, dict[str, str]]:
    """The compiled sides of ``layout`` (tessera's; FSDP2's beside ZeRO-3), built on every rank."""
    builders: dict[str, Callable[[], tuple[StepFn, Any]]] = {COMPILED: partial(build_tessera, w, layout)}
    if layout == "zero3-dp2":
        builders[FSDP2] = partial(build_fsdp2, w)
    built, errors = built_sides(builders, group, lambda label: label == COMPILED)
    return {label: fn for label, (fn, _) in built.items()}, built[COMPILED][1], errors


def compiler_startup(backend: str) -> None:
    """Compile and train a small function: what the first compilation of a process pays besides
    its graphs (imports, the C++ compiler's probe, AOT autograd's set-up) is paid here, so that
    it falls on no side's first step (the first side to compile would pay it alone)."""
    weight = torch.randn(8, 8, requires_grad=True)
    step = torch.compile(lambda x: torch.nn.functional.gelu(x @ weight).sum(), backend=backend)
    step(torch.randn(4, 8)).backward()


def _first_steps(
    backend: str,
    fns: dict[str, StepFn],
    caches: dict[str, str],
    data: list[tuple[torch.Tensor, torch.Tensor]],
    losses: dict[str, list[float]],
    group: Any,
) -> dict[str, float]:
    """One eager step of every side (a side's one-time costs: optimizer states, buffers, FSDP2's
    lazy set-up), the compiler's own start-up (:func:`compiler_startup`), then each side's first
    compiled step with its inductor cache: its seconds (:data:`STARTUP`: the compiler's)."""
    for label, fn in fns.items():
        step_block(force_eager(fn), data, losses[EAGER if label == COMPILED else label], 1)()
    with inductor_cache(caches[STARTUP]):
        first = {STARTUP: time_block(partial(compiler_startup, backend), group, 1)}
    for label, fn in fns.items():
        with inductor_cache(caches[label]):
            first[label] = time_block(step_block(fn, data, losses[label], 1), group, 1)
    return first


def release() -> None:
    """Drop the compiled code (it holds the process groups it calls) and what only cycles keep."""
    torch._dynamo.reset()
    gc.collect()


def timing_body(
    w: Workload, layout: str, blocks: int, steps: int, caches: dict[str, str], peak_size: int = 2048
) -> dict[str, Any]:
    """The timed run of one layout on every rank: the matmul peak (every rank at once), the
    sides built, an eager step each, the first compiled step of each with a cold cache, then
    alternating blocks of tessera eager, tessera compiled (and FSDP2)."""
    from tessera.engine.peak import measure_matmul_peak

    torch._dynamo.reset()  # a pool's ranks outlive a run: no compiled code of an earlier one
    ctx = use(layout, w)
    group = ctx.group("world")
    peak = measure_matmul_peak("cpu", "fp32", sizes=(peak_size,), seconds=0.5)
    fns, engine, errors = _sides(w, layout, group)
    data = batches_of(w, layout, ctx.group("data").rank)
    losses: dict[str, list[float]] = {label: [] for label in (EAGER, *fns)}
    first = _first_steps(w.backend, fns, caches, data, losses, group)
    sides = {EAGER: step_block(force_eager(fns[COMPILED]), data, losses[EAGER], steps)}
    sides |= {label: step_block(fn, data, losses[label], steps) for label, fn in fns.items()}
    times = alternate(sides, blocks, steps, group)
    if FSDP2 in losses:  # the same weights and first batch: the same first loss, or it trains something else
        ours, theirs = losses[EAGER][0], losses[FSDP2][0]
        if abs(ours - theirs) > FIRST_LOSS_RTOL * abs(ours):
            raise RuntimeError(f"{FSDP2} trains something else: first loss {theirs}, tessera's {ours}")
    report = engine.compile_report.as_dict() if engine.compile_report is not None else {}
    engine.strategy.close()
    release()
    return {"times": times, "first": first, "peak": peak, "losses": losses, "report": report, "errors": errors}


def warm_body(w: Workload, layout: str, caches: dict[str, str]) -> dict[str, float]:
    """The same sides again in fresh processes, their inductor caches as the timed run left them:
    each side's first compiled step (after an eager one) less its second, in seconds."""
    torch._dynamo.reset()
    ctx = use(layout, w)
    group = ctx.group("world")
    fns, engine, _ = _sides(w, layout, group)
    data = batches_of(w, layout, ctx.group("data").rank)
    losses: dict[str, list[float]] = {label: [] for label in (EAGER, *fns)}
    first = _first_steps(w.backend, fns, caches, data, losses, group)
    warm = {}
    for label, fn in fns.items():
        second = time_block(step_block(fn, data, losses[label], 1), group, 1)
        warm[label] = first[label] - second
    warm[STARTUP] = first[STARTUP]
    engine.strategy.close()
    release()
    return warm


def cold_compile_s(first: float, steady: list[float]) -> float:
    """Seconds the first compiled step took beyond a steady one (the median of ``steady``)."""
    return first - statistics.median(steady)


__all__ = [
    "COMPILED",
    "EAGER",
    "FSDP2",
    "LAYOUTS",
    "Workload",
    "build_fsdp2",
    "build_tessera",
    "layout_config",
    "timing_body",
    "warm_body",
]
