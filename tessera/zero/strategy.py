"""ZeRO as a training strategy: the sharded optimizer reduces the gradients itself
(reduce-scatter over the data axis), so the model is not wrapped in DDP."""

from __future__ import annotations

import torch
from torch import nn

from tessera.context import ParallelContext
from tessera.context.views import HeldTensor
from tessera.parallel.strategy import Strategy, module_tensors, view_of
from tessera.zero.optimizer import ZeroOptimizer
from tessera.zero.policy import ZeroOptions


class Zero(Strategy):
    """``optimizer`` sharded over ``ctx``'s data axis per ``options``; ``module``'s parameters
    move into the chunk store (and to the mixed-precision dtype). Full state dicts gather and
    load through the parameters' placements, which name the store."""

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext, options: ZeroOptions
    ) -> None:
        self.module = self.model = module
        self.ctx = ctx
        self.sharded = ZeroOptimizer(module, optimizer, ctx, options)
        self.optimizer = self.sharded
        self.name = f"zero{options.policy.stage}"

    def reduce_gradients(self) -> None:
        self.sharded.reduce_gradients()  # each rank now holds the average of its shard

    def grad_norm(self) -> torch.Tensor:
        return self.sharded.grad_norm()

    def memory_parts(self) -> dict[str, list[torch.Tensor]]:
        return self.sharded.memory_parts()

    def checkpoint_tensors(self) -> list[HeldTensor]:
        """This rank's pieces of the parameters the sharded optimizer steps (flat ranges of
        their blocks, fp32 masters), plus whatever it does not shard (frozen parameters, buffers)."""
        sharded = self.sharded
        held = [
            HeldTensor(name, piece, view_of(param).with_flat(a, b))
            for name, param, piece, a, b in sharded.held_pieces()
        ]
        stepped = {id(p) for p in sharded.params}
        return held + module_tensors(self.module, lambda p: id(p) not in stepped and self.holds(p))

    def checkpoint_loaded(self) -> None:
        self.sharded.masters_loaded()

    def full_precision_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]] | None:
        return self.sharded.full_precision_weights()  # the fp32 masters (bf16/fp16), gathered over data
