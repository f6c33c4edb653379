"""``tessera bench lora``: fine-tuning a LLaMA-shaped transformers model on 2 ranks (data
parallelism), full fine-tuning against LoRA, LoRA on int8 and NF4 bases, and PEFT's LoRA under
torch DDP and under DeepSpeed ZeRO-3, on CPU; and the largest model each way fine-tunes under
one memory budget per rank.

Every side trains its own copy of the same ``LlamaForCausalLM`` (one config, one seed) on the
same batches with AdamW; the LoRA sides adapt q, k, v, o, gate, up and down with rank 16:

- tessera: ``tessera.lora.apply`` (and ``tessera.lora.quant.quantize`` for the int8/NF4 bases),
  ``tessera.initialize`` under ``parallel.data = 2`` (full fine-tuning: the same, no adapters);
- PEFT + DDP: ``peft.get_peft_model(model, LoraConfig(...))`` wrapped in torch's
  ``DistributedDataParallel``;
- PEFT + DeepSpeed ZeRO-3: the PEFT model through ``deepspeed.initialize`` with ZeRO stage 3 on
  its CPU accelerator (bench extra).

Step time: the sides alternate blocks of steps in one pool (:func:`tessera.bench.timing.alternate`),
the median per step. Peak RSS: each side in a fresh pool of its own, after importing what it
uses, from just before it builds its model to the end of its steps, the larger rank's.
Two phases: ``setup`` (the build; a quantized base exists in full precision until it is
quantized: quantizing while loading is not built yet) and ``train`` (the steps, the peak reset
after the build). ``trainable``: the parameters the side trains. The largest model: layers are
added (hidden size fixed) until a side's training growth passes the budget, for full
fine-tuning, for LoRA on an NF4 base and for LoRA on an NF4 base whose shards Gemini keeps on
disk (``gemini.frozen_tier = "disk"``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tessera.bench.checks import built_sides, fresh_deepspeed
from tessera.bench.pools import rank_pool
from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.timing import alternate, step_block
from tessera.bench.zero_sides import deepspeed_available

if TYPE_CHECKING:
    from tessera.testing import PoolSet

StepFn = Callable[[torch.Tensor, torch.Tensor], float]

FULL, LORA, INT8, NF4 = "tessera full", "tessera lora", "tessera lora int8", "tessera lora nf4"
NF4_GEMINI = "tessera lora nf4, gemini base on disk"
PEFT_DDP, PEFT_DS = "PEFT + DDP", "PEFT + DeepSpeed ZeRO-3"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_MIB = 2**20


@dataclass(frozen=True)
class Workload:
    """A ``LlamaForCausalLM`` (grouped-query attention) and batches ``[batch, seq]`` per rank."""

    vocab: int = 2048
    hidden: int = 512
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1408
    seq: int = 64
    batch: int = 4
    rank: int = 16
    lr: float = 1e-4
    ranks: int = 2

    @property
    def tag(self) -> str:
        return f"llama h{self.hidden} l{self.layers} dp{self.ranks} b{self.batch}x{self.seq} r{self.rank}"


def build_model(w: Workload) -> torch.nn.Module:
    """The plain transformers model of ``w``, the same on every rank and every side (built as
    ``tessera bench hf`` builds its LLaMA)."""
    from tessera.bench import hf

    fields = ("vocab", "hidden", "layers", "heads", "kv_heads", "intermediate", "seq")
    return hf.build_model(hf.Workload(**{name: getattr(w, name) for name in fields}))


def loss_of(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def _trained(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def build_tessera(w: Workload, label: str) -> tuple[StepFn, int]:
    import tessera
    import tessera.lora
    from tessera.lora.quant import quantize

    model = build_model(w)
    if label != FULL:
        tessera.lora.apply(model, rank=w.rank, alpha=2.0 * w.rank, targets=TARGETS)
        if label in (INT8, NF4, NF4_GEMINI):
            quantize(model, "int8" if label == INT8 else "nf4", double_quant=label != INT8)
    trained = _trained(model)
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(trained, lr=w.lr), loss_of)
    return (lambda x, y: engine.train_batch(iter([(x, y)]))), sum(p.numel() for p in trained)


def _mean_over_ranks(loss: torch.Tensor) -> float:
    """The loss averaged over the ranks, as tessera's engine reports it."""
    from tessera import comm
    from tessera.context import get_context

    value = comm.all_reduce(loss.detach().clone(), get_context().group("world"), op="avg")
    return float(value)


def _peft_model(w: Workload) -> torch.nn.Module:
    import peft

    config = peft.LoraConfig(r=w.rank, lora_alpha=2 * w.rank, target_modules=TARGETS, lora_dropout=0.0)
    return peft.get_peft_model(build_model(w), config)


