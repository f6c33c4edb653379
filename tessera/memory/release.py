"""ZeRO's parameter release (stage 3): parameters too are sharded; each chunk is gathered just before a module that
uses it runs (forward or backward) and released after.

Forward: a module's pre-hook gathers the chunks of its own parameters and starts gathering those
of the module that ran next on the first pass (prefetch); its post-hook releases a chunk once
every module using it has run in this pass. Backward: a hook on the module's outputs gathers
its chunks again (and prefetches those of the module that ran before it); a chunk is released as soon as
all its parameters have their gradients, which is also when their reduce-scatter starts.
Every chunk is thus gathered once in forward and once in backward, and reduce-scattered once:
3P communicated per step. A chunk of frozen tensors (``frozen``: no gradient ever arrives for
them) is released in the backward once the gradients of the inputs of every module that used it
are computed, the point after which nothing reads it again. Autograd's saved views of a weight see the data again after the
re-gather because a release only shrinks the storage (see ``tessera.memory.chunks``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tessera.memory.chunks import Chunk, ChunkState, ChunkStore, Slot

_UNIT = "_tessera_gather_unit"


def gather_as_unit(module: nn.Module) -> None:
    """Gather and release the chunks of ``module``'s whole subtree together, around the module,
    instead of around each submodule that holds parameters: a compiled block then runs as one
    graph over whole parameters, with no hook inside it."""
    setattr(module, _UNIT, True)


def _recomputing() -> bool:
    """Whether a forward runs inside a backward pass (an activation checkpoint's recompute)."""
    return bool(torch._C._current_graph_task_id() != -1)


class ReleaseOnUse:
    """Gather/release hooks on ``model`` for the chunks of ``stores`` (``slot_of``: a parameter's,
    or buffer's, id to its chunk and slot). The sharded optimizer releases a trainable chunk once
    its gradients are reduced; a chunk of ``frozen`` (ids of chunks without gradients) is
    released after the backward of its last user; the hooks gather a chunk again when a module
    needs it."""

    def __init__(
        self,
        model: nn.Module,
        stores: list[ChunkStore],
        slot_of: dict[int, tuple[Chunk, Slot]],
        frozen: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> None:
        self.chunks = [c for store in stores for c in store.chunks]
        self._slot_of = slot_of
        self._frozen = frozen
        self._backward_users: dict[int, int] = {}  # frozen chunk -> modules whose backward has not passed it
        self._users: dict[int, int] = {}  # chunk index -> modules that use it directly
        self._left: dict[int, int] = {}  # per pass: users that have not run yet
        self._calls: list[list[Chunk]] = []  # the chunks of each module call of the first forward, in order
        self._cursor = 0  # position in _calls of the module running now (+1)
        self._recording = True
        self._backward_queued = False
        self._installed = False  # the per-module hooks go on when the first pass begins
        model.register_forward_pre_hook(self._begin_pass)
        for chunk in self.chunks:
            chunk.release()

    def _install(self, model: nn.Module) -> None:
        """The per-module hooks, put in place when the first pass begins (as FSDP2's lazy
        initialisation does): a model that is built and never run, or only saved, carries
        none of them."""
        units = [m for m in model.modules() if getattr(m, _UNIT, False)]
        inside = {id(sub) for unit in units for sub in unit.modules() if sub is not unit}
        for module in model.modules():
            if id(module) in inside:
                continue
            chunks = self._chunks_of(module, recurse=getattr(module, _UNIT, False))
            if not chunks:
                continue
            for c in chunks:
                self._users[id(c)] = self._users.get(id(c), 0) + 1
            module.register_forward_pre_hook(self._make_pre_forward(chunks))
            module.register_forward_hook(self._make_post_forward(chunks))
        model.register_forward_hook(self._end_pass)

    def _chunks_of(self, module: nn.Module, recurse: bool = False) -> list[Chunk]:
        found: dict[int, Chunk] = {}
        for t in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]:
            where = self._slot_of.get(id(t))
            if where is not None:
                found[id(where[0])] = where[0]
        return list(found.values())

    # ---- forward -----------------------------------------------------------------------------
    def _begin_pass(self, module: nn.Module, args: Any) -> None:
        first = not self._installed
        if first:
            self._install(module)
            self._installed = True
        self._left = dict(self._users)
        self._cursor = 0
        if first and (own := self._chunks_of(module)):  # its own hook was added in this call: runs from the next
            self._gather(own)

    def _end_pass(self, module: nn.Module, args: Any, output: Any) -> None:
        self._recording = False
        for chunk in self.chunks:
            chunk.release()

    def _gather(self, chunks: list[Chunk], backward: bool = False) -> None:
        """Gather ``chunks`` now and start gathering those of the module that ran next (forward)
        or before (backward) on the first pass."""
        if self._recording and not backward:
            self._calls.append(chunks)
        self._cursor += -1 if backward else 1
        for c in chunks:
            c.gather()
        if self._recording:
            return
        following = self._cursor - 1 if backward else self._cursor
        if 0 <= following < len(self._calls):
            for c in self._calls[following]:
                c.gather(async_op=True)

    def _make_pre_forward(self, chunks: list[Chunk]) -> Any:
        def pre_forward(module: nn.Module, args: Any) -> None:
            if _recomputing():  # activation checkpointing runs the module again: its chunks only need to be there
                for c in chunks:
                    c.gather()
                return
            self._gather(chunks)

        return pre_forward

    def _make_post_forward(self, chunks: list[Chunk]) -> Any:
        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if _recomputing():  # released with their gradients, as after the backward reached them
                return
            for c in chunks:
                self._left[id(c)] = self._left.get(id(c), 0) - 1
                if self._left[id(c)] == 0:
                    c.release()
            if torch.is_grad_enabled():
                self._hook_outputs(output, chunks)
                self._hook_inputs(args, [c for c in chunks if id(c) in self._frozen])

        return post_forward

    # ---- backward ----------------------------------------------------------------------------
    def _hook_outputs(self, output: Any, chunks: list[Chunk]) -> None:
        """Gather ``chunks`` when the first gradient reaches one of ``output``'s tensors."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        fired = [False]

        def before_backward(grad: torch.Tensor) -> torch.Tensor:
            if not fired[0]:
                fired[0] = True
                if not self._backward_queued:
                    torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
                    self._backward_queued = True
                self._gather(chunks, backward=True)
            return grad

        for t in tensors:
            t.register_hook(before_backward)

    def _hook_inputs(self, args: Any, frozen: list[Chunk]) -> None:
        """Release ``frozen`` chunks once the gradients of ``args`` (the module's inputs) are
        computed and no other module's backward still needs them."""
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not frozen or not tensors:
            return
        for c in frozen:
            self._backward_users[id(c)] = self._backward_users.get(id(c), 0) + 1
        fired = [False]

        def after_backward(grad: torch.Tensor) -> torch.Tensor:
            if not fired[0]:
                fired[0] = True
                for c in frozen:
                    self._backward_users[id(c)] -= 1
                    if self._backward_users[id(c)] == 0:
                        c.release()
            return grad

        for t in tensors:
            t.register_hook(after_backward)

    def _end_backward(self) -> None:
        self._backward_queued = False
        self._backward_users.clear()
        for chunk in self.chunks:
            if chunk.state is not ChunkState.SHARDED:
                chunk.release()
