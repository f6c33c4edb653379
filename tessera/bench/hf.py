"""``tessera bench hf``: an unmodified transformers LLaMA trained under 1D tensor parallelism by
tessera's policy, against torch's ``parallelize_module`` and DeepSpeed AutoTP, on CPU.

Every side trains its own copy of the same ``LlamaForCausalLM`` (built from one
``LlamaConfig`` under the same seed, so the same initial weights; torch's ``sdpa`` attention)
with ``torch.optim.AdamW`` on the same batches ``[batch, seq]`` (every rank of the tensor group
holds the whole batch), with the same loss (cross entropy of ``output.logits`` against the next
tokens), on the same ranks (gloo, one intra-op thread per rank), used the way its users use it:

- tessera: ``use_layout(config={"parallel": {"tensor": {"size": P, "mode": "1d"}}})`` and
  ``tessera.initialize(model, AdamW, loss)``, which applies the LLaMA policy (q/k/v and
  gate/up column-parallel, o/down row-parallel, one all-reduce forward and one backward per
  attention or MLP block; embedding and head split on the vocabulary, logits gathered);
  ``engine.train_batch(iter([(x, y)]))``;
- torch: ``parallelize_module`` on a 1D ``DeviceMesh`` with the LLaMA plan of torch's tensor
  parallel tutorial without its sequence parallelism: ``ColwiseParallel`` on q/k/v/gate/up,
  ``RowwiseParallel`` on o/down, the embedding ``RowwiseParallel(input_layouts=Replicate())``
  and the head ``ColwiseParallel(output_layouts=Replicate())``. The tutorial divides its
  attention's head counts by the mesh size; transformers' attention reads them from the
  projections' widths (``view(..., -1, head_dim)``), so there is nothing to divide;
- DeepSpeed: ``deepspeed.initialize`` with ``tensor_parallel.autotp_size = P`` (AutoTP training,
  which follows the model's ``base_model_tp_plan``: the same column/row split, the head split on
  the vocabulary and gathered, the embedding whole), ZeRO stage 0, no clipping, its CPU
  accelerator on the process group tessera started.

Step time: the sides are built in one rank pool and run in alternating blocks of steps (ABC,
then CBA; :func:`tessera.bench.timing.alternate`), each block timed between barriers with the
slowest rank's time; the value is the median over blocks of the time per step.
``tokens_per_s`` is ``batch * seq`` over that median (the tensor group trains one batch a step).
``collectives_per_step``: the process-group collectives (all-reduce, all-gather, ...) one rank
runs in a training step, counted by the profiler in one more block of steps after the timed
ones (whatever issues them: tessera.comm, DTensor, DeepSpeed's comm).

Every side records its loss at every step (a warm-up step, the timed ones and the counted ones,
each side on the same sequence of batches), and the run checks that the trajectories agree: the first step
within 1e-4 relative (same weights, same batch), every step within 1e-3. A side that computes
something else fails the run, since its time would mean nothing. The ``loss_first`` and
``loss_last`` rows record the agreement.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tessera.bench.checks import built_sides, fresh_deepspeed, loss_gaps
from tessera.bench.pools import rank_pool
from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.timing import alternate, step_block
from tessera.bench.zero_sides import deepspeed_available
from tessera.errors import NotAvailableError

if TYPE_CHECKING:
    from tessera.testing import PoolSet

StepFn = Callable[[torch.Tensor, torch.Tensor], float]

TESSERA = "tessera 1d"
TORCH = "torch parallelize_module"
DEEPSPEED = "DeepSpeed AutoTP"

FIRST_STEP_RTOL = 1e-4  # same weights, same batch: only the reduction order differs
TRAJECTORY_RTOL = 1e-3


@dataclass(frozen=True)
class Workload:
    """The model and data every side trains: a ``LlamaForCausalLM`` (grouped-query attention),
    batches ``[batch, seq]`` of random tokens, AdamW(``lr``), on ``ranks`` ranks (tp ``ranks``)."""

    vocab: int = 1000
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 768
    seq: int = 128
    batch: int = 8
    lr: float = 1e-3
    ranks: int = 4
    distinct_batches: int = 8  # the steps cycle through these

    @property
    def tag(self) -> str:
        return f"hf llama h{self.hidden} l{self.layers} v{self.vocab} tp{self.ranks} b{self.batch}x{self.seq}"


def build_model(w: Workload) -> torch.nn.Module:
    """The plain transformers model, the same on every rank and every side."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=w.vocab, hidden_size=w.hidden, intermediate_size=w.intermediate, num_hidden_layers=w.layers,
        num_attention_heads=w.heads, num_key_value_heads=w.kv_heads, max_position_embeddings=w.seq,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def batches_of(w: Workload) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``distinct_batches`` (inputs, next-token targets), the same on every rank."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, w.vocab, (w.distinct_batches, w.batch, w.seq + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def loss_of(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def build_tessera(w: Workload) -> StepFn:
    """tessera's side, under the layout :func:`_rank_body` made current."""
    import tessera

    model = build_model(w)
    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=w.lr), loss_of)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        return engine.train_batch(iter([(x, y)]))

    return step


def build_torch(w: Workload) -> StepFn:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (w.ranks,))
    model = build_model(w)
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
    }  # fmt: skip
    for layer in model.model.layers:  # type: ignore[union-attr]
        parallelize_module(layer, mesh, layer_plan)  # type: ignore[arg-type]
    root_plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, root_plan)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=w.lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return step


