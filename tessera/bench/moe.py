"""``tessera bench moe``: tessera's mixture-of-experts GPT under expert parallelism against a
dense GPT of the same active parameters and against DeepSpeed-MoE, on CPU.

The sides, each trained with ``torch.optim.AdamW`` on the same micro-batches (one
``[micro_batch, seq_len]`` of byte tokens per rank and step, each rank its own), on the same
ranks (gloo, one intra-op thread per rank), used the way their users use them:

- tessera MoE: the GPT MoE preset (default ``tiny-moe``: Mixtral-style, top-2 of 8 SwiGLU
  experts in every block, capacity factor 1.25) under
  ``use_layout(config={"parallel": {"data": N, "expert": E}})``: the experts spread over ``E``
  of the ``N`` data ranks, tokens exchanged by all-to-all, expert gradients averaged over the
  ranks holding the same experts; ``tessera.initialize(model, AdamW, NextTokenLoss())``,
  ``engine.train_batch(iter([(x, y)]))``; the auxiliary losses join the backward by themselves;
- dense GPT (the anchor of the ratios): the same GPT with dense GELU MLPs whose width gives
  each token the MoE's active MLP parameters (``2 d ff_dense = k * 3 d ff_expert`` for SwiGLU
  experts, so ``ff_dense = 3 k ff_expert / 2``: 768 for ``tiny-moe``), trained by tessera's
  engine with plain data parallelism on the same ranks;
- DeepSpeed-MoE: the same GPT with every MoE MLP a ``deepspeed.moe.layer.MoE`` (``ep_size=E``,
  ``k``, the same capacity factor, SwiGLU experts, the same initial weights), trained by a
  DeepSpeed engine (ZeRO stage 0) on its CPU accelerator (:mod:`tessera.bench.moe_deepspeed`).
  DeepSpeed is optional (``pip install 'tessera[bench]'``): without it, or where it fails here,
  its rows are absent and the run says why.

Layouts (row names ``epE dpN``: N data-parallel ranks, the experts spread over E of them; each
rank holds ``experts / E``): ep1 dp2 (every rank holds every expert), ep2 dp2, and ep2 dp4
(experts over 2 ranks, 2 such groups); ``--ranks N`` measures ep1, ep2 and epN on N ranks.

Step time: the sides of a layout are built in one rank pool and run in alternating blocks of
steps (ABC, then CBA; :func:`tessera.bench.timing.alternate`), each block timed between barriers
with the slowest rank's time; the value is the median over blocks (default 16 of 3 steps) of
the time per step. ``tokens_per_s``: the tokens of all ranks' micro-batches over it.
``params_total`` and ``params_active`` (per token: all but the experts a token is not routed
to) count single-process parameters, the tied embedding once.

Losses: every side records the mean over the ranks of its micro-batch loss at every step (a
warm-up step, then the timed ones; each side on the same batches). tessera's and DeepSpeed's
MoE start from the same weights on the same batches, so their first losses agree to 1e-4 (the
run checks it). After that they drift apart slowly, for two reasons, both DeepSpeed's
semantics: its auxiliary loss differs (tessera's load-balancing loss counts both choices and
adds the router z-loss; DeepSpeed's counts first choices only, no z-loss), and when capacity
drops a token's choice DeepSpeed renormalises the token's weights over the choices kept
(tessera, as GShard, keeps the weights and the dropped choice adds nothing). The run checks
every step within 5e-2 (1.5e-2 after the 51 steps of the default run, which takes the loss
from 5.57 to about 1.9 by learning its 4 batches per rank by heart). Without drops
(``moe_capacity_factor=None``) and without auxiliary losses the two train to the same losses
(5e-8 relative over 10 steps of ``tiny-moe`` on ep2; the tests check 1e-5 at their size). The
dense GPT is another model; its losses are reported beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tessera.bench.checks import agreed, loss_gaps
from tessera.bench.pools import rank_pool
from tessera.bench.report import Row, print_rows, write_rows
from tessera.bench.timing import alternate
from tessera.bench.zero_sides import deepspeed_available
from tessera.context import ParallelContext
from tessera.models.gpt import GPTConfig, preset_config

if TYPE_CHECKING:
    from tessera.testing import PoolSet

StepFn = Callable[[torch.Tensor, torch.Tensor], float]

TESSERA = "tessera MoE"
DENSE = "dense GPT"
DEEPSPEED = "DeepSpeed-MoE"

FIRST_STEP_RTOL = 1e-4  # same weights, same batch: only the order of sums differs
TRAJECTORY_RTOL = 5e-2  # the auxiliary losses and the weights after drops differ (module docstring)


@dataclass(frozen=True)
class Workload:
    """The models and data: GPT ``preset`` (``max_seq_len=seq_len``, fields replaced by
    ``overrides``), one micro-batch ``[micro_batch, seq_len]`` per rank and step (the steps cycle
    through ``distinct_batches`` of them), AdamW(``lr``)."""

    preset: str = "tiny-moe"
    seq_len: int = 128
    micro_batch: int = 8
    lr: float = 1e-3
    distinct_batches: int = 4
    overrides: dict[str, Any] = field(default_factory=dict)

    def moe_config(self) -> GPTConfig:
        config = preset_config(self.preset, max_seq_len=self.seq_len, **self.overrides)
        if not config.num_experts:
            raise ValueError(f"tessera bench moe needs an MoE preset (num_experts > 0), not {self.preset!r}")
        return config

    def dense_config(self) -> GPTConfig:
        config = self.moe_config()
        return dataclasses.replace(config, num_experts=0, d_ff=dense_ff_dim(config))

    @property
    def tag(self) -> str:
        return f"gpt-{self.preset} b{self.micro_batch}x{self.seq_len}"


@dataclass(frozen=True)
class Layout:
    """``ranks`` data-parallel ranks, the experts spread over ``expert`` of them."""

    ranks: int
    expert: int

    @property
    def name(self) -> str:
        return f"ep{self.expert} dp{self.ranks}"


LAYOUTS = (Layout(2, 1), Layout(2, 2), Layout(4, 2))


def layouts_for(ranks: int) -> list[Layout]:
    """ep1, ep2 and ep``ranks`` on ``ranks`` ranks (those that divide it)."""
    return [Layout(ranks, e) for e in sorted({1, 2, ranks}) if ranks % e == 0]


def dense_ff_dim(config: GPTConfig) -> int:
    """The dense GELU MLP width with the MoE's active MLP parameters per token: ``2 d ff`` against
    ``k`` experts of ``3 d ff_expert`` (SwiGLU) or ``2 d ff_expert`` (GELU)."""
    matrices = 3 if config.moe_activation == "swiglu" else 2
    active = config.moe_top_k * matrices * config.ff_dim
    if active % 2:
        raise ValueError(f"no dense width matches {config.moe_top_k} x {matrices} x ff {config.ff_dim} / 2")
    return active // 2


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(total, active per token)`` single-process parameters of a GPT: the active ones leave out
    the experts each token is not routed to (``num_experts - top_k`` of every MoE layer's)."""
    from tessera.context.placement import full_numel
    from tessera.nn.moe import moe_layers

    total = int(model.num_parameters())  # type: ignore[operator]
    idle = 0
    for _, layer in moe_layers(model):
        experts = sum(full_numel(w) for w in layer.experts.weights())
        idle += experts * (layer.num_experts - layer.top_k) // layer.num_experts
    return total, total - idle


