"""A model cut into pipeline stages for this rank: its chunks, its schedule, and the gradient
work a pipeline step needs beyond the schedule (parameters shared across stages, data-parallel
averaging).

Every rank builds the whole model (same seed, same weights) and keeps training only the chunks
it holds; each parameter's placement records the pipeline rank that owns it (``stage``), which
is where ``full_state_dict`` fetches it from. A parameter used by chunks on several ranks
(a GPT's embedding tied to its output head) is kept equal everywhere by summing its gradient
over the pipeline group before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tessera import comm
from tessera.context import ParallelContext
from tessera.context.placement import placement_of, update_placement
from tessera.errors import ConfigError
from tessera.parallel.pipeline.partition import blocks_of, chunk_ranges, chunks_of_rank, partition
from tessera.parallel.pipeline.runtime import LossFn, PipelineRuntime, build_chunks
from tessera.parallel.pipeline.schedules import build_schedule


def pipeline_layers(model: nn.Module) -> Sequence[nn.Module]:
    """The model as a sequence of layers to cut into stages: ``model.pipeline_layers()`` where the
    model defines it (the GPT and the ViT wrap their embeddings and head around their blocks),
    else its blocks (an ``nn.Sequential``, or a ``blocks``/``layers``/``h`` list)."""
    method = getattr(model, "pipeline_layers", None)
    if callable(method):
        return list(method())
    return list(blocks_of(model))


@dataclass(frozen=True)
class PipelineOptions:
    """How to cut and run the pipeline (built from the config's ``parallel.pipeline``):
    ``schedule`` (gpipe, 1f1b, interleaved, zero_bubble), ``microbatches`` per step (None: one per
    stage), model ``chunks`` per rank, the ``partition`` method and its explicit ``boundaries``."""

    schedule: str = "1f1b"
    microbatches: int | None = None
    chunks: int = 1
    partition: str = "parameters"
    boundaries: tuple[int, ...] | None = None


class PipelineStage:
    """This rank's part of a pipelined model and the runtime that trains it."""

    def __init__(
        self,
        model: nn.Module,
        criterion: LossFn | None,
        ctx: ParallelContext,
        *,
        schedule: str,
        microbatches: int,
        chunks_per_rank: int,
        method: str,
        boundaries: list[int] | None,
    ) -> None:
        layers = pipeline_layers(model)
        p = ctx.size("pipeline")
        parts = p * chunks_per_rank
        if method == "time":
            raise ConfigError(
                "parallel.pipeline.partition='time' needs a sample batch; use 'parameters', 'uniform' or 'explicit'"
            )
        self.boundaries = partition(layers, parts, method, boundaries=boundaries)
        self.stage = ctx.local_rank("pipeline")
        self.schedule = schedule
        self.microbatches = microbatches
        self.ctx = ctx
        chunk_ids = chunks_of_rank(self.stage, p, chunks_per_rank)
        self.chunks = build_chunks(layers, self.boundaries, chunk_ids)
        self.shared = self._mark_owners(layers, parts, p)
        actions = build_schedule(schedule, p, microbatches, chunks_per_rank)[self.stage]
        self.runtime = PipelineRuntime(self.chunks, actions, parts, criterion, ctx.group("pipeline"))

    def _mark_owners(self, layers: Sequence[nn.Module], parts: int, p: int) -> list[nn.Parameter]:
        """Tag every parameter with its owning pipeline rank; return those held on several ranks."""
        owners: dict[int, set[int]] = {}
        params: dict[int, nn.Parameter] = {}
        for chunk, (start, end) in enumerate(chunk_ranges(self.boundaries, len(layers))):
            for layer in layers[start:end]:
                for param in layer.parameters():
                    owners.setdefault(id(param), set()).add(chunk % p)
                    params[id(param)] = param
        for key, param in params.items():
            update_placement(param, stage=min(owners[key]), tied=len(owners[key]) > 1, mesh=self._mesh(param))
        return [params[key] for key in params if len(owners[key]) > 1]

    def _mesh(self, param: nn.Parameter) -> ParallelContext:
        """The context a parameter's placement names: the one that split it, else this stage's."""
        mesh = placement_of(param).mesh
        return mesh if mesh is not None else self.ctx

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The parameters this rank trains."""
        seen: dict[int, nn.Parameter] = {}
        for chunk in self.chunks.values():
            for param in chunk.parameters():
                seen.setdefault(id(param), param)
        return list(seen.values())

    def step(self, micro_batches: Sequence[Any], loss_fn: LossFn | None = None) -> float:
        """Forward and backward of one optimizer step over ``microbatches`` ``(inputs, targets)``,
        each micro-batch's loss ``loss_fn(output, targets)`` (the criterion the stage was built
        with when None); returns the step's loss (the mean of the micro-batches' losses, on
        every pipeline rank)."""
        if len(micro_batches) != self.microbatches:
            raise ValueError(f"a pipeline step takes {self.microbatches} micro-batches, got {len(micro_batches)}")
        inputs = [b[0] for b in micro_batches]
        targets = [b[1] for b in micro_batches]
        loss = self.runtime.run(inputs, targets, loss_fn=loss_fn)
        self._sum_shared_gradients()
        return loss

    def _sum_shared_gradients(self) -> None:
        group = self.ctx.group("pipeline")
        for param in self.shared:  # the same order on every rank: model order
            if not param.requires_grad:  # frozen (an adapter's base): no gradient to sum
                continue
            if param.is_meta:  # a deferred model's parameter this stage does not hold: join with zeros
                comm.all_reduce(torch.zeros(param.shape, dtype=param.dtype, device=self.ctx.device), group)
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            comm.all_reduce(param.grad, group)