def build_deepspeed(w: Workload) -> StepFn:
    from tessera.bench.zero_anchors import _deepspeed

    deepspeed = _deepspeed()
    model = build_model(w)
    config = {
        "train_micro_batch_size_per_gpu": w.batch,
        "gradient_accumulation_steps": 1,
        "tensor_parallel": {"autotp_size": w.ranks},
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0,  # the other sides do not clip
        "steps_per_print": 2**31 - 1,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=w.lr)
    fresh_deepspeed()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return step


def _rank_body(w: Workload, blocks: int, steps: int, with_deepspeed: bool) -> dict[str, Any]:
    """On every rank: build the sides, take one warm-up step each, then time alternating blocks."""
    from tessera.testing import use_layout

    ctx = use_layout(tensor=w.ranks, config={"parallel": {"tensor": {"size": w.ranks, "mode": "1d"}}})
    group = ctx.group("world")
    builders: dict[str, Callable[[Workload], StepFn]] = {TESSERA: build_tessera, TORCH: build_torch}
    if with_deepspeed:
        builders[DEEPSPEED] = build_deepspeed
    data = batches_of(w)
    step_fns, errors = built_sides(
        {label: partial(build, w) for label, build in builders.items()}, group, lambda label: label == TESSERA
    )
    losses: dict[str, list[float]] = {label: [] for label in step_fns}

    def block(label: str) -> Callable[[], None]:
        return step_block(step_fns[label], data, losses[label], steps)

    for label, fn in step_fns.items():  # warm-up
        x, y = data[0]
        losses[label].append(fn(x, y))
    times = alternate({label: block(label) for label in step_fns}, blocks, steps, group)
    collectives = {label: collectives_in(block(label)) / steps for label in step_fns}  # untimed
    return {"times": times, "losses": losses, "errors": errors, "collectives": collectives}


_COLLECTIVE = re.compile(r"^c10d::_?(allreduce|allgather|all_gather|reduce_scatter|broadcast|alltoall)")


def collectives_in(fn: Callable[[], None]) -> int:
    """How many collectives this rank's process group runs during ``fn()`` (the c10d ops the
    profiler sees, whoever calls them: tessera.comm, DTensor, DeepSpeed)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.count for event in prof.key_averages() if _COLLECTIVE.match(event.key))


def check_losses(losses: dict[str, list[float]]) -> dict[str, float]:
    """Each anchor's largest relative loss difference from tessera's over the steps; raises when
    the first step differs by more than 1e-4 or any step by more than 1e-3 (relative)."""
    return loss_gaps(losses, TESSERA, FIRST_STEP_RTOL, TRAJECTORY_RTOL)


def rows_of(w: Workload, result: dict[str, Any]) -> list[Row]:
    times: dict[str, list[float]] = result["times"]
    losses: dict[str, list[float]] = result["losses"]
    ours = statistics.median(times[TESSERA])
    tokens = w.batch * w.seq
    rows: list[Row] = []
    for label in times:
        if label == TESSERA:
            continue
        theirs = statistics.median(times[label])
        rows.append(Row(w.tag, "step_time_s", ours, label, theirs))
        rows.append(Row(w.tag, "tokens_per_s", tokens / ours, label, tokens / theirs))
        collectives = result["collectives"]
        rows.append(Row(w.tag, "collectives_per_step", collectives[TESSERA], label, collectives[label]))
        rows.append(Row(w.tag, "loss_first", losses[TESSERA][0], label, losses[label][0]))
        rows.append(Row(w.tag, "loss_last", losses[TESSERA][-1], label, losses[label][-1]))
    return rows


def run(
    w: Workload | None = None,
    blocks: int = 16,
    steps: int = 3,
    with_deepspeed: bool | None = None,
    report: dict[str, Any] | None = None,
    pools: PoolSet | None = None,
) -> list[Row]:
    """The rows of ``w`` (default :class:`Workload`), on a fresh pool or on ``pools``'
    (:func:`~tessera.bench.pools.rank_pool`). ``report``, when given, receives the loss
    trajectories (``losses``), each anchor's largest relative loss difference (``worst``) and
    why an anchor could not run (``errors``)."""
    if importlib.util.find_spec("transformers") is None:
        raise NotAvailableError("tessera bench hf trains a transformers model: pip install 'tessera[hf]'")
    w = w or Workload()
    if with_deepspeed is None:
        with_deepspeed = deepspeed_available()
    with rank_pool(w.ranks, pools) as pool:
        result = pool.run(_rank_body, w, blocks, steps, with_deepspeed, timeout=3600)[0]
    worst = check_losses(result["losses"])
    if report is not None:
        report.update(losses=result["losses"], worst=worst, errors=result["errors"])
    return rows_of(w, result)


def main(args: argparse.Namespace) -> int:
    ranks = getattr(args, "ranks", None)
    w = Workload() if ranks is None else Workload(ranks=ranks)
    with_deepspeed = deepspeed_available()
    report: dict[str, Any] = {}
    rows = run(w, with_deepspeed=with_deepspeed, report=report)
    print_rows(rows)
    print("loss trajectories (a warm-up step, the timed steps, the counted ones; each side on the same batches):")
    for label, values in report["losses"].items():
        shown = ", ".join(f"{v:.6f}" for v in values[:3]) + f", ... {values[-1]:.6f} ({len(values)} steps)"
        extra = "" if label == TESSERA else f"; largest relative difference from tessera {report['worst'][label]:.2e}"
        print(f"  {label:<26} {shown}{extra}")
    for label, error in report["errors"].items():
        print(f"{label} could not run here, its rows are absent: {error}", file=sys.stderr)
    if not with_deepspeed:
        print("DeepSpeed is not installed: its rows are absent (pip install 'tessera[bench]' to add them)")
    if args.out:
        write_rows(rows, args.out)
    return 0
