"""ZeRO's residence: every part of a shard in device memory, or the fp32 masters, gradient pieces
and optimizer states in host memory (``offload="cpu"``), and all pieces stepped at once.

- stage 1: full gradients stay on every rank until the step; then one reduce-scatter per chunk
  gives each rank the average of its shard, it steps its shard, and an all-gather refreshes the
  parameters (2P communicated).
- stage 2: each chunk's gradients are reduce-scattered as soon as the backward completes them;
  only the shard of the gradient is kept (2P communicated).
- stage 3: chunks are also released after use; see :mod:`tessera.memory.release` (3P communicated).

With bf16/fp16 the parameters (and their chunks) are kept in that dtype and the masters in fp32;
in fp32 the master *is* the parameter shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tessera.comm import Pending
from tessera.memory.chunks import Chunk
from tessera.memory.host import copy_to_device_, host_copy, wait_for_device
from tessera.optim.host_adam import HostAdamW
from tessera.optim.norms import global_grad_norm
from tessera.zero.sharded import Residence, ShardedOptimizer


class DeviceResidence(Residence):
    """Shards on the device; masters and optimizer states there too, or in host memory with
    ``offload="cpu"`` (AdamW then steps with the fused host kernel of ``HostAdamW``);
    ``chunk_mb``: the chunk capacity (a larger parameter gets a chunk of its own)."""

    def __init__(self, chunk_mb: float = 25.0, offload: str = "none") -> None:
        self.chunk_mb = chunk_mb
        self.offload = offload

    def plan(self, sharded: ShardedOptimizer, numels: list[int], labels: list[int], sizes: list[int]) -> int:
        self.sharded = sharded
        self.master_device = torch.device("cpu") if self.offload == "cpu" else sharded.ctx.device
        self.masters: dict[int, torch.Tensor] = {}  # chunk index -> its fp32 master shard (made on first use)
        self.grad_shards: dict[int, torch.Tensor] = {}  # chunk index -> its reduced gradient shard
        return sharded.elements_in(self.chunk_mb)

    def _make_master(self, chunk: Chunk) -> torch.Tensor:
        if self.sharded.param_dtype == torch.float32 and self.master_device == chunk.shard.device:
            return chunk.shard  # fp32 on the same device: the shard itself is the master
        if self.master_device.type == "cpu":  # offloaded: pinned host memory when the shard is on a GPU
            return host_copy(chunk.shard, torch.float32)
        return chunk.shard.detach().to(self.master_device, torch.float32, copy=True)

    def piece_data(self, chunk: Chunk, start: int, end: int) -> torch.Tensor:
        if chunk.index not in self.masters:
            self.masters[chunk.index] = self._make_master(chunk)
        return self.masters[chunk.index][start:end]

    def attach(self) -> None:
        """Offloaded AdamW moves to ``HostAdamW``; whether the pieces are apart from the
        parameter shards is known."""
        sharded = self.sharded
        if self.offload == "cpu" and type(sharded.optimizer) is torch.optim.AdamW:
            # flat host buffers (the pieces may move into them), fused CPU kernel
            sharded.optimizer = HostAdamW.taking_over(sharded.optimizer)
        # pieces that are not the parameter shard itself: copied into it after each step
        self.separate = any(
            piece.data_ptr() != c.shard[start].data_ptr() for c, ps in zip(sharded.chunks, sharded.pieces)
            for piece, _, start, _ in ps
        )  # fmt: skip

    # ---- gradients ---------------------------------------------------------------------------
    def add_gradient(self, chunk: Chunk, shard: torch.Tensor) -> None:
        current = self.grad_shards.get(chunk.index)
        if current is None:
            self.grad_shards[chunk.index] = shard
        else:
            current.add_(shard)

    def gradients_ready(self) -> None:
        """Each piece's ``.grad`` becomes its part of the averaged gradient (fp32, on the
        masters' device)."""
        sharded = self.sharded
        if any(p is sharded.empty for p in sharded.optimizer.param_groups[0]["params"]):
            sharded.empty.grad = torch.zeros_like(sharded.empty)
        copied = False
        for chunk, pieces in zip(sharded.chunks, sharded.pieces):
            shard = self.grad_shards.get(chunk.index)
            if shard is None:
                continue
            if shard.device != self.master_device:  # offloaded: one pinned, non-blocking copy per chunk
                shard, copied = host_copy(shard, torch.float32, wait=False), True
            for piece, slot, start, end in pieces:
                if not sharded.has_grad(slot):
                    continue  # no rank of the data axis computed it (e.g. another stage's layer)
                grad = shard[start:end]
                piece.grad = (
                    grad
                    if grad.dtype == piece.dtype and grad.device == piece.device
                    else grad.to(piece.device, piece.dtype)
                )
        if copied:
            wait_for_device(sharded.ctx.device)  # the gradients copied to the host have arrived

    def _all_pieces(self) -> list[torch.nn.Parameter]:
        return [piece for pieces in self.sharded.pieces for piece, _, _, _ in pieces]

    def grad_norm(self) -> torch.Tensor:
        """From the pieces' gradients as they are now (after any scaling)."""
        sharded = self.sharded
        return global_grad_norm(
            self._all_pieces(), sharded.ctx, zero_slots=sharded.slot_placements, zero_group=sharded.group
        )

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        grads = [p.grad for p in self._all_pieces() if p.grad is not None]
        if grads:
            if isinstance(factor, torch.Tensor):
                factor = factor.to(grads[0].device)
            torch._foreach_mul_(grads, factor)

    def zero_grad(self) -> None:
        for piece in self._all_pieces():
            piece.grad = None
        self.grad_shards.clear()

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> None:
        """Step every piece, write them back into the parameter shards and refresh the
        parameters (all-gather; stage 3 gathers on next use instead)."""
        self.sharded.optimizer.step()
        self._write_back()
        for piece in self._all_pieces():  # fp32 gradient pieces are transient
            piece.grad = None

    def _write_back(self) -> None:
        pending: list[Pending | None] = []
        with torch.no_grad():
            for chunk, pieces in zip(self.sharded.chunks, self.sharded.pieces):
                if self.separate and pieces:
                    copy_to_device_([chunk.shard[a:b] for _, _, a, b in pieces], [p for p, _, _, _ in pieces])
                pending.append(chunk.refresh_full(async_op=True))
        for work in pending:
            if work is not None:
                work.wait()

    # ---- values and state --------------------------------------------------------------------
    @contextmanager
    def master_shard(self, chunk: Chunk) -> Iterator[torch.Tensor]:
        # the pieces may be apart from each other (host AdamW's flat buffers): a shard of them
        shard = torch.zeros(chunk.shard_numel, dtype=torch.float32, device=chunk.shard.device)
        for piece, _, start, end in self.sharded.pieces[chunk.index]:
            shard[start:end].copy_(piece)
        yield shard

    def master_from_params(self, chunk: Chunk) -> None:
        pieces = self.sharded.pieces[chunk.index]
        if self.separate and pieces:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _, _, _ in pieces], [chunk.shard[a:b] for _, _, a, b in pieces])

    def masters_loaded(self) -> None:
        self._write_back()

    def memory_parts(self) -> dict[str, list[torch.Tensor]]:
        sharded = self.sharded
        params: list[torch.Tensor] = [p for p in sharded.params if p.untyped_storage().nbytes() > 0]
        if sharded.policy.release_parameters:
            params += [c.shard for c in sharded.chunks]
        grads = [p.grad for p in sharded.params if p.grad is not None]
        grads += list(self.grad_shards.values()) if sharded.policy.reduce_in_backward else []
        optimizer = sharded.optimizer
        states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        if self.separate:  # fp32 masters kept apart from the parameter shards
            states += self._all_pieces()
        return {"parameters": params, "gradients": grads, "optimizer_states": states}
