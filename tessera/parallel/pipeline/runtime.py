"""Running a pipeline schedule: one rank walks its action list for one optimizer step.

:func:`build_chunks` cuts this rank's model chunks out of the blocks; :class:`PipelineRuntime`
runs the rank's list from :func:`~tessera.parallel.pipeline.build_schedule`. Each compute action
is one small method (a dispatch table from :class:`Kind`); each maximal run of adjacent transfers
is posted as one batched p2p through :mod:`tessera.comm`, in list order, without waiting: a
received tensor is waited for by the compute that reads it, the sends at the end of the step
(``docs/pipeline.md``, "For runtime authors"). Where the backend lets transfers complete in any
order (gloo), steps whose activation shapes are known walk
:func:`~tessera.parallel.pipeline.post_early`'s reordering of the list: sends right after their
compute, receives as early as pairing allows.

What crosses the wire (shape headers in a step that brings micro-batches of new input shapes,
the first step at least; receive buffers; the loss riding on the last micro-batch's gradient
instead of a collective) is :mod:`~tessera.parallel.pipeline.wire`'s job; zero-bubble's B and W
split the backward without repeating work (:mod:`~tessera.parallel.pipeline.backward`).

``run(..., measure=True)`` records a :class:`StepMeasure` of the step in ``runtime.last_measure``
(:mod:`~tessera.parallel.pipeline.measure`; off by default; when off, no timer or hook runs):
this rank's busy time in compute actions, the step's wall time after a start barrier, and the
peak bytes of tensors saved for backward by its chunks' forwards (parameters excluded), held
from a forward until its backward (or its W when the backward is split).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tessera import comm
from tessera.comm.group import AxisGroup
from tessera.comm.ops import p2p_in_any_order
from tessera.parallel.pipeline.actions import Action, Kind
from tessera.parallel.pipeline.backward import WeightWork, backward_input, backward_weight
from tessera.parallel.pipeline.inputs import MISSING, running_inputs
from tessera.parallel.pipeline.measure import SavedBytes, StepMeasure
from tessera.parallel.pipeline.p2p_placement import post_early
from tessera.parallel.pipeline.partition import chunk_ranges
from tessera.parallel.pipeline.wire import (
    BoundaryShapes,
    Signature,
    gradient_buffer,
    input_signature,
    pack_loss,
    peer_of,
    unpack_loss,
)

LossFn = Callable[[Any, Any], torch.Tensor]  # (last chunk's output, micro-batch's target) -> loss
Key = tuple[int, int]  # (chunk, micro-batch)

_MAKES_INPUT_GRAD = (Kind.BACKWARD, Kind.BACKWARD_INPUT)


def _plan(actions: Sequence[Action]) -> list[tuple[list[Action], Action | None]]:
    """A rank's list as (run of transfers, compute after it) pairs; the last compute is None."""
    plan: list[tuple[list[Action], Action | None]] = []
    transfers: list[Action] = []
    for action in actions:
        if action.kind.is_compute:
            plan.append((transfers, action))
            transfers = []
        else:
            transfers.append(action)
    plan.append((transfers, None))
    return plan


def build_chunks(blocks: Sequence[nn.Module], boundaries: list[int], chunk_ids: list[int]) -> dict[int, nn.Module]:
    """``{chunk: nn.Sequential of its blocks}`` for the chunks in ``chunk_ids``, cut from
    ``blocks`` at ``boundaries`` (``len(boundaries) + 1`` parts, :func:`chunk_ranges`). The
    modules are shared with ``blocks``, not copied."""
    ranges = chunk_ranges(boundaries, len(blocks))
    return {c: nn.Sequential(*[blocks[k] for k in range(*ranges[c])]) for c in chunk_ids}