def build_peft_ddp(w: Workload, label: str) -> tuple[StepFn, int]:
    from torch.nn.parallel import DistributedDataParallel

    model = _peft_model(w)
    trained = _trained(model)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(trained, lr=w.lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(ddp(input_ids=x), y)
        loss.backward()
        optimizer.step()
        return _mean_over_ranks(loss)

    return step, sum(p.numel() for p in trained)


def build_peft_deepspeed(w: Workload, label: str) -> tuple[StepFn, int]:
    from tessera.bench.zero_anchors import _deepspeed

    deepspeed = _deepspeed()
    model = _peft_model(w)
    trained = _trained(model)
    count = sum(p.numel() for p in trained)  # before ZeRO-3 partitions them (a partitioned one has no elements)
    config = {
        "train_micro_batch_size_per_gpu": w.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31 - 1,
    }
    fresh_deepspeed()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trained, lr=w.lr), config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = loss_of(engine(input_ids=x), y)
        engine.backward(loss)
        engine.step()
        return _mean_over_ranks(loss)

    return step, count


BUILDERS: dict[str, Callable[[Workload, str], tuple[StepFn, int]]] = {
    FULL: build_tessera, LORA: build_tessera, INT8: build_tessera, NF4: build_tessera, NF4_GEMINI: build_tessera,
    PEFT_DDP: build_peft_ddp, PEFT_DS: build_peft_deepspeed,
}  # fmt: skip