def batches_of(w: Workload, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``distinct_batches`` micro-batches (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(1000 + rank)
    vocab = w.moe_config().vocab_size
    tokens = [torch.randint(0, vocab, (w.micro_batch, w.seq_len + 1), generator=g) for _ in range(w.distinct_batches)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def build_tessera(model: torch.nn.Module, lr: float) -> StepFn:
    """tessera's engine over ``model`` in the current layout; the step returns the loss averaged
    over the data ranks."""
    import tessera
    from tessera.models import NextTokenLoss

    engine, *_ = tessera.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr), NextTokenLoss())

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        return engine.train_batch(iter([(x, y)]))

    return step


def _rank_body(layout: Layout, w: Workload, blocks: int, steps: int, with_deepspeed: bool) -> dict[str, Any]:
    """On every rank: build the sides, take one warm-up step each, time alternating blocks."""
    from tessera.context import set_context
    from tessera.models.gpt import GPT
    from tessera.testing import use_layout

    def enter(expert: int) -> ParallelContext:
        """Make current the layout with the experts over ``expert`` of the ranks (tessera.initialize
        reads it; the dense GPT has no experts to spread: 1, plain data parallelism)."""
        return use_layout(
            data=layout.ranks, expert=expert, config={"parallel": {"data": layout.ranks, "expert": expert}}
        )

    def model_of(config: GPTConfig) -> torch.nn.Module:
        torch.manual_seed(0)  # tessera's and DeepSpeed's MoE start from the same weights
        return GPT(config)

    contexts = {TESSERA: enter(layout.expert), DENSE: enter(1)}
    group = contexts[TESSERA].group("world")
    models = {TESSERA: lambda: model_of(w.moe_config()), DENSE: lambda: model_of(w.dense_config())}
    step_fns: dict[str, StepFn] = {}
    params: dict[str, tuple[int, int]] = {}
    for label in (TESSERA, DENSE):
        enter(contexts[label].size("expert"))
        model = models[label]()
        params[label] = parameter_counts(model)
        step_fns[label] = build_tessera(model, w.lr)
    errors: dict[str, str] = {}
    if with_deepspeed:
        from tessera.bench.moe_deepspeed import build_deepspeed_moe

        contexts[DEEPSPEED] = enter(layout.expert)  # its model is tessera's, built alike
        error = None
        try:
            expert_rank = contexts[DEEPSPEED].local_rank("expert")
            step_fns[DEEPSPEED] = build_deepspeed_moe(models[TESSERA], expert_rank, layout.expert, w.micro_batch, w.lr)
        except Exception as exc:  # it cannot run here: its rows are absent, the reason printed
            error = f"{type(exc).__name__}: {exc}"
        if not agreed(error is None, group):
            step_fns.pop(DEEPSPEED, None)
            errors[DEEPSPEED] = error or "failed on another rank"
    data = batches_of(w, group.rank)
    losses: dict[str, list[float]] = {label: [] for label in step_fns}

    def block(label: str) -> Callable[[], None]:
        def run() -> None:
            set_context(contexts[label])  # layers read the current context in their forward
            for _ in range(steps):
                x, y = data[len(losses[label]) % len(data)]
                losses[label].append(step_fns[label](x, y))

        return run

    for label in step_fns:  # warm-up: buffers, groups and optimizer states appear
        block(label)()
    times = alternate({label: block(label) for label in step_fns}, blocks, steps, group)
    if DEEPSPEED in losses:  # its step returns this rank's loss; tessera's engine the mean over the ranks
        from tessera import comm

        total = comm.all_reduce(torch.tensor(losses[DEEPSPEED], dtype=torch.float64), group)
        losses[DEEPSPEED] = (total / group.size).tolist()
    return {"times": times, "losses": losses, "errors": errors, "params": params}


def check_losses(losses: dict[str, list[float]]) -> float | None:
    """DeepSpeed-MoE's largest relative loss difference from tessera's MoE over the steps (None
    without it); raises when the first step differs by more than 1e-4 or any by more than 5e-2."""
    if DEEPSPEED not in losses:
        return None
    pair = {TESSERA: losses[TESSERA], DEEPSPEED: losses[DEEPSPEED]}
    return loss_gaps(pair, TESSERA, FIRST_STEP_RTOL, TRAJECTORY_RTOL)[DEEPSPEED]


def dense_label(w: Workload) -> str:
    return f"{DENSE} ff{dense_ff_dim(w.moe_config())}"


def rows_of(layout: Layout, w: Workload, result: dict[str, Any]) -> list[Row]:
    """The rows of one layout's measurements: tessera's MoE against the dense GPT measured in the
    same run (step time, tokens/s, parameters), and against DeepSpeed-MoE where it ran (step
    time, tokens/s, the first and last loss)."""
    times = {label: statistics.median(values) for label, values in result["times"].items()}
    losses: dict[str, list[float]] = result["losses"]
    params: dict[str, tuple[int, int]] = result["params"]
    name = f"{layout.name} {w.tag}"
    tokens = w.micro_batch * w.seq_len * layout.ranks
    ours, dense = times[TESSERA], times[DENSE]
    anchor = dense_label(w)
    rows = [
        Row(name, "step_time_s", ours, anchor, dense),
        Row(name, "tokens_per_s", tokens / ours, anchor, tokens / dense),
        Row(name, "params_total", float(params[TESSERA][0]), anchor, float(params[DENSE][0])),
        Row(name, "params_active", float(params[TESSERA][1]), anchor, float(params[DENSE][1])),
    ]
    if DEEPSPEED in times:
        theirs, anchor = times[DEEPSPEED], f"{DEEPSPEED} ep{layout.expert}"
        rows += [
            Row(name, "step_time_s", ours, anchor, theirs),
            Row(name, "tokens_per_s", tokens / ours, anchor, tokens / theirs),
            Row(name, "loss_first", losses[TESSERA][0], anchor, losses[DEEPSPEED][0]),
            Row(name, "loss_last", losses[TESSERA][-1], anchor, losses[DEEPSPEED][-1]),
        ]
    return rows


def table(w: Workload, report: dict[str, dict[str, Any]]) -> str:
    """A markdown table of every layout and side: parameters, step time, tokens/s, the step
    time against the dense GPT of the same run, and the loss after the timed steps."""
    lines = [
        "| layout | side | params total | active / token | step time (s) | tokens/s | vs dense | last loss |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, result in report.items():
        tokens = w.micro_batch * w.seq_len * result["ranks"]
        times = {label: statistics.median(values) for label, values in result["times"].items()}
        for label, seconds in times.items():
            total, active = result["params"][DENSE if label == DENSE else TESSERA]
            side = dense_label(w) if label == DENSE else label
            lines.append(
                f"| {name} | {side} | {total:,} | {active:,} | {seconds:.4f} | {tokens / seconds:,.0f} | "
                f"{seconds / times[DENSE]:.3f} | {result['losses'][label][-1]:.4f} |"
            )
        for label, error in result["errors"].items():
            lines.append(f"| {name} | {label} | | | did not run: {error} | | | |")
    return "\n".join(lines)


def run(
    w: Workload | None = None,
    layouts: tuple[Layout, ...] | list[Layout] = LAYOUTS,
    blocks: int = 16,
    steps: int = 3,
    with_deepspeed: bool | None = None,
    report: dict[str, dict[str, Any]] | None = None,
    pools: PoolSet | None = None,
) -> list[Row]:
    """The rows of every layout (one rank pool per world size: a fresh one, or ``pools``';
    :func:`~tessera.bench.pools.rank_pool`). ``with_deepspeed`` defaults to
    whether DeepSpeed is installed. ``report``, when given, receives per layout name its block
    times, loss trajectories, parameter counts, why DeepSpeed could not run (``errors``), its
    largest relative loss difference from tessera's MoE (``worst``) and the world size."""
    w = w or Workload()
    if with_deepspeed is None:
        with_deepspeed = deepspeed_available()
    rows: list[Row] = []
    for ranks in dict.fromkeys(layout.ranks for layout in layouts):
        with rank_pool(ranks, pools) as pool:
            for layout in (x for x in layouts if x.ranks == ranks):
                result = pool.run(_rank_body, layout, w, blocks, steps, with_deepspeed, timeout=1800)[0]
                worst = check_losses(result["losses"])
                rows += rows_of(layout, w, result)
                if report is not None:
                    report[f"{layout.name} {w.tag}"] = {**result, "worst": worst, "ranks": layout.ranks}
    return rows


def main(args: argparse.Namespace) -> int:
    ranks = getattr(args, "ranks", None)
    w = Workload()
    with_deepspeed = deepspeed_available()
    report: dict[str, dict[str, Any]] = {}
    rows = run(w, layouts_for(ranks) if ranks else LAYOUTS, with_deepspeed=with_deepspeed, report=report)
    print_rows(rows)
    print()
    print(table(w, report))
    print()
    print("loss trajectories (mean over the ranks; a warm-up step, then the timed ones, on the same batches):")
    for name, result in report.items():
        for label, values in result["losses"].items():
            shown = ", ".join(f"{v:.4f}" for v in values[:3]) + f", ... {values[-1]:.4f} ({len(values)} steps)"
            extra = f"; largest relative difference from {TESSERA} {result['worst']:.2e}" if label == DEEPSPEED else ""
            print(f"  {name:<32} {label:<14} {shown}{extra}")
        for label, error in result["errors"].items():
            print(f"{label} could not run on {name}, its rows are absent: {error}", file=sys.stderr)
    if not with_deepspeed:
        print("DeepSpeed is not installed: its rows are absent (pip install 'tessera[bench]' to add them)")
    if args.out:
        write_rows(rows, args.out)
    return 0


__all__ = [
    "LAYOUTS",
    "Layout",
    "Workload",
    "check_losses",
    "dense_ff_dim",
    "layouts_for",
    "main",
    "parameter_counts",
    "rows_of",
    "run",
    "table",
]
