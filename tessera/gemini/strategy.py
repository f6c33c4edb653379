"""Gemini as a training strategy: the sharded optimizer with ZeRO-3's policy and the tiered
residence, whose chunks live on the device, in host memory or on disk (see
:mod:`tessera.gemini.tiered`).

The first optimizer step is the warm-up: the memory tracer records the saved activations of
its passes and the order in which they use the chunks. From then on the manager reads chunks
on disk ahead of their use in that order, and the ``auto`` policy evicts the part needed
furthest in the future and keeps device room for the traced activations.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from tessera.context import ParallelContext
from tessera.context.views import HeldTensor
from tessera.errors import TesseraError
from tessera.gemini.options import GeminiOptions
from tessera.gemini.tiered import TieredResidence
from tessera.memory.tracer import MemoryTracer, Trace
from tessera.zero.policy import ZeroPolicy
from tessera.zero.sharded import ShardedOptimizer
from tessera.zero.strategy import Sharded, held_tensors


class Gemini(Sharded):
    """``optimizer`` over chunks of ``module``'s parameters placed over the tiers per ``options``."""

    residence: TieredResidence

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext, options: GeminiOptions
    ) -> None:
        self.residence = TieredResidence(options)
        policy = ZeroPolicy.for_stage(3)  # parameters released between uses, gradients reduced in the backward
        sharded = ShardedOptimizer(module, optimizer, ctx, policy=policy, residence=self.residence,
                                   precision=options.precision, shard=options.shard)  # fmt: skip
        super().__init__(module, sharded)
        self.memory = self.residence.memory
        self.name = f"gemini({options.placement})"
        self.tracer = MemoryTracer(module, self.memory, sharded.chunks)
        self.trace: Trace | None = None
        self.groups_planned = 0  # chunk groups of the last checkpoint_groups() (a deferred model's filling)

    # ---- the warm-up -------------------------------------------------------------------------
    def forward(self, *args: Any, final: bool = True, **kwargs: Any) -> Any:
        self.sharded.final = final
        self.memory.retaining = torch.is_grad_enabled()  # keep chunks gathered for the backward if room
        if self.trace is None and torch.is_grad_enabled():  # the warm-up step
            with self.tracer.tracing():
                return self.model(*args, **kwargs)
        return self.model(*args, **kwargs)

    def step(self) -> None:
        """Step; after the warm-up step, the policy keeps device room for the traced activations."""
        self.sharded.step()
        if self.trace is None:
            self.trace = self.tracer.finish()
            self.residence.warmed_up(self.trace.activation_bytes)

    def report(self) -> dict[str, Any]:
        """Chunks, utilisation, tier bytes and the traced activations."""
        out = super().report()
        out["activation_bytes"] = self.trace.activation_bytes if self.trace is not None else None
        return out

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoint_tensors(self) -> list[HeldTensor]:
        """As for every sharded strategy, inside a checkpoint session (the pieces view the
        masters only there)."""
        if not self.residence._resident:
            raise TesseraError("Gemini's checkpoint tensors are read inside strategy.checkpoint_session()")
        return super().checkpoint_tensors()

    def checkpoint_groups(self) -> list[AbstractContextManager[list[HeldTensor]]]:
        """Chunks in groups whose parts not yet in memory fit in the host room left (less what
        parts passing through need), so that a deferred model is never whole on this rank."""
        groups = self.residence.groups()
        self.groups_planned = len(groups)
        others = self._unsharded()
        trained: list[AbstractContextManager[list[HeldTensor]]] = [
            self._group(indices, others if n == 0 else []) for n, indices in enumerate(groups)
        ]
        return trained + [self._frozen_group(chunk) for chunk in self.residence.frozen_chunks]

    @contextmanager
    def _frozen_group(self, chunk: Any) -> Iterator[list[HeldTensor]]:
        """One frozen chunk's pieces (a frozen base is filled a chunk at a time)."""
        with self.residence.frozen_filling(chunk):
            yield held_tensors(self.sharded.frozen.pieces(self.residence.frozen_shard, [chunk]))  # type: ignore[arg-type]

    @contextmanager
    def _group(self, indices: list[int], others: list[HeldTensor]) -> Iterator[list[HeldTensor]]:
        with self.residence.filling(indices) as pieces:
            yield held_tensors(pieces) + others
