"""The sharded optimizer's gradient pipeline, the same for every residence.

With ``reduce_in_backward`` (ZeRO stages 2 and 3, Gemini) a hook takes each parameter's gradient
as soon as it is accumulated into its chunk's bucket; a complete bucket is reduce-scattered
asynchronously over the chunk's group (two in flight at most, overlapping the rest of the
backward) and the residence adds this rank's shard of the average to the chunk's gradients, and
a released chunk's parameters may go. Under hybrid sharding (``tessera.zero.hybrid``) the chunk's
group is the replicas of this rank's host, and each arrived shard is then all-reduced between the
hosts. Without it (stage 1) full gradients stay until the step
and are reduced then, chunk by chunk. An expert chunk's group holds part of the replicas (the
other expert ranks hold other experts): its sum is divided by all of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera import comm
from tessera.comm import AxisGroup, Pending
from tessera.context import ParallelContext
from tessera.context.reduction import Reduction
from tessera.memory.chunks import Chunk, Slot
from tessera.memory.release import ReleaseOnUse
from tessera.optim.norms import add_slot_squares
from tessera.zero.policy import ZeroPolicy


class GradientSink:
    """What the pipeline tells the residence (the gradient side of
    ``tessera.zero.sharded.Residence``)."""

    def bucket_opened(self, chunk: Chunk, nbytes: int) -> None:
        """A gradient bucket and its reduced shard, ``nbytes`` together, are about to be made."""

    def bucket_closed(self, chunk: Chunk, nbytes: int) -> None:
        """The bucket of ``chunk`` is freed."""

    def add_gradient(self, chunk: Chunk, shard: torch.Tensor) -> None:
        """This rank's shard of the data-parallel average of ``chunk``'s gradients arrived."""
        raise NotImplementedError

    def backward_done(self) -> None:
        """A backward pass ended and every reduction has arrived."""

    def gradients_ready(self) -> None:
        """After the step's last backward (and stage 1's reduction): the step may read them."""


class GradientPipeline:
    """The gradient side of :class:`~tessera.zero.sharded.ShardedOptimizer` (a mixin over its
    chunks, parameters, policy and residence)."""

    ctx: ParallelContext
    policy: ZeroPolicy
    residence: GradientSink
    params: list[nn.Parameter]
    chunks: list[Chunk]
    pieces: list[list[tuple[nn.Parameter, Slot, int, int]]]
    param_dtype: torch.dtype
    element_size: int
    overlap_comm: bool
    reductions: dict[int, Reduction]  # chunk index -> how its gradients are reduced
    across: AxisGroup | None  # hybrid sharding: the ranks holding this rank's shards on the other hosts
    _slot_of: dict[int, tuple[Chunk, Slot]]
    _release: ReleaseOnUse | None

    def _start_gradients(self, model: nn.Module) -> None:
        self._has_grad: set[int] = set()  # slot indices that received a gradient this step
        self.final = True  # whether the backward that follows completes the step's gradients (the strategy sets it)
        self._in_flight: list[tuple[Chunk, Pending, torch.Tensor]] = []
        self._buckets: dict[int, torch.Tensor] = {}  # chunk index -> gradients being collected
        self._written: dict[int, set[int]] = {}  # chunk index -> slots whose gradient is in its bucket
        self._callback_queued = False
        if self.policy.reduce_in_backward:  # the gradient hooks go on when the first pass begins
            self._hooks_pending = model.register_forward_pre_hook(self._install_grad_hooks)

    def gradients_consumed(self) -> None:
        """The step has used this step's gradients (which slots had one is forgotten)."""
        self._has_grad.clear()

    def has_grad(self, slot: Slot) -> bool:
        """Whether some rank of the data axis computed a gradient for ``slot`` this step."""
        return slot.index in self._has_grad

    def _install_grad_hooks(self, module: nn.Module, args: Any) -> None:
        """Before the first forward: a hook on each parameter taking its gradient as soon as it
        is accumulated (installed then rather than at construction, as FSDP2 does its lazy
        set-up: a model that is built and only saved or loaded carries none)."""
        self._hooks_pending.remove()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _bucket_bytes(self, chunk: Chunk) -> int:
        return (chunk.padded_numel + chunk.shard_numel) * self.element_size

    def _open_bucket(self, chunk: Chunk) -> torch.Tensor:
        self.residence.bucket_opened(chunk, self._bucket_bytes(chunk))
        return torch.empty(chunk.padded_numel, dtype=self.param_dtype, device=self.ctx.device)

    def _on_grad(self, p: torch.Tensor) -> None:
        """During backward: ``p``'s gradient goes into its chunk's bucket."""
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        self._take(p)

    def _take(self, p: torch.Tensor, drop: bool = True) -> None:
        """``p``'s gradient goes into its chunk's bucket (and is dropped unless not ``drop``:
        stage 1 keeps full gradients until the step); a complete bucket is reduce-scattered."""
        chunk, slot = self._slot_of[id(p)]
        bucket = self._buckets.get(chunk.index)
        if bucket is None:
            bucket = self._buckets[chunk.index] = self._open_bucket(chunk)
        assert p.grad is not None
        bucket[slot.offset : slot.offset + slot.numel].copy_(p.grad.reshape(-1))
        if drop:
            p.grad = None
        self._has_grad.add(slot.index)
        written = self._written.setdefault(chunk.index, set())
        written.add(slot.index)
        if len(written) == len(chunk.slots):
            self._reduce_bucket(chunk)

    def _reduce_bucket(self, chunk: Chunk) -> None:
        """Start the chunk's reduce-scatter (parameters that got no gradient in this pass count
        zeros); its parameters may then be released."""
        bucket = self._buckets.pop(chunk.index)
        written = self._written.pop(chunk.index, set())
        bucket[chunk.numel :].zero_()  # the padding
        if len(written) < len(chunk.slots):
            for slot in chunk.slots:
                if slot.index not in written:
                    bucket[slot.offset : slot.offset + slot.numel].zero_()
        self._start_reduction(chunk, bucket)
        # Two reductions in flight at most: older buckets are freed as the backward goes on, so
        # the whole model's gradients never exist at once (stage 1, whose full gradients are
        # all alive: one, overlap without a second full copy).
        self._drain(keep=(2 if self.overlap_comm else 0) if self.policy.reduce_in_backward else 1)
        if self._release is not None:
            chunk.release()  # its gradients are complete: gathered again when next used

    def _start_reduction(self, chunk: Chunk, bucket: torch.Tensor) -> None:
        """Start the average of ``chunk``'s gradients (``bucket``) over all the replicas: over
        the chunk's group, then (hybrid sharding) over the hosts, when it arrives. An expert
        chunk's group holds a part of them (the other expert ranks hold other experts): its sum
        is divided by all of them."""
        out = torch.empty(chunk.shard_numel, dtype=self.param_dtype, device=bucket.device)
        reduction = self.reductions[chunk.index]
        pending = comm.reduce_scatter_into(
            out, bucket, chunk.group, op="avg", async_op=True, divide_by=reduction.after_average
        )
        self._in_flight.append((chunk, pending, bucket))

    def _drain(self, keep: int = 0) -> None:
        """Finish the reductions in flight (all but the newest ``keep``): each arrived shard goes
        to the residence and its bucket is freed."""
        while len(self._in_flight) > keep:
            chunk, pending, bucket = self._in_flight.pop(0)
            out = pending.wait()
            del bucket
            if self.across is not None:  # hybrid sharding: the same shard on every host
                comm.all_reduce(out, self.across, op="avg")
            self.residence.add_gradient(chunk, out)
            self.residence.bucket_closed(chunk, self._bucket_bytes(chunk))

    def finish_oldest(self) -> bool:
        """Under memory pressure: finish the oldest reduction in flight (its bucket is freed)."""
        if not self._in_flight:
            return False
        self._drain(keep=len(self._in_flight) - 1)
        return True

    def _finish_backward(self) -> None:
        """End of a backward pass: every reduction made and arrived."""
        self._flush()
        self._callback_queued = False
        self.residence.backward_done()

    def _flush(self) -> None:
        """Reduce the chunks some of whose parameters got no gradient, then wait for all."""
        for chunk in self.chunks:
            if chunk.index in self._buckets:
                self._reduce_bucket(chunk)
        self._drain()

    def reduce_gradients(self) -> None:
        """After the step's last backward: the residence holds this rank's shard of the
        data-parallel average of every gradient. Stage 1 reduces here, chunk by chunk; the
        others have reduced during the backward passes."""
        if not self.policy.reduce_in_backward:
            for p in self.params:
                if p.grad is not None:
                    self._take(p, drop=False)
            self._flush()
        self.residence.gradients_ready()

    def slot_squares(self, per_slot: torch.Tensor, chunk: Chunk, grad: torch.Tensor) -> None:
        """Add to ``per_slot`` the squared norms of ``grad`` (``chunk``'s gradient shard) over
        each piece whose parameter has a gradient this step."""
        pieces = [(slot.index, a, b) for _, slot, a, b in self.pieces[chunk.index] if slot.index in self._has_grad]
        add_slot_squares(per_slot, [i for i, _, _ in pieces], [grad[a:b] for _, a, b in pieces])
