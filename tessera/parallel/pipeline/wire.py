"""The pipeline runtime's wire protocol: what crosses between two pipeline ranks, and the buffers
it lands in. :mod:`~tessera.parallel.pipeline.runtime` decides when a transfer is posted; this
module decides what its bytes are.

- **Activations** go as they are. A receive buffer needs a shape, so the first activation sent
  across a chunk boundary for micro-batches of a new :func:`input_signature` (the shapes and
  dtypes of the micro-batch's inputs, which every pipeline rank is given alike) is preceded by
  a small header (int64 ``[8]``: ndim, dtype code, dims) in a batch of its own, waited at once,
  just before the data batch; both sides cache the shape per boundary and signature
  (:class:`BoundaryShapes`), and micro-batches of a known signature send data only (an
  activation's shape is taken to follow from the shapes of the micro-batch's inputs: data
  collators pad each batch to its own longest row, and a stream's last batch is short). The
  header batch pairs with the partner's header batch exactly as the data batches pair, so it
  adds no new wait to the schedule's order; headers cross only in a step that brings a new
  signature (the first, at least), which walks the list as generated.
- **Gradients** go as they are, into a buffer shaped like the output they are the gradient of,
  which the receiving rank made itself: no header.
- **The step's loss**, known on the last chunk's rank only, rides as 8 bytes of float64 in front
  of the gradient of the last micro-batch (:func:`pack_loss`, :func:`unpack_loss`): that message
  is a flat uint8 buffer of ``8 + gradient bytes``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

from tessera import comm
from tessera.comm.group import AxisGroup
from tessera.parallel.pipeline.actions import Action, Kind

HEADER_SIZE = 8  # ndim, dtype code, up to 6 dims
LOSS_BYTES = 8  # the step's loss, float64, in front of the last micro-batch's gradient
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)

ShapeDtype = tuple[torch.Size, torch.dtype]
Signature = Hashable  # what input_signature returns


def input_signature(inputs: Any) -> Signature:
    """The shapes and dtypes of the tensors in a micro-batch's ``inputs`` (a tensor, or
    mappings, lists and tuples of them, walked in order), with the mapping keys: equal for two
    micro-batches whose activations have the same shapes."""
    if isinstance(inputs, torch.Tensor):
        return (tuple(inputs.shape), inputs.dtype)
    if isinstance(inputs, Mapping):
        return tuple((key, input_signature(value)) for key, value in inputs.items())
    if isinstance(inputs, list | tuple):
        return tuple(input_signature(value) for value in inputs)
    return type(inputs).__name__


def peer_of(action: Action) -> int:
    """The pipeline rank (index in the pipeline group) at the other end of a transfer."""
    if action.peer is None:
        raise ValueError(f"transfer {action} names no peer")
    return action.peer


def encode_header(tensor: torch.Tensor) -> torch.Tensor:
    """The int64 ``[HEADER_SIZE]`` header announcing ``tensor``'s shape and dtype (on the CPU)."""
    if tensor.dim() > HEADER_SIZE - 2:
        raise ValueError(f"pipeline activations may have at most {HEADER_SIZE - 2} dims, got {tuple(tensor.shape)}")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"pipeline activations of dtype {tensor.dtype} are not supported; use one of {DTYPES}")
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[0], header[1] = tensor.dim(), DTYPES.index(tensor.dtype)
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> ShapeDtype:
    """The shape and dtype a header from :func:`encode_header` announces."""
    ndim, code = int(header[0]), int(header[1])
    return torch.Size(int(d) for d in header[2 : 2 + ndim]), DTYPES[code]


class BoundaryShapes:
    """Shape and dtype of the activation crossing each chunk boundary this rank sends or receives
    (a boundary is named by the chunk on its sending side), per input signature of the
    micro-batches (:func:`input_signature`): learned from headers in the step that first brings
    the signature, and kept across steps."""

    def __init__(self, actions: Sequence[Action]) -> None:
        self._inbound = {a.chunk - 1 for a in actions if a.kind is Kind.RECV_ACT}
        self._outbound = {a.chunk for a in actions if a.kind is Kind.SEND_ACT}
        self._announced: set[tuple[int, Signature]] = set()  # (boundary, signature) headers sent
        self._received: dict[tuple[int, Signature], ShapeDtype] = {}  # (boundary, signature) headers received

    def known(self, signatures: Sequence[Signature]) -> bool:
        """Whether every header this rank sends or receives for micro-batches of ``signatures``
        has crossed."""
        return all((b, s) in self._received for b in self._inbound for s in signatures) and all(
            (b, s) in self._announced for b in self._outbound for s in signatures
        )

    def exchange(
        self,
        transfers: Sequence[Action],
        activation: Callable[[Action], torch.Tensor],
        group: AxisGroup,
        device: torch.device,
        signatures: Sequence[Signature],
    ) -> None:
        """Send and receive, as one waited batch in list order, the headers of the boundaries in
        ``transfers`` that have not crossed yet for their micro-batch's signature
        (``signatures[i]`` for micro-batch ``i``). ``activation(action)`` is the tensor a
        ``SEND_ACT`` will send."""
        ops: list[comm.P2POp] = []
        incoming: dict[tuple[int, Signature], torch.Tensor] = {}  # (boundary, signature) -> header buffer
        for action in transfers:
            signature = signatures[action.microbatch]
            if action.kind is Kind.SEND_ACT and (action.chunk, signature) not in self._announced:
                self._announced.add((action.chunk, signature))
                header = encode_header(activation(action)).to(device)
                ops.append(comm.P2POp("send", header, group, peer_of(action)))
            elif action.kind is Kind.RECV_ACT:
                key = (action.chunk - 1, signature)
                if key not in self._received and key not in incoming:
                    incoming[key] = torch.zeros(HEADER_SIZE, dtype=torch.int64, device=device)
                    ops.append(comm.P2POp("recv", incoming[key], group, peer_of(action)))
        comm.batch_p2p(ops)
        for key, header in incoming.items():
            self._received[key] = decode_header(header)

    def activation_buffer(self, boundary: int, signature: Signature, device: torch.device) -> torch.Tensor:
        """A fresh buffer for an activation crossing ``boundary`` for a micro-batch of
        ``signature`` (its header must have crossed)."""
        shape, dtype = self._received[(boundary, signature)]
        return torch.empty(shape, dtype=dtype, device=device)


def gradient_buffer(output: torch.Tensor, *, with_loss: bool, device: torch.device) -> torch.Tensor:
    """A fresh buffer for the gradient of ``output``; with ``with_loss``, for the uint8 message
    of :func:`pack_loss` that carries it."""
    if with_loss:
        return torch.empty(LOSS_BYTES + output.numel() * output.element_size(), dtype=torch.uint8, device=device)
    return torch.empty_like(output, memory_format=torch.contiguous_format)


def pack_loss(loss: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """One uint8 message: the float64 scalar ``loss``, then the bytes of (contiguous) ``grad``."""
    message = torch.empty(LOSS_BYTES + grad.numel() * grad.element_size(), dtype=torch.uint8, device=grad.device)
    message[:LOSS_BYTES].view(torch.float64).copy_(loss.reshape(1))
    message[LOSS_BYTES:].view(grad.dtype).copy_(grad.reshape(-1))
    return message


def unpack_loss(message: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, gradient)`` from a :func:`pack_loss` message carrying the gradient of ``output``:
    views of ``message``, the loss a float64 scalar, the gradient shaped like ``output``."""
    loss = message[:LOSS_BYTES].view(torch.float64)[0]
    return loss, message[LOSS_BYTES:].view(output.dtype).view(output.shape)
