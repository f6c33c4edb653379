"""Gemini as a training strategy: ZeRO-3 over the data axis whose chunks live on the device,
in host memory or on disk (see :mod:`tessera.gemini.optimizer`).

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
from tessera.gemini.optimizer import GeminiOptimizer
from tessera.gemini.options import GeminiOptions
from tessera.memory.placement import AutoPolicy
from tessera.memory.tiers import BudgetError, Tier
from tessera.memory.tracer import MemoryTracer, Trace
from tessera.parallel.strategy import Strategy, module_tensors, view_of


class Gemini(Strategy):
    """``optimizer`` over chunks of ``module``'s parameters placed over the tiers per ``options``."""

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext, options: GeminiOptions
    ) -> None:
        self.module = self.model = module
        self.ctx = ctx
        self.sharded = GeminiOptimizer(module, optimizer, ctx, options)
        self.optimizer = self.sharded
        self.memory = self.sharded.memory
        self.name = f"gemini({options.placement})"
        self.tracer = MemoryTracer(module, ctx.device, self._is_model, self._model_device_bytes)
        self.trace: Trace | None = None
        self.groups_planned = 0  # chunk groups of the last checkpoint_groups() (a deferred model's filling)

    def _is_model(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.untyped_storage().data_ptr()
        return any(ptr == c.full.untyped_storage().data_ptr() for c in self.sharded.chunks) or isinstance(
            tensor, nn.Parameter
        )

    def _model_device_bytes(self) -> int:
        return self.sharded.ledger.held[Tier.DEVICE]

    # ---- forward and backward ----------------------------------------------------------------
    def forward(self, *args: Any, final: bool = True, **kwargs: Any) -> Any:
        self.sharded.set_final(final)
        self.memory.retaining = torch.is_grad_enabled()  # keep chunks gathered for the backward if room
        if self.trace is None and torch.is_grad_enabled():
            if self.memory.recording is None:  # the warm-up step begins
                self.memory.start_trace()
            with self.tracer.tracing():
                return self.model(*args, **kwargs)
        return self.model(*args, **kwargs)

    # ---- gradients and the step --------------------------------------------------------------
    def gradient_tensors(self) -> list[torch.Tensor]:
        return []  # gradients live in the chunks' parts: scaled through scale_gradients

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        self.sharded.scale_gradients(factor)

    def grad_norm(self) -> torch.Tensor:
        return self.sharded.grad_norm()

    def step(self) -> None:
        self.sharded.step()
        if self.trace is None:
            self._end_warm_up()

    def zero_grad(self) -> None:
        self.sharded.zero_grad()

    def _end_warm_up(self) -> None:
        """The warm-up step is over: keep its trace; the auto policy keeps device room for the
        traced activations from now on."""
        self.trace = self.tracer.finish(self.memory.stop_trace())
        if isinstance(self.sharded.policy, AutoPolicy):
            need = self.trace.activation_bytes
            budget = self.sharded.ledger.budget[Tier.DEVICE]
            smallest = self.sharded.policy.reserve + need
            too_small = BudgetError(
                f"gemini.device_budget={budget} bytes cannot hold the traced activations ({need} bytes) next to "
                f"one chunk's working set: give gemini.device_budget >= {smallest} bytes or use smaller micro-batches"
            )
            if budget is not None and budget < smallest:
                raise too_small
            self.sharded.make_room_for_gathered(need)
            try:
                self.memory.reserve(Tier.DEVICE, need, "activations", "traced activations")
            except BudgetError as error:
                raise too_small from error

    # ---- memory and state --------------------------------------------------------------------
    def memory_parts(self) -> dict[str, list[torch.Tensor]]:
        return self.sharded.memory_parts()

    def full_precision_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]] | None:
        return self.sharded.full_precision_weights()

    def report(self) -> dict[str, Any]:
        """Chunks, utilisation, tier bytes and the traced activations."""
        out = self.sharded.report()
        out["activation_bytes"] = self.trace.activation_bytes if self.trace is not None else None
        return out

    def checkpoint_session(self) -> AbstractContextManager[None]:
        return self.sharded.resident()

    def checkpoint_tensors(self) -> list[HeldTensor]:
        """This rank's pieces of the parameters (fp32 masters, flat ranges of their blocks) and
        whatever Gemini does not manage (frozen parameters, buffers); inside a checkpoint session."""
        if not self.sharded._resident:
            raise TesseraError("Gemini's checkpoint tensors are read inside strategy.checkpoint_session()")
        sharded = self.sharded
        held = [
            HeldTensor(name, piece, view_of(param).with_flat(a, b))
            for name, param, piece, a, b in sharded.held_pieces()
        ]
        stepped = {id(p) for p in sharded.params}
        return held + module_tensors(self.module, lambda p: id(p) not in stepped)

    def checkpoint_groups(self) -> list[AbstractContextManager[list[HeldTensor]]]:
        """Chunks in groups whose parts not yet in memory fit in the host room left (less what
        parts passing through need), so that a deferred model is never whole on this rank."""
        sharded = self.sharded
        host = sharded.ledger.budget[Tier.HOST]
        room = float("inf") if host is None else max(1.0, sharded.ledger.free(Tier.HOST) - sharded.policy_host_reserve)
        groups = sharded.groups(room)
        self.groups_planned = len(groups)
        stepped = {id(p) for p in sharded.params}
        others = module_tensors(self.module, lambda p: id(p) not in stepped)
        return [self._group(indices, others if n == 0 else []) for n, indices in enumerate(groups)]

    @contextmanager
    def _group(self, indices: list[int], others: list[HeldTensor]) -> Iterator[list[HeldTensor]]:
        with self.sharded.filling(indices) as pieces:
            yield [
                HeldTensor(name, piece, view_of(param).with_flat(a, b)) for name, param, piece, a, b in pieces
            ] + others

    def checkpoint_loaded(self) -> None:
        self.sharded.masters_loaded()

    def state_dict(self) -> dict[str, Any]:
        with self.checkpoint_session():
            return {"optimizer": self.sharded.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.checkpoint_session():
            self.sharded.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        """Wait for disk transfers and remove this rank's offload files."""
        self.sharded.close()