class PipelineRuntime:
    """Runs this rank's ``actions`` (one rank's list of a schedule) over its ``chunks``.

    ``chunks`` maps every chunk the actions name to its module; ``num_chunks`` is ``p * v``;
    ``loss_fn(output, target)`` gives the loss of one micro-batch on the last chunk (a step may
    bring its own: :meth:`run`); ``group`` is the pipeline group (an action's ``peer`` indexes
    it). Parameter gradients accumulate into ``.grad``; the caller zeroes them and steps the
    optimizer.
    """

    def __init__(
        self,
        chunks: dict[int, nn.Module],
        actions: list[Action],
        num_chunks: int,
        loss_fn: LossFn | None,
        group: AxisGroup,
    ) -> None:
        missing = sorted({a.chunk for a in actions} - set(chunks))
        if missing:
            raise ValueError(f"actions name chunks {missing} that this rank does not hold (holds {sorted(chunks)})")
        self.chunks, self.actions, self.num_chunks = chunks, actions, num_chunks
        self.loss_fn, self.group = loss_fn, group
        self.num_microbatches = 1 + max((a.microbatch for a in actions), default=-1)
        self._params = {c: [p for p in m.parameters() if p.requires_grad] for c, m in chunks.items()}
        self._holds_loss = num_chunks - 1 in chunks
        # Transfers never block this runtime, so in a step where no shape header has to cross
        # (every step after the first whose micro-batches' input shapes were seen before) sends go
        # right after the compute that makes their data and receives as early as the pairing
        # order allows (post_early), where the backend lets transfers complete in any order (gloo).
        self._first_plan = _plan(actions)
        self._plan = _plan(post_early(actions)) if p2p_in_any_order(group) else self._first_plan
        self._check_loss_carrier()
        self._dispatch: dict[Kind, Callable[[Action], None]] = {
            Kind.FORWARD: self._forward,
            Kind.BACKWARD: self._backward,
            Kind.BACKWARD_INPUT: self._backward_input,
            Kind.BACKWARD_WEIGHT: self._backward_weight,
        }
        self._shapes = BoundaryShapes(actions)  # activation shapes per boundary and input signature
        self.last_measure: StepMeasure | None = None  # set by run(..., measure=True)
        self._measure: StepMeasure | None = None
        self._reset_step([], [])

    def _check_loss_carrier(self) -> None:
        """The step's loss rides on the gradient of the last micro-batch (see :meth:`_pack_loss`),
        so the last chunk must have run every forward before the backward that makes it."""
        last, final = self.num_chunks - 1, self.num_microbatches - 1
        if not self._holds_loss or last - 1 in self.chunks:
            return
        computes = [a for a in self.actions if a.kind.is_compute]
        carrier = next(
            (
                k
                for k, a in enumerate(computes)
                if a.kind in _MAKES_INPUT_GRAD and (a.chunk, a.microbatch) == (last, final)
            ),
            None,
        )
        forwards = [k for k, a in enumerate(computes) if a.kind is Kind.FORWARD and a.chunk == last]
        if carrier is None or max(forwards, default=-1) > carrier:
            raise ValueError(
                f"the last chunk ({last}) must run all its forwards before the backward of micro-batch "
                f"{final}, whose gradient carries the step's loss to the other stages"
            )

    # ---- one step --------------------------------------------------------------------------

    @property
    def _device(self) -> torch.device:
        """Where this rank's chunks live (read when needed: a deferred model's parameters get
        their device after the stage is built)."""
        return next((p.device for c in self.chunks.values() for p in c.parameters()), torch.device("cpu"))

    def run(
        self,
        inputs: Sequence[Any],
        targets: Sequence[Any],
        *,
        loss_fn: LossFn | None = None,
        measure: bool = False,
    ) -> float:
        """Run one step of ``m`` micro-batches: ``inputs[i]`` feeds chunk 0 (a tensor, or a dict
        of them), ``targets[i]`` the loss of the last chunk, ``loss_fn(output, targets[i])`` (the
        runtime's own when None). The engine gives every rank the inputs: later chunks may read
        them (:func:`~tessera.parallel.pipeline.inputs.current_inputs`), and where the inputs'
        shapes change between micro-batches (a collator's padding, a stream's short last batch)
        both ends of a boundary need them to agree on the activation's shape
        (:func:`~tessera.parallel.pipeline.wire.input_signature`). Where shapes never change, a
        rank may pass empty lists for what it does not read. Returns the sum of the micro-batch
        losses, each divided by ``m`` (the step's mean loss), on every pipeline rank. With
        ``measure``, the ranks first meet at a barrier and the step's :class:`StepMeasure` is left
        in ``last_measure`` (every pipeline rank must pass the same ``measure``)."""
        step_loss = loss_fn if loss_fn is not None else self.loss_fn
        if step_loss is None:
            raise ValueError("the pipeline runtime has no loss function: pass loss_fn= to the runtime or to run()")
        self._reset_step(inputs, targets, step_loss)
        self._measure = stats = StepMeasure() if measure else None
        if stats is not None:
            comm.barrier(self.group)
            start = time.perf_counter()
        known = self._shapes.known(self._signatures)
        for transfers, action in self._plan if known else self._first_plan:
            if transfers:
                if not known:
                    self._shapes.exchange(transfers, self._activation, self.group, self._device, self._signatures)
                self._post(transfers)
            if action is None:
                break
            self._await_inputs(action)
            if stats is None:
                self._dispatch[action.kind](action)
            else:
                began = time.perf_counter()
                self._dispatch[action.kind](action)
                stats.busy_s += time.perf_counter() - began
        while self._sends:
            self._sends.pop().wait()
        if stats is not None:
            stats.step_s = time.perf_counter() - start
            self.last_measure, self._measure = stats, None
        leftover = [name for name, held in self._held().items() if held]
        total = self._loss
        self._reset_step([], [])
        if leftover:
            raise RuntimeError(f"pipeline step ended with state still held: {', '.join(leftover)}")
        if total is None:
            raise RuntimeError("pipeline step ended without the step's loss reaching this rank")
        return float(total)

    def _input_signatures(self, inputs: Sequence[Any]) -> list[Signature]:
        """Each micro-batch's :func:`input_signature`; one for all when this rank has no inputs."""
        if len(inputs) != self.num_microbatches:
            return [None] * self.num_microbatches
        return [input_signature(x) for x in inputs]

    def _reset_step(self, inputs: Sequence[Any], targets: Sequence[Any], loss_fn: LossFn | None = None) -> None:
        self._inputs, self._targets, self._step_loss = inputs, targets, loss_fn
        self._signatures = self._input_signatures(inputs)
        self._saved: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}  # (input, output or loss) of a forward
        # After B: what W needs (chunk 0, which makes no input gradient, keeps output and its grad)
        self._for_weight: dict[Key, WeightWork | tuple[torch.Tensor, torch.Tensor | None]] = {}
        # Received tensors stay Pending until the compute that needs them (_await_inputs).
        self._act_in: dict[Key, torch.Tensor | comm.Pending] = {}  # input activation of (chunk, mb)
        self._grad_in: dict[Key, torch.Tensor | comm.Pending] = {}  # gradient of (chunk, mb)'s output
        self._sends: list[comm.Pending] = []  # sends in flight, waited at the end of the step
        self._grad_out: dict[Key, torch.Tensor] = {}  # gradient of (chunk, mb)'s input, to send
        # The step's loss (float64): summed here on the last chunk's rank, else received (_unpack_loss).
        self._loss: torch.Tensor | None = (
            torch.zeros((), dtype=torch.float64, device=self._device) if self._holds_loss else None
        )

    def _held(self) -> dict[str, int]:
        return {
            "saved activations": len(self._saved),
            "outputs waiting for W": len(self._for_weight),
            "input activations": len(self._act_in),
            "output gradients": len(self._grad_in),
            "input gradients": len(self._grad_out),
            "sends in flight": len(self._sends),
        }

    def _await_inputs(self, action: Action) -> None:
        """Wait for the receive a compute action reads, if it is still in flight: a forward's
        input activation, a backward's output gradient."""
        key = action.chunk, action.microbatch
        if action.kind is Kind.FORWARD:
            act = self._act_in.get(key)
            if isinstance(act, comm.Pending):
                self._act_in[key] = act.wait().requires_grad_(True)
        elif action.kind is not Kind.BACKWARD_WEIGHT:
            grad = self._grad_in.get(key)
            if isinstance(grad, comm.Pending):
                received = grad.wait()
                if self._carries_loss(action):
                    received = self._unpack_loss(received, self._saved[key][1])
                self._grad_in[key] = received

    # ---- compute ---------------------------------------------------------------------------

    def _forward(self, action: Action) -> None:
        c, i = action.chunk, action.microbatch
        x: Any  # chunk 0 takes the micro-batch's inputs as they come (a tensor, a dict of them)
        if c == 0:
            x = self._inputs[i]
        else:
            x = self._act_in.pop((c, i))
            assert isinstance(x, torch.Tensor)  # awaited by _await_inputs
        if self._measure is None:
            out = self._chunk_forward(c, i, x)
        else:
            with SavedBytes(list(self.chunks[c].parameters())) as counter:
                out = self._chunk_forward(c, i, x)
            self._measure.hold((c, i), counter.nbytes)
        if c != self.num_chunks - 1 and c + 1 in self.chunks:  # neighbour on this rank (only with p = 1): no transfer
            self._act_in[(c + 1, i)] = out.detach().requires_grad_(True)
        self._saved[(c, i)] = (x, out)

    def _chunk_forward(self, c: int, i: int, x: Any) -> torch.Tensor:
        with running_inputs(self._inputs[i] if i < len(self._inputs) else MISSING):
            out = self.chunks[c](x)
        if c == self.num_chunks - 1:
            assert self._step_loss is not None  # set by run
            out = self._step_loss(out, self._targets[i]) / self.num_microbatches
            assert self._loss is not None
            self._loss += out.detach()
        return out

    def _backward(self, action: Action) -> None:
        key = action.chunk, action.microbatch
        x, out = self._saved.pop(key)
        grad = self._grad_in.pop(key, None)
        assert not isinstance(grad, comm.Pending)  # awaited by _await_inputs
        torch.autograd.backward(out, grad)
        if self._measure is not None:
            self._measure.release(key)
        if action.chunk > 0:
            self._deliver_input_grad(action, x.grad)

    def _backward_input(self, action: Action) -> None:
        key = action.chunk, action.microbatch
        x, out = self._saved.pop(key)
        grad = self._grad_in.pop(key, None)
        assert not isinstance(grad, comm.Pending)  # awaited by _await_inputs
        if action.chunk > 0:
            x_grad, work = backward_input(out, grad, x, self._params[action.chunk])
            self._deliver_input_grad(action, x_grad)
            self._for_weight[key] = work
        else:  # no input gradient to make: W runs the whole backward
            self._for_weight[key] = (out, grad)

    def _backward_weight(self, action: Action) -> None:
        work = self._for_weight.pop((action.chunk, action.microbatch))
        if isinstance(work, WeightWork):
            backward_weight(work)
        else:
            torch.autograd.backward(*work)
        if self._measure is not None:
            self._measure.release((action.chunk, action.microbatch))

    def _deliver_input_grad(self, action: Action, grad: torch.Tensor | None) -> None:
        if grad is None:
            raise RuntimeError(f"{action}: the chunk's output does not depend on its input")
        c, i = action.chunk, action.microbatch
        if c - 1 in self.chunks:  # neighbour on this rank (only with p = 1): no transfer
            self._grad_in[(c - 1, i)] = grad
        else:
            self._grad_out[(c, i)] = grad

    # ---- transfers -------------------------------------------------------------------------

    def _post(self, transfers: list[Action]) -> None:
        """Post one run of adjacent transfers as one batch, in list order, without waiting: a
        receive is waited for by the compute that reads it, a send at the end of the step."""
        ops = [
            comm.P2POp("send" if a.kind.is_send else "recv", self._transfer_tensor(a), self.group, peer_of(a))
            for a in transfers
        ]
        for action, pending in zip(transfers, comm.batch_p2p(ops, async_op=True), strict=True):
            key = action.chunk, action.microbatch
            if action.kind.is_send:
                self._sends.append(pending)
            elif action.kind is Kind.RECV_ACT:
                self._act_in[key] = pending
            else:
                self._grad_in[key] = pending

    def _activation(self, action: Action) -> torch.Tensor:
        """The output activation a ``SEND_ACT`` sends: its forward's output."""
        return self._saved[(action.chunk, action.microbatch)][1]

    def _transfer_tensor(self, action: Action) -> torch.Tensor:
        """The tensor to send, or a fresh buffer to receive into."""
        key = action.chunk, action.microbatch
        if action.kind is Kind.SEND_ACT:
            return self._activation(action).detach().contiguous()
        if action.kind is Kind.SEND_GRAD:
            grad = self._grad_out.pop(key).contiguous()
            return self._pack_loss(grad) if self._carries_loss(action) else grad
        if action.kind is Kind.RECV_ACT:
            signature = self._signatures[action.microbatch]
            return self._shapes.activation_buffer(action.chunk - 1, signature, self._device)
        output = self._saved[key][1]  # RECV_GRAD: the gradient of an output this rank made
        return gradient_buffer(output, with_loss=self._carries_loss(action), device=self._device)

    # The step's loss is known on the last chunk's rank only. Rather than all-reducing it (a
    # collective that every step would wait for), it rides, as 8 bytes of float64 in front of the
    # gradient, on the gradient of the last micro-batch, which passes every boundary after the
    # last chunk's final forward (checked by _check_loss_carrier).

    def _carries_loss(self, action: Action) -> bool:
        return action.microbatch == self.num_microbatches - 1

    def _pack_loss(self, grad: torch.Tensor) -> torch.Tensor:
        if self._loss is None:
            raise RuntimeError("the step's loss has not reached this rank before the last micro-batch's gradient")
        return pack_loss(self._loss, grad)

    def _unpack_loss(self, message: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """The gradient in ``message`` (shaped like ``output``); keeps the loss it carries."""
        loss, grad = unpack_loss(message, output)
        if not self._holds_loss:
            self._loss = loss
        return grad
