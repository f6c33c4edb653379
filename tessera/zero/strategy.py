"""The sharded optimizer as a training strategy: it reduces the gradients itself (reduce-scatter
over the data axis), so the model is not wrapped in DDP. ZeRO is this strategy with a stage's
policy and the device residence; Gemini (``tessera.gemini``) with the tiered residence."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from tessera import comm
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
        self.optimizer = self.sharded = sharded  # steps and zeroes gradients for the engine
        self.residence = sharded.residence

    def forward(self, *args: Any, final: bool = True, **kwargs: Any) -> Any:
        self.sharded.final = final
        return self.model(*args, **kwargs)

    def reduce_gradients(self) -> None:
        self.sharded.reduce_gradients()  # each rank now holds the average of its shard

    def grad_norm(self) -> torch.Tensor:
        return self.residence.grad_norm()  # every rank makes the same collectives whatever its shard

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        self.residence.scale_gradients(factor)

    def full_precision_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]] | None:
        """The fp32 masters, bitwise what the pieces hold, each gathered whole over the data axis
        (one all-gather per chunk); None in fp32, where the parameter shards are the masters."""
        sharded = self.sharded
        if sharded.param_dtype == torch.float32:
            return None
        masters: list[tuple[nn.Parameter, torch.Tensor]] = []
        with torch.no_grad(), self.residence.lifted():
            for chunk in sharded.chunks:
                full = torch.empty(chunk.padded_numel, dtype=torch.float32, device=self.ctx.device)
                with self.residence.master_shard(chunk) as shard:
                    comm.all_gather_into(full, shard, chunk.group)
                masters += [
                    (sharded.params[s.index], full[s.offset : s.offset + s.numel].view(s.shape)) for s in chunk.slots
                ]
        return masters

    def report(self) -> dict[str, Any]:
        chunks = self.sharded.chunks
        return {
            "chunks": len(chunks),
            "chunk_mb": self.sharded.chunk_numel * self.sharded.element_size / 2**20,
            "utilisation": sum(c.numel for c in chunks) / max(1, sum(c.padded_numel for c in chunks)),
            **self.residence.report(),
        }

    def close(self) -> None:
        self.residence.close()

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoint_session(self) -> AbstractContextManager[None]:
        return self.residence.resident()

    def checkpoint_tensors(self) -> list[HeldTensor]:
        """This rank's pieces of the parameters the sharded optimizer steps (flat ranges of
        their blocks, fp32 masters), plus whatever it does not shard (frozen parameters, buffers)."""
        return held_tensors(self.sharded.held_pieces()) + self._frozen_pieces() + self._unsharded()

    def _frozen_pieces(self) -> list[HeldTensor]:
        """This rank's pieces of the frozen tensors sharded under parameter release."""
        return held_tensors(self.sharded.frozen.pieces(self.residence.frozen_shard))  # type: ignore[arg-type]

    def _unsharded(self) -> list[HeldTensor]:
        stepped = {id(p) for p in self.sharded.params} | self.sharded.frozen.keys()
        held = module_tensors(self.module, lambda p: id(p) not in stepped and self.holds(p))
        return [h for h in held if id(h.tensor) not in stepped]  # frozen buffers (quantized codes) too

    def checkpoint_loaded(self) -> None:
        self.residence.masters_loaded()
        self.sharded.frozen.loaded(self.residence.frozen_shard)


def held_tensors(pieces: list[tuple[str, nn.Parameter, nn.Parameter, int, int]]) -> list[HeldTensor]:
    """Pieces (``ShardedOptimizer.held_pieces``) as a checkpoint's tensors: flat ranges of their
    parameters' blocks."""
    return [HeldTensor(name, piece, view_of(param).with_flat(a, b)) for name, param, piece, a, b in pieces]


class Zero(Sharded):
    """ZeRO stage 1, 2 or 3 (``options.policy``) with every part on the device, or the fp32
    masters and optimizer states in host memory (``options.offload="cpu"``)."""

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext, options: ZeroOptions
    ) -> None:
        residence = DeviceResidence(options.chunk_mb, options.offload)
        sharded = ShardedOptimizer(module, optimizer, ctx, policy=options.policy, residence=residence,
                                   precision=options.precision, overlap_comm=options.overlap_comm,
                                   shard=options.shard)  # fmt: skip
        super().__init__(module, sharded)
        self.name = f"zero{options.policy.stage}"
