"""The sharded optimizer as a training strategy: it reduces the gradients itself (reduce-scatter
over the data axis), so the model is not wrapped in DDP. ZeRO is this strategy with a stage's
policy and the device residence; Gemini (``tessera.gemini``) with the tiered residence."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext
from tessera.context.views import HeldTensor
from tessera.parallel.strategy import Strategy, module_tensors, view_of
from tessera.zero.device import DeviceResidence
from tessera.zero.policy import ZeroOptions
from tessera.zero.sharded import ShardedOptimizer


class Sharded(Strategy):
    """Training ``module`` with ``sharded``, the sharded optimizer built over it (its parameters
    moved into the chunk store, and to the mixed-precision dtype). Full state dicts gather and
    load through the parameters' placements, which name the store."""

    def __init__(self, module: nn.Module, sharded: ShardedOptimizer) -> None:
        self.module = self.model = module
        self.ctx = sharded.ctx
        self.sharded = sharded
        self.optimizer = sharded

    def forward(self, *args: Any, final: bool = True, **kwargs: Any) -> Any:
        self.sharded.set_final(final)
        return self.model(*args, **kwargs)

    # ---- gradients and the step --------------------------------------------------------------
    def reduce_gradients(self) -> None:
        self.sharded.reduce_gradients()  # each rank now holds the average of its shard

    def grad_norm(self) -> torch.Tensor:
        return self.sharded.grad_norm()

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        self.sharded.scale_gradients(factor)

    def step(self) -> None:
        self.sharded.step()

    def zero_grad(self) -> None:
        self.sharded.zero_grad()

    # ---- memory and state --------------------------------------------------------------------
    def full_precision_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]] | None:
        return self.sharded.full_precision_weights()  # the fp32 masters (bf16/fp16), gathered over data

    def report(self) -> dict[str, Any]:
        return self.sharded.report()

    def close(self) -> None:
        self.sharded.close()

    def checkpoint_session(self) -> AbstractContextManager[None]:
        return self.sharded.resident()

    def checkpoint_tensors(self) -> list[HeldTensor]:
        """This rank's pieces of the parameters the sharded optimizer steps (flat ranges of
        their blocks, fp32 masters), plus whatever it does not shard (frozen parameters, buffers)."""
        held = [
            HeldTensor(name, piece, view_of(param).with_flat(a, b))
            for name, param, piece, a, b in self.sharded.held_pieces()
        ]
        return held + self._unsharded()

    def _unsharded(self) -> list[HeldTensor]:
        stepped = {id(p) for p in self.sharded.params}
        return module_tensors(self.module, lambda p: id(p) not in stepped and self.holds(p))

    def checkpoint_loaded(self) -> None:
        self.sharded.masters_loaded()


class Zero(Sharded):
    """ZeRO stage 1, 2 or 3 (``options.policy``) with every part on the device, or the fp32
    masters and optimizer states in host memory (``options.offload="cpu"``)."""

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext, options: ZeroOptions
    ) -> None:
        residence = DeviceResidence(options.chunk_mb, options.offload)
        sharded = ShardedOptimizer(module, optimizer, ctx, policy=options.policy, residence=residence,
                                   precision=options.precision, overlap_comm=options.overlap_comm)  # fmt: skip
        super().__init__(module, sharded)
        self.name = f"zero{options.policy.stage}"