def _batches(w: Workload, rank: int, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5 + rank)
    tokens = torch.randint(0, w.vocab, (count, w.batch, w.seq + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _layout(w: Workload, label: str = FULL) -> Any:
    """Data parallelism over ``w.ranks``; for :data:`NF4_GEMINI` under Gemini with the frozen
    base's shards on disk (each rank's files in a folder of its own under the temporary
    directory, removed when the side ends)."""
    import os
    import tempfile

    from tessera.testing import use_layout

    config: dict[str, Any] = {"parallel": {"data": w.ranks}}
    if label == NF4_GEMINI:
        folder = os.path.join(tempfile.gettempdir(), "tessera-bench-lora")
        config["gemini"] = {"enabled": True, "frozen_tier": "disk", "offload_dir": folder}
    return use_layout(data=w.ranks, config=config)


def timing_body(w: Workload, labels: list[str], blocks: int, steps: int) -> dict[str, Any]:
    ctx = _layout(w)
    group = ctx.group("world")
    data = _batches(w, ctx.rank)
    built, errors = built_sides(
        {label: partial(BUILDERS[label], w, label) for label in labels},
        group,
        lambda label: label.startswith("tessera"),
    )
    fns = {label: fn for label, (fn, _) in built.items()}
    trainable = {label: count for label, (_, count) in built.items()}
    losses: dict[str, list[float]] = {label: [] for label in fns}

    def block(label: str) -> Callable[[], None]:
        return step_block(fns[label], data, losses[label], steps)

    for label in fns:  # warm-up
        block(label)()
    times = alternate({label: block(label) for label in fns}, blocks, steps, group)
    return {"times": times, "trainable": trainable, "errors": errors, "losses": losses}


def memory_body(w: Workload, label: str, steps: int) -> dict[str, int] | None:
    """This rank's peak RSS growth while ``label`` builds its model (``setup``: the full-precision
    base exists whole before it is quantized) and while it then trains ``steps`` steps
    (``train``, the peak reset after the build), over the RSS before the build (what it uses
    imported first, on a one-layer miniature). Allocations of 256 KiB or more are mapped on
    their own, so that what a side frees (a quantized base's full-precision build) leaves the
    resident set as it would with a tuned allocator."""
    from tessera.memory.report import map_large_allocations, peak_rss_bytes, reset_peak_rss, trim_heap

    map_large_allocations()  # every side alike: freed buffers go back to the system, the RSS follows what lives
    ctx = _layout(w, label)
    data = _batches(w, ctx.rank)
    tiny = replace(w, layers=1, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256)
    fn, _ = BUILDERS[label](tiny, label)
    fn(*_batches(tiny, ctx.rank, 1)[0])
    del fn
    gc.collect()
    trim_heap()
    if not reset_peak_rss():
        return None
    before = peak_rss_bytes()
    fn, _ = BUILDERS[label](w, label)
    setup = peak_rss_bytes()
    gc.collect()
    trim_heap()
    reset_peak_rss()
    for i in range(steps):
        fn(*data[i % len(data)])
    train = peak_rss_bytes()
    if before is None or setup is None or train is None:
        return None
    return {"setup": setup - before, "train": train - before}


def peak_growth(w: Workload, label: str, steps: int, pools: PoolSet | None = None) -> dict[str, int] | None:
    """The larger rank's :func:`memory_body`, phase by phase."""
    with rank_pool(w.ranks, pools) as pool:  # fresh processes, unless the caller's (tests)
        grown = pool.run(memory_body, w, label, steps, timeout=900)
    if any(g is None for g in grown):
        return None
    return {phase: max(g[phase] for g in grown if g is not None) for phase in ("setup", "train")}


def largest(
    w: Workload, label: str, budget: int, steps: int = 2, most: int = 64, pools: PoolSet | None = None
) -> tuple[int, list[tuple[int, int]]]:
    """The most layers (hidden size fixed) whose peak RSS growth stays within ``budget``, doubling
    then bisecting; the parameters of that model and what each try took."""
    tried: list[tuple[int, int]] = []

    def fits(layers: int) -> bool:
        grown = peak_growth(replace(w, layers=layers), label, steps, pools)
        train = grown["train"] if grown is not None else 0
        tried.append((layers, train))
        print(f"  {label}: {layers} layers, training grew {train / _MIB:.0f} MiB", file=sys.stderr, flush=True)
        return grown is not None and train <= budget

    low, high = 0, 1
    while high <= most and fits(high):
        low, high = high, high * 2
    while high - low > 1 and low > 0:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    params = sum(p.numel() for p in build_model(replace(w, layers=low)).parameters()) if low else 0
    return params, tried


def run(
    w: Workload | None = None,
    blocks: int = 6,
    steps: int = 2,
    memory_steps: int = 3,
    budget_mib: int = 768,
    with_deepspeed: bool | None = None,
    report: dict[str, Any] | None = None,
    most: int = 64,
    pools: PoolSet | None = None,
) -> list[Row]:
    """The rows of ``w`` (default :class:`Workload`); with ``pools`` every measurement runs on
    their pool (tests: the memory rows are then made, not meaningful)."""
    w = w or Workload()
    if with_deepspeed is None:
        with_deepspeed = deepspeed_available()
    labels = [FULL, LORA, INT8, NF4, PEFT_DDP] + ([PEFT_DS] if with_deepspeed else [])
    with rank_pool(w.ranks, pools) as pool:
        timed = pool.run(timing_body, w, labels, blocks, steps, timeout=3600)[0]
    memory = {label: peak_growth(w, label, memory_steps, pools) for label in timed["times"]}
    rows: list[Row] = []
    step = {label: statistics.median(t) for label, t in timed["times"].items()}
    for ours, anchor in ((LORA, FULL), (INT8, FULL), (NF4, FULL), (LORA, PEFT_DDP), (LORA, PEFT_DS), (NF4, PEFT_DS)):
        if ours not in step or anchor not in step:
            continue
        name = f"{ours} vs {anchor} {w.tag}"
        rows.append(Row(name, "step_time_s", step[ours], anchor, step[anchor]))
        mine, theirs = memory.get(ours), memory.get(anchor)
        if mine is not None and theirs is not None:
            for phase in ("setup", "train"):
                if theirs[phase] > 0:  # a miniature's warm-up may leave a side's build no growth to show
                    rows.append(Row(name, f"peak_rss_{phase}_bytes", float(mine[phase]), anchor, float(theirs[phase])))
        rows.append(Row(name, "trainable_params", float(timed["trainable"][ours]), anchor,
                        float(timed["trainable"][anchor])))  # fmt: skip
    if report is not None:
        report.update(errors=timed["errors"], memory=memory, losses=timed["losses"])
    return rows + largest_rows(w, budget_mib, most, pools, report)


def largest_rows(
    w: Workload, budget_mib: int = 768, most: int = 64, pools: PoolSet | None = None, report: dict | None = None
) -> list[Row]:
    """The largest model full fine-tuning, LoRA on NF4 and LoRA on NF4 with the base on disk
    under Gemini train within ``budget_mib`` per rank (``tessera bench lora --only largest``)."""
    budget = budget_mib * _MIB
    found = {label: largest(w, label, budget, most=most, pools=pools) for label in (FULL, NF4, NF4_GEMINI)}
    full = float(found[FULL][0])
    rows = [
        Row(f"largest llama h{w.hidden} under {budget_mib} MiB/rank ({label})", "parameters", float(found[label][0]),
            f"{FULL} (largest fine-tuned whole)", full)
        for label in (NF4, NF4_GEMINI) if full
    ]  # fmt: skip
    if report is not None:
        report["tried"] = {label: tried for label, (_, tried) in found.items()}
    return rows


def main(args: argparse.Namespace) -> int:
    from tessera.errors import NotAvailableError

    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise NotAvailableError(
            "tessera bench lora needs transformers and peft: pip install 'tessera[hf,peft]'"
        ) from exc
    report: dict[str, Any] = {"errors": {}}
    if args.only not in (None, "largest"):
        raise NotAvailableError(f"tessera bench lora --only {args.only!r}: the one part it runs alone is 'largest'")
    rows = largest_rows(Workload(), report=report) if args.only == "largest" else run(report=report)
    print_rows(rows)
    for label, error in report["errors"].items():
        print(f"{label} could not run here, its rows are absent: {error}", file=sys.stderr)
    if args.out:
        write_rows(rows, args.out)
    return 0
